"""A real Envoy (Delta ADS) takes a model's zone failover priorities, locality weights, active HTTP health
checks and slow start from the config: /clusters shows each host's priority and health-check state.

Three small aiohttp servers stand in for one model's GPUs, one per locality (the gateway's own zone, the
region's other zone, another region); the own-zone one fails its /health first, then recovers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from inferlb.config.schema import default_config_path, load_config
from inferlb.ops.stack import free_ports
from tests.e2e.conftest import spawn_envoy
from tests.e2e.test_xds_envoy import WAIT_S, _http, _poll
from xds_server.bootstrap import render_bootstrap
from xds_server.server import XdsServer

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct--v1"


class HealthServers:
    """One aiohttp app per port answering ``GET /health`` with the status set for that port."""

    def __init__(self) -> None:
        self.status: dict[int, int] = {}
        self.checks: dict[int, int] = {}
        self._runners: list[web.AppRunner] = []

    async def start(self, port: int, status: int) -> None:
        self.status[port] = status
        self.checks[port] = 0

        async def health(_request: web.Request) -> web.Response:
            self.checks[port] += 1
            return web.json_response({"status": "ok"}, status=self.status[port])

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self._runners.append(runner)

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


@pytest.fixture
async def health() -> AsyncIterator[HealthServers]:
    servers = HealthServers()
    try:
        yield servers
    finally:
        await servers.stop()


async def test_failover_priorities_health_checks_and_slow_start_reach_envoy(
    tmp_path: Path, health: HealthServers
) -> None:
    gw, admin, xds, ext_proc, *eps = free_ports(4 + 8)
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["gateway"].update(listen=f"127.0.0.1:{gw}", admin=f"127.0.0.1:{admin}", region="eu", zone="a")
    doc["xds"].update(listen=f"127.0.0.1:{xds}", push_debounce_ms=20)
    # response metering on: Envoy must take the ext_proc filter with response headers SEND, body STREAMED
    doc["ext_proc"].update(listen=f"127.0.0.1:{ext_proc}", failure_mode_allow=True, account_responses=True)
    for endpoint, port in zip(doc["endpoints"], eps, strict=True):
        endpoint["address"] = f"127.0.0.1:{port}"
    doc["models"][1]["cluster"] = {
        "failover": "zone",
        "locality_weighted": True,
        "health_check": {
            "path": "/health",
            "interval_ms": 300,
            "interval_jitter_ms": 0,
            "no_traffic_interval_ms": 300,
            "unhealthy_threshold": 1,
        },
        "slow_start_window_ms": 20_000,
    }
    qwen = [e for e in doc["endpoints"] if e["model"] == "qwen2.5-7b-instruct"]
    for e, (region, zone) in zip(qwen, [("eu", "a"), ("eu", "b"), ("us", "a")], strict=True):
        e.update(region=region, zone=zone)
    ports = {e["name"]: int(e["address"].rsplit(":", 1)[1]) for e in qwen}
    await health.start(ports["h100-1"], 503)  # the gateway's own zone is failing its health check
    await health.start(ports["v100-1"], 200)
    await health.start(ports["v100-2"], 200)

    config_file = tmp_path / "inferlb.yaml"
    config_file.write_text(yaml.safe_dump(doc), encoding="utf-8")
    server = XdsServer(config_file, poll_interval_s=0.1, api_bind=("127.0.0.1", 0))
    await server.start()
    boot = tmp_path / "bootstrap.yaml"
    boot.write_text(
        yaml.safe_dump(render_bootstrap(load_config(config_file), node_id="e2e-locality", mode="delta"))
    )
    log = tmp_path / "envoy.log"
    envoy = await spawn_envoy(boot, log)

    async def hosts() -> dict[str, dict[str, Any]]:
        status, body = await asyncio.to_thread(_http, f"http://127.0.0.1:{admin}/clusters?format=json")
        if status != 200:
            raise OSError(f"HTTP {status}")
        for c in json.loads(body).get("cluster_statuses", []):
            if c["name"] == QWEN:
                return {
                    h.get("hostname", ""): {
                        "priority": int(h.get("priority", 0)),
                        "failed_hc": bool(h.get("health_status", {}).get("failed_active_health_check")),
                        "weight": int(h.get("weight", 0)),
                    }
                    for h in c.get("host_statuses", [])
                }
        return {}

    try:
        seen = await _poll(
            hosts,
            lambda h: len(h) == 3 and h["h100-1"]["failed_hc"] and not h["v100-1"]["failed_hc"],
            "the own-zone GPU failing its health check, the others healthy",
        )
        assert {n: v["priority"] for n, v in seen.items()} == {"h100-1": 0, "v100-1": 1, "v100-2": 2}
        assert not seen["v100-2"]["failed_hc"]
        assert health.checks[ports["v100-2"]] > 0  # Envoy really called /health

        dump = json.loads(
            (
                await asyncio.to_thread(
                    _http, f"http://127.0.0.1:{admin}/config_dump?resource=dynamic_active_clusters"
                )
            )[1]
        )
        cluster = next(e["cluster"] for e in dump["configs"] if e["cluster"]["name"] == QWEN)
        assert cluster["least_request_lb_config"]["slow_start_config"]["slow_start_window"] == "20s"
        assert "locality_weighted_lb_config" in cluster["common_lb_config"]
        assert cluster["health_checks"][0]["http_health_check"]["path"] == "/health"

        # the own zone recovers: its GPU passes the next check
        health.status[ports["h100-1"]] = 200
        await _poll(hosts, lambda h: not h["h100-1"]["failed_hc"], "the own-zone GPU healthy again")
        assert server.servicer.stats.nacks == 0  # the listener (metering ext_proc) and clusters were taken
        assert envoy.returncode is None, log.read_text(errors="replace")
    finally:
        if envoy.returncode is None:
            envoy.kill()
        await asyncio.wait_for(envoy.wait(), WAIT_S)
        await server.stop(0)
