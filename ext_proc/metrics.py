"""Prometheus metrics of the ext_proc service (prometheus_client), in their own registry.

Names follow Prometheus conventions (``_total`` counters, base units: seconds, tokens). Label values come
from the config (tenant and model names), the HTTP status, or a fixed vocabulary, so cardinality is
bounded by the config. A request refused before its tenant or model is known is labelled ``""``.

- ``inferlb_requests_total{tenant, model, status}``: requests ended, by HTTP status (``aborted`` when the
  response never completed);
- ``inferlb_prompt_tokens_total{tenant, model}``, ``inferlb_completion_tokens_total{tenant, model}``:
  tokens charged to the quotas;
- ``inferlb_usage_settled_total{source}``: settlements by where the usage came from (``reported``,
  ``counted``, ``reserved``, ``none``; see :class:`inferlb.request.usage.UsageSource`);
- ``inferlb_quota_rejections_total{tenant, limit}``: quota refusals (429; 503 with ``limit``
  ``quota_backend_unavailable`` when failing closed, ``quota_backend_busy`` when no Redis connection freed
  within the request's budget);
- ``inferlb_quota_backend_errors_total{backend, operation}``: calls to the shared quota state that failed
  (``operation`` ``admit``, ``settle``, or ``start``: the warm-up at start-up); a wait for a free connection
  is not one;
- ``inferlb_low_priority_shed_total{tenant, model}``: ``priority: low`` requests refused (503
  ``overloaded``) because their cluster's DEFAULT-priority requests in flight reached the low-priority
  limit (:mod:`inferlb.policy.shedding`);
- ``inferlb_endpoint_picks_total{model, outcome}``: endpoint picking's requests by outcome (``picked``;
  ``no_state``: no endpoint state yet, Envoy's fallback balanced it; ``no_eligible``: 503, no endpoint
  healthy; ``queued``: waited in the model's fair queue, ``endpoint_picking.queue``; ``queue_full``: 429);
- ``inferlb_length_class_decisions_total{model, length_class, source}``: length classes decided, by what
  decided them (``cap``, ``prediction``); ``inferlb_length_class_spills_total{model, from_class,
  to_class}``: the capacity guard's spills;
- ``inferlb_length_class_threshold_tokens{model, cluster, length_class}``: the output-cap threshold a
  class uses now (learnt with ``length_aware.learn_thresholds``, else configured);
  ``inferlb_length_class_confined_work_share{...}``: the recent requests' work share above it (the work
  confined to its GPU set), ``inferlb_length_class_set_share{...}``: that set's capacity share, and
  ``inferlb_length_class_overcommitted_total{...}``: checks that found the first above the second
  (:mod:`ext_proc.length_state`);
- ``inferlb_endpoint_queue_wait_seconds{model, outcome}``: time waited in a model's fair queue, by how the
  wait ended (``admitted``, ``expired``: 429 ``queue_timeout``, ``cancelled``: the client went away,
  ``no_state``);
- ``inferlb_endpoint_state_polls_total{outcome}``: reads of the xDS server's ``GET /v1/picking`` (``ok``,
  ``failed``), and ``inferlb_endpoint_state_age_seconds``: the age of the state served (-1 before any);
- ``inferlb_ext_proc_processing_seconds{phase}``: time to answer one ext_proc message.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Histogram buckets of a wait in a model's fair queue (s): 1 ms to the longest ``max_wait_ms`` (30 s).
QUEUE_WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
#: Histogram buckets for one ext_proc message (s): 50 us to 1 s, finer where the hot path lives
#: (the goal is <= 0.4 ms added at p50).
PROCESSING_BUCKETS: Final = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class ExtProcMetrics:
    """The ext_proc metric families, registered in ``registry`` (a fresh one by default, so several
    instances in one test process do not collide)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inferlb_requests", "Requests ended, by HTTP status", ("tenant", "model", "status"), registry=r
        )
        self.prompt_tokens = Counter(
            "inferlb_prompt_tokens", "Prompt tokens charged", ("tenant", "model"), registry=r
        )
        self.completion_tokens = Counter(
            "inferlb_completion_tokens", "Completion tokens charged", ("tenant", "model"), registry=r
        )
        self.usage_settled = Counter(
            "inferlb_usage_settled", "Quota settlements by the source of the usage", ("source",), registry=r
        )
        self.meter_settlements = Counter(
            "inferlb_meter_settlements",
            "ext_authz mode: reservations settled from Envoy's access log, by outcome (metered: the "
            "reported usage; unmetered: the entry had no usage, charged the reservation; produced: a "
            "stream cut before its usage, charged the prompt and its streamed text bytes; not_served: "
            "non-2xx without usage, charged nothing; expired: no entry within the lease TTL, charged the "
            "reservation)",
            ("outcome",),
            registry=r,
        )
        self.meter_entries_ignored = Counter(
            "inferlb_meter_entries_ignored",
            "ext_authz mode: access-log entries that settled nothing (duplicate, late: after the TTL settled "
            "the reservation, unknown: never reserved by this process)",
            ("reason",),
            registry=r,
        )
        self.quota_rejections = Counter(
            "inferlb_quota_rejections", "Requests refused by a quota", ("tenant", "limit"), registry=r
        )
        self.quota_backend_errors = Counter(
            "inferlb_quota_backend_errors",
            "Calls to the shared quota state that failed (unreachable, timeout)",
            ("backend", "operation"),
            registry=r,
        )
        self.low_priority_shed = Counter(
            "inferlb_low_priority_shed",
            "Low-priority requests refused because their cluster was busy",
            ("tenant", "model"),
            registry=r,
        )
        self.endpoint_picks = Counter(
            "inferlb_endpoint_picks",
            "Requests of endpoint picking's models, by outcome",
            ("model", "outcome"),
            registry=r,
        )
        self.length_class_decisions = Counter(
            "inferlb_length_class_decisions",
            "Requests of length-aware models by the length class decided and what decided it: the output "
            "cap or the output-length prediction (before the capacity guard)",
            ("model", "length_class", "source"),
            registry=r,
        )
        self.length_class_spills = Counter(
            "inferlb_length_class_spills",
            "Requests of length-aware models the capacity guard sent to a wider length class than their own",
            ("model", "from_class", "to_class"),
            registry=r,
        )
        self.length_class_threshold = Gauge(
            "inferlb_length_class_threshold_tokens",
            "Output-cap threshold a length class of a cluster uses now (tokens): the learnt one with "
            "length_aware.learn_thresholds once enough requests were seen, else the configured one",
            ("model", "cluster", "length_class"),
            registry=r,
        )
        self.length_class_confined_share = Gauge(
            "inferlb_length_class_confined_work_share",
            "Share of the recent requests' work (estimated from prompt tokens and output caps) whose cap "
            "is above the length class's threshold: the work confined to its GPU set (longer classes "
            "included)",
            ("model", "cluster", "length_class"),
            registry=r,
        )
        self.length_class_set_share = Gauge(
            "inferlb_length_class_set_share",
            "Capacity share of a length class's GPU set in its cluster (configured endpoints)",
            ("model", "cluster", "length_class"),
            registry=r,
        )
        self.length_class_overcommitted = Counter(
            "inferlb_length_class_overcommitted",
            "Checks (one per re-derivation interval) that found a length class's confined work share "
            "above its GPU set's capacity share: at full load that set saturates",
            ("model", "cluster", "length_class"),
            registry=r,
        )
        self.endpoint_queue_waits = Histogram(
            "inferlb_endpoint_queue_wait_seconds",
            "Time waited in a model's fair queue for an endpoint with room, by outcome",
            ("model", "outcome"),
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.endpoint_state_polls = Counter(
            "inferlb_endpoint_state_polls",
            "Reads of the xDS server's endpoint state (GET /v1/picking)",
            ("outcome",),
            registry=r,
        )
        self.endpoint_state_age = Gauge(
            "inferlb_endpoint_state_age_seconds",
            "Age of the endpoint state the picker serves from (-1 before any)",
            registry=r,
        )
        self.endpoint_state_age.set(-1)
        self.processing_seconds = Histogram(
            "inferlb_ext_proc_processing_seconds",
            "Time to answer one ext_proc message",
            ("phase",),
            buckets=PROCESSING_BUCKETS,
            registry=r,
        )

        # label children by label values: prometheus_client's labels() validates and locks on every call
        # (~2-5 us); a child is the same object for the same values, so caching it changes nothing else.
        # Cardinality is bounded by the config (tenant and model names) and HTTP statuses.
        self._requests: dict[tuple[str, str, str], Counter] = {}
        self._tokens: dict[tuple[str, str], tuple[Counter, Counter]] = {}
        self._phases: dict[str, Histogram] = {}

    def request_ended(self, tenant: str, model: str, status: str) -> None:
        """Count one request ended with ``status`` (``inferlb_requests_total``)."""
        child = self._requests.get((tenant, model, status))
        if child is None:
            child = self._requests[(tenant, model, status)] = self.requests.labels(tenant, model, status)
        child.inc()

    def tokens_charged(self, tenant: str, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Add one request's charged tokens to ``inferlb_prompt_tokens_total`` and
        ``inferlb_completion_tokens_total`` (tokens)."""
        pair = self._tokens.get((tenant, model))
        if pair is None:
            pair = self._tokens[(tenant, model)] = (
                self.prompt_tokens.labels(tenant, model),
                self.completion_tokens.labels(tenant, model),
            )
        pair[0].inc(prompt_tokens)
        pair[1].inc(completion_tokens)

    def processed(self, phase: str, seconds: float) -> None:
        """Observe the time to answer one ext_proc message of ``phase`` (seconds)."""
        child = self._phases.get(phase)
        if child is None:
            child = self._phases[phase] = self.processing_seconds.labels(phase)
        child.observe(seconds)

    def quota_backend_error(self, backend: str, operation: str) -> None:
        """Count one failed call to the quota backend (the callback :mod:`inferlb.adapters.quota_redis`
        takes)."""
        self.quota_backend_errors.labels(backend, operation).inc()
