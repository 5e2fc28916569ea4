"""xDS scale benchmark: a large fleet served to many ADS clients plus one real Envoy, SotW and Delta.

Not a test: it prints a table. Per ADS mode it

1. writes a config with ``--endpoints`` endpoints (IP literals, nothing listens) in ``--clusters`` model
   clusters and starts ``python -m xds_server`` on it as a child process (so its CPU and memory are its own);
2. starts one real Envoy (bootstrap in that mode) and ``--clients`` in-process gRPC ADS clients, each
   subscribing to every cluster (CDS wildcard) and every assignment (EDS), ACKing every response;
3. measures the time until every client holds every assignment (full sync), and the same for Envoy (its
   ``membership_total`` stats add up to the fleet);
4. ``--rounds`` times, pins new weights on 1% of the endpoints (``--spread random``: anywhere, so about
   63% of the clusters change; ``--spread cluster``: one cluster's) in one fleet-API call
   (``PUT /v1/weights``) and measures, per client, the time from the call to the EDS update arriving
   (p50/p99 over all clients and rounds), and for Envoy the time until its per-cluster ``update_success``
   counters moved;
5. reads the server's CPU seconds (``/proc/PID/stat``) and peak RSS (``VmHWM``).

Usage: ``.venv/bin/python bench/xds_scale.py [--endpoints 10000] [--clusters 100] [--clients 100]``
(``--help`` for the rest). Limits: the clients share one Python process and event loop, so a client's
arrival time includes waiting for that loop (the client side is measured, not only the server); Envoy's
times come from polling its admin API every 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from inferlb.config.schema import load_config
from inferlb.ops.stack import free_ports
from xds_server.bootstrap import render_bootstrap

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
TOKEN = "bench-token-0123456789abcdef"
GPUS = ("H100", "A100", "V100")
WAIT_S = 120.0
#: Envoy's per-cluster EDS update counters.
UPDATE_SUCCESS = r"^cluster\..*\.update_success$"
#: gRPC's default maximum message size: a SotW EDS response over it would be refused by the client.
MAX_MESSAGE = 4 * 1024 * 1024


def cluster_names(clusters: int) -> list[str]:
    return [f"model-{i:03d}--v1" for i in range(clusters)]


def write_config(
    path: Path,
    *,
    endpoints: int,
    clusters: int,
    debounce_ms: int,
    ports: list[int],
    scrape_interval_ms: int = 500,
) -> None:
    """A fleet of ``endpoints`` GPUs spread evenly over ``clusters`` single-version models; the xDS server's
    telemetry loop scrapes every endpoint's ``/metrics`` each ``scrape_interval_ms`` (nothing listens)."""
    gw, admin, xds, api, ext_proc = ports
    eps = []
    for i in range(endpoints):
        eps.append(
            {
                "name": f"gpu-{i:05d}",
                "address": f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}:8000",
                "model": f"model-{i % clusters:03d}",
                "gpu": GPUS[i % len(GPUS)],
                "zone": "ab"[i % 2],
            }
        )
    doc = {
        "gateway": {"listen": f"127.0.0.1:{gw}", "admin": f"127.0.0.1:{admin}"},
        "xds": {
            "listen": f"127.0.0.1:{xds}",
            "api_listen": f"127.0.0.1:{api}",
            "push_debounce_ms": debounce_ms,
            "push_max_delay_ms": max(debounce_ms * 4, 200),
        },
        "ext_proc": {"listen": f"127.0.0.1:{ext_proc}", "failure_mode_allow": True},
        "telemetry": {"scrape_interval_ms": scrape_interval_ms},
        "models": [{"name": f"model-{i:03d}"} for i in range(clusters)],
        "endpoints": eps,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")


@dataclass
class Client:
    """One ADS stream holding the EDS versions it got; ``arrivals`` are monotonic times of EDS updates."""

    mode: str
    port: int
    names: list[str]
    index: int
    held: set[str] = field(default_factory=set)
    eds_updates: int = 0
    arrivals: list[float] = field(default_factory=list)
    synced_at: float | None = None
    error: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}", options=options) as channel:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            node = base_pb2.Node(id=f"bench-{self.mode}-{self.index}", cluster="inferlb-gateway")
            try:
                if self.mode == "sotw":
                    await self._sotw(stub, node, stop)
                else:
                    await self._delta(stub, node, stop)
            except grpc.aio.AioRpcError as exc:
                if not stop.is_set():
                    self.error = f"{exc.code().name}: {exc.details()}"

    def _got_eds(self, names: list[str]) -> None:
        now = time.monotonic()
        self.held.update(names)
        self.eds_updates += 1
        if self.synced_at is None and len(self.held) >= len(self.names):
            self.synced_at = now
        elif self.synced_at is not None:
            self.arrivals.append(now)

    async def _sotw(self, stub: Any, node: base_pb2.Node, stop: asyncio.Event) -> None:
        call = stub.StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=CDS, node=node))
        await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=self.names))
        while not stop.is_set():
            resp = await call.read()
            if resp is grpc.aio.EOF:
                return
            names = self.names if resp.type_url == EDS else []
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=resp.type_url,
                    response_nonce=resp.nonce,
                    version_info=resp.version_info,
                    resource_names=names,
                )
            )
            if resp.type_url == EDS:
                # SotW: every EDS response carries every subscribed assignment
                self._got_eds(self.names if len(resp.resources) == len(self.names) else [])
        call.cancel()

    async def _delta(self, stub: Any, node: base_pb2.Node, stop: asyncio.Event) -> None:
        call = stub.DeltaAggregatedResources()
        await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=CDS, node=node))
        await call.write(
            discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=self.names)
        )
        while not stop.is_set():
            resp = await call.read()
            if resp is grpc.aio.EOF:
                return
            await call.write(
                discovery_pb2.DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce)
            )
            if resp.type_url == EDS:
                self._got_eds([r.name for r in resp.resources])
        call.cancel()


