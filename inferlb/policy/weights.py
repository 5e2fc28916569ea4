"""Endpoint weights from GPU and model-server telemetry: a pure, documented policy. No I/O, no clock.

Envoy's weighted balancers (round robin, least request with ``active_request_bias``) send each endpoint a
share of traffic proportional to its EDS ``load_balancing_weight``. This module turns what an endpoint reports
into that integer, one control-loop *step* at a time::

    state, weight = step(state, inputs, now, params)

**The target** (weight units, float), computed by :func:`target_weight`::

    target = scale * capacity * performance * load * kv * errors

* ``capacity``: the GPU profile's ``relative_capacity`` (V100 = 1.0; the sources are in
  ``inferlb.config.schema.DEFAULT_GPU_CAPACITY``). ``scale * capacity`` is the **profile weight**, what a GPU
  gets with no telemetry.
* ``performance = min(speed_ratio, throttle)`` (1.0 for a healthy GPU), two estimates of the same thing, the
  fraction of its nominal speed the GPU delivers; the minimum so that a throttled GPU whose throughput also
  shows it is not penalised twice:

  - ``speed_ratio = generation_tokens_per_s / (running * capacity * reference_tokens_per_s)``, the measured
    per-sequence decode rate over the rate the profile predicts, clamped to ``[min_speed_ratio,
    max_speed_ratio]``. Only when the endpoint runs at least one request (an idle GPU produces no tokens and
    says nothing about its speed) and a reference rate (tokens/s of one sequence on a capacity-1.0 GPU) is
    given; :func:`fleet_reference_rate` estimates it as the fleet median, so that effects every GPU shares
    (batch size, model) cancel out.
  - ``throttle``: the SM clock over its maximum when known (NVML ``nvmlDeviceGetClockInfo`` /
    ``nvmlDeviceGetMaxClockInfo``): decode is memory-bound and prefill compute-bound, and both slow down with
    the clock; else ``throttle_factor`` (0.5) when NVML reports a thermal or power throttle reason; else 1.0.

* ``load = 1 / (1 + queue_penalty * waiting / max_batch + running_penalty * running / max_batch)``: a queued
  request waits for a batch slot (``vllm:num_requests_waiting``), so the weight falls as the queue grows, by
  half when one full batch waits (``queue_penalty`` 1.0); a full running batch costs 20% (``running_penalty``
  0.25: a fuller batch decodes each sequence a little slower, Orca/vLLM iteration-level batching).
* ``kv = 1`` up to ``kv_knee`` (0.8) KV-cache usage (``vllm:kv_cache_usage_perc``), then linear down to
  ``kv_floor`` (0.2) at a full cache: vLLM preempts (recomputes) running sequences when the cache is full, so
  the last 20% of the cache is where latency degrades.
* ``errors = max(error_floor, 1 - error_penalty * error_rate)`` for the fraction of requests that failed
  (0..1): Envoy's outlier detection ejects a host with consecutive 5xx; this only steers traffic away from a
  host that fails part of its requests.

**Smoothing** (EWMA in continuous time): ``smoothed += (1 - exp(-dt / tau)) * (target - smoothed)`` with
``tau = smoothing_tau_s`` (1 s). It does not depend on how often :func:`step` is called: after a step change
of the target, 63% of the change is applied after ``tau``, 90% after ``2.3 tau``.

**Slow start**: a new endpoint's weight is multiplied by ``ramp = max(slow_start_min_fraction, age /
slow_start_s)`` (capped at 1), a linear ramp as Envoy's ``slow_start_config`` with ``aggression`` 1.0, so a
cold server (empty caches, CUDA graphs being captured) is not handed its full share at once.

**Hysteresis**: the pushed weight changes only when ``|candidate - pushed| >= hysteresis * pushed``
(``candidate = smoothed * ramp``); small moves are not pushed, so a noisy input does not cost an xDS push
per step. The steady-state error is therefore below ``hysteresis`` (10%). When the slow-start ramp completes,
the weight is pushed once whatever the change, so a ramp does not end short of the target.

**Stale telemetry**: when the telemetry is older than ``stale_after_s`` (or there is none), the target is the
profile weight, adopted at once (smoothing and hysteresis bypassed): knowing nothing, the profile is the best
prior, and a GPU is never zeroed because its agent or its ``/metrics`` went quiet. Envoy's outlier detection
and health checks handle an endpoint that is really down.

**Bounds**: every pushed weight is an integer in ``[1, max_weight]`` (Envoy NACKs a zero weight).

**Convergence** (tested): for a constant input the smoothed value moves monotonically towards the target,
and every push moves the weight by at least ``hysteresis``, so the weight changes a finite number of times,
all in one direction, and then never again: no oscillation. A GPU throttled to half speed (clock ratio 0.5,
half the measured throughput) is first pushed lower one 0.5 s step later (-20%) and falls within 20% of half
its weight within :data:`THROTTLE_HALVING_STEPS` steps of 0.5 s (3 s) with the default parameters.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from inferlb.config.schema import WeightsConfig

#: With the default parameters and one step every 0.5 s, the number of steps after which a GPU throttled to
#: half speed has a pushed weight within 20% of half its previous weight. Derivation: the smoothed value is
#: ``W/2 + W/2 * exp(-k * 0.5 / 1.0)`` after ``k`` steps and the pushed one stays within 10% of it, so
#: ``k >= 6`` gives ``<= 0.6 W`` (tested in tests/unit/test_weights.py).
THROTTLE_HALVING_STEPS = 6


@dataclass(frozen=True, kw_only=True)
class WeightParams:
    """The policy's parameters, in seconds and fractions (see the module doc for each).

    Build it from the config with :meth:`from_config`; the defaults equal :class:`WeightsConfig`'s.

    Raises:
        ValueError: a parameter out of its range (non-positive scale, floor or factor, a negative time
            constant, a knee outside [0, 1), ``min_speed_ratio > max_speed_ratio``...).
    """

    scale: float = 100.0
    max_weight: int = 10_000
    smoothing_tau_s: float = 1.0
    hysteresis: float = 0.10
    slow_start_s: float = 10.0
    slow_start_min_fraction: float = 0.10
    stale_after_s: float = 5.0
    queue_penalty: float = 1.0
    running_penalty: float = 0.25
    kv_knee: float = 0.8
    kv_floor: float = 0.2
    throttle_factor: float = 0.5
    error_penalty: float = 2.0
    error_floor: float = 0.05
    min_speed_ratio: float = 0.05
    max_speed_ratio: float = 2.0

    def __post_init__(self) -> None:
        positive = {
            "scale": self.scale,
            "slow_start_min_fraction": self.slow_start_min_fraction,
            "stale_after_s": self.stale_after_s,
            "kv_floor": self.kv_floor,
            "throttle_factor": self.throttle_factor,
            "error_floor": self.error_floor,
            "min_speed_ratio": self.min_speed_ratio,
        }
        for name, v in positive.items():
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0, got {v}")
        non_negative = {
            "smoothing_tau_s": self.smoothing_tau_s,
            "hysteresis": self.hysteresis,
            "slow_start_s": self.slow_start_s,
            "queue_penalty": self.queue_penalty,
            "running_penalty": self.running_penalty,
            "error_penalty": self.error_penalty,
        }
        for name, v in non_negative.items():
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.max_weight < 1:
            raise ValueError(f"max_weight must be >= 1, got {self.max_weight}")
        if not 0 <= self.kv_knee < 1:
            raise ValueError(f"kv_knee must be in [0, 1), got {self.kv_knee}")
        for name, v in (
            ("slow_start_min_fraction", self.slow_start_min_fraction),
            ("kv_floor", self.kv_floor),
            ("throttle_factor", self.throttle_factor),
            ("error_floor", self.error_floor),
        ):
            if v > 1:
                raise ValueError(f"{name} must be <= 1, got {v}")
        if not self.min_speed_ratio <= self.max_speed_ratio or not math.isfinite(self.max_speed_ratio):
            raise ValueError(
                f"min_speed_ratio ({self.min_speed_ratio}) must be <= "
                f"max_speed_ratio ({self.max_speed_ratio})"
            )

    @classmethod
    def from_config(cls, cfg: WeightsConfig) -> WeightParams:
        """The parameters of a config's ``weights:`` section (ms and percent converted to s and fractions)."""
        return cls(
            scale=cfg.scale,
            max_weight=cfg.max_weight,
            smoothing_tau_s=cfg.smoothing_tau_ms / 1000,
            hysteresis=cfg.hysteresis_percent / 100,
            slow_start_s=cfg.slow_start_ms / 1000,
            slow_start_min_fraction=cfg.slow_start_min_percent / 100,
            stale_after_s=cfg.stale_after_ms / 1000,
            queue_penalty=cfg.queue_penalty,
            running_penalty=cfg.running_penalty,
            kv_knee=cfg.kv_knee,
            kv_floor=cfg.kv_floor,
            throttle_factor=cfg.throttle_factor,
            error_penalty=cfg.error_penalty,
            error_floor=cfg.error_floor,
        )


