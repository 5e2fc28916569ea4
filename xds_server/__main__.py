"""``python -m xds_server --config PATH [--listen HOST:PORT] [--advertise HOST:PORT]
[--state-file PATH | --state-redis-url URL] [--log-level info]``: serve ADS for one inferlb config file.

``--listen`` binds there instead of ``xds.listen`` (``0.0.0.0`` allowed; kept across config reloads);
``--advertise`` states where Envoy dials the server and must match the config's ``xds.advertise`` (else
``xds.listen``), which Envoy's bootstrap is rendered from
(:func:`inferlb.config.schema.check_advertise_flag`).

The fleet API's bearer token comes from ``INFERLB_XDS_API_TOKEN`` when set (else ``xds.api_token``).
``--state-file`` stores the fleet API's changes there (overriding ``xds.state_file``) so a restart, clean or
``kill -9``, keeps them (:mod:`xds_server.fleet_store`); ``--state-redis-url`` (overriding
``xds.state_redis_url``) keeps them in Redis instead, shared by every server started on it, which all serve
them.
The telemetry loop (:mod:`xds_server.collector`: ``/metrics`` scrape, GPU reports, weights) runs beside it.

Exits 1 when the config is invalid, the state file is in use by another server, unreadable or corrupt (the
file named), the Redis store cannot be reached or holds something else (the store named), or the listen
address cannot be bound at start-up; at run time a bad
config change is logged and the last good snapshot keeps serving. SIGINT/SIGTERM stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from inferlb.config.schema import HostPort, check_advertise_flag, default_config_path, load_config
from inferlb.errors import ConfigError, InferlbError
from xds_server.collector import TelemetryCollector
from xds_server.server import DEFAULT_GRACE_S, XdsServer

log = logging.getLogger("xds_server")

#: Environment variable holding the fleet API's bearer token (overrides ``xds.api_token``).
API_TOKEN_ENV = "INFERLB_XDS_API_TOKEN"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xds_server", description="inferlb xDS (ADS) control server")
    p.add_argument(
        "--config", type=Path, default=default_config_path(), help="inferlb YAML config (default: embedded)"
    )
    p.add_argument("--listen", default=None, help="HOST:PORT to bind instead of xds.listen (0.0.0.0 allowed)")
    p.add_argument(
        "--advertise",
        default=None,
        help="HOST:PORT Envoy dials this server at; must be the config's xds.advertise (else xds.listen), "
        "which its bootstrap is rendered from",
    )
    store = p.add_mutually_exclusive_group()
    store.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="store fleet API changes in this file (default: xds.state_file; none: in memory only)",
    )
    store.add_argument(
        "--state-redis-url",
        default=None,
        help="store fleet API changes in this Redis, shared with other xDS servers (default: "
        "xds.state_redis_url)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def _addresses(config_path: Path, listen: str | None, advertise: str | None) -> tuple[str, int] | None:
    """``--listen`` as the server's bind address (None: the config's), after checking ``--advertise``
    against the config's ``xds.advertise``.

    Raises:
        ConfigError: the config file is invalid.
        ValueError: a flag is not ``host:port``, or ``--advertise`` is not where Envoy dials."""
    if advertise is not None:
        xds = load_config(config_path).xds
        check_advertise_flag(HostPort.model_validate(advertise), (xds.dial_address(),), "xds.advertise")
    if listen is None:
        return None
    hp = HostPort.model_validate(listen)
    return hp.host, hp.port


async def _serve(
    config_path: Path,
    state_file: Path | None = None,
    state_redis_url: str | None = None,
    bind: tuple[str, int] | None = None,
) -> int:
    telemetry = TelemetryCollector()
    server = XdsServer(
        config_path,
        bind=bind,
        api_token=os.environ.get(API_TOKEN_ENV) or None,
        api_routes=telemetry.routes(),
        state_file=state_file,
        state_redis_url=state_redis_url,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # handlers go in before start(): a supervisor may signal as soon as it reads the ready line
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await server.start()
        except (InferlbError, RuntimeError) as exc:
            log.error("xds_server cannot start: %s", exc)
            await server.stop(0)
            return 1
        await telemetry.start(server)
        await stop.wait()
        log.info("xds_server stopping")
        await telemetry.stop()
        await server.stop(DEFAULT_GRACE_S)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log.info("xds_server stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit code."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # grpc and asyncio are chatty at DEBUG; our own loggers carry the protocol detail
    for noisy in ("grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))
    try:
        bind = _addresses(args.config, args.listen, args.advertise)
    except ConfigError as err:
        log.error("xds_server cannot start: %s", err)
        return 1
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        log.error("xds_server cannot start: --listen/--advertise: %s", exc)
        return 1
    return asyncio.run(_serve(args.config, args.state_file, args.state_redis_url, bind))


if __name__ == "__main__":
    sys.exit(main())
