"""``python -m ext_authz --config PATH [--listen HOST:PORT] [--metrics-listen HOST:PORT]``: serve Envoy's
ext_authz HTTP service (``ext_proc.protocol: ext_authz``).

Serves HTTP/1.1 on ``ext_proc.listen`` (``--listen`` overrides it, e.g. one port per process of
``ext_proc.extra_listen``) and Prometheus metrics on ``http://ext_proc.metrics_listen/metrics`` (the metric
names of ext_proc, :mod:`ext_proc.metrics`; ``inferlb_ext_proc_processing_seconds{phase="check"}`` times a
check). Quota state lives where ``ext_proc.quota_backend`` says. It logs ``ext_authz ready on HOST:PORT``
once it accepts connections and reloads the config file as ext_proc does
(:func:`ext_proc.process.watch_config`: by content hash, two stable polls, the same checks as xds_server,
the last good config kept on a bad file). The event loop is uvloop's when installed (``--event-loop``).
SIGINT/SIGTERM stop it cleanly (:meth:`ext_authz.server.CheckServer.close`). Exit status: 0 after a clean
stop, 1 when the config, the listen address or the event loop is unusable at start-up, or the config's
``ext_proc.protocol`` is not ``ext_authz``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ext_authz.check import CheckService
from ext_authz.server import CheckServer
from ext_proc.process import (
    StartUp,
    open_state,
    release,
    run_service,
    serve_metrics,
    service_arguments,
    until_stopped,
)
from inferlb.config.schema import HostPort

log = logging.getLogger("ext_authz")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = service_arguments("python -m ext_authz", "inferlb Envoy ext_authz HTTP service", "ext_proc.listen")
    return p.parse_args(argv)


async def serve(start: StartUp, poll_interval_s: float) -> int:
    """Run the service until SIGINT/SIGTERM; returns the exit status."""
    config, poller, listen = start.config, start.poller, start.listen
    if config.ext_proc.protocol != "ext_authz":
        log.error("cannot start: ext_proc.protocol is %s, not ext_authz", config.ext_proc.protocol)
        return 1
    if not isinstance(listen, HostPort):  # refused by the config schema; --listen is always TCP
        log.error("cannot start: ext_authz serves TCP only")
        return 1
    state = await open_state(config, poller, log)
    if state is None:
        return 1
    quotas = state.quotas
    server = CheckServer(CheckService(state))
    metrics_server = await serve_metrics(state, start.metrics_listen or config.ext_proc.metrics_listen, log)
    if metrics_server is None:
        return 1
    await quotas.start()
    try:
        port = await server.start(listen.host, listen.port)
    except OSError as exc:
        log.error("cannot listen on %s: %s", listen, exc)
        await release(state, metrics_server)
        return 1
    log.info("ext_authz ready on %s", HostPort(host=listen.host, port=port))

    try:
        await until_stopped(poller, state, str(listen), poll_interval_s, log)
    finally:
        await server.close()
        await release(state, metrics_server)
    log.info("ext_authz stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ext_authz``."""
    args = _parse_args(argv)
    return run_service(args, log, lambda start: serve(start, args.poll_interval))


if __name__ == "__main__":
    sys.exit(main())
