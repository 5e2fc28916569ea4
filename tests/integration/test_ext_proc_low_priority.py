"""Low-priority shedding over the real grpc ext_proc servicer: ``default`` and ``low`` requests count in
their cluster's in-flight number from admission to the response's end (however the stream ends), ``low``
ones are refused 503 ``overloaded`` with ``retry-after`` once it reaches the limit, ``default`` and
``high`` ones never are, and a quota refusal holds nothing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc

from tests.integration.test_ext_proc_accounting import chat, req_body, req_headers, resp_body, resp_headers
from tests.integration.test_ext_proc_stream_ends import JSON_USAGE, Client, serving

HIGH, PLAIN, LOW, TINY = "sk-high-0001", "sk-plain-001", "sk-low-00001", "sk-tiny-0001"
CLUSTER = "llama--v1"
CONFIG: dict[str, Any] = {
    # ext_proc mode sheds low by in-flight count
    "ext_proc": {"protocol": "ext_proc", "account_responses": True},
    "gateway": {"overflow_retry_after_s": 2},
    # limit: 50% of 4 = 2 DEFAULT-priority requests in flight before low is refused
    "models": [
        {
            "name": "llama",
            "default_max_tokens": 10,
            "cluster": {"circuit_breaker_default": {"max_requests": 4}},
        }
    ],
    "tenants": [
        {"name": "high", "api_keys": [HIGH], "priority": "high"},
        {"name": "plain", "api_keys": [PLAIN]},
        {"name": "low", "api_keys": [LOW], "priority": "low"},
        {"name": "tiny", "api_keys": [TINY], "priority": "low", "requests_per_minute": 1},
    ],
}


async def start(c: Client, key: str) -> tuple[Any, Any]:
    """Headers and body of one request: (the call, the body phase's answer)."""
    call = c.stub.Process()
    await c.send(call, req_headers(key))
    return call, await c.send(call, req_body(chat()))


def shed(resp: Any) -> bool:
    if not resp.HasField("immediate_response"):
        assert resp.HasField("request_body"), resp
        return False
    imm = resp.immediate_response
    assert imm.status.code == 503, imm
    hdrs = {o.header.key: o.header.raw_value.decode() or o.header.value for o in imm.headers.set_headers}
    assert hdrs["retry-after"] == "2"
    assert json.loads(imm.body)["error"]["code"] == "overloaded"
    return True


async def in_flight_is(c: Client, n: int) -> None:
    await c.servicer.drain()
    for _ in range(250):
        if c.state.in_flight.get(CLUSTER) == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"in flight {c.state.in_flight.get(CLUSTER)}, expected {n}")


async def test_low_is_refused_at_the_limit_default_and_high_are_not() -> None:
    async with serving(CONFIG) as c:
        d1, r = await start(c, PLAIN)
        assert not shed(r)
        low1, r = await start(c, LOW)
        assert not shed(r)  # 1 in flight < 2
        await in_flight_is(c, 2)
        _, r = await start(c, LOW)
        assert shed(r)
        # default past the low limit: Envoy's breaker decides, not ext_proc; high is not counted
        d2, r = await start(c, PLAIN)
        assert not shed(r)
        h1, r = await start(c, HIGH)
        assert not shed(r)
        await in_flight_is(c, 3)
        assert c.state.metrics.low_priority_shed.labels("low", "llama")._value.get() == 1
        # ends: a normal response end, a non-2xx answer, a cancelled stream: each leaves the count once
        await c.send(d1, resp_headers(200, "application/json"))
        await c.send(d1, resp_body(JSON_USAGE, eos=True))
        await in_flight_is(c, 2)
        _, r = await start(c, LOW)
        assert shed(r)
        await c.send(low1, resp_headers(503, "application/json"))
        await in_flight_is(c, 1)
        low2, r = await start(c, LOW)
        assert not shed(r)
        await in_flight_is(c, 2)
        for call in (low2, d2, h1):
            call.cancel()
        await in_flight_is(c, 0)
        assert c.state.in_flight.snapshot() == {}
        d1.cancel()
        low1.cancel()


async def test_a_quota_refusal_and_an_eof_hold_nothing() -> None:
    async with serving(CONFIG) as c:
        call, r = await start(c, TINY)
        assert not shed(r)
        await in_flight_is(c, 1)
        refused, r = await start(c, TINY)  # over requests_per_minute: 429, not counted
        assert r.immediate_response.status.code == 429
        await in_flight_is(c, 1)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        await in_flight_is(c, 0)
        refused.cancel()


async def test_without_response_accounting_nothing_is_counted_or_shed() -> None:
    cfg = {**CONFIG, "ext_proc": {"protocol": "ext_proc", "account_responses": False}}
    async with serving(cfg) as c:
        calls = []
        for _ in range(5):
            call, r = await start(c, LOW)
            assert not shed(r)
            calls.append(call)
        assert c.state.in_flight.snapshot() == {}
        for call in calls:
            call.cancel()
