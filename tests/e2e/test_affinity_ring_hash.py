"""Affinity through a real Envoy, the official ``openai`` SDK as the client.

The llama model balances with ``ring_hash``: ext_proc sets ``x-inferlb-prefix`` (the conversation's
opening) and ``x-inferlb-session`` (the ``user``), the routes hash on them, so every turn of one
conversation lands on one GPU while different conversations spread; the canary version is chosen per
user, sticky, and the 90/10 split holds over many users.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from inferlb.request.headers import ENDPOINT
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, in_mode, started_stack

pytestmark = pytest.mark.e2e

LLAMA = "llama-3.1-8b-instruct"


@pytest.fixture(scope="module")
def ring_hash_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("affinity")
    doc = in_mode(make_config_doc(), request_path)
    llama = next(m for m in doc["models"] if m["name"] == LLAMA)
    llama["cluster"] = {"lb_policy": "ring_hash", "hash_balance_factor": 150}
    with started_stack(work, doc) as rs:
        yield rs


def version_of(rs: RunningStack) -> dict[str, str]:
    return {e.display_name: rs.config.endpoint_version(e) for e in rs.config.endpoints if e.model == LLAMA}


def test_turns_of_a_conversation_stay_on_one_gpu_and_conversations_spread(
    ring_hash_stack: RunningStack,
) -> None:
    rs = ring_hash_stack
    gpus_of: dict[int, set[str]] = {}
    with openai.OpenAI(base_url=f"http://{rs.gateway}/v1", api_key="sk-demo-a", max_retries=0) as c:
        for conv in range(24):
            messages: list[Any] = [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"conversation {conv}: tell me about topic {conv * 7}"},
            ]
            for turn in range(4):
                raw = c.chat.completions.with_raw_response.create(
                    model=LLAMA, messages=messages, max_tokens=3, user=f"user-{conv}"
                )
                gpus_of.setdefault(conv, set()).add(raw.headers[ENDPOINT])
                answer = raw.parse().choices[0].message.content or ""
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"and turn {turn + 1}?"},
                ]
    assert all(len(g) == 1 for g in gpus_of.values()), gpus_of
    used = Counter(next(iter(g)) for g in gpus_of.values())
    # 24 conversations over the v1 GPUs (and the v2 canary for its users): not all on one
    assert len(used) >= 3, used


def test_canary_version_is_sticky_per_user_and_the_split_holds(ring_hash_stack: RunningStack) -> None:
    rs = ring_hash_stack
    versions = version_of(rs)
    users = 600

    async def run() -> dict[str, set[str]]:
        seen: dict[str, set[str]] = {}
        sem = asyncio.Semaphore(32)
        async with openai.AsyncOpenAI(
            base_url=f"http://{rs.gateway}/v1", api_key="sk-demo-a", max_retries=0, timeout=30
        ) as c:

            async def one(user: str, i: int) -> None:
                async with sem:
                    raw = await c.chat.completions.with_raw_response.create(
                        model=LLAMA,
                        messages=[{"role": "user", "content": f"question {i} from {user}"}],
                        max_tokens=1,
                        user=user,
                    )
                seen.setdefault(user, set()).add(versions[raw.headers[ENDPOINT]])

            jobs = [one(f"canary-user-{u}", i) for u in range(users) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*jobs), 120)
        return seen

    seen = asyncio.run(run())
    assert len(seen) == users
    assert all(len(v) == 1 for v in seen.values())  # sticky: each user always gets one version
    v2 = sum(1 for v in seen.values() if v == {"v2"})
    # 600 users at 10%: the standard deviation is 1.2 points, 4 points is > 3 sigma
    assert abs(v2 / users - 0.10) <= 0.04, v2
