"""The per-type discovery services (CDS, EDS, LDS, RDS) over real gRPC: SotW and Delta streams restricted
to their type, Fetch, and pushes shared with ADS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.route.v3 import rds_pb2_grpc

from inferlb.config.schema import default_config_path
from xds_server import resources as r
from xds_server.server import XdsServer

CLUSTERS = ["llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1"]
NODE = base_pb2.Node(id="per-type-client", cluster="inferlb-gateway")
WAIT_S = 5.0


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[XdsServer]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["xds"]["push_debounce_ms"] = 0
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    srv = XdsServer(path, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(0)


async def test_cds_sotw_stream_serves_clusters_only(server: XdsServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = cds_pb2_grpc.ClusterDiscoveryServiceStub(channel).StreamClusters()
        # per-type requests may leave type_url empty: the service knows its type
        await call.write(discovery_pb2.DiscoveryRequest(node=NODE))
        resp = await asyncio.wait_for(call.read(), WAIT_S)
        assert resp.type_url == r.CLUSTER_TYPE
        assert len(resp.resources) == len(CLUSTERS) + 2  # + the default request path: ext_authz, the settler
        await call.write(discovery_pb2.DiscoveryRequest(type_url=r.LISTENER_TYPE))  # not this service's type
        await call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=r.CLUSTER_TYPE, response_nonce=resp.nonce, version_info=resp.version_info
            )
        )
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while server.servicer.stats.acks < 1:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert server.servicer.stats.unknown_types == 1
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call.read(), 0.3)
        call.cancel()


async def test_eds_delta_stream_gets_a_push_on_a_weight_change(server: XdsServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).DeltaEndpoints()
        await call.write(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=r.ENDPOINT_TYPE, resource_names_subscribe=CLUSTERS, node=NODE
            )
        )
        first = await asyncio.wait_for(call.read(), WAIT_S)
        assert sorted(x.name for x in first.resources) == CLUSTERS
        await call.write(
            discovery_pb2.DeltaDiscoveryRequest(type_url=r.ENDPOINT_TYPE, response_nonce=first.nonce)
        )
        server.set_telemetry_weights({"127.0.0.1:8006": 42})  # qwen's H100
        push = await asyncio.wait_for(call.read(), WAIT_S)
        assert [x.name for x in push.resources] == ["qwen2.5-7b-instruct--v1"]
        (client,) = server.servicer.clients_json()
        assert client["mode"] == "delta" and list(client["types"]) == ["ClusterLoadAssignment"]
        call.cancel()


async def test_fetch_routes_answers_the_current_route_configuration(server: XdsServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = rds_pb2_grpc.RouteDiscoveryServiceStub(channel)
        resp = await stub.FetchRoutes(
            discovery_pb2.DiscoveryRequest(resource_names=[r.ROUTE_CONFIG_NAME], node=NODE), timeout=WAIT_S
        )
        (res,) = resp.resources
        rc = route_pb2.RouteConfiguration()
        assert res.Unpack(rc) and rc.name == r.ROUTE_CONFIG_NAME
        snap = server.cache.snapshot()
        assert snap is not None and resp.version_info == snap.version(r.ROUTE_TYPE)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.FetchRoutes(discovery_pb2.DiscoveryRequest(type_url=r.CLUSTER_TYPE), timeout=WAIT_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
