"""``python -m ext_proc --config PATH [--listen HOST:PORT] [--metrics-listen HOST:PORT]``: serve Envoy's
ext_proc.

Serves on ``ext_proc.listen`` from the config, or on the Unix socket ``ext_proc.listen_unix`` (mode 0600)
when set (``--listen`` overrides either with a TCP address, e.g. one port per process) and
Prometheus metrics on ``http://ext_proc.metrics_listen/metrics`` (``--metrics-listen`` overrides it; port 0
picks a free one, logged as ``ext_proc metrics on HOST:PORT``). Quota state lives where
``ext_proc.quota_backend`` says (``memory`` or ``redis``; a change needs a restart). It
logs ``ext_proc ready on HOST:PORT`` (``unix:PATH``) once it accepts streams, polls the config file every
``--poll-interval`` seconds (0.5) by content hash and applies a changed file once two consecutive polls read
the same bytes; a bad file is logged with the field named and the last good config keeps serving (a file
must also pass :func:`inferlb.config.checks.check_config` and must not empty the running config's models,
endpoints or tenants unless its ``allow_empty`` says so (:mod:`inferlb.config.changes`), as xds_server's
must, so the two never serve different files). The event loop is uvloop's when uvloop is installed
(``--event-loop auto``, the default; ``asyncio`` forces the standard loop): it cut the server's work per
request by ~7% (bench/extproc_cpu.py --unique, callgrind: 3.55 M -> 3.30 M instructions).
SIGINT/SIGTERM stop it cleanly (in-flight streams get a grace period). Exit status: 0 after a clean stop,
1 when the config or the listen socket is unusable at start-up (or ``--event-loop uvloop`` without uvloop).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, Literal

from ext_proc.metrics import ExtProcMetrics
from ext_proc.poller import ConfigPoller
from ext_proc.servicer import MAX_CONFIGURABLE_BODY_BYTES, ExtProcState, add_to_server, make_server
from ext_proc.stores import make_quota_store, start_metrics_server
from inferlb.adapters.unix_socket import UnixSocketError, bind_unix_socket
from inferlb.config.changes import check_not_emptied
from inferlb.config.checks import check_config
from inferlb.config.schema import Config, GrpcAddress, HostPort, UnixSocket
from inferlb.errors import ConfigError

log = logging.getLogger("ext_proc")

#: Seconds in-flight streams get to finish on shutdown.
SHUTDOWN_GRACE_S = 2.0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ext_proc", description="inferlb Envoy external processor")
    p.add_argument("--config", required=True, help="inferlb YAML config file (watched for changes)")
    p.add_argument("--listen", help="HOST:PORT to serve on instead of the config's ext_proc.listen")
    p.add_argument(
        "--metrics-listen", help="HOST:PORT for /metrics instead of the config's ext_proc.metrics_listen"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--poll-interval", type=float, default=0.5, help="config poll period in seconds")
    p.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="auto: uvloop when installed, else asyncio's own loop",
    )
    return p.parse_args(argv)


EventLoopChoice = Literal["auto", "uvloop", "asyncio"]


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


def _log_config_error(err: ConfigError, what: str) -> None:
    for field, msg in err.problems:
        log.error("%s: %s: %s: %s", what, err.source, field or "<document>", msg)


async def _watch_config(poller: ConfigPoller, state: ExtProcState, listen: str, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            config = poller.poll()
        except ConfigError as err:
            _log_config_error(err, "config reload refused, still serving the last good config")
            continue
        if config is None:
            continue
        try:
            # the checks xds_server runs too (no emptied section, tokenizers, host names), so both serve
            # this file or neither
            check_not_emptied(state.gateway.config, config, str(poller.path))
            await check_config(config, str(poller.path))
        except ConfigError as err:
            _log_config_error(err, "config reload refused, still serving the last good config")
            continue
        if str(config.ext_proc.grpc_address()) != listen:
            log.warning(
                "ext_proc.listen/listen_unix changed to %s; the new address needs a restart",
                config.ext_proc.grpc_address(),
            )
        if config.ext_proc.quota_backend != state.gateway.config.ext_proc.quota_backend:
            log.warning(
                "ext_proc.quota_backend changed to %s; it needs a restart", config.ext_proc.quota_backend
            )
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


async def serve(
    config: Config,
    poller: ConfigPoller,
    listen: GrpcAddress,
    poll_interval_s: float,
    metrics_listen: HostPort | None = None,
) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status."""
    try:
        await check_config(config, str(poller.path))
    except ConfigError as err:
        _log_config_error(err, "cannot start")
        return 1
    metrics = ExtProcMetrics()
    quotas = make_quota_store(config, metrics)
    try:
        state = ExtProcState(config, quotas=quotas, metrics=metrics)
    except ValueError as exc:  # a model's tokenizer cannot be built
        log.error("cannot start: %s", exc)
        await quotas.aclose()
        return 1
    # sized for the largest body any config allows, so a reload raising the body limit still fits
    server = make_server(MAX_CONFIGURABLE_BODY_BYTES)
    servicer = add_to_server(server, state)
    try:
        if isinstance(listen, UnixSocket):
            bind_unix_socket(listen.path, "ext_proc.listen_unix", server.add_insecure_port)
            bound: GrpcAddress = listen
        else:
            bound = HostPort(host=listen.host, port=server.add_insecure_port(str(listen)))
    except (RuntimeError, UnixSocketError) as exc:
        log.error("cannot listen on %s: %s", listen, exc)
        await quotas.aclose()
        return 1
    metrics_at = metrics_listen or config.ext_proc.metrics_listen
    try:
        metrics_server, metrics_port = start_metrics_server(metrics_at, metrics)
    except OSError as exc:
        log.error("cannot serve metrics on %s: %s", metrics_at, exc)
        await quotas.aclose()
        return 1
    log.info("ext_proc metrics on %s", HostPort(host=metrics_at.host, port=metrics_port))
    log.info("ext_proc quota backend: %s", config.ext_proc.quota_backend)
    # open the quota store's connections before the first stream: a cold burst must find them ready
    await quotas.start()
    await server.start()
    log.info("ext_proc ready on %s", bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(
        _watch_config(poller, state, str(config.ext_proc.grpc_address()), poll_interval_s)
    )
    try:
        await stop.wait()
        log.info("ext_proc stopping")
    finally:
        watcher.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop(SHUTDOWN_GRACE_S)
        # the watcher may be mid-poll; wait for its cancellation so nothing runs after we return
        await asyncio.gather(watcher, return_exceptions=True)
        await servicer.drain()  # settlements of streams cut by the stop
        await quotas.aclose()
        metrics_server.shutdown()
        metrics_server.server_close()
    log.info("ext_proc stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ext_proc``."""
    args = _parse_args(argv)
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
    except ConfigError as err:
        _log_config_error(err, "cannot start")
        return 1
    except ValueError as exc:  # pydantic's ValidationError for a bad --listen
        log.error("cannot start: --listen/--metrics-listen: %s", exc)
        return 1
    poller.digest = digest
    try:
        status, _ = run_event_loop(
            serve(config, poller, listen, args.poll_interval, metrics_listen), args.event_loop
        )
    except ImportError:
        log.error("cannot start: --event-loop uvloop, but uvloop is not installed")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
