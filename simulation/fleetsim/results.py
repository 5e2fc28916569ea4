"""The figures of a run and the traffic shift after a fault (times in seconds, shares 0..1).

**Figures** (:class:`FleetRunResult`): end-to-end latency and time to first token over requests that
arrived in ``[warmup_s, duration_s)`` (nearest-rank percentiles, as :func:`inferlb.traces.percentile`),
tokens/s emitted by the fleet over that window, each GPU's busy fraction over it (NVML's utilization: the
fraction of time a step ran), refused requests (an engine's queue full: the server answers 503; Envoy
retries are not modelled), and after a throttle (:func:`traffic_shift`) how long until the throttled GPUs'
share of arrivals fell below a fraction of its pre-fault value.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from simulation.fleetsim.scenario import Policy


@dataclass(frozen=True, kw_only=True)
class TrafficShift:
    """How fast the throttled GPUs lost traffic after the fault.

    Attributes:
        pre_share: their share of arrivals in the ``baseline_s`` before the fault (0..1).
        window_s: the sliding window the post-fault share was measured over.
        threshold: the fraction of ``pre_share`` that counts as "fell" (0.6).
        seconds: from the fault to the middle of the first window, starting after the fault, whose share
            was below ``threshold * pre_share``; None when no window was (the share never fell). Its
            resolution is about ``window_s / 2``.
        post_share: their share of arrivals from ``settle_s`` after the fault to the end of arrivals.
    """

    pre_share: float
    window_s: float
    threshold: float
    seconds: float | None
    post_share: float


@dataclass(frozen=True, kw_only=True)
class LengthClassLatency:
    """The latency of one output-length class of the measured requests, classed by their *true*
    completion (what the model server wrote, whatever cap the client sent): the cost of length-aware
    placement to the requests it does not favour stays visible.

    Attributes:
        name: ``short`` (completion at most ``split_tokens``) or ``long`` (above it).
        split_tokens: the split (tokens): :data:`LONG_SHARE_PERCENTILE` of the measured completions.
        requests: measured requests of the class that finished.
        e2e_p50_s / e2e_p99_s / ttft_p50_s: their latencies (s, nearest rank).
    """

    name: str
    split_tokens: int
    requests: int
    e2e_p50_s: float
    e2e_p99_s: float
    ttft_p50_s: float


#: The percentile of the measured requests' completions that splits ``short`` from ``long``
#: (:class:`LengthClassLatency`): the longest 30% against the rest.
LONG_SHARE_PERCENTILE = 70.0


@dataclass(frozen=True, kw_only=True)
class FleetRunResult:
    """The figures of one run (times in seconds, shares 0..1, utilization in percent).

    Attributes:
        policy: the balancer.
        gpus: fleet size.
        arrivals: requests offered (all of them, warm-up included).
        finished / refused / unfinished: outcomes of every arrival (they add up to ``arrivals``).
        measured: arrivals in ``[warmup_s, duration_s)``, the requests the latency figures cover.
        e2e_p50_s / e2e_p99_s / ttft_p50_s / ttft_p99_s: latency of the measured requests that finished.
        throughput_tokens_per_s: tokens the fleet emitted per second over ``[warmup_s, duration_s)``.
        busy_percent: per GPU, percent of ``[warmup_s, duration_s)`` a step ran (NVML's utilization: it
            reads 100% as soon as one sequence runs all the time, whatever the batch occupancy).
        busy_spread_pts: max - min of ``busy_percent``.
        work_percent: per GPU, the work it did in ``[warmup_s, duration_s)`` priced as
            :func:`simulation.fleetsim.workload.request_service_seconds` prices it (prefill seconds of the
            prompt tokens it prefilled, plus each decoded token at a full-batch step's share, at nominal
            speed), over the window: the share of its capacity (as
            :func:`simulation.fleetsim.workload.fleet_capacity_rps` defines it) it delivered; ~100% =
            saturated.
        work_spread_pts / work_p95_p5_pts: max - min and 95th - 5th percentile of ``work_percent``.
        work_by_type: mean ``work_percent`` per GPU type.
        refused_by_type: refused arrivals per GPU type.
        weight_pushes: weight sets applied to the balancer (the initial one included).
        arrival_times / arrival_gpus: every arrival's time and the GPU it was sent to.
        shift: the traffic shift after the throttle, None without one.
        weight_shift_s: for ``telemetry_weights`` with a throttle: seconds from the fault until the weight
            share of the throttled GPUs that Envoy balances on (after the push delay) fell below
            ``shift.threshold`` times its pre-fault value; None otherwise or when it never did.
        events: events processed (a measure of the simulation's work).
        sim_end_s: simulated time at the end (the last event or the drain bound).
        long_output_threshold: for ``length_aware``: completion tokens above which a request was long
            (None for the other policies).
        tier_thresholds / class_requests: for ``tiered``: the thresholds used, and the arrivals of each
            length class (longest first; the last: unconfined).
        long_requests / long_fallbacks: for ``length_aware`` and ``tiered``: arrivals routed as long
            (any confined class), and those of them
            sent to the whole fleet because the fast set was saturated (0 for the other policies).
        class_set_changes / live_classes: whether the class sets followed the GPUs (``Scenario.
            live_classes``), and how many times the applied sets changed.
        prefix_cache_queries / prefix_cache_hits: prompt tokens the GPUs' prefix caches looked up, and found,
            in the window (tokens, summed over GPUs; 0 when the engines have no cache or the trace no block
            ids). :attr:`prefix_cache_hit_rate` is their ratio.
        preemptions: running requests the engines preempted for want of KV blocks (and recomputed), over
            the whole run (vLLM's ``vllm:num_preemptions_total`` summed over GPUs).
        ttft_p90_s: time to first token, 90th percentile (s), as ``ttft_p99_s``.
        mean_in_flight: per GPU, its active requests averaged over the window (requests; a request counts
            from its arrival to its end).
        by_length: the measured requests' latencies per true output-length class, ``short`` then
            ``long`` (:class:`LengthClassLatency`; empty when none finished).
        predicted_requests: for a run that classes by predicted lengths (``Scenario.predict_lengths``):
            arrivals whose class was decided on a prediction, not on their cap.
        threshold_changes: for a run with learnt thresholds (``Scenario.learn_thresholds``): how many times
            the learner's thresholds replaced the balancer's (``tier_thresholds``: the last ones).
    """

    policy: Policy
    gpus: int
    arrivals: int
    finished: int
    refused: int
    unfinished: int
    measured: int
    e2e_p50_s: float
    e2e_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tokens_per_s: float
    busy_percent: tuple[float, ...]
    busy_spread_pts: float
    work_percent: tuple[float, ...]
    work_spread_pts: float
    work_p95_p5_pts: float
    work_by_type: dict[str, float]
    refused_by_type: dict[str, int]
    weight_pushes: int
    arrival_times: tuple[float, ...]
    arrival_gpus: tuple[int, ...]
    shift: TrafficShift | None
    weight_shift_s: float | None
    events: int
    sim_end_s: float
    long_output_threshold: int | None = None
    long_requests: int = 0
    long_fallbacks: int = 0
    tier_thresholds: tuple[int, ...] | None = None
    class_requests: tuple[int, ...] = ()
    class_set_changes: int = 0
    live_classes: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    ttft_p90_s: float = math.nan
    mean_in_flight: tuple[float, ...] = ()
    by_length: tuple[LengthClassLatency, ...] = ()
    predicted_requests: int = 0
    threshold_changes: int = 0

    def length_class(self, name: str) -> LengthClassLatency | None:
        """The :attr:`by_length` entry named ``name`` (``short``, ``long``), None when absent."""
        return next((c for c in self.by_length if c.name == name), None)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """``prefix_cache_hits / prefix_cache_queries`` (0..1; NaN when nothing was looked up)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else math.nan


def share_series(
    times: Sequence[float],
    gpus: Sequence[int],
    targets: frozenset[int],
    *,
    start: float,
    end: float,
    bin_s: float,
) -> list[tuple[float, float]]:
    """The share (0..1) of arrivals sent to ``targets`` per bin of ``bin_s`` seconds over ``[start, end)``,
    as ``(bin middle, share)``; bins with no arrival are left out. ``times`` must be sorted.

    Raises:
        ValueError: ``bin_s <= 0`` or ``times`` and ``gpus`` of different lengths.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    if len(times) != len(gpus):
        raise ValueError("times and gpus must have the same length")
    hits = _prefix_hits(gpus, targets)
    out: list[tuple[float, float]] = []
    t = start
    while t < end:
        lo, hi = bisect_left(times, t), bisect_left(times, min(t + bin_s, end))
        if hi > lo:
            out.append((t + bin_s / 2, (hits[hi] - hits[lo]) / (hi - lo)))
        t += bin_s
    return out


def _prefix_hits(gpus: Sequence[int], targets: frozenset[int]) -> list[int]:
    hits = [0]
    for g in gpus:
        hits.append(hits[-1] + (g in targets))
    return hits


def traffic_shift(
    times: Sequence[float],
    gpus: Sequence[int],
    targets: frozenset[int],
    *,
    fault_at: float,
    end: float,
    threshold: float = 0.6,
    baseline_s: float = 10.0,
    min_window_arrivals: int = 40,
    step_s: float = 0.05,
    settle_s: float = 5.0,
) -> TrafficShift:
    """How long after ``fault_at`` the share of arrivals sent to ``targets`` fell below ``threshold`` times
    its share in the ``baseline_s`` before the fault (see :class:`TrafficShift`).

    The post-fault share is measured over windows ``[t, t + w)`` for ``t`` from ``fault_at`` in steps of
    ``step_s``, with ``w`` long enough to hold ``min_window_arrivals`` arrivals to the targets at the
    pre-fault rate (bounded to [0.2, 5] s), so the counting noise of one window is about
    ``1 / sqrt(min_window_arrivals)`` (16%). ``times`` must be sorted.

    Raises:
        ValueError: ``times`` and ``gpus`` of different lengths, or a threshold outside (0, 1).
    """
    if len(times) != len(gpus):
        raise ValueError("times and gpus must have the same length")
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    hits = _prefix_hits(gpus, targets)

    def share(a: float, b: float) -> tuple[float, int]:
        lo, hi = bisect_left(times, a), bisect_left(times, b)
        return ((hits[hi] - hits[lo]) / (hi - lo) if hi > lo else math.nan), hi - lo

    pre, pre_n = share(max(0.0, fault_at - baseline_s), fault_at)
    if pre_n == 0 or not pre > 0:
        return TrafficShift(pre_share=0.0, window_s=0.0, threshold=threshold, seconds=None, post_share=0.0)
    rate_to_targets = pre * pre_n / min(baseline_s, fault_at)
    w = min(5.0, max(0.2, min_window_arrivals / rate_to_targets))
    seconds: float | None = None
    t = fault_at
    while t + w <= end:
        s, k = share(t, t + w)
        if k > 0 and s < threshold * pre:
            seconds = t + w / 2 - fault_at
            break
        t += step_s
    post, _ = share(fault_at + settle_s, end)
    return TrafficShift(
        pre_share=pre,
        window_s=w,
        threshold=threshold,
        seconds=seconds,
        post_share=0.0 if math.isnan(post) else post,
    )
