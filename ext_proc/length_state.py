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
- :meth:`LengthState.hold` (admitted): the request enters its class's in-flight count.
- :meth:`LengthState.release` (settled, exactly once): it leaves the count and, with the metered
  ``completion_tokens`` (a reported usage: ext_proc's response meter, or ext_authz's access-log entry), the
  predictor learns its answer.

What each process knows is its own: with several request-path processes (``ext_proc.extra_listen``) each
keeps its own predictor, learnt from the answers it settles, and its own class counts, so each guards its
share of the traffic (Envoy spreads requests over the processes evenly, so each sees the same mix).

The Envoy-subset guard's capacities are the config's: each class's set is the cluster's configured endpoints
whose GPU profile may serve the class (:func:`inferlb.policy.length_aware.allowed_classes`, the static
sets); endpoints found only by discovery are not counted, and a cluster with none configured is not guarded.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from prometheus_client import Counter

from ext_proc.handlers import PreparedRequest
from ext_proc.metrics import ExtProcMetrics
from inferlb.config.schema import Config, ModelConfig
from inferlb.policy.affinity import conversation_opening
from inferlb.policy.class_guard import ClassHold, guarded_class, nested_class_loads
from inferlb.policy.length_aware import SHORT, confined_classes, length_class
from inferlb.policy.output_predictor import LengthQuery, OutputPredictor, PredictionKey


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


class LengthState:
    """One process's output predictor and in-flight counts per ``(cluster, length class)`` (module
    docstring; not thread-safe: the event loop owns it, kept across reloads).

    Args:
        metrics: where decisions and spills are counted.
        predictor: the predictor (a fresh :class:`~inferlb.policy.output_predictor.OutputPredictor`
            by default).
    """

    def __init__(self, metrics: ExtProcMetrics, predictor: OutputPredictor | None = None) -> None:
        self.metrics = metrics
        self.predictor = predictor if predictor is not None else OutputPredictor()
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
        name = length_class(tokens, policy)
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

    def _guard(self, config: Config, model: ModelConfig, version: str, name: str, factor: float) -> str:
        assert model.cluster.length_aware is not None
        classes = [c.name for c in confined_classes(model.cluster.length_aware)]
        if config is not self._config:
            self._capacities.clear()
            self._config = config
        cache_key = (model.name, version)
        capacities = self._capacities.get(cache_key)
        if capacities is None:
            capacities = self._capacities[cache_key] = class_capacities(config, model, version)
        set_capacity, fleet_capacity = capacities
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
