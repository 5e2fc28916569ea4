"""The policies (core): pure decisions over the config, telemetry and request values.

- :mod:`inferlb.policy.capacity`: an endpoint's static Envoy weight from its GPU profile.
- :mod:`inferlb.policy.telemetry`: GPU (NVML/DCGM) and model-server metric values and their parsers.
- :mod:`inferlb.policy.weights`: the telemetry weight policy (EWMA, hysteresis, slow start, stale fallback).
- :mod:`inferlb.policy.length_aware`: length classes and their GPU tiers, static and live.
- :mod:`inferlb.policy.output_predictor`: the online output-length predictor that classes requests whose
  cap is uninformative (decayed quantile sketches per tenant, model and endpoint kind; conversations).
- :mod:`inferlb.policy.threshold_learner`: length-class thresholds learnt online from the output caps the
  gateway sees (the tiered threshold rule over a bounded window of recent requests, with hysteresis).
- :mod:`inferlb.policy.class_guard`: the live capacity guard of length classes (a class whose GPU set is
  loaded past a factor over the fleet spills to the next wider set).
- :mod:`inferlb.policy.affinity`: prefix and session affinity keys.
- :mod:`inferlb.policy.routing`: the routing table (model, alias, version by canary split).
- :mod:`inferlb.policy.shedding`: ``priority: low`` shed before ``default`` (the per-cluster in-flight
  count and its limit, a share of the DEFAULT circuit breaker).
- :mod:`inferlb.policy.quota`: the quota book (sliding windows, concurrency, daily budgets) and its
  in-process store; the Redis store is an adapter (:mod:`inferlb.adapters.quota_redis`).
- :mod:`inferlb.policy.settlement`: the exactly-once rule that settles reservations from access-log entries
  (ext_authz mode's metering).
- :mod:`inferlb.policy.picker`: the endpoint picker's scoring (prefix match, request and token load, KV
  usage, the load guard, length-class eligibility).
- :mod:`inferlb.policy.columnar`: the same scoring over numpy columns kept in place, for large clusters
  (identical picks, a fraction of the cost at 1,000 endpoints).
- :mod:`inferlb.policy.prefix_index`: the approximate prefix index, learnt from the picker's own picks.
- :mod:`inferlb.policy.fair_queue`: per-model waiting under saturation (strict bands, start-time fair
  queueing by tokens within one, bounded waits).
- :mod:`inferlb.policy.fair_wait`: waiting in that queue on an event loop (futures, expiry timers, a client
  gone), shared by the EPP's flow control and the request path's endpoint picking.
- :mod:`inferlb.policy.endpoint_book`: a request-path process's view of the picking models' endpoints
  (the xDS server's state, its own in-flight counts per endpoint) as the picker's inputs.
- :mod:`inferlb.policy.kv_index`: the precise prefix index, rebuilt from the model servers' KV events.
- :mod:`inferlb.policy.prefix_indexes`: the prefix index of one picking mode, built alike for the request
  path and the EPP.

May import: :mod:`inferlb.errors`, :mod:`inferlb.config`, :mod:`inferlb.request`, prometheus_client's text
parser, numpy (the columnar picker); no server, client, Redis, NVML or simulator.
"""
