"""Length-aware placement (pure): long generations go to the fast GPUs of a model's cluster.

Why: at 90% load the slowest 1% of requests are long completions decoding on slow GPUs (a V100 decodes a
600-1,000-token answer in 15-40 s where an H100 takes a third of that). Endpoint weights change how many
requests each GPU gets, not which GPU gets the long ones. The gateway knows each request's output cap before
routing, so it can send the long ones to the fast GPUs (bench/fleet_sim.py and bench/routing.py
measure it).

How it runs in Envoy, for a model whose ``cluster.length_aware`` is set
(:class:`inferlb.config.schema.LengthAwareRouting`):

1. ext_proc classifies each admitted request by its output cap,
   :meth:`inferlb.request.parsing.InferenceRequest. output_token_cap`
   (``max_completion_tokens``/``max_tokens``/``max_output_tokens``, else the model's ``default_max_tokens``, x
   ``n`` x prompts: the tokens quota admission reserves): above ``long_output_tokens`` it is :data:`LONG`,
   else :data:`SHORT` (:func:`length_class`), and sets the ``x-inferlb-length-class`` header
   (:data:`inferlb.request.headers.LENGTH_CLASS`).
2. The xDS server gives each endpoint of such a model the ``envoy.lb`` metadata ``{gpu_tier: fast}`` when its
   GPU profile's ``relative_capacity`` is at least ``fast_min_relative_capacity``, else
   ``{gpu_tier: standard}`` (:func:`gpu_tier`), and its clusters an ``lb_subset_config`` with one selector on
   ``gpu_tier`` and fallback ``ANY_ENDPOINT``. Each subset keeps the cluster's own balancer (least request
   with the pushed weights, or round robin): Envoy's subset load balancer "uses the load balancer policy
   specified by the cluster" (Envoy docs, "Load Balancer Subsets").
3. A route matching ``x-inferlb-length-class: long`` (before the model's other routes) carries
   ``metadata_match {envoy.lb: {gpu_tier: fast}}``: long requests are balanced among the fast GPUs only.
   Short requests match the model's usual routes, which carry no metadata match, so the fallback policy
   (``ANY_ENDPOINT``) balances them over every endpoint. With no fast endpoint in the cluster the ``fast``
   subset does not exist and long requests fall back to every endpoint too.

What the cap is: the client's declared upper bound. A client that always sends a large ``max_tokens`` (or
none, with a large model default) makes every request look long; the benchmarks replay a trace whose
``max_tokens`` equals the completion it generates, the best case. Unlike the discrete-event model in
:mod:`simulation.fleetsim`, Envoy does not fall back from a busy fast subset to the whole fleet: the subset is
fixed by the endpoints' metadata, not by load.

**Live class sets** (``weights.mode: telemetry``): with static sets a fast GPU that throttles stays in its
classes' sets, with its lowered weight, and the longest class loses capacity it was sized for (live
bench, one H100 at half speed: p99 9.42 -> 19.89 s). With telemetry weights the xDS server re-derives each
class's set every telemetry period from the GPUs' clock-throttle factor (:func:`class_set_performance`,
held by :func:`hold_performance`): :func:`live_class_sets` keeps each class's nominal capacity by taking
the next fastest GPUs in, and the endpoints' ``envoy.lb`` metadata follows through the usual EDS push;
healthy, the sets are exactly the static ones. With ``static`` weights they stay static.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

from inferlb.config.schema import Config, LengthAwareRouting
from inferlb.policy.weights import WeightBreakdown

#: ``x-inferlb-length-class`` value of a request whose output cap exceeds the model's threshold.
LONG: Final = "long"
#: ``x-inferlb-length-class`` value of every other request of a length-aware model.
SHORT: Final = "short"
#: Envoy's metadata namespace for subset load balancing (endpoint metadata and route ``metadata_match``).
ENVOY_LB_NAMESPACE: Final = "envoy.lb"
#: The endpoint metadata key the subsets are built on.
TIER_KEY: Final = "gpu_tier"
#: Tier of a GPU whose profile's relative capacity is at least the model's ``fast_min_relative_capacity``.
FAST_TIER: Final = "fast"
#: Tier of every other GPU.
STANDARD_TIER: Final = "standard"


#: Endpoint metadata key of the tiered form: the list of the confined length classes a GPU may serve.
CLASSES_KEY: Final = "length_classes"
#: ``x-inferlb-length-class`` values of the tiered form's classes, longest first: ``long-0``, ``long-1``, ...
TIER_CLASS_NAMES: Final = tuple(f"long-{k}" for k in range(8))


@dataclass(frozen=True, kw_only=True)
class ConfinedClass:
    """One length class that may run only on some GPUs (the two-tier form has one, the tiered form one per
    tier).

    Attributes:
        name: its ``x-inferlb-length-class`` value (``long``; tiered: ``long-0``, ``long-1``, ...).
        above_output_tokens: caps above this (tokens), and no longer class's, are of this class.
        min_relative_capacity: the GPUs it may run on have at least this profile capacity.
        match_key / match_value: the route's ``metadata_match {envoy.lb: {match_key: match_value}}`` that
            selects those GPUs' subset.
    """

    name: str
    above_output_tokens: int
    min_relative_capacity: float
    match_key: str
    match_value: str


def confined_classes(policy: LengthAwareRouting) -> tuple[ConfinedClass, ...]:
    """The confined length classes of ``policy``, longest first.

    Two-tier form: one class :data:`LONG` on the fast tier, matched by ``{gpu_tier: fast}``. Tiered form:
    class ``k`` is ``long-k`` on GPUs of capacity ``>= tiers[k].min_relative_capacity``, matched by
    ``{length_classes: long-k}``: each endpoint lists every class it may serve (:func:`endpoint_lb_metadata`)
    and the cluster's subset selector sets ``list_as_any``, under which Envoy matches a route's value
    against any element of an endpoint's list value (``Cluster.LbSubsetConfig.list_as_any``), so one
    selector serves every class although the classes' GPU sets overlap.
    """
    if policy.tiers is None:
        return (
            ConfinedClass(
                name=LONG,
                above_output_tokens=policy.long_output_tokens,
                min_relative_capacity=policy.fast_min_relative_capacity,
                match_key=TIER_KEY,
                match_value=FAST_TIER,
            ),
        )
    return tuple(
        ConfinedClass(
            name=TIER_CLASS_NAMES[k],
            above_output_tokens=t.above_output_tokens,
            min_relative_capacity=t.min_relative_capacity,
            match_key=CLASSES_KEY,
            match_value=TIER_CLASS_NAMES[k],
        )
        for k, t in enumerate(policy.tiers)
    )


def length_class(output_cap_tokens: int, policy: LengthAwareRouting) -> str:
    """The ``x-inferlb-length-class`` value of a request whose whole output cap is ``output_cap_tokens``:
    two-tier form, :data:`LONG` above ``policy.long_output_tokens``; tiered form, ``long-k`` for the first
    tier ``k`` whose ``above_output_tokens`` the cap exceeds; else :data:`SHORT`."""
    tiers = policy.tiers
    if tiers is None:
        return LONG if output_cap_tokens > policy.long_output_tokens else SHORT
    for k, tier in enumerate(tiers):
        if output_cap_tokens > tier.above_output_tokens:
            return TIER_CLASS_NAMES[k]
    return SHORT


def static_thresholds(policy: LengthAwareRouting) -> tuple[int, ...]:
    """The configured thresholds of ``policy``'s confined classes, longest first (tokens):
    ``(long_output_tokens,)`` (two tiers) or each tier's ``above_output_tokens``."""
    return tuple(c.above_output_tokens for c in confined_classes(policy))


