"""Faults of a simulated GPU and the NVML-like telemetry it reports. Pure: values in, values out.

A simulated endpoint is told what to do with ``POST /sim/fault`` (:func:`parse_fault_command`):

* ``throttle`` (factor ``f`` >= 1): the GPU runs ``f`` times slower *because it is hot*: its engine's slowdown
  is ``f``, its SM clock is ``max_clock / f``, its temperature is :data:`THROTTLE_TEMPERATURE_C` and NVML's
  SW-thermal-slowdown reason bit is set. What a real thermally throttled GPU shows.
* ``slow`` (factor ``f``): ``f`` times slower with nothing to see in NVML (clock, temperature and reasons as
  healthy): a noisy neighbour, a degraded link, a bad driver. Only the model server's throughput shows it.
* ``fail``: ``/health`` and every inference request (chat, completions, embeddings) answer 503; NVML shows
  an idle GPU.
* ``hang``: a wedged server: it still accepts connections and reads requests, but ``/health`` and every
  inference request never answer, and streams in flight stop between two chunks (the engine keeps its
  state). What a stuck collective or a deadlocked engine looks like from the network: no error, no
  reset, nothing. ``recover`` lets the held answers go on; a client that gave up has already left.
* ``recover``: back to normal (slowdown 1.0, telemetry on, held answers released).
* ``mute`` / ``unmute``: ``/metrics`` and ``/sim/telemetry`` answer 503 (a broken exporter or agent) while the
  GPU keeps serving in whatever mode it is in; the only command that keeps the mode, so that a throttled GPU
  can go quiet and show that the control plane then falls back to its profile weight.

:func:`simulated_gpu_telemetry` turns an engine snapshot and the fault into a :class:`GpuTelemetry`:

* utilization = busy seconds over elapsed seconds since the previous reading (the engine's
  ``busy_seconds_total`` counts the time a step ran: NVML's utilization is "percent of time over the past
  sample period during which one or more kernels was executing");
* memory used = model weights + KV usage x KV budget (bytes). Real vLLM preallocates its KV cache, so NVML
  would show ~90% used at all times; here memory follows KV usage so the telemetry carries that signal;
* temperature = ``IDLE_TEMPERATURE_C + (LOAD_TEMPERATURE_C - IDLE_TEMPERATURE_C) * utilization``, or
  :data:`THROTTLE_TEMPERATURE_C` when throttled;
* power = ``idle + (TDP - idle) * utilization`` scaled by the clock ratio when throttled (dynamic power falls
  at least linearly with the clock).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Literal

from inferlb.errors import RequestError
from inferlb.policy.telemetry import REASON_SW_THERMAL, GpuTelemetry
from simulation.gpusim.engine import KV_BYTES_PER_TOKEN, MODEL_WEIGHTS_GIB, EngineStats

FaultAction = Literal["throttle", "slow", "fail", "hang", "recover", "mute", "unmute"]
FaultMode = Literal["healthy", "throttled", "slow", "failed", "hung"]
ACTIONS: tuple[FaultAction, ...] = ("throttle", "slow", "fail", "hang", "recover", "mute", "unmute")
#: Factor when a throttle or slow command gives none (half speed).
DEFAULT_FACTOR = 2.0
MAX_FACTOR = 100.0

IDLE_TEMPERATURE_C = 35.0
LOAD_TEMPERATURE_C = 72.0
#: Above the ~85-90 C where data-centre GPUs start thermal slowdown (NVML's
#: ``NVML_TEMPERATURE_THRESHOLD_SLOWDOWN`` is 87-90 C on A100/H100 boards).
THROTTLE_TEMPERATURE_C = 91.0


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Datasheet figures of one GPU type: boost SM clock (MHz), board power limit and idle power (W)."""

    max_sm_clock_mhz: float
    tdp_w: float
    idle_w: float
    product_name: str


#: NVIDIA datasheets: H100 SXM5 (1980 MHz boost, 700 W), A100 SXM4 (1410 MHz, 400 W), V100 SXM2 (1530 MHz,
#: 300 W), L4 (2040 MHz, 72 W), A10G (1710 MHz, 150 W, the A10's figures). Idle power is ~10-15% of TDP.
GPU_SPECS: dict[str, GpuSpec] = {
    "H100": GpuSpec(max_sm_clock_mhz=1980, tdp_w=700, idle_w=70, product_name="NVIDIA H100 80GB HBM3"),
    "A100": GpuSpec(max_sm_clock_mhz=1410, tdp_w=400, idle_w=50, product_name="NVIDIA A100-SXM4-80GB"),
    "V100": GpuSpec(max_sm_clock_mhz=1530, tdp_w=300, idle_w=40, product_name="Tesla V100-SXM2-32GB"),
    "L4": GpuSpec(max_sm_clock_mhz=2040, tdp_w=72, idle_w=16, product_name="NVIDIA L4"),
    "A10G": GpuSpec(max_sm_clock_mhz=1710, tdp_w=150, idle_w=20, product_name="NVIDIA A10G"),
}
#: For a profile name not in :data:`GPU_SPECS`.
GENERIC_SPEC = GpuSpec(max_sm_clock_mhz=1500, tdp_w=300, idle_w=40, product_name="Simulated GPU")


@dataclass(frozen=True, kw_only=True)
class FaultState:
    """The fault a simulated GPU is in: ``mode`` and the slowdown ``factor`` (1.0 unless throttled/slow);
    ``telemetry_muted``: its ``/metrics`` and ``/sim/telemetry`` answer 503."""

    mode: FaultMode = "healthy"
    factor: float = 1.0
    telemetry_muted: bool = False

    @property
    def slowdown(self) -> float:
        """The engine slowdown this fault implies."""
        return self.factor if self.mode in ("throttled", "slow") else 1.0

    def to_json(self) -> dict[str, Any]:
        """``{"mode": ..., "factor": ..., "slowdown": ...}``, plus ``"telemetry_muted": true`` when muted."""
        out: dict[str, Any] = {"mode": self.mode, "factor": self.factor, "slowdown": self.slowdown}
        if self.telemetry_muted:
            out["telemetry_muted"] = True
        return out


