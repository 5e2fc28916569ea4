"""The length class of each request of a length-aware model, live: output prediction and the capacity guard
over one request-path process's own counts (both protocols: :mod:`ext_proc.servicer` and
:mod:`ext_authz.check` call it alike).

- :meth:`LengthState.decide` (before endpoint picking): the class by the cap, or, with
  ``length_aware.predict_output`` and an uninformative cap, by the predicted output
  (:mod:`inferlb.policy.output_predictor`); then, with ``length_aware.capacity_guard_factor`` on a model
  balanced by Envoy's subsets, the guard over this process's in-flight requests per class
  (:func:`inferlb.policy.class_guard.nested_class_loads`; a model that picks endpoints is guarded in its
  class-host selection instead, :func:`ext_proc.picking.class_hosts`, from the picker's own endpoint
  counts). The class travels in :attr:`ext_proc.handlers.PreparedRequest.length_class` to the
  ``x-inferlb-length-class`` header and the picker.
- Thresholds (in :meth:`LengthState.decide`): every generating request of a length-aware model is observed,
  its cap as classed (the cap, or the predicted output) and its work (:func:`~inferlb.policy.
  threshold_learner.request_work` of its prompt tokens and that cap), in one
  :class:`~inferlb.policy.threshold_learner.ThresholdLearner` per cluster, whose set shares are the static
  sets' capacity over the cluster's (:func:`class_capacities`). With ``length_aware.learn_thresholds`` the
  classes use its thresholds once it has seen ``min_samples`` requests (the configured ones before).
  Every re-derivation interval the cluster's thresholds in use, their confined work share and the sets'
  shares are set on the metrics, and a class whose confined share exceeds its set's share is counted and
  logged (a warning at most every :data:`OVERCOMMIT_LOG_INTERVAL_S` per cluster): a static threshold the
  clients' caps have outgrown. A cluster with no configured endpoint has no shares: static thresholds,
  unchecked.
- :meth:`LengthState.hold` (admitted): the request enters its class's in-flight count.
- :meth:`LengthState.release` (settled, exactly once): it leaves the count and, with the metered
  ``completion_tokens`` (a reported usage: ext_proc's response meter, or ext_authz's access-log entry), the
  predictor learns its answer.

What each process knows is its own: with several request-path processes (``ext_proc.extra_listen``) or
replicas each keeps its own predictor, learnt from the answers it settles, its own threshold learners, learnt
from the requests it classes, and its own class counts, so each guards its share of the traffic (Envoy
spreads requests over the processes evenly, so each sees the same mix and learns alike thresholds; a
restarted process starts from the configured thresholds).

The Envoy-subset guard's capacities are the config's: each class's set is the cluster's configured endpoints
whose GPU profile may serve the class (:func:`inferlb.policy.length_aware.allowed_classes`, the static
sets); endpoints found only by discovery are not counted, and a cluster with none configured is not guarded.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import msgspec
from prometheus_client import Counter, Gauge

from ext_proc.handlers import PreparedRequest
from ext_proc.metrics import ExtProcMetrics
from inferlb.config.schema import Config, LearnedThresholds, LengthAwareRouting, ModelConfig
from inferlb.policy.affinity import conversation_opening
from inferlb.policy.class_guard import ClassHold, guarded_class, nested_class_loads
from inferlb.policy.length_aware import (
    SHORT,
    class_by_thresholds,
    confined_classes,
    length_class,
    static_thresholds,
)
from inferlb.policy.output_predictor import LengthQuery, OutputPredictor, PredictionKey
from inferlb.policy.threshold_learner import MAX_CAP_TOKENS, ThresholdLearner, request_work

log = logging.getLogger(__name__)

#: Least seconds between two warnings of one cluster's overcommitted length class.
OVERCOMMIT_LOG_INTERVAL_S: Final = 300.0
#: The window, interval and work price of the check of static thresholds (a model without
#: ``learn_thresholds``): the learner's defaults.
STATIC_CHECK: Final = LearnedThresholds()


def class_capacities(config: Config, model: ModelConfig, version: str) -> tuple[tuple[float, ...], float]:
    """Each confined class's set capacity (longest first) and the cluster's, from ``version``'s configured
    endpoints and their GPU profiles' ``relative_capacity`` (V100 = 1.0): the static sets of
    :func:`inferlb.policy.length_aware.allowed_classes`. A model that is not length-aware: ``((), 0.0)``."""
    policy = model.cluster.length_aware
    if policy is None:
        return (), 0.0
    caps = [
        config.gpu_profiles[e.gpu].relative_capacity
        for e in config.endpoints
        if e.model == model.name and config.endpoint_version(e) == version and e.gpu in config.gpu_profiles
    ]
    classes = confined_classes(policy)
    return tuple(sum(c for c in caps if c >= k.min_relative_capacity) for k in classes), sum(caps)


@dataclass(slots=True, kw_only=True)
class ClusterThresholds:
    """One cluster's threshold learner and what its reviews set (:class:`LengthState`'s, per cluster).

    Attributes:
        config: the config it was built under (rebuilt when a new one changes its policy or shares).
        model / cluster: whose (metric labels).
        policy: the model's ``length_aware``.
        names: the confined classes, longest first.
        static: their configured thresholds (tokens).
        shares: their sets' capacity share of the cluster (0..1).
        learner: the window of requests seen.
        learn: whether the classes use the learnt thresholds (``learn_thresholds``) or only check the static.
        prompt_token_work: the price of a prompt token in generated tokens (:func:`request_work`).
        min_samples: requests seen before the learnt thresholds are used or the static ones checked.
        review_every_s: seconds between two reviews (metrics, the check).
        next_review_s: when the next review is due (the state's clock, s).
        warned_at: when the last overcommit warning was logged.
        gauges: ``(threshold, confined share)`` gauge children per class.
        overcommitted: the overcommit counter's children per class.
    """

    config: Config
    model: str
    cluster: str
    policy: LengthAwareRouting
    names: tuple[str, ...]
    static: tuple[int, ...]
    shares: tuple[float, ...]
    learner: ThresholdLearner
    learn: bool
    prompt_token_work: float
    min_samples: int
    review_every_s: float
    next_review_s: float = -math.inf
    warned_at: float = -math.inf
    gauges: tuple[tuple[Gauge, Gauge], ...] = ()
    overcommitted: tuple[Counter, ...] = ()


class LengthState:
    """One process's output predictor and in-flight counts per ``(cluster, length class)`` (module
    docstring; not thread-safe: the event loop owns it, kept across reloads).

    Args:
        metrics: where decisions, spills and thresholds are counted.
        predictor: the predictor (a fresh :class:`~inferlb.policy.output_predictor.OutputPredictor`
            by default).
        clock: monotonic seconds, for the threshold learners (injected for tests).
    """

    def __init__(
        self,
        metrics: ExtProcMetrics,
        predictor: OutputPredictor | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.predictor = predictor if predictor is not None else OutputPredictor()
        self.clock = clock
        #: (model, version) -> its cluster's thresholds, kept across reloads that leave its policy and
        #: shares alike
        self._thresholds: dict[tuple[str, str], ClusterThresholds] = {}
        #: (model, version) -> the config under which its cluster has no configured capacity (static
        #: thresholds, unchecked)
        self._no_capacity: dict[tuple[str, str], Config] = {}
        self._in_flight: dict[tuple[str, str], int] = {}
        self._decided: dict[tuple[str, str, str], Counter] = {}
        #: (model, version) -> class_capacities() of the config ``_config`` (held, so its identity is not
        #: reused by a later config)
        self._capacities: dict[tuple[str, str], tuple[tuple[float, ...], float]] = {}
        self._config: Config | None = None

    def in_flight(self) -> Mapping[tuple[str, str], int]:
        """``{(cluster, class): requests held}`` of the pairs with any."""
        return dict(self._in_flight)

    def query(self, prepared: PreparedRequest) -> LengthQuery:
        """What the predictor is asked about ``prepared``: its key (tenant, model, endpoint kind), prompt
        tokens, conversation (the session header, else ``user``, else a hash of a chat's opening)
        and per-choice cap."""
        request = prepared.request
        conversation = prepared.pending.session or request.user
        if conversation is None and request.messages:
            # the conversation's opening names it (later turns repeat it); Python's hash suffices (and costs
            # a tenth of a digest): the predictor lives and dies with this process
            opening = conversation_opening(request.messages)
            conversation = f"opening:{hash(opening):x}" if opening else None
        return LengthQuery(
            key=PredictionKey(
                tenant=prepared.pending.tenant.name, model=prepared.model.name, kind=request.kind.value
            ),
            prompt_tokens=prepared.prompt_tokens,
            conversation=conversation,
            cap=request.largest_output_tokens,
            default_cap=prepared.model.default_max_tokens,
            width=request.n * request.prompt_count,
        )

    def decide(self, config: Config, prepared: PreparedRequest, version: str) -> PreparedRequest:
        """``prepared`` with its length class decided (module docstring); unchanged for a model that is not
        length-aware or a request that generates nothing (embeddings)."""
        model = prepared.model
        policy = model.cluster.length_aware
        if policy is None or not prepared.request.kind.generates_tokens:
            return prepared
        query = None
        tokens = prepared.request.output_token_cap(model.default_max_tokens)
        source = "cap"
        if policy.predict_output:
            query = self.query(prepared)
            estimate = self.predictor.estimate(query)
            tokens = estimate.output_tokens
            source = "prediction" if estimate.predicted else "cap"
        cluster = self._thresholds.get((model.name, version))
        if cluster is None or cluster.config is not config:
            cluster = self._cluster_thresholds(config, model, version)
        if cluster is None:
            name = length_class(tokens, policy)
        else:
            tokens = min(tokens, MAX_CAP_TOKENS)  # as the learner counts it
            now = self.clock()
            learner = cluster.learner
            learnt = learner.thresholds(now) if cluster.learn else None
            name = class_by_thresholds(tokens, cluster.static if learnt is None else learnt, cluster.names)
            learner.observe(
                tokens,
                request_work(prepared.prompt_tokens, tokens, cluster.prompt_token_work),
                now,
            )
            if now >= cluster.next_review_s:
                self._review(cluster, now)
        decided = self._decided.get((model.name, name, source))
        if decided is None:  # labels() validates and locks on every call: keep the children
            decided = self._decided[model.name, name, source] = self.metrics.length_class_decisions.labels(
                model.name, name, source
            )
        decided.inc()
        factor = policy.capacity_guard_factor
        if factor is not None and name != SHORT and not model.endpoint_picking.enabled:
            guarded = self._guard(config, model, version, name, factor)
            if guarded != name:
                self.metrics.length_class_spills.labels(model.name, name, guarded).inc()
                name = guarded
        return msgspec.structs.replace(prepared, length_class=name, length_query=query)

    def thresholds_of(self, model: str, version: str) -> ClusterThresholds | None:
        """The threshold state of ``model``'s ``version`` cluster (None before its first request, or without
        configured capacity)."""
        return self._thresholds.get((model, version))

    def _capacities_of(
        self, config: Config, model: ModelConfig, version: str
    ) -> tuple[tuple[float, ...], float]:
        """:func:`class_capacities`, cached per config."""
        if config is not self._config:
            self._capacities.clear()
            self._config = config
        cache_key = (model.name, version)
        capacities = self._capacities.get(cache_key)
        if capacities is None:
            capacities = self._capacities[cache_key] = class_capacities(config, model, version)
        return capacities

    def _cluster_thresholds(
        self, config: Config, model: ModelConfig, version: str
    ) -> ClusterThresholds | None:
        key = (model.name, version)
        entry = self._thresholds.get(key)
        if entry is not None and entry.config is config:
            return entry
        if self._no_capacity.get(key) is config:
            return None
        cluster = model.cluster_name(version)
        policy = model.cluster.length_aware
        assert policy is not None
        sets, fleet = self._capacities_of(config, model, version)
        if not fleet > 0:
            self._thresholds.pop(key, None)
            self._no_capacity[key] = config
            return None
        shares = tuple(min(1.0, s / fleet) for s in sets)
        if entry is not None and entry.policy == policy and entry.shares == shares:
            entry.config = config  # a reload that leaves this cluster alike keeps what it learnt
            return entry
        learn = policy.learn_thresholds
        params = learn if learn is not None else STATIC_CHECK
        min_samples = params.samples_before_use
        names = tuple(c.name for c in confined_classes(policy))
        m = self.metrics
        labels = [(model.name, cluster, n) for n in names]
        for share, lv in zip(shares, labels, strict=True):
            m.length_class_set_share.labels(*lv).set(share)
        entry = self._thresholds[key] = ClusterThresholds(
            config=config,
            model=model.name,
            cluster=cluster,
            policy=policy,
            names=names,
            static=static_thresholds(policy),
            shares=shares,
            learner=ThresholdLearner(
                shares,
                fraction=params.fraction,
                window=params.window,
                min_samples=min_samples,
                rederive_every_s=params.rederive_every_s,
                hysteresis=params.hysteresis,
            ),
            learn=learn is not None,
            prompt_token_work=params.prompt_token_work,
            min_samples=min_samples,
            review_every_s=params.rederive_every_s,
            gauges=tuple(
                (m.length_class_threshold.labels(*lv), m.length_class_confined_share.labels(*lv))
                for lv in labels
            ),
            overcommitted=tuple(m.length_class_overcommitted.labels(*lv) for lv in labels),
        )
        return entry

    def _review(self, entry: ClusterThresholds, now: float) -> None:
        """Set the cluster's threshold metrics and check its confined work shares against its sets'."""
        entry.next_review_s = now + entry.review_every_s
        learner = entry.learner
        learnt = learner.thresholds(now) if entry.learn else None
        in_use = entry.static if learnt is None else learnt
        for (threshold, _), t in zip(entry.gauges, in_use, strict=True):
            threshold.set(t)
        if learner.samples < entry.min_samples:
            return
        confined = learner.confined_shares(in_use)
        if confined is None:
            return
        over = []
        for name, t, got, share, (_, gauge), counter in zip(
            entry.names, in_use, confined, entry.shares, entry.gauges, entry.overcommitted, strict=True
        ):
            gauge.set(got)
            if got > share:
                counter.inc()
                over.append(f"{name} (caps above {t} tokens: {got:.0%} of the work, its GPUs {share:.0%})")
        if over and now - entry.warned_at >= OVERCOMMIT_LOG_INTERVAL_S:
            entry.warned_at = now
            advice = "" if entry.learn else "; length_aware.learn_thresholds derives them from the caps seen"
            log.warning(
                "model %s cluster %s: length classes carry more work than their GPU sets' capacity share, "
                "over the last %d requests: %s. At full load those sets saturate%s",
                entry.model,
                entry.cluster,
                learner.samples,
                ", ".join(over),
                advice,
            )

    def _guard(self, config: Config, model: ModelConfig, version: str, name: str, factor: float) -> str:
        assert model.cluster.length_aware is not None
        classes = [c.name for c in confined_classes(model.cluster.length_aware)]
        set_capacity, fleet_capacity = self._capacities_of(config, model, version)
        if fleet_capacity <= 0:
            return name
        cluster = model.cluster_name(version)
        counts = [self._in_flight.get((cluster, c), 0) for c in classes]
        sets, fleet = nested_class_loads(
            counts, self._in_flight.get((cluster, SHORT), 0), set_capacity, fleet_capacity
        )
        k = guarded_class(sets, fleet, classes.index(name), factor)
        return classes[k] if k < len(classes) else SHORT

    def hold(self, prepared: PreparedRequest, cluster: str) -> ClassHold | None:
        """Enter an admitted request in its class's in-flight count; the hold its settlement releases
        (None for a request :meth:`decide` left unclassed)."""
        name = prepared.length_class
        if name is None:
            return None
        key = (cluster, name)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return ClassHold(cluster=cluster, length_class=name, query=prepared.length_query)

    def release(self, hold: ClassHold, completion_tokens: int | None) -> None:
        """The request of ``hold`` ended: it leaves its count, and with ``completion_tokens`` (its
        reported usage, all choices) the predictor learns them. Call once per hold."""
        key = (hold.cluster, hold.length_class)
        n = self._in_flight.get(key, 0) - 1
        if n > 0:
            self._in_flight[key] = n
        else:
            self._in_flight.pop(key, None)
        if completion_tokens is not None and hold.query is not None:
            self.predictor.observe(hold.query, completion_tokens)