def class_by_thresholds(output_cap_tokens: int, thresholds: Sequence[int], names: Sequence[str]) -> str:
    """The length class of a cap under ``thresholds`` (tokens, longest class first, as
    :func:`static_thresholds` or :class:`inferlb.policy.threshold_learner.ThresholdLearner`): ``names[k]``
    for the first ``k`` whose threshold the cap exceeds, else :data:`SHORT`. With the static thresholds and
    the :func:`confined_classes` names it is :func:`length_class`."""
    for k, threshold in enumerate(thresholds):
        if output_cap_tokens > threshold:
            return names[k]
    return SHORT


def gpu_tier(config: Config, gpu: str, policy: LengthAwareRouting) -> str:
    """:data:`FAST_TIER` when GPU type ``gpu``'s profile has ``relative_capacity >=
    policy.fast_min_relative_capacity``, else :data:`STANDARD_TIER` (the two-tier form).

    Raises:
        KeyError: ``gpu`` has no profile (config validation refuses such endpoints).
    """
    fast = config.gpu_profiles[gpu].relative_capacity >= policy.fast_min_relative_capacity
    return FAST_TIER if fast else STANDARD_TIER


def allowed_classes(config: Config, gpu: str, policy: LengthAwareRouting) -> tuple[str, ...]:
    """The confined classes (names, longest first) a GPU of type ``gpu`` may serve; every GPU serves
    :data:`SHORT` requests besides.

    Raises:
        KeyError: ``gpu`` has no profile.
    """
    capacity = config.gpu_profiles[gpu].relative_capacity
    return tuple(c.name for c in confined_classes(policy) if capacity >= c.min_relative_capacity)


