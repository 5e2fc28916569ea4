"""inferlb's Envoy external processor (envoy.service.ext_proc.v3): reads each OpenAI request, checks key,
quota and model, counts prompt tokens and sets the ``x-inferlb-*`` routing headers.

- :mod:`ext_proc.handlers`: the per-phase decisions, plain values in and out (no gRPC).
- :mod:`ext_proc.servicer`: the grpcio aio adapter (ProcessingRequest stream -> handlers -> responses).
- :mod:`ext_proc.stores`: the quota store (in-process or Redis) and the ``/metrics`` server from the config.
- :mod:`ext_proc.metrics`: the service's Prometheus registry.
- :mod:`ext_proc.poller`: the config-file poller.
- ``__main__``: the process (``python -m ext_proc --config PATH``).

May import: the core (:mod:`inferlb.errors`, :mod:`inferlb.config`, :mod:`inferlb.request`,
:mod:`inferlb.policy`), :mod:`inferlb.adapters`, grpcio and the Envoy protos, prometheus_client, aiohttp;
never ``xds_server``, ``simulation`` or :mod:`inferlb.ops`.
"""
