"""Low-priority shedding in ext_authz mode, in-process with the settler over real gRPC (Envoy's access-log
protos): a ``default`` or ``low`` check counts in its cluster's in-flight number from admission until its
access-log entry settles it (or the TTL does, for an entry that never comes); ``low`` checks are refused
503 ``overloaded`` with ``retry-after`` (as 403 + ``x-inferlb-status``) once the count reaches the limit,
``default`` and ``high`` ones never are; refusals hold nothing; without ``account_responses`` nothing is
counted or shed. Each case runs on the synchronous check and on the awaited one (a body counted in a worker
thread)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from ext_authz.meter import Meter
from ext_proc.access_log import serve_access_log
from ext_proc.state import ExtProcState
from inferlb.config.schema import parse_config
from inferlb.policy.settlement import MeterEntry
from inferlb.request import headers as h
from tests.integration.test_ext_authz_meter import Clock, log_entry, send
from tests.integration.test_ext_proc_low_priority import CLUSTER, HIGH, LOW, PLAIN, TINY
from tests.integration.test_ext_proc_low_priority import CONFIG as EXT_PROC_CONFIG

CONFIG: dict[str, Any] = {
    **EXT_PROC_CONFIG,  # limit: 50% of 4 = 2 DEFAULT-priority requests in flight before low is refused
    "ext_proc": {"protocol": "ext_authz", "lease_ttl_ms": 2_000},
    "gateway": {"overflow_retry_after_s": 2, "request_timeout_ms": 1_000},
}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}

Settler = tuple[CheckService, Meter, Clock, als_pb2_grpc.AccessLogServiceStub]


@pytest.fixture(params=["sync", "awaited"])
async def settler(request: pytest.FixtureRequest) -> AsyncIterator[Settler]:
    """The check service and its settler; ``awaited``: every body is counted in a worker thread, so each
    check is the future path (as with Redis or a big body)."""
    clock = Clock()
    state = ExtProcState(parse_config(CONFIG), clock=clock)
    meter = Meter(state, clock=clock)
    server, port = await serve_access_log("127.0.0.1", 0, meter.on_entries)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    offload = 1 if request.param == "awaited" else 1 << 30
    try:
        service = CheckService(state, meter=meter, offload_body_bytes=offload)
        yield service, meter, clock, als_pb2_grpc.AccessLogServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
        await meter.aclose()


async def check(service: CheckService, key: str, model: str = "llama") -> CheckAnswer:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    out = service.check(
        CheckRequest(
            method="POST",
            path="/v1/chat/completions",
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
            body=body,
        )
    )
    return out if isinstance(out, CheckAnswer) else await asyncio.wait_for(out, 10)


def shed(answer: CheckAnswer) -> bool:
    """Whether ``answer`` is the low-priority refusal (asserting its shape); False for an admission."""
    hdrs = dict(answer.headers)
    if answer.status == 200:
        return False
    assert answer.status == 403, answer
    assert hdrs[h.STATUS] == "503" and hdrs["retry-after"] == "2"
    assert json.loads(answer.body)["error"]["code"] == "overloaded"
    return True


def shed_count(service: CheckService) -> float:
    value = service.state.metrics.registry.get_sample_value(
        "inferlb_low_priority_shed_total", {"tenant": "low", "model": "llama"}
    )
    return value or 0.0


async def test_low_is_refused_at_the_limit_until_an_entry_settles_one(settler: Settler) -> None:
    service, meter, _, stub = settler
    state = service.state
    first = await check(service, PLAIN)
    assert not shed(first)
    assert not shed(await check(service, LOW))
    assert state.in_flight.get(CLUSTER) == 2
    # at the limit: low is refused, default and high go on (high is not counted)
    assert shed(await check(service, LOW))
    assert not shed(await check(service, PLAIN))
    assert not shed(await check(service, HIGH))
    assert state.in_flight.get(CLUSTER) == 3
    assert shed_count(service) == 1
    # the first request's entry arrives: one fewer in flight, still at the limit
    await send(stub, [log_entry(dict(first.headers)[h.METER], 200, USAGE)])
    assert state.in_flight.get(CLUSTER) == 2
    assert shed(await check(service, LOW))
    assert meter.ledger.pending == 3  # high is metered too, just not counted


async def test_every_settlement_leaves_the_count_once(settler: Settler) -> None:
    service, meter, clock, stub = settler
    state = service.state
    ids = [dict((await check(service, key)).headers)[h.METER] for key in (PLAIN, LOW)]
    assert state.in_flight.get(CLUSTER) == 2
    # a non-2xx answer without usage, then the same entry again: one leave
    await send(stub, [log_entry(ids[0], 503, None)], [log_entry(ids[0], 503, None)])
    assert state.in_flight.get(CLUSTER) == 1
    # the other entry is lost: the TTL settles it and frees the count
    clock.now += meter.ledger.ttl_s
    assert await meter.sweep() == 1
    assert state.in_flight.get(CLUSTER) == 0
    await send(stub, [log_entry(ids[1], 200, USAGE)])  # late: nothing more
    assert state.in_flight.get(CLUSTER) == 0
    assert not shed(await check(service, LOW))


async def test_refusals_hold_nothing(settler: Settler) -> None:
    service, _, _, _ = settler
    state = service.state
    assert not shed(await check(service, TINY))
    quota = await check(service, TINY)  # over its requests per minute
    assert quota.status == 429
    assert (await check(service, PLAIN, model="no-such-model")).status == 404
    assert state.in_flight.get(CLUSTER) == 1  # only the admitted one


async def test_without_response_accounting_nothing_is_counted_or_shed() -> None:
    doc = json.loads(json.dumps(CONFIG))
    doc["ext_proc"]["account_responses"] = False
    state = ExtProcState(parse_config(doc))
    assert state.gateway.low_priority_limits == {}
    service = CheckService(state)
    for _ in range(5):
        answer = await check(service, LOW)
        assert answer.status == 200 and h.METER not in dict(answer.headers)
    assert state.in_flight.get(CLUSTER) == 0
    assert shed_count(service) == 0


#: One step of :func:`test_the_count_is_always_the_counted_reservations_waiting`: a check by a tenant's key,
#: the entry of the ``i``-th reservation still waiting (``i`` modulo how many), or the clock past the TTL.
Step = tuple[str, int]
STEPS = st.one_of(
    st.tuples(st.just("check"), st.sampled_from([0, 1, 2])),
    st.tuples(st.just("entry"), st.integers(0, 20)),
    st.tuples(st.just("expire"), st.just(0)),
)


@given(st.lists(STEPS, max_size=40))
@settings(max_examples=60, deadline=None)
def test_the_count_is_always_the_counted_reservations_waiting(steps: list[Step]) -> None:
    """Whatever the order of checks, entries and expiries: the in-flight count equals the ``default`` and
    ``low`` reservations still waiting for their entry, ``low`` is admitted only below the limit (2) and
    refused only at it, and ``default`` and ``high`` are never refused."""

    async def run() -> None:
        clock = Clock()
        state = ExtProcState(parse_config(CONFIG), clock=clock)
        meter = Meter(state, clock=clock)
        service = CheckService(state, meter=meter)
        waiting: list[tuple[str, bool]] = []  # (meter id, counted)
        for kind, arg in steps:
            if kind == "check":
                key = (PLAIN, LOW, HIGH)[arg]
                before = state.in_flight.get(CLUSTER)
                answer = await check(service, key)
                if shed(answer):
                    assert key == LOW and before >= 2
                    continue
                assert key != LOW or before < 2
                waiting.append((dict(answer.headers)[h.METER], key != HIGH))
            elif kind == "entry" and waiting:
                meter_id, _ = waiting.pop(arg % len(waiting))
                await meter.on_entries([MeterEntry(meter_id=meter_id, status=200, usage=(1, 1))])
            elif kind == "expire":
                clock.now += meter.ledger.ttl_s
                assert await meter.sweep() == len(waiting)
                waiting.clear()
            assert state.in_flight.get(CLUSTER) == sum(counted for _, counted in waiting)

    asyncio.run(run())