def endpoint_lb_metadata(config: Config, gpu: str, policy: LengthAwareRouting) -> dict[str, str | list[str]]:
    """The ``envoy.lb`` endpoint metadata of a GPU of type ``gpu`` (the subset load balancer's input):
    two-tier form ``{gpu_tier: fast|standard}`` (:func:`gpu_tier`); tiered form ``{length_classes: [...]}``,
    the classes it may serve (:func:`allowed_classes`; empty for the slowest GPUs, which then belong to no
    subset and serve only short requests, through the ``ANY_ENDPOINT`` fallback).

    Raises:
        KeyError: ``gpu`` has no profile.
    """
    if policy.tiers is None:
        return {TIER_KEY: gpu_tier(config, gpu, policy)}
    return {CLASSES_KEY: list(allowed_classes(config, gpu, policy))}


def subset_key(policy: LengthAwareRouting) -> str:
    """The endpoint metadata key the cluster's one subset selector is built on: ``gpu_tier`` (two tiers)
    or ``length_classes`` (tiered, with ``list_as_any``)."""
    return TIER_KEY if policy.tiers is None else CLASSES_KEY


# -- tiered placement: the threshold rule --------------------------------------------------------------------

#: The share of a tier set's capacity that the requests allowed only on it may take (see
#: :func:`tier_thresholds`): chosen on the training window (first half of the Azure 2023 conversation
#: trace, 1,000 simulated GPUs, 90% load, seed 1) among 0.25, 0.5, 0.75 and 1, then checked on the held-out
#: half (bench/fleet_sim.py).
DEFAULT_TIER_WORK_FRACTION: Final = 0.75


