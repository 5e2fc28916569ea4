"""Delta ADS over real gRPC (in-process XdsServer, aio client streams), push coalescing, and the SotW and
Delta streams of one server seeing the same snapshots."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from inferlb.config.schema import default_config_path
from tests.conftest import wait_until
from xds_server import ads
from xds_server import resources as r
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, METER_CLUSTER
from xds_server.server import XdsServer

CLUSTERS = ["llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1"]
NODE = base_pb2.Node(id="delta-client-1", cluster="inferlb-gateway")
WAIT_S = 5.0


def _doc(**xds: Any) -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    doc["xds"].update(xds)
    return doc


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    await wait_until(predicate, what, timeout_s, poll_s=0.01)


class DeltaClient:
    """One Delta ADS stream; a reader task queues every response so reads can be time-bounded."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel).DeltaAggregatedResources()
        self.responses: asyncio.Queue[discovery_pb2.DeltaDiscoveryResponse] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            self.responses.put_nowait(msg)

    async def send(
        self,
        type_url: str,
        *,
        subscribe: list[str] | None = None,
        unsubscribe: list[str] | None = None,
        nonce: str = "",
        initial: dict[str, str] | None = None,
        error: str | None = None,
    ) -> None:
        req = discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url,
            resource_names_subscribe=subscribe or [],
            resource_names_unsubscribe=unsubscribe or [],
            response_nonce=nonce,
            initial_resource_versions=initial or {},
            node=NODE,
        )
        if error is not None:
            req.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
        await self.call.write(req)

    async def recv(self, timeout_s: float = WAIT_S) -> discovery_pb2.DeltaDiscoveryResponse:
        return await asyncio.wait_for(self.responses.get(), timeout_s)

    async def expect_silence(self, seconds: float = 0.4) -> None:
        try:
            extra = await asyncio.wait_for(self.responses.get(), seconds)
        except TimeoutError:
            return
        pytest.fail(f"unexpected response {extra.type_url} {[x.name for x in extra.resources]}")

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self.channel.close()


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "inferlb.yaml"
    _write(path, _doc(push_debounce_ms=100, push_max_delay_ms=1000))
    return path


@pytest.fixture
async def server(config_file: Path) -> AsyncIterator[XdsServer]:
    srv = XdsServer(config_file, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), poll_interval_s=0.05)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(0)


@pytest.fixture
async def connect(server: XdsServer) -> AsyncIterator[Callable[[], DeltaClient]]:
    clients: list[DeltaClient] = []

    def make() -> DeltaClient:
        c = DeltaClient(server.port)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


async def _synced(client: DeltaClient) -> dict[str, dict[str, str]]:
    """Subscribe to clusters (wildcard) and their assignments, ACK both; returns ``{type: {name: version}}``
    held."""
    await client.send(r.CLUSTER_TYPE)
    cds = await client.recv()
    await client.send(r.CLUSTER_TYPE, nonce=cds.nonce)
    await client.send(r.ENDPOINT_TYPE, subscribe=CLUSTERS)
    eds = await client.recv()
    await client.send(r.ENDPOINT_TYPE, nonce=eds.nonce)
    return {t.type_url: {res.name: res.version for res in t.resources} for t in (cds, eds)}


async def test_delta_subscribe_ack_and_incremental_push(
    server: XdsServer, connect: Callable[[], DeltaClient], config_file: Path
) -> None:
    client = connect()
    held = await _synced(client)
    # the models' clusters and the default request path's (ext_authz, the settler)
    assert set(held[r.CLUSTER_TYPE]) == {*CLUSTERS, EXT_AUTHZ_CLUSTER, METER_CLUSTER}
    assert set(held[r.ENDPOINT_TYPE]) == set(CLUSTERS)
    await _until(lambda: server.servicer.stats.acks == 2, "two ACKs")
    (info,) = server.servicer.clients_json()
    assert info["mode"] == "delta" and info["node_id"] == "delta-client-1"
    assert info["types"]["ClusterLoadAssignment"]["acked_version"] == server.cache.snapshot().version(  # type: ignore[union-attr]
        r.ENDPOINT_TYPE
    )
    doc = _doc(push_debounce_ms=100, push_max_delay_ms=1000)
    doc["gpu_profiles"]["V100"] = {"relative_capacity": 1.5}
    _write(config_file, doc)
    push = await client.recv()
    assert push.type_url == r.ENDPOINT_TYPE
    assert sorted(x.name for x in push.resources) == ["llama-3.1-8b-instruct--v1", "qwen2.5-7b-instruct--v1"]
    cla = endpoint_pb2.ClusterLoadAssignment()
    assert push.resources[0].resource.Unpack(cla)
    weights = {
        lb.endpoint.hostname: lb.load_balancing_weight.value
        for loc in cla.endpoints
        for lb in loc.lb_endpoints
    }
    assert weights["v100-0"] == 15
    await client.send(r.ENDPOINT_TYPE, nonce=push.nonce)
    await client.expect_silence()