def http(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def proc_usage(pid: int) -> tuple[float, float]:
    """``(cpu_seconds, peak_rss_mb)`` of a live process from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return cpu, hwm


async def wait_until(pred: Any, what: str, timeout_s: float = WAIT_S, step_s: float = 0.01) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await pred() if asyncio.iscoroutinefunction(pred) else pred()
        if value:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(step_s)


def envoy_stats(admin: int, pattern: str) -> dict[str, int]:
    try:
        status, body = http("GET", f"http://127.0.0.1:{admin}/stats?filter={pattern}")
    except OSError:  # Envoy's admin not up yet
        return {}
    if status != 200:
        return {}
    out = {}
    for line in body.decode().splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


NAN = float("nan")


def histogram_quantiles(text: str, mode: str) -> tuple[float, float]:
    """p50 and p99 (s, bucket upper bounds) of the server's ``inferlb_xds_push_latency_seconds{mode}``:
    from the first change of a burst to each push written, as the server sees it. Covers every push of
    the run (the initial sync included, when it was a push)."""
    buckets: list[tuple[float, float]] = []
    pattern = re.compile(
        r'^inferlb_xds_push_latency_seconds_bucket\{le="([^"]+)",mode="' + mode + r'"\} ([0-9.e+]+)$'
    )
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            buckets.append((float(m[1]), float(m[2])))
    if not buckets or buckets[-1][1] == 0:
        return NAN, NAN
    total = buckets[-1][1]

    def q(frac: float) -> float:
        return next(le for le, count in buckets if count >= frac * total)

    return q(0.5), q(0.99)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@dataclass
class Result:
    mode: str
    clients: int
    full_sync_s: float
    envoy_sync_s: float
    change_p50_ms: float
    change_p99_ms: float
    envoy_change_ms: float
    server_cpu_s: float
    server_rss_mb: float
    eds_bytes: int
    errors: int
    server_push_p50_ms: float
    server_push_p99_ms: float
    #: the distinct client errors (gRPC status and details), printed under the table
    error_kinds: list[str] = field(default_factory=list)


async def run_mode(mode: str, args: argparse.Namespace, work: Path) -> Result:
    ports = free_ports(5)
    cfg_path = work / f"fleet-{mode}.yaml"
    write_config(
        cfg_path,
        endpoints=args.endpoints,
        clusters=args.clusters,
        debounce_ms=args.debounce_ms,
        ports=ports,
        scrape_interval_ms=args.scrape_interval_ms,
    )
    config = load_config(cfg_path)
    _gw, admin, xds, api, _ = ports
    env = {**os.environ, "INFERLB_XDS_API_TOKEN": TOKEN}
    log = (work / f"xds-{mode}.log").open("wb")
    server = subprocess.Popen(  # noqa: ASYNC220 - started before any stream runs; Popen returns at once
        [sys.executable, "-m", "xds_server", "--config", str(cfg_path), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    envoy: subprocess.Popen[bytes] | None = None
    stop = asyncio.Event()
    try:
        await wait_until(lambda: _up(api), "the xDS server API")
        names = cluster_names(args.clusters)
        snapshot_eds = 0
        if args.envoy:
            boot = render_bootstrap(config, node_id=f"bench-envoy-{mode}", mode=mode)  # type: ignore[arg-type]
            boot_path = work / f"bootstrap-{mode}.yaml"
            boot_path.write_text(yaml.safe_dump(boot), encoding="utf-8")
            envoy = subprocess.Popen(  # noqa: ASYNC220 - as above
                [args.envoy_bin, "-c", str(boot_path), "--base-id", str(random.randint(10_000, 2_000_000)),
                 "--concurrency", "1", "-l", "error"],
                stdout=(work / f"envoy-{mode}.log").open("wb"), stderr=subprocess.STDOUT,
            )  # fmt: skip
        clients = [Client(mode, xds, names, i) for i in range(args.clients)]
        t0 = time.monotonic()
        tasks = [asyncio.create_task(c.run(stop)) for c in clients]
        await wait_until(
            lambda: all(c.synced_at is not None or c.error for c in clients), "every client synced"
        )
        full_sync = max((c.synced_at or t0) - t0 for c in clients)
        envoy_sync = float("nan")
        if envoy is not None:
            done = await wait_until(
                lambda: sum(envoy_stats(admin, r"membership_total$").values()) >= args.endpoints + 2,
                "Envoy to hold the fleet",
            )
            envoy_sync = done - t0
        # SotW EDS response size: what one client receives per push
        if mode == "sotw":
            snapshot_eds = await _eds_response_bytes(xds, names)
        latencies: list[float] = []
        envoy_latencies: list[float] = []
        keys = list(config.endpoints)
        for rnd in range(args.rounds):
            await asyncio.sleep(args.settle_s)
            before = [len(c.arrivals) for c in clients]
            envoy_before = sum(envoy_stats(admin, UPDATE_SUCCESS).values()) if envoy else 0
            count = max(1, len(keys) // 100)
            if args.spread == "random":
                picked = random.sample(keys, count)
            else:  # the endpoints of as few clusters as possible: one cluster's GPUs re-weighted
                model = f"model-{rnd % args.clusters:03d}"
                picked = ([e for e in keys if e.model == model] + keys)[:count]
            weights = {str(e.address): 1000 + rnd * 10 + i % 7 for i, e in enumerate(picked)}
            changed_clusters = len({e.model for e in picked})
            t_send = time.monotonic()
            status, body = await asyncio.to_thread(
                http, "PUT", f"http://127.0.0.1:{api}/v1/weights", {"weights": weights}, TOKEN
            )
            if status != 200:
                raise RuntimeError(f"PUT /v1/weights: {status} {body[:200]!r}")
            await wait_until(
                lambda before=before: all(
                    len(c.arrivals) > b or c.error for c, b in zip(clients, before, strict=True)
                ),
                f"round {rnd} at every client",
            )
            latencies.extend(
                c.arrivals[b] - t_send for c, b in zip(clients, before, strict=True) if len(c.arrivals) > b
            )
            if envoy is not None:
                need = changed_clusters if mode == "delta" else args.clusters
                target = envoy_before + need
                done = await wait_until(
                    lambda target=target: sum(envoy_stats(admin, UPDATE_SUCCESS).values()) >= target,
                    f"round {rnd} at Envoy",
                )
                envoy_latencies.append(done - t_send)
        cpu, rss = proc_usage(server.pid)
        status, metrics = await asyncio.to_thread(http, "GET", f"http://127.0.0.1:{api}/metrics")
        server_p50, server_p99 = histogram_quantiles(metrics.decode(), mode) if status == 200 else (NAN, NAN)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return Result(
            mode=mode,
            clients=args.clients,
            full_sync_s=full_sync,
            envoy_sync_s=envoy_sync,
            change_p50_ms=pct(latencies, 50) * 1000,
            change_p99_ms=pct(latencies, 99) * 1000,
            envoy_change_ms=statistics.median(envoy_latencies) * 1000 if envoy_latencies else float("nan"),
            server_cpu_s=cpu,
            server_rss_mb=rss,
            eds_bytes=snapshot_eds,
            errors=sum(1 for c in clients if c.error),
            error_kinds=sorted({c.error for c in clients if c.error}),
            server_push_p50_ms=server_p50 * 1000,
            server_push_p99_ms=server_p99 * 1000,
        )
    finally:
        stop.set()
        for p in (envoy, server):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        log.close()


def _up(api: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{api}/healthz")[0] == 200
    except OSError:
        return False


async def _eds_response_bytes(port: int, names: list[str]) -> int:
    """Size of one SotW EDS response for every cluster (fetched on a separate short stream)."""
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=names))
        resp = await call.read()
        call.cancel()
        return int(resp.ByteSize())


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    print(
        f"\nxds_scale: {args.endpoints} endpoints in {args.clusters} clusters, {args.clients} ADS clients "
        f"+ {'1 Envoy' if args.envoy else 'no Envoy'}, {args.rounds} rounds of a 1% weight change "
        f"({args.spread} endpoints), "
        f"push_debounce_ms={args.debounce_ms}, telemetry.scrape_interval_ms={args.scrape_interval_ms}, "
        f"{os.cpu_count()} CPUs"
    )
    cols = [
        ("mode", "{:<6}"), ("full sync s", "{:>11.2f}"), ("Envoy sync s", "{:>12.2f}"),
        ("1% p50 ms", "{:>9.0f}"), ("1% p99 ms", "{:>9.0f}"), ("Envoy 1% ms", "{:>11.0f}"),
        ("server push p50/p99 ms", "{:>21}"),
        ("server CPU s", "{:>12.1f}"), ("peak RSS MB", "{:>11.0f}"), ("SotW EDS MB", "{:>11.2f}"),
        ("errors", "{:>6}"),
    ]  # fmt: skip
    print(" | ".join(f"{name:>{len(name)}}" for name, _ in cols))
    print("-+-".join("-" * len(name) for name, _ in cols))
    for r in results:
        push = f"<={r.server_push_p50_ms:.0f} / <={r.server_push_p99_ms:.0f}"
        values = [
            r.mode, r.full_sync_s, r.envoy_sync_s, r.change_p50_ms, r.change_p99_ms, r.envoy_change_ms,
            push, r.server_cpu_s, r.server_rss_mb, r.eds_bytes / 1e6, r.errors,
        ]  # fmt: skip
        print(" | ".join(fmt.format(v) for (_, fmt), v in zip(cols, values, strict=True)))
    for r in results:
        for kind in r.error_kinds:
            print(f"{r.mode} client error: {kind}")
    print(
        "targets: full sync <= 2 s, 1% change <= 200 ms p99 (Delta), server RSS <= 300 MB. "
        "Server CPU covers start-up, the syncs and every round."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--endpoints", type=int, default=10_000)
    p.add_argument("--clusters", type=int, default=100)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5, help="1%% weight changes per mode")
    p.add_argument("--modes", default="sotw,delta")
    p.add_argument(
        "--spread",
        choices=["random", "cluster"],
        default="random",
        help="which 1%% changes: random endpoints (touching ~63%% of the clusters) or one cluster's",
    )
    p.add_argument("--debounce-ms", type=int, default=50, help="xds.push_debounce_ms")
    p.add_argument(
        "--scrape-interval-ms",
        type=int,
        default=500,
        help="telemetry.scrape_interval_ms (the xDS server scrapes every endpoint's /metrics in its own "
        "event loop; 600000 keeps the scrape out of the xDS measurement)",
    )
    p.add_argument("--settle-s", type=float, default=0.5, help="pause before each change (s)")
    p.add_argument("--no-envoy", dest="envoy", action="store_false")
    p.add_argument(
        "--envoy-bin", default=os.environ.get("ENVOY_BIN") or str(Path(sys.executable).parent / "envoy")
    )
    args = p.parse_args(argv)
    random.seed(7)
    results = []
    with tempfile.TemporaryDirectory(prefix="xds_scale-") as tmp:
        for mode in args.modes.split(","):
            print(f"running {mode} ...", file=sys.stderr, flush=True)
            results.append(asyncio.run(run_mode(mode.strip(), args, Path(tmp))))
    print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
