"""inferlb as a Gateway API Inference Extension endpoint picker (EPP): an Envoy external processor
(``envoy.service.ext_proc.v3``, ``FULL_DUPLEX_STREAMED`` request bodies) that a gateway inferlb did not
configure calls per request; it picks endpoints of one pool with :func:`inferlb.policy.picker.pick` and
answers as the EPP protocol (proposal 004) says: header ``x-gateway-destination-endpoint`` and the same
value in dynamic metadata ``envoy.lb``, 503 when nothing is eligible, 429 when shedding.

- :mod:`epp.pool`: the pool's endpoints and live state (``/metrics`` scrape, in-flight counts, saturation).
- :mod:`epp.picking`: the decision for one request (parse, subset hint, 503/429, pick), transport-free.
- :mod:`epp.flow`: the fair queue a request waits in when every eligible endpoint is saturated.
- :mod:`epp.exchange`: one ext_proc stream as a state machine over Envoy's protos (no gRPC).
- :mod:`epp.server`: the grpcio aio servicer and the gRPC health services.
- :mod:`epp.metrics`: the service's Prometheus registry.
- ``__main__``: the process (``python -m epp --endpoint IP:PORT ...`` or ``--config PATH --model NAME``).

May import: the core (:mod:`inferlb.errors`, :mod:`inferlb.config`, :mod:`inferlb.request`,
:mod:`inferlb.policy`), grpcio and grpcio-health-checking, the Envoy protos, prometheus_client, aiohttp;
never ``xds_server``, ``ext_proc``, ``ext_authz``, ``simulation`` or :mod:`inferlb.ops`.
"""
