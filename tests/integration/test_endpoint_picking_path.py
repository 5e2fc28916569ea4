"""Endpoint picking on the request path, in-process, both modes (:mod:`ext_proc.picking`): from a given
endpoint state the ext_authz check and the ext_proc stream set ``x-gateway-destination-endpoint`` (ext_proc
also the ``envoy.lb`` metadata) to the picker's order, whatever the client sent; the pick holds the
endpoint's in-flight count until the request's settlement; no eligible endpoint is 503
``no_eligible_endpoint``; no state yet lets Envoy's fallback balance. The poller reads the xDS server's
``GET /v1/picking`` over loopback and keeps its last state while the server is down."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from ext_authz.meter import Meter
from ext_proc.access_log import serve_access_log
from ext_proc.metrics import ExtProcMetrics
from ext_proc.picking import EndpointStatePoller, PickingState, picker_weights
from ext_proc.state import ExtProcState
from inferlb.config.schema import Config, parse_config
from inferlb.ops.stack import free_ports
from inferlb.policy.columnar import COLUMNAR_MIN_ENDPOINTS
from inferlb.policy.endpoint_book import BookedEndpoint, BookedState
from inferlb.policy.picker import pick
from inferlb.request import headers as h
from simulation.gpusim.faults import FaultCommand
from simulation.gpusim.server import SimulatedEndpoint
from tests.integration.test_ext_authz_meter import Clock, log_entry, send
from tests.integration.test_ext_proc_accounting import chat, req_body, req_headers, resp_body, resp_headers
from tests.integration.test_ext_proc_stream_ends import JSON_USAGE, serving
from xds_server.collector import TelemetryCollector
from xds_server.server import XdsServer

KEY = "sk-gold-0001"
CLUSTER = "llama--v1"
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
TOKEN = "picking-token-0123456789"


def _config(protocol: str) -> dict[str, Any]:
    return {
        "ext_proc": {"protocol": protocol, "account_responses": True},
        "models": [{"name": "llama", "default_max_tokens": 10, "endpoint_picking": {"mode": "load"}}],
        "tenants": [{"name": "gold", "api_keys": [KEY]}],
    }


def _state(*endpoints: BookedEndpoint) -> BookedState:
    return BookedState(clusters={CLUSTER: endpoints}, stale_after_ms=5_000)


#: A is busy (a queue of 6 at the model server), B and C idle; C has twice B's capacity.
BUSY_A = _state(
    BookedEndpoint(address=A, weight=10, healthy=True, waiting=6, telemetry_age_ms=0),
    BookedEndpoint(address=B, weight=10, healthy=True, waiting=0, telemetry_age_ms=0),
    BookedEndpoint(address=C, weight=20, healthy=True, waiting=0, telemetry_age_ms=0),
)
NONE_HEALTHY = _state(
    BookedEndpoint(address=A, weight=10, healthy=False),
    BookedEndpoint(address=B, weight=10, healthy=False),
)


def _authz_request(spoof: str | None = None) -> CheckRequest:
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    if spoof is not None:
        headers[h.DESTINATION_ENDPOINT] = spoof
    return CheckRequest(method="POST", path="/v1/chat/completions", headers=headers, body=chat())


@pytest.fixture
async def authz() -> AsyncIterator[tuple[CheckService, als_pb2_grpc.AccessLogServiceStub]]:
    async with checking(_config("ext_authz")) as out:
        yield out


@contextlib.asynccontextmanager
async def checking(
    doc: dict[str, Any],
) -> AsyncIterator[tuple[CheckService, als_pb2_grpc.AccessLogServiceStub]]:
    """An ext_authz check service over ``doc`` with its meter fed by a real access-log gRPC server, and a
    stub to send it entries."""
    clock = Clock()
    state = ExtProcState(parse_config(doc), clock=clock)
    meter = Meter(state, clock=clock)
    server, port = await serve_access_log("127.0.0.1", 0, meter.on_entries)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield CheckService(state, meter=meter), als_pb2_grpc.AccessLogServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
        await meter.aclose()


def _answer(service: CheckService, request: CheckRequest) -> CheckAnswer:
    out = service.check(request)
    assert isinstance(out, CheckAnswer)
    return out


async def test_ext_authz_sets_the_picked_hosts_over_the_clients_and_holds_the_first(
    authz: tuple[CheckService, als_pb2_grpc.AccessLogServiceStub],
) -> None:
    service, stub = authz
    book = service.state.picking.book
    book.update(BUSY_A, time.monotonic())
    answer = _answer(service, _authz_request(spoof=A))
    assert answer.status == 200, answer
    headers = dict(answer.headers)
    # least load first (C: 0 of 20, B: 0 of 10; ties by salt), the busy A last; never the client's A alone
    hosts = headers[h.DESTINATION_ENDPOINT].split(",")
    assert set(hosts) == {A, B, C} and hosts[-1] == A, hosts
    assert book.in_flight() == {hosts[0]: 1}
    # the next pick sees this process's own request in flight on the first
    second = dict(_answer(service, _authz_request()).headers)[h.DESTINATION_ENDPOINT].split(",")
    assert second[0] != hosts[0] and second[-1] == A, second
    assert book.in_flight() == {hosts[0]: 1, second[0]: 1}
    # each access-log entry settles its request and leaves its endpoint's count
    await send(stub, [log_entry(headers[h.METER], 200, {"prompt_tokens": 3, "completion_tokens": 2})])
    assert book.in_flight() == {second[0]: 1}


async def test_a_large_cluster_is_picked_over_the_books_columns_as_pick_would(
    authz: tuple[CheckService, als_pb2_grpc.AccessLogServiceStub],
) -> None:
    service, stub = authz
    book = service.state.picking.book
    n = 4 * COLUMNAR_MIN_ENDPOINTS
    fleet = [
        BookedEndpoint(address=f"10.1.{i // 256}.{i % 256}:8000", weight=10 + i % 3 * 10, healthy=i % 7 != 0,
                       waiting=i % 5, telemetry_age_ms=0)
        for i in range(n)
    ]  # fmt: skip
    book.update(_state(*fleet), time.monotonic())
    assert book.columns(CLUSTER, time.monotonic()) is not None
    picking = parse_config(_config("ext_authz")).models[0].endpoint_picking
    meters = []
    for _ in range(5):
        now = time.monotonic()
        states = book.states(CLUSTER, now)
        assert states is not None
        expected = pick(states, weights=picker_weights(picking), salt=service.state.picking.salt,
                        block_tokens=picking.block_size)  # fmt: skip
        headers = dict(_answer(service, _authz_request()).headers)
        assert tuple(headers[h.DESTINATION_ENDPOINT].split(",")) == expected
        meters.append(headers[h.METER])
    assert sum(book.in_flight().values()) == 5
    await send(stub, [log_entry(m, 200, {"prompt_tokens": 3, "completion_tokens": 2}) for m in meters])
    assert book.in_flight() == {}
    columns = book.columns(CLUSTER, time.monotonic())
    assert columns is not None and all(columns.in_flight(e.address) == 0 for e in fleet)


async def test_ext_authz_refuses_503_when_no_endpoint_is_eligible(
    authz: tuple[CheckService, als_pb2_grpc.AccessLogServiceStub],
) -> None:
    service, _ = authz
    service.state.picking.book.update(NONE_HEALTHY, time.monotonic())
    answer = _answer(service, _authz_request())
    # a 5xx goes to Envoy as 403 + x-inferlb-status (the local-reply mapper restores it)
    assert answer.status == 403, answer
    headers = dict(answer.headers)
    assert headers[h.STATUS] == "503" and headers["retry-after"] == "1"
    assert json.loads(answer.body)["error"]["code"] == "no_eligible_endpoint"
    assert service.state.picking.book.in_flight() == {}
    assert service.state.metrics.endpoint_picks.labels("llama", "no_eligible")._value.get() == 1


async def test_without_state_envoy_balances(
    authz: tuple[CheckService, als_pb2_grpc.AccessLogServiceStub],
) -> None:
    service, _ = authz
    answer = _answer(service, _authz_request())
    assert answer.status == 200
    assert h.DESTINATION_ENDPOINT not in dict(answer.headers)
    assert service.state.metrics.endpoint_picks.labels("llama", "no_state")._value.get() == 1


async def test_ext_proc_sets_header_and_envoy_lb_metadata_and_leaves_at_the_stream_end() -> None:
    async with serving(_config("ext_proc")) as c:
        book = c.state.picking.book
        book.update(BUSY_A, time.monotonic())
        call = c.stub.Process()
        pairs = [
            (":method", "POST"), (":path", "/v1/chat/completions"), ("authorization", f"Bearer {KEY}"),
            (h.DESTINATION_ENDPOINT, A),
        ]  # fmt: skip
        hmap = base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
        )
        await c.send(call, ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hmap)))
        resp = await c.send(call, req_body(chat()))
        assert resp.HasField("request_body"), resp
        mutation = resp.request_body.response.header_mutation
        got = {o.header.key: o.header.raw_value.decode() or o.header.value for o in mutation.set_headers}
        hosts = got[h.DESTINATION_ENDPOINT].split(",")
        assert set(hosts) == {A, B, C} and hosts[-1] == A, hosts
        lb = resp.dynamic_metadata.fields[h.DESTINATION_ENDPOINT_NAMESPACE].struct_value
        assert lb.fields[h.DESTINATION_ENDPOINT].string_value == got[h.DESTINATION_ENDPOINT]
        assert book.in_flight() == {hosts[0]: 1}
        await c.send(call, resp_headers(200, "application/json"))
        await c.send(call, resp_body(JSON_USAGE, eos=True))
        await c.servicer.drain()
        assert book.in_flight() == {}
        call.cancel()


async def test_ext_proc_refuses_503_when_no_endpoint_is_eligible() -> None:
    async with serving(_config("ext_proc")) as c:
        c.state.picking.book.update(NONE_HEALTHY, time.monotonic())
        call = c.stub.Process()
        await c.send(call, req_headers(KEY))
        resp = await c.send(call, req_body(chat()))
        imm = resp.immediate_response
        assert imm.status.code == 503, resp
        assert json.loads(imm.body)["error"]["code"] == "no_eligible_endpoint"
        assert c.state.picking.book.in_flight() == {}
        call.cancel()


# -- the state's way from the xDS server to the request path ----------------------------------------------


def _xds_doc() -> dict[str, Any]:
    ports = free_ports(5)
    return {
        "xds": {"listen": f"127.0.0.1:{ports[0]}", "api_listen": f"127.0.0.1:{ports[1]}"},
        "simulation": {"prefill_tokens_per_s": 1_000_000, "decode_tokens_per_s": 2_000, "max_batch": 8},
        "telemetry": {"scrape_interval_ms": 100, "scrape_timeout_ms": 500},
        "gpu_profiles": {"H100": {"relative_capacity": 3.4, "prefill_relative_capacity": 7.23}},
        "models": [
            {
                "name": "llama",
                "endpoint_picking": {"mode": "load"},
                "cluster": {
                    "health_check": {"interval_ms": 1000, "unhealthy_threshold": 2},
                    "length_aware": {"long_output_tokens": 100},
                },
            },
            {"name": "other"},
        ],
        "endpoints": [
            {"name": "h100", "address": f"127.0.0.1:{ports[2]}", "model": "llama", "gpu": "H100",
             "simulated": True},
            {"name": "v100", "address": f"127.0.0.1:{ports[3]}", "model": "llama", "gpu": "V100",
             "simulated": True},
            {"name": "o", "address": f"127.0.0.1:{ports[4]}", "model": "other", "gpu": "V100"},
        ],
    }  # fmt: skip


async def test_the_poller_reads_the_xds_servers_state_and_keeps_it_while_the_server_is_down(
    tmp_path: Path,
) -> None:
    doc = _xds_doc()
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    config: Config = parse_config(doc)
    sims = []
    for e in config.endpoints:
        if e.simulated:
            sim = SimulatedEndpoint(config=config, endpoint=e)
            await sim.start(host=e.address.host, port=e.address.port)
            sims.append(sim)
    collector = TelemetryCollector()
    server = XdsServer(path, api_token=TOKEN, api_routes=collector.routes())
    await server.start()
    await collector.start(server)
    picking = PickingState()
    poller = EndpointStatePoller(picking, lambda: config, ExtProcMetrics(), token=TOKEN)
    try:
        async with aiohttp.ClientSession() as http:
            # static weights, yet the picking model's endpoints are scraped and probed
            deadline = time.monotonic() + 8
            while True:
                assert await poller.poll_once(http, config)
                states = picking.book.states(CLUSTER, time.monotonic())
                assert states is not None
                if all(s.kv_usage >= 0 for s in states) and collector.scrapes.get("health", 0) >= 4:
                    break
                assert time.monotonic() < deadline, collector.scrapes
            doc_now = collector.picking_json()
            assert set(doc_now["clusters"]) == {CLUSTER}  # "other" does not pick
            rows = {r["name"]: r for r in doc_now["clusters"][CLUSTER]}
            assert rows["h100"]["weight"] == 34 and rows["v100"]["weight"] == 10
            # the prefill weight: the H100's profile prefills 7.23 V100s' worth, the V100's gives none
            assert (
                rows["h100"]["prefill_weight"] == pytest.approx(72.3) and rows["v100"]["prefill_weight"] == 10
            )
            by_address = {s.address: s.prefill_weight for s in states}
            assert by_address[str(config.endpoints[0].address)] == pytest.approx(72.3)
            assert rows["h100"]["telemetry_age_ms"] is not None and rows["h100"]["waiting"] == 0
            # length-aware: each row names the classes it may serve, the book each class's hosts
            assert (rows["h100"]["length_classes"], rows["v100"]["length_classes"]) == (["long"], [])
            assert picking.book.class_hosts(CLUSTER, "long") == {str(config.endpoints[0].address)}
            assert {s.address: s.healthy for s in states} == {
                str(e.address): True for e in config.endpoints[:2]
            }
            # a failing GPU is out after two failed probes
            sims[1].apply_fault(FaultCommand(action="fail"))
            deadline = time.monotonic() + 8
            while True:
                await poller.poll_once(http, config)
                healthy = {s.address: s.healthy for s in picking.book.states(CLUSTER, time.monotonic()) or []}
                if healthy[str(config.endpoints[1].address)] is False:
                    break
                assert time.monotonic() < deadline, healthy
            assert healthy[str(config.endpoints[0].address)] is True
            # the xDS server goes away: the poll fails, the last state keeps serving
            await collector.stop()
            await server.stop(0)
            assert not await poller.poll_once(http, config)
            kept = picking.book.states(CLUSTER, time.monotonic())
            assert kept is not None and {s.address: s.healthy for s in kept} == healthy
    finally:
        await collector.stop()
        await server.stop(0)
        for sim in sims:
            await sim.stop()


async def test_a_refused_or_bad_answer_keeps_the_last_state() -> None:
    port = free_ports(1)[0]
    answers: list[web.Response] = []

    async def handler(request: web.Request) -> web.Response:
        return answers.pop(0)

    app = web.Application()
    app.router.add_get("/v1/picking", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    config = parse_config({**_config("ext_authz"), "xds": {"api_listen": f"127.0.0.1:{port}"}})
    picking = PickingState()
    metrics = ExtProcMetrics()
    poller = EndpointStatePoller(picking, lambda: config, metrics, token=TOKEN)
    good = {"clusters": {CLUSTER: [{"address": A, "weight": 10, "healthy": True}]}, "stale_after_ms": 5000}
    try:
        async with aiohttp.ClientSession() as http:
            answers.append(web.json_response(good))
            assert await poller.poll_once(http, config)
            answers.append(web.json_response({"error": "nope"}, status=401))
            answers.append(web.json_response({"clusters": {CLUSTER: [{"address": A, "weight": 0}]}}))
            assert not await poller.poll_once(http, config)
            assert not await poller.poll_once(http, config)
            states = picking.book.states(CLUSTER, time.monotonic())
            assert states is not None and [s.address for s in states] == [A]
            assert metrics.endpoint_state_polls.labels("failed")._value.get() == 2
    finally:
        await runner.cleanup()