def tier_capacity_shares(capacities: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """The nested tier sets of a fleet and their share of its capacity.

    ``capacities`` holds each GPU's profile ``relative_capacity`` (one entry per GPU, V100 = 1.0). The tiers
    are the distinct capacities ``c_1 > c_2 > ... > c_m``; tier set ``k`` is every GPU of capacity ``>= c_k``
    (the ``k`` fastest tiers). Returned: ``(c_k, share_k)`` for ``k = 1 .. m - 1``, fastest first, where
    ``share_k`` (0..1) is the set's summed capacity over the fleet's. The last set, the whole fleet (share
    1), is left out: the shortest class runs anywhere. Capacity is relative throughput, so the share is the
    share of the fleet's GPU-seconds of work the set can do per second.

    Raises:
        ValueError: no capacity, or one not > 0.
    """
    if not capacities:
        raise ValueError("no GPU capacities")
    if any(not c > 0 for c in capacities):
        raise ValueError("relative capacities must be > 0")
    total = sum(capacities)
    tiers = sorted(set(capacities), reverse=True)
    return tuple((c, sum(x for x in capacities if x >= c) / total) for c in tiers[:-1])


def tier_thresholds(
    set_shares: Sequence[float],
    samples: Sequence[tuple[int, float]],
    *,
    fraction: float = DEFAULT_TIER_WORK_FRACTION,
) -> tuple[int, ...]:
    """Output-cap thresholds of the length classes, one per tier set, by a rule (no tuning on outcomes).

    Args:
        set_shares: the capacity share (0..1) of each nested tier set, fastest (smallest) set first, as the
            second members of :func:`tier_capacity_shares`.
        samples: ``(output cap tokens, work)`` of each request of a *training* window, where work is the
            request's GPU-seconds on any one GPU type
            (:func:`simulation.fleetsim.workload.request_service_seconds`: prefill plus decode at full batch;
            the shares do not depend on the type, since every rate scales with ``relative_capacity``).
        fraction: the share of a set's capacity its confined requests may take (0 < fraction <= 1).

    Returns:
        ``T_1 >= T_2 >= ...``, one per set: a request whose cap exceeds ``T_k`` may run only on set ``k``
        (the first ``k`` it exceeds wins: above ``T_1`` only the fastest tier). Each ``T_k`` is the smallest
        cap seen in the samples such that the requests above it carry at most ``fraction * set_shares[k]``
        of the samples' work.

    The rule and why: the requests confined to set ``k`` (caps above ``T_k``) put ``load x W_k`` of the
    fleet's capacity on that set, where ``W_k`` is their share of the work. Requests confined to nested sets
    can all be served only if ``W_k <= share_k`` for every ``k`` (Hall's condition for nested sets); above
    it the set saturates whatever the balancer does. With ``W_k = fraction x share_k`` the confined requests
    fill that part of each set at full load and leave the rest (1 - fraction) to the weighted
    least-request balancer, which places the unconfined requests where load is lowest: the freedom that
    keeps queues short. ``fraction`` 1 would leave the balancer no freedom on the fast tiers; 0 confines
    nothing. The default, :data:`DEFAULT_TIER_WORK_FRACTION` (0.75), was chosen on a training window: an
    even split (0.5), the first choice, gave no gain over two tiers there or on held-out data, while 0.75
    moved most of the long tail's work onto the fastest tier (p99 0.50x least request on the training
    window, 0.50x on the held-out half) at the cost of a saturated fastest tier (TTFT p99 and p50 rise).

    Raises:
        ValueError: no samples, a fraction outside (0, 1], a share outside (0, 1], shares not increasing,
            a negative cap or work, or zero total work.
    """
    if not samples:
        raise ValueError("no samples to take thresholds from")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if any(not 0 < s <= 1 for s in set_shares):
        raise ValueError("set shares must be in (0, 1]")
    if any(a >= b for a, b in pairwise(set_shares)):
        raise ValueError("set shares must increase (fastest, smallest set first)")
    if any(cap < 0 or work < 0 for cap, work in samples):
        raise ValueError("caps and work must be >= 0")
    total = sum(work for _, work in samples)
    if not total > 0:
        raise ValueError("the samples carry no work")
    work_at: dict[int, float] = {}
    for cap, work in samples:
        work_at[cap] = work_at.get(cap, 0.0) + work
    caps = sorted(work_at)
    # above[i]: work of the samples whose cap exceeds caps[i] (non-increasing in i; 0 at the largest cap)
    above = [0.0] * len(caps)
    acc = 0.0
    for i in range(len(caps) - 1, -1, -1):
        above[i] = acc
        acc += work_at[caps[i]]
    out = []
    for share in set_shares:
        budget = fraction * share * total
        out.append(next(caps[i] for i in range(len(caps)) if above[i] <= budget))
    return tuple(out)


# -- live class sets: follow the GPUs' measured performance ----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ClassSetMember:
    """One endpoint of a length-aware cluster, as :func:`live_class_sets` ranks it.

    Attributes:
        name: a unique name (the endpoint key); the last tie-breaker, so the ranking is deterministic.
        capacity: its GPU profile's ``relative_capacity`` (V100 = 1.0, > 0).
        performance: the held performance factor (:func:`hold_performance`), in (0, 1]: the fraction of its
            profile speed it delivers now; 1.0 when healthy or when its telemetry is stale.
    """

    name: str
    capacity: float
    performance: float = 1.0

    def __post_init__(self) -> None:
        if not (self.capacity > 0 and math.isfinite(self.capacity)):
            raise ValueError(f"capacity of {self.name!r} must be a finite number > 0, got {self.capacity}")
        if not 0 < self.performance <= 1:
            raise ValueError(f"performance of {self.name!r} must be in (0, 1], got {self.performance}")

    @property
    def effective_capacity(self) -> float:
        """``capacity x performance``: what the GPU delivers now, in V100 units."""
        return self.capacity * self.performance


#: Relative slack on "the prefix reached the class's nominal capacity": the nominal sum and the prefix sum
#: add the same numbers in different orders, so they may differ in the last bits (3.4 + 1.7 + 1.7 vs 6.8).
#: Far below the smallest capacity step (a V100, 1.0, in a 10,000-GPU cluster is 1e-5 of it at worst).
_CAPACITY_RTOL: Final = 1e-9


def nominal_class_capacity(members: Sequence[ClassSetMember], min_relative_capacity: float) -> float:
    """``C_k``: the summed profile capacity of the members whose profile capacity is at least
    ``min_relative_capacity``, the capacity a class gets from its static set (:func:`allowed_classes`)."""
    return math.fsum(m.capacity for m in members if m.capacity >= min_relative_capacity)


def performance_rank(members: Sequence[ClassSetMember]) -> list[ClassSetMember]:
    """The members fastest first: effective capacity descending, then profile capacity descending, then name
    ascending (deterministic; with every performance 1.0 this is the profile order, so the static sets are
    its prefixes)."""
    return sorted(members, key=lambda m: (-m.effective_capacity, -m.capacity, m.name))


def live_class_sets(
    members: Sequence[ClassSetMember], min_capacities: Sequence[float]
) -> tuple[tuple[str, ...], ...]:
    """Each confined class's endpoint set from the endpoints' live performance (names, fastest first).

    Args:
        members: the endpoints of one cluster (unique names).
        min_capacities: each class's ``min_relative_capacity`` (:attr:`ConfinedClass.min_relative_capacity`),
            longest class first.

    Returns:
        One tuple of names per class: the shortest prefix of :func:`performance_rank` whose summed
        effective capacity reaches the class's nominal capacity ``C_k`` (:func:`nominal_class_capacity`),
        or every member when no prefix does.

    The rule and why: the thresholds of the classes were chosen so that class ``k``'s requests take a
    fixed share of ``C_k`` (:func:`tier_thresholds`). The static set (GPUs of profile capacity ``>=
    min_relative_capacity``) delivers ``C_k`` only while they all run at full speed; an H100 throttled to
    half speed keeps its place in the longest class's set and the set loses a quarter of its capacity
    while its share of the work stays: the set saturates (bench/results/2026-11-29/
    routing_tiered_throttle.txt: p99 9.42 -> 19.89 s). Keeping every class's *capacity* rather than its
    *GPU classes* restores the premise of the thresholds: the set grows by the next fastest GPUs until it
    delivers ``C_k`` again (the throttled GPU stays in it: it still serves at half speed, and its weight
    already halves its share within the set). Ranking by effective capacity keeps the long requests on
    the fastest GPUs that remain, and the sets are prefixes of one ranking, so they stay nested as
    Envoy's one ``list_as_any`` selector and :class:`simulation.fleetsim.balancers.TieredBalancer` expect.
    With every performance 1.0 the ranking is the profile order and the prefix that first reaches ``C_k`` is
    exactly the static set (every capacity > 0, so no shorter prefix reaches it): today's sets.

    Raises:
        ValueError: two members with the same name.
    """
    if len({m.name for m in members}) != len(members):
        raise ValueError("member names must be unique")
    ranked = performance_rank(members)
    prefix = [0.0]
    for m in ranked:
        prefix.append(prefix[-1] + m.effective_capacity)
    out = []
    for min_capacity in min_capacities:
        need = nominal_class_capacity(members, min_capacity)
        size = next(
            (i for i, s in enumerate(prefix) if s >= need * (1 - _CAPACITY_RTOL)),
            len(ranked),
        )
        out.append(tuple(m.name for m in ranked[:size]))
    return tuple(out)


def live_endpoint_classes(
    members: Sequence[ClassSetMember], classes: Sequence[ConfinedClass]
) -> dict[str, tuple[str, ...]]:
    """``{member name: the classes it may serve}`` (class names, longest first) under
    :func:`live_class_sets`; the members in no set map to ``()`` (short requests only)."""
    sets = live_class_sets(members, [c.min_relative_capacity for c in classes])
    out: dict[str, tuple[str, ...]] = {m.name: () for m in members}
    for c, names in zip(classes, sets, strict=True):
        for name in names:
            out[name] += (c.name,)
    return out


def lb_metadata_of_classes(policy: LengthAwareRouting, classes: Sequence[str]) -> dict[str, str | list[str]]:
    """The ``envoy.lb`` endpoint metadata of an endpoint that may serve ``classes`` (names from
    :func:`confined_classes`): ``{length_classes: [...]}`` (tiered) or ``{gpu_tier: fast|standard}`` (two
    tiers: fast when it serves :data:`LONG`). With the static classes (:func:`allowed_classes`) this is
    :func:`endpoint_lb_metadata`."""
    if policy.tiers is None:
        return {TIER_KEY: FAST_TIER if LONG in classes else STANDARD_TIER}
    return {CLASSES_KEY: list(classes)}


def class_set_performance(breakdown: WeightBreakdown) -> float | None:
    """The performance factor the class sets follow, from the weight model's breakdown of one endpoint:
    its ``throttle`` factor (SM clock over its maximum, from NVML; else ``throttle_factor`` when a thermal
    or power throttle reason is set; 1.0 otherwise), None when the telemetry is stale or missing.

    Why the clock and not the weight model's whole ``performance`` (which also takes the measured speed
    ratio): the speed ratio is measured per scrape from the generation-token counter over the running
    requests, and a scrape period sees prefills stall the batch and requests join and leave. In the
    discrete-event fleet (8 GPUs, 90% load, 0.5 s ticks) its per-tick deciles were 0.61..1.22 on healthy
    H100s and 0.26..1.49 on V100s, and with it the class sets of a healthy fleet changed 92 times in 60 s
    even through the EWMA and hysteresis of :func:`hold_performance`; the weights absorb such noise (a 10%
    weight error moves a few requests), a class set does not (it moves a GPU class's share of the long
    requests at once). The clock ratio is exact and is what a thermal or power throttle changes (NVML
    ``nvmlDeviceGetClockInfo`` / ``nvmlDeviceGetMaxClockInfo``). A GPU slowed without a clock change (a
    noisy neighbour, a bad link) therefore loses weight but keeps its classes.
    """
    return breakdown.throttle if breakdown.fresh else None


@dataclass(frozen=True, kw_only=True)
class PerformanceHold:
    """What :func:`hold_performance` remembers about one endpoint (times in the caller's clock, s).

    Attributes:
        smoothed: EWMA of the measured performance factor (clamped to <= 1).
        held: the factor the class sets are built from, in (0, 1]; changes only past the hysteresis.
        updated_at: the time of the last step.
    """

    smoothed: float
    held: float
    updated_at: float


def hold_performance(
    state: PerformanceHold | None,
    performance: float | None,
    now: float,
    *,
    tau_s: float,
    hysteresis: float,
) -> PerformanceHold:
    """Advance one endpoint's held performance factor to ``now`` (s).

    Args:
        state: the last step's, None for a new endpoint (smoothing starts from the measured value).
        performance: the endpoint's performance factor, :func:`class_set_performance` (the weight model's
            clock-throttle factor; not its load, KV or error factors, which follow the queue and would move
            the sets with every burst, nor its noisy measured speed ratio); None when the telemetry is
            stale or missing. Values above 1 count as 1: a GPU faster than its profile never shrinks a set
            below its static one.
        tau_s / hysteresis: the weight model's ``smoothing_tau_s`` and ``hysteresis``
            (:class:`inferlb.policy.weights.WeightParams`), so the sets move on the same time scale as the
            weights.

    Rule: ``smoothed`` is the EWMA of the factor in continuous time (as :func:`inferlb.policy.weights.step`).
    ``held`` stays 1.0 (healthy) until ``smoothed`` falls below ``1 - hysteresis``; then it follows
    ``smoothed`` whenever that moves by at least ``hysteresis`` (relative) from it, and returns to exactly
    1.0 once ``smoothed`` is back above ``1 - hysteresis / 2`` (the band between the two is what keeps a
    factor hovering near ``1 - hysteresis`` from flapping between the healthy and the degraded sets).
    Stale telemetry is 1.0 at once (the profile: knowing nothing, the static set is the best prior).
    For a constant input ``smoothed`` moves monotonically, so ``held`` changes finitely often, then never.
    """
    if performance is None:
        return PerformanceHold(smoothed=1.0, held=1.0, updated_at=now)
    measured = min(1.0, max(0.0, performance))
    if state is None:
        smoothed, held, since = measured, 1.0, now
    else:
        dt = max(0.0, now - state.updated_at)
        since = max(now, state.updated_at)
        alpha = -math.expm1(-dt / tau_s) if tau_s > 0 else 1.0
        smoothed, held = state.smoothed + alpha * (measured - state.smoothed), state.held
    if held >= 1.0:
        if smoothed < 1.0 - hysteresis:
            held = smoothed
    elif smoothed >= 1.0 - hysteresis / 2:
        held = 1.0
    elif abs(smoothed - held) >= hysteresis * held:
        held = smoothed
    return PerformanceHold(smoothed=smoothed, held=max(held, 1e-6), updated_at=since)
