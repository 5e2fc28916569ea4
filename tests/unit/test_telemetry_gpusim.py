"""The simulated GPU's faults and NVML-like telemetry (simulation.gpusim.faults), as pure functions."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.errors import RequestError
from inferlb.policy.telemetry import REASON_SW_THERMAL, GpuTelemetry
from simulation.gpusim.engine import MODEL_WEIGHTS_GIB, EngineStats
from simulation.gpusim.faults import (
    GPU_SPECS,
    IDLE_TEMPERATURE_C,
    THROTTLE_TEMPERATURE_C,
    FaultCommand,
    FaultState,
    parse_fault_command,
    simulated_gpu_telemetry,
    simulated_uuid,
    utilization_percent,
)


def stats(kv_usage: float = 0.0) -> EngineStats:
    return EngineStats(
        running_requests=0, running_slots=0, waiting_requests=0, kv_tokens=0, kv_usage=kv_usage,
        prompt_tokens_total=0, generation_tokens_total=0, requests_finished_total=0, requests_refused_total=0,
        requests_cancelled_total=0, steps_total=0, busy_seconds_total=0.0, slowdown=1.0,
    )  # fmt: skip


def telemetry(fault: FaultState, *, utilization: float = 50.0, kv_usage: float = 0.0) -> GpuTelemetry:
    return simulated_gpu_telemetry(
        name="h100-0", gpu_type="H100", memory_gb=80, kv_budget_tokens=400_000, stats=stats(kv_usage),
        utilization=utilization, fault=fault,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"action": "throttle", "factor": 2.5}, FaultState(mode="throttled", factor=2.5)),
        ({"action": "throttle"}, FaultState(mode="throttled", factor=2.0)),
        ({"action": "slow", "factor": 3}, FaultState(mode="slow", factor=3.0)),
        ({"action": "fail"}, FaultState(mode="failed")),
        ({"action": "recover", "factor": None}, FaultState()),
    ],
)
def test_fault_commands(body: dict[str, Any], expected: FaultState) -> None:
    assert parse_fault_command(body).apply() == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({}, "action"),
        ({"action": "melt"}, "action"),
        ({"action": "throttle", "factor": 0.5}, "factor"),
        ({"action": "throttle", "factor": 101}, "factor"),
        ({"action": "slow", "factor": "2"}, "factor"),
        ({"action": "slow", "factor": True}, "factor"),
        ({"action": "slow", "factor": float("inf")}, "factor"),
    ],
)
def test_bad_fault_commands_are_400_naming_the_field(body: Any, param: str | None) -> None:
    with pytest.raises(RequestError) as info:
        parse_fault_command(body)
    assert info.value.status == 400
    assert info.value.param == param


def test_slowdown_of_each_mode() -> None:
    assert FaultState(mode="throttled", factor=2.0).slowdown == 2.0
    assert FaultState(mode="slow", factor=3.0).slowdown == 3.0
    assert FaultState(mode="failed", factor=3.0).slowdown == 1.0
    assert FaultCommand(action="recover").apply().slowdown == 1.0


def test_a_healthy_gpu_reports_full_clocks_and_no_throttle() -> None:
    t = telemetry(FaultState())
    spec = GPU_SPECS["H100"]
    assert t.clock_ratio == 1.0 and t.sm_clock_mhz == spec.max_sm_clock_mhz
    assert t.throttle_reasons == 0 and not t.thermal_throttled
    assert IDLE_TEMPERATURE_C < t.temperature_c < THROTTLE_TEMPERATURE_C
    assert t.power_w == pytest.approx(spec.idle_w + (spec.tdp_w - spec.idle_w) * 0.5)
    assert t.uuid == simulated_uuid("h100-0") and t.uuid.startswith("GPU-")
    assert t.name == spec.product_name


def test_a_throttled_gpu_is_hot_and_clocked_down_by_the_factor() -> None:
    t = telemetry(FaultState(mode="throttled", factor=2.0))
    assert t.temperature_c == THROTTLE_TEMPERATURE_C
    assert t.thermal_throttled and t.throttle_reasons == REASON_SW_THERMAL
    assert t.clock_ratio == pytest.approx(0.5)
    assert t.power_w is not None and t.power_w < telemetry(FaultState()).power_w  # type: ignore[operator]


def test_a_slow_gpu_looks_healthy_to_nvml() -> None:
    slow = telemetry(FaultState(mode="slow", factor=4.0))
    healthy = telemetry(FaultState())
    assert slow == healthy


def test_a_failed_gpu_shows_idle() -> None:
    t = telemetry(FaultState(mode="failed"), utilization=90.0)
    assert t.utilization_percent == 0.0
    assert t.temperature_c == IDLE_TEMPERATURE_C


@given(st.floats(0, 1), st.floats(0, 1))
def test_memory_follows_kv_usage(a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    t_lo, t_hi = telemetry(FaultState(), kv_usage=lo), telemetry(FaultState(), kv_usage=hi)
    assert int(MODEL_WEIGHTS_GIB * 2**30) <= t_lo.memory_used_bytes <= t_hi.memory_used_bytes
    assert t_hi.memory_used_bytes <= t_hi.memory_total_bytes == 80 * 2**30


@given(st.floats(-50, 200))
def test_temperature_and_utilization_are_bounded(util: float) -> None:
    t = telemetry(FaultState(), utilization=util)
    assert 0 <= t.utilization_percent <= 100
    assert IDLE_TEMPERATURE_C <= t.temperature_c < THROTTLE_TEMPERATURE_C
    # the telemetry is valid JSON telemetry
    assert GpuTelemetry.from_json(t.to_json()) == t


def test_utilization_percent() -> None:
    assert utilization_percent(1.0, 10.0, 1.5, 11.0) == pytest.approx(50.0)
    assert utilization_percent(1.0, 10.0, 3.0, 11.0) == 100.0
    assert utilization_percent(1.0, 10.0, 1.0, 10.0) == 0.0


def test_an_unknown_gpu_type_gets_generic_figures() -> None:
    t = simulated_gpu_telemetry(
        name="x", gpu_type="MI300X", memory_gb=192, kv_budget_tokens=1000, stats=stats(), utilization=0.0,
        fault=FaultState(),
    )  # fmt: skip
    assert t.name == "MI300X" and t.max_sm_clock_mhz is not None
