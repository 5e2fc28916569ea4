"""gpusim: simulated GPU model servers (OpenAI-compatible, vLLM metric names) for the local stack, tests and
benchmarks. :mod:`gpusim.engine` is the pure timing model; :mod:`gpusim.server` the aiohttp server;
``python -m gpusim`` runs a config's simulated fleet in one process."""
