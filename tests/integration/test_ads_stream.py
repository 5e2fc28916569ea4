"""The ADS servicer over real gRPC: an in-process grpcio aio server (XdsServer) and aio client streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from inferlb.config.schema import default_config_path
from tests.conftest import wait_until
from tests.tls_certs import CertificateAuthority
from xds_server import resources as r
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, METER_CLUSTER
from xds_server.server import XdsServer

CLUSTERS = ["llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1"]
NODE = base_pb2.Node(id="test-envoy-1", cluster="inferlb-gateway")
WAIT_S = 5.0


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    await wait_until(predicate, what, timeout_s, poll_s=0.02)


class AdsClient:
    """One SotW ADS stream; a reader task queues every response so reads can be time-bounded."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        self.call = stub.StreamAggregatedResources()
        self.responses: asyncio.Queue[discovery_pb2.DiscoveryResponse] = asyncio.Queue()
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
        nonce: str = "",
        version: str = "",
        names: list[str] | None = None,
        error: str | None = None,
        node: bool = False,
    ) -> None:
        req = discovery_pb2.DiscoveryRequest(
            type_url=type_url, response_nonce=nonce, version_info=version, resource_names=names or []
        )
        if error is not None:
            req.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
        if node:
            req.node.CopyFrom(NODE)
        await self.call.write(req)

    async def ack(self, resp: discovery_pb2.DiscoveryResponse, names: list[str] | None = None) -> None:
        await self.send(resp.type_url, nonce=resp.nonce, version=resp.version_info, names=names)

    async def recv(self, timeout_s: float = WAIT_S) -> discovery_pb2.DiscoveryResponse:
        return await asyncio.wait_for(self.responses.get(), timeout_s)

    async def expect_silence(self, seconds: float = 0.5) -> None:
        try:
            extra = await asyncio.wait_for(self.responses.get(), seconds)
        except TimeoutError:
            return
        pytest.fail(f"unexpected response {extra.type_url} {extra.version_info}")

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self.channel.close()


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "inferlb.yaml"
    _write(path, _doc())
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
async def connect(server: XdsServer) -> AsyncIterator[Callable[[], AdsClient]]:
    clients: list[AdsClient] = []

    def make() -> AdsClient:
        c = AdsClient(server.port)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


def _weights(resp: discovery_pb2.DiscoveryResponse) -> dict[str, int]:
    out = {}
    for any_ in resp.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert any_.Unpack(cla)
        for loc in cla.endpoints:
            for lb in loc.lb_endpoints:
                out[lb.endpoint.hostname] = lb.load_balancing_weight.value
    return out


async def test_first_request_answered_then_ack_recorded(
    server: XdsServer, connect: Callable[[], AdsClient]
) -> None:
    client = connect()
    await client.send(r.CLUSTER_TYPE, node=True)
    resp = await client.recv()
    snap = server.cache.snapshot()
    assert snap is not None
    assert resp.type_url == r.CLUSTER_TYPE
    assert resp.version_info == snap.version(r.CLUSTER_TYPE)
    assert resp.version_info.startswith(server.cache.instance_id + "-")
    names = set()
    for any_ in resp.resources:
        c = cluster_pb2.Cluster()
        assert any_.Unpack(c)
        names.add(c.name)
    assert names == {*CLUSTERS, EXT_AUTHZ_CLUSTER, METER_CLUSTER}  # the default request path
    await client.ack(resp)
    await _until(lambda: server.servicer.stats.acks == 1, "the ACK")
    await client.expect_silence(0.3)


async def test_nack_is_logged_counted_and_not_answered_by_a_resend(
    server: XdsServer,
    connect: Callable[[], AdsClient],
    config_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="xds_server.ads")
    client = connect()
    await client.send(r.ENDPOINT_TYPE, names=CLUSTERS, node=True)
    first = await client.recv()
    await client.ack(first, CLUSTERS)
    doc = _doc()
    doc["gpu_profiles"]["V100"]["relative_capacity"] = 1.5
    _write(config_file, doc)
    pushed = await client.recv()
    assert pushed.version_info != first.version_info
    await client.send(
        r.ENDPOINT_TYPE,
        nonce=pushed.nonce,
        version=first.version_info,
        names=CLUSTERS,
        error="weight too big",
    )
    await _until(lambda: server.servicer.stats.nacks == 1, "the NACK to be counted")
    await client.expect_silence(0.5)
    nack = server.servicer.stats.last_nack
    assert nack is not None
    assert (nack.node_id, nack.rejected_version, nack.kept_version) == (
        "test-envoy-1",
        pushed.version_info,
        first.version_info,
    )
    [record] = [rec for rec in caplog.records if "NACK" in rec.getMessage()]
    assert "test-envoy-1" in record.getMessage()
    assert "weight too big" in record.getMessage()
    assert pushed.version_info in record.getMessage()
    # the next good snapshot is delivered
    doc["gpu_profiles"]["V100"]["relative_capacity"] = 1.2
    _write(config_file, doc)
    fixed = await client.recv()
    assert fixed.version_info not in (first.version_info, pushed.version_info)
    assert _weights(fixed)["v100-0"] == 12


