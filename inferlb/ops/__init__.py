"""Operator tools: the ``inferlb`` command and what it runs.

- :mod:`inferlb.ops.cli`: the ``inferlb`` command (``up``, ``status``, ``top``, ``replay``, ``validate``,
  ``bootstrap``, ``xds clients``, ``sim``, ``agent``).
- :mod:`inferlb.ops.stack`: the local stack as processes (``inferlb up``).
- :mod:`inferlb.ops.status`: Envoy's and the xDS server's view of the fleet as tables.
- :mod:`inferlb.ops.top`: each GPU's load over time as a live heat map (``inferlb top``).
- :mod:`inferlb.ops.replay`: replay a trace through the gateway and summarise what the fleet did.
- :mod:`inferlb.ops.agent`: the per-node GPU agent (NVML readings to ``/metrics`` and the control plane).
- :mod:`inferlb.ops.redis_server`: a loopback ``redis-server`` (optionally with its append-only file) for
  the shared quota store in tests and benchmarks.

May import: the core, the adapters and the services' pure parts (``xds_server.bootstrap``); the services
themselves run as child processes (``python -m``), never in-process. Never the simulators.
"""
