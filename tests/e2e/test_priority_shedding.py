"""Priority and shedding through a real Envoy, the official ``openai`` SDK as the client.

A high-priority tenant's requests ride Envoy's HIGH routing priority, which has its own circuit-breaker
budget on every model cluster. The qwen pool here gets a tiny DEFAULT budget: saturating it with
low-priority streams sheds the overflow as a 503 ``overloaded`` OpenAI JSON error with ``retry-after``
(from ext_proc past the low-priority share of the budget, from Envoy, response flag UO, past the budget),
while high-priority requests sent at the same time are all served. Low against default:
tests/e2e/test_low_priority_shedding.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import RunningStack, in_mode, saturable_doc, started_stack

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
#: The DEFAULT-priority budget of the qwen cluster: two requests in flight, one waiting.
DEFAULT_BUDGET = {"max_connections": 2, "max_pending_requests": 1, "max_requests": 2, "max_retries": 1}
RETRY_AFTER_S = 2


@pytest.fixture(scope="module")
def small_pool_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("priority")
    doc = in_mode(saturable_doc(QWEN, DEFAULT_BUDGET, RETRY_AFTER_S), request_path)
    with started_stack(work, doc) as rs:
        yield rs


async def _low(c: openai.AsyncOpenAI, i: int) -> tuple[int, str | None, str | None]:
    """One long low-priority stream: (status, retry-after, error code)."""
    try:
        stream = await c.chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": f"low priority {i}"}],
            max_tokens=300,
            stream=True,
        )
        async for _ in stream:
            pass
        return 200, None, None
    except openai.APIStatusError as err:
        body = err.body if isinstance(err.body, dict) else {}
        return err.status_code, err.response.headers.get("retry-after"), body.get("code")


async def _high(c: openai.AsyncOpenAI, i: int) -> int:
    resp = await c.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": f"high priority {i}"}], max_tokens=5
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 5
    return 200


def test_saturated_default_budget_sheds_low_priority_and_serves_high(small_pool_stack: RunningStack) -> None:
    rs = small_pool_stack
    base = f"http://{rs.gateway}/v1"

    async def run() -> tuple[list[tuple[int, str | None, str | None]], list[int]]:
        async with (
            openai.AsyncOpenAI(base_url=base, api_key="sk-demo-b", max_retries=0, timeout=30) as low,
            openai.AsyncOpenAI(base_url=base, api_key="sk-demo-a", max_retries=0, timeout=30) as high,
        ):
            lows = [asyncio.create_task(_low(low, i)) for i in range(12)]
            await asyncio.sleep(0.2)  # the low streams now hold the DEFAULT budget
            highs = await asyncio.wait_for(asyncio.gather(*(_high(high, i) for i in range(8))), 30)
            return list(await asyncio.wait_for(asyncio.gather(*lows), 30)), list(highs)

    lows, highs = asyncio.run(run())
    assert highs == [200] * 8
    served = [x for x in lows if x[0] == 200]
    shed = [x for x in lows if x[0] != 200]
    # at most max_requests + max_pending_requests low-priority requests get in at once
    assert DEFAULT_BUDGET["max_requests"] + DEFAULT_BUDGET["max_pending_requests"] >= len(served) >= 1
    assert shed and all(x == (503, str(RETRY_AFTER_S), "overloaded") for x in shed), shed