async def test_delta_reconnect_with_initial_versions_gets_only_what_changed(
    server: XdsServer, connect: Callable[[], DeltaClient], config_file: Path
) -> None:
    first = connect()
    held = await _synced(first)
    await first.close()
    doc = _doc(push_debounce_ms=100, push_max_delay_ms=1000)
    doc["gpu_profiles"]["H100"] = {"relative_capacity": 4.0}
    _write(config_file, doc)
    before = server.cache.snapshot()
    await _until(lambda: server.cache.snapshot() is not before, "the new snapshot")
    again = connect()
    await again.send(r.CLUSTER_TYPE, initial=held[r.CLUSTER_TYPE])
    cds = await again.recv()
    assert list(cds.resources) == []  # clusters unchanged: nothing resent, but the subscription is answered
    await again.send(r.CLUSTER_TYPE, nonce=cds.nonce)
    await again.send(r.ENDPOINT_TYPE, subscribe=CLUSTERS, initial=held[r.ENDPOINT_TYPE])
    eds = await again.recv()
    # H100s serve llama v1 and qwen; the v2 canary (an A100) is unchanged
    assert sorted(x.name for x in eds.resources) == ["llama-3.1-8b-instruct--v1", "qwen2.5-7b-instruct--v1"]


async def test_delta_nack_is_counted_and_not_answered_by_a_resend(
    server: XdsServer, connect: Callable[[], DeltaClient], config_file: Path
) -> None:
    client = connect()
    await _synced(client)
    doc = _doc(push_debounce_ms=100, push_max_delay_ms=1000)
    doc["gpu_profiles"]["A100"] = {"relative_capacity": 2.0}
    _write(config_file, doc)
    push = await client.recv()
    await client.send(push.type_url, nonce=push.nonce, error="rejected for the test")
    await _until(lambda: server.servicer.stats.nacks == 1, "the NACK to be counted")
    await client.expect_silence()
    (info,) = server.servicer.clients_json()
    assert info["last_nack"]["error_message"] == "rejected for the test"
    assert server.servicer.stats.nacks_by[("delta", r.ENDPOINT_TYPE)] == 1
    doc["gpu_profiles"]["A100"] = {"relative_capacity": 2.5}
    _write(config_file, doc)
    nxt = await client.recv()
    assert nxt.type_url == r.ENDPOINT_TYPE and nxt.nonce != push.nonce


async def test_a_burst_of_changes_is_one_push_and_sotw_and_delta_agree(
    server: XdsServer, connect: Callable[[], DeltaClient]
) -> None:
    delta = connect()
    await _synced(delta)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    sotw = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
    try:
        await sotw.write(
            discovery_pb2.DiscoveryRequest(type_url=r.ENDPOINT_TYPE, resource_names=CLUSTERS, node=NODE)
        )
        first = await asyncio.wait_for(sotw.read(), WAIT_S)
        await sotw.write(
            discovery_pb2.DiscoveryRequest(
                type_url=r.ENDPOINT_TYPE, resource_names=CLUSTERS, response_nonce=first.nonce,
                version_info=first.version_info,
            )
        )  # fmt: skip
        published = server.coalescer.publishes  # type: ignore[union-attr]
        # ten telemetry weight changes back to back: within the 100 ms debounce, so one push
        key = "127.0.0.1:8001"
        for w in range(50, 60):
            server.set_telemetry_weights({key: w})
        assert server.coalescer.changes >= 10  # type: ignore[union-attr]
        push = await delta.recv()
        assert [x.name for x in push.resources] == ["llama-3.1-8b-instruct--v1"]
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert push.resources[0].resource.Unpack(cla)
        assert {
            lb.endpoint.hostname: lb.load_balancing_weight.value
            for loc in cla.endpoints
            for lb in loc.lb_endpoints
        }["h100-0"] == 59
        sotw_push = await asyncio.wait_for(sotw.read(), WAIT_S)
        assert sotw_push.version_info == push.system_version_info
        await delta.expect_silence(0.4)
        assert server.coalescer.publishes == published + 1  # type: ignore[union-attr]
    finally:
        sotw.cancel()
        await channel.close()


async def test_staleness_is_bounded_while_changes_keep_coming(
    server: XdsServer, connect: Callable[[], DeltaClient]
) -> None:
    # changes every 40 ms never leave the 100 ms debounce quiet; the 1 s max delay still forces pushes
    assert server.coalescer is not None
    published = server.coalescer.publishes
    start = time.monotonic()
    w = 50
    while time.monotonic() - start < 2.5:
        w += 1
        server.set_telemetry_weights({"127.0.0.1:8001": w})
        await asyncio.sleep(0.04)
    # 2.5 s of changes: pushes at ~1.0 and ~2.0 s (a quiet-period debounce alone would give none)
    assert server.coalescer.publishes - published >= 2
    await _until(lambda: not server.coalescer.pending, "the last burst to be pushed")  # type: ignore[union-attr]


async def test_oversized_sotw_responses_are_counted_and_logged(
    server: XdsServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ads, "GRPC_DEFAULT_MAX_MESSAGE", 100)  # the default config's EDS is ~2 KB
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(
            discovery_pb2.DiscoveryRequest(type_url=r.ENDPOINT_TYPE, resource_names=CLUSTERS, node=NODE)
        )
        resp = await asyncio.wait_for(call.read(), WAIT_S)
        assert len(resp.resources) == 3
        call.cancel()
    await _until(lambda: server.servicer.stats.oversized_responses == 1, "the oversized response counted")
    assert any("over gRPC's 4 MiB default" in rec.getMessage() for rec in caplog.records)
