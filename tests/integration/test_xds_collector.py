"""The xDS server's telemetry loop over loopback: simulated GPUs scraped (``/metrics``, ``/sim/telemetry``),
an agent's report through the authenticated intake, weights handed to the snapshot, stale telemetry falling
back to the profile weight, ``GET /v1/weights``, failures counted in ``/metrics``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from envoy.config.endpoint.v3 import endpoint_pb2

from inferlb.config.schema import parse_config
from inferlb.ops.stack import free_ports
from simulation.gpusim.faults import FaultCommand
from simulation.gpusim.server import SimulatedEndpoint
from tests.conftest import wait_until
from xds_server import resources as r
from xds_server.collector import TelemetryCollector
from xds_server.server import XdsServer

TOKEN = "telemetry-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "m"
CLUSTER = "m--v1"
WAIT_S = 8.0


def _doc(mode: str = "telemetry", *, extra_endpoint: int | None = None) -> dict[str, Any]:
    ports = free_ports(5)
    doc: dict[str, Any] = {
        "xds": {
            "listen": f"127.0.0.1:{ports[0]}",
            "api_listen": f"127.0.0.1:{ports[1]}",
            "push_debounce_ms": 20,
        },
        "simulation": {"prefill_tokens_per_s": 1_000_000, "decode_tokens_per_s": 2_000, "max_batch": 8},
        "models": [{"name": MODEL}],
        "weights": {"mode": mode, "stale_after_ms": 1_000, "smoothing_tau_ms": 200, "slow_start_ms": 5_000},
        "telemetry": {"scrape_interval_ms": 100, "scrape_timeout_ms": 500},
        "endpoints": [
            {
                "name": "h100",
                "address": f"127.0.0.1:{ports[2]}",
                "model": MODEL,
                "gpu": "H100",
                "simulated": True,
            },
            {
                "name": "a100",
                "address": f"127.0.0.1:{ports[3]}",
                "model": MODEL,
                "gpu": "A100",
                "simulated": True,
            },
            # a real (not simulated) server on a node whose agent reports GPU 1; nothing listens there
            {
                "name": "v100",
                "address": f"127.0.0.1:{ports[4]}",
                "model": MODEL,
                "gpu": "V100",
                "gpu_node": "node-7",
                "gpu_index": 1,
            },
        ],
    }
    return doc


@dataclass
class Running:
    server: XdsServer
    collector: TelemetryCollector
    sims: dict[str, SimulatedEndpoint]
    api: str
    http: aiohttp.ClientSession
    keys: dict[str, str]
    path: Path


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    await wait_until(predicate, what, timeout_s, poll_s=0.02)


def _snapshot_weights(server: XdsServer) -> dict[str, int]:
    snap = server.cache.snapshot()
    assert snap is not None
    cla = snap.resources[r.ENDPOINT_TYPE][CLUSTER].message
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    out = {}
    for loc in cla.endpoints:
        for lb in loc.lb_endpoints:
            sa = lb.endpoint.address.socket_address
            out[f"{sa.address}:{sa.port_value}"] = lb.load_balancing_weight.value
    return out


@contextlib.asynccontextmanager
async def _start(tmp_path: Path, doc: dict[str, Any]) -> AsyncIterator[Running]:
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    config = parse_config(doc)
    sims: dict[str, SimulatedEndpoint] = {}
    for e in config.endpoints:
        if e.simulated:
            sim = SimulatedEndpoint(config=config, endpoint=e)
            await sim.start(host=e.address.host, port=e.address.port)
            sims[e.display_name] = sim
    collector = TelemetryCollector()
    server = XdsServer(path, api_token=TOKEN, api_routes=collector.routes())
    await server.start()
    await collector.start(server)
    http = aiohttp.ClientSession()
    try:
        yield Running(
            server=server,
            collector=collector,
            sims=sims,
            api=f"http://127.0.0.1:{server.api_port}",
            http=http,
            keys={e.display_name: str(e.address) for e in config.endpoints},
            path=path,
        )
    finally:
        await http.close()
        await collector.stop()
        await server.stop(0)
        for sim in sims.values():
            await sim.stop()


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    async with _start(tmp_path, _doc()) as run:
        yield run


async def _weights(run: Running) -> dict[str, dict[str, Any]]:
    async with run.http.get(f"{run.api}/v1/weights", headers=AUTH) as resp:
        assert resp.status == 200
        body = await resp.json()
    return {row["name"]: row for row in body["endpoints"]}


async def test_fresh_scrapes_give_every_endpoint_its_profile_weight_on_one_scale(running: Running) -> None:
    run = running
    await _until(lambda: run.collector.cycles >= 3, "three telemetry periods")
    rows = await _weights(run)
    # idle, healthy simulated GPUs: fresh telemetry, factors 1 (load ~1), weight = 100 x capacity
    assert rows["h100"]["factors"]["fresh"] is True and rows["h100"]["gpu_source"] == "sim"
    assert rows["h100"]["served_weight"] == 340 and rows["h100"]["weight_source"] == "telemetry"
    assert rows["a100"]["served_weight"] == 170
    # the V100 has no server and no agent yet: never scraped, profile weight on the telemetry scale (not 10)
    assert rows["v100"]["factors"]["fresh"] is False
    assert rows["v100"]["served_weight"] == 100 and rows["v100"]["capacity_weight"] == 10
    assert rows["v100"]["scrape_failures"] >= 1 and "ClientConnector" in (rows["v100"]["last_error"] or "")
    await _until(
        lambda: _snapshot_weights(run.server).get(run.keys["v100"]) == 100, "the snapshot on the 100 scale"
    )
    assert _snapshot_weights(run.server)[run.keys["h100"]] == 340
    async with run.http.get(f"{run.api}/metrics") as resp:
        text = await resp.text()
    assert (
        f'inferlb_telemetry_scrape_failures_total{{endpoint="{run.keys["v100"]}",source="metrics"}}' in text
    )
    assert f'inferlb_telemetry_weight{{cluster="{CLUSTER}",endpoint="{run.keys["h100"]}"}} 340.0' in text


async def test_a_throttled_gpu_loses_weight_and_gets_it_back(running: Running) -> None:
    run = running
    await _until(lambda: run.collector.cycles >= 2, "two telemetry periods")
    key = run.keys["h100"]
    run.sims["h100"].apply_fault(FaultCommand(action="throttle", factor=2.0))
    await _until(lambda: run.server.telemetry_weights.get(key, 999) <= 200, "the throttled H100 near half")
    await _until(lambda: _snapshot_weights(run.server)[key] <= 200, "the snapshot to follow")
    rows = await _weights(run)
    assert rows["h100"]["factors"]["throttle"] == 0.5 and rows["h100"]["inputs"]["thermal_throttled"] is True
    assert rows["a100"]["served_weight"] == 170  # the others do not move
    run.sims["h100"].apply_fault(FaultCommand(action="recover"))
    await _until(lambda: run.server.telemetry_weights.get(key, 0) >= 306, "the H100 back within 10%")


async def test_muted_telemetry_falls_back_to_the_profile_weight_never_zero(running: Running) -> None:
    run = running
    key = run.keys["a100"]
    run.sims["a100"].apply_fault(FaultCommand(action="throttle", factor=4.0))
    await _until(lambda: run.server.telemetry_weights.get(key, 999) <= 60, "the throttled A100 at ~1/4")
    run.sims["a100"].apply_fault(FaultCommand(action="mute"))
    seen: list[int] = []

    def back_to_profile() -> bool:
        seen.append(run.server.telemetry_weights.get(key, 0))
        return seen[-1] == 170

    await _until(back_to_profile, "stale telemetry -> profile weight 170")
    assert min(seen) >= 1
    rows = await _weights(run)
    assert rows["a100"]["factors"]["fresh"] is False and "503" in (rows["a100"]["last_error"] or "")


async def test_an_agent_report_feeds_its_endpoint_through_the_authenticated_intake(running: Running) -> None:
    run = running
    url = f"{run.api}/v1/telemetry/gpu"
    gpu = {
        "index": 1, "uuid": "GPU-real-1", "name": "Tesla V100", "utilization_percent": 50.0,
        "memory_used_bytes": 1, "memory_total_bytes": 2, "temperature_c": 90.0, "throttle_reasons": 0x20,
        "sm_clock_mhz": 765.0, "max_sm_clock_mhz": 1530.0,
    }  # fmt: skip
    other = {**gpu, "index": 0, "uuid": "GPU-real-0"}
    body = {"node": "node-7", "sent_at": time.time(), "gpus": [other, gpu]}
    async with run.http.post(url, json=body) as resp:
        assert resp.status == 401
    async with run.http.post(url, json={**body, "gpus": [{**gpu, "uuid": 5}]}, headers=AUTH) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "gpus[0].uuid"
    async with run.http.post(url, data=b"{not json", headers=AUTH) as resp:
        assert resp.status == 400
    async with run.http.post(url, json=body, headers=AUTH) as resp:
        assert resp.status == 202
        answer = await resp.json()
    assert answer == {"matched": {"GPU-real-1": run.keys["v100"]}, "unmatched": ["GPU-real-0"]}
    key = run.keys["v100"]
    # only the GPU half the speed (clock 765/1530): 100 -> ~50, though its /metrics is never reachable
    await _until(lambda: run.server.telemetry_weights.get(key, 999) <= 60, "the reported V100 near half")
    rows = await _weights(run)
    assert rows["v100"]["gpu_source"] == "agent" and rows["v100"]["gpu_telemetry"]["node"] == "node-7"
    assert rows["v100"]["factors"]["fresh"] is True
    # no further report: after stale_after_ms (1 s) it is back at its profile weight
    await _until(lambda: run.server.telemetry_weights.get(key) == 100, "the V100 back at 100 once stale")


async def test_static_mode_collects_nothing_and_pushes_capacity_weights(tmp_path: Path) -> None:
    async with _start(tmp_path, _doc("static")) as run:
        await _until(lambda: run.collector.cycles >= 3, "three telemetry periods")
        run.sims["h100"].apply_fault(FaultCommand(action="throttle", factor=2.0))
        cycles = run.collector.cycles
        await _until(lambda: run.collector.cycles >= cycles + 3, "three more periods")
        # static weights need no telemetry: nothing is scraped (at 10,000 endpoints scraping in the xDS
        # server's loop slowed pushes ~30x), nothing is computed, the capacity weight is served
        assert run.collector.scrapes == {} and run.collector.last == {}
        assert run.server.telemetry_weights == {}
        assert _snapshot_weights(run.server)[run.keys["h100"]] == 34  # the static capacity weight
        rows = await _weights(run)
        assert rows["h100"]["weight_source"] == "capacity"
        # a fleet API pin wins in either mode
        async with run.http.put(
            f"{run.api}/v1/endpoints/{run.keys['a100']}/weight", json={"weight": 7}, headers=AUTH
        ) as resp:
            assert resp.status == 200
        rows = await _weights(run)
        assert rows["a100"]["served_weight"] == 7 and rows["a100"]["weight_source"] == "pin"
