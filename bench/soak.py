"""Soak: RSS and open file descriptors of every process of the local stack under steady load, over time.

Not a test: it prints a table of samples and one of growth per process. It runs the local stack
(:class:`inferlb.ops.stack.Stack` on the embedded default config with free loopback ports: the simulated
8-GPU fleet, the xDS server, ext_proc, Envoy), then keeps ``--concurrency`` clients busy with chat
completions (``max_tokens`` 2, ``--prompts`` distinct prompts in turn, streamed every other request, the
demo tenant with the generous quota) for ``--duration`` seconds, at most ``--max-requests`` requests, and
samples each process (``psutil``: RSS, open fds) every ``--interval`` seconds.

Growth is the least-squares slope of RSS over the second half of the run (MB/min), so the start-up and
warm-up (imports, caches, Envoy's first connections) do not count; "flat" means within
``--flat-mb-per-min``. Usage: ``.venv/bin/python bench/soak.py [--duration 1800] [--interval 30]
[--json PATH]`` (``--json`` also writes the growth per process, what ``bench/faults.py`` reads); a short
look: ``--duration 120 --interval 10``. Every request goes to 127.0.0.1; the loop is bounded in count and
time.
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
import psutil
import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferlb.config.schema import default_config_path
from inferlb.ops.stack import Stack, on_free_ports

KEY = "sk-demo-a"
MODEL = "qwen"


@dataclass
class Samples:
    """RSS (MB) and open fds of one process, sampled at ``t`` seconds into the load."""

    t: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def slope_mb_per_min(self) -> float:
        """Least-squares slope of RSS over the second half of the samples (MB/min); 0 with fewer than 3."""
        half = len(self.t) // 2
        ts, ys = self.t[half:], self.rss_mb[half:]
        if len(ts) < 3:
            return 0.0
        mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
        var = sum((t - mt) ** 2 for t in ts)
        return 0.0 if var == 0 else 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def shifted_config(work: Path) -> Path:
    """The default config on free loopback ports (so the soak runs beside another stack)."""
    doc = on_free_ports(yaml.safe_load(default_config_path().read_text(encoding="utf-8")))
    path = work / "soak.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def processes(stack: Stack) -> dict[str, psutil.Process]:
    """The stack's processes by child name (``gpusim`` is one process for every simulated GPU)."""
    out = {}
    for child in stack.children:
        if child.proc is not None and child.proc.poll() is None:
            out[child.name] = psutil.Process(child.proc.pid)
    return out


async def load(
    gateway: str,
    *,
    concurrency: int,
    prompts: int,
    deadline: float,
    max_requests: int,
    statuses: Counter[str],
) -> None:
    """Keep ``concurrency`` clients busy until ``deadline`` (monotonic) or ``max_requests``."""
    sent = 0
    url = f"http://{gateway}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=30)

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while time.monotonic() < deadline and sent < max_requests:
            i = sent
            sent += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"soak prompt {i % prompts}: say something"}],
                "max_tokens": 2,
                "stream": i % 2 == 1,
            }
            try:
                async with session.post(url, data=json.dumps(body), headers=headers) as resp:
                    await resp.read()
                    statuses[str(resp.status)] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                statuses[type(exc).__name__] += 1

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))


async def sample(
    procs: dict[str, psutil.Process],
    series: dict[str, Samples],
    *,
    start: float,
    deadline: float,
    every: float,
) -> None:
    """Sample every process each ``every`` seconds until ``deadline``."""
    console = Console(stderr=True)
    while True:
        t = time.monotonic() - start
        row = []
        for name, proc in procs.items():
            s = series.setdefault(name, Samples())
            with proc.oneshot():
                s.t.append(t)
                s.rss_mb.append(proc.memory_info().rss / 1e6)
                s.fds.append(proc.num_fds())
            row.append(f"{name} {s.rss_mb[-1]:.1f} MB/{s.fds[-1]} fds")
        console.print(f"[{t:6.0f} s] " + ", ".join(row), highlight=False)
        if time.monotonic() + every > deadline:
            return
        await asyncio.sleep(every)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--duration", type=float, default=1800, help="seconds of load (default 30 min)")
    p.add_argument("--interval", type=float, default=30, help="seconds between samples")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompts", type=int, default=20, help="distinct prompts, sent in turn")
    p.add_argument("--max-requests", type=int, default=2_000_000, help="bound on requests")
    p.add_argument("--flat-mb-per-min", type=float, default=0.05, help="growth below this reads flat")
    p.add_argument("--json", metavar="PATH", help="also write the growth per process to PATH as JSON")
    args = p.parse_args(argv)
    console = Console(width=150)
    with tempfile.TemporaryDirectory(prefix="inferlb-soak-") as tmp:
        work = Path(tmp)
        stack = Stack(shifted_config(work), workdir=work, log_level="warning")
        stack.start(timeout_s=120)
        try:
            procs = processes(stack)
            series: dict[str, Samples] = {}
            statuses: Counter[str] = Counter()
            start = time.monotonic()
            deadline = start + args.duration

            async def run() -> None:
                await asyncio.gather(
                    load(
                        str(stack.config.gateway.listen),
                        concurrency=args.concurrency,
                        prompts=args.prompts,
                        deadline=deadline,
                        max_requests=args.max_requests,
                        statuses=statuses,
                    ),
                    sample(procs, series, start=start, deadline=deadline, every=args.interval),
                )

            asyncio.run(run())
            wall = time.monotonic() - start
        finally:
            stack.stop()
    total = sum(statuses.values())
    table = Table(
        title=f"Soak: {total:,} requests in {wall:.0f} s ({total / wall:.0f} req/s), {dict(statuses)}"
    )
    for col in (
        "process",
        "RSS start MB",
        "RSS end MB",
        "RSS max MB",
        "growth MB/min (2nd half)",
        "fds start",
        "fds end",
        "fds max",
        "verdict",
    ):
        table.add_column(col, justify="left" if col in ("process", "verdict") else "right")
    growth: dict[str, dict[str, Any]] = {}
    for name, s in series.items():
        slope = s.slope_mb_per_min()
        mid = len(s.fds) // 2
        flat = abs(slope) <= args.flat_mb_per_min and s.fds[-1] <= s.fds[mid] + 2
        growth[name] = {"rss_start_mb": s.rss_mb[0], "rss_end_mb": s.rss_mb[-1], "mb_per_min": slope,
                        "fds_start": s.fds[0], "fds_end": s.fds[-1], "flat": flat}  # fmt: skip
        table.add_row(
            name,
            f"{s.rss_mb[0]:.1f}",
            f"{s.rss_mb[-1]:.1f}",
            f"{max(s.rss_mb):.1f}",
            f"{slope:+.3f}",
            str(s.fds[0]),
            str(s.fds[-1]),
            str(max(s.fds)),
            "flat" if flat else "grows",
        )
    console.print(table)
    if args.json:
        summary = {"seconds": wall, "requests": total, "statuses": dict(statuses), "processes": growth}
        Path(args.json).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
