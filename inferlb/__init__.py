"""inferlb: an Envoy control plane (xDS + ext_proc) that load-balances LLM inference over GPU fleets.

The library the services share, in layers whose dependencies point one way (each subpackage's docstring
says what it may import; ``tests/unit/test_layers.py`` checks it):

- the core, pure (values in, values out; no server, no client, no I/O at import): :mod:`inferlb.errors`,
  :mod:`inferlb.traces`, :mod:`inferlb.config` (the fleet/config model), :mod:`inferlb.request` (the OpenAI
  request side), :mod:`inferlb.policy` (weights, length classes, affinity, routing, quotas);
- :mod:`inferlb.adapters`: the core's seams bound to Redis and NVML;
- :mod:`inferlb.ops`: the operator tools (the ``inferlb`` command, the local stack, status, replay, the GPU
  agent).

The services are the packages ``xds_server`` and ``ext_proc``; the simulators live in ``simulation``.
"""

__version__ = "0.1.0"
