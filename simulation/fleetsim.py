"""A discrete-event simulation of a large GPU fleet behind Envoy's load balancers. Pure: no clock, no I/O.

The weight policy (:mod:`inferlb.policy.weights`) is shown at fleet scale here, not assumed.
This module runs a trace's requests through ``N`` simulated model servers (one continuous-batching engine per
GPU, injected by the caller: ``simulation.gpusim.engine.BatchEngine`` satisfies :class:`ServingEngine`; the
core does not import gpusim) with one of four balancers that reproduce what Envoy does, without Envoy:

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
  ``1 / slowdown`` of its maximum, the SW-thermal reason set). New weights take effect ``push_delay_s``
  later (xDS debounce and delivery).
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
  a training window (:func:`tiered_thresholds`). A saturated set spills to the next wider one (counted as a
  fallback; Envoy has none).

**The fleet** (:func:`fleet_mix`): ``N`` GPUs split over the GPU types of the config's endpoints in the
config's proportions (the bundled config has 2 H100, 3 A100, 3 V100, so 1,000 GPUs are 250/375/375).

**Load** (:func:`fleet_capacity_rps`, :func:`scale_trace`): the capacity of a GPU is the request rate it
sustains with a full batch: one request costs ``prefill_seconds(P) + (C - 1) * decode_step_seconds(B) / B``
GPU-seconds (its prefill stalls the batch; its other ``C - 1`` tokens share full steps of ``B`` sequences),
averaged over the trace's prompt (``P``) and completion (``C``) lengths; the fleet's capacity is the sum over
GPUs of one over that mean. The trace is then superposed ``m`` times with circular shifts of ``j / m`` of
its length and time-scaled so that the arrival rate is the target (e.g. 0.9 x capacity): arrival times are
the trace's (rescaled), and each request keeps its prompt and completion tokens.

**Events**: arrivals (in trace order), engine transitions (each engine's
:meth:`ServingEngine.next_transition_time`: an admission, a first token or a completion; runs of identical
decode steps are skipped by the engine), telemetry ticks, weight pushes and the throttle fault. Nothing
happens between events, so 1,000 GPUs and a few hundred thousand requests run in minutes on one core.

**Figures** (:class:`FleetRunResult`): end-to-end latency and time to first token over requests that
arrived in ``[warmup_s, duration_s)`` (nearest-rank percentiles, as :func:`inferlb.ops.replay.percentile`),
tokens/s emitted by the fleet over that window, each GPU's busy fraction over it (NVML's utilization: the
fraction of time a step ran), refused requests (an engine's queue full: the server answers 503; Envoy
retries are not modelled), and after a throttle (:func:`traffic_shift`) how long until the throttled GPUs'
share of arrivals fell below a fraction of its pre-fault value.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, Protocol, overload, runtime_checkable

from inferlb.config.schema import Config, EndpointConfig, HostPort
from inferlb.policy.capacity import capacity_weight
from inferlb.policy.length_aware import (
    DEFAULT_TIER_WORK_FRACTION,
    ClassSetMember,
    PerformanceHold,
    class_set_performance,
    hold_performance,
    live_class_sets,
    tier_capacity_shares,
    tier_thresholds,
)
from inferlb.policy.telemetry import REASON_SW_THERMAL, GpuTelemetry, ServerMetrics, weight_inputs
from inferlb.policy.weights import WeightParams, WeightState, fleet_reference_rate, step, target_weight
from inferlb.traces import TraceRow, percentile

Policy = Literal[
    "round_robin", "least_request", "static_weights", "telemetry_weights", "length_aware", "tiered"
]
POLICIES: tuple[Policy, ...] = (
    "round_robin",
    "least_request",
    "static_weights",
    "telemetry_weights",
    "length_aware",
    "tiered",
)
#: The policies whose weights follow the telemetry (:func:`inferlb.policy.weights.step`).
TELEMETRY_POLICIES: frozenset[Policy] = frozenset({"telemetry_weights", "length_aware", "tiered"})

#: Nominal maximum SM clock reported for every simulated GPU (MHz). Only the ratio current / maximum reaches
#: the weight policy, so one nominal value serves every type.
NOMINAL_MAX_SM_CLOCK_MHZ = 1000.0


# -- the engine seam ----------------------------------------------------------------------------------------


class EngineTiming(Protocol):
    """The timing model of one server (``simulation.gpusim.engine.TimingModel`` satisfies it). Seconds."""

    @property
    def max_batch(self) -> int: ...

    @property
    def relative_capacity(self) -> float: ...

    def prefill_seconds(self, prompt_tokens: int, *, slowdown: float = 1.0) -> float: ...

    def decode_step_seconds(self, running: int, *, slowdown: float = 1.0) -> float: ...


class EngineSnapshot(Protocol):
    """What :meth:`ServingEngine.stats` reports (``simulation.gpusim.engine.EngineStats`` satisfies it)."""

    @property
    def running_requests(self) -> int: ...

    @property
    def waiting_requests(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def generation_tokens_total(self) -> int: ...

    @property
    def prompt_tokens_total(self) -> int: ...

    @property
    def busy_seconds_total(self) -> float: ...


@runtime_checkable
class FirstTokenLike(Protocol):
    """An engine event: a request's first token at ``at`` (``simulation.gpusim.engine.FirstTokenEmitted``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def at(self) -> float: ...


