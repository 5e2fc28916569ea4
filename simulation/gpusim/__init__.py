"""gpusim: simulated GPU model servers (OpenAI-compatible, vLLM metric names) for the local stack, tests and
benchmarks.

- :mod:`simulation.gpusim.engine`: the pure continuous-batching timing model of one GPU.
- :mod:`simulation.gpusim.replies`: the OpenAI response bodies and streams (pure).
- :mod:`simulation.gpusim.faults`: faults (throttle, slow, fail, mute) and the NVML-like telemetry they show.
- :mod:`simulation.gpusim.vllm_metrics`: ``/metrics`` under vLLM's metric names.
- :mod:`simulation.gpusim.kv_events`: the prefix cache's KV events on a ZMQ PUB socket in vLLM's wire format
  (``--kv-events-config``).
- :mod:`simulation.gpusim.server`: the aiohttp server of one simulated endpoint.
- ``__main__``: ``python -m simulation.gpusim`` runs a config's simulated fleet in one process.

May import: the core (:mod:`inferlb.errors`, :mod:`inferlb.config`, :mod:`inferlb.request`,
:mod:`inferlb.policy`), :mod:`simulation.kvcache`, aiohttp, prometheus_client, pyzmq and msgspec.
"""
