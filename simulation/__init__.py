"""Simulators, outside the runtime: nothing in ``inferlb``, ``xds_server`` or ``ext_proc`` imports them.

- :mod:`simulation.gpusim`: simulated GPU model servers (OpenAI-compatible, vLLM metric names, faults and
  NVML-like telemetry) for the local stack, tests and benchmarks; ``python -m simulation.gpusim``.
- :mod:`simulation.fleetsim`: a discrete-event simulation of a fleet behind Envoy-like balancers, for
  benchmarks at 1,000-GPU scale.
- :mod:`simulation.kvcache`: the pure model of vLLM's automatic prefix caching (chained block hashes, an
  LRU block pool with reference counts) that both use: gpusim's engine holds one per GPU, and so does each
  engine the fleet simulation is given.
- :mod:`simulation.scheduler`: the pure step rules of vLLM's scheduler (token budget and chunked prefill,
  KV blocks per sequence, preemption, the step time) that gpusim's engine applies, and so the fleet
  simulation through it.

May import: the core (:mod:`inferlb.config`, :mod:`inferlb.request`, :mod:`inferlb.policy`,
:mod:`inferlb.traces`, :mod:`inferlb.errors`), aiohttp and prometheus_client; no service, adapter or
operator tool.
"""
