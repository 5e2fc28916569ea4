"""inferlb's Envoy external authorization service in HTTP-service mode (``ext_proc.protocol: ext_authz``):
the same decisions as ext_proc (:mod:`ext_proc.handlers`: key, quota, model, prompt tokens, routing
headers), asked once per request by Envoy's ``envoy.filters.http.ext_authz`` filter with the buffered body,
answered over HTTP/1.1 on asyncio (uvloop when installed).

- :mod:`ext_authz.check`: one check -> the handlers -> the HTTP answer (no sockets).
- :mod:`ext_authz.server`: the asyncio protocol over httptools (keep-alive, pipelining, bounds, shutdown).
- :mod:`ext_authz.meter`: the settler (``account_responses``): reservations awaiting Envoy's access-log
  entry, settled once (:mod:`inferlb.policy.settlement`); with ``extra_listen`` each process settles its
  own, Envoy sending each entry to its owner.
- ``__main__``: the process (``python -m ext_authz --config PATH``), with the settler's gRPC access-log
  receiver (:mod:`ext_proc.access_log`) on ``ext_proc.meter_listen`` (an ``extra_listen`` process: on its
  ``extra_meter_listen`` address).

May import: the core (:mod:`inferlb.errors`, :mod:`inferlb.config`, :mod:`inferlb.request`,
:mod:`inferlb.policy`), :mod:`inferlb.adapters`, ext_proc's transport-free modules (:mod:`ext_proc.handlers`,
:mod:`ext_proc.state`, :mod:`ext_proc.process`, :mod:`ext_proc.poller`, :mod:`ext_proc.stores`,
:mod:`ext_proc.metrics`, :mod:`ext_proc.access_log`), httptools, prometheus_client; never grpc (but
``__main__``, to start the receiver) or the Envoy protos, never :mod:`ext_proc.servicer`, ``xds_server``,
``simulation`` or :mod:`inferlb.ops`.
"""
