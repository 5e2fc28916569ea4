"""gpusim: simulated GPU model servers (OpenAI-compatible, vLLM metric names) for the local stack, tests and
benchmarks. :mod:`simulation.gpusim.engine` is the pure timing model; :mod:`simulation.gpusim.server` the
aiohttp server; ``python -m simulation.gpusim`` runs a config's simulated fleet in one process."""