@runtime_checkable
class FinishedLike(Protocol):
    """An engine event: a request's last token at ``at`` (``simulation.gpusim.engine.SequenceFinished``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def at(self) -> float: ...

    @property
    def completion_tokens(self) -> int: ...


@runtime_checkable
class ScheduledLike(Protocol):
    """An engine event: a request joined the batch (``simulation.gpusim.engine.SequenceScheduled``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def queued_seconds(self) -> float: ...


class ServingEngine(Protocol):
    """One GPU's model server in simulated time (``simulation.gpusim.engine.BatchEngine`` satisfies it).

    ``submit`` may refuse (queue full); the simulation learns which through :meth:`holds`.
    """

    @property
    def model(self) -> EngineTiming: ...

    def submit(
        self, now: float, *, request_id: str, prompt_tokens: int, completion_tokens: int, width: int = 1
    ) -> object: ...

    def holds(self, request_id: str) -> bool: ...

    def advance(self, now: float) -> Sequence[object]: ...

    def next_transition_time(self) -> float | None: ...

    def set_slowdown(self, now: float, factor: float) -> None: ...

    def stats(self) -> EngineSnapshot: ...


# -- the fleet ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FleetGpu:
    """One GPU of the simulated fleet.

    Attributes:
        index: position in the fleet (0..N-1).
        gpu_type: GPU profile name (``H100``).
        relative_capacity: the profile's capacity (V100 = 1.0).
        endpoint: an endpoint config for it (never bound; for ``TimingModel.for_endpoint`` and the static
            weight).
        static_weight: :func:`inferlb.policy.capacity.capacity_weight` of the endpoint (EDS weight units).
    """

    index: int
    gpu_type: str
    relative_capacity: float
    endpoint: EndpointConfig
    static_weight: int


def fleet_mix(config: Config, n_gpus: int) -> tuple[FleetGpu, ...]:
    """``n_gpus`` GPUs in the proportions of the GPU types of ``config.endpoints``, types interleaved.

    Counts are rounded by largest remainder, so they add up to ``n_gpus``; GPUs of each type are spread
    evenly over the fleet order (the order does not matter to the balancers, but keeps small fleets mixed).

    Raises:
        ValueError: ``n_gpus < 1``, or the config has no endpoints.
    """
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    if not config.endpoints:
        raise ValueError("the config has no endpoints: the fleet's GPU mix comes from them")
    seen: dict[str, int] = {}
    for e in config.endpoints:
        seen[e.gpu] = seen.get(e.gpu, 0) + 1
    total = sum(seen.values())
    exact = {t: n_gpus * c / total for t, c in seen.items()}
    counts = {t: math.floor(x) for t, x in exact.items()}
    by_remainder = sorted(seen, key=lambda t: (-(exact[t] - counts[t]), list(seen).index(t)))
    for t in by_remainder[: n_gpus - sum(counts.values())]:
        counts[t] += 1
    # Interleave: the k-th GPU of a type of count c sits at fleet position (k + 0.5) / c.
    slots = sorted(((k + 0.5) / c, i, t) for i, (t, c) in enumerate(counts.items()) for k in range(c))
    model = config.endpoints[0].model
    version = config.endpoints[0].version
    out: list[FleetGpu] = []
    for index, (_, _, gpu_type) in enumerate(slots):
        endpoint = EndpointConfig(
            name=f"{gpu_type.lower()}-{index}",
            address=HostPort(host=f"gpu-{index}.fleet.invalid", port=8000),
            model=model,
            version=version,
            gpu=gpu_type,
            simulated=True,
        )
        out.append(
            FleetGpu(
                index=index,
                gpu_type=gpu_type,
                relative_capacity=config.gpu_profiles[gpu_type].relative_capacity,
                endpoint=endpoint,
                static_weight=capacity_weight(config, endpoint),
            )
        )
    return tuple(out)


def request_service_seconds(model: EngineTiming, prompt_tokens: int, completion_tokens: int) -> float:
    """GPU-seconds one request costs a server running full batches: ``prefill_seconds(P) + max(C - 1, 0) *
    decode_step_seconds(B) / B`` (see the module doc)."""
    b = model.max_batch
    return model.prefill_seconds(prompt_tokens) + max(completion_tokens - 1, 0) * (
        model.decode_step_seconds(b) / b
    )


def fleet_capacity_rps(models: Sequence[EngineTiming], rows: Sequence[TraceRow]) -> float:
    """Requests/s the fleet sustains with every GPU running full batches of the trace's mix of requests:
    ``sum over GPUs of 1 / mean(request_service_seconds)``.

    Models of equal ``relative_capacity`` and ``max_batch`` are taken to time alike (they do when built from
    one config), so the mean is computed once per distinct pair.

    Raises:
        ValueError: no models or no rows.
    """
    if not models or not rows:
        raise ValueError("need at least one model and one trace row")
    mean_by_kind: dict[tuple[float, int], float] = {}
    total = 0.0
    for m in models:
        kind = (m.relative_capacity, m.max_batch)
        mean = mean_by_kind.get(kind)
        if mean is None:
            mean = sum(request_service_seconds(m, r.prompt_tokens, r.output_tokens) for r in rows) / len(rows)
            mean_by_kind[kind] = mean
        total += 1.0 / mean
    return total


def scale_trace(rows: Sequence[TraceRow], *, rate_rps: float, duration_s: float) -> list[TraceRow]:
    """The trace's requests at ``rate_rps`` on average for ``duration_s`` seconds (see the module doc).

    ``m = ceil(rate_rps * duration_s / len(rows))`` copies of the trace, copy ``j`` shifted circularly by
    ``j / m`` of the trace period, are merged and time-scaled so that the mean rate is ``rate_rps``; rows at
    or after ``duration_s`` are dropped. The trace period is its span plus one mean inter-arrival gap, so
    the last request of one lap and the first of the next are spaced like the rest. Deterministic.

    Raises:
        ValueError: no rows, or a non-positive rate or duration.
    """
    if not rows:
        raise ValueError("the trace has no rows")
    if not (rate_rps > 0 and duration_s > 0 and math.isfinite(rate_rps) and math.isfinite(duration_s)):
        raise ValueError(f"rate_rps and duration_s must be finite and > 0, got {rate_rps}, {duration_s}")
    n = len(rows)
    t0 = min(r.offset_s for r in rows)
    span = max(r.offset_s for r in rows) - t0
    period = span + (span / (n - 1) if n > 1 and span > 0 else 1.0)
    copies = max(1, math.ceil(rate_rps * duration_s / n))
    speedup = rate_rps * period / (copies * n)
    out: list[TraceRow] = []
    for j in range(copies):
        shift = j * period / copies
        for r in rows:
            at = ((r.offset_s - t0 + shift) % period) / speedup
            if at < duration_s:
                out.append(
                    TraceRow(offset_s=at, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens)
                )
    out.sort(key=lambda r: r.offset_s)
    return out


# -- Envoy's balancers --------------------------------------------------------------------------------------


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
    class ``k`` (the last entry: the unconfined ones).

    Raises:
        ValueError: ``n_hosts < 1``, no class, thresholds and sets of different lengths, an empty set,
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
    ) -> None:
        if n_hosts < 1:
            raise ValueError(f"n_hosts must be >= 1, got {n_hosts}")
        if not class_hosts or len(class_hosts) != len(thresholds):
            raise ValueError("need one threshold per confined class, and at least one class")
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
        self._rng = rng
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
                len(s), rng=rng, active_request_bias=active_request_bias, choice_count=choice_count
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


