"""Fair waiting under saturation through a real Envoy 1.40, in both request-path modes
(``models[].endpoint_picking.queue``, :class:`ext_proc.picking.PickQueue`).

One stack per mode: qwen (one H100, two V100s) picks endpoints with at most one request in flight per
endpoint from the request path, so three requests saturate it and the rest wait in its fair queue; a
heavy tenant (256-token completions) and a light one (32-token completions) of one band, both kept
backlogged by closed-loop clients, are admitted by equal tokens (the served prompt + completion tokens
within 10% of each other), and no request of either is refused. A second model, ``fairq-one``, has one
V100 and a 300 ms queue: while a long completion holds it, the next request waits 300 ms and gets 429
``queue_timeout`` with ``retry-after`` in OpenAI's JSON shape.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest

from inferlb.ops.stack import free_ports
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, in_mode, started_stack

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
ONE = "fairq-one"
#: tenant -> (API key, completion tokens per request, closed-loop clients): more clients than the three
#: slots, the light tenant most (each of its requests is short: fewer clients would leave gaps in its
#: backlog, which the heavy one would fill), so both tenants always have requests waiting.
TENANTS = {"heavy": ("sk-fairq-heavy", 256, 4), "light": ("sk-fairq-light", 32, 12)}
#: Seconds of load, and the middle window whose completions count (the first and last second left out,
#: while the loops ramp up and drain).
LOAD_S = 8.0
WINDOW = (1.5, 6.5)


@pytest.fixture(scope="module")
def queue_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(make_config_doc(), request_path)
    # a V100 sequence decodes 2,000 tokens/s (an H100 3.4x that): a 256-token completion holds its slot
    # 40-130 ms, a 32-token one 5-16 ms, a 4,000-token one 2 s on the V100
    doc["simulation"]["decode_tokens_per_s"] = 2_000
    # ext_authz mode frees a slot at the access log's flush: every 50 ms, so the heavy tenant's fair share
    # (about one admission in seven) keeps each of its requests within the 2 s queue time
    doc["ext_proc"]["meter_flush_interval_ms"] = 50
    qwen = next(m for m in doc["models"] if m["name"] == QWEN)
    qwen["endpoint_picking"] = {
        "mode": "load",
        "queue": {"max_queued": 256, "max_wait_ms": 2_000, "max_in_flight": 1},
    }
    doc["models"].append(
        {
            "name": ONE,
            "endpoint_picking": {
                "mode": "load",
                "queue": {"max_queued": 8, "max_wait_ms": 300, "max_in_flight": 1},
            },
        }
    )
    [port] = free_ports(1)
    doc["endpoints"].append(
        {"name": "fairq-v100", "address": f"127.0.0.1:{port}", "model": ONE, "gpu": "V100", "simulated": True}
    )
    doc["tenants"] += [{"name": f"fairq-{t}", "api_keys": [key]} for t, (key, _, _) in TENANTS.items()]
    with started_stack(tmp_path_factory.mktemp("queue"), doc) as rs:
        yield rs


def _body(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}


async def _tenant_load(gateway: str, tenant: str, started: float) -> list[tuple[float, int, int]]:
    """One tenant's closed loop: (seconds since ``started`` at completion, status, prompt + completion
    tokens) per request; bounded by :data:`LOAD_S` and 5,000 requests."""
    key, max_tokens, clients = TENANTS[tenant]
    out: list[tuple[float, int, int]] = []
    url = f"http://{gateway}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=10)

    async def client(http: aiohttp.ClientSession) -> None:
        while time.monotonic() - started < LOAD_S and len(out) < 5_000:
            async with http.post(
                url, json=_body(QWEN, max_tokens), headers={"Authorization": f"Bearer {key}"}, timeout=timeout
            ) as r:
                data = await r.read()
                tokens = 0
                if r.status == 200:
                    usage = json.loads(data)["usage"]
                    tokens = usage["prompt_tokens"] + usage["completion_tokens"]
                out.append((time.monotonic() - started, r.status, tokens))

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return out


def _wait_until_ready(rs: RunningStack) -> None:
    # the request path picks only once it has the xDS server's endpoint state (a poll after start-up)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if all(rs.chat(m, "sk-fairq-light").status == 200 for m in (QWEN, ONE)):
            return
        time.sleep(0.2)
    raise AssertionError("the stack never served both models")


def test_two_backlogged_tenants_of_one_band_get_equal_token_throughput(queue_stack: RunningStack) -> None:
    rs = queue_stack
    _wait_until_ready(rs)

    async def both() -> dict[str, list[tuple[float, int, int]]]:
        started = time.monotonic()
        heavy, light = await asyncio.gather(
            _tenant_load(rs.gateway, "heavy", started), _tenant_load(rs.gateway, "light", started)
        )
        return {"heavy": heavy, "light": light}

    got = asyncio.run(both())
    statuses = {t: Counter(s for _, s, _ in rows) for t, rows in got.items()}
    # waiting, not refusing: every request of both tenants was served
    assert all(set(c) == {200} for c in statuses.values()), statuses
    tokens = {t: sum(n for at, _, n in rows if WINDOW[0] <= at < WINDOW[1]) for t, rows in got.items()}
    served = {t: sum(1 for at, _, _ in rows if WINDOW[0] <= at < WINDOW[1]) for t, rows in got.items()}
    print(f"tokens in the window: {tokens}, requests: {served}")
    assert min(tokens.values()) > 0, tokens
    # equal tokens, so the heavy tenant is served several times fewer requests
    assert abs(tokens["heavy"] - tokens["light"]) <= 0.1 * max(tokens.values()), (tokens, served)
    assert served["light"] > 3 * served["heavy"], served


def test_a_queue_timeout_is_429_with_retry_after(queue_stack: RunningStack) -> None:
    rs = queue_stack
    _wait_until_ready(rs)
    with ThreadPoolExecutor(1) as pool:
        # a 4,000-token completion holds fairq-one's only endpoint for ~2 s
        long = pool.submit(rs.chat, ONE, "sk-fairq-heavy", max_tokens=4_000)
        time.sleep(0.3)
        t0 = time.monotonic()
        reply = rs.chat(ONE, "sk-fairq-light", max_tokens=4)
        waited = time.monotonic() - t0
        assert long.result(timeout=30).status == 200
    assert reply.status == 429, (reply.status, reply.body)
    assert int(reply.headers["retry-after"]) >= 1
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "rate_limit_error", error
    assert waited >= 0.25, waited  # it waited its max_wait_ms, not refused at once