@dataclass(frozen=True, kw_only=True)
class FaultCommand:
    """A parsed ``POST /sim/fault`` body."""

    action: FaultAction
    factor: float = DEFAULT_FACTOR

    def apply(self, previous: FaultState | None = None) -> FaultState:
        """The state the command leads to from ``previous``: throttle, slow, fail and hang replace the mode
        (they do not stack) and keep a mute; mute and unmute keep the mode; recover resets everything."""
        muted = previous.telemetry_muted if previous is not None else False
        if self.action == "throttle":
            return FaultState(mode="throttled", factor=self.factor, telemetry_muted=muted)
        if self.action == "slow":
            return FaultState(mode="slow", factor=self.factor, telemetry_muted=muted)
        if self.action == "fail":
            return FaultState(mode="failed", telemetry_muted=muted)
        if self.action == "hang":
            return FaultState(mode="hung", telemetry_muted=muted)
        if self.action in ("mute", "unmute"):
            base = previous or FaultState()
            return FaultState(mode=base.mode, factor=base.factor, telemetry_muted=self.action == "mute")
        return FaultState()


def parse_fault_command(obj: Any) -> FaultCommand:
    """Read ``{"action": "throttle"|"slow"|"fail"|"hang"|"recover"|"mute"|"unmute", "factor": 2.0}``
    (factor optional, default 2.0, used by throttle and slow).

    Raises:
        RequestError: 400 naming the field (``param``) when the body is not an object, the action is unknown,
            or the factor is not a finite number in [1, 100].
    """
    if not isinstance(obj, dict):
        raise RequestError(400, "expected a JSON object", type="invalid_request_error")
    action = obj.get("action")
    if action not in ACTIONS:
        raise RequestError(
            400, f"action must be one of {list(ACTIONS)}, got {action!r}", type="invalid_request_error",
            param="action",
        )  # fmt: skip
    factor = obj.get("factor", DEFAULT_FACTOR)
    if factor is None:
        factor = DEFAULT_FACTOR
    if (
        isinstance(factor, bool)
        or not isinstance(factor, int | float)
        or not math.isfinite(factor)
        or not 1.0 <= factor <= MAX_FACTOR
    ):
        raise RequestError(
            400, f"factor must be a number in [1, {MAX_FACTOR:g}], got {factor!r}",
            type="invalid_request_error", param="factor",
        )  # fmt: skip
    return FaultCommand(action=action, factor=float(factor))


def utilization_percent(busy_before: float, at_before: float, busy_now: float, at_now: float) -> float:
    """Percent of ``[at_before, at_now]`` the GPU was busy, in [0, 100]; 0 when no time passed."""
    elapsed = at_now - at_before
    if elapsed <= 0:
        return 0.0
    return max(0.0, min(100.0, 100.0 * (busy_now - busy_before) / elapsed))


def simulated_uuid(name: str) -> str:
    """A stable NVML-style UUID for a simulated GPU named ``name``."""
    h = hashlib.sha256(name.encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def simulated_gpu_telemetry(
    *,
    name: str,
    gpu_type: str,
    memory_gb: float,
    kv_budget_tokens: int,
    stats: EngineStats,
    utilization: float,
    fault: FaultState,
    index: int = 0,
) -> GpuTelemetry:
    """The NVML view of a simulated GPU (see the module doc for each formula).

    Args:
        name: endpoint display name (gives the UUID).
        gpu_type: GPU profile name (gives clocks and power from :data:`GPU_SPECS`).
        memory_gb: the profile's memory (GiB).
        kv_budget_tokens: the engine's KV budget (tokens).
        stats: the engine snapshot (KV usage).
        utilization: percent busy over the last period (:func:`utilization_percent`).
        fault: the current fault.
        index: device index to report.
    """
    spec = GPU_SPECS.get(gpu_type, GENERIC_SPEC)
    util = 0.0 if fault.mode == "failed" else max(0.0, min(100.0, utilization))
    load = util / 100.0
    total = int(memory_gb * 2**30)
    used = int(MODEL_WEIGHTS_GIB * 2**30 + stats.kv_usage * kv_budget_tokens * KV_BYTES_PER_TOKEN)
    used = max(0, min(total, used))
    throttled = fault.mode == "throttled"
    clock_ratio = 1.0 / fault.factor if throttled else 1.0
    temperature = (
        THROTTLE_TEMPERATURE_C
        if throttled
        else IDLE_TEMPERATURE_C + (LOAD_TEMPERATURE_C - IDLE_TEMPERATURE_C) * load
    )
    power = (spec.idle_w + (spec.tdp_w - spec.idle_w) * load) * (clock_ratio if throttled else 1.0)
    return GpuTelemetry(
        index=index,
        uuid=simulated_uuid(name),
        name=spec.product_name if gpu_type in GPU_SPECS else gpu_type,
        utilization_percent=round(util, 2),
        memory_used_bytes=used,
        memory_total_bytes=total,
        temperature_c=round(temperature, 1),
        throttle_reasons=REASON_SW_THERMAL if throttled else 0,
        thermal_throttled=throttled,
        power_throttled=False,
        sm_clock_mhz=round(spec.max_sm_clock_mhz * clock_ratio, 1),
        max_sm_clock_mhz=spec.max_sm_clock_mhz,
        power_w=round(max(spec.idle_w * clock_ratio, power), 1),
    )
