"""The ``inferlb`` command line: ``up``, ``status``, ``replay``, ``validate``, ``bootstrap``, ``sim``,
``agent``, ``xds clients``.

Every verb that takes a config defaults to the embedded one (``inferlb/data/local.yaml``, also at
``examples/local.yaml``). Exit codes: 0 success, 1 a run-time failure, 2 bad input (config, trace, usage).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import math
import os
import signal
import sys
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from inferlb.config.checks import check_config_sync
from inferlb.config.schema import Config, checked_api_key, default_config_path, hash_api_key, load_config
from inferlb.errors import ConfigError, InferlbError
from inferlb.ops.replay import EndpointShare, ReplaySummary
from xds_server.bootstrap import ADS_MODES, render_bootstrap_yaml

if TYPE_CHECKING:
    from inferlb.ops.agent import Agent
    from inferlb.ops.top import TopSample

EXIT_OK, EXIT_FAIL, EXIT_INPUT = 0, 1, 2


def _config_arg(p: argparse.ArgumentParser, positional: bool) -> None:
    help_ = "config file (YAML); default: the embedded local config"
    if positional:
        p.add_argument("config", nargs="?", default=None, help=help_)
    else:
        p.add_argument("--config", "-c", default=None, help=help_)


def _load(path: str | None) -> Config:
    return load_config(path or default_config_path())


def cmd_hash_key(args: argparse.Namespace, out: Console) -> int:
    """``inferlb hash-key``: read one API key (a prompt without echo on a terminal, else the first line of
    stdin; never from the command line, where ``ps`` and shell history would keep it) and print its
    lower-case hex SHA-256, the value of a tenant's ``api_key_sha256``.

    Raises:
        ValueError: the key is empty, shorter than 8 or longer than 256 characters, or holds white space.
    """
    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline()
    out.print(hash_api_key(checked_api_key("key", key.strip())).hex(), markup=False)
    return EXIT_OK


def cmd_validate(args: argparse.Namespace, out: Console) -> int:
    """``inferlb validate FILE``: check a config as xds_server and ext_proc would before serving it (the
    schema, then :func:`inferlb.config.checks.check_config`: tokenizers load, host names resolve); exit 2
    naming each bad field."""
    cfg = load_config(args.file)
    check_config_sync(cfg, args.file)
    out.print(
        f"ok: {args.file}: {len(cfg.models)} models, {len(cfg.endpoints)} endpoints "
        f"({sum(e.simulated for e in cfg.endpoints)} simulated), {len(cfg.tenants)} tenants"
    )
    return EXIT_OK


def cmd_bootstrap(args: argparse.Namespace, out: Console) -> int:
    """``inferlb bootstrap [CONFIG] [--sds-dir DIR]``: print the Envoy bootstrap (YAML) for a config; with
    ``--sds-dir``, also write Envoy's SDS files (``gateway.tls``, ``gateway.upstream_tls``) into DIR, which
    should be ``gateway.sds_dir`` as Envoy's host sees it."""
    cfg = _load(args.config)
    source = args.config or "inferlb/data/local.yaml"
    if args.sds_dir is not None:  # an Envoy on another host: its SDS files, written where it reads them
        from inferlb.ops.stack import write_sds_files  # noqa: PLC0415 - CLI-only import

        try:
            written = write_sds_files(cfg, Path(args.sds_dir))
        except OSError as exc:
            print(
                "inferlb bootstrap: cannot write Envoy's SDS files into "
                f"{args.sds_dir}: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return EXIT_FAIL
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    sys.stdout.write(render_bootstrap_yaml(cfg, source=source, node_id=args.node_id, mode=args.ads_mode))
    return EXIT_OK


def cmd_up(args: argparse.Namespace, out: Console) -> int:
    """``inferlb up [CONFIG]``: run the local stack until Ctrl-C or SIGTERM."""
    from inferlb.ops.stack import Stack, StackError, describe, sample_curl  # noqa: PLC0415 - CLI-only import

    path = Path(args.config) if args.config else default_config_path()
    stack = Stack(path, workdir=args.workdir, log_level=args.log_level)
    stopping = False
    failed = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        out.print(f"[bold]inferlb[/bold] starting the local stack from {path}")
        out.print(f"  logs in {stack.workdir}", soft_wrap=True)
        try:
            stack.start(timeout_s=args.timeout, progress=lambda m: out.print(f"  {m}"))
        except StackError as exc:
            failed = True
            out.print("[red]failed to start:[/red] " + escape(str(exc)))
            if stack.workdir.exists():
                out.print(f"logs kept in {stack.workdir}", soft_wrap=True)
            return EXIT_FAIL
        out.print("[green]ready[/green]: Envoy holds every cluster with its endpoints")
        for line in describe(stack.config):
            out.print("  " + line, soft_wrap=True)
        out.print(f"  logs     {stack.workdir}")
        # soft_wrap: a wrapped curl line would not paste back into a shell
        out.print("\ntry:\n" + sample_curl(stack.config), markup=False, highlight=False, soft_wrap=True)
        out.print("\nCtrl-C stops everything.")
        while not stopping:
            broken = stack.first_exited()
            if broken is not None:
                out.print(f"[red]{broken.name} exited[/red] (code {broken.exited()}); stopping the stack")
                out.print(broken.log_tail(), markup=False, highlight=False)
                out.print(f"logs kept in {stack.workdir}")
                failed = True
                return EXIT_FAIL
            time.sleep(0.3)
        out.print("stopping")
        return EXIT_OK
    finally:
        stack.stop(keep_workdir=failed)
        for s, h in old.items():
            signal.signal(s, h)


def cmd_status(args: argparse.Namespace, out: Console) -> int:
    """``inferlb status``: Envoy's clusters and endpoints with weight, health and request counts, then each
    endpoint's weight and the inputs behind it from the xDS server's ``GET /v1/weights`` (needs its API
    token: ``--token``, ``$INFERLB_XDS_API_TOKEN`` or ``xds.api_token``). ``--json`` prints Envoy's rows,
    ``--json --weights`` the weight rows."""
    from inferlb.ops.stack import clusters_json  # noqa: PLC0415
    from inferlb.ops.status import host_rows, status_table, weight_rows, weights_table  # noqa: PLC0415

    cfg = _load(args.config)
    try:
        data = clusters_json(cfg)
    except (OSError, urllib.error.URLError) as exc:
        out.print(
            f"[red]cannot reach Envoy admin at http://{cfg.gateway.admin}[/red]: {exc}\n"
            "Is the stack up (`inferlb up`)?"
        )
        return EXIT_FAIL
    rows = host_rows(cfg, data, only_models=not args.all)
    weights, why = _fetch_weights(cfg, args)
    if args.json:
        if args.weights:
            if weights is None:
                out.print(f"weights unavailable: {why}", markup=False)
                return EXIT_FAIL
            wrows = weight_rows(weights, host_rows(cfg, data, only_models=False))
            sys.stdout.write(json.dumps([asdict(r) for r in wrows], indent=2) + "\n")
        else:
            sys.stdout.write(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        return EXIT_OK
    if not args.weights:
        out.print(status_table(rows))
    if weights is None:
        out.print(f"weights and their inputs unavailable: {why}", markup=False)
        return EXIT_FAIL if args.weights else EXIT_OK
    wrows = weight_rows(weights, host_rows(cfg, data, only_models=False))
    out.print(weights_table(wrows, str(weights.get("mode", "?"))))
    return EXIT_OK


def cmd_top(args: argparse.Namespace, out: Console) -> int:
    """``inferlb top``: each GPU's in-flight load per unit of capacity over time, a live heat map
    (:mod:`inferlb.ops.top`), from Envoy's admin ``/clusters`` and, when the xDS API answers, the GPUs' own
    queues (``GET /v1/weights``). Exit 1 when Envoy's admin cannot be reached."""
    from inferlb.ops.stack import clusters_json  # noqa: PLC0415
    from inferlb.ops.status import host_rows, weight_rows  # noqa: PLC0415
    from inferlb.ops.top import run_top, samples_from  # noqa: PLC0415

    cfg = _load(args.config)

    def sample() -> list[TopSample]:
        hosts = host_rows(cfg, clusters_json(cfg))
        weights, _ = _fetch_weights(cfg, args)
        return samples_from(cfg, hosts, weight_rows(weights, hosts) if weights else [])

    try:
        run_top(sample, out, interval_s=args.interval, width=args.width, iterations=args.iterations)
    except (OSError, urllib.error.URLError) as exc:
        out.print(
            f"[red]cannot reach Envoy admin at http://{cfg.gateway.admin}[/red]: {exc}\n"
            "Is the stack up (`inferlb up`)?"
        )
        return EXIT_FAIL
    return EXIT_OK


def _fetch_weights(cfg: Config, args: argparse.Namespace) -> tuple[dict[str, Any] | None, str]:
    """The xDS server's ``GET /v1/weights`` body, or None and why not."""
    import urllib.request  # noqa: PLC0415 - CLI-only import

    if args.url:
        base = args.url.rstrip("/")
    elif (api := cfg.xds.api_dial_address()) is not None:
        base = f"http://{api}"
    else:
        return None, "xds.api_listen is off in this config (pass --url)"
    token = args.token or os.environ.get(XDS_API_TOKEN_ENV) or cfg.xds.api_token
    if not token:
        return None, f"no xDS API token (pass --token, set {XDS_API_TOKEN_ENV} or xds.api_token)"
    req = urllib.request.Request(base + "/v1/weights", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return None, f"xds server {base}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, f"xds server {base} unreachable: {exc}"
    if not isinstance(body, dict):
        return None, f"xds server {base}: unexpected answer"
    return body, ""


def _ms(seconds: float) -> str:
    """A duration in whole ms, or ``-`` for none (NaN: no request to measure, e.g. TTFT of a non-streamed
    replay)."""
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f} ms"


def cmd_replay(args: argparse.Namespace, out: Console) -> int:
    """``inferlb replay [TRACE]``: replay a trace through the gateway and print what the fleet did."""
    from inferlb.ops import replay as rp  # noqa: PLC0415
    from inferlb.ops.stack import clusters_json  # noqa: PLC0415
    from inferlb.ops.status import host_rows  # noqa: PLC0415
    from inferlb.traces import DEFAULT_TRACE, read_trace, window  # noqa: PLC0415

    cfg = _load(args.config)
    rows = window(
        read_trace(args.trace or DEFAULT_TRACE),
        start_s=args.start,
        duration_s=args.duration,
        speedup=args.speedup,
        limit=args.limit,
    )
    planned = rp.plan(cfg, rows, model=args.model, seed=args.seed)
    if not planned:
        out.print("[yellow]no trace rows in that window[/yellow]")
        return EXIT_INPUT
    out.print(
        f"replaying {len(planned)} requests over {planned[-1].at_s:.1f} s "
        f"(speedup {args.speedup:g}) through http://{cfg.gateway.listen}"
    )
    progress = Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=False,
        disable=not out.is_terminal and not args.progress,
    )
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task("replay", total=len(planned))
        outcomes = asyncio.run(
            rp.send_all(
                str(cfg.gateway.listen),
                planned,
                stream=not args.no_stream,
                timeout_s=args.timeout,
                on_done=lambda _o: progress.advance(task),
            )
        )
    wall = time.perf_counter() - t0
    try:
        weights = {r.name: r.weight for r in host_rows(cfg, clusters_json(cfg))}
    except (OSError, urllib.error.URLError):
        weights = {}
    summary = rp.summarize(outcomes, wall)
    shares = rp.endpoint_shares(cfg, outcomes, weights)
    print_replay(out, summary, shares)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "summary": asdict(summary),
                    "endpoints": [asdict(s) for s in shares],
                    "outcomes": [asdict(o) for o in outcomes],
                },
                indent=1,
            ),
            encoding="utf-8",
        )
        out.print(f"wrote {args.json}")
    transport_errors = summary.by_status.get(0, 0) + sum(n for s, n in summary.by_status.items() if s >= 500)
    return EXIT_FAIL if transport_errors else EXIT_OK


