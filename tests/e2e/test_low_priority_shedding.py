"""``priority: low`` is shed before ``default`` (and ``high``) through a real Envoy and the simulated fleet.

The qwen pool gets a DEFAULT circuit breaker of 4 requests (connections and pending requests left ample, so
``max_requests`` is the bound) and the default ``low_priority_max_requests_percent`` (50: low is refused
once 2 DEFAULT-priority requests are in flight). A bounded closed loop saturates it with 2 ``default``
workers and 4 ``low`` ones (6 > 4: Envoy's breaker alone would shed both alike, as it did before low had a
mechanism of its own), while one ``high`` worker sends short requests. Low is refused with 503
``overloaded`` and ``retry-after``, with the same response headers in both request-path modes (in ext_authz
mode the 5xx is restored from a 403 by a local-reply mapper, and the status it carried stays in Envoy);
every default and high request is served.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import RunningStack, in_mode, saturable_doc, started_stack

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
#: DEFAULT-priority budget of the qwen cluster: 4 requests at once.
DEFAULT_BUDGET = {"max_connections": 64, "max_pending_requests": 64, "max_requests": 4, "max_retries": 4}
RETRY_AFTER_S = 2
DEFAULT_KEY, LOW_KEY, HIGH_KEY = "sk-demo-d", "sk-demo-b", "sk-demo-a"
#: The load loop's bounds: seconds, and requests per worker.
DURATION_S = 6.0
MAX_PER_WORKER = 200

Result = tuple[int, str | None, str | None]
#: The response headers of a shed request, in both modes (ext_proc's immediate response as Envoy sends it).
SHED_HEADERS = frozenset({"content-type", "content-length", "retry-after", "date", "server"})


@pytest.fixture(scope="module")
def saturated_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    # the gateway counts each request until its response ends: ext_proc from its stream, ext_authz from
    # the access-log entry that settles it (up to meter_flush_interval_ms late)
    work = tmp_path_factory.mktemp("low-priority")
    doc = in_mode(saturable_doc(QWEN, DEFAULT_BUDGET, RETRY_AFTER_S), request_path)
    # a default-priority tenant without limits (the demo's team-c has a tiny token quota)
    doc["tenants"].append({"name": "team-d", "api_keys": [DEFAULT_KEY], "priority": "default"})
    # the default flush (the fast test config's is shorter): how long an ext_authz-mode request stays
    # counted after its response is part of the saturation this module measures
    doc["ext_proc"]["meter_flush_interval_ms"] = 1_000
    with started_stack(work, doc) as rs:
        yield rs


async def _one(c: openai.AsyncOpenAI, i: int, *, stream: bool, max_tokens: int) -> Result:
    """One request: (status, retry-after, error code); a refusal whose header names are not
    :data:`SHED_HEADERS` is its status with the names instead of the code."""
    try:
        if stream:
            chunks = await c.chat.completions.create(
                model=QWEN,
                messages=[{"role": "user", "content": f"r{i}"}],
                max_tokens=max_tokens,
                stream=True,
            )
            async for _ in chunks:
                pass
        else:
            resp = await c.chat.completions.create(
                model=QWEN, messages=[{"role": "user", "content": f"r{i}"}], max_tokens=max_tokens
            )
            assert resp.usage is not None and resp.usage.completion_tokens == max_tokens
        return 200, None, None
    except openai.APIStatusError as err:
        body = err.body if isinstance(err.body, dict) else {}
        names = frozenset(k.lower() for k in err.response.headers)
        if err.status_code == 503 and names != SHED_HEADERS:
            return err.status_code, None, f"headers {sorted(names)}"
        return err.status_code, err.response.headers.get("retry-after"), body.get("code")


async def _worker(
    c: openai.AsyncOpenAI, deadline: float, out: list[Result], *, stream: bool, tokens: int
) -> None:
    """A closed loop, bounded by ``deadline`` and :data:`MAX_PER_WORKER`; a refusal waits 50 ms."""
    for i in range(MAX_PER_WORKER):
        if time.monotonic() >= deadline:
            return
        result = await _one(c, i, stream=stream, max_tokens=tokens)
        out.append(result)
        if result[0] != 200:
            await asyncio.sleep(0.05)
        elif not stream:
            await asyncio.sleep(0.1)


def test_low_is_shed_while_default_and_high_are_served(saturated_stack: RunningStack) -> None:
    base = f"http://{saturated_stack.gateway}/v1"
    results: dict[str, list[Result]] = {"default": [], "low": [], "high": []}

    async def run() -> None:
        async with (
            openai.AsyncOpenAI(base_url=base, api_key=DEFAULT_KEY, max_retries=0, timeout=30) as default,
            openai.AsyncOpenAI(base_url=base, api_key=LOW_KEY, max_retries=0, timeout=30) as low,
            openai.AsyncOpenAI(base_url=base, api_key=HIGH_KEY, max_retries=0, timeout=30) as high,
        ):
            deadline = time.monotonic() + DURATION_S
            workers = [
                *(_worker(default, deadline, results["default"], stream=True, tokens=150) for _ in range(2)),
                *(_worker(low, deadline, results["low"], stream=True, tokens=150) for _ in range(4)),
                _worker(high, deadline, results["high"], stream=False, tokens=5),
            ]
            await asyncio.wait_for(asyncio.gather(*workers), DURATION_S + 30)

    asyncio.run(run())
    table = {p: Counter(status for status, _, _ in rs) for p, rs in results.items()}
    print(f"\nrequests by priority and status over {DURATION_S:.0f} s: {table}")
    assert results["default"] and all(r[0] == 200 for r in results["default"]), table
    assert results["high"] and all(r[0] == 200 for r in results["high"]), table
    shed = [r for r in results["low"] if r[0] != 200]
    assert len(shed) >= 10, table
    assert all(r == (503, str(RETRY_AFTER_S), "overloaded") for r in shed), Counter(shed)
