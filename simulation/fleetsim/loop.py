"""The event loop: :func:`simulate` runs a trace's arrivals through a fleet of fresh engines under one
:class:`simulation.fleetsim.scenario.Scenario` and returns its figures
(:class:`simulation.fleetsim.results.FleetRunResult`).

**Events**: arrivals (in trace order), engine transitions (each engine's
:meth:`simulation.fleetsim.seams.ServingEngine.next_transition_time`: an admission, a first token or a
completion; runs of identical decode steps are skipped by the engine), telemetry ticks, weight pushes and the
throttle fault. Nothing happens between events, so 1,000 GPUs and a few hundred thousand requests run in
minutes on one core. At equal times the queued events run before an arrival, engine transitions first
(completions free capacity before anything else), then the fault, the marks of the figures' window,
telemetry ticks and weight pushes.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence

from inferlb.policy.length_aware import (
    ClassSetMember,
    PerformanceHold,
    class_set_performance,
    hold_performance,
    live_class_sets,
    tier_capacity_shares,
)
from inferlb.policy.output_predictor import LengthQuery, OutputPredictor
from inferlb.policy.threshold_learner import ThresholdLearner, request_work
from inferlb.policy.weights import WeightParams, WeightState, fleet_reference_rate, step, target_weight
from inferlb.traces import TraceRow, percentile
from simulation.fleetsim.balancers import PickerBalancer, RingHashBalancer, TieredBalancer, make_balancer
from simulation.fleetsim.results import (
    LONG_SHARE_PERCENTILE,
    FleetRunResult,
    LengthClassLatency,
    TrafficShift,
    traffic_shift,
)
from simulation.fleetsim.scenario import TELEMETRY_POLICIES, Scenario
from simulation.fleetsim.seams import (
    EngineSnapshot,
    FinishedLike,
    FirstTokenLike,
    ScheduledLike,
    ServingEngine,
)
from simulation.fleetsim.signals import simulated_weight_inputs
from simulation.fleetsim.workload import FleetGpu, length_query, long_output_threshold, tiered_thresholds
from simulation.kvcache import PromptBlocks

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


#: A threshold no cap exceeds: the learnt-threshold run confines nothing before its first derivation.
_NEVER_CONFINED = 2**62

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
        gpus: the fleet (:func:`simulation.fleetsim.workload.fleet_mix`).
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
    run = _FleetRun(gpus, make_engine, rows, scenario, weight_params or WeightParams())
    run.run()
    return run.result()


class _FleetRun:
    """One :func:`simulate` run: the engines and the balancer, the event heap, what happened to each request
    (indexed by arrival), and the telemetry state; one method per kind of event, then the figures."""

    def __init__(
        self,
        gpus: Sequence[FleetGpu],
        make_engine: Callable[[FleetGpu], ServingEngine],
        rows: list[TraceRow],
        scenario: Scenario,
        params: WeightParams,
    ) -> None:
        n = len(gpus)
        m = len(rows)
        self.gpus = gpus
        self.rows = rows
        self.scenario = scenario
        self.params = params
        self.n = n
        rng = random.Random(scenario.seed)
        self.engines = [make_engine(g) for g in gpus]
        # the engines' prefix caches, for the policies that read or size by them (None: an engine has none)
        caches = [getattr(e, "prefix_cache", None) for e in self.engines]
        self.threshold = self._long_output_threshold()
        self.tiers = self._tier_thresholds()
        self.balancer = make_balancer(
            scenario,
            gpus,
            rng,
            long_output_threshold=self.threshold or 0,
            saturation_active=[e.model.max_batch for e in self.engines],
            tier_thresholds=self.tiers,
            caches=caches,
            cache_blocks=[0 if c is None else int(c.num_blocks) for c in caches],
        )
        # the balancer when it reads each request and follows its stream (ring_hash, the picker), else None
        self.by_request = (
            self.balancer if isinstance(self.balancer, (RingHashBalancer, PickerBalancer)) else None
        )
        # the balancer when it places by length (length_aware, tiered), else None
        self.by_length = self.balancer if isinstance(self.balancer, TieredBalancer) else None
        # live class sets: each confined class's minimum profile capacity (as make_balancer built its set)
        # (none when the balancer confines nothing: a fleet of one GPU class)
        self.live = (
            self.by_length is not None
            and bool(self.by_length.class_hosts)
            and scenario.live_classes
            and scenario.policy in TELEMETRY_POLICIES
        )
        self.class_min_caps = (
            [c for c, _ in tier_capacity_shares([g.relative_capacity for g in gpus])]
            if scenario.policy == "tiered"
            else [scenario.long_min_relative_capacity]
        )
        # predicted lengths: the predictor, each request's query until it finishes, the predicted arrivals
        self.predictor = (
            OutputPredictor() if scenario.predict_lengths and self.by_length is not None else None
        )
        self.queries: dict[int, LengthQuery] = {}
        self.predicted = 0
        # learnt thresholds: the learner (None without a confined class), and the thresholds it set
        self.learner: ThresholdLearner | None = None
        self.threshold_changes = 0
        if scenario.learn_thresholds and self.by_length is not None and self.by_length.class_hosts:
            shares = [share for _, share in tier_capacity_shares([g.relative_capacity for g in gpus])]
            self.learner = ThresholdLearner(shares)
            self.by_length.set_thresholds([_NEVER_CONFINED] * len(shares))
        self.holds: list[PerformanceHold | None] = [None] * n
        self.pending_sets: dict[int, list[list[int]]] = {}
        self.class_set_changes = 0
        # per request: its GPU, first token and completion times, whether it was refused
        self.arrival_gpu = [-1] * m
        self.first_at = [math.nan] * m
        self.done_at = [math.nan] * m
        self.refused = [False] * m
        # per GPU: active requests (Envoy's rq_active), the engine transition queued for it
        self.active = [0] * n
        self.scheduled: list[float | None] = [None] * n
        # queued events: (time, kind, sequence number, payload)
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.events = 0
        self.now = 0.0
        self.weight_pushes = (
            1 if scenario.policy == "static_weights" or scenario.policy in TELEMETRY_POLICIES else 0
        )
        self.end = scenario.duration_s + scenario.drain_s
        self._init_telemetry()
        self._queue_first_events()

    def _long_output_threshold(self) -> int | None:
        """For ``length_aware``: the long-request threshold (tokens), given or from the arrivals."""
        scenario, rows = self.scenario, self.rows
        if scenario.policy != "length_aware":
            return None
        return (
            scenario.long_output_tokens
            if scenario.long_output_tokens is not None
            else long_output_threshold(rows, scenario.long_output_percentile)
            if rows
            else 0
        )

    def _tier_thresholds(self) -> tuple[int, ...]:
        """For ``tiered``: the class thresholds, given or by the rule over the arrivals (in-sample)."""
        scenario = self.scenario
        if scenario.policy != "tiered":
            return ()
        return (
            scenario.tier_thresholds
            if scenario.tier_thresholds is not None
            else tiered_thresholds(
                self.gpus, self.engines[0].model, self.rows, fraction=scenario.tier_work_fraction
            )
        )

    def _init_telemetry(self) -> None:
        """The telemetry state, per GPU, and the weights the balancer applied."""
        n, scenario = self.n, self.scenario
        self.throttled = [False] * n
        self.weight_state: list[WeightState | None] = [None] * n
        self.prev_gen = [0] * n
        self.pending_weights: dict[int, list[int]] = {}
        # mark id -> per GPU (busy seconds, generated tokens, prefilled prompt tokens, prefix cache queries,
        # prefix cache hits)
        self.marks: dict[int, list[tuple[float, int, int, int, int]]] = {}
        self.applied: list[int] | None = None
        self.targets = (
            frozenset(scenario.throttle_gpus) if scenario.throttle_at_s is not None else frozenset()
        )
        # (time applied, throttled GPUs' share of the weights)
        self.weight_share: list[tuple[float, float]] = []

    def _queue_first_events(self) -> None:
        """The telemetry policies' initial weights and first tick, the fault, and the window's marks."""
        scenario, params = self.scenario, self.params
        if scenario.policy in TELEMETRY_POLICIES:
            # The fleet has been up for a while: no slow start, smoothing from the profile weight.
            for fg in self.gpus:
                w = fg.relative_capacity * params.scale
                self.weight_state[fg.index] = WeightState(
                    first_seen_at=-params.slow_start_s - 1.0, updated_at=0.0, smoothed=w, weight=round(w)
                )
            # The balancer starts from the policy's own profile weights (its scale, not fleet.WEIGHT_SCALE).
            applied = [s.weight for s in self.weight_state if s is not None]
            self.applied = applied
            self.balancer.set_weights(applied, self.active)
            if self.targets:
                self.weight_share.append((0.0, sum(applied[g] for g in self.targets) / sum(applied)))
            self._push(scenario.telemetry_period_s, _TELEMETRY, 0)
        if scenario.throttle_at_s is not None and scenario.throttle_gpus:
            self._push(scenario.throttle_at_s, _FAULT, 0)
        self._push(scenario.warmup_s, _MARK, 0)
        self._push(scenario.duration_s, _MARK, 1)

    # -- the loop and its events --------------------------------------------------------------------------

    def run(self) -> None:
        """Process events in time order until none is left or the next is past the drain bound."""
        rows, heap, end = self.rows, self.heap, self.end
        m = len(rows)
        ai = 0
        while True:
            next_arrival = rows[ai].offset_s if ai < m else math.inf
            top = heap[0][0] if heap else math.inf
            t = min(next_arrival, top)
            if t > end or t == math.inf:
                break
            self.now = t
            self.events += 1
            if top <= next_arrival:
                _, kind, _, payload = heapq.heappop(heap)
                if kind == _ENGINE:
                    self._engine_transition(payload, t)
                elif kind == _TELEMETRY:
                    self._telemetry_tick(t)
                elif kind == _APPLY:
                    self._apply(payload, t)
                elif kind == _FAULT:
                    self._fault(t)
                else:  # _MARK
                    self.marks[payload] = self._sample_all(t)
                continue
            self._arrival(ai, t)
            ai += 1

    def _push(self, t: float, kind: int, payload: int) -> None:
        heapq.heappush(self.heap, (t, kind, self.seq, payload))
        self.seq += 1

    def _handle(self, g: int, evs: Sequence[object]) -> None:
        """Record GPU ``g``'s engine events: first tokens, and completions (each frees an active request)."""
        for ev in evs:
            k = _kind(ev)
            if k == _FINISHED:
                assert isinstance(ev, FinishedLike)
                self.done_at[int(ev.request_id)] = ev.at
                self.active[g] -= 1
                if self.predictor is not None:
                    rid = int(ev.request_id)
                    q = self.queries.pop(rid, None)
                    if q is not None:  # metering: the true completion of the answer
                        self.predictor.observe(q, self.rows[rid].output_tokens)
                if self.by_request is not None:
                    self.by_request.finished(g, int(ev.request_id))
            elif k == _FIRST:
                assert isinstance(ev, FirstTokenLike)
                self.first_at[int(ev.request_id)] = ev.at
                if self.by_request is not None:
                    self.by_request.first_token(g, int(ev.request_id))

    def _reschedule(self, g: int) -> None:
        """Queue GPU ``g``'s next engine transition, unless the one queued is still it."""
        t = self.engines[g].next_transition_time()
        if t != self.scheduled[g]:
            self.scheduled[g] = t
            if t is not None:
                self._push(t, _ENGINE, g)

    def _advance(self, g: int, now: float) -> None:
        """Bring GPU ``g``'s engine to ``now``, record its events, and queue its next transition."""
        self._handle(g, self.engines[g].advance(now))
        self._reschedule(g)

    def _arrival(self, ai: int, t: float) -> None:
        """Arrival ``ai``: the balancer picks a GPU, whose engine takes the request or refuses it."""
        r = self.rows[ai]
        active = self.active
        by_length = self.by_length
        if self.by_request is not None:
            g = self.by_request.pick_request(active, ai, r)
        elif by_length is None:
            g = self.balancer.pick(active)
        elif self.predictor is None:
            if self.learner is not None:
                self._learn(r, t, by_length)
            g = by_length.pick_for(active, r.output_cap)
        else:
            q = length_query(r, self.scenario.default_max_tokens)
            est = self.predictor.estimate(q)
            self.queries[ai] = q
            self.predicted += est.predicted
            g = by_length.pick_for(active, est.output_tokens)
        rid = str(ai)
        self.arrival_gpu[ai] = g
        eng = self.engines[g]
        if r.block_hashes:
            prompts = (PromptBlocks(tokens=r.prompt_tokens, hashes=r.block_hashes),)
            eng.submit(
                t,
                request_id=rid,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.output_tokens,
                prompts=prompts,
            )
        else:  # no block ids: the call of a run without prefix caching, unchanged
            eng.submit(t, request_id=rid, prompt_tokens=r.prompt_tokens, completion_tokens=r.output_tokens)
        if eng.holds(rid):
            active[g] += 1
        else:
            self.refused[ai] = True
            self.queries.pop(ai, None)
            if self.by_request is not None:
                self.by_request.finished(g, ai)
        self._handle(g, eng.advance(t))
        self._reschedule(g)

    def _learn(self, r: TraceRow, t: float, by_length: TieredBalancer) -> None:
        """The learner sees arrival ``r``'s cap; its thresholds, once it has any, replace the balancer's."""
        assert self.learner is not None
        self.learner.observe(r.output_cap, request_work(r.prompt_tokens, r.output_cap), t)
        learnt = self.learner.thresholds(t)
        if learnt is not None and learnt != by_length.thresholds:
            by_length.set_thresholds(learnt)
            self.threshold_changes += 1

    def _engine_transition(self, g: int, t: float) -> None:
        """GPU ``g``'s engine reached a transition queued for ``t`` (ignored when superseded since)."""
        if self.scheduled[g] != t:
            return  # superseded
        self.scheduled[g] = None
        self._advance(g, t)

    def _fault(self, t: float) -> None:
        """The throttle: the throttled GPUs slow down by ``throttle_factor`` from ``t``."""
        for g in self.scenario.throttle_gpus:
            self.engines[g].set_slowdown(t, self.scenario.throttle_factor)
            self.throttled[g] = True
            self._advance(g, t)

    def _sample_all(self, now: float) -> list[tuple[float, int, int, int, int]]:
        """Every GPU's counters now: (busy seconds, generated tokens, prefilled prompt tokens, prefix cache
        queries, prefix cache hits)."""
        out = []
        for g in range(self.n):
            self._advance(g, now)
            st = self.engines[g].stats()
            out.append(
                (
                    st.busy_seconds_total,
                    st.generation_tokens_total,
                    st.prompt_tokens_total,
                    st.prefix_cache_queries_total,
                    st.prefix_cache_hits_total,
                )
            )
        return out

    def _telemetry_tick(self, now: float) -> None:
        """Sample every GPU, compute the new weights (and live class sets), and queue them for
        ``push_delay_s`` later; queue the next tick while arrivals last."""
        scenario, gpus = self.scenario, self.gpus
        period = scenario.telemetry_period_s
        snaps, rates = self._sample_rates(now, period)
        reference = fleet_reference_rate(
            (gpus[g].relative_capacity, rates[g], snaps[g].running_requests) for g in range(self.n)
        )
        weights = [self._gpu_weight(g, snaps[g], rates[g], reference, now) for g in range(self.n)]
        if self.live:
            self.pending_sets[self.seq] = self._live_sets()
        self.pending_weights[self.seq] = weights
        self._push(now + scenario.push_delay_s, _APPLY, self.seq)
        if now + period < scenario.duration_s:
            self._push(now + period, _TELEMETRY, 0)

    def _sample_rates(self, now: float, period: float) -> tuple[list[EngineSnapshot], list[float]]:
        """Every GPU's stats now, and its generation rate (tokens/s) over the last ``period``."""
        snaps: list[EngineSnapshot] = []
        rates: list[float] = []
        for g in range(self.n):
            self._advance(g, now)
            st = self.engines[g].stats()
            snaps.append(st)
            rates.append(max(0.0, (st.generation_tokens_total - self.prev_gen[g]) / period))
            self.prev_gen[g] = st.generation_tokens_total
        return snaps, rates

    def _gpu_weight(
        self, g: int, st: EngineSnapshot, rate: float, reference: float | None, now: float
    ) -> int:
        """GPU ``g``'s new weight by :func:`inferlb.policy.weights.step` (its state updated), and with live
        classes its held performance."""
        params = self.params
        inputs = simulated_weight_inputs(
            g,
            self.gpus[g],
            st,
            max_batch=self.engines[g].model.max_batch,
            throttled=self.throttled[g],
            throttle_factor=self.scenario.throttle_factor,
            params=params,
            generation_tokens_per_s=rate,
            reference_tokens_per_s=reference,
        )
        state, w = step(self.weight_state[g], inputs, now, params)
        self.weight_state[g] = state
        if self.live:
            self.holds[g] = hold_performance(
                self.holds[g],
                class_set_performance(target_weight(inputs, params)),
                now,
                tau_s=params.smoothing_tau_s,
                hysteresis=params.hysteresis,
            )
        return w

    def _live_sets(self) -> list[list[int]]:
        """The confined classes' host sets from the GPUs' held performance
        (:func:`inferlb.policy.length_aware.live_class_sets`)."""
        members = [
            ClassSetMember(name=f"{g:09d}", capacity=self.gpus[g].relative_capacity, performance=h.held)
            for g, h in enumerate(self.holds)
            if h is not None
        ]
        sets = live_class_sets(members, self.class_min_caps)
        return [[int(name) for name in names] for names in sets]

    def _apply(self, payload: int, t: float) -> None:
        """The weights (and class sets) computed at tick ``payload`` reach the balancer."""
        new_sets = self.pending_sets.pop(payload, None)
        by_length = self.by_length
        if (
            new_sets is not None
            and by_length is not None
            and [sorted(x) for x in new_sets] != [list(x) for x in by_length.class_hosts]
        ):
            by_length.set_class_hosts(new_sets, self.active)
            self.class_set_changes += 1
        weights = self.pending_weights.pop(payload)
        if weights != self.applied:
            self.balancer.set_weights(weights, self.active)
            self.applied = weights
            self.weight_pushes += 1
            if self.targets:
                self.weight_share.append((t, sum(weights[g] for g in self.targets) / sum(weights)))

    # -- the figures --------------------------------------------------------------------------------------

    def result(self) -> FleetRunResult:
        """The run's figures (see :mod:`simulation.fleetsim.results`)."""
        scenario, n, m = self.scenario, self.n, len(self.rows)
        e2e, ttft, measured = self._latencies()
        n_refused = sum(self.refused)
        n_finished = sum(1 for x in self.done_at if not math.isnan(x))
        start_mark = self.marks.get(0, [(0.0, 0, 0, 0, 0)] * n)
        end_mark = self.marks.get(1, start_mark)
        window = scenario.duration_s - scenario.warmup_s
        busy = tuple(100.0 * (end_mark[g][0] - start_mark[g][0]) / window for g in range(n))
        tokens = sum(end_mark[g][1] - start_mark[g][1] for g in range(n))
        work = self._work_percent(start_mark, end_mark, window)
        work_by_type, refused_by_type = self._by_type(work)
        times = tuple(r.offset_s for r in self.rows)
        shift, weight_shift_s = self._shifts(times)
        by_length = self.by_length
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
            ttft_p90_s=percentile(ttft, 90),
            mean_in_flight=self._mean_in_flight(),
            throughput_tokens_per_s=tokens / window,
            busy_percent=busy,
            busy_spread_pts=max(busy) - min(busy),
            work_percent=work,
            work_spread_pts=max(work) - min(work),
            work_p95_p5_pts=percentile(work, 95) - percentile(work, 5),
            work_by_type=work_by_type,
            refused_by_type=refused_by_type,
            weight_pushes=self.weight_pushes,
            arrival_times=times,
            arrival_gpus=tuple(self.arrival_gpu),
            shift=shift,
            weight_shift_s=weight_shift_s,
            events=self.events,
            sim_end_s=self.now,
            long_output_threshold=self.threshold,
            long_requests=0 if by_length is None else by_length.confined_picks,
            long_fallbacks=0 if by_length is None else by_length.fallbacks,
            tier_thresholds=(
                by_length.thresholds if by_length is not None and scenario.policy == "tiered" else None
            ),
            threshold_changes=self.threshold_changes,
            class_requests=() if by_length is None else tuple(by_length.class_picks),
            class_set_changes=self.class_set_changes,
            live_classes=self.live,
            prefix_cache_queries=sum(end_mark[g][3] - start_mark[g][3] for g in range(n)),
            prefix_cache_hits=sum(end_mark[g][4] - start_mark[g][4] for g in range(n)),
            preemptions=sum(e.stats().num_preemptions_total for e in self.engines),
            by_length=self._by_length(),
            predicted_requests=self.predicted,
        )

    def _by_length(self) -> tuple[LengthClassLatency, ...]:
        """The measured finished requests' latencies, split by true completion at
        :data:`simulation.fleetsim.results.LONG_SHARE_PERCENTILE` of the measured completions."""
        warmup, duration = self.scenario.warmup_s, self.scenario.duration_s
        measured = [i for i, r in enumerate(self.rows) if warmup <= r.offset_s < duration]
        if not measured:
            return ()
        split = int(percentile([float(self.rows[i].output_tokens) for i in measured], LONG_SHARE_PERCENTILE))
        out = []
        for name, is_long in (("short", False), ("long", True)):
            done = [
                i
                for i in measured
                if (self.rows[i].output_tokens > split) == is_long and not math.isnan(self.done_at[i])
            ]
            at = self.rows
            e2e = [self.done_at[i] - at[i].offset_s for i in done]
            ttft = [self.first_at[i] - at[i].offset_s for i in done if not math.isnan(self.first_at[i])]
            out.append(
                LengthClassLatency(
                    name=name,
                    split_tokens=split,
                    requests=len(done),
                    e2e_p50_s=percentile(e2e, 50),
                    e2e_p99_s=percentile(e2e, 99),
                    ttft_p50_s=percentile(ttft, 50),
                )
            )
        return tuple(out)

    def _mean_in_flight(self) -> tuple[float, ...]:
        """Per GPU, its time-averaged active requests over the window (each request counts from its
        arrival to its end, or the end of the run)."""
        warmup, duration = self.scenario.warmup_s, self.scenario.duration_s
        window = duration - warmup
        held = [0.0] * self.n
        for i, r in enumerate(self.rows):
            if self.refused[i]:
                continue
            end = self.done_at[i] if not math.isnan(self.done_at[i]) else self.now
            lo, hi = max(r.offset_s, warmup), min(end, duration)
            if hi > lo:
                held[self.arrival_gpu[i]] += hi - lo
        return tuple(h / window for h in held)

    def _latencies(self) -> tuple[list[float], list[float], int]:
        """End-to-end latencies and TTFTs of the measured requests that finished, and the measured count."""
        warmup, duration = self.scenario.warmup_s, self.scenario.duration_s
        e2e: list[float] = []
        ttft: list[float] = []
        measured = 0
        for i, r in enumerate(self.rows):
            if not warmup <= r.offset_s < duration:
                continue
            measured += 1
            if not math.isnan(self.done_at[i]):
                e2e.append(self.done_at[i] - r.offset_s)
                if not math.isnan(self.first_at[i]):
                    ttft.append(self.first_at[i] - r.offset_s)
        return e2e, ttft, measured

    def _work_percent(
        self,
        start_mark: list[tuple[float, int, int, int, int]],
        end_mark: list[tuple[float, int, int, int, int]],
        window: float,
    ) -> tuple[float, ...]:
        """Per GPU, the work done in the window as a percent of the window (see ``work_percent``)."""
        warmup, duration = self.scenario.warmup_s, self.scenario.duration_s
        # Work done in the window, from the engines' counters: the prompt tokens prefilled, and the tokens
        # decoded (generated tokens less the first ones, which come out of the prefill) at full-batch cost.
        # Prompt tokens found in a prefix cache were not prefilled: they are no work.
        first_tokens = [0] * self.n
        for i in range(len(self.rows)):
            if warmup < self.first_at[i] <= duration:
                first_tokens[self.arrival_gpu[i]] += 1
        work_s = []
        for g in range(self.n):
            model = self.engines[g].model
            b = model.max_batch
            decoded = max(0, end_mark[g][1] - start_mark[g][1] - first_tokens[g])
            prefilled = max(0, end_mark[g][2] - start_mark[g][2] - (end_mark[g][4] - start_mark[g][4]))
            work_s.append(model.prefill_seconds(prefilled) + decoded * model.decode_step_seconds(b) / b)
        return tuple(100.0 * w / window for w in work_s)

    def _by_type(self, work: tuple[float, ...]) -> tuple[dict[str, float], dict[str, int]]:
        """Mean ``work`` and refused arrivals per GPU type."""
        by_type: dict[str, list[float]] = {}
        refused_by_type: dict[str, int] = {}
        for fg in self.gpus:
            by_type.setdefault(fg.gpu_type, []).append(work[fg.index])
            refused_by_type.setdefault(fg.gpu_type, 0)
        for i in range(len(self.rows)):
            if self.refused[i]:
                refused_by_type[self.gpus[self.arrival_gpu[i]].gpu_type] += 1
        return {t: sum(v) / len(v) for t, v in by_type.items()}, refused_by_type

    def _shifts(self, times: tuple[float, ...]) -> tuple[TrafficShift | None, float | None]:
        """After a throttle: the traffic shift, and when the applied weights' share fell (None: never)."""
        scenario = self.scenario
        if scenario.throttle_at_s is None or not self.targets:
            return None, None
        shift = traffic_shift(
            times, self.arrival_gpu, self.targets, fault_at=scenario.throttle_at_s, end=scenario.duration_s
        )
        weight_shift_s = None
        before = [s for at, s in self.weight_share if at <= scenario.throttle_at_s]
        if before:
            for at, s in self.weight_share:
                if at > scenario.throttle_at_s and s < shift.threshold * before[-1]:
                    weight_shift_s = at - scenario.throttle_at_s
                    break
        return shift, weight_shift_s
