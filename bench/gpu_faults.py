"""What clients see when a GPU fails, a GPU hangs, or the xDS server restarts: the local stack under a
bounded closed-loop load, one scenario after the other.

Run: ``.venv/bin/python bench/gpu_faults.py [--scenario-s 25] [--fault-s F] [--clients 16] [--old-defaults]
[--json PATH]`` (about ``3 x scenario-s`` plus start-up). Prints one table; not a test. Loopback only.
``--json`` also writes the table's figures, the configured bound of a non-streamed request and the resync
time to ``PATH`` (what ``bench/faults.py`` reads).

Set-up: ``inferlb.ops.stack.Stack`` on the default config (8 simulated GPUs: llama v1 on 4, its canary v2 on
1, qwen on 3) moved to free ports, the simulated GPUs sped up (a 64-token answer takes ~10-40 ms) so a
scenario serves thousands of requests. ``--clients`` clients, half of them streaming (``"stream": true``),
alternate between the two models, each sending its next request when the previous one ended (at most
``--max-requests`` per scenario, each bounded by ``--client-timeout-s``).

Scenarios (``T`` = ``--scenario-s``, ``F`` = ``--fault-s``, 0.4 T unless given):

- ``fail``: ``a100-1`` (llama v1) answers 503 to ``/health`` and to every request from 0.2 T to 0.2 T + F
  (``inferlb sim fail``), then recovers;
- ``hang``: ``v100-1`` (qwen) accepts and reads requests but answers nothing, ``/health`` included, from
  0.2 T to 0.2 T + F (``hang``), then recovers (and answers what it held);
- ``xds restart``: the xDS server is stopped at 0.2 T and started again at 0.5 T; Envoy serves its last
  config meanwhile. ``resync`` is the time from the new server listening to it listing this Envoy as having
  ACKed every type (``GET /v1/clients``).

The hung GPU's requests are released by the per-try bounds, whose production defaults (5 min for a
non-streamed answer, 60 s of silence for a stream) never trip in a scenario this short: this bench sets
them to ``--per-try-timeout-ms`` and ``--stream-idle-timeout-ms`` (shown in the title) unless
``--config-timeouts``. ``--old-defaults`` runs the config as the gateway was before these defaults: no
active health check, 503s not retried, Envoy's 1 s ``update_merge_window``, a 300 s route timeout and no
per-try bound, Envoy's reconnect backoff (1 s to 10 s).

Columns per scenario and kind (non-streamed / streamed): requests, 200s, errors by status (``cut``: a 200
stream that ended early or without ``[DONE]``; exception names for other transport failures), max and p99
latency (s), Envoy's retries during the scenario (``upstream_rq_retry`` over the model clusters), and when
the bad GPU was out of balancing (health check or outlier detection, admin ``/clusters``) or Envoy had
resynced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import Config, default_config_path
from inferlb.ops.stack import Stack, admin_get, clusters_json, free_ports, synced_nodes

sys.path.insert(0, str(Path(__file__).parents[1]))

TOKEN = "bench-gpu-faults-token-0001"
KEY = "sk-demo-a"
NODE = "inferlb-gateway-0"
MODELS = ("llama3", "qwen")
MAX_TOKENS = 64


def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    """The default config on free loopback ports with fast simulated GPUs and the bench's timeouts."""
    doc: dict[str, Any] = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    ports = free_ports(6 + len(doc["endpoints"]))
    doc["gateway"].update(listen=f"127.0.0.1:{ports[0]}", admin=f"127.0.0.1:{ports[1]}")
    doc["xds"].update(listen=f"127.0.0.1:{ports[2]}", api_listen=f"127.0.0.1:{ports[4]}", api_token=TOKEN)
    doc["ext_proc"].update(listen=f"127.0.0.1:{ports[3]}", metrics_listen=f"127.0.0.1:{ports[5]}")
    for ep, port in zip(doc["endpoints"], ports[6:], strict=True):
        ep["address"] = f"127.0.0.1:{port}"
    doc["simulation"].update(
        prefill_tokens_per_s=2_000_000, decode_tokens_per_s=5_000, max_batch=64, max_queue=4096
    )
    if not args.config_timeouts:
        doc["gateway"].update(
            per_try_timeout_ms=args.per_try_timeout_ms, stream_idle_timeout_ms=args.stream_idle_timeout_ms
        )
    if args.old_defaults:
        doc["gateway"].update(
            request_timeout_ms=300_000, per_try_timeout_ms=0, stream_idle_timeout_ms=0, retry_status_codes=[]
        )
        doc["xds"].update(reconnect_base_ms=1_000, reconnect_max_ms=10_000)
        for m in doc["models"]:
            m.setdefault("cluster", {}).update(health_check=None, update_merge_window_ms=1_000)
    return doc