def print_replay(out: Console, s: ReplaySummary, shares: Sequence[EndpointShare]) -> None:
    """Print the replay tables: per endpoint, per tenant, totals."""
    t = Table(title="per endpoint (shares within each cluster)")
    for col in (
        "cluster",
        "endpoint",
        "gpu",
        "weight",
        "weight share",
        "requests",
        "req share",
        "tokens",
        "token share",
    ):
        t.add_column(col, justify="right" if col not in ("cluster", "endpoint", "gpu") else "left")
    for r in shares:
        t.add_row(
            r.cluster,
            r.endpoint,
            r.gpu,
            str(r.weight),
            f"{r.weight_share:.1%}",
            str(r.requests),
            f"{r.request_share:.1%}",
            str(r.tokens),
            f"{r.token_share:.1%}",
        )
    out.print(t)
    statuses = sorted(s.by_status)
    caption = "0 = transport error" if 0 in statuses else None
    tt = Table(title="per tenant: requests by HTTP status", caption=caption)
    tt.add_column("tenant")
    for st in statuses:
        tt.add_column(str(st), justify="right")
    for tenant, counts in s.by_tenant.items():
        tt.add_row(tenant, *(str(counts.get(st, 0)) for st in statuses))
    out.print(tt)
    tot = Table(title="totals")
    for col in (
        "sent",
        "ok",
        "errors by status",
        "latency p50",
        "latency p99",
        "TTFT p50",
        "TTFT p99",
        "wall",
    ):
        tot.add_column(col, justify="right")
    errs = ", ".join(f"{k}: {v}" for k, v in sorted(s.by_status.items()) if k != 200) or "none"
    tot.add_row(
        str(s.sent),
        str(s.ok),
        errs,
        *(_ms(v) for v in (s.latency_p50_s, s.latency_p99_s, s.ttft_p50_s, s.ttft_p99_s)),
        f"{s.wall_s:.1f} s",
    )
    out.print(tot)