async def test_stale_nonce_is_ignored(
    server: XdsServer, connect: Callable[[], AdsClient], config_file: Path
) -> None:
    client = connect()
    await client.send(r.ENDPOINT_TYPE, names=CLUSTERS, node=True)
    first = await client.recv()
    await client.ack(first, CLUSTERS)
    doc = _doc()
    doc["gpu_profiles"]["A100"]["relative_capacity"] = 2.0
    _write(config_file, doc)
    pushed = await client.recv()
    # a late answer to the first response asks for fewer names: as a current request it would be answered
    await client.send(r.ENDPOINT_TYPE, nonce=first.nonce, version=first.version_info, names=CLUSTERS[:1])
    await _until(lambda: server.servicer.stats.stale_nonces == 1, "the stale nonce to be counted")
    await client.expect_silence(0.3)
    # the current nonce with the same names is answered
    await client.send(r.ENDPOINT_TYPE, nonce=pushed.nonce, version=pushed.version_info, names=CLUSTERS[:1])
    narrowed = await client.recv()
    assert len(narrowed.resources) == 1


async def test_config_change_pushes_clusters_then_endpoints(
    server: XdsServer, connect: Callable[[], AdsClient], config_file: Path
) -> None:
    client = connect()
    first: dict[str, discovery_pb2.DiscoveryResponse] = {}
    for t, names in (
        (r.CLUSTER_TYPE, None),
        (r.ENDPOINT_TYPE, CLUSTERS),
        (r.LISTENER_TYPE, None),
        (r.ROUTE_TYPE, [r.ROUTE_CONFIG_NAME]),
    ):
        await client.send(t, names=names, node=t == r.CLUSTER_TYPE)
        first[t] = await client.recv()
        await client.ack(first[t], names)
    await _until(lambda: server.servicer.stats.acks == 4, "four ACKs")
    doc = _doc()
    doc["models"][1]["cluster"] = {"healthy_panic_threshold": 10}
    doc["gpu_profiles"]["H100"]["relative_capacity"] = 4.0
    _write(config_file, doc)
    clusters = await client.recv()
    endpoints = await client.recv()
    assert [clusters.type_url, endpoints.type_url] == [r.CLUSTER_TYPE, r.ENDPOINT_TYPE]
    assert clusters.version_info != first[r.CLUSTER_TYPE].version_info
    assert endpoints.version_info != first[r.ENDPOINT_TYPE].version_info
    assert _weights(endpoints)["h100-0"] == 40
    await client.expect_silence(0.3)  # listeners and routes did not change


async def test_new_subscription_is_answered_when_nothing_changed(
    server: XdsServer, connect: Callable[[], AdsClient]
) -> None:
    one, two = connect(), connect()
    await one.send(r.LISTENER_TYPE, node=True)
    a = await one.recv()
    await one.ack(a)
    await two.send(r.LISTENER_TYPE, node=True)
    b = await two.recv()
    assert a.version_info == b.version_info
    assert a.resources[0].value == b.resources[0].value
    # and on the same stream, a re-subscription (empty nonce) is answered too
    await one.send(r.LISTENER_TYPE)
    again = await one.recv()
    assert again.version_info == a.version_info
    assert again.nonce != a.nonce


def _refused(server: XdsServer, count: int) -> Callable[[], bool]:
    """A predicate: ``server`` has refused ``count`` changed files."""
    return lambda: server.reload_errors == count


