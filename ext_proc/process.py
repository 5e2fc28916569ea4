"""The process pieces ``python -m ext_proc`` and ``python -m ext_authz`` share: the event loop choice (uvloop
when installed), the ``--metrics-listen`` address, config error logging and the config-file watch loop that
applies a changed file to an :class:`~ext_proc.state.ExtProcState`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, Literal
from wsgiref.simple_server import WSGIServer

from ext_proc.metrics import ExtProcMetrics
from ext_proc.picking import EndpointStatePoller
from ext_proc.poller import ConfigPoller
from ext_proc.state import ExtProcState
from ext_proc.stores import make_quota_store, start_metrics_server
from inferlb.config.changes import check_not_emptied
from inferlb.config.checks import check_config
from inferlb.config.schema import Config, GrpcAddress, HostPort, check_advertise_flag
from inferlb.errors import ConfigError

log = logging.getLogger("ext_proc")

#: The environment variable holding the xDS server's API token (as ``python -m xds_server`` reads it), for
#: endpoint picking's state reads; else ``xds.api_token``.
XDS_API_TOKEN_ENV: Final = "INFERLB_XDS_API_TOKEN"

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]
#: The ``--event-loop`` choices of both entry points.
EVENT_LOOP_CHOICES: Final = ("auto", "uvloop", "asyncio")


def run_event_loop(main: Coroutine[Any, Any, int], choice: EventLoopChoice = "auto") -> tuple[int, str]:
    """Run ``main`` to completion on the chosen event loop; returns (its result, the loop used:
    ``"uvloop"`` or ``"asyncio"``).

    ``auto`` takes uvloop when it is installed and falls back to asyncio's default loop (logged) when it is
    not; grpc aio runs on either (its completion queue is polled from the running loop).

    Raises:
        ImportError: ``choice`` is ``"uvloop"`` and uvloop is not installed.
    """
    if choice != "asyncio":
        try:
            import uvloop  # noqa: PLC0415  # optional: only this entry point wants it
        except ImportError:
            if choice == "uvloop":
                main.close()
                raise
            log.info("uvloop is not installed; using asyncio's default event loop")
        else:
            return uvloop.run(main), "uvloop"
    return asyncio.run(main), "asyncio"


def parse_metrics_listen(text: str) -> HostPort:
    """``--metrics-listen HOST:PORT``; unlike a config address, port 0 is allowed (the OS picks a free
    port, logged as ``ext_proc metrics on HOST:PORT``).

    Raises:
        ValueError: not ``host:port`` (pydantic's ValidationError is a ValueError).
    """
    host, sep, port = text.strip().rpartition(":")
    if sep and port == "0":
        # validate the host the usual way, then take port 0 (HostPort itself requires 1-65535)
        return HostPort.model_validate(f"{host}:1").model_copy(update={"port": 0})
    return HostPort.model_validate(text)


def log_config_error(log: logging.Logger, err: ConfigError, what: str) -> None:
    """Log each ``(field, message)`` of ``err`` as one error line, prefixed by ``what``."""
    for field, msg in err.problems:
        log.error("%s: %s: %s: %s", what, err.source, field or "<document>", msg)


async def watch_config(
    poller: ConfigPoller, state: ExtProcState, listen: str, interval_s: float, log: logging.Logger
) -> None:
    """Poll the config file every ``interval_s`` seconds for ever (cancel the task to stop it) and serve each
    new config that passes the checks xds_server runs too (:func:`inferlb.config.checks.check_config`, no
    emptied section), so both serve one file or neither; a refused file is logged with its fields and the
    last good config keeps serving. ``listen`` is the address served now: a change to it (or to
    ``ext_proc.quota_backend`` or ``ext_proc.protocol``) is logged as needing a restart."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            config = poller.poll()
        except ConfigError as err:
            log_config_error(log, err, "config reload refused, still serving the last good config")
            continue
        if config is None:
            continue
        try:
            # the checks xds_server runs too (no emptied section, tokenizers, host names), so both serve
            # this file or neither
            check_not_emptied(state.gateway.config, config, str(poller.path))
            await check_config(config, str(poller.path))
        except ConfigError as err:
            log_config_error(log, err, "config reload refused, still serving the last good config")
            continue
        warn_if_process_moved(state.gateway.config, config, listen, log)
        if config.ext_proc.protocol != state.gateway.config.ext_proc.protocol:
            log.warning("ext_proc.protocol changed to %s; it needs a restart", config.ext_proc.protocol)
        if config.ext_proc.quota_backend != state.gateway.config.ext_proc.quota_backend:
            log.warning(
                "ext_proc.quota_backend changed to %s; it needs a restart", config.ext_proc.quota_backend
            )
        if config.ext_proc.tls != state.gateway.config.ext_proc.tls:
            # the socket's credentials are made at start; a rotation of the same files needs nothing
            log.warning("ext_proc.tls changed; it needs a restart (still serving the one it started with)")
        try:
            state.apply_config(config)
        except ValueError as exc:
            log.error("config reload refused, still serving the last good config: %s", exc)
            continue
        log.info(
            "config reloaded from %s: %d models, %d tenants",
            poller.path,
            len(config.models),
            len(config.tenants),
        )


def warn_if_process_moved(old: Config, new: Config, listen: str, log: logging.Logger) -> None:
    """Log that a restart is needed when the process serving ``listen`` is no longer one of ``new``'s
    request-path addresses (``ext_proc.listen``/``listen_unix``, ``extra_listen``), or, when ext_authz mode
    meters, the settler addresses changed (:meth:`~inferlb.config.schema.ExtProcConfig.meter_addresses`):
    Envoy's access logger ``i`` follows the new address ``i`` while each process keeps the settler address
    and meter id prefix it started with (:mod:`ext_authz.meter`). A reordered ``extra_listen`` alone changes
    neither."""
    now = [str(a) for a in (new.ext_proc.grpc_address(), *new.ext_proc.extra_listen)]
    if listen not in now:
        log.warning(
            "%s is no longer ext_proc.listen/listen_unix nor one of extra_listen (now %s); the new "
            "addresses need a restart",
            listen,
            ", ".join(now),
        )
    if new.ext_proc.meters_access_log() and new.ext_proc.meter_addresses() != old.ext_proc.meter_addresses():
        log.warning(
            "the settler addresses changed to %s; the ext_authz processes keep theirs until a restart "
            "(entries Envoy sends to another settler are ignored there; their reservations settle by the "
            "TTL)",
            ", ".join(map(str, new.ext_proc.meter_addresses())),
        )


def service_arguments(prog: str, description: str, listen_field: str) -> argparse.ArgumentParser:
    """The command line both services take: ``--config`` (required), ``--listen`` (instead of
    ``listen_field``), ``--advertise`` (checked against the config's dialled addresses:
    :func:`~inferlb.config.schema.check_advertise_flag`), ``--metrics-listen``, ``--log-level``,
    ``--poll-interval`` (s) and ``--event-loop``."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", required=True, help="inferlb YAML config file (watched for changes)")
    p.add_argument(
        "--listen",
        help=f"HOST:PORT to serve on (bind; 0.0.0.0 allowed) instead of the config's {listen_field}",
    )
    p.add_argument(
        "--advertise",
        help="HOST:PORT Envoy dials this process at; must be the config's ext_proc.advertise (else listen) "
        "or one of extra_listen, which the xDS server builds Envoy's cluster from",
    )
    p.add_argument(
        "--metrics-listen", help="HOST:PORT for /metrics instead of the config's ext_proc.metrics_listen"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--poll-interval", type=float, default=0.5, help="config poll period in seconds")
    p.add_argument(
        "--event-loop",
        default="auto",
        choices=EVENT_LOOP_CHOICES,
        help="auto: uvloop when installed, else asyncio's own loop",
    )
    return p


@dataclass(frozen=True, kw_only=True)
class StartUp:
    """What a service starts from: the poller (its digest set to the file read), that file's config, the
    address to serve on (``--listen`` or the config's), the address Envoy dials it at (``--advertise`` or
    the config's) and ``--metrics-listen`` (None: the config's)."""

    poller: ConfigPoller
    config: Config
    listen: GrpcAddress
    advertise: GrpcAddress
    metrics_listen: HostPort | None


def _advertised(config: Config, listen: GrpcAddress, flag: str | None) -> GrpcAddress:
    """Where Envoy dials the process serving on ``listen``: ``--advertise`` (checked against the
    config), else the config's dial address of that process (``ext_proc.advertise`` for process 0),
    else ``listen`` itself."""
    dialled = config.ext_proc.dial_addresses()
    if flag is not None:
        hp = HostPort.model_validate(flag)
        check_advertise_flag(hp, dialled, "ext_proc.advertise/extra_listen")
        return hp
    index = config.ext_proc.process_index(listen)
    return listen if index is None else dialled[index]


def run_service(
    args: argparse.Namespace,
    log: logging.Logger,
    serve: Callable[[StartUp], Coroutine[Any, Any, int]],
) -> int:
    """Set up logging, read the config named by ``args`` (:func:`service_arguments`), and run
    ``serve(start_up)`` on the chosen event loop; returns the exit status (1, logged, when the config, an
    address or the event loop is unusable)."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    poller = ConfigPoller(args.config)
    try:
        digest, config = poller.read()
        listen: GrpcAddress = (
            HostPort.model_validate(args.listen) if args.listen else config.ext_proc.grpc_address()
        )
        metrics_listen = parse_metrics_listen(args.metrics_listen) if args.metrics_listen else None
        advertise = _advertised(config, listen, args.advertise)
    except ConfigError as err:
        log_config_error(log, err, "cannot start")
        return 1
    except ValueError as exc:  # pydantic's ValidationError for a bad --listen
        log.error("cannot start: --listen/--advertise/--metrics-listen: %s", exc)
        return 1
    poller.digest = digest
    log.info("serving on %s, Envoy dials it at %s", listen, advertise)
    start = StartUp(
        poller=poller, config=config, listen=listen, advertise=advertise, metrics_listen=metrics_listen
    )
    try:
        status, _ = run_event_loop(serve(start), args.event_loop)
    except ImportError:
        log.error("cannot start: --event-loop uvloop, but uvloop is not installed")
        return 1
    return status


async def open_state(config: Config, poller: ConfigPoller, log: logging.Logger) -> ExtProcState | None:
    """Check ``config`` as xds_server does and build the state to serve it: metrics, the quota store
    (not started), the handlers' gateway. None (logged) when the config fails a check or a model's
    tokenizer cannot be built."""
    try:
        await check_config(config, str(poller.path))
    except ConfigError as err:
        log_config_error(log, err, "cannot start")
        return None
    metrics = ExtProcMetrics()
    quotas = make_quota_store(config, metrics)
    try:
        return ExtProcState(config, quotas=quotas, metrics=metrics)
    except ValueError as exc:  # a model's tokenizer cannot be built
        log.error("cannot start: %s", exc)
        await quotas.aclose()
        return None


async def until_stopped(
    poller: ConfigPoller, state: ExtProcState, listen: str, interval_s: float, log: logging.Logger
) -> None:
    """Watch the config (:func:`watch_config`) until SIGINT or SIGTERM, then stop watching (the watcher's
    cancellation awaited, the signal handlers removed) and return, for the caller to stop its server."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(watch_config(poller, state, listen, interval_s, log))
    # endpoint picking's live state: polled from the xDS server beside the requests, never on their path
    endpoints = EndpointStatePoller(
        state.picking,
        lambda: state.gateway.config,
        state.metrics,
        token=os.environ.get(XDS_API_TOKEN_ENV),
    )
    endpoints.start()
    try:
        await stop.wait()
        log.info("%s stopping", log.name)
    finally:
        await endpoints.stop()
        watcher.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # the watcher may be mid-poll; wait for its cancellation so nothing runs after we return
        await asyncio.gather(watcher, return_exceptions=True)


async def release(state: ExtProcState, metrics_server: WSGIServer | None) -> None:
    """Close the quota store's connections and stop the ``/metrics`` server (when started): the last steps
    of both services' shutdown, after their own server stopped."""
    await state.quotas.aclose()
    if metrics_server is not None:
        metrics_server.shutdown()
        metrics_server.server_close()


async def serve_metrics(state: ExtProcState, at: HostPort, log: logging.Logger) -> WSGIServer | None:
    """Serve ``state``'s metrics on ``http://at/metrics`` (port 0: a free one), logged as ``<service> metrics
    on HOST:PORT`` with the quota backend; None (logged, the quota store closed) when ``at`` cannot be
    bound."""
    # the KV-event subscribers' counters (precise endpoint picking), read at each scrape
    with contextlib.suppress(ValueError):  # registered already (a second serve in one process)
        state.metrics.registry.register(state.picking.kv_events)
    try:
        server, port = start_metrics_server(at, state.metrics)
    except OSError as exc:
        log.error("cannot serve metrics on %s: %s", at, exc)
        await state.quotas.aclose()
        return None
    log.info("%s metrics on %s", log.name, HostPort(host=at.host, port=port))
    log.info("%s quota backend: %s", log.name, state.gateway.config.ext_proc.quota_backend)
    return server
