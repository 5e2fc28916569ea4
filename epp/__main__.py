"""``python -m epp (--endpoint IP:PORT ... | --config PATH [--model NAME]) [options]``: serve the Gateway API
Inference Extension's endpoint-picker protocol (ext_proc) over one pool of model servers.

The pool is the ``--endpoint`` addresses (repeatable, or comma-separated; weight 1 each), or the endpoints
of one model of an inferlb config file (``--model``, needed when the file has several models), each
weighted by its GPU profile's ``relative_capacity`` (and, for the picker's prefill term, by its
``prefill_relative_capacity`` where the profile gives one). Every address must be an IP literal with a
port: the gateway's ORIGINAL_DST cluster connects to it as written.

Serves ext_proc and the gRPC health services on ``--listen`` (``127.0.0.1:9002``; port 0 picks a free
one), Prometheus metrics on ``http://--metrics-listen/metrics`` (``127.0.0.1:9090``), scrapes every
endpoint's ``/metrics`` each ``--scrape-interval`` seconds. Logs ``epp ready on HOST:PORT`` once it accepts
streams and ``epp metrics on HOST:PORT``; readiness turns SERVING once each endpoint was scraped once.
``--max-queued N`` (> 0) lets a request wait when every eligible endpoint is saturated, at most
``--max-wait`` seconds, in a fair queue (:mod:`epp.flow`: ``--objective NAME=PRIORITY`` maps
``x-gateway-inference-objective`` to a priority). SIGINT/SIGTERM stop it (health NOT_SERVING, in-flight
streams get :data:`SHUTDOWN_GRACE_S`).

Cache-aware picking: ``--prefix-index approximate`` learns where each prompt's blocks are cached from the
EPP's own picks; ``--prefix-index precise`` reads them from each endpoint's vLLM KV events (ZMQ PUB,
``--kv-events IP:PORT=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]`` per endpoint, or the config's endpoints'
``kv_events``); ``--block-size`` is the servers' ``--block-size``. With ``--config`` both default to the
model's ``endpoint_picking`` (``mode`` when ``approximate`` or ``precise``, else ``off``). The subscribers'
counters are ``inferlb_kv_events_*_total{endpoint}`` on ``/metrics``. Exit status: 0 after a clean stop, 2
for a bad command line or pool (the field named), 1 when an address cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import msgspec
import uvloop  # the event loop, as ext_proc's (~7% fewer instructions per request there)
import zmq
from prometheus_client import start_http_server
from pydantic import ValidationError

from epp.flow import DEFAULT_MAX_TOKENS, DEFAULT_MAX_WAIT_S, QueueSettings, parse_objective
from epp.metrics import EppMetrics
from epp.picking import DEFAULT_EPP_WEIGHTS, PREFIX_MODES, EndpointPicker, PrefixMode, prefix_index
from epp.pool import (
    DEFAULT_SCRAPE_INTERVAL_S,
    Pool,
    PoolEndpoint,
    PoolError,
    Saturation,
    Scraper,
    parse_address,
)
from epp.server import add_to_server, make_server
from inferlb.adapters.kv_events import KvEventsCollector, KvEventSubscriber
from inferlb.config.schema import KvEventsSource, ModelConfig, load_config
from inferlb.errors import ConfigError
from inferlb.policy.capacity import WEIGHT_SCALE, capacity_weight, prefill_ratio
from inferlb.policy.kv_index import PreciseKvIndex
from inferlb.policy.picker import PickerWeights
from inferlb.request.blocks import DEFAULT_BLOCK_SIZE
from inferlb.request.tokens import default_counter

log = logging.getLogger("epp")

#: Seconds in-flight streams get to finish on shutdown.
SHUTDOWN_GRACE_S: Final = 2.0
#: Default request body limit (bytes): the gateway's default ``max_request_body_bytes``.
DEFAULT_MAX_BODY_BYTES: Final = 4 * 1024 * 1024


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epp", description="inferlb as a GIE endpoint picker (EPP)")
    pool = p.add_argument_group("the pool (one of)")
    pool.add_argument(
        "--endpoint", action="append", default=[], help="IP:PORT of a model server (repeatable)"
    )
    pool.add_argument("--config", type=Path, help="inferlb config file: the endpoints of --model")
    pool.add_argument("--model", help="the model whose endpoints form the pool (with --config)")
    p.add_argument("--listen", default="127.0.0.1:9002", help="HOST:PORT for ext_proc and health (gRPC)")
    p.add_argument("--metrics-listen", default="127.0.0.1:9090", help="HOST:PORT for Prometheus /metrics")
    p.add_argument("--scrape-interval", type=float, default=DEFAULT_SCRAPE_INTERVAL_S, help="seconds")
    p.add_argument(
        "--stale-after", type=float, help="seconds without a good scrape before an endpoint is unhealthy "
        "(default: 3 scrape intervals)"
    )  # fmt: skip
    p.add_argument(
        "--queue-depth", type=float, default=5.0, help="waiting requests that saturate an endpoint"
    )
    p.add_argument("--kv-usage", type=float, default=0.8, help="KV-cache usage (0..1] that saturates one")
    p.add_argument(
        "--max-hosts",
        type=int,
        default=DEFAULT_EPP_WEIGHTS.max_hosts,
        help="endpoints per pick (ORIGINAL_DST takes exactly one)",
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies: 413")
    px = p.add_argument_group("prefix cache (cache-aware picking)")
    px.add_argument(
        "--prefix-index",
        choices=PREFIX_MODES,
        help="off: load only; approximate: learnt from the EPP's picks; precise: from vLLM KV events "
        "(default: the config model's endpoint_picking.mode, else off)",
    )
    px.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per KV-cache block, the servers' --block-size (default: the config model's, else "
        f"{DEFAULT_BLOCK_SIZE})",
    )
    px.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="IP:PORT=ZMQ[,REPLAY]",
        help="where the pool endpoint IP:PORT publishes its KV events (vLLM's --kv-events-config endpoint, "
        "as reached from here, and its optional replay_endpoint; repeatable; precise only)",
    )
    fq = p.add_argument_group("fair queue (when every eligible endpoint is saturated)")
    fq.add_argument(
        "--max-queued", type=int, default=0, help="requests waiting at most (0: none wait, 429 at once)"
    )
    fq.add_argument(
        "--max-wait",
        type=float,
        default=DEFAULT_MAX_WAIT_S,
        help="seconds a request may wait (keep it below the gateway's ext_proc message_timeout)",
    )
    fq.add_argument(
        "--objective",
        action="append",
        default=[],
        metavar="NAME=PRIORITY",
        help="an InferenceObjective's priority for x-gateway-inference-objective (repeatable)",
    )
    fq.add_argument(
        "--default-max-tokens",
        type=int,
        help=f"completion budget of a request without a cap (default: the config's model, else "
        f"{DEFAULT_MAX_TOKENS})",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def pool_endpoints(args: argparse.Namespace) -> list[PoolEndpoint]:
    """The pool the command line names.

    Raises:
        PoolError: neither or both of ``--endpoint`` and ``--config``, an unknown or missing ``--model``,
            a model without endpoints, or an address that is not ``ip:port`` (the field named).
        ConfigError: the config file is unreadable or invalid.
    """
    if bool(args.endpoint) == (args.config is not None):
        raise PoolError("--endpoint/--config", "give the pool as --endpoint IP:PORT ... or --config PATH")
    if args.endpoint:
        texts = [part for arg in args.endpoint for part in arg.split(",") if part.strip()]
        return [PoolEndpoint(address=parse_address(t, field="--endpoint")) for t in texts]
    config = load_config(args.config)
    names = [m.name for m in config.models]
    model = args.model
    if model is None:
        if len(names) != 1:
            raise PoolError("--model", f"the config has models {names}; name the pool's")
        model = names[0]
    elif model not in names:
        raise PoolError("--model", f"{model!r} is not a model of the config (models: {names})")
    out = [
        PoolEndpoint(
            address=parse_address(str(e.address), field=f"endpoints[{i}].address"),
            weight=(w := capacity_weight(config, e) / WEIGHT_SCALE),
            prefill_weight=w * prefill_ratio(config, e),
        )
        for i, e in enumerate(config.endpoints)
        if e.model == model
    ]
    if not out:
        raise PoolError("--model", f"model {model!r} has no endpoints in the config")
    return out


def queue_settings(args: argparse.Namespace) -> QueueSettings:
    """The fair queue the command line asks for.

    Raises:
        ValueError: a flag out of range or an ``--objective`` that is not ``NAME=PRIORITY`` (named).
        ConfigError: the config file is unreadable or invalid.
    """
    budget = args.default_max_tokens
    if budget is None and args.config is not None:
        config = load_config(args.config)
        budget = next(
            (m.default_max_tokens for m in config.models if args.model in (None, m.name)), DEFAULT_MAX_TOKENS
        )
    return QueueSettings(
        max_queued=args.max_queued,
        max_wait_s=args.max_wait,
        objectives=dict(parse_objective(text) for text in args.objective),
        default_max_tokens=budget if budget is not None else DEFAULT_MAX_TOKENS,
    )


def _config_model(args: argparse.Namespace) -> ModelConfig | None:
    """The ``--config`` file's pool model (None without ``--config``; :func:`pool_endpoints` has checked
    ``--model``)."""
    if args.config is None:
        return None
    config = load_config(args.config)
    return next((m for m in config.models if args.model in (None, m.name)), None)


class PrefixSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The EPP's prefix index as the command line asks for it.

    Attributes:
        mode: ``off``, ``approximate`` or ``precise``.
        block_size: tokens per block (>= 1).
        kv_events: pool address -> where it publishes its KV events (``precise`` only).
    """

    mode: PrefixMode
    block_size: int
    kv_events: Mapping[str, KvEventsSource]