@dataclass
class Outcome:
    """One request: stream or not, status (or ``cut`` / an exception name), start (monotonic s), seconds."""

    stream: bool
    status: int | str
    started: float
    seconds: float


@dataclass
class Run:
    """A scenario's requests and the events measured during it."""

    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    retries: int = 0
    notes: list[str] = field(default_factory=list)
    #: Seconds from the restarted xDS server listening to Envoy having ACKed every type (restart only).
    resync_s: float | None = None

    def summary(self) -> dict[str, Any]:
        """The scenario's figures per kind (``non_streamed``, ``streamed``): requests, 200s, errors by
        status, max and p99 latency (s); and its retries, notes and resync time."""
        out: dict[str, Any] = {"name": self.name, "retries": self.retries, "notes": self.notes,
                               "resync_s": self.resync_s}  # fmt: skip
        for stream in (False, True):
            rows = [o for o in self.outcomes if o.stream is stream]
            lat = sorted(o.seconds for o in rows)
            out["streamed" if stream else "non_streamed"] = {
                "requests": len(rows),
                "ok": sum(1 for o in rows if o.status == 200),
                "errors": dict(Counter(str(o.status) for o in rows if o.status != 200)),
                "max_s": lat[-1] if lat else None,
                "p99_s": lat[int(0.99 * (len(lat) - 1))] if lat else None,
            }
        return out


async def load(gateway: str, run: Run, *, clients: int, until: float, args: argparse.Namespace) -> None:
    """The closed loop: ``clients`` clients (the odd ones streaming) until ``until`` (monotonic)."""
    url = f"http://{gateway}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=args.client_timeout_s)

    async def client(http: aiohttp.ClientSession, i: int) -> None:
        stream = i % 2 == 1
        n = 0
        while time.monotonic() < until and len(run.outcomes) < args.max_requests:
            body = {
                "model": MODELS[(i + n) % len(MODELS)],
                "messages": [{"role": "user", "content": f"client {i} request {n}"}],
                "max_tokens": MAX_TOKENS,
                "stream": stream,
            }
            n += 1
            t0 = time.monotonic()
            status: int | str
            try:
                async with http.post(
                    url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout
                ) as r:
                    data = await r.read()
                    status = r.status
                    if status == 200 and stream and b"[DONE]" not in data:
                        status = "cut"
            except aiohttp.ClientPayloadError:
                status = "cut"  # the body ended early: a stream the server stopped, cut by Envoy
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = type(exc).__name__
            run.outcomes.append(Outcome(stream, status, t0, time.monotonic() - t0))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(client(http, i) for i in range(clients)))


def model_retries(config: Config) -> int:
    """Envoy's ``upstream_rq_retry`` summed over the model clusters."""
    stats = json.loads(admin_get(config, "/stats?format=json&filter=upstream_rq_retry$"))
    return sum(int(s.get("value", 0)) for s in stats.get("stats", []) if "--" in s.get("name", ""))


