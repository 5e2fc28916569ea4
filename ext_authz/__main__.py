"""``python -m ext_authz --config PATH [--listen HOST:PORT] [--metrics-listen HOST:PORT]``: serve Envoy's
ext_authz HTTP service (``ext_proc.protocol: ext_authz``).

Serves HTTP/1.1 on ``ext_proc.listen`` (``--listen`` overrides it, e.g. one port per process of
``ext_proc.extra_listen``), or on the Unix socket ``ext_proc.listen_unix`` (mode 0600, as ext_proc:
:meth:`ext_authz.server.CheckServer.start_unix`), and Prometheus metrics on
``http://ext_proc.metrics_listen/metrics`` (the metric names of ext_proc, :mod:`ext_proc.metrics`;
``inferlb_ext_proc_processing_seconds{phase="check"}`` times a check). Quota state lives where
``ext_proc.quota_backend`` says. It logs ``ext_authz ready on HOST:PORT``
once it accepts connections and reloads the config file as ext_proc does
(:func:`ext_proc.process.watch_config`: by content hash, two stable polls, the same checks as xds_server,
the last good config kept on a bad file). The event loop is uvloop's when installed (``--event-loop``).
With ``ext_proc.account_responses`` it also serves Envoy's gRPC access-log service on
``ext_proc.meter_listen`` (:mod:`ext_proc.access_log` -> :mod:`ext_authz.meter`, the settler) before it
takes checks; the process serving ``extra_listen[i]`` (its ``--listen``) serves it on the matching
``extra_meter_listen`` address instead and prefixes its meter ids with its index
(:meth:`inferlb.config.schema.ExtProcConfig.meter_addresses`, :mod:`ext_authz.meter`). SIGINT/SIGTERM
stop it cleanly (:meth:`ext_authz.server.CheckServer.close`, then the settler). Exit status: 0 after a
clean stop, 1 when the config, the listen address or the event loop is unusable at start-up, the config's
``ext_proc.protocol`` is not ``ext_authz``, or it meters with ``extra_listen`` processes and its listen
address is none of the config's (no access log of Envoy's would reach its settler).
"""

from __future__ import annotations

import argparse
import logging
import ssl
import sys
from collections.abc import Sequence

import grpc

from ext_authz.check import CheckService
from ext_authz.meter import Meter
from ext_authz.server import CheckServer
from ext_proc.access_log import serve_access_log
from ext_proc.grpc_tls import grpc_server_credentials
from ext_proc.process import (
    StartUp,
    open_state,
    release,
    run_service,
    serve_metrics,
    service_arguments,
    until_stopped,
)
from inferlb.adapters.tls import ssl_server_context
from inferlb.adapters.unix_socket import UnixSocketError
from inferlb.config.schema import ExtProcConfig, GrpcAddress, HostPort, UnixSocket

log = logging.getLogger("ext_authz")

#: Seconds the settler's gRPC server lets a batch in flight finish at shutdown.
SETTLER_GRACE_S = 1.0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = service_arguments("python -m ext_authz", "inferlb Envoy ext_authz HTTP service", "ext_proc.listen")
    return p.parse_args(argv)


async def serve(start: StartUp, poll_interval_s: float) -> int:
    """Run the service until SIGINT/SIGTERM; returns the exit status."""
    config, poller, listen = start.config, start.poller, start.listen
    if config.ext_proc.protocol != "ext_authz":
        log.error("cannot start: ext_proc.protocol is %s, not ext_authz", config.ext_proc.protocol)
        return 1
    process = _process_index(config.ext_proc, listen)
    if process is None:
        return 1
    state = await open_state(config, poller, log)
    if state is None:
        return 1
    quotas = state.quotas
    meter = Meter(state, process=process) if config.ext_proc.meters_access_log() else None
    server = CheckServer(CheckService(state, meter=meter))
    metrics_server = await serve_metrics(state, start.metrics_listen or config.ext_proc.metrics_listen, log)
    if metrics_server is None:
        return 1
    await quotas.start()
    settler: grpc.aio.Server | None = None
    tls = config.ext_proc.tls  # mutual TLS on the check service and the settler; files reloaded on change
    try:
        if meter is not None:
            # before the checks: every metered request's entry must find the settler listening
            meter_listen = config.ext_proc.meter_addresses()[process]
            settler, meter_port = await serve_access_log(
                meter_listen.host,
                meter_listen.port,
                meter.on_entries,
                None if tls is None else grpc_server_credentials(tls, "ext_proc.tls")[0],
            )
            meter.start()
            settled_on = HostPort(host=meter_listen.host, port=meter_port)
            log.info("ext_authz settler on %s (process %d)", settled_on, process)
        if isinstance(listen, UnixSocket):
            await server.start_unix(listen.path)
            bound: GrpcAddress = listen
        else:
            context = None if tls is None else ssl_server_context(tls, "ext_proc.tls")[0]
            bound = HostPort(host=listen.host, port=await server.start(listen.host, listen.port, context))
    except (OSError, UnixSocketError, ssl.SSLError) as exc:
        log.error("cannot listen on %s: %s", listen, exc)
        await _stop_settler(settler, meter)
        await release(state, metrics_server)
        return 1
    log.info("ext_authz ready on %s", bound)

    try:
        await until_stopped(poller, state, str(listen), poll_interval_s, log)
    finally:
        await server.close()
        await _stop_settler(settler, meter)
        await release(state, metrics_server)
    log.info("ext_authz stopped")
    return 0


def _process_index(ep: ExtProcConfig, listen: GrpcAddress) -> int | None:
    """This process's index among the request-path processes (:meth:`ExtProcConfig.process_index`); a
    ``--listen`` the config does not name is process 0 when the config has one process, else None (logged:
    Envoy would send its entries to no settler of its own)."""
    process = ep.process_index(listen)
    if process is not None:
        return process
    if not ep.extra_listen or not ep.meters_access_log():
        return 0
    log.error(
        "cannot start: %s is neither ext_proc.listen nor one of extra_listen, so no access log of Envoy's "
        "reaches this process's settler; serve on one of them",
        listen,
    )
    return None


async def _stop_settler(settler: grpc.aio.Server | None, meter: Meter | None) -> None:
    """Stop the access-log receiver after the entries in flight (a short grace), then the sweeps."""
    if settler is not None:
        await settler.stop(SETTLER_GRACE_S)
    if meter is not None:
        await meter.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ext_authz``."""
    args = _parse_args(argv)
    return run_service(args, log, lambda start: serve(start, args.poll_interval))


if __name__ == "__main__":
    sys.exit(main())
