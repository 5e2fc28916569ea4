"""Endpoint host names are resolved again every ``xds.resolve_interval_ms``: a changed address reaches a
connected ADS client, a name that stops resolving keeps its last address."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from inferlb.config.schema import default_config_path
from xds_server import resources as r
from xds_server.server import XdsServer

QWEN = "qwen2.5-7b-instruct--v1"
WAIT_S = 5.0


class _Zone:
    """A DNS zone the test edits: name -> IP; a name missing from it does not resolve."""

    def __init__(self, records: dict[str, str]) -> None:
        self.records = records
        self.lookups = 0

    async def resolve(self, name: str) -> str:
        self.lookups += 1
        await asyncio.sleep(0)
        if name not in self.records:
            raise OSError(f"{name}: Name or service not known")
        return self.records[name]


def _config(tmp_path: Path, interval_ms: int) -> Path:
    doc: dict[str, Any] = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["xds"].update(push_debounce_ms=10, resolve_interval_ms=interval_ms, api_listen=None)
    for e in doc["endpoints"]:
        if e["name"] == "h100-1":
            e["address"] = "gpu-h100-1.test:8006"
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _addresses(cla: endpoint_pb2.ClusterLoadAssignment) -> set[str]:
    return {lb.endpoint.address.socket_address.address for loc in cla.endpoints for lb in loc.lb_endpoints}


async def _eds_updates(port: int) -> AsyncIterator[endpoint_pb2.ClusterLoadAssignment]:
    """A SotW ADS client subscribed to the qwen assignment, ACKing each response, yielding it."""
    queue: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()
    queue.put_nowait(discovery_pb2.DiscoveryRequest(type_url=r.ENDPOINT_TYPE, resource_names=[QWEN]))

    async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while True:
            yield await queue.get()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(requests())
        async for resp in call:
            queue.put_nowait(
                discovery_pb2.DiscoveryRequest(
                    type_url=r.ENDPOINT_TYPE,
                    resource_names=[QWEN],
                    version_info=resp.version_info,
                    response_nonce=resp.nonce,
                )
            )
            [packed] = resp.resources
            cla = endpoint_pb2.ClusterLoadAssignment()
            packed.Unpack(cla)
            yield cla


async def test_changed_address_is_pushed_and_a_failed_lookup_keeps_the_last_one(tmp_path: Path) -> None:
    zone = _Zone({"gpu-h100-1.test": "127.0.0.11"})
    srv = XdsServer(_config(tmp_path, 50), bind=("127.0.0.1", 0), resolve=zone.resolve, poll_interval_s=0.05)
    await srv.start()
    try:
        updates = _eds_updates(srv.port)
        first = await asyncio.wait_for(anext(updates), WAIT_S)
        assert "127.0.0.11" in _addresses(first)
        zone.records["gpu-h100-1.test"] = "127.0.0.12"  # the model server moved
        moved = await asyncio.wait_for(anext(updates), WAIT_S)
        assert "127.0.0.12" in _addresses(moved) and "127.0.0.11" not in _addresses(moved)
        assert srv.resolved_hosts["gpu-h100-1.test"] == "127.0.0.12"
        # DNS fails for a while: several lookups later the endpoint still has its last address
        del zone.records["gpu-h100-1.test"]
        seen = zone.lookups
        deadline = time.monotonic() + WAIT_S
        while zone.lookups < seen + 3:
            assert time.monotonic() < deadline, "no re-resolution"
            await asyncio.sleep(0.02)
        snap = srv.cache.snapshot()
        assert snap is not None
        cla = snap.resources[r.ENDPOINT_TYPE][QWEN].message
        assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
        assert "127.0.0.12" in _addresses(cla)
        assert srv.resolved_hosts["gpu-h100-1.test"] == "127.0.0.12"
        await updates.aclose()
    finally:
        await srv.stop(0)


async def test_resolve_interval_zero_resolves_only_at_load(tmp_path: Path) -> None:
    zone = _Zone({"gpu-h100-1.test": "127.0.0.11"})
    srv = XdsServer(_config(tmp_path, 0), bind=("127.0.0.1", 0), resolve=zone.resolve, poll_interval_s=0.02)
    await srv.start()
    try:
        loaded = zone.lookups
        await asyncio.sleep(0.3)  # 15 poll intervals
        assert zone.lookups == loaded
        # an explicit refresh still works, and reports what changed
        zone.records["gpu-h100-1.test"] = "127.0.0.13"
        assert await srv.refresh_host_addresses() == {"gpu-h100-1.test": "127.0.0.13"}
        assert await srv.refresh_host_addresses() == {}
    finally:
        await srv.stop(0)