def out_of_balancing(config: Config, address: str) -> bool:
    """Envoy holds the host ``address`` as failing its health check or outlier-ejected."""
    for c in clusters_json(config).get("cluster_statuses", []):
        for h in c.get("host_statuses", []):
            sa = h["address"]["socket_address"]
            if f"{sa['address']}:{sa['port_value']}" == address:
                health = h.get("health_status", {})
                return bool(health.get("failed_active_health_check") or health.get("failed_outlier_check"))
    return False


def fault(config: Config, name: str, action: str) -> None:
    """``POST /sim/fault`` to the simulated GPU ``name``."""
    import urllib.request  # noqa: PLC0415

    address = next(e.address for e in config.endpoints if e.display_name == name)
    req = urllib.request.Request(
        f"http://{address}/sim/fault",
        data=json.dumps({"action": action}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(req, timeout=5).read()


async def watch_out(config: Config, name: str, since: float, until: float) -> str:
    """How long after ``since`` Envoy took GPU ``name`` out of balancing (polled every 50 ms)."""
    address = str(next(e.address for e in config.endpoints if e.display_name == name))
    while time.monotonic() < until:
        if await asyncio.to_thread(out_of_balancing, config, address):
            return f"{name} out after {time.monotonic() - since:.1f} s"
        await asyncio.sleep(0.05)
    return f"{name} never out"


async def gpu_fault(stack: Stack, name: str, action: str, args: argparse.Namespace) -> Run:
    """A scenario: GPU ``name`` in fault ``action`` from 0.2 T to 0.2 T + F, under load throughout."""
    t = args.scenario_s
    ends = 0.2 * t + fault_s(args)
    run = Run(f"{action} {name} for {ends - 0.2 * t:g} s")
    start = time.monotonic()
    retries = model_retries(stack.config)
    loop = asyncio.create_task(load(str(stack.config.gateway.listen), run, clients=args.clients,
                                    until=start + t, args=args))  # fmt: skip
    await asyncio.sleep(0.2 * t)
    await asyncio.to_thread(fault, stack.config, name, action)
    run.notes.append(await watch_out(stack.config, name, time.monotonic(), start + ends))
    await asyncio.sleep(max(0.0, start + ends - time.monotonic()))
    await asyncio.to_thread(fault, stack.config, name, "recover")
    await loop
    run.retries = model_retries(stack.config) - retries
    return run


async def xds_restart(stack: Stack, args: argparse.Namespace) -> Run:
    """A scenario: the xDS server down from 0.2 T to 0.5 T, under load throughout; Envoy's resync time."""
    run = Run("xds restart")
    t = args.scenario_s
    start = time.monotonic()
    retries = model_retries(stack.config)
    loop = asyncio.create_task(load(str(stack.config.gateway.listen), run, clients=args.clients,
                                    until=start + t, args=args))  # fmt: skip
    await asyncio.sleep(0.2 * t)
    listening = await asyncio.to_thread(stack.restart, "xds_server", down_s=0.3 * t)
    while time.monotonic() < start + t + 30:
        try:
            synced = NODE in await asyncio.to_thread(synced_nodes, stack.config, TOKEN, 0.5)
        except OSError:
            synced = False
        if synced:
            run.resync_s = time.monotonic() - listening
            run.notes.append(f"resync {run.resync_s:.2f} s after the restart")
            break
        await asyncio.sleep(0.02)
    else:
        run.notes.append("no resync within the scenario + 30 s")
    await loop
    run.retries = model_retries(stack.config) - retries
    return run


def fault_s(args: argparse.Namespace) -> float:
    """How long a GPU fault lasts (s): ``--fault-s``, or 0.4 of the scenario."""
    return float(args.fault_s) if args.fault_s is not None else 0.4 * args.scenario_s


def held_bound_s(config: Config) -> float:
    """The longest the gateway's settings let a non-streamed request be held (s): the route timeout if
    set, else every attempt at its per-try timeout (``(num_retries + 1) x per_try_timeout_ms``); inf when
    neither bounds it."""
    gw = config.gateway
    if gw.request_timeout_ms:
        return gw.request_timeout_ms / 1000
    if gw.per_try_timeout_ms:
        return (gw.num_retries + 1) * gw.per_try_timeout_ms / 1000
    return float("inf")


def table(runs: list[Run], title: str) -> Table:
    """One row per scenario and kind of request."""
    t = Table(title=title)
    for col in ("scenario", "kind", "requests", "200", "errors by status", "max s", "p99 s", "retries",
                "measured"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("scenario", "kind", "errors by status", "measured")
                     else "right")  # fmt: skip
    for run in runs:
        figures = run.summary()
        for i, kind in enumerate(("non_streamed", "streamed")):
            f = figures[kind]
            t.add_row(
                run.name if i == 0 else "",
                kind.replace("_", "-"),
                str(f["requests"]),
                str(f["ok"]),
                ", ".join(f"{k}: {v}" for k, v in sorted(f["errors"].items())) or "-",
                "-" if f["max_s"] is None else f"{f['max_s']:.2f}",
                "-" if f["p99_s"] is None else f"{f['p99_s']:.2f}",
                str(run.retries) if i == 0 else "",
                "; ".join(run.notes) if i == 0 else "",
            )
    return t


async def main_async(args: argparse.Namespace) -> None:
    out = Console(width=170)
    with tempfile.TemporaryDirectory(prefix="gpu-faults-") as tmp:
        path = Path(tmp) / "inferlb.yaml"
        path.write_text(yaml.safe_dump(bench_config(args), sort_keys=False), encoding="utf-8")
        stack = Stack(path, workdir=tmp, log_level="warning")
        stack.start(timeout_s=90)
        try:
            await asyncio.sleep(2.0)  # first health checks passed everywhere
            runs = [
                await gpu_fault(stack, "a100-1", "fail", args),
                await gpu_fault(stack, "v100-1", "hang", args),
                await xds_restart(stack, args),
            ]
        finally:
            stack.stop()
    gw = stack.config.gateway
    timeouts = (
        f"per-try {gw.per_try_timeout_ms} ms, stream idle {gw.stream_idle_timeout_ms} ms, "
        f"route {gw.request_timeout_ms or 'none'}"
    )
    mode = "old defaults" if args.old_defaults else "defaults"
    out.print(
        table(runs, f"GPU faults, {args.clients} clients, {args.scenario_s:g} s each ({mode}; {timeouts})")
    )
    if args.json:
        summary = {"clients": args.clients, "scenario_s": args.scenario_s, "fault_s": fault_s(args),
                   "old_defaults": args.old_defaults, "held_bound_s": held_bound_s(stack.config),
                   "scenarios": [r.summary() for r in runs]}  # fmt: skip
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(summary, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario-s", type=float, default=25.0, help="length of each scenario (s)")
    p.add_argument("--fault-s", type=float, help="how long a GPU fault lasts (s; default 0.4 x scenario)")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients (half of them streaming)")
    p.add_argument("--max-requests", type=int, default=100_000, help="bound on the requests of a scenario")
    p.add_argument("--client-timeout-s", type=float, default=60.0, help="bound on one request (s)")
    p.add_argument("--per-try-timeout-ms", type=int, default=4_000)
    p.add_argument("--stream-idle-timeout-ms", type=int, default=2_000)
    p.add_argument("--config-timeouts", action="store_true", help="keep the config's per-try bounds")
    p.add_argument("--old-defaults", action="store_true", help="the gateway's defaults before this bench")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = p.parse_args()
    if not 5 <= args.scenario_s <= 300 or not 1 <= args.clients <= 256:
        p.error("--scenario-s must be in [5, 300] and --clients in [1, 256]")
    if not 0 < fault_s(args) <= 0.7 * args.scenario_s:
        p.error("--fault-s must be in (0, 0.7 x --scenario-s]: the GPU recovers within the scenario")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