def long_output_threshold(rows: Sequence[TraceRow], percentile_rank: float) -> int:
    """The nearest-rank ``percentile_rank``-th percentile (0..100) of the rows' completion tokens.

    Raises:
        ValueError: no rows, or a rank outside [0, 100].
    """
    if not rows:
        raise ValueError("no rows to take a percentile of")
    if not 0 <= percentile_rank <= 100:
        raise ValueError(f"percentile_rank must be in [0, 100], got {percentile_rank}")
    return int(percentile([float(r.output_tokens) for r in rows], percentile_rank))


def tiered_thresholds(
    gpus: Sequence[FleetGpu],
    model: EngineTiming,
    rows: Sequence[TraceRow],
    *,
    fraction: float = DEFAULT_TIER_WORK_FRACTION,
) -> tuple[int, ...]:
    """The ``tiered`` policy's thresholds for this fleet from the requests ``rows`` (a training window):
    :func:`inferlb.policy.length_aware.tier_thresholds` over the tier sets of the fleet's GPU classes
    (:func:`inferlb.policy.length_aware.tier_capacity_shares`), each request's work priced by
    :func:`request_service_seconds` on ``model`` (any GPU type: the shares do not depend on it).

    Raises:
        ValueError: no rows, or as :func:`inferlb.policy.length_aware.tier_thresholds`.
    """
    shares = [share for _, share in tier_capacity_shares([g.relative_capacity for g in gpus])]
    samples = [
        (r.output_tokens, request_service_seconds(model, r.prompt_tokens, r.output_tokens)) for r in rows
    ]
    return tier_thresholds(shares, samples, fraction=fraction)


