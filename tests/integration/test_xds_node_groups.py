"""Snapshots per node group: Envoys of different node clusters (zones) get their own failover priorities,
and fall back to the default snapshot when their group leaves the config."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from inferlb.config.schema import default_config_path
from tests.conftest import wait_until
from xds_server import resources as r
from xds_server.cache import DEFAULT_GROUP
from xds_server.server import XdsServer

QWEN = "qwen2.5-7b-instruct--v1"
WAIT_S = 5.0


def _doc(groups: bool) -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["xds"]["push_debounce_ms"] = 10
    if groups:
        doc["xds"]["node_groups"] = {"gateways-zone-b": {"region": "local", "zone": "b"}}
    doc["models"][1]["cluster"] = {"failover": "zone"}
    return doc


async def _until(predicate: Callable[[], bool], what: str) -> None:
    await wait_until(predicate, what, WAIT_S, poll_s=0.02)


def _priorities(resp: discovery_pb2.DeltaDiscoveryResponse) -> dict[str, int]:
    cla = endpoint_pb2.ClusterLoadAssignment()
    assert resp.resources[0].resource.Unpack(cla)
    return {lb.endpoint.hostname: loc.priority for loc in cla.endpoints for lb in loc.lb_endpoints}


async def test_each_node_group_gets_its_own_priorities(tmp_path: Path) -> None:
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(_doc(groups=True)), encoding="utf-8")
    server = XdsServer(path, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), poll_interval_s=0.05)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    calls = []
    try:
        assert sorted(server.cache.groups()) == sorted([DEFAULT_GROUP, "gateways-zone-b"])
        first: dict[str, discovery_pb2.DeltaDiscoveryResponse] = {}
        for cluster in ("inferlb-gateway", "gateways-zone-b"):
            call = stub.DeltaAggregatedResources()
            calls.append(call)
            await call.write(
                discovery_pb2.DeltaDiscoveryRequest(
                    type_url=r.ENDPOINT_TYPE,
                    resource_names_subscribe=[QWEN],
                    node=base_pb2.Node(id=f"gw-{cluster}", cluster=cluster),
                )
            )
            first[cluster] = await asyncio.wait_for(call.read(), WAIT_S)
            await call.write(
                discovery_pb2.DeltaDiscoveryRequest(
                    type_url=r.ENDPOINT_TYPE, response_nonce=first[cluster].nonce
                )
            )
        # qwen: h100-1 in zone a, v100-1 and v100-2 in zone b (the default config)
        assert _priorities(first["inferlb-gateway"]) == {"h100-1": 0, "v100-1": 1, "v100-2": 1}
        assert _priorities(first["gateways-zone-b"]) == {"h100-1": 1, "v100-1": 0, "v100-2": 0}

        # the group leaves the config: its Envoys move to the default snapshot
        path.write_text(yaml.safe_dump(_doc(groups=False)), encoding="utf-8")
        moved = await asyncio.wait_for(calls[1].read(), WAIT_S)
        assert _priorities(moved) == {"h100-1": 0, "v100-1": 1, "v100-2": 1}
        await _until(lambda: server.cache.groups() == [DEFAULT_GROUP], "the group dropped")
    finally:
        for call in calls:
            call.cancel()
        await channel.close()
        await server.stop(0)
