"""Fair waiting on the request path, in-process (:class:`ext_proc.picking.PickQueue` behind the real
ext_authz check and the real ext_proc stream): with ``endpoint_picking.queue`` on and every endpoint at
``max_in_flight``, a check waits instead of an immediate answer and is picked once a request ends; a
higher band goes first; two backlogged tenants of one band are admitted by equal tokens whatever their
request sizes (Hypothesis over the sizes); a full queue and a queue timeout are 429s with ``retry-after``
in OpenAI's shape; a stream that ends while it waits leaves the queue."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.accesslog.v3 import als_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from ext_authz.meter import Meter
from ext_proc import handlers
from ext_proc.picking import picker_weights
from ext_proc.state import ExtProcState
from inferlb.config.schema import parse_config
from inferlb.errors import ConfigError
from inferlb.policy.columnar import COLUMNAR_MIN_ENDPOINTS
from inferlb.policy.endpoint_book import BookedEndpoint, BookedState
from inferlb.policy.picker import pick
from inferlb.request import headers as h
from tests.conftest import make_config_doc
from tests.integration.test_endpoint_picking_path import checking
from tests.integration.test_ext_authz_meter import Clock, log_entry, send
from tests.integration.test_ext_proc_accounting import chat, req_body, req_headers
from tests.integration.test_ext_proc_stream_ends import finish_response, serving

CLUSTER = "llama--v1"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
KEYS = {"heavy": "sk-heavy-0001", "light": "sk-light-0001", "vip": "sk-vip-00001"}


def _doc(protocol: str = "ext_authz", **queue: Any) -> dict[str, Any]:
    return {
        "ext_proc": {"protocol": protocol, "account_responses": True},
        "models": [
            {
                "name": "llama",
                "default_max_tokens": 10,
                "endpoint_picking": {
                    "mode": "load",
                    "queue": {"max_queued": 64, "max_wait_ms": 2_000, "max_in_flight": 1, **queue},
                },
            }
        ],
        "tenants": [
            {"name": "heavy", "api_keys": [KEYS["heavy"]]},
            {"name": "light", "api_keys": [KEYS["light"]]},
            {"name": "vip", "api_keys": [KEYS["vip"]], "priority": "high"},
        ],
    }


def _book_state(*addresses: str) -> BookedState:
    rows = tuple(
        BookedEndpoint(address=a, weight=10, healthy=True, waiting=0, telemetry_age_ms=0) for a in addresses
    )
    return BookedState(clusters={CLUSTER: rows}, stale_after_ms=600_000)


def _request(tenant: str, max_tokens: int = 10) -> CheckRequest:
    body = {"model": "llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    return CheckRequest(
        method="POST",
        path="/v1/chat/completions",
        headers={"authorization": f"Bearer {KEYS[tenant]}", "content-type": "application/json"},
        body=json.dumps(body).encode(),
    )


@pytest.fixture
async def authz() -> AsyncIterator[tuple[CheckService, als_pb2_grpc.AccessLogServiceStub]]:
    async with checking(_doc()) as out:
        out[0].state.picking.book.update(_book_state(A), time.monotonic())
        yield out


def _now(service: CheckService, request: CheckRequest) -> CheckAnswer:
    out = service.check(request)
    assert isinstance(out, CheckAnswer), "expected an answer at once, the check waits"
    return out


def _waits(service: CheckService, request: CheckRequest) -> asyncio.Future[CheckAnswer]:
    out = service.check(request)
    assert isinstance(out, asyncio.Future), f"expected the check to wait, got {out}"
    return out


async def _settle(fut: asyncio.Future[CheckAnswer]) -> CheckAnswer:
    await asyncio.sleep(0)  # the admitted waiter's quota admission runs on the loop
    return await asyncio.wait_for(fut, 5)


def test_the_queue_is_off_by_default_and_its_bounds_are_checked_naming_the_field() -> None:
    doc = make_config_doc()
    config = parse_config(doc)
    assert all(not m.endpoint_picking.queue.enabled for m in config.models)
    bad = _doc(max_wait_ms=3_000)  # message_timeout_ms 5000: more than half
    with pytest.raises(ConfigError) as err:
        parse_config(bad)
    assert "models[0].endpoint_picking.queue.max_wait_ms" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config(_doc(max_in_flight=0))
    assert "max_in_flight" in str(err.value)


async def test_a_saturated_endpoint_makes_the_check_wait_until_a_request_ends(
    authz: tuple[CheckService, als_pb2_grpc.AccessLogServiceStub],
) -> None:
    service, stub = authz
    first = _now(service, _request("heavy"))
    assert first.status == 200 and dict(first.headers)[h.DESTINATION_ENDPOINT] == A
    waiting = _waits(service, _request("light"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    # the first request's access-log entry settles it: A has room, the waiter is picked to A
    meter_id = dict(first.headers)[h.METER]
    await send(stub, [log_entry(meter_id, 200, {"prompt_tokens": 3, "completion_tokens": 2})])
    answer = await _settle(waiting)
    assert answer.status == 200 and dict(answer.headers)[h.DESTINATION_ENDPOINT] == A
    assert service.state.picking.book.in_flight() == {A: 1}
    picks = service.state.metrics.endpoint_picks
    assert picks.labels("llama", "queued")._value.get() == 1


async def test_a_higher_band_is_served_first(
    authz: tuple[CheckService, als_pb2_grpc.AccessLogServiceStub],
) -> None:
    service, _ = authz
    _now(service, _request("heavy"))
    low = _waits(service, _request("light"))
    high = _waits(service, _request("vip"))
    service.state.picking.leave(A)
    assert (await _settle(high)).status == 200
    assert not low.done()
    service.state.picking.leave(A)
    assert (await _settle(low)).status == 200


def _reserved(state: ExtProcState, request: CheckRequest) -> int:
    """The tokens the request path reserves for ``request`` (its cost in the queue)."""
    headers = {**request.headers, ":method": request.method, ":path": request.path}
    first = handlers.on_request_headers(state.gateway, headers, end_of_stream=False)
    assert isinstance(first, handlers.BodyExpected), first
    prepared = handlers.prepare_body(
        state.gateway, first.pending, request.body, deadline=time.monotonic() + 5
    )
    assert isinstance(prepared, handlers.PreparedRequest), prepared
    return prepared.reserved_tokens


@settings(max_examples=10, deadline=None)
@given(heavy_tokens=st.integers(50, 2_000), light_tokens=st.integers(10, 400))
def test_two_backlogged_tenants_of_one_band_get_equal_tokens(heavy_tokens: int, light_tokens: int) -> None:
    async def run() -> tuple[int, int, int, int]:
        clock = Clock()
        state = ExtProcState(parse_config(_doc()), clock=clock)
        state.picking.book.update(_book_state(A), time.monotonic())
        service = CheckService(state, meter=Meter(state, clock=clock))
        sizes = {"heavy": heavy_tokens, "light": light_tokens}
        cost = {t: _reserved(state, _request(t, size)) for t, size in sizes.items()}
        _now(service, _request("heavy", heavy_tokens))
        # every heavy request arrives before any light one: a FIFO queue would serve heavy only
        queued = {t: [_waits(service, _request(t, size)) for _ in range(24)] for t, size in sizes.items()}
        # one request ends at a time, admitting one waiter, while both tenants still have requests waiting
        while all(any(not f.done() for f in fs) for fs in queued.values()):
            state.picking.leave(A)
            pending = [f for fs in queued.values() for f in fs if not f.done()]
            done, _ = await asyncio.wait(pending, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            assert done, "a request ended and no waiter was admitted"
        served = {t: sum(1 for f in fs if f.done()) * cost[t] for t, fs in queued.items()}
        for fs in queued.values():
            for f in fs:
                f.cancel()
        await asyncio.gather(*(f for fs in queued.values() for f in fs), return_exceptions=True)
        return served["heavy"], served["light"], cost["heavy"], cost["light"]

    heavy, light, heavy_cost, light_cost = asyncio.run(run())
    # SFQ's bound (Goyal et al., Theorem 1): the served tokens of two backlogged tenants of equal weight
    # differ by at most the sum of their largest requests
    assert abs(heavy - light) <= heavy_cost + light_cost, (heavy, light, heavy_cost, light_cost)


async def test_a_full_queue_and_a_queue_timeout_are_429s_with_retry_after() -> None:
    clock = Clock()
    state = ExtProcState(parse_config(_doc(max_queued=1, max_wait_ms=50)), clock=clock)
    state.picking.book.update(_book_state(A), time.monotonic())
    service = CheckService(state, meter=Meter(state, clock=clock))
    _now(service, _request("heavy"))
    waiting = _waits(service, _request("light"))
    full = _now(service, _request("light"))
    assert full.status == 429 and dict(full.headers)["retry-after"] == "1"
    assert json.loads(full.body)["error"]["code"] == "queue_full"
    timed_out = await asyncio.wait_for(waiting, 5)  # its 50 ms expiry timer answers it
    assert timed_out.status == 429 and dict(timed_out.headers)["retry-after"] == "1"
    error = json.loads(timed_out.body)["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "rate_limit_error"
    assert len(state.picking.queue(state.gateway.config.models[0]) or ()) == 0
    assert state.picking.book.in_flight() == {A: 1}  # the timed-out one never held A


async def test_ext_proc_waits_and_a_stream_that_ends_while_it_waits_leaves_the_queue() -> None:
    async with serving(_doc("ext_proc")) as c:
        state = c.state
        state.picking.book.update(_book_state(A), time.monotonic())
        queue = state.picking.queue(state.gateway.config.models[0])
        assert queue is not None
        first = c.stub.Process()
        await c.send(first, req_headers(KEYS["heavy"]))
        resp = await c.send(first, req_body(chat()))
        assert resp.HasField("request_body"), resp
        second = c.stub.Process()
        await c.send(second, req_headers(KEYS["light"]))
        await second.write(req_body(chat()))
        for _ in range(200):
            if len(queue):
                break
            await asyncio.sleep(0.01)
        assert len(queue) == 1
        # its stream ends while it waits: out of the queue, nothing held
        second.cancel()
        for _ in range(200):
            if not len(queue):
                break
            await asyncio.sleep(0.01)
        assert len(queue) == 0
        assert state.picking.book.in_flight() == {A: 1}
        # a third waits and is picked when the first's stream ends
        third = c.stub.Process()
        await c.send(third, req_headers(KEYS["light"]))
        await third.write(req_body(chat()))
        read = asyncio.ensure_future(third.read())
        await finish_response(c, first)
        resp = await asyncio.wait_for(read, 5)
        assert resp.HasField("request_body"), resp
        mutation = resp.request_body.response.header_mutation
        got = {o.header.key: o.header.raw_value.decode() or o.header.value for o in mutation.set_headers}
        assert got[h.DESTINATION_ENDPOINT] == A
        first.cancel()
        third.cancel()


async def test_a_large_cluster_with_a_queue_picks_over_its_columns_among_the_endpoints_with_room() -> None:
    n = COLUMNAR_MIN_ENDPOINTS + 4
    addresses = [f"10.1.0.{i}:8000" for i in range(n)]
    async with checking(_doc()) as (service, _):
        book = service.state.picking.book
        book.update(_book_state(*addresses), time.monotonic())
        assert book.columns(CLUSTER, time.monotonic()) is not None
        picking = parse_config(_doc()).models[0].endpoint_picking
        for _ in range(n):
            states = book.states(CLUSTER, time.monotonic()) or []
            room = [s for s in states if s.healthy and s.in_flight < 1]
            expected = pick(room, weights=picker_weights(picking), salt=service.state.picking.salt,
                            block_tokens=picking.block_size)  # fmt: skip
            answer = _now(service, _request("heavy"))
            assert tuple(dict(answer.headers)[h.DESTINATION_ENDPOINT].split(",")) == expected
        # one request in flight on every endpoint (max_in_flight 1): the next waits
        assert book.in_flight() == dict.fromkeys(addresses, 1)
        waiting = _waits(service, _request("light"))
        await asyncio.sleep(0.01)
        assert not waiting.done()
