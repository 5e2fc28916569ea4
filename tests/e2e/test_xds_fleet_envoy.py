"""Several real Envoys (two Delta, one SotW) on one in-process xDS server: the same fleet everywhere, fleet
API changes (register, weight pin, drain shown as DRAINING, removal), a Delta NACK, clients and metrics.

The Envoys share the gateway listener port (Envoy binds listeners with SO_REUSEPORT) and each has its own
admin port. No ext_proc or model server runs: /clusters shows the hosts all the same.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2

from inferlb.config.schema import default_config_path, load_config
from inferlb.ops.stack import free_ports
from tests.e2e.conftest import spawn_envoy
from tests.e2e.test_xds_envoy import WAIT_S, _http, _poll
from xds_server import resources as r
from xds_server.bootstrap import render_bootstrap
from xds_server.fleet_state import effective_overrides
from xds_server.server import XdsServer

pytestmark = pytest.mark.e2e

TOKEN = "e2e-fleet-token-0123456789"
QWEN = "qwen2.5-7b-instruct--v1"
LLAMA = "llama-3.1-8b-instruct--v1"
CDS = r.CLUSTER_TYPE


@dataclass
class Gateway:
    node_id: str
    mode: str
    admin: str
    proc: asyncio.subprocess.Process
    log: Path

    async def get(self, path: str) -> bytes:
        status, body = await asyncio.to_thread(_http, self.admin + path)
        if status != 200:
            raise OSError(f"admin {path}: HTTP {status}")
        return body

    async def hosts(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{cluster: {hostname: {"weight": int, "eds_health": str}}}`` of the model clusters."""
        data = json.loads(await self.get("/clusters?format=json"))
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for c in data.get("cluster_statuses", []):
            if c["name"] == r.EXT_PROC_CLUSTER:
                continue
            out[c["name"]] = {
                h.get("hostname", ""): {
                    "weight": int(h.get("weight", 0)),
                    "eds_health": h.get("health_status", {}).get("eds_health_status", ""),
                }
                for h in c.get("host_statuses", [])
            }
        return out

    async def stats(self) -> dict[str, int]:
        text = (await self.get("/stats?usedonly")).decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name] = int(value)
        return out


@dataclass
class Fleet:
    xds: XdsServer
    gateways: list[Gateway]
    api: str

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.api + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    gw, xds, ext_proc, new_ep, *ports = free_ports(4 + 8 + 3)
    eps, admins = ports[:8], ports[8:]
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["gateway"].update(listen=f"127.0.0.1:{gw}", admin=f"127.0.0.1:{admins[0]}")
    doc["xds"].update(listen=f"127.0.0.1:{xds}", push_debounce_ms=50, drain_period_ms=60_000)
    doc["ext_proc"].update(listen=f"127.0.0.1:{ext_proc}", failure_mode_allow=True)
    for endpoint, port in zip(doc["endpoints"], eps, strict=True):
        endpoint["address"] = f"127.0.0.1:{port}"
    config_file = tmp_path / "inferlb.yaml"
    config_file.write_text(yaml.safe_dump(doc), encoding="utf-8")
    server = XdsServer(config_file, poll_interval_s=0.1, api_bind=("127.0.0.1", 0), api_token=TOKEN)
    await server.start()
    config = load_config(config_file)
    gateways: list[Gateway] = []
    try:
        for i, (mode, admin) in enumerate(zip(("delta", "delta", "sotw"), admins, strict=True)):
            node_id = f"e2e-{mode}-{i}"
            boot = render_bootstrap(config, node_id=node_id, mode=mode)  # type: ignore[arg-type]
            boot["admin"]["address"]["socket_address"]["port_value"] = admin
            path = tmp_path / f"bootstrap-{i}.yaml"
            path.write_text(yaml.safe_dump(boot), encoding="utf-8")
            log = tmp_path / f"envoy-{i}.log"
            proc = await spawn_envoy(path, log)
            gateways.append(Gateway(node_id, mode, f"http://127.0.0.1:{admin}", proc, log))
        fleet = Fleet(server, gateways, f"http://127.0.0.1:{server.api_port}")
        fleet.new_endpoint = f"127.0.0.1:{new_ep}"  # type: ignore[attr-defined]
        yield fleet
    finally:
        for g in gateways:
            if g.proc.returncode is None:
                g.proc.kill()
            await asyncio.wait_for(g.proc.wait(), WAIT_S)
        await server.stop(0)


async def _all(fleet: Fleet, ok: Any, what: str, timeout_s: float = WAIT_S) -> None:
    for g in fleet.gateways:
        await _poll(g.hosts, ok, f"{what} on {g.node_id}", timeout_s)