async def test_bad_config_is_refused_and_the_last_good_keeps_serving(
    server: XdsServer,
    connect: Callable[[], AdsClient],
    config_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="xds_server")
    client = connect()
    await client.send(r.ENDPOINT_TYPE, names=CLUSTERS, node=True)
    first = await client.recv()
    await client.ack(first, CLUSTERS)
    doc = _doc()
    doc["models"][0]["versions"][1]["traffic_percent"] = 20
    _write(config_file, doc)
    await _until(lambda: server.reload_errors == 1, "the bad config to be refused")
    await client.expect_silence(0.3)
    assert any("models[0].versions" in rec.getMessage() for rec in caplog.records)
    late = connect()
    await late.send(r.ENDPOINT_TYPE, names=CLUSTERS, node=True)
    assert (await late.recv()).version_info == first.version_info
    # a file Envoy cannot use (an EDS host name that does not resolve: .invalid is reserved, RFC 2606) is
    # refused the same way, naming the field; and so is a file ext_proc could not serve (a tokenizer that
    # does not load): both services run the same checks
    doc = _doc()
    doc["endpoints"][0]["address"] = "gpu-0.invalid:8001"
    refusals = [
        ("endpoints[0].address", "does not resolve"),
        ("models[0].tokenizer", "cannot load tokenizer"),
    ]
    for field, why in refusals:
        _write(config_file, doc)
        await _until(
            _refused(server, server.reload_errors + 1), f"the config with a bad {field} to be refused"
        )
        assert any(field in rec.getMessage() and why in rec.getMessage() for rec in caplog.records)
        doc["endpoints"][0]["address"] = "127.0.0.1:8101"
        doc["models"][0]["tokenizer"] = "hf:/nonexistent/tokenizer.json"
    await client.expect_silence(0.3)
    del doc["models"][0]["tokenizer"]
    _write(config_file, doc)
    pushed = await client.recv()
    assert pushed.version_info != first.version_info


async def test_endpoint_host_names_are_resolved_to_ip_addresses(
    server: XdsServer, connect: Callable[[], AdsClient], config_file: Path
) -> None:
    before = server.cache.snapshot()
    assert before is not None
    doc = _doc()
    doc["endpoints"][0]["address"] = "localhost:8101"  # a name, as in the container stack (gpusim:8001)
    _write(config_file, doc)
    await _until(lambda: server.resolved_hosts == {"localhost": "127.0.0.1"}, "localhost to be resolved")
    await _until(lambda: server.cache.snapshot() is not before, "the new snapshot to be published")
    client = connect()
    await client.send(r.ENDPOINT_TYPE, names=CLUSTERS, node=True)
    resp = await client.recv()
    first = endpoint_pb2.ClusterLoadAssignment()
    assert resp.resources[0].Unpack(first)
    assert first.cluster_name == CLUSTERS[0]
    hosts = [lb for loc in first.endpoints for lb in loc.lb_endpoints]
    h100 = next(lb for lb in hosts if lb.endpoint.hostname == "h100-0")
    assert h100.endpoint.address.socket_address.address == "127.0.0.1"
    assert h100.endpoint.address.socket_address.port_value == 8101


async def test_cancelled_streams_are_cleaned_up_quietly(
    server: XdsServer, connect: Callable[[], AdsClient], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    clients = [connect() for _ in range(3)]
    for c in clients:
        await c.send(r.CLUSTER_TYPE, node=True)
        await c.recv()
    assert server.servicer.stats.streams_active == 3
    for c in clients:
        await c.close()
    await _until(lambda: server.servicer.stats.streams_active == 0, "streams to end")
    await _until(lambda: server.cache.watcher_count == 0, "watchers to be removed")
    assert server.servicer.stats.streams_opened == 3
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


async def test_gateway_tls_with_a_missing_file_is_refused_and_a_good_one_is_pushed(
    server: XdsServer,
    connect: Callable[[], AdsClient],
    config_file: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="xds_server")
    client = connect()
    await client.send(r.LISTENER_TYPE, node=True)
    first = await client.recv()
    await client.ack(first)
    ca = CertificateAuthority()
    crt, key = ca.issue("127.0.0.1").write(tmp_path, "gateway")
    doc = _doc()
    tls = {"cert_file": str(tmp_path / "missing.crt"), "key_file": str(key)}
    doc["gateway"].update(tls=tls, sds_dir=str(tmp_path / "sds"))
    _write(config_file, doc)
    await _until(_refused(server, 1), "the config naming a missing certificate to be refused")
    assert any("gateway.tls.cert_file: cannot read" in rec.getMessage() for rec in caplog.records)
    await client.expect_silence(0.3)  # the last good listener keeps serving
    tls["cert_file"] = str(crt)
    _write(config_file, doc)
    pushed = await client.recv()
    (listener,) = [listener_pb2.Listener.FromString(a.value) for a in pushed.resources]
    socket = listener.filter_chains[0].transport_socket
    assert socket.name == "envoy.transport_sockets.tls"
    assert not first.resources[0].value.count(b"envoy.transport_sockets.tls")
