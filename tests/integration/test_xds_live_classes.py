"""Live length classes over loopback (:mod:`xds_server.collector`): a tiered model's simulated H100 throttles,
its held performance falls, the longest class's set takes in the A100, the snapshot's EDS metadata and
``GET /v1/weights`` show it, and recovery restores the profile's classes; static mode keeps them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from envoy.config.endpoint.v3 import endpoint_pb2

from simulation.gpusim.faults import FaultCommand
from tests.integration.test_xds_collector import CLUSTER, MODEL, Running, _doc, _start, _until, _weights
from tests.unit.test_length_aware_live import _classes_by_name
from xds_server import resources as r

TIERS = [
    {"above_output_tokens": 800, "min_relative_capacity": 3.4},
    {"above_output_tokens": 300, "min_relative_capacity": 1.7},
]


def _tiered_doc(mode: str) -> dict[str, Any]:
    doc = _doc(mode)
    doc["models"] = [{"name": MODEL, "cluster": {"length_aware": {"tiers": TIERS}}}]
    # a second simulated H100 in place of the unreachable V100, and a simulated V100
    h100, a100, v100 = doc["endpoints"]
    h100b = {**h100, "name": "h100b", "address": v100["address"]}
    port = int(v100["address"].rsplit(":", 1)[1])
    v100 = {"name": "v100", "address": f"127.0.0.1:{port + 1000}", "model": MODEL, "gpu": "V100"}
    v100["simulated"] = True
    doc["endpoints"] = [h100, h100b, a100, v100]
    return doc


def _snapshot_classes(run: Running) -> dict[str, list[str]]:
    snap = run.server.cache.snapshot()
    assert snap is not None
    cla = snap.resources[r.ENDPOINT_TYPE][CLUSTER].message
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    return _classes_by_name(cla)


PROFILE = {
    "h100": ["long-0", "long-1"],
    "h100b": ["long-0", "long-1"],
    "a100": ["long-1"],
    "v100": [],
}


async def test_a_throttled_h100_brings_the_a100_into_the_longest_class_and_back(tmp_path: Path) -> None:
    async with _start(tmp_path, _tiered_doc("telemetry")) as run:
        await _until(lambda: run.collector.cycles >= 3, "three telemetry periods")
        assert _snapshot_classes(run) == PROFILE
        assert run.server.telemetry_classes == {}
        run.sims["h100"].apply_fault(FaultCommand(action="throttle", factor=2.0))
        await _until(lambda: _snapshot_classes(run)["a100"] == ["long-0", "long-1"], "the A100 in long-0")
        # 3.4 + 1.7 (the throttled H100) + 1.7 = 6.8, long-0's nominal capacity; long-1 (8.5) needs all
        assert _snapshot_classes(run) == {**PROFILE, "a100": ["long-0", "long-1"], "v100": ["long-1"]}
        await _until(lambda: run.collector.last[run.keys["h100"]].held_performance < 0.6, "held ~0.5")
        rows = await _weights(run)
        assert rows["a100"]["length_classes"] == ["long-0", "long-1"]
        assert rows["a100"]["profile_classes"] == ["long-1"]
        assert rows["h100b"]["held_performance"] == 1.0
        run.sims["h100"].apply_fault(FaultCommand(action="recover"))
        await _until(lambda: _snapshot_classes(run) == PROFILE, "the profile's classes after recovery")
        await _until(lambda: run.server.telemetry_classes == {}, "no live override left")


async def test_static_mode_keeps_the_profile_classes(tmp_path: Path) -> None:
    async with _start(tmp_path, _tiered_doc("static")) as run:
        run.sims["h100"].apply_fault(FaultCommand(action="throttle", factor=2.0))
        await _until(lambda: run.collector.cycles >= 5, "five telemetry periods")
        assert _snapshot_classes(run) == PROFILE
        rows = await _weights(run)
        assert rows["a100"]["length_classes"] is None  # nothing computed in static mode
