"""The telemetry one simulated GPU shows the weight policy, as the xDS server would scrape it: its model
server's metrics from the engine's stats (``vllm:num_requests_waiting``, ``..._running``,
``vllm:kv_cache_usage_perc``, ``vllm:generation_tokens_total``) and the NVML view of a throttle (SM clock at
``1 / slowdown`` of its maximum, the SW-thermal reason set), combined by the same adapter the xDS server uses
(:func:`inferlb.policy.telemetry.weight_inputs`). Rates in tokens/s.
"""

from __future__ import annotations

from inferlb.policy.telemetry import REASON_SW_THERMAL, GpuTelemetry, ServerMetrics, weight_inputs
from inferlb.policy.weights import WeightInputs, WeightParams
from simulation.fleetsim.seams import EngineSnapshot
from simulation.fleetsim.workload import FleetGpu

#: Nominal maximum SM clock reported for every simulated GPU (MHz). Only the ratio current / maximum reaches
#: the weight policy, so one nominal value serves every type.
NOMINAL_MAX_SM_CLOCK_MHZ = 1000.0


def simulated_weight_inputs(
    position: int,
    gpu: FleetGpu,
    stats: EngineSnapshot,
    *,
    max_batch: int,
    throttled: bool,
    throttle_factor: float,
    params: WeightParams,
    generation_tokens_per_s: float,
    reference_tokens_per_s: float | None,
) -> WeightInputs:
    """The weight policy's inputs for the GPU at ``position`` in the fleet, sampled now (both sources fresh).

    Args:
        position: the GPU's position in the fleet (its simulated UUID is ``GPU-sim-<position>``).
        gpu: the GPU (its profile capacity and type).
        stats: its engine's stats now.
        max_batch: its engine's batch bound.
        throttled: whether it is throttled now; its SM clock then reads ``1 / throttle_factor`` of the
            maximum, with the SW-thermal reason set.
        throttle_factor: the throttle's slowdown (2.0 = half speed).
        params: the weight policy's parameters (for ``stale_after_s``).
        generation_tokens_per_s: its tokens emitted over the last telemetry period, per second.
        reference_tokens_per_s: the fleet reference rate
            (:func:`inferlb.policy.weights.fleet_reference_rate`; None when no GPU runs anything).
    """
    slowdown = throttle_factor if throttled else 1.0
    server = ServerMetrics(
        family="vllm",
        waiting_requests=float(stats.waiting_requests),
        running_requests=float(stats.running_requests),
        kv_cache_usage=stats.kv_usage,
        generation_tokens_total=float(stats.generation_tokens_total),
    )
    nvml = GpuTelemetry(
        index=0,
        uuid=f"GPU-sim-{position}",
        name=gpu.gpu_type,
        utilization_percent=0.0,
        memory_used_bytes=0,
        memory_total_bytes=0,
        temperature_c=0.0,
        throttle_reasons=REASON_SW_THERMAL if throttled else 0,
        thermal_throttled=throttled,
        sm_clock_mhz=NOMINAL_MAX_SM_CLOCK_MHZ / slowdown,
        max_sm_clock_mhz=NOMINAL_MAX_SM_CLOCK_MHZ,
    )
    return weight_inputs(
        profile_capacity=gpu.relative_capacity,
        max_batch=max_batch,
        server=server,
        server_age_s=0.0,
        gpu=nvml,
        gpu_age_s=0.0,
        stale_after_s=params.stale_after_s,
        generation_tokens_per_s=generation_tokens_per_s,
        reference_tokens_per_s=reference_tokens_per_s,
    )
