"""Length-aware placement (pure): long generations go to the fast GPUs of a model's cluster.

Why: at 90% load the slowest 1% of requests are long completions decoding on slow GPUs (a V100 decodes a
600-1,000-token answer in 15-40 s where an H100 takes a third of that). Endpoint weights change how many
requests each GPU gets, not which GPU gets the long ones. The gateway knows each request's output cap before
routing, so it can send the long ones to the fast GPUs (issue 5; bench/fleet_sim.py and bench/routing.py
measure it).

How it runs in Envoy, for a model whose ``cluster.length_aware`` is set
(:class:`inferlb.config.LengthAwareRouting`):

1. ext_proc classifies each admitted request by its output cap, :meth:`inferlb.openai_api.InferenceRequest.
   output_token_cap` (``max_completion_tokens``/``max_tokens``/``max_output_tokens``, else the model's
   ``default_max_tokens``, x ``n`` x prompts: the tokens quota admission reserves): above
   ``long_output_tokens`` it is :data:`LONG`, else :data:`SHORT` (:func:`length_class`), and sets the
   ``x-inferlb-length-class`` header (:data:`inferlb.headers.LENGTH_CLASS`).
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
:mod:`inferlb.fleetsim`, Envoy does not fall back from a busy fast subset to the whole fleet: the subset is
fixed by GPU class, not by load (a fast GPU that throttles stays in it, with its lowered weight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

from inferlb.config import Config, LengthAwareRouting

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
            request's GPU-seconds on any one GPU type (:func:`inferlb.fleetsim.request_service_seconds`:
            prefill plus decode at full batch; the shares do not depend on the type, since every rate scales
            with ``relative_capacity``).
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