# -- the scenario and its result ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One simulated run.

    Attributes:
        policy: which balancer (see the module doc).
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
            from the arrivals themselves by :func:`tiered_thresholds` (in-sample; the benchmark passes ones
            taken from a training window instead).
        tier_work_fraction: for ``tiered`` without ``tier_thresholds``: the rule's fraction.
        spill: for ``length_aware`` and ``tiered``: a confined request whose set is saturated spills to the
            next wider set (the default, the first model's); False: never, as Envoy's subsets do.
        live_classes: for ``length_aware`` and ``tiered``: the class sets follow the GPUs' performance as the
            xDS server's do with telemetry weights (each telemetry tick: the clock-throttle factor,
            :func:`inferlb.policy.length_aware.class_set_performance`, held by
            :func:`inferlb.policy.length_aware.hold_performance`; the sets by
            :func:`inferlb.policy.length_aware.live_class_sets` over each set's minimum capacity; applied with
            the weights, ``push_delay_s`` later); False: fixed by GPU class.

    Raises:
        ValueError: a non-positive duration, period or factor, a negative delay, a warm-up not before the
            end, or a percentile outside [0, 100].
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

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
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
            :func:`request_service_seconds` prices it (prefill seconds of the prompt tokens it prefilled,
            plus each decoded token at a full-batch step's share, at nominal speed), over the window: the
            share of its capacity (as :func:`fleet_capacity_rps` defines it) it delivered; ~100% =
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


def make_balancer(
    scenario: Scenario,
    gpus: Sequence[FleetGpu],
    rng: random.Random,
    *,
    long_output_threshold: int = 0,
    saturation_active: Sequence[int] | None = None,
    tier_thresholds: Sequence[int] = (),
) -> Balancer:
    """The balancer of ``scenario.policy`` over ``gpus``, with its initial weights (equal, or the static
    capacity weights for the weighted policies: the telemetry policies start from the profile weights,
    as the xDS server does before any telemetry).

    For ``length_aware``: a :class:`TieredBalancer` with one confined class (as :class:`LengthAwareBalancer`)
    whose fast set is the GPUs of ``relative_capacity
    >= scenario.long_min_relative_capacity``, with ``long_output_threshold`` (tokens) and
    ``saturation_active`` (per GPU; default 16, the bundled ``max_batch``).

    Raises:
    For ``tiered``: a :class:`TieredBalancer` whose class sets are the nested tier sets of
    :func:`inferlb.policy.length_aware.tier_capacity_shares` (the fastest tier, the two fastest, ...), with
    ``tier_thresholds`` (one per set, longest first).

    Raises:
        ValueError: for ``length_aware``, no GPU in the fast set; for ``tiered``, not one threshold per
            tier set.
    """
    n = len(gpus)
    bounds = saturation_active if saturation_active is not None else [16] * n
    if scenario.policy == "round_robin":
        return RoundRobinBalancer(n, rng=rng)
    if scenario.policy in ("tiered", "length_aware"):
        if scenario.policy == "tiered":
            tiers = tier_capacity_shares([g.relative_capacity for g in gpus])
            class_hosts = [[g.index for g in gpus if g.relative_capacity >= c] for c, _ in tiers]
            thresholds = tuple(tier_thresholds)
        else:  # two tiers: the fast set and the rest
            class_hosts = [
                [g.index for g in gpus if g.relative_capacity >= scenario.long_min_relative_capacity]
            ]
            thresholds = (long_output_threshold,)
        tb = TieredBalancer(
            n,
            class_hosts=class_hosts,
            thresholds=thresholds,
            saturation_active=bounds,
            rng=rng,
            active_request_bias=scenario.active_request_bias,
            choice_count=scenario.choice_count,
            spill=scenario.spill,
        )
        tb.set_weights([g.static_weight for g in gpus], [0] * n)
        return tb
    lr = LeastRequestBalancer(
        n, rng=rng, active_request_bias=scenario.active_request_bias, choice_count=scenario.choice_count
    )
    if scenario.policy in ("static_weights", "telemetry_weights"):
        lr.set_weights([g.static_weight for g in gpus], [0] * n)
    return lr


_FIRST, _FINISHED, _SCHEDULED, _OTHER = 0, 1, 2, 3
# event classes are classified once each (a runtime Protocol check costs microseconds)
_KIND_OF_TYPE: dict[type, int] = {}


def _kind(event: object) -> int:
    t = type(event)
    k = _KIND_OF_TYPE.get(t)
    if k is None:
        if isinstance(event, FinishedLike):
            k = _FINISHED
        elif isinstance(event, ScheduledLike):
            k = _SCHEDULED
        elif isinstance(event, FirstTokenLike):
            k = _FIRST
        else:
            k = _OTHER
        _KIND_OF_TYPE[t] = k
    return k


# heap entry kinds, in the order they run at equal times: completions free capacity before anything else
_ENGINE, _FAULT, _MARK, _TELEMETRY, _APPLY = 0, 1, 2, 3, 4


def simulate(
    gpus: Sequence[FleetGpu],
    make_engine: Callable[[FleetGpu], ServingEngine],
    arrivals: Sequence[TraceRow],
    scenario: Scenario,
    weight_params: WeightParams | None = None,
) -> FleetRunResult:
    """Run ``arrivals`` (offsets in seconds, sorted) through a fleet of fresh engines under ``scenario``.

    Args:
        gpus: the fleet (:func:`fleet_mix`).
        make_engine: builds one fresh engine per GPU, e.g.
            ``BatchEngine(model=TimingModel.for_endpoint(config, gpu.endpoint))``.
        arrivals: requests with ``offset_s`` the arrival time; those at or after ``duration_s`` are ignored.
        scenario: the policy, bounds and fault.
        weight_params: the weight policy's parameters (:meth:`WeightParams.from_config`), for
            ``telemetry_weights``; defaults to :class:`WeightParams`'s.

    Raises:
        ValueError: an empty fleet, arrivals out of order, or a throttled GPU index out of range.
    """
    n = len(gpus)
    if n < 1:
        raise ValueError("the fleet has no GPUs")
    if any(not 0 <= g < n for g in scenario.throttle_gpus):
        raise ValueError(f"throttle_gpus must be in [0, {n})")
    rows = [r for r in arrivals if r.offset_s < scenario.duration_s]
    if any(rows[i].offset_s > rows[i + 1].offset_s for i in range(len(rows) - 1)):
        raise ValueError("arrivals must be sorted by offset_s")
    params = weight_params or WeightParams()
    rng = random.Random(scenario.seed)
    engines = [make_engine(g) for g in gpus]
    threshold: int | None = None
    if scenario.policy == "length_aware":
        threshold = (
            scenario.long_output_tokens
            if scenario.long_output_tokens is not None
            else long_output_threshold(rows, scenario.long_output_percentile)
            if rows
            else 0
        )
    tiers: tuple[int, ...] = ()
    if scenario.policy == "tiered":
        tiers = (
            scenario.tier_thresholds
            if scenario.tier_thresholds is not None
            else tiered_thresholds(gpus, engines[0].model, rows, fraction=scenario.tier_work_fraction)
        )
    balancer = make_balancer(
        scenario,
        gpus,
        rng,
        long_output_threshold=threshold or 0,
        saturation_active=[e.model.max_batch for e in engines],
        tier_thresholds=tiers,
    )
    length_aware = balancer if isinstance(balancer, TieredBalancer) else None
    # live class sets: each confined class's minimum profile capacity (as make_balancer built its set)
    live = length_aware is not None and scenario.live_classes and scenario.policy in TELEMETRY_POLICIES
    class_min_caps = (
        [c for c, _ in tier_capacity_shares([g.relative_capacity for g in gpus])]
        if scenario.policy == "tiered"
        else [scenario.long_min_relative_capacity]
    )
    holds: list[PerformanceHold | None] = [None] * n
    pending_sets: dict[int, list[list[int]]] = {}
    class_set_changes = 0
    m = len(rows)
    active = [0] * n
    arrival_gpu = [-1] * m
    first_at = [math.nan] * m
    done_at = [math.nan] * m
    refused = [False] * m
    scheduled: list[float | None] = [None] * n
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    events = 0
    weight_pushes = 1 if scenario.policy == "static_weights" or scenario.policy in TELEMETRY_POLICIES else 0
    end = scenario.duration_s + scenario.drain_s

    def push(t: float, kind: int, payload: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, kind, seq, payload))
        seq += 1

    def handle(g: int, evs: Sequence[object]) -> None:
        for ev in evs:
            k = _kind(ev)
            if k == _FINISHED:
                assert isinstance(ev, FinishedLike)
                done_at[int(ev.request_id)] = ev.at
                active[g] -= 1
            elif k == _FIRST:
                assert isinstance(ev, FirstTokenLike)
                first_at[int(ev.request_id)] = ev.at

    def reschedule(g: int) -> None:
        t = engines[g].next_transition_time()
        if t != scheduled[g]:
            scheduled[g] = t
            if t is not None:
                push(t, _ENGINE, g)

    # telemetry state, per GPU
    throttled = [False] * n
    weight_state: list[WeightState | None] = [None] * n
    prev_gen = [0] * n
    pending_weights: dict[int, list[int]] = {}
    # mark id -> per GPU (busy seconds, generated tokens, prefilled prompt tokens)
    marks: dict[int, list[tuple[float, int, int]]] = {}
    applied: list[int] | None = None
    targets = frozenset(scenario.throttle_gpus) if scenario.throttle_at_s is not None else frozenset()
    weight_share: list[tuple[float, float]] = []  # (time applied, throttled GPUs' share of the weights)

    if scenario.policy in TELEMETRY_POLICIES:
        # The fleet has been up for a while: no slow start, smoothing from the profile weight.
        for fg in gpus:
            w = fg.relative_capacity * params.scale
            weight_state[fg.index] = WeightState(
                first_seen_at=-params.slow_start_s - 1.0, updated_at=0.0, smoothed=w, weight=round(w)
            )
        # The balancer starts from the policy's own profile weights (its scale, not fleet.WEIGHT_SCALE).
        applied = [s.weight for s in weight_state if s is not None]
        balancer.set_weights(applied, active)
        if targets:
            weight_share.append((0.0, sum(applied[g] for g in targets) / sum(applied)))
        push(scenario.telemetry_period_s, _TELEMETRY, 0)
    if scenario.throttle_at_s is not None and scenario.throttle_gpus:
        push(scenario.throttle_at_s, _FAULT, 0)
    push(scenario.warmup_s, _MARK, 0)
    push(scenario.duration_s, _MARK, 1)

    def sample_all(now: float) -> list[tuple[float, int, int]]:
        out = []
        for g in range(n):
            handle(g, engines[g].advance(now))
            reschedule(g)
            st = engines[g].stats()
            out.append((st.busy_seconds_total, st.generation_tokens_total, st.prompt_tokens_total))
        return out

    def telemetry_tick(now: float) -> None:
        period = scenario.telemetry_period_s
        snaps: list[EngineSnapshot] = []
        rates: list[float] = []
        for g in range(n):
            handle(g, engines[g].advance(now))
            reschedule(g)
            st = engines[g].stats()
            snaps.append(st)
            rates.append(max(0.0, (st.generation_tokens_total - prev_gen[g]) / period))
            prev_gen[g] = st.generation_tokens_total
        reference = fleet_reference_rate(
            (gpus[g].relative_capacity, rates[g], snaps[g].running_requests) for g in range(n)
        )
        weights: list[int] = []
        for g in range(n):
            st = snaps[g]
            slowdown = scenario.throttle_factor if throttled[g] else 1.0
            server = ServerMetrics(
                family="vllm",
                waiting_requests=float(st.waiting_requests),
                running_requests=float(st.running_requests),
                kv_cache_usage=st.kv_usage,
                generation_tokens_total=float(st.generation_tokens_total),
            )
            gpu = GpuTelemetry(
                index=0,
                uuid=f"GPU-sim-{g}",
                name=gpus[g].gpu_type,
                utilization_percent=0.0,
                memory_used_bytes=0,
                memory_total_bytes=0,
                temperature_c=0.0,
                throttle_reasons=REASON_SW_THERMAL if throttled[g] else 0,
                thermal_throttled=throttled[g],
                sm_clock_mhz=NOMINAL_MAX_SM_CLOCK_MHZ / slowdown,
                max_sm_clock_mhz=NOMINAL_MAX_SM_CLOCK_MHZ,
            )
            inputs = weight_inputs(
                profile_capacity=gpus[g].relative_capacity,
                max_batch=engines[g].model.max_batch,
                server=server,
                server_age_s=0.0,
                gpu=gpu,
                gpu_age_s=0.0,
                stale_after_s=params.stale_after_s,
                generation_tokens_per_s=rates[g],
                reference_tokens_per_s=reference,
            )
            state, w = step(weight_state[g], inputs, now, params)
            weight_state[g] = state
            weights.append(w)
            if live:
                holds[g] = hold_performance(
                    holds[g],
                    class_set_performance(target_weight(inputs, params)),
                    now,
                    tau_s=params.smoothing_tau_s,
                    hysteresis=params.hysteresis,
                )
        if live:
            members = [
                ClassSetMember(name=f"{g:09d}", capacity=gpus[g].relative_capacity, performance=h.held)
                for g, h in enumerate(holds)
                if h is not None
            ]
            sets = live_class_sets(members, class_min_caps)
            pending_sets[seq] = [[int(name) for name in names] for names in sets]
        pending_weights[seq] = weights
        push(now + scenario.push_delay_s, _APPLY, seq)
        if now + period < scenario.duration_s:
            push(now + period, _TELEMETRY, 0)

    ai = 0
    now = 0.0
    while True:
        next_arrival = rows[ai].offset_s if ai < m else math.inf
        top = heap[0][0] if heap else math.inf
        t = min(next_arrival, top)
        if t > end or t == math.inf:
            break
        now = t
        events += 1
        if top <= next_arrival:
            _, kind, _, payload = heapq.heappop(heap)
            if kind == _ENGINE:
                g = payload
                if scheduled[g] != t:
                    continue  # superseded
                scheduled[g] = None
                handle(g, engines[g].advance(t))
                reschedule(g)
            elif kind == _TELEMETRY:
                telemetry_tick(t)
            elif kind == _APPLY:
                new_sets = pending_sets.pop(payload, None)
                if (
                    new_sets is not None
                    and length_aware is not None
                    and [sorted(x) for x in new_sets] != [list(x) for x in length_aware.class_hosts]
                ):
                    length_aware.set_class_hosts(new_sets, active)
                    class_set_changes += 1
                weights = pending_weights.pop(payload)
                if weights != applied:
                    balancer.set_weights(weights, active)
                    applied = weights
                    weight_pushes += 1
                    if targets:
                        weight_share.append((t, sum(weights[g] for g in targets) / sum(weights)))
            elif kind == _FAULT:
                for g in scenario.throttle_gpus:
                    engines[g].set_slowdown(t, scenario.throttle_factor)
                    throttled[g] = True
                    handle(g, engines[g].advance(t))
                    reschedule(g)
            else:  # _MARK
                marks[payload] = sample_all(t)
            continue
        r = rows[ai]
        g = balancer.pick(active) if length_aware is None else length_aware.pick_for(active, r.output_tokens)
        rid = str(ai)
        arrival_gpu[ai] = g
        eng = engines[g]
        eng.submit(t, request_id=rid, prompt_tokens=r.prompt_tokens, completion_tokens=r.output_tokens)
        if eng.holds(rid):
            active[g] += 1
        else:
            refused[ai] = True
        handle(g, eng.advance(t))
        reschedule(g)
        ai += 1

    # figures
    e2e: list[float] = []
    ttft: list[float] = []
    measured = 0
    for i, r in enumerate(rows):
        if not scenario.warmup_s <= r.offset_s < scenario.duration_s:
            continue
        measured += 1
        if not math.isnan(done_at[i]):
            e2e.append(done_at[i] - r.offset_s)
            if not math.isnan(first_at[i]):
                ttft.append(first_at[i] - r.offset_s)
    n_refused = sum(refused)
    n_finished = sum(1 for x in done_at if not math.isnan(x))
    start_mark = marks.get(0, [(0.0, 0, 0)] * n)
    end_mark = marks.get(1, start_mark)
    window = scenario.duration_s - scenario.warmup_s
    busy = tuple(100.0 * (end_mark[g][0] - start_mark[g][0]) / window for g in range(n))
    tokens = sum(end_mark[g][1] - start_mark[g][1] for g in range(n))
    # Work done in the window, from the engines' counters: the prompt tokens prefilled, and the tokens
    # decoded (generated tokens less the first ones, which come out of the prefill) at full-batch cost.
    first_tokens = [0] * n
    for i in range(m):
        if scenario.warmup_s < first_at[i] <= scenario.duration_s:
            first_tokens[arrival_gpu[i]] += 1
    work_s = []
    for g in range(n):
        model = engines[g].model
        b = model.max_batch
        decoded = max(0, end_mark[g][1] - start_mark[g][1] - first_tokens[g])
        prefilled = end_mark[g][2] - start_mark[g][2]
        work_s.append(model.prefill_seconds(prefilled) + decoded * model.decode_step_seconds(b) / b)
    work = tuple(100.0 * w / window for w in work_s)
    by_type: dict[str, list[float]] = {}
    refused_by_type: dict[str, int] = {}
    for fg in gpus:
        by_type.setdefault(fg.gpu_type, []).append(work[fg.index])
        refused_by_type.setdefault(fg.gpu_type, 0)
    for i in range(m):
        if refused[i]:
            refused_by_type[gpus[arrival_gpu[i]].gpu_type] += 1
    times = tuple(r.offset_s for r in rows)
    shift = None
    weight_shift_s = None
    if scenario.throttle_at_s is not None and targets:
        shift = traffic_shift(
            times, arrival_gpu, targets, fault_at=scenario.throttle_at_s, end=scenario.duration_s
        )
        before = [s for at, s in weight_share if at <= scenario.throttle_at_s]
        if before:
            for at, s in weight_share:
                if at > scenario.throttle_at_s and s < shift.threshold * before[-1]:
                    weight_shift_s = at - scenario.throttle_at_s
                    break
    return FleetRunResult(
        policy=scenario.policy,
        gpus=n,
        arrivals=m,
        finished=n_finished,
        refused=n_refused,
        unfinished=m - n_finished - n_refused,
        measured=measured,
        e2e_p50_s=percentile(e2e, 50),
        e2e_p99_s=percentile(e2e, 99),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        throughput_tokens_per_s=tokens / window,
        busy_percent=busy,
        busy_spread_pts=max(busy) - min(busy),
        work_percent=work,
        work_spread_pts=max(work) - min(work),
        work_p95_p5_pts=percentile(work, 95) - percentile(work, 5),
        work_by_type={t: sum(v) / len(v) for t, v in by_type.items()},
        refused_by_type=refused_by_type,
        weight_pushes=weight_pushes,
        arrival_times=times,
        arrival_gpus=tuple(arrival_gpu),
        shift=shift,
        weight_shift_s=weight_shift_s,
        events=events,
        sim_end_s=now,
        long_output_threshold=threshold,
        long_requests=0 if length_aware is None else length_aware.confined_picks,
        long_fallbacks=0 if length_aware is None else length_aware.fallbacks,
        tier_thresholds=tiers if scenario.policy == "tiered" else None,
        class_requests=() if length_aware is None else tuple(length_aware.class_picks),
        class_set_changes=class_set_changes,
        live_classes=live,
    )


# -- traffic share after a fault ----------------------------------------------------------------------------


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
