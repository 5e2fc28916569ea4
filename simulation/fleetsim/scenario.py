"""The definition of one simulated run: the policies (which balancer) and :class:`Scenario` (its bounds in
seconds, the telemetry period and push delay, the throttle fault, the options of the length-aware policies).

The balancer of each policy is described in :mod:`simulation.fleetsim.balancers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from inferlb.policy.length_aware import DEFAULT_TIER_WORK_FRACTION
from inferlb.policy.picker import DEFAULT_WEIGHTS, PickerWeights
from inferlb.traces import MOONCAKE_BLOCK_TOKENS

WeightPolicy = Literal[
    "round_robin", "least_request", "static_weights", "telemetry_weights", "length_aware", "tiered"
]
PrefixPolicy = Literal["ring_hash", "approximate", "precise", "precise_speculative"]
Policy = Literal[WeightPolicy, PrefixPolicy]
#: The weight and length policies (the fleet benchmark's set).
POLICIES: tuple[Policy, ...] = get_args(WeightPolicy)
#: The prefix-affinity policies: Envoy's ring hash on the prefix, and the endpoint picker over an
#: approximate or a precise prefix index (the latter with or without the pending picks).
PREFIX_POLICIES: tuple[Policy, ...] = get_args(PrefixPolicy)
#: The policies whose weights follow the telemetry (:func:`inferlb.policy.weights.step`).
TELEMETRY_POLICIES: frozenset[Policy] = frozenset({"telemetry_weights", "length_aware", "tiered"})


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One simulated run.

    Attributes:
        policy: which balancer (see :mod:`simulation.fleetsim.balancers`).
        duration_s: arrivals are taken in ``[0, duration_s)``; figures cover ``[warmup_s, duration_s)``.
        warmup_s: time excluded from the figures while queues fill.
        drain_s: after ``duration_s``, time allowed for requests in flight to finish (a bound: requests
            still held then count as unfinished).
        telemetry_period_s: seconds between telemetry samples (the xDS server's scrape interval).
        push_delay_s: seconds from a weight computation until Envoy balances on it (debounce + xDS).
        active_request_bias: Envoy ``active_request_bias`` for the weighted policies.
        choice_count: Envoy ``choice_count`` for P2C.
        throttle_at_s: when the throttled GPUs slow down (None: no fault).
        throttle_gpus: indexes of the GPUs that throttle.
        throttle_factor: their slowdown (2.0 = half speed), shown by NVML as a clock at ``1 / factor``.
        seed: seeds every random choice (balancer start points, P2C draws).
        long_output_percentile: for ``length_aware``: requests whose completion tokens exceed this
            nearest-rank percentile (0..100) of the arrivals' completion tokens are long.
        long_output_tokens: for ``length_aware``: the threshold in tokens, instead of the percentile.
        long_min_relative_capacity: for ``length_aware``: the fast set is the GPUs of at least this
            ``relative_capacity`` (V100 = 1.0; the bundled profiles: A100 1.7, H100 3.4).
            The defaults (70th percentile, 1.5: V100s get only the shortest 70% of completions, which
            A100s and H100s also share) were the best of percentiles 50-95 and sets {H100}, {A100, H100}
            in 100-GPU runs at 90% load (60 s, seed 1); the H100 set alone saturates (a third of long
            requests fell back to the whole fleet).
        tier_thresholds: for ``tiered``: the output-cap thresholds of the confined classes, longest first
            (one per tier set of :func:`inferlb.policy.length_aware.tier_capacity_shares`); None: computed
            from the arrivals themselves by :func:`simulation.fleetsim.workload.tiered_thresholds`
            (in-sample; the benchmark passes ones taken from a training window instead).
        tier_work_fraction: for ``tiered`` without ``tier_thresholds``: the rule's fraction.
        spill: for ``length_aware`` and ``tiered``: a confined request whose set is saturated spills to the
            next wider set (the default, the first model's); False: never, as Envoy's subsets do.
        live_classes: for ``length_aware`` and ``tiered``: the class sets follow the GPUs' performance as the
            xDS server's do with telemetry weights (each telemetry tick: the clock-throttle factor,
            :func:`inferlb.policy.length_aware.class_set_performance`, held by
            :func:`inferlb.policy.length_aware.hold_performance`; the sets by
            :func:`inferlb.policy.length_aware.live_class_sets` over each set's minimum capacity; applied with
            the weights, ``push_delay_s`` later); False: fixed by GPU class.
        affinity_blocks: for ``ring_hash``: the request's leading block ids its hash key covers (>= 1).
        hash_balance_factor: for ``ring_hash``: Envoy's bounded load (%; >= 100).
        picker_weights: for ``approximate`` and ``precise``: the endpoint picker's weights.
        block_tokens: for ``approximate`` and ``precise``: tokens per block id of the trace (Mooncake: 512).
        predict_lengths: for ``length_aware`` and ``tiered``: a request whose cap is uninformative (none
            sent, the model's default, or one default for every request of its tenant) is classed by the
            length :class:`inferlb.policy.output_predictor.OutputPredictor` predicts for it, as the request
            path does; the predictor learns each request's true completion when it finishes (the metered
            ``completion_tokens``). Starts cold: until a tenant has answers, its requests class by cap.
        default_max_tokens: the model's ``default_max_tokens`` (tokens), the cap of a request that sets
            none (the predictor's uninformative-cap rule).
        learn_thresholds: for ``tiered``: the thresholds are learnt online from the caps the gateway sees
            (:class:`inferlb.policy.threshold_learner.ThresholdLearner` with its defaults, each arrival
            observed with its cap and :func:`inferlb.policy.threshold_learner.request_work` of its prompt and
            cap), not fixed: until the learner's first derivation no class is confined, then each
            derivation it keeps replaces the balancer's thresholds at once (``tier_thresholds`` is unused).

    Raises:
        ValueError: a non-positive duration, period, factor or default cap, a negative delay, a warm-up not
            before the end, or a percentile outside [0, 100].
    """

    policy: Policy
    duration_s: float
    warmup_s: float = 0.0
    drain_s: float = 600.0
    telemetry_period_s: float = 0.5
    push_delay_s: float = 0.1
    active_request_bias: float = 1.0
    choice_count: int = 2
    throttle_at_s: float | None = None
    throttle_gpus: tuple[int, ...] = ()
    throttle_factor: float = 2.0
    seed: int = 1
    long_output_percentile: float = 70.0
    long_output_tokens: int | None = None
    long_min_relative_capacity: float = 1.5
    tier_thresholds: tuple[int, ...] | None = None
    tier_work_fraction: float = DEFAULT_TIER_WORK_FRACTION
    spill: bool = True
    live_classes: bool = False
    affinity_blocks: int = 2
    hash_balance_factor: int = 150
    picker_weights: PickerWeights = DEFAULT_WEIGHTS
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    predict_lengths: bool = False
    default_max_tokens: int = 256
    learn_thresholds: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES + PREFIX_POLICIES:
            raise ValueError(f"policy must be one of {POLICIES + PREFIX_POLICIES}, got {self.policy!r}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.affinity_blocks < 1 or self.hash_balance_factor < 100 or self.block_tokens < 1:
            raise ValueError("affinity_blocks and block_tokens must be >= 1, hash_balance_factor >= 100")
        if not (self.duration_s > 0 and self.telemetry_period_s > 0 and self.throttle_factor > 0):
            raise ValueError("duration_s, telemetry_period_s and throttle_factor must be > 0")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s), got {self.warmup_s}")
        if self.push_delay_s < 0 or self.drain_s < 0:
            raise ValueError("push_delay_s and drain_s must be >= 0")
        if not 0 <= self.long_output_percentile <= 100:
            raise ValueError(f"long_output_percentile must be in [0, 100], got {self.long_output_percentile}")
        if self.long_output_tokens is not None and self.long_output_tokens < 0:
            raise ValueError(f"long_output_tokens must be >= 0, got {self.long_output_tokens}")
        if not 0 < self.tier_work_fraction <= 1:
            raise ValueError(f"tier_work_fraction must be in (0, 1], got {self.tier_work_fraction}")
        if self.tier_thresholds is not None and any(t < 0 for t in self.tier_thresholds):
            raise ValueError(f"tier_thresholds must be >= 0, got {self.tier_thresholds}")