def prefix_settings(args: argparse.Namespace, endpoints: Sequence[PoolEndpoint]) -> PrefixSettings:
    """The prefix index of the command line: ``--prefix-index``, ``--block-size`` and ``--kv-events``, each
    defaulting to the ``--config`` model's ``endpoint_picking`` and its endpoints' ``kv_events``.

    Raises:
        PoolError: ``--block-size`` below 1; a ``--kv-events`` value that is not ``IP:PORT=ZMQ[,REPLAY]``,
            names no pool endpoint, names one twice, or is given without ``precise``; ``precise`` with no
            endpoint's KV events (the flag named).
        ConfigError: the config file is unreadable or invalid.
    """
    model = _config_model(args)
    picking = model.endpoint_picking if model is not None else None
    mode: PrefixMode = args.prefix_index or (
        picking.mode if picking is not None and picking.mode in ("approximate", "precise") else "off"
    )
    block_size = args.block_size or (picking.block_size if picking is not None else DEFAULT_BLOCK_SIZE)
    if args.block_size is not None and args.block_size < 1:
        raise PoolError("--block-size", f"must be >= 1, got {args.block_size}")
    pool = {e.address for e in endpoints}
    sources: dict[str, KvEventsSource] = {}
    if args.config is not None and mode == "precise":
        for i, e in enumerate(load_config(args.config).endpoints):
            if e.kv_events is None:
                continue
            address = parse_address(str(e.address), field=f"endpoints[{i}].address")
            if address in pool:
                sources[address] = e.kv_events
    given: set[str] = set()
    for text in args.kv_events:
        named, eq, rest = text.partition("=")
        if not eq or not rest.strip():
            raise PoolError("--kv-events", f"{text!r} is not IP:PORT=ZMQ[,REPLAY]")
        address = parse_address(named, field="--kv-events")
        if address not in pool:
            raise PoolError("--kv-events", f"{address!r} is not an endpoint of the pool ({sorted(pool)})")
        if address in given:
            raise PoolError("--kv-events", f"{address} is given twice")
        given.add(address)
        endpoint, _, replay = (part.strip() for part in rest.partition(","))
        try:
            sources[address] = KvEventsSource(endpoint=endpoint, replay_endpoint=replay or None)
        except ValidationError as exc:
            raise PoolError("--kv-events", f"{text!r}: {exc.errors()[0]['msg']}") from None
    if args.kv_events and mode != "precise":
        raise PoolError("--kv-events", f"KV events feed --prefix-index precise only (it is {mode})")
    if mode == "precise" and not sources:
        raise PoolError(
            "--kv-events", "--prefix-index precise needs the KV events of at least one pool endpoint"
        )
    return PrefixSettings(mode=mode, block_size=block_size, kv_events=sources)


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise PoolError(flag, f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def kv_event_subscribers(settings: PrefixSettings, index: PreciseKvIndex) -> list[KvEventSubscriber]:
    """One subscriber per endpoint of ``settings.kv_events``, feeding ``index`` (not opened yet)."""
    return [
        KvEventSubscriber(
            address=address,
            endpoint=source.endpoint,
            index=index,
            replay_endpoint=source.replay_endpoint,
            topic=source.topic,
        )
        for address, source in settings.kv_events.items()
    ]


async def _subscribe(sub: KvEventSubscriber) -> None:
    try:
        await sub.run()
    except asyncio.CancelledError:
        raise
    except Exception:  # a socket error ends it; the picks go on without that endpoint's entries
        log.exception("kv events of %s: subscriber stopped; entries dropped", sub.address)
        sub.index.clear(sub.address)


async def serve(
    args: argparse.Namespace,
    endpoints: list[PoolEndpoint],
    queue: QueueSettings | None = None,
    prefix: PrefixSettings | None = None,
) -> int:
    """Run the EPP until SIGINT/SIGTERM; returns the exit status."""
    interval = args.scrape_interval
    prefix = prefix if prefix is not None else PrefixSettings(mode="off", block_size=16, kv_events={})
    pool = Pool(endpoints, stale_after_s=args.stale_after if args.stale_after else 3 * interval)
    metrics = EppMetrics(pool.addresses, pool.in_flight)
    index = prefix_index(prefix.mode, block_size=prefix.block_size)
    picker = EndpointPicker(
        pool,
        metrics,
        weights=PickerWeights(max_hosts=args.max_hosts),
        saturation=Saturation(queue_depth=args.queue_depth, kv_usage=args.kv_usage),
        index=index,
        block_size=prefix.block_size,
        queue=queue,
    )
    subscribers = kv_event_subscribers(prefix, index) if isinstance(index, PreciseKvIndex) else []
    metrics.registry.register(KvEventsCollector(subscribers))
    if picker.flow is not None:
        default_counter().count("load the tokenizer before the first request waits")
    scraper = Scraper(
        pool,
        interval_s=interval,
        on_error=lambda a: metrics.scrape_errors.labels(a).inc(),
        on_round=picker.dispatch,
    )
    host, port = _host_port(args.listen, "--listen")
    mhost, mport = _host_port(args.metrics_listen, "--metrics-listen")
    server = make_server()
    _, checks = add_to_server(server, picker, max_body_bytes=args.max_body_bytes)
    try:
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        for sub in subscribers:
            sub.open()
        metrics_server, metrics_thread = start_http_server(mport, addr=mhost, registry=metrics.registry)
    except (RuntimeError, OSError, zmq.ZMQError) as exc:
        log.error("cannot listen: %s", exc)
        for sub in subscribers:
            sub.close()
        return 1
    tasks = [asyncio.create_task(_subscribe(sub), name=f"kv-events {sub.address}") for sub in subscribers]
    for sub in subscribers:
        log.info("kv events of %s: subscribed to %s", sub.address, sub.endpoint)
    assert isinstance(metrics_thread, threading.Thread)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await checks.alive()
    await server.start()
    log.info("epp ready on %s:%d (%d endpoints)", host, bound, len(endpoints))
    log.info("epp metrics on %s:%d", mhost, metrics_server.server_address[1])
    try:
        await scraper.scrape_once()
        await checks.ready()
        scraper.start()
        await stop.wait()
    finally:
        await checks.shutting_down()
        await server.stop(SHUTDOWN_GRACE_S)
        await scraper.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sub in subscribers:
            sub.close()
        metrics_server.shutdown()
        metrics_server.server_close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
    log.info("epp stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m epp``."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        endpoints = pool_endpoints(args)
        queue = queue_settings(args)
        prefix = prefix_settings(args, endpoints)
        PickerWeights(max_hosts=args.max_hosts)
        Saturation(queue_depth=args.queue_depth, kv_usage=args.kv_usage)
        if args.scrape_interval <= 0:
            raise PoolError("--scrape-interval", "must be > 0")
        _host_port(args.listen, "--listen")
        _host_port(args.metrics_listen, "--metrics-listen")
    except (PoolError, ConfigError) as err:
        log.error("cannot start: %s", err)
        return 2
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    return uvloop.run(serve(args, endpoints, queue, prefix))


if __name__ == "__main__":
    sys.exit(main())
