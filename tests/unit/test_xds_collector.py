"""The telemetry loop's pure parts: matching GPU reports to endpoints, the policy step over a fleet (one
scale, stale fallback, slow start), the status join, and gpusim's mute fault."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from inferlb.config.schema import Config, parse_config
from inferlb.ops.status import HostRow, weight_rows, weights_table
from inferlb.policy.telemetry import GpuTelemetry, ServerMetrics
from simulation.gpusim.faults import FaultCommand, FaultState, parse_fault_command
from xds_server.collector import GpuSample, ServerSample, TelemetryCollector, gpu_match_keys, match_gpus


def _config(**weights: Any) -> Config:
    return parse_config(
        {
            "models": [
                {"name": "m"},
                {"name": "ss", "cluster": {"slow_start_window_ms": 30_000}},
            ],
            "weights": {"mode": "telemetry", **weights},
            "endpoints": [
                {"address": "10.0.0.1:8000", "model": "m", "gpu": "H100"},
                {"address": "10.0.0.2:8000", "model": "m", "gpu": "V100", "gpu_node": "n2", "gpu_index": 3},
                {"address": "10.0.0.3:8000", "model": "m", "gpu": "A100", "gpu_uuid": "GPU-abc"},
                {"address": "10.0.0.4:8000", "model": "ss", "gpu": "A100"},
            ],
        }
    )


def _gpu(index: int, uuid: str, *, clock: float | None = None) -> GpuTelemetry:
    return GpuTelemetry(
        index=index, uuid=uuid, name="g", utilization_percent=0.0, memory_used_bytes=0,
        memory_total_bytes=1, temperature_c=40.0, sm_clock_mhz=clock,
        max_sm_clock_mhz=1000.0 if clock else None,
    )  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _collector(config: Config) -> tuple[TelemetryCollector, Clock, SimpleNamespace]:
    clock = Clock()
    c = TelemetryCollector(clock=clock)
    server = SimpleNamespace(effective=config, resolved_hosts={})
    c._server = server  # type: ignore[assignment]  # compute() only reads .effective
    return c, clock, server


def test_gpus_match_by_uuid_else_node_and_index() -> None:
    cfg = _config()
    assert gpu_match_keys(cfg.endpoints[0]) == (None, ("10.0.0.1", 0))
    assert gpu_match_keys(cfg.endpoints[1]) == (None, ("n2", 3))
    matched, unmatched = match_gpus(
        cfg.endpoints, "n2", [_gpu(3, "GPU-x"), _gpu(0, "GPU-abc"), _gpu(1, "GPU-y")]
    )
    assert set(matched) == {"10.0.0.2:8000", "10.0.0.3:8000"}
    assert matched["10.0.0.3:8000"].uuid == "GPU-abc"  # by UUID whatever the node
    assert unmatched == ["GPU-y"]
    # the address's host is the default node: an agent run with --node 10.0.0.1 feeds endpoint 0
    matched, _ = match_gpus(cfg.endpoints, "10.0.0.1", [_gpu(0, "GPU-z")])
    assert set(matched) == {"10.0.0.1:8000"}


def test_no_telemetry_gives_profile_weights_on_the_telemetry_scale_without_a_ramp_at_start() -> None:
    c, clock, _ = _collector(_config())
    out = c.compute(clock())
    assert {k: w.weight for k, w in out.items()} == {
        "10.0.0.1:8000": 340, "10.0.0.2:8000": 100, "10.0.0.3:8000": 170, "10.0.0.4:8000": 170,
    }  # fmt: skip
    assert not any(w.breakdown.fresh for w in out.values())


def test_an_endpoint_added_later_ramps_unless_envoy_slow_start_is_on() -> None:
    full = _config()
    first = full.model_copy(update={"endpoints": full.endpoints[:1]})
    c, clock, server = _collector(first)
    c.compute(clock())
    server.effective = full
    clock.t += 1.0
    out = c.compute(clock())
    assert out["10.0.0.2:8000"].weight == 10  # 10% of 100: slow_start_min_percent
    assert out["10.0.0.4:8000"].weight == 170  # model "ss" has Envoy's slow_start_config: no second ramp
    clock.t += 10.0
    assert c.compute(clock())["10.0.0.2:8000"].weight == 100


def test_fresh_throttle_lowers_a_weight_and_stale_telemetry_restores_the_profile() -> None:
    c, clock, _ = _collector(_config(stale_after_ms=2_000, smoothing_tau_ms=0))
    key = "10.0.0.1:8000"
    c.compute(clock())
    c.gpus[key] = GpuSample(gpu=_gpu(0, "G", clock=500.0), at=clock(), source="agent", node="10.0.0.1")
    c.servers[key] = ServerSample(
        metrics=ServerMetrics(family="vllm", waiting_requests=0, running_requests=0), at=clock(),
        generation_tokens_per_s=None,
    )  # fmt: skip
    clock.t += 0.5
    w = c.compute(clock())[key]
    assert w.breakdown.fresh and w.breakdown.throttle == 0.5 and w.weight == 170
    clock.t += 2.0  # both samples now 2.5 s old > 2 s
    w = c.compute(clock())[key]
    assert not w.breakdown.fresh and w.weight == 340


@given(
    waiting=st.integers(0, 500),
    running=st.integers(0, 300),
    kv=st.floats(0, 1),
    clock_mhz=st.floats(1, 1000),
    age=st.floats(0, 100),
)
def test_weights_are_never_below_one(
    waiting: int, running: int, kv: float, clock_mhz: float, age: float
) -> None:
    c, clock, _ = _collector(_config())
    key = "10.0.0.2:8000"
    c.gpus[key] = GpuSample(gpu=_gpu(3, "G", clock=clock_mhz), at=clock() - age, source="agent", node="n2")
    c.servers[key] = ServerSample(
        metrics=ServerMetrics(
            family="vllm", waiting_requests=waiting, running_requests=running, kv_cache_usage=kv
        ),
        at=clock() - age, generation_tokens_per_s=None,
    )  # fmt: skip
    for _ in range(3):
        assert min(w.weight for w in c.compute(clock()).values()) >= 1
        clock.t += 0.5


def test_endpoints_that_leave_the_fleet_are_forgotten() -> None:
    full = _config()
    c, clock, server = _collector(full)
    c.compute(clock())
    c.gpus["10.0.0.4:8000"] = GpuSample(gpu=_gpu(0, "G"), at=clock(), source="agent", node="x")
    server.effective = full.model_copy(update={"endpoints": full.endpoints[:2]})
    out = c.compute(clock())
    assert set(out) == set(c.states) == {"10.0.0.1:8000", "10.0.0.2:8000"} and not c.gpus


def _host(address: str, weight: int) -> HostRow:
    return HostRow(
        cluster="m--v1", address=address, name=address, gpu="H100", weight=weight, weight_share=1.0,
        health="healthy", rq_active=0, rq_total=0, rq_error=0,
    )  # fmt: skip


def test_status_joins_the_weights_with_envoys_view() -> None:
    body = {
        "mode": "telemetry",
        "endpoints": [
            {
                "key": "10.0.0.1:8000", "name": "h", "gpu": "H100", "cluster": "m--v1", "served_weight": 170,
                "weight_source": "telemetry", "policy_weight": 170, "profile_weight": 340,
                "inputs": {"waiting_requests": 3, "running_requests": 8, "kv_cache_usage": 0.5,
                           "thermal_throttled": True, "clock_ratio": 0.5, "telemetry_age_s": 0.2},
                "factors": {"fresh": True, "performance": 0.5, "load": 0.9, "kv": 1.0, "errors": 1.0,
                            "target": 153.0},
            },
            {"key": "gpu-b:8000", "name": "b", "gpu": "V100", "served_weight": 100,
             "weight_source": "capacity", "profile_weight": 100},
        ],
    }  # fmt: skip
    rows = weight_rows(body, [_host("10.0.0.1:8000", 170)])
    assert rows[0].envoy_weight == 170 and rows[0].throttle == "thermal" and rows[0].waiting == 3
    assert rows[0].factors["target"] == 153.0
    assert rows[1].envoy_weight is None and rows[1].fresh is False and rows[1].waiting is None
    assert (rows[0].collected, rows[1].collected) == (True, False)
    # the table's age column: a number when fresh, "-" when nothing is collected (static mode), not "stale"
    console = Console(width=400, record=True)
    console.print(weights_table(rows, "telemetry"))
    lines = {line.split("│")[2].strip(): line for line in console.export_text().splitlines() if "│" in line}
    assert "stale" not in lines["b"] and "0.2" in lines["h"]


@pytest.mark.parametrize("mode", ["throttle", "slow", "fail"])
def test_mute_keeps_the_fault_and_recover_clears_both(mode: str) -> None:
    state = parse_fault_command({"action": mode, "factor": 3}).apply(FaultState())
    muted = FaultCommand(action="mute").apply(state)
    assert muted.mode == state.mode and muted.factor == state.factor and muted.telemetry_muted
    assert muted.to_json()["telemetry_muted"] is True
    again = parse_fault_command({"action": "throttle"}).apply(muted)
    assert again.telemetry_muted and again.mode == "throttled"
    assert FaultCommand(action="unmute").apply(muted) == state
    assert FaultCommand(action="recover").apply(muted) == FaultState()
    assert "telemetry_muted" not in state.to_json()
