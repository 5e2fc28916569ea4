"""inferlb's Envoy external processor (envoy.service.ext_proc.v3): reads each OpenAI request, checks key,
quota and model, counts prompt tokens and sets the ``x-inferlb-*`` routing headers. Its transport-free
modules (all but ``servicer`` and ``__main__``) are also the core of :mod:`ext_authz`, the same decisions
behind Envoy's ext_authz filter.

- :mod:`ext_proc.handlers`: the per-phase decisions, plain values in and out (no gRPC).
- :mod:`ext_proc.servicer`: the grpcio aio adapter (ProcessingRequest stream -> handlers -> responses).
- :mod:`ext_proc.access_log`: Envoy's gRPC access-log service -> meter entries (the ext_authz settler's
  receiver).
- :mod:`ext_proc.grpc_tls`: mutual TLS server credentials (``ext_proc.tls``) that reload changed
  certificate files, for ext_proc's gRPC server and the settler's.
- :mod:`ext_proc.stores`: the quota store (in-process or Redis) and the ``/metrics`` server from the config.
- :mod:`ext_proc.metrics`: the service's Prometheus registry.
- :mod:`ext_proc.poller`: the config-file poller.
- :mod:`ext_proc.state`: the mutable state a process serves from (config, quota store, metrics).
- :mod:`ext_proc.picking`: endpoint picking on the request path (the pick, the live endpoint state polled
  from the xDS server, in-flight counts per endpoint).
- :mod:`ext_proc.length_state`: each request's length class, live (output prediction, thresholds learnt
  from the caps seen or the static ones checked against them, the capacity guard over per-class in-flight
  counts, the predictor fed at settlement).
- :mod:`ext_proc.process`: the command line, event loop and config watch loop ``__main__`` shares with
  ``python -m ext_authz``.
- ``__main__``: the process (``python -m ext_proc --config PATH``).

May import: the core (:mod:`inferlb.errors`, :mod:`inferlb.config`, :mod:`inferlb.request`,
:mod:`inferlb.policy`), :mod:`inferlb.adapters`, grpcio and the Envoy protos, prometheus_client, aiohttp;
never ``xds_server``, ``ext_authz``, ``simulation`` or :mod:`inferlb.ops`.
"""