#: Environment variable holding the xDS server's API bearer token (the xDS server reads the same one).
XDS_API_TOKEN_ENV = "INFERLB_XDS_API_TOKEN"
#: Short xDS type names in ``inferlb xds clients`` columns.
XDS_TYPE_COLUMNS = (
    ("Cluster", "CDS"),
    ("ClusterLoadAssignment", "EDS"),
    ("Listener", "LDS"),
    ("RouteConfiguration", "RDS"),
)


def cmd_xds(args: argparse.Namespace, out: Console) -> int:
    """``inferlb xds clients``: every Envoy connected to the xDS server, with the version it ACKed per type
    and its last NACK, from the xDS server's ``GET /v1/clients`` (``xds.api_listen``)."""
    import urllib.request  # noqa: PLC0415 - CLI-only import

    cfg = _load(args.config)
    if args.url:
        base = args.url.rstrip("/")
    elif (api := cfg.xds.api_dial_address()) is not None:
        base = f"http://{api}"
    else:
        raise ValueError("xds.api_listen is off in this config: pass --url")
    token = args.token or os.environ.get(XDS_API_TOKEN_ENV) or cfg.xds.api_token
    if not token:
        raise ValueError(f"no API token: pass --token, set {XDS_API_TOKEN_ENV} or xds.api_token")
    req = urllib.request.Request(base + "/v1/clients", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            clients = json.loads(resp.read())["clients"]
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        out.print(f"xds server {base}: HTTP {exc.code}: {detail}", markup=False)
        return EXIT_FAIL
    except (urllib.error.URLError, OSError) as exc:
        out.print(f"xds server {base} unreachable: {exc}", markup=False)
        return EXIT_FAIL
    if args.json:
        sys.stdout.write(json.dumps(clients, indent=2) + "\n")
        return EXIT_OK
    t = Table(title=f"Envoys connected to {base} ({len(clients)})")
    for col in ("node", "node cluster", "mode", "peer"):
        t.add_column(col)
    for _, short in XDS_TYPE_COLUMNS:
        t.add_column(f"{short} ACKed")
    t.add_column("last NACK")
    for c in clients:
        types = c.get("types", {})
        acked = [str(types.get(name, {}).get("acked_version") or "-") for name, _ in XDS_TYPE_COLUMNS]
        nack = c.get("last_nack")
        last = "-" if not nack else f"{nack['type']} {nack['rejected_version']}: {nack['error_message'][:80]}"
        t.add_row(
            *(
                escape(str(x))
                for x in (c.get("node_id"), c.get("node_cluster"), c.get("mode"), c.get("peer"))
            ),
            *acked,
            escape(last),
        )
    out.print(t)
    return EXIT_OK


SIM_ACTIONS = ("throttle", "slow", "fail", "hang", "mute", "unmute", "recover", "telemetry")


def cmd_sim(args: argparse.Namespace, out: Console) -> int:
    """``inferlb sim ACTION NAME [--factor X]``: tell a simulated endpoint to throttle, slow down, fail, hang
    or recover (``POST http://ADDRESS/sim/fault``), or show its simulated GPU telemetry
    (``GET /sim/telemetry``).

    NAME is an endpoint's display name in the config (its ``name``, else its address). Exit 1 when the
    endpoint cannot be reached or refuses the command, 2 for an unknown name.
    """
    import urllib.request  # noqa: PLC0415 - CLI-only import

    cfg = _load(args.config)
    by_name = {e.display_name: e for e in cfg.endpoints}
    endpoint = by_name.get(args.name) or next((e for e in cfg.endpoints if str(e.address) == args.name), None)
    if endpoint is None:
        raise ValueError(f"unknown endpoint {args.name!r}; known: {sorted(by_name)}")
    base = f"http://{endpoint.address}"
    if args.action == "telemetry":
        req = urllib.request.Request(f"{base}/sim/telemetry", method="GET")
    else:
        body = {"action": args.action, "factor": args.factor}
        req = urllib.request.Request(
            f"{base}/sim/fault",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        out.print(f"{endpoint.display_name} refused {args.action} ({exc.code}): {detail}", markup=False)
        return EXIT_FAIL
    except (OSError, urllib.error.URLError, json.JSONDecodeError) as exc:
        out.print(f"cannot reach {endpoint.display_name} at {base}: {exc}", markup=False)
        return EXIT_FAIL
    if args.json or args.action == "telemetry":
        sys.stdout.write(json.dumps(answer, indent=2) + "\n")
    else:
        out.print(
            f"{endpoint.display_name} ({endpoint.gpu}, {endpoint.address}): {answer.get('mode')}, "
            f"slowdown {answer.get('slowdown')}"
        )
    return EXIT_OK


def cmd_agent(args: argparse.Namespace, out: Console) -> int:
    """``inferlb agent``: read this node's GPUs through NVML, serve them on ``/metrics`` and POST them to
    ``{url}/v1/telemetry/gpu`` every period (see :mod:`inferlb.ops.agent`). Exit 1 with the reason when the
    node has no usable NVIDIA GPU; 0 after SIGINT/SIGTERM or ``--once``.
    """
    from inferlb.adapters import nvml as nv  # noqa: PLC0415 - CLI-only import
    from inferlb.config.schema import HostPort  # noqa: PLC0415
    from inferlb.ops import agent as ag  # noqa: PLC0415 - CLI-only import

    cfg = _load(args.config)
    interval_s = args.interval if args.interval is not None else cfg.telemetry.agent_interval_ms / 1000
    if interval_s <= 0:
        raise ValueError(f"--interval must be > 0, got {interval_s}")
    listen = None if args.no_metrics else HostPort.model_validate(args.listen)
    settings = ag.AgentSettings(
        node=args.node or ag.default_node_name(),
        url=args.url,
        token=args.token or os.environ.get("INFERLB_XDS_API_TOKEN") or cfg.xds.api_token,
        metrics_host=listen.host if listen else None,
        metrics_port=listen.port if listen else 0,
        interval_s=interval_s,
    )
    err = Console(stderr=True, highlight=False)
    try:
        nvml = nv.load_pynvml()
        count = nv.open_nvml(nvml)
    except nv.NoGpuError as exc:
        err.print(f"inferlb agent: {exc}", markup=False, soft_wrap=True)
        return EXIT_FAIL
    agent = ag.Agent(nvml, count, settings)
    if args.once:
        try:
            sys.stdout.write(json.dumps(agent.read().to_json(), indent=2) + "\n")
        finally:
            asyncio.run(agent.close())
        return EXIT_OK
    return asyncio.run(_run_agent(agent, out, err))


async def _run_agent(agent: Agent, out: Console, err: Console) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            bound = await agent.start_metrics()
        except OSError as exc:
            err.print(f"inferlb agent: cannot listen for /metrics: {exc}", markup=False)
            return EXIT_FAIL
        s = agent.settings
        out.print(
            f"inferlb agent on {s.node}: {agent.gpu_count} GPU(s), every {s.interval_s:g} s; "
            f"metrics {f'http://{bound[0]}:{bound[1]}/metrics' if bound else 'off'}; "
            f"reports {s.url + '/v1/telemetry/gpu' if s.url else 'off (no --url)'}",
            markup=False,
        )
        await agent.run(stop)
        return EXIT_OK
    finally:
        await agent.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for every verb."""
    p = argparse.ArgumentParser(
        prog="inferlb",
        description="inferlb: an Envoy control plane that load-balances LLM inference across GPU fleets.",
    )
    sub = p.add_subparsers(dest="verb", required=True)

    h = sub.add_parser("hash-key", help="print the SHA-256 of an API key from stdin (api_key_sha256)")
    h.set_defaults(fn=cmd_hash_key)

    v = sub.add_parser("validate", help="check a config file; exit 2 naming each bad field")
    v.add_argument("file")
    v.set_defaults(fn=cmd_validate)

    b = sub.add_parser("bootstrap", help="print the Envoy bootstrap for a config")
    _config_arg(b, positional=True)
    b.add_argument("--node-id", default="inferlb-gateway-0")
    b.add_argument(
        "--ads-mode",
        choices=list(ADS_MODES),
        default="sotw",
        help="sotw: ADS, state of the world; delta: Delta (incremental) ADS; xds: one gRPC stream per type "
        "(LDS, CDS, RDS, EDS), no ADS",
    )
    b.add_argument(
        "--sds-dir",
        default=None,
        help="also write Envoy's SDS files (gateway.tls, gateway.upstream_tls) into this directory: "
        "gateway.sds_dir as Envoy's host sees it",
    )
    b.set_defaults(fn=cmd_bootstrap)

    u = sub.add_parser("up", help="run the local stack (xDS, ext_authz or ext_proc, simulated GPUs, Envoy)")
    _config_arg(u, positional=True)
    u.add_argument("--workdir", default=None, help="where bootstrap and logs go (default: a temp dir)")
    u.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    u.add_argument("--timeout", type=float, default=60.0, help="start-up deadline (s)")
    u.set_defaults(fn=cmd_up)

    s = sub.add_parser("status", help="Envoy's clusters and endpoints: weight, health, requests")
    _config_arg(s, positional=False)
    s.add_argument("--all", action="store_true", help="include internal clusters (xDS, ext_proc)")
    s.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    s.add_argument("--weights", action="store_true", help="only the weights and their inputs (xDS API)")
    s.add_argument("--url", default=None, help="xDS server API base URL (default: http://<xds.api_listen>)")
    s.add_argument(
        "--token", default=None, help=f"xDS API bearer token (default: ${XDS_API_TOKEN_ENV}, xds.api_token)"
    )
    s.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout of the xDS API (s)")
    s.set_defaults(fn=cmd_status)

    t = sub.add_parser("top", help="each GPU's load over time, a live heat map (Ctrl-C ends it)")
    _config_arg(t, positional=False)
    t.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    t.add_argument("--width", type=int, default=60, help="samples shown per row (default 60)")
    t.add_argument("--iterations", type=int, default=None, help="stop after this many samples")
    t.add_argument("--url", default=None, help="xDS server API base URL (default: http://<xds.api_listen>)")
    t.add_argument(
        "--token", default=None, help=f"xDS API bearer token (default: ${XDS_API_TOKEN_ENV}, xds.api_token)"
    )
    t.add_argument("--timeout", type=float, default=2.0, help="HTTP timeout of the xDS API (s)")
    t.set_defaults(fn=cmd_top)

    r = sub.add_parser("replay", help="replay a TIMESTAMP,ContextTokens,GeneratedTokens trace")
    r.add_argument("trace", nargs="?", default=None, help="CSV trace (default: the bundled Azure 2023 trace)")
    _config_arg(r, positional=False)
    r.add_argument("--speedup", type=float, default=1.0, help="time compression (2 = twice as fast)")
    r.add_argument("--start", type=float, default=0.0, help="trace offset to start at (s)")
    r.add_argument("--duration", type=float, default=60.0, help="trace seconds to replay (default 60)")
    r.add_argument("--limit", type=int, default=None, help="at most this many requests")
    r.add_argument("--model", default=None, help="send everything to this model (default: spread)")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    r.add_argument("--no-stream", action="store_true", help="non-streamed requests (no TTFT)")
    r.add_argument("--progress", action="store_true", help="show the progress bar even when not a terminal")
    r.add_argument("--json", default=None, help="also write summary and outcomes to this JSON file")
    r.set_defaults(fn=cmd_replay)

    x = sub.add_parser("xds", help="ask the xDS server: `inferlb xds clients` lists the connected Envoys")
    x.add_argument("what", choices=["clients"])
    _config_arg(x, positional=False)
    x.add_argument("--url", default=None, help="xDS server API base URL (default: http://<xds.api_listen>)")
    x.add_argument(
        "--token", default=None, help=f"API bearer token (default: ${XDS_API_TOKEN_ENV}, xds.api_token)"
    )
    x.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout (s)")
    x.add_argument("--json", action="store_true", help="print the server's JSON")
    x.set_defaults(fn=cmd_xds)

    m = sub.add_parser(
        "sim", help="throttle, slow, fail, hang, mute, unmute or recover a simulated GPU, or show telemetry"
    )
    m.add_argument("action", choices=SIM_ACTIONS)
    m.add_argument("name", help="endpoint name (or address) in the config")
    _config_arg(m, positional=False)
    m.add_argument("--factor", type=float, default=2.0, help="slowdown factor for throttle/slow (default 2)")
    m.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout (s)")
    m.add_argument("--json", action="store_true", help="print the endpoint's JSON answer")
    m.set_defaults(fn=cmd_sim)

    a = sub.add_parser("agent", help="report this node's GPUs (NVML) to the control plane and on /metrics")
    _config_arg(a, positional=False)
    a.add_argument("--url", default=None, help="control-plane base URL; reports go to URL/v1/telemetry/gpu")
    a.add_argument("--node", default=None, help="node name in reports (default: the host name)")
    a.add_argument(
        "--token",
        default=None,
        help="bearer token of the xDS server's intake (default: $INFERLB_XDS_API_TOKEN, then xds.api_token)",
    )
    a.add_argument(
        "--listen", default="127.0.0.1:9402", help="host:port of /metrics (default 127.0.0.1:9402)"
    )
    a.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    a.add_argument("--interval", type=float, default=None, help="seconds between readings (default: config)")
    a.add_argument("--once", action="store_true", help="read once, print the JSON report, exit")
    a.set_defaults(fn=cmd_agent)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``inferlb`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    # Tables stay whole when piped to a file or a CI log (rich would otherwise assume 80 columns).
    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
    out = Console(highlight=False, width=width)
    err = Console(stderr=True, highlight=False, width=width)
    try:
        code: int = args.fn(args, out)
    except ConfigError as exc:
        err.print(str(exc), markup=False)
        return EXIT_INPUT
    except (InferlbError, ValueError) as exc:
        err.print(f"error: {exc}", markup=False)
        return EXIT_INPUT
    return code


if __name__ == "__main__":
    sys.exit(main())
