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
import logging
import ssl
import sys
from collections.abc import Sequence

from ext_proc.grpc_tls import grpc_server_credentials
from ext_proc.poller import ConfigPoller
from ext_proc.process import open_state, release, run_service, serve_metrics, service_arguments, until_stopped
from ext_proc.servicer import MAX_CONFIGURABLE_BODY_BYTES, add_to_server, make_server
from inferlb.adapters.unix_socket import UnixSocketError, bind_unix_socket
from inferlb.config.schema import Config, GrpcAddress, HostPort, UnixSocket

log = logging.getLogger("ext_proc")

#: Seconds in-flight streams get to finish on shutdown.
SHUTDOWN_GRACE_S = 2.0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = service_arguments("python -m ext_proc", "inferlb Envoy external processor", "ext_proc.listen")
    return p.parse_args(argv)


async def serve(
    config: Config,
    poller: ConfigPoller,
    listen: GrpcAddress,
    poll_interval_s: float,
    metrics_listen: HostPort | None = None,
) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status (1 when the config's
    ``ext_proc.protocol`` is not ``ext_proc``: Envoy would not call this service, and its metering would be
    Envoy's)."""
    if config.ext_proc.protocol != "ext_proc":
        log.error(
            "cannot start: ext_proc.protocol is %s, not ext_proc (run python -m %s, or set "
            "ext_proc.protocol: ext_proc)",
            config.ext_proc.protocol,
            config.ext_proc.protocol,
        )
        return 1
    state = await open_state(config, poller, log)
    if state is None:
        return 1
    quotas = state.quotas
    # sized for the largest body any config allows, so a reload raising the body limit still fits
    server = make_server(MAX_CONFIGURABLE_BODY_BYTES)
    servicer = add_to_server(server, state)
    try:
        if isinstance(listen, UnixSocket):
            bind_unix_socket(listen.path, "ext_proc.listen_unix", server.add_insecure_port)
            bound: GrpcAddress = listen
        elif config.ext_proc.tls is not None:  # mutual TLS, files read again when they change
            credentials, _ = grpc_server_credentials(config.ext_proc.tls, "ext_proc.tls")
            bound = HostPort(host=listen.host, port=server.add_secure_port(str(listen), credentials))
        else:
            bound = HostPort(host=listen.host, port=server.add_insecure_port(str(listen)))
    except (RuntimeError, UnixSocketError, OSError, ssl.SSLError) as exc:
        log.error("cannot listen on %s: %s", listen, exc)
        await quotas.aclose()
        return 1
    metrics_server = await serve_metrics(state, metrics_listen or config.ext_proc.metrics_listen, log)
    if metrics_server is None:
        return 1
    # open the quota store's connections before the first stream: a cold burst must find them ready
    await quotas.start()
    await server.start()
    log.info("ext_proc ready on %s", bound)

    try:
        await until_stopped(poller, state, str(config.ext_proc.grpc_address()), poll_interval_s, log)
    finally:
        await server.stop(SHUTDOWN_GRACE_S)
        await servicer.drain()  # settlements of streams cut by the stop
        await release(state, metrics_server)
    log.info("ext_proc stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ext_proc``."""
    args = _parse_args(argv)
    return run_service(
        args,
        log,
        lambda start: serve(
            start.config, start.poller, start.listen, args.poll_interval, start.metrics_listen
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
