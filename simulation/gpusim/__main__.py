"""``python -m simulation.gpusim --config PATH [--only NAME ...] [--log-level info]``: run the simulated
endpoints of a config in one process (one aiohttp site per endpoint address).

Runs every endpoint with ``simulated: true`` (or only those named with ``--only``, by display name, i.e. the
endpoint's ``name`` or else its address). Logs ``gpusim ready: N endpoints`` once all listen; stops cleanly on
SIGINT/SIGTERM. Exit status: 0 after a signal, 2 for a bad config or an unknown ``--only`` name, 1 when an
address cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Mapping, Sequence

from inferlb.config.schema import Config, EndpointConfig, default_config_path, load_config
from inferlb.errors import ConfigError
from simulation.gpusim.kv_events import KvEventsConfig, parse_kv_events_config
from simulation.gpusim.server import SimulatedEndpoint

log = logging.getLogger("gpusim")


def select_endpoints(config: Config, only: Sequence[str] | None) -> list[EndpointConfig]:
    """The endpoints to simulate: those marked ``simulated``, or exactly the ones named in ``only``.

    Raises:
        ValueError: a name in ``only`` matches no endpoint (the message lists the known names).
    """
    if not only:
        return [e for e in config.endpoints if e.simulated]
    by_name = {e.display_name: e for e in config.endpoints}
    unknown = [n for n in only if n not in by_name]
    if unknown:
        raise ValueError(f"unknown endpoint name(s) {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in dict.fromkeys(only)]


async def serve(
    config: Config,
    endpoints: Sequence[EndpointConfig],
    kv_events: KvEventsConfig | None = None,
    per_endpoint: Mapping[str, KvEventsConfig] | None = None,
) -> int:
    """Start one :class:`SimulatedEndpoint` per endpoint, wait for SIGINT/SIGTERM, stop them all. With
    ``kv_events``, the ``i``-th endpoint publishes on :meth:`KvEventsConfig.for_endpoint` ``(i)``; an
    endpoint named (by display name) in ``per_endpoint`` publishes on its own config instead."""
    own = per_endpoint or {}
    servers = [
        SimulatedEndpoint(
            config=config,
            endpoint=e,
            kv_events=own.get(e.display_name, None if kv_events is None else kv_events.for_endpoint(i)),
        )
        for i, e in enumerate(endpoints)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started: list[SimulatedEndpoint] = []
    try:
        for srv in servers:
            try:
                host, port = await srv.start()
            except OSError as exc:
                log.error(
                    "gpusim: cannot listen on %s for %s: %s", srv.endpoint.address, srv.display_name, exc
                )
                return 1
            started.append(srv)
            log.info(
                "%s (%s, %s) listening on %s:%d",
                srv.display_name, srv.endpoint.gpu, srv.model.name, host, port,
            )  # fmt: skip
        log.info("gpusim ready: %d endpoints", len(started))
        await stop.wait()
        log.info("stopping")
        return 0
    finally:
        await asyncio.gather(*(s.stop() for s in started))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m simulation.gpusim", description="Run the simulated GPU model servers."
    )
    parser.add_argument("--config", default=str(default_config_path()), help="inferlb config file (YAML)")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run only these endpoints (by name or address)"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--kv-events-config",
        metavar="JSON",
        help="publish KV events as vLLM does, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' '
        '(the i-th endpoint on port + i); "replay_endpoint": "tcp://*:5558" adds vLLM\'s replay socket '
        '(the last "buffer_steps" batches); NAME=JSON (repeatable) sets one endpoint\'s own config',
        action="append",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config)
        endpoints = select_endpoints(config, args.only)
        kv_events, per_endpoint = _kv_events_args(args.kv_events_config or [])
        unknown = sorted(set(per_endpoint) - {e.display_name for e in endpoints})
        if unknown:
            raise ValueError(f"--kv-events-config: no simulated endpoint named {unknown}")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"gpusim: {exc}", file=sys.stderr)
        return 2
    publishes = any(k.publishes for k in (kv_events, *per_endpoint.values()) if k is not None)
    if publishes and not config.simulation.prefix_caching:
        print("gpusim: --kv-events-config needs simulation.prefix_caching (it is false)", file=sys.stderr)
        return 2
    if not endpoints:
        print(f"gpusim: no simulated endpoints in {args.config}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config, endpoints, kv_events, per_endpoint))


def _kv_events_args(values: Sequence[str]) -> tuple[KvEventsConfig | None, dict[str, KvEventsConfig]]:
    """The ``--kv-events-config`` values: at most one bare JSON (every endpoint, port + i) and any number of
    ``NAME=JSON`` (that endpoint's own).

    Raises:
        ValueError: two bare values, a name given twice, or a JSON :func:`parse_kv_events_config` refuses.
    """
    shared: KvEventsConfig | None = None
    own: dict[str, KvEventsConfig] = {}
    for v in values:
        if v.lstrip().startswith("{"):
            if shared is not None:
                raise ValueError("--kv-events-config: one JSON for all endpoints at most (NAME=JSON for one)")
            shared = parse_kv_events_config(v)
            continue
        name, eq, text = v.partition("=")
        if not eq or name in own:
            raise ValueError(f"--kv-events-config: expected JSON or NAME=JSON once per name, got {v[:80]!r}")
        own[name] = parse_kv_events_config(text)
    return shared, own


if __name__ == "__main__":
    sys.exit(main())