@dataclass(frozen=True, kw_only=True)
class WeightInputs:
    """What is known about one endpoint at one step.

    Attributes:
        profile_capacity: the GPU profile's relative capacity (V100 = 1.0, > 0).
        max_batch: batch slots of the server (vLLM ``--max-num-seqs``, >= 1); normalises queue and batch.
        telemetry_age_s: seconds since the newest telemetry sample was taken; None when there is none. When
            None or above ``stale_after_s`` every field below is ignored.
        waiting_requests: requests queued for a batch slot (``vllm:num_requests_waiting``, >= 0).
        running_requests: requests in the running batch (``vllm:num_requests_running``, >= 0).
        kv_cache_usage: KV-cache usage, 0..1 (``vllm:kv_cache_usage_perc``); values above 1 count as 1.
        thermal_throttled / power_throttled: NVML clock throttle (event) reasons set (SW/HW thermal
            slowdown; SW power cap, HW power brake).
        clock_ratio: current SM clock over its maximum (0..1], None when unknown.
        error_rate: fraction of recent requests that failed, 0..1.
        generation_tokens_per_s: measured generation rate (tokens/s, the rate of
            ``vllm:generation_tokens_total``), None when unknown.
        reference_tokens_per_s: decode rate of one sequence on a capacity-1.0 GPU (tokens/s) to compare
            against, e.g. :func:`fleet_reference_rate`; None disables the throughput correction.

    Raises:
        ValueError: a NaN, a negative count, rate or age, ``profile_capacity <= 0``, ``max_batch < 1``, or a
            ``clock_ratio`` outside (0, 1].
    """

    profile_capacity: float
    max_batch: int
    telemetry_age_s: float | None = None
    waiting_requests: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0
    thermal_throttled: bool = False
    power_throttled: bool = False
    clock_ratio: float | None = None
    error_rate: float = 0.0
    generation_tokens_per_s: float | None = None
    reference_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.profile_capacity > 0 and math.isfinite(self.profile_capacity)):
            raise ValueError(f"profile_capacity must be a finite number > 0, got {self.profile_capacity}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.waiting_requests < 0 or self.running_requests < 0:
            raise ValueError(
                f"request counts must be >= 0, got waiting={self.waiting_requests} "
                f"running={self.running_requests}"
            )
        for name, v in (
            ("telemetry_age_s", self.telemetry_age_s),
            ("kv_cache_usage", self.kv_cache_usage),
            ("error_rate", self.error_rate),
            ("generation_tokens_per_s", self.generation_tokens_per_s),
            ("reference_tokens_per_s", self.reference_tokens_per_s),
        ):
            if v is not None and not v >= 0:  # also refuses NaN
                raise ValueError(f"{name} must be >= 0, got {v}")
        if self.clock_ratio is not None and not 0 < self.clock_ratio <= 1:
            raise ValueError(f"clock_ratio must be in (0, 1], got {self.clock_ratio}")


@dataclass(frozen=True, kw_only=True)
class WeightBreakdown:
    """The target weight and the factors behind it (for ``inferlb status`` and logs). Factors are in
    (0, 1] except ``performance`` (up to ``max_speed_ratio``); ``target`` is in weight units."""

    profile_weight: float
    fresh: bool
    speed_ratio: float | None
    throttle: float
    performance: float
    load: float
    kv: float
    errors: float
    target: float


@dataclass(frozen=True, kw_only=True)
class WeightState:
    """What :func:`step` remembers about one endpoint between steps (times in the caller's clock, s).

    Attributes:
        first_seen_at: when the endpoint was first stepped (slow start counts from here).
        updated_at: the time of the last step.
        smoothed: EWMA of the target (weight units, before slow start).
        weight: the weight last pushed, in ``[1, max_weight]``.
    """

    first_seen_at: float
    updated_at: float
    smoothed: float
    weight: int


def profile_weight(capacity: float, params: WeightParams) -> int:
    """The weight of a GPU from its profile alone: ``round(scale * capacity)`` in ``[1, max_weight]``."""
    return _bounded(scale_capacity(capacity, params), params)


def scale_capacity(capacity: float, params: WeightParams) -> float:
    """``scale * capacity`` (weight units, unrounded)."""
    return params.scale * capacity


def _bounded(value: float, params: WeightParams) -> int:
    return max(1, min(params.max_weight, math.floor(value + 0.5)))


def target_weight(inputs: WeightInputs, params: WeightParams) -> WeightBreakdown:
    """The unsmoothed weight the inputs call for, with its factors (see the module doc for the formula).

    Stale or missing telemetry gives the profile weight with every factor 1.0 and ``fresh`` False.
    """
    base = scale_capacity(inputs.profile_capacity, params)
    fresh = inputs.telemetry_age_s is not None and inputs.telemetry_age_s <= params.stale_after_s
    if not fresh:
        return WeightBreakdown(
            profile_weight=base, fresh=False, speed_ratio=None, throttle=1.0, performance=1.0,
            load=1.0, kv=1.0, errors=1.0, target=base,
        )  # fmt: skip
    speed: float | None = None
    if (
        inputs.generation_tokens_per_s is not None
        and inputs.reference_tokens_per_s
        and inputs.running_requests >= 1
    ):
        nominal = inputs.running_requests * inputs.profile_capacity * inputs.reference_tokens_per_s
        speed = min(
            params.max_speed_ratio, max(params.min_speed_ratio, inputs.generation_tokens_per_s / nominal)
        )
    if inputs.clock_ratio is not None:
        throttle = max(params.min_speed_ratio, inputs.clock_ratio)
    elif inputs.thermal_throttled or inputs.power_throttled:
        throttle = params.throttle_factor
    else:
        throttle = 1.0
    performance = throttle if speed is None else min(speed, throttle)
    b = inputs.max_batch
    load = 1.0 / (
        1.0
        + params.queue_penalty * inputs.waiting_requests / b
        + params.running_penalty * inputs.running_requests / b
    )
    usage = min(1.0, inputs.kv_cache_usage)
    if usage <= params.kv_knee:
        kv = 1.0
    else:
        kv = 1.0 - (usage - params.kv_knee) / (1.0 - params.kv_knee) * (1.0 - params.kv_floor)
    errors = max(params.error_floor, 1.0 - params.error_penalty * min(1.0, inputs.error_rate))
    return WeightBreakdown(
        profile_weight=base, fresh=True, speed_ratio=speed, throttle=throttle, performance=performance,
        load=load, kv=kv, errors=errors, target=base * performance * load * kv * errors,
    )  # fmt: skip


def slow_start_ramp(age_s: float, params: WeightParams) -> float:
    """The slow-start multiplier of an endpoint first seen ``age_s`` seconds ago, in
    ``[slow_start_min_fraction, 1]``: linear in age, 1.0 once ``age_s >= slow_start_s``."""
    if params.slow_start_s <= 0 or age_s >= params.slow_start_s:
        return 1.0
    return max(params.slow_start_min_fraction, max(0.0, age_s) / params.slow_start_s)


def step(
    state: WeightState | None, inputs: WeightInputs, now: float, params: WeightParams | None = None
) -> tuple[WeightState, int]:
    """Advance one endpoint's weight to ``now`` (seconds, non-decreasing per endpoint; an earlier ``now``
    counts as no time passing). ``state`` None means the endpoint is new: slow start begins at ``now`` and the
    smoothing starts from the current target.

    Returns the new state and the weight to push (an integer in ``[1, max_weight]``; equal to
    ``state.weight`` when the change is under the hysteresis).
    """
    p = params or DEFAULT_PARAMS
    b = target_weight(inputs, p)
    if state is None:
        ramp = slow_start_ramp(0.0, p)
        weight = _bounded(b.target * ramp, p)
        return WeightState(first_seen_at=now, updated_at=now, smoothed=b.target, weight=weight), weight
    dt = max(0.0, now - state.updated_at)
    now = max(now, state.updated_at)
    if not b.fresh or p.smoothing_tau_s <= 0:
        smoothed = b.target
    else:
        alpha = -math.expm1(-dt / p.smoothing_tau_s)
        smoothed = state.smoothed + alpha * (b.target - state.smoothed)
    age = now - state.first_seen_at
    ramp = slow_start_ramp(age, p)
    ramp_completed = ramp >= 1.0 and slow_start_ramp(state.updated_at - state.first_seen_at, p) < 1.0
    candidate = smoothed * ramp
    if not b.fresh or ramp_completed or abs(candidate - state.weight) >= p.hysteresis * state.weight:
        weight = _bounded(candidate, p)
    else:
        weight = state.weight
    return WeightState(
        first_seen_at=state.first_seen_at, updated_at=now, smoothed=smoothed, weight=weight
    ), weight


def fleet_reference_rate(samples: Iterable[tuple[float, float, int]]) -> float | None:
    """The median per-sequence decode rate per unit of capacity over a fleet, for
    :attr:`WeightInputs.reference_tokens_per_s`.

    Args:
        samples: ``(profile_capacity, generation_tokens_per_s, running_requests)`` per endpoint with fresh
            telemetry; endpoints running nothing are skipped (an idle GPU says nothing about its speed).

    Returns:
        tokens/s of one sequence on a capacity-1.0 GPU, or None when no endpoint runs anything. The median
        keeps one throttled or misreporting GPU from moving everyone's reference.
    """
    rates = [tps / (running * cap) for cap, tps, running in samples if running >= 1 and cap > 0 and tps >= 0]
    return statistics.median(rates) if rates else None


DEFAULT_PARAMS = WeightParams()
