"""How the ext_proc stream ends, and what it costs: RSS growth and CPU per request of the real servicer,
in-process, without Envoy, with the stream waiting for the client's reset after its last answer (the
default, :data:`ext_proc.servicer.RESET_WAIT_S`) or ending at once (``--reset-wait-s 0``).

Run: ``.venv/bin/python bench/extproc_stream_end.py [--waits 0,2] [--rounds 2] [--batches 6]
[--per-batch 8000] [--sse]``. Prints a rich table; not a test.

Set-up, all on 127.0.0.1: for each wait in ``--waits``, ``bench/extproc_cpu.py``'s server (the real ext_proc
servicer on :func:`ext_proc.servicer.make_server`, in-process quota store, metrics on, on the loop
``python -m ext_proc`` uses) runs in a **subprocess**; this process is a grpc aio
client sending, one ``Process`` stream per request, the messages Envoy sends with response accounting on
(``bench/extproc_cpu.py``: request headers, the BUFFERED body, response headers, the response body) and,
after the last answer, half-closing and resetting the stream as Envoy does. The waits are interleaved:
each round runs every wait once, so the machine's load falls on all of them alike.

Measures, per wait: the server's RSS (``psutil``) after a warm-up and after each of ``--batches`` batches
of ``--per-batch`` requests; growth is bytes per request over the second half of the batches (the first
half warms allocator pools); server CPU (user + system) per request over all batches. A stream that ends at
once sends a final status that races the client's reset, and a status batch that loses it never frees its
native memory in grpcio aio: that is the growth this shows.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import psutil
from extproc_cpu import Workload, run_requests, start_server
from rich.console import Console
from rich.table import Table


def _requests(port: int, n: int, args: argparse.Namespace, work: Workload) -> None:
    if asyncio.run(run_requests(port, n, args.concurrency, work)) != n:
        raise RuntimeError("a request was refused or its stream ended before its last answer")


def measure(wait_s: float, args: argparse.Namespace, work: Workload) -> tuple[float, float]:
    """One server with ``wait_s``: (RSS growth in bytes per request over the second half of the batches,
    server CPU in us per request over all batches)."""
    server = start_server([], reset_wait_s=wait_s)
    try:
        proc = psutil.Process(server.pid)
        _requests(server.port, args.warmup, args, work)
        rss = [proc.memory_info().rss]
        t = proc.cpu_times()
        cpu0 = t.user + t.system
        for _ in range(args.batches):
            _requests(server.port, args.per_batch, args, work)
            rss.append(proc.memory_info().rss)
        t = proc.cpu_times()
        cpu = t.user + t.system - cpu0
    finally:
        server.stop()
    half = len(rss) // 2
    growth = (rss[-1] - rss[half]) / ((len(rss) - 1 - half) * args.per_batch)
    return growth, cpu / (args.batches * args.per_batch) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--waits", default="0,2", help="reset waits to compare (seconds, comma-separated)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every wait once")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--per-batch", type=int, default=8000, help="requests per batch")
    p.add_argument("--warmup", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streams")
    p.add_argument("--sse", action="store_true", help="a streamed (SSE) response instead of JSON")
    args = p.parse_args(argv)
    waits = [float(w) for w in args.waits.split(",")]
    work = Workload(body_bytes=3072, sse=args.sse, unique=False)
    growth: dict[float, list[float]] = {w: [] for w in waits}
    cpu: dict[float, list[float]] = {w: [] for w in waits}
    console = Console(width=150)
    for r in range(args.rounds):
        for w in waits:
            started = time.monotonic()
            g, c = measure(w, args, work)
            growth[w].append(g)
            cpu[w].append(c)
            console.print(
                f"round {r + 1}, wait {w:g} s: {g:+.1f} B/request, {c:.0f} us/request "
                f"({time.monotonic() - started:.0f} s)",
                highlight=False,
            )
    n = args.batches * args.per_batch
    table = Table(
        title=f"ext_proc stream end: {args.rounds} rounds x {n:,} requests per wait, "
        f"{'SSE' if args.sse else 'JSON'} responses, concurrency {args.concurrency}"
    )
    for col in ("reset wait s", "RSS growth B/request (each round)", "median", "CPU us/request (each round)"):
        table.add_column(col, justify="right")
    table.add_column("median", justify="right")
    for w in waits:
        table.add_row(
            f"{w:g}",
            ", ".join(f"{g:+.1f}" for g in growth[w]),
            f"{statistics.median(growth[w]):+.1f}",
            ", ".join(f"{c:.0f}" for c in cpu[w]),
            f"{statistics.median(cpu[w]):.0f}",
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
