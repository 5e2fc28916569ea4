"""Envoy's load balancers, modelled without Envoy: one per policy of :mod:`simulation.fleetsim.scenario`
(:func:`make_balancer` builds it). Each balances over hosts ``0..n-1`` from their active requests (Envoy's
``rq_active``), which the caller keeps.

* ``round_robin``: ``ROUND_ROBIN`` with equal weights. Envoy's ``RoundRobinLoadBalancer::unweightedHostPick``
  returns ``hosts[rr_index++ % hosts.size()]`` from a seeded start (``source/extensions/load_balancing_
  policies/round_robin/round_robin_lb.cc``); with unequal weights it is the EDF schedule below with fixed
  weights ("Supported load balancers: Weighted round robin", envoyproxy.io docs).
* ``least_request``: ``LEAST_REQUEST`` with equal weights: "selects N random available hosts (2 by default)
  and picks the host which has the fewest active requests" (P2C, Mitzenmacher), hosts drawn with
  replacement, the first kept on a tie (``LeastRequestLoadBalancer::unweightedHostPick``).
* ``static_weights``: ``LEAST_REQUEST`` with the profile weights of
  :func:`inferlb.policy.capacity.capacity_weight`. With unequal weights Envoy schedules by earliest deadline
  first (``EdfScheduler``: each pick takes the entry with the earliest deadline, sets the scheduler's time to
  it, and re-inserts the host with deadline ``time + 1 / weight``, ties broken by insertion order), where the
  weight is computed at re-insertion as ``load_balancing_weight / (active_requests + 1) ^
  active_request_bias`` ("Load balancers: Weighted least request" and ``LeastRequest.active_request_bias`` in
  the Envoy docs; ``LeastRequestLoadBalancer:: hostWeight``). A host's weight is thus stale until it is next
  picked, as in Envoy. A weight change in EDS rebuilds the schedule (``EdfLoadBalancerBase::refresh`` via
  ``EdfScheduler::createWithPicks``, which starts the rotation at a seeded point): modelled as a rebuild where
  each host's first deadline is ``u / weight`` with ``u`` uniform in (0, 1], the same random phase.
* ``telemetry_weights``: the same weighted least request, with the weights recomputed every telemetry period
  by :func:`inferlb.policy.weights.step` from simulated telemetry, through the same adapter the xDS server
  uses (:func:`inferlb.policy.telemetry.weight_inputs`): each GPU's waiting/running requests and KV usage from
  its engine (``vllm:num_requests_waiting``, ``..._running``, ``vllm:kv_cache_usage_perc``), its generation
  throughput from the tokens emitted over the period (``vllm:generation_tokens_total``), the fleet reference
  rate from :func:`inferlb.policy.weights.fleet_reference_rate`, and the NVML view of a throttle (SM clock at
  ``1 / slowdown`` of its maximum, the SW-thermal reason set; :mod:`simulation.fleetsim.signals`). New
  weights take effect ``push_delay_s`` later (xDS debounce and delivery; :mod:`simulation.fleetsim.loop`).
* ``length_aware``: the telemetry weights, plus placement by the request's length, which the gateway knows
  before routing (the prompt, and the ``max_tokens`` cap on the completion; the trace's completion tokens
  stand in for ``max_tokens``, i.e. a client whose cap is tight). A request whose completion tokens exceed
  ``long_output_threshold`` (by default the ``long_output_percentile``-th nearest-rank percentile of the
  arrivals' completion tokens) is "long" and goes to the *fast set*, the GPUs whose ``relative_capacity``
  is at least ``long_min_relative_capacity``, by weighted least request among them only (its own EDF
  schedule, as Envoy runs one load balancer per subset); when every GPU of the fast set already has at
  least ``max_batch`` active requests (a new request would queue on any of them), it falls back to the whole
  fleet. Every other request goes to the whole fleet by weighted least request. In Envoy
  (``models[].cluster.length_aware``, :mod:`inferlb.policy.length_aware`): ext_proc sets
  ``x-inferlb-length-class`` from the request's output cap and a route with ``metadata_match`` picks the fast
  subset of the cluster (``lb_subset_config`` on GPU-class endpoint metadata; :class:`LengthAwareBalancer`).
  Envoy has no saturation fallback: its subset is fixed by GPU class, so this model's fallback only matches
  Envoy when it never fires (0 fallbacks at 1,000 GPUs; 780 of 3,740 long requests at 100 GPUs, 90% load).
* ``tiered``: ``length_aware`` generalised to every GPU class (:class:`TieredBalancer`). The tiers are the
  fleet's distinct ``relative_capacity`` values, fastest first; length class ``k`` (caps above
  ``tier_thresholds[k]``, longest first) may run only on the ``k + 1`` fastest tiers, the last class
  anywhere (here: the longest on H100s, the middle on H100s and A100s, the rest on every GPU). The
  thresholds come from a rule, not from the outcome: :func:`inferlb.policy.length_aware.tier_thresholds` over
  a training window (:func:`simulation.fleetsim.workload.tiered_thresholds`). A saturated set spills to the
  next wider one (counted as a fallback; Envoy has none).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import pairwise
from typing import Protocol, overload

import msgspec

from inferlb.policy.length_aware import tier_capacity_shares
from inferlb.policy.picker import EndpointState, PickerWeights, PrefixIndex, pick
from inferlb.policy.prefix_index import ApproximatePrefixIndex
from inferlb.traces import TraceRow
from simulation.fleetsim.scenario import Scenario
from simulation.fleetsim.workload import FleetGpu


class EdfScheduler:
    """Envoy's ``EdfScheduler``: earliest deadline first over hosts, for weighted round robin.

    ``pick_and_add`` pops the entry with the earliest deadline (ties: the earlier inserted), sets the
    scheduler's time to that deadline and re-inserts the host with deadline ``time + 1 / weight(host)``.
    The initial deadline of host ``i`` is ``phase_i / weight_i`` with ``phase_i`` in (0, 1] from ``rng``
    (the seeded starting point of ``createWithPicks``).

    Raises:
        ValueError: no hosts or a non-positive weight.
    """

    def __init__(self, weights: Sequence[float], rng: random.Random) -> None:
        if not weights:
            raise ValueError("EdfScheduler needs at least one host")
        if any(not w > 0 for w in weights):
            raise ValueError("EDF weights must be > 0")
        self._heap: list[tuple[float, int, int]] = [
            ((1.0 - rng.random()) / w, i, i) for i, w in enumerate(weights)
        ]
        heapq.heapify(self._heap)
        self._order = len(weights)
        self.time = 0.0

    def pick_and_add(self, weight_of: Callable[[int], float]) -> int:
        """The host with the earliest deadline; it is re-inserted with ``weight_of(host)`` (> 0)."""
        deadline, _, host = heapq.heappop(self._heap)
        self.time = deadline
        heapq.heappush(self._heap, (deadline + 1.0 / weight_of(host), self._order, host))
        self._order += 1
        return host


class Balancer(Protocol):
    """One Envoy cluster load balancer over hosts ``0..n-1``; ``active[h]`` is host ``h``'s active requests
    (Envoy's ``rq_active``), kept by the caller."""

    def pick(self, active: Sequence[int]) -> int:
        """The host for the next request."""
        ...

    def set_weights(self, weights: Sequence[int], active: Sequence[int]) -> None:
        """New EDS ``load_balancing_weight`` values (each >= 1), as after an EDS update."""
        ...


class RoundRobinBalancer:
    """Envoy ``ROUND_ROBIN``: ``hosts[index++ % n]`` from a seeded start with equal weights, the EDF schedule
    with fixed weights otherwise.

    Raises:
        ValueError: ``n_hosts < 1``.
    """

    def __init__(self, n_hosts: int, *, rng: random.Random) -> None:
        if n_hosts < 1:
            raise ValueError(f"n_hosts must be >= 1, got {n_hosts}")
        self._n = n_hosts
        self._rng = rng
        self._next = rng.randrange(n_hosts)
        self._weights: list[float] = [1.0] * n_hosts
        self._edf: EdfScheduler | None = None

    def set_weights(self, weights: Sequence[int], active: Sequence[int]) -> None:
        """Equal weights: plain rotation; unequal: an EDF schedule rebuilt with a new seeded phase."""
        _check_weights(weights, self._n)
        self._weights = [float(w) for w in weights]
        self._edf = None if len(set(weights)) <= 1 else EdfScheduler(self._weights, self._rng)

    def pick(self, active: Sequence[int]) -> int:
        """The next host in the rotation (``active`` is not read)."""
        if self._edf is not None:
            w = self._weights
            return self._edf.pick_and_add(lambda h: w[h])
        h = self._next
        self._next = (h + 1) % self._n
        return h


class LeastRequestBalancer:
    """Envoy ``LEAST_REQUEST``: P2C (``choice_count`` random hosts, fewest active requests, the first on a
    tie) with equal weights; with unequal weights the EDF schedule where a host re-enters with weight
    ``weight / (active + 1) ** active_request_bias``.

    Raises:
        ValueError: ``n_hosts < 1``, ``choice_count < 1`` or a negative bias.
    """

    def __init__(
        self, n_hosts: int, *, rng: random.Random, active_request_bias: float = 1.0, choice_count: int = 2
    ) -> None:
        if n_hosts < 1:
            raise ValueError(f"n_hosts must be >= 1, got {n_hosts}")
        if choice_count < 1:
            raise ValueError(f"choice_count must be >= 1, got {choice_count}")
        if not active_request_bias >= 0:
            raise ValueError(f"active_request_bias must be >= 0, got {active_request_bias}")
        self._n = n_hosts
        self._rng = rng
        self._bias = active_request_bias
        self._choices = choice_count
        self._weights: list[float] = [1.0] * n_hosts
        self._edf: EdfScheduler | None = None

    def effective_weight(self, host: int, active: Sequence[int]) -> float:
        """``weight / (active + 1) ** active_request_bias``, as Envoy's
        ``LeastRequestLoadBalancer::hostWeight``."""
        a = active[host]
        if self._bias == 1.0:
            return self._weights[host] / (a + 1)
        if self._bias == 0.0:
            return self._weights[host]
        return self._weights[host] / float((a + 1) ** self._bias)

    def set_weights(self, weights: Sequence[int], active: Sequence[int]) -> None:
        """Equal weights: P2C; unequal: the EDF schedule rebuilt from the effective weights now."""
        _check_weights(weights, self._n)
        self._weights = [float(w) for w in weights]
        if len(set(weights)) <= 1:
            self._edf = None
            return
        self._edf = EdfScheduler([self.effective_weight(h, active) for h in range(self._n)], self._rng)

    def pick(self, active: Sequence[int]) -> int:
        """The host for the next request (see the class doc)."""
        if self._edf is not None:
            return self._edf.pick_and_add(lambda h: self.effective_weight(h, active))
        rnd = self._rng.randrange
        best = rnd(self._n)
        for _ in range(self._choices - 1):
            h = rnd(self._n)
            if active[h] < active[best]:
                best = h
        return best


def _check_weights(weights: Sequence[int], n: int) -> None:
    if len(weights) != n:
        raise ValueError(f"expected {n} weights, got {len(weights)}")
    if any(w < 1 for w in weights):
        raise ValueError("EDS weights must be >= 1 (Envoy NACKs 0)")


class _SubsetActive(Sequence[int]):
    """The active requests of a subset of hosts, indexed by position in the subset (no copy)."""

    def __init__(self, hosts: Sequence[int], active: Sequence[int]) -> None:
        self._hosts = hosts
        self._active = active

    def __len__(self) -> int:
        return len(self._hosts)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            return [self._active[h] for h in self._hosts[i]]
        return self._active[self._hosts[i]]


class TieredBalancer:
    """Tiered length-aware placement: length classes by output cap, each balanced over a nested host set
    by Envoy's weighted least request (:class:`LeastRequestBalancer`, one schedule per set, as Envoy keeps
    one load balancer per subset).

    ``class_hosts[k]`` is the host set of class ``k`` (longest outputs first; each set contains the one
    before it); ``thresholds[k]`` (non-increasing) is the output cap above which a request is of class
    ``k`` (the first ``k`` whose threshold it exceeds); every other request balances over all ``n_hosts``.
    When every host of a request's set already has at least its ``saturation_active[h]`` active requests
    (for the simulation: the engine's ``max_batch``, beyond which a new request waits in the queue), the
    request falls back to the next wider set, and so on to the whole fleet (Envoy has no such fallback:
    ``fallbacks`` counts how often the model departs from it); with ``spill=False`` it never does, as in
    Envoy, whose subset is fixed by the route's ``metadata_match``. ``class_picks[k]`` counts the requests of
    class ``k`` (the last entry: the unconfined ones). With no confined class (a fleet of one GPU class has
    no faster tier to confine to) every request balances over all hosts: plain weighted least request.
    The whole fleet's schedule draws from ``rng``, the class sets' from ``subset_rng`` (default: ``rng``):
    with a separate one, a run in which no request is confined (every cap at or below the thresholds)
    makes exactly the picks of plain weighted least request on ``rng``.

    Raises:
        ValueError: ``n_hosts < 1``, thresholds and sets of different lengths, an empty set,
            a host out of range, sets not nested, thresholds negative or increasing, or
            ``saturation_active`` not of length ``n_hosts``.
    """

    def __init__(
        self,
        n_hosts: int,
        *,
        class_hosts: Sequence[Sequence[int]],
        thresholds: Sequence[int],
        saturation_active: Sequence[int],
        rng: random.Random,
        active_request_bias: float = 1.0,
        choice_count: int = 2,
        spill: bool = True,
        subset_rng: random.Random | None = None,
    ) -> None:
        if n_hosts < 1:
            raise ValueError(f"n_hosts must be >= 1, got {n_hosts}")
        if len(class_hosts) != len(thresholds):
            raise ValueError("need one threshold per confined class")
        if any(not hosts for hosts in class_hosts):
            raise ValueError("the fast set is empty: no GPU reaches the capacity asked for long requests")
        sets = [tuple(sorted(set(hosts))) for hosts in class_hosts]
        if any(not 0 <= h < n_hosts for s in sets for h in s):
            raise ValueError(f"fast_hosts must be in [0, {n_hosts})")
        if any(not set(a) <= set(b) for a, b in pairwise(sets)):
            raise ValueError("class host sets must be nested (each contains the one before)")
        if any(t < 0 for t in thresholds):
            raise ValueError(f"long_output_threshold must be >= 0, got {min(thresholds)}")
        if any(a < b for a, b in pairwise(thresholds)):
            raise ValueError("thresholds must not increase (longest class first)")
        if len(saturation_active) != n_hosts:
            raise ValueError(f"expected {n_hosts} saturation bounds, got {len(saturation_active)}")
        self._n = n_hosts
        self._rng = rng if subset_rng is None else subset_rng
        self._bias = active_request_bias
        self._choices = choice_count
        self._weights: tuple[int, ...] | None = None
        self.class_hosts: tuple[tuple[int, ...], ...] = tuple(sets)
        self.thresholds: tuple[int, ...] = tuple(thresholds)
        self._bound = tuple(saturation_active)
        self._all = LeastRequestBalancer(
            n_hosts, rng=rng, active_request_bias=active_request_bias, choice_count=choice_count
        )
        self._sets = [
            LeastRequestBalancer(
                len(s), rng=self._rng, active_request_bias=active_request_bias, choice_count=choice_count
            )
            for s in sets
        ]
        self.class_picks = [0] * (len(sets) + 1)
        self.fallbacks = 0
        self.spill = spill

    def set_weights(self, weights: Sequence[int], active: Sequence[int]) -> None:
        """New EDS weights for every host (each >= 1): every schedule is rebuilt."""
        _check_weights(weights, self._n)
        self._weights = tuple(weights)
        self._all.set_weights(weights, active)
        for hosts, lb in zip(self.class_hosts, self._sets, strict=True):
            lb.set_weights([weights[h] for h in hosts], _SubsetActive(hosts, active))

    def set_class_hosts(self, class_hosts: Sequence[Sequence[int]], active: Sequence[int]) -> None:
        """New host sets for the confined classes (one per class, nested, as at construction), as Envoy
        rebuilds its subsets when the endpoints' metadata change (the live sets of
        :func:`inferlb.policy.length_aware.live_class_sets`); each changed set gets a fresh schedule on the
        last weights.

        Raises:
            ValueError: not one set per class, an empty set, a host out of range, or sets not nested.
        """
        sets = [tuple(sorted(set(hosts))) for hosts in class_hosts]
        if len(sets) != len(self.class_hosts) or any(not s for s in sets):
            raise ValueError("need one non-empty host set per confined class")
        if any(not 0 <= h < self._n for s in sets for h in s):
            raise ValueError(f"class hosts must be in [0, {self._n})")
        if any(not set(a) <= set(b) for a, b in pairwise(sets)):
            raise ValueError("class host sets must be nested (each contains the one before)")
        for k, hosts in enumerate(sets):
            if hosts != self.class_hosts[k]:
                self._sets[k] = LeastRequestBalancer(
                    len(hosts), rng=self._rng, active_request_bias=self._bias, choice_count=self._choices
                )
                if self._weights is not None:
                    self._sets[k].set_weights([self._weights[h] for h in hosts], _SubsetActive(hosts, active))
        self.class_hosts = tuple(sets)

    def set_thresholds(self, thresholds: Sequence[int]) -> None:
        """New class thresholds (one per class, non-increasing, >= 0), as the request path applies learnt
        ones (:class:`inferlb.policy.threshold_learner.ThresholdLearner`); the host sets stay.

        Raises:
            ValueError: not one threshold per class, a negative one, or thresholds that increase.
        """
        if len(thresholds) != len(self.class_hosts):
            raise ValueError("need one threshold per confined class")
        if any(t < 0 for t in thresholds) or any(a < b for a, b in pairwise(thresholds)):
            raise ValueError("thresholds must be >= 0 and must not increase (longest class first)")
        self.thresholds = tuple(thresholds)

    def length_class(self, completion_tokens: int) -> int:
        """The class of a request with this completion cap: the first ``k`` with ``cap > thresholds[k]``,
        else ``len(thresholds)`` (anywhere)."""
        for k, t in enumerate(self.thresholds):
            if completion_tokens > t:
                return k
        return len(self.thresholds)

    def saturated(self, k: int, active: Sequence[int]) -> bool:
        """Every host of class ``k``'s set has at least its saturation bound of active requests."""
        bound = self._bound
        return all(active[h] >= bound[h] for h in self.class_hosts[k])

    def pick(self, active: Sequence[int]) -> int:
        """A request of unknown length: the whole fleet."""
        return self._all.pick(active)

    def pick_for(self, active: Sequence[int], completion_tokens: int) -> int:
        """The host for a request with ``completion_tokens`` (see the class doc)."""
        k = self.length_class(completion_tokens)
        self.class_picks[k] += 1
        if k == len(self.thresholds):
            return self._all.pick(active)
        if not self.spill:
            hosts = self.class_hosts[k]
            return hosts[self._sets[k].pick(_SubsetActive(hosts, active))]
        for j in range(k, len(self.class_hosts)):
            if not self.saturated(j, active):
                if j > k:
                    self.fallbacks += 1
                hosts = self.class_hosts[j]
                return hosts[self._sets[j].pick(_SubsetActive(hosts, active))]
        self.fallbacks += 1
        return self._all.pick(active)

    @property
    def confined_picks(self) -> int:
        """Requests of a confined class (every class but the last)."""
        return sum(self.class_picks[:-1])


class LengthAwareBalancer(TieredBalancer):
    """Length-aware placement with two tiers: long requests to a fast set of hosts, the rest to all
    (:class:`TieredBalancer` with one confined class).

    A request is long when its completion tokens (``max_tokens`` at the gateway) exceed
    ``long_output_threshold``. A long request goes to ``fast_hosts`` unless every one of them has at least
    its ``saturation_active[h]`` active requests; then it falls back to the whole fleet. ``fallbacks`` and
    ``long_picks`` count those decisions.

    Raises:
        ValueError: ``n_hosts < 1``, an empty ``fast_hosts`` or one out of range, a negative threshold, or
            ``saturation_active`` not of length ``n_hosts``.
    """

    def __init__(
        self,
        n_hosts: int,
        *,
        fast_hosts: Sequence[int],
        long_output_threshold: int,
        saturation_active: Sequence[int],
        rng: random.Random,
        active_request_bias: float = 1.0,
        choice_count: int = 2,
    ) -> None:
        super().__init__(
            n_hosts,
            class_hosts=(fast_hosts,),
            thresholds=(long_output_threshold,),
            saturation_active=saturation_active,
            rng=rng,
            active_request_bias=active_request_bias,
            choice_count=choice_count,
        )
        self.fast_hosts = self.class_hosts[0]
        self.long_output_threshold = long_output_threshold

    @property
    def long_picks(self) -> int:
        """Requests routed as long."""
        return self.class_picks[0]

    def is_long(self, completion_tokens: int) -> bool:
        """Whether a request with this completion cap goes to the fast set."""
        return completion_tokens > self.long_output_threshold

    def fast_set_saturated(self, active: Sequence[int]) -> bool:
        """Every fast host has at least its saturation bound of active requests."""
        return self.saturated(0, active)


def make_balancer(
    scenario: Scenario,
    gpus: Sequence[FleetGpu],
    rng: random.Random,
    *,
    long_output_threshold: int = 0,
    saturation_active: Sequence[int] | None = None,
    tier_thresholds: Sequence[int] = (),
    caches: Sequence[CachedPrefixes | None] = (),
    cache_blocks: Sequence[int] = (),
) -> Balancer:
    """The balancer of ``scenario.policy`` over ``gpus``, with its initial weights (equal, or the static
    capacity weights for the weighted policies: the telemetry policies start from the profile weights,
    as the xDS server does before any telemetry).

    For ``length_aware``: a :class:`TieredBalancer` with one confined class (as :class:`LengthAwareBalancer`)
    whose fast set is the GPUs of ``relative_capacity >= scenario.long_min_relative_capacity``, with
    ``long_output_threshold`` (tokens) and ``saturation_active`` (per GPU; default 16, the bundled
    ``max_batch``).

    For ``tiered``: a :class:`TieredBalancer` whose class sets are the nested tier sets of
    :func:`inferlb.policy.length_aware.tier_capacity_shares` (the fastest tier, the two fastest, ...), with
    ``tier_thresholds`` (one per set, longest first). A fleet of one GPU class has no tier set, and a
    ``length_aware`` fast set that no GPU reaches is no set: the balancer then confines nothing (plain
    weighted least request with the telemetry weights), and ``tier_thresholds`` must be empty.

    For ``ring_hash``: a :class:`RingHashBalancer` over the GPUs' ``relative_capacity``, keyed on the first
    ``scenario.affinity_blocks`` block ids, bounded by ``scenario.hash_balance_factor``. For
    ``approximate`` and ``precise``: a :class:`PickerBalancer` with ``scenario.picker_weights`` and
    ``scenario.block_tokens``, over an :class:`inferlb.policy.prefix_index.ApproximatePrefixIndex` whose
    per-GPU capacity is ``cache_blocks`` (each engine's cache in blocks; default: unbounded), or over the
    engines' own ``caches`` (:class:`EngineCacheIndex`; ``precise_speculative``: with the pending picks,
    :class:`SpeculativeCacheIndex`).

    Raises:
        ValueError: for ``tiered``, not one threshold per tier set; for ``precise``, not one cache per
            GPU.
    """
    n = len(gpus)
    bounds = saturation_active if saturation_active is not None else [16] * n
    if scenario.policy == "round_robin":
        return RoundRobinBalancer(n, rng=rng)
    if scenario.policy == "ring_hash":
        return RingHashBalancer(
            [g.relative_capacity for g in gpus],
            key_blocks=scenario.affinity_blocks,
            balance=scenario.hash_balance_factor / 100.0,
        )
    if scenario.policy in ("approximate", "precise", "precise_speculative"):
        index: PrefixIndex
        if scenario.policy != "approximate":
            held = [c for c in caches if c is not None]
            if len(held) != n:
                raise ValueError(f"the {scenario.policy} policy needs every engine's prefix cache")
            index = EngineCacheIndex(held) if scenario.policy == "precise" else SpeculativeCacheIndex(held)
        else:
            caps = {str(g): max(1, b) for g, b in enumerate(cache_blocks)}
            index = ApproximatePrefixIndex(capacity_blocks=1 << 40, max_entries=1 << 40, capacities=caps)
        return PickerBalancer(
            [g.relative_capacity for g in gpus],
            index=index,
            weights=scenario.picker_weights,
            block_tokens=scenario.block_tokens,
            salt=str(scenario.seed).encode(),
        )
    if scenario.policy in ("tiered", "length_aware"):
        if scenario.policy == "tiered":
            tiers = tier_capacity_shares([g.relative_capacity for g in gpus])
            class_hosts = [[g.index for g in gpus if g.relative_capacity >= c] for c, _ in tiers]
            thresholds = tuple(tier_thresholds)
        else:  # two tiers: the fast set and the rest
            fast = [g.index for g in gpus if g.relative_capacity >= scenario.long_min_relative_capacity]
            class_hosts = [fast] if fast else []
            thresholds = (long_output_threshold,) if fast else ()
        tb = TieredBalancer(
            n,
            class_hosts=class_hosts,
            thresholds=thresholds,
            saturation_active=bounds,
            rng=rng,
            active_request_bias=scenario.active_request_bias,
            choice_count=scenario.choice_count,
            spill=scenario.spill,
            # the sets' own stream: with nothing confined, the picks are plain weighted least request's
            subset_rng=random.Random(f"{scenario.seed}/class-sets"),
        )
        tb.set_weights([g.static_weight for g in gpus], [0] * n)
        return tb
    lr = LeastRequestBalancer(
        n, rng=rng, active_request_bias=scenario.active_request_bias, choice_count=scenario.choice_count
    )
    if scenario.policy in ("static_weights", "telemetry_weights"):
        lr.set_weights([g.static_weight for g in gpus], [0] * n)
    return lr


# -- prefix-aware placement ----------------------------------------------------------------------------------


class RequestBalancer(Protocol):
    """A balancer that reads the request (its prompt's block ids and lengths) and follows what happens to it:
    the gateway's view. The loop calls :meth:`pick_request` instead of ``pick``, then :meth:`first_token`
    and :meth:`finished` as the request streams (the gateway sees both)."""

    def pick_request(self, active: Sequence[int], request: int, row: TraceRow) -> int:
        """The host for arrival ``request`` (its trace row ``row``)."""
        ...

    def first_token(self, host: int, request: int) -> None:
        """Arrival ``request``'s first token left ``host`` (its prefill is done)."""
        ...

    def finished(self, host: int, request: int) -> None:
        """Arrival ``request`` ended on ``host`` (done, or refused)."""
        ...


def _blake64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class RingHashBalancer:
    """Envoy ``RING_HASH`` with bounded load, keyed on the request's prefix: the ring of
    ``source/extensions/load_balancing_policies/ring_hash/ring_hash_lb.cc`` and the bounded-load walk of
    ``hash_balance_factor`` (Envoy docs "Ring hash": "each host is hashed onto the ring ... proportional to
    its weight"; ``ConsistentHashingLbConfig.hash_balance_factor``).

    The ring: host ``h`` gets ``round(scale * weight_h / W)`` points (at least one) with ``scale =
    min(ceil(min_share * minimum_ring_size) / min_share, maximum_ring_size)``, ``min_share`` the least
    normalised weight, as Envoy sizes it (``minimum_ring_size`` 1024 by default, Envoy's); a point is a
    64-bit hash of ``"{host}_{i}"`` (BLAKE2b here, xxHash64 in Envoy: a different but equally uniform
    placement). A request's key is the hash of its first ``key_blocks`` block ids (the DES stand-in for the
    gateway's prefix key, :mod:`inferlb.policy.affinity`: the conversation's opening); it goes to the first
    point clockwise from it whose host is not overloaded: ``active_h + 1 > ceil(balance * (A + 1) *
    weight_h / W)`` with ``A`` the hosts' active requests (the bounded load of Mirrokni et al., as Envoy's
    ``BoundedLoadHashingLoadBalancer``). A request without block ids hashes on its arrival index.

    Raises:
        ValueError: no hosts, a non-positive weight, ``key_blocks < 1``, ``balance < 1`` or a ring size
            below 1.
    """

    def __init__(
        self,
        weights: Sequence[float],
        *,
        key_blocks: int,
        balance: float = 1.5,
        minimum_ring_size: int = 1024,
        maximum_ring_size: int = 8 * 1024 * 1024,
    ) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError("ring hash needs at least one host, every weight > 0")
        if key_blocks < 1:
            raise ValueError(f"key_blocks must be >= 1, got {key_blocks}")
        if not balance >= 1.0:
            raise ValueError(f"hash_balance_factor must be >= 100 (balance >= 1), got {balance}")
        if minimum_ring_size < 1 or maximum_ring_size < minimum_ring_size:
            raise ValueError("ring sizes must be >= 1, the maximum at least the minimum")
        total = sum(weights)
        shares = [w / total for w in weights]
        least = min(shares)
        scale = min(math.ceil(least * minimum_ring_size) / least, maximum_ring_size)
        points: list[tuple[int, int]] = []
        for h, s in enumerate(shares):
            for i in range(max(1, round(scale * s))):
                points.append((_blake64(f"{h}_{i}".encode()), h))
        points.sort()
        self._hashes = [p for p, _ in points]
        self._hosts = [h for _, h in points]
        self._weights = [float(w) for w in weights]
        self._total = total
        self._balance = balance
        self.key_blocks = key_blocks
        self.spills = 0  # requests sent past their key's first host by the bound

    @property
    def ring_size(self) -> int:
        """Points on the ring."""
        return len(self._hashes)

    def set_weights(self, weights: Sequence[int], active: Sequence[int]) -> None:
        """EDS weights are not followed (the ring is built once from the capacity weights)."""

    def pick(self, active: Sequence[int]) -> int:
        """Without a request, the key is unknown: the ring's first point (callers use :meth:`pick_key`)."""
        return self.pick_key(active, 0)

    def pick_key(self, active: Sequence[int], key: int) -> int:
        """The first host clockwise from ``key`` (64-bit) within the bounded load."""
        n = len(self._hashes)
        start = bisect.bisect_left(self._hashes, key) % n
        total_active = sum(active) + 1
        factor = self._balance * total_active / self._total
        w = self._weights
        first = self._hosts[start]
        for j in range(n):
            h = self._hosts[(start + j) % n]
            if active[h] + 1 <= math.ceil(factor * w[h]):
                if h != first:
                    self.spills += 1
                return h
        return first

    def pick_request(self, active: Sequence[int], request: int, row: TraceRow) -> int:
        """The host of ``row``'s prefix key (see the class doc)."""
        ids = row.block_hashes[: self.key_blocks]
        data = b"".join(i.to_bytes(8, "big", signed=True) for i in ids) if ids else f"r{request}".encode()
        return self.pick_key(active, _blake64(data))

    def first_token(self, host: int, request: int) -> None:
        """Not followed."""

    def finished(self, host: int, request: int) -> None:
        """Not followed."""


class CachedPrefixes(Protocol):
    """What the ``precise`` balancer reads of one engine's prefix cache
    (:class:`simulation.kvcache.PrefixCache` satisfies it)."""

    def is_cached(self, block_hash: int) -> bool: ...


class EngineCacheIndex:
    """A :class:`inferlb.policy.picker.PrefixIndex` that reads the engines' prefix caches themselves: the
    exact state a gateway would rebuild from perfect KV events (vLLM's ``BlockStored`` / ``BlockRemoved``
    with no delay nor loss). A block is cached from the moment its engine *schedules* the request that
    computes it (:meth:`simulation.kvcache.PrefixCache.allocate`), as vLLM emits ``BlockStored``, so a
    request still queued is not yet visible. Hosts are named by their index as a string."""

    def __init__(self, caches: Sequence[CachedPrefixes]) -> None:
        self._is_cached = [c.is_cached for c in caches]  # bound once: a lookup per host per request

    def matched_blocks(self, keys: Sequence[int], addresses: Collection[str]) -> Mapping[str, int]:
        """Host -> leading ``keys`` its cache holds now (hosts holding none left out)."""
        out: dict[str, int] = {}
        if not keys:
            return out
        k0 = keys[0]
        n = len(keys)
        for g, is_cached in enumerate(self._is_cached):
            if is_cached(k0):
                m = 1
                while m < n and is_cached(keys[m]):
                    m += 1
                out[str(g)] = m
        return out

    def record_pick(self, address: str, keys: Sequence[int]) -> None:
        """Nothing to learn: the caches themselves are read."""


class SpeculativeCacheIndex(EngineCacheIndex):
    """:class:`EngineCacheIndex` plus the picks whose blocks the engines have not cached yet: a request sent
    and not yet scheduled counts as held by its host (llm-d's precise prefix-cache scorer does the same,
    "speculative" entries added at pick time until the KV events confirm them). Without it, a follow-up
    that arrives while its conversation's previous turn still waits in the engine's queue sees nothing
    cached and is placed by load alone. An entry lasts until the request's first token (by then its
    engine has scheduled it and its cache holds the blocks) or its end."""

    def __init__(self, caches: Sequence[CachedPrefixes]) -> None:
        super().__init__(caches)
        self._pending: dict[int, tuple[str, tuple[int, ...]]] = {}  # request -> (host, keys)
        self._holders: dict[int, dict[str, int]] = {}  # key -> host -> pending requests holding it

    def add(self, request: int, address: str, keys: Sequence[int]) -> None:
        """Request ``request`` with ``keys`` was sent to ``address``."""
        ks = tuple(keys)
        self._pending[request] = (address, ks)
        for k in ks:
            by = self._holders.setdefault(k, {})
            by[address] = by.get(address, 0) + 1

    def settle(self, request: int) -> None:
        """Request ``request`` was scheduled (its first token) or ended: its entries go."""
        got = self._pending.pop(request, None)
        if got is None:
            return
        address, ks = got
        for k in ks:
            by = self._holders[k]
            if by[address] == 1:
                del by[address]
                if not by:
                    del self._holders[k]
            else:
                by[address] -= 1

    def matched_blocks(self, keys: Sequence[int], addresses: Collection[str]) -> Mapping[str, int]:
        """The caches' matches, raised to the pending picks' where those are longer."""
        out = dict(super().matched_blocks(keys, addresses))
        if not keys:
            return out
        first = self._holders.get(keys[0])
        if not first:
            return out
        for a in first:
            m = 1
            while m < len(keys) and a in self._holders.get(keys[m], ()):
                m += 1
            if m > out.get(a, 0):
                out[a] = m
        return out


class PickerBalancer:
    """The endpoint picker (:func:`inferlb.policy.picker.pick`) as the DES balancer: ``approximate`` with an
    :class:`inferlb.policy.prefix_index.ApproximatePrefixIndex` fed by its own picks, ``precise`` with an
    :class:`EngineCacheIndex` over the engines' caches, or any other index.

    The state it passes per host is the gateway's own: ``in_flight`` (its active requests),
    ``prefill_tokens`` (the prompt tokens it expected each request in flight to prefill, ``prompt_tokens -
    block_tokens * matched`` at its pick, until its first token) and ``decode_tokens`` (the completion tokens
    of the requests in flight, the trace's standing in for ``max_tokens``, until they end); ``weight`` the
    GPU's ``relative_capacity``. The model servers' queue and KV usage (scraped in the live stack) are not
    modelled (0). A request's block keys are its trace block ids, cut to what a lookup may hit
    (``(prompt_tokens - 1) // block_tokens``, vLLM's rule); the first pick of the list is the host.

    Raises:
        ValueError: a non-positive capacity or ``block_tokens < 1``.
    """

    def __init__(
        self,
        capacities: Sequence[float],
        *,
        index: PrefixIndex,
        weights: PickerWeights,
        block_tokens: int,
        salt: bytes = b"",
    ) -> None:
        if any(not c > 0 for c in capacities):
            raise ValueError("capacities must be > 0")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self._n = len(capacities)
        self._index = index
        self._weights = weights
        self._block_tokens = block_tokens
        self._salt = salt
        self._names = [str(g) for g in range(self._n)]
        self._all = frozenset(self._names)
        self._states = [
            EndpointState(address=self._names[g], weight=float(c)) for g, c in enumerate(capacities)
        ]
        self._prefill = [0.0] * self._n
        self._decode = [0.0] * self._n
        self._pending_prefill: dict[int, float] = {}
        self._pending_decode: dict[int, float] = {}
        self._picks = 0
        #: requests whose pick saw at least one block held somewhere, and the blocks it expected to hit
        self.matched_requests = 0
        self.expected_hit_blocks = 0

    def set_weights(self, weights: Sequence[int], active: Sequence[int]) -> None:
        """EDS weights are not read (the picker weighs by ``relative_capacity``)."""

    def pick(self, active: Sequence[int]) -> int:
        """A request of no known prompt: by load alone."""
        self._sync(active)
        return int(pick(self._states, weights=self._weights, salt=self._salt)[0])

    def _sync(self, active: Sequence[int]) -> None:
        states = self._states
        for g in range(self._n):
            s = states[g]
            if s.in_flight != active[g]:
                states[g] = msgspec.structs.replace(s, in_flight=active[g])

    def _set(self, g: int) -> None:
        self._states[g] = msgspec.structs.replace(
            self._states[g], prefill_tokens=self._prefill[g], decode_tokens=self._decode[g]
        )

    def pick_request(self, active: Sequence[int], request: int, row: TraceRow) -> int:
        """The picker's first choice for ``row`` (see the class doc)."""
        self._sync(active)
        bt = self._block_tokens
        keys = row.block_hashes[: max(0, row.prompt_tokens - 1) // bt]
        matched = self._index.matched_blocks(keys, self._all) if keys else {}
        self._picks += 1
        chosen = pick(
            self._states,
            prompt_blocks=len(keys),
            matched_blocks=matched,
            weights=self._weights,
            salt=self._salt,
            prompt_tokens=row.prompt_tokens,
            block_tokens=bt,
            candidate_seed=self._picks,
        )[0]
        g = int(chosen)
        m = min(matched.get(chosen, 0), len(keys))
        if matched:
            self.matched_requests += 1
        self.expected_hit_blocks += m
        if keys:
            self._index.record_pick(chosen, keys)
            if isinstance(self._index, SpeculativeCacheIndex):
                self._index.add(request, chosen, keys)
        miss = float(max(row.prompt_tokens - bt * m, 0))
        self._pending_prefill[request] = miss
        self._pending_decode[request] = float(row.output_cap)
        self._prefill[g] += miss
        self._decode[g] += row.output_cap
        self._set(g)
        return g

    def first_token(self, host: int, request: int) -> None:
        """Its prefill is done: its prompt tokens leave the host's ``prefill_tokens``."""
        if isinstance(self._index, SpeculativeCacheIndex):
            self._index.settle(request)
        miss = self._pending_prefill.pop(request, None)
        if miss is not None:
            self._prefill[host] = max(0.0, self._prefill[host] - miss)
            self._set(host)

    def finished(self, host: int, request: int) -> None:
        """It ended: its completion tokens leave ``decode_tokens`` (and its prefill, if never done)."""
        self.first_token(host, request)
        d = self._pending_decode.pop(request, None)
        if d is not None:
            self._decode[host] = max(0.0, self._decode[host] - d)
            self._set(host)