async def test_sotw_and_delta_envoys_follow_fleet_api_changes(fleet: Fleet) -> None:
    await _all(fleet, lambda h: h.get(QWEN, {}).get("h100-1", {}).get("weight") == 34, "the config fleet")

    # the server lists the three Envoys with what each ACKed, and counts streams by mode
    async def clients() -> list[dict[str, Any]]:
        status, body = await asyncio.to_thread(fleet.call, "GET", "/v1/clients")
        assert status == 200
        return list(body["clients"])

    snap = fleet.xds.cache.snapshot()
    assert snap is not None
    eds_version = snap.version(r.ENDPOINT_TYPE)
    listed = await _poll(
        clients,
        lambda cs: (
            len(cs) == 3
            and all(
                c["types"].get("ClusterLoadAssignment", {}).get("acked_version") == eds_version for c in cs
            )
        ),
        "three clients with the current EDS version ACKed",
    )
    assert sorted((c["node_id"], c["mode"]) for c in listed) == [
        ("e2e-delta-0", "delta"), ("e2e-delta-1", "delta"), ("e2e-sotw-2", "sotw"),
    ]  # fmt: skip
    status, metrics = await asyncio.to_thread(_http, fleet.api + "/metrics")
    assert status == 200
    assert 'inferlb_xds_streams{mode="delta"} 2.0' in metrics.decode()
    assert 'inferlb_xds_streams{mode="sotw"} 1.0' in metrics.decode()

    # register a GPU: every Envoy gets it with its capacity weight
    new = fleet.new_endpoint  # type: ignore[attr-defined]
    status, body = await asyncio.to_thread(
        fleet.call, "POST", "/v1/endpoints",
        {"address": new, "model": "qwen2.5-7b-instruct", "gpu": "H100", "name": "h100-new", "zone": "b"},
    )  # fmt: skip
    assert status == 201, body
    await _all(fleet, lambda h: h.get(QWEN, {}).get("h100-new", {}).get("weight") == 34, "the registered GPU")

    # pin a weight; a bad pin is refused with the field named
    key = fleet.xds.config.endpoints[0].address  # type: ignore[union-attr]
    status, _ = await asyncio.to_thread(fleet.call, "PUT", f"/v1/endpoints/{key}/weight", {"weight": 99})
    assert status == 200
    status, body = await asyncio.to_thread(fleet.call, "PUT", f"/v1/endpoints/{key}/weight", {"weight": 0})
    assert status == 400 and body["error"]["param"] == "weight"
    await _all(fleet, lambda h: h.get(LLAMA, {}).get("h100-0", {}).get("weight") == 99, "the pinned weight")

    # drain: DRAINING in every Envoy's /clusters, then removed when the (short) drain period ends
    status, body = await asyncio.to_thread(
        fleet.call, "POST", f"/v1/endpoints/{new}/drain", {"drain_ms": 2500}
    )
    assert status == 202 and body["draining"] is True
    await _all(
        fleet, lambda h: h.get(QWEN, {}).get("h100-new", {}).get("eds_health") == "DRAINING", "DRAINING"
    )
    await _all(fleet, lambda h: "h100-new" not in h.get(QWEN, {"h100-new": 1}), "the drained GPU removed")
    status, _ = await asyncio.to_thread(fleet.call, "DELETE", f"/v1/endpoints/{new}")
    assert status == 404  # already gone

    # a cluster every Envoy must reject: the Delta ones NACK it, it is counted and not resent, and the
    # last good clusters keep serving
    assert fleet.xds.effective is not None
    overrides = effective_overrides(fleet.xds.fleet, fleet.xds.telemetry_weights)
    res = r.build_resources(fleet.xds.effective, resolved_hosts=fleet.xds.resolved_hosts, overrides=overrides)
    clusters = dict(res.by_type[r.CLUSTER_TYPE])
    bad = cluster_pb2.Cluster()
    bad.CopyFrom(clusters[LLAMA])
    bad.least_request_lb_config.choice_count.value = 1
    clusters[LLAMA] = bad
    fleet.xds.cache.set_resources(r.XdsResources(by_type={**res.by_type, r.CLUSTER_TYPE: clusters}))
    for g in fleet.gateways:
        await _poll(g.stats, lambda s: s.get("cluster_manager.cds.update_rejected") == 1, f"{g.node_id} NACK")
    stats = fleet.xds.servicer.stats
    await _poll(
        lambda: asyncio.sleep(0, (stats.nacks_by[("delta", CDS)], stats.nacks_by[("sotw", CDS)])),
        lambda n: n == (2, 1),
        "two Delta NACKs and one SotW NACK",
    )
    sent = stats.responses_sent
    await asyncio.sleep(1.0)  # a NACK loop would resend within milliseconds
    assert stats.responses_sent == sent
    listed = await clients()
    assert all(c["last_nack"] and c["last_nack"]["type"] == "Cluster" for c in listed)
    await _all(fleet, lambda h: h.get(LLAMA, {}).get("h100-0", {}).get("weight") == 99, "the last good fleet")

    # the next good change is taken by all
    status, _ = await asyncio.to_thread(fleet.call, "PUT", f"/v1/endpoints/{key}/weight", {"weight": None})
    assert status == 200
    await _all(fleet, lambda h: h.get(LLAMA, {}).get("h100-0", {}).get("weight") == 34, "the unpinned weight")
    for g in fleet.gateways:
        s = await g.stats()
        assert s["cluster_manager.cds.update_rejected"] == 1
        assert s.get("cluster_manager.warming_clusters", 0) == 0
        assert g.proc.returncode is None, g.log.read_text(errors="replace")
