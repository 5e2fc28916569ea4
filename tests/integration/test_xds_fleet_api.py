"""The xDS server's HTTP API over loopback: bearer auth, fleet changes and their errors, the fleet listing,
/metrics, and config-file edits composing with API changes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from inferlb.config.schema import default_config_path
from tests.conftest import wait_until
from xds_server import resources as r
from xds_server.server import XdsServer

TOKEN = "integration-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QWEN = "qwen2.5-7b-instruct--v1"
WAIT_S = 5.0


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    doc["xds"]["push_debounce_ms"] = 20
    return doc


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    await wait_until(predicate, what, timeout_s, poll_s=0.01)


def _hosts(server: XdsServer, cluster: str) -> dict[str, endpoint_pb2.LbEndpoint]:
    snap = server.cache.snapshot()
    assert snap is not None
    cla = snap.resources[r.ENDPOINT_TYPE][cluster].message
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    return {lb.endpoint.hostname: lb for loc in cla.endpoints for lb in loc.lb_endpoints}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "inferlb.yaml"
    _write(path, _doc())
    return path


async def _server(config_file: Path, token: str | None) -> XdsServer:
    srv = XdsServer(
        config_file, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), api_token=token, poll_interval_s=0.05
    )
    await srv.start()
    return srv


@pytest.fixture
async def server(config_file: Path) -> AsyncIterator[XdsServer]:
    srv = await _server(config_file, TOKEN)
    try:
        yield srv
    finally:
        await srv.stop(0)


@pytest.fixture
async def http(server: XdsServer) -> AsyncIterator[Callable[..., Any]]:
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.api_port}") as session:

        async def call(
            method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
        ) -> Any:
            async with session.request(
                method, path, json=body, headers=AUTH if headers is None else headers
            ) as resp:
                data = await resp.json() if resp.content_type == "application/json" else await resp.text()
                return resp.status, data

        yield call


async def test_every_v1_route_needs_the_bearer_token(http: Callable[..., Any]) -> None:
    assert (await http("GET", "/healthz", headers={}))[0] == 200
    for method, path in [
        ("GET", "/v1/endpoints"),
        ("GET", "/v1/clients"),
        ("POST", "/v1/endpoints"),
        ("DELETE", "/v1/endpoints/127.0.0.1:8001"),
    ]:
        status, body = await http(method, path, headers={})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = await http(method, path, headers={"Authorization": "Bearer wrong-token-0123456789"})
        assert status == 401


async def test_without_a_token_the_fleet_api_is_closed(config_file: Path) -> None:
    doc = _doc()
    doc["xds"].pop("api_token", None)  # the default config carries a demo token
    _write(config_file, doc)
    srv = await _server(config_file, None)
    try:
        url = f"http://127.0.0.1:{srv.api_port}/v1/endpoints"
        async with aiohttp.ClientSession() as s, s.get(url, headers=AUTH) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "api_disabled"
    finally:
        await srv.stop(0)


async def test_register_pin_drain_deregister_and_their_errors(
    server: XdsServer, http: Callable[..., Any]
) -> None:
    new = {"address": "127.0.0.1:9200", "model": "qwen2.5-7b-instruct", "gpu": "A100", "name": "a100-new"}
    assert (await http("POST", "/v1/endpoints", new))[0] == 201
    await _until(lambda: "a100-new" in _hosts(server, QWEN), "the registered endpoint in the snapshot")
    assert _hosts(server, QWEN)["a100-new"].load_balancing_weight.value == 17

    status, body = await http("POST", "/v1/endpoints", {**new, "address": "127.0.0.1:9201", "model": "nope"})
    assert status == 400 and "model" in body["error"]["message"]
    status, body = await http("POST", "/v1/endpoints", {**new, "address": "gpu-9.invalid:80"})
    assert status == 400 and "does not resolve" in body["error"]["message"]
    status, body = await http("POST", "/v1/endpoints", {**new, "gpu": 7, "address": "bad"})
    assert status == 400 and body["error"]["param"].startswith("endpoint.")
    status, body = await http("PUT", "/v1/endpoints/10.9.9.9:1/weight", {"weight": 5})
    assert status == 404 and body["error"]["code"] == "unknown_endpoint"

    assert (await http("PUT", "/v1/endpoints/127.0.0.1:9200/weight", {"weight": 250}))[0] == 200
    await _until(lambda: _hosts(server, QWEN)["a100-new"].load_balancing_weight.value == 250, "the pin")

    status, body = await http("POST", "/v1/endpoints/127.0.0.1:9200/drain", {"drain_ms": 300})
    assert status == 202 and 0 < body["removed_in_ms"] <= 300
    await _until(
        lambda: (
            "a100-new" in _hosts(server, QWEN)
            and _hosts(server, QWEN)["a100-new"].health_status == health_check_pb2.HealthStatus.DRAINING
        ),
        "DRAINING",
    )
    status, listing = await http("GET", "/v1/endpoints")
    row = next(e for e in listing["endpoints"] if e["key"] == "127.0.0.1:9200")
    assert row["draining"] is True and row["source"] == "api" and row["weight_override"] == 250
    await _until(lambda: "a100-new" not in _hosts(server, QWEN), "removal after the drain period")

    # a config-file endpoint can be deregistered at once (hidden) and registered back
    assert (await http("DELETE", "/v1/endpoints/127.0.0.1:8008"))[0] == 200
    await _until(lambda: "v100-2" not in _hosts(server, QWEN), "the deregistered file endpoint gone")
    back = {"address": "127.0.0.1:8008", "model": "qwen2.5-7b-instruct", "gpu": "V100", "name": "v100-2"}
    assert (await http("POST", "/v1/endpoints", back))[0] == 201
    await _until(lambda: "v100-2" in _hosts(server, QWEN), "the file endpoint back")


async def test_config_edits_keep_working_alongside_api_changes(
    server: XdsServer, http: Callable[..., Any], config_file: Path
) -> None:
    new = {"address": "127.0.0.1:9300", "model": "qwen2.5-7b-instruct", "gpu": "H100", "name": "h100-api"}
    assert (await http("POST", "/v1/endpoints", new))[0] == 201
    doc = _doc()
    doc["gpu_profiles"]["H100"] = {"relative_capacity": 4.0}
    _write(config_file, doc)
    await _until(
        lambda: (
            _hosts(server, QWEN).get("h100-api") is not None
            and _hosts(server, QWEN)["h100-api"].load_balancing_weight.value == 40
            and _hosts(server, QWEN)["h100-1"].load_balancing_weight.value == 40
        ),
        "the file's new H100 capacity applied to the file's and the API's H100s",
    )
    # a file valid on its own but not with the registered endpoint (its model dropped) is refused, the
    # field named, and the last good snapshot keeps serving
    doc["models"] = [m for m in doc["models"] if m["name"] != "qwen2.5-7b-instruct"]
    doc["endpoints"] = [e for e in doc["endpoints"] if e["model"] != "qwen2.5-7b-instruct"]
    _write(config_file, doc)
    await _until(lambda: server.reload_errors == 1, "the file refused")
    assert "h100-api" in _hosts(server, QWEN)


async def test_metrics_expose_streams_pushes_versions(server: XdsServer, http: Callable[..., Any]) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=r.ENDPOINT_TYPE, resource_names=[QWEN]))
        first = await asyncio.wait_for(call.read(), WAIT_S)
        await call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=r.ENDPOINT_TYPE, resource_names=[QWEN], response_nonce=first.nonce,
                version_info=first.version_info,
            )
        )  # fmt: skip
        server.set_telemetry_weights({"127.0.0.1:8006": 77})
        pushed = await asyncio.wait_for(call.read(), WAIT_S)
        assert pushed.version_info != first.version_info
        assert _hosts(server, QWEN)["h100-1"].load_balancing_weight.value == 77
        status, text = await http("GET", "/metrics", headers={})
        call.cancel()
    assert status == 200
    snap = server.cache.snapshot()
    assert snap is not None
    serial = snap.version(r.ENDPOINT_TYPE).rsplit("-", 1)[-1]
    assert f'inferlb_xds_snapshot_serial{{type="ClusterLoadAssignment"}} {float(serial)}' in text
    assert 'inferlb_xds_streams{mode="sotw"} 1.0' in text
    assert 'inferlb_xds_subscriptions{mode="sotw",type="ClusterLoadAssignment"} 1.0' in text
    assert 'inferlb_xds_responses_total{mode="sotw",type="ClusterLoadAssignment"} 2.0' in text
    assert 'inferlb_xds_push_latency_seconds_count{mode="sotw"} 1.0' in text
    assert 'inferlb_xds_nacks_total{mode="delta",type="Cluster"} 0.0' in text
    assert "inferlb_xds_snapshots_published_total 2.0" in text
    assert "inferlb_xds_oversized_responses_total 0.0" in text
    assert "inferlb_xds_snapshot_groups 1.0" in text


async def test_batch_weights_are_one_change_and_all_or_nothing(
    server: XdsServer, http: Callable[..., Any]
) -> None:
    assert server.coalescer is not None
    published = server.coalescer.publishes
    weights = {"127.0.0.1:8006": 101, "127.0.0.1:8007": 102, "127.0.0.1:8008": 103}
    status, body = await http("PUT", "/v1/weights", {"weights": weights})
    assert status == 200 and body == {"updated": 3}
    await _until(lambda: _hosts(server, QWEN)["v100-2"].load_balancing_weight.value == 103, "the batch")
    assert {n: lb.load_balancing_weight.value for n, lb in _hosts(server, QWEN).items()} == {
        "h100-1": 101, "v100-1": 102, "v100-2": 103,
    }  # fmt: skip
    assert server.coalescer.publishes == published + 1
    # one unknown key: 404 and nothing changes; a zero weight: 400
    status, _ = await http("PUT", "/v1/weights", {"weights": {"127.0.0.1:8006": 5, "10.0.0.1:1": 5}})
    assert status == 404
    status, _ = await http("PUT", "/v1/weights", {"weights": {"127.0.0.1:8006": 0}})
    assert status == 400
    assert server.fleet.weight_overrides["127.0.0.1:8006"] == 101


async def test_extra_routes_share_the_token_check(config_file: Path) -> None:
    async def intake(request: web.Request) -> web.Response:
        body = await request.json()
        srv.set_telemetry_weights(body["weights"])
        return web.json_response({"ok": True})

    srv = XdsServer(
        config_file,
        bind=("127.0.0.1", 0),
        api_bind=("127.0.0.1", 0),
        api_token=TOKEN,
        api_routes=[web.post("/v1/telemetry/weights", intake)],
    )
    await srv.start()
    try:
        url = f"http://127.0.0.1:{srv.api_port}/v1/telemetry/weights"
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={"weights": {"127.0.0.1:8006": 61}}) as resp:
                assert resp.status == 401
            async with s.post(url, json={"weights": {"127.0.0.1:8006": 61}}, headers=AUTH) as resp:
                assert resp.status == 200
        await _until(
            lambda: _hosts(srv, QWEN)["h100-1"].load_balancing_weight.value == 61, "the intake weight"
        )
    finally:
        await srv.stop(0)
