"""A cold burst against the shared Redis quota: does it admit exactly the quota, with Redis healthy?

Run: ``.venv/bin/python bench/quota_burst.py [--runs 3] [--requests 300] [--rpm 50]
[--failure-mode open|closed] [--json PATH]`` (needs ``redis-server``). Prints one table; not a test.
``--json`` also writes the runs' counts to ``PATH`` (what ``bench/faults.py`` reads).

Each run, all on 127.0.0.1: a fresh ``redis-server`` (a temporary directory, a free port, no persistence),
two fresh ``python -m ext_proc`` replicas on one config (one tenant at ``--rpm`` requests/min,
``quota_backend: redis``, every other Redis setting at its default: ``redis_timeout_ms`` 100,
``redis_connect_timeout_ms`` 1000, ``redis_pool_size`` 16, ``redis_failure_mode`` as given), then
``--requests`` ext_proc streams at once, split evenly over the two replicas. Each stream is what Envoy sends
for a chat completion (request headers, then the buffered body with ``end_of_stream``), driven over the
gRPC ``ExternalProcessor`` stream directly, so no Envoy is needed; its answer to the body is counted as
admitted (a continue with the routing headers), 429 (a quota refusal), 503 (the quota store failed or was
too busy) or other. With Redis healthy, admitted must equal the quota (never more) and 503 must be 0:
the table says so per run. The replicas' ``inferlb_quota_backend_errors_total`` is summed from their
``/metrics``.

Bounded: ``--requests`` streams per run (at most 2000), each answer awaited at most 10 s, each run at most
120 s; ``--runs`` at most 10.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parents[1]))

from inferlb.ops.redis_server import RedisServer
from inferlb.ops.stack import free_ports

API_KEY = "sk-burst-tenant-01"
MODEL = "bench-model"
#: Seconds to wait for one ext_proc answer, for a replica to log ready, and for one whole run.
ANSWER_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 120.0
MAX_REQUESTS = 2000
MAX_RUNS = 10


@dataclass
class RunResult:
    """What one burst got back."""

    outcomes: Counter[str]
    seconds: float
    backend_errors: float


def replica_config(redis_url: str, rpm: int, mode: str, listen: int, metrics: int) -> dict[str, Any]:
    """One replica's config document: one model, one tenant at ``rpm`` requests/min, the Redis store."""
    return {
        "models": [{"name": MODEL, "default_max_tokens": 16}],
        "tenants": [{"name": "burst", "api_keys": [API_KEY], "requests_per_minute": rpm}],
        "ext_proc": {
            "protocol": "ext_proc",  # the replicas are python -m ext_proc processes
            "listen": f"127.0.0.1:{listen}",
            "metrics_listen": f"127.0.0.1:{metrics}",
            "quota_backend": "redis",
            "redis_url": redis_url,
            "redis_failure_mode": mode,
        },
    }


def headers_message() -> ep.ProcessingRequest:
    pairs = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        ":authority": "127.0.0.1:10000",
        "authorization": f"Bearer {API_KEY}",
        "content-type": "application/json",
    }
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    hm = base_pb2.HeaderMap(headers=values)
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm))


def body_message(i: int) -> ep.ProcessingRequest:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 16}
    ).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))


async def one_stream(stub: ep_grpc.ExternalProcessorStub, i: int, start: asyncio.Event) -> str:
    """Headers then body on one stream; the body's answer as ``admitted``, ``429``, ``503`` or other."""
    await start.wait()
    call = stub.Process()
    try:
        await call.write(headers_message())
        first = await asyncio.wait_for(call.read(), timeout=ANSWER_TIMEOUT_S)
        if first is grpc.aio.EOF or not first.HasField("request_headers"):
            return "headers refused"
        await call.write(body_message(i))
        answer = await asyncio.wait_for(call.read(), timeout=ANSWER_TIMEOUT_S)
        if answer is grpc.aio.EOF:
            return "eof"
        if answer.HasField("request_body"):
            return "admitted"
        return str(answer.immediate_response.status.code)
    except (grpc.aio.AioRpcError, TimeoutError) as exc:
        return type(exc).__name__
    finally:
        call.cancel()  # as Envoy resets the stream once it has what it needs


async def wait_ready(proc: asyncio.subprocess.Process) -> None:
    assert proc.stderr is not None
    lines: list[str] = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), timeout=READY_TIMEOUT_S)).decode()
        lines.append(line)
        if not line:
            raise RuntimeError("ext_proc exited:\n" + "".join(lines))
        if "ext_proc ready on" in line:
            return


