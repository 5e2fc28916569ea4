"""A discrete-event simulation of a large GPU fleet behind Envoy's load balancers. Pure: no clock, no I/O.

The weight policy (:mod:`inferlb.policy.weights`) is shown at fleet scale here, not assumed. This package
runs a trace's requests through ``N`` simulated model servers (one continuous-batching engine per GPU,
injected by the caller: ``simulation.gpusim.engine.BatchEngine`` satisfies
:class:`simulation.fleetsim.seams.ServingEngine`; the package does not import gpusim) with one of six
balancers that reproduce what Envoy does, without Envoy (``round_robin``, ``least_request``,
``static_weights``, ``telemetry_weights``, ``length_aware``, ``tiered``), or one of three prefix-aware
placements (``ring_hash``: Envoy's ring hash with bounded load on the prefix; ``approximate`` and
``precise``: the endpoint picker :func:`inferlb.policy.picker.pick` over an approximate prefix index learnt
from its own picks, or over the engines' real prefix caches, what perfect KV events would give).

Modules (each imports only those above it, and the core):

- :mod:`simulation.fleetsim.seams`: what the simulation needs of a serving engine (``typing.Protocol`` s:
  its timing model, its stats, its events).
- :mod:`simulation.fleetsim.workload`: the fleet (:func:`~simulation.fleetsim.workload.fleet_mix`), the cost
  of one request and the fleet's capacity, the trace scaled to a target rate, and the length thresholds of
  the length-aware policies.
- :mod:`simulation.fleetsim.scenario`: the policies and :class:`~simulation.fleetsim.scenario.Scenario`, the
  definition of one run (bounds, telemetry, fault, placement options).
- :mod:`simulation.fleetsim.balancers`: Envoy's load balancers (EDF scheduler, round robin, least request,
  tiered and length-aware placement, ring hash) and the endpoint picker's placement, and
  :func:`~simulation.fleetsim.balancers.make_balancer`.
- :mod:`simulation.fleetsim.signals`: the telemetry one simulated GPU shows the weight policy (its
  model server's metrics and its NVML view).
- :mod:`simulation.fleetsim.results`: the figures of a run
  (:class:`~simulation.fleetsim.results.FleetRunResult`) and the traffic shift after a fault.
- :mod:`simulation.fleetsim.loop`: the event loop, :func:`~simulation.fleetsim.loop.simulate`.

Import each name from the module that defines it; this ``__init__`` re-exports nothing.

**Prefix caching.** A trace row with block ids (a Mooncake trace's ``hash_ids``:
:func:`inferlb.traces.read_mooncake_trace`) is submitted with them (:class:`simulation.kvcache.PromptBlocks`);
an engine built with a :class:`simulation.kvcache.PrefixCache` of the trace's block size (512 tokens for
Mooncake) prefills only what its cache misses, by the same rules as a gpusim server, and the run reports the
hit rate. Rows without block ids (the Azure trace, synthetic loads) are submitted exactly as before, and
engines without a cache behave exactly as before: runs of those stay bit-identical.

May import: the core (:mod:`inferlb.config`, :mod:`inferlb.policy`, :mod:`inferlb.traces`),
:mod:`simulation.kvcache`; never
:mod:`simulation.gpusim` (its engines come in by injection), a service, an adapter or an operator tool.
"""