async def drain_stderr(proc: asyncio.subprocess.Process) -> None:
    # keep reading the replica's log so it never blocks on a full pipe
    assert proc.stderr is not None
    while await proc.stderr.readline():
        pass


def backend_errors(metrics_port: int) -> float:
    """Sum of ``inferlb_quota_backend_errors_total`` on one replica's ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples = re.findall(r"^inferlb_quota_backend_errors_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(m) for m in samples)


async def one_run(requests: int, rpm: int, mode: str, workdir: Path) -> RunResult:
    redis = RedisServer(workdir, appendonly=False).start()
    procs: list[asyncio.subprocess.Process] = []
    channels: list[grpc.aio.Channel] = []
    drains: list[asyncio.Task[None]] = []
    ports = free_ports(4)
    try:
        for r in range(2):
            path = workdir / f"replica{r}.yaml"
            doc = replica_config(redis.url, rpm, mode, ports[2 * r], ports[2 * r + 1])
            path.write_text(yaml.safe_dump(doc), encoding="utf-8")
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "ext_proc",
                    "--config",
                    str(path),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                )
            )
        for p in procs:
            await wait_ready(p)
            drains.append(asyncio.create_task(drain_stderr(p)))
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{ports[2 * r]}") for r in range(2)]
        for c in channels:
            await asyncio.wait_for(c.channel_ready(), timeout=READY_TIMEOUT_S)
        stubs = [ep_grpc.ExternalProcessorStub(c) for c in channels]
        start = asyncio.Event()
        tasks = [asyncio.create_task(one_stream(stubs[i % 2], i, start)) for i in range(requests)]
        await asyncio.sleep(0.2)  # every stream waits on the same event: one cold burst
        began = time.perf_counter()
        start.set()
        outcomes = Counter(await asyncio.wait_for(asyncio.gather(*tasks), timeout=RUN_TIMEOUT_S))
        seconds = time.perf_counter() - began
        errors = sum(backend_errors(ports[2 * r + 1]) for r in range(2))
        return RunResult(outcomes=outcomes, seconds=seconds, backend_errors=errors)
    finally:
        for c in channels:
            await c.close()
        for p in procs:
            if p.returncode is None:
                p.terminate()
        for p in procs:
            await asyncio.wait_for(p.wait(), timeout=20)
        for d in drains:
            d.cancel()
        redis.stop()


async def main_async(args: argparse.Namespace) -> int:
    console = Console()
    table = Table(
        title=f"Cold burst: {args.requests} concurrent ext_proc streams over 2 replicas, one tenant at "
        f"{args.rpm} requests/min, quota_backend redis (redis_failure_mode {args.failure_mode}, "
        "other Redis settings default)"
    )
    for col in ("run", "admitted", "429", "503", "other", "backend errors", "burst (s)", "admitted <= quota"):
        table.add_column(col, justify="right")
    ok = True
    runs: list[dict[str, Any]] = []
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="inferlb-quota-burst-") as tmp:
            result = await one_run(args.requests, args.rpm, args.failure_mode, Path(tmp))
        o = result.outcomes
        admitted, r429, r503 = o["admitted"], o["429"], o["503"]
        fine = admitted <= args.rpm
        ok = ok and fine and r503 == 0
        other = {k: v for k, v in o.items() if k not in ("admitted", "429", "503")}
        runs.append({"admitted": admitted, "429": r429, "503": r503, "other": other, "s": result.seconds})
        table.add_row(
            str(run),
            str(admitted),
            str(r429),
            str(r503),
            ", ".join(f"{k}: {v}" for k, v in o.items() if k not in ("admitted", "429", "503")) or "0",
            f"{result.backend_errors:.0f}",
            f"{result.seconds:.2f}",
            "yes" if fine else "NO",
        )
    console.print(table)
    console.print("each run: a fresh redis-server and two fresh ext_proc processes (cold pools)")
    if args.json:
        summary = {"requests": args.requests, "rpm": args.rpm, "failure_mode": args.failure_mode}
        await asyncio.to_thread(Path(args.json).write_text, json.dumps({**summary, "runs": runs}, indent=1))
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rpm", type=int, default=50, help="the tenant's requests_per_minute")
    p.add_argument("--failure-mode", choices=["open", "closed"], default="open")
    p.add_argument("--json", metavar="PATH", help="also write the runs' counts to PATH as JSON")
    args = p.parse_args()
    if not 1 <= args.runs <= MAX_RUNS or not 2 <= args.requests <= MAX_REQUESTS or args.rpm < 1:
        p.error(f"--runs 1..{MAX_RUNS}, --requests 2..{MAX_REQUESTS}, --rpm >= 1")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
