"""CPU cost of ``python -m epp`` per request, behind the real Envoy with a foreign (GIE-style) config.

Run: ``.venv/bin/python bench/epp_cpu.py [--requests 1000] [--rounds 3] [--concurrency 8]``. Prints a rich
table; not a test.

Set-up, all on 127.0.0.1: the simulated GPUs of the default config (fast), ``python -m epp`` over the
``llama-3.1-8b-instruct`` pool, and Envoy on the bootstrap of ``tests/e2e/test_epp_foreign_envoy.py``
(ext_proc ``FULL_DUPLEX_STREAMED`` both ways, trailers SEND, an ORIGINAL_DST cluster on the header). This
process is the client: ``--concurrency`` aiohttp connections in a closed loop, POSTing non-streamed chat
completions (``max_tokens`` 4) through Envoy.

Cells, interleaved round by round: a small body (~0.1 KB, one body message) and a 64 KB body (a padding
field no parser reads; several body messages, picked at the last). Per cell and round: the EPP process's
and Envoy's user + system CPU (``psutil``) over ``--requests`` requests after a warm-up, divided by the
requests; the ext_proc messages the EPP answered per request (its processing histogram's count); the
client's wall-clock req/s. Median over ``--rounds``. Every request must answer 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferlb.ops.stack import find_envoy, free_ports
from tests.conftest import make_config_doc, write_config
from tests.e2e.test_epp_foreign_envoy import MODEL, foreign_bootstrap

CELLS = {"0.1 KB body": 0, "64 KB body": 64 * 1024}


def _body(pad: int) -> bytes:
    doc: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    if pad:
        doc["x_pad"] = "p" * pad
    return json.dumps(doc).encode()


async def _load(url: str, body: bytes, requests: int, concurrency: int) -> float:
    left = requests
    bad: list[int] = []

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    bad.append(r.status)

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.wait_for(asyncio.gather(*(client(session) for _ in range(concurrency))), 600)
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not answer 200: {sorted(set(bad))}")
    return requests / (time.monotonic() - t0)


def _phases(metrics_url: str) -> dict[str, float]:
    """ext_proc messages the EPP answered so far, by phase (its ``inferlb_epp_processing_seconds`` count)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    prefix = 'inferlb_epp_processing_seconds_count{phase="'
    return {
        line[len(prefix) :].partition('"')[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def _wait(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process of the stack exited during start-up")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {url}")


def _until_routed(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Wait until a request through Envoy answers 200 (gpusim up, the EPP's first scrape done)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process of the stack exited during start-up")
        req = urllib.request.Request(url, data=_body(0), headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("no request was routed within 60 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=200)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    doc = make_config_doc()
    config = write_config(work / "inferlb.yaml", doc)
    listen, admin, epp, epp_metrics = free_ports(4)
    bootstrap = work / "envoy.yaml"
    bootstrap.write_text(
        yaml.safe_dump(foreign_bootstrap(listen=listen, admin=admin, epp=epp, log=Path("/dev/null")))
    )
    argvs = [
        [sys.executable, "-m", "simulation.gpusim", "--config", str(config), "--log-level", "warning"],
        [
            *(
                sys.executable,
                "-m",
                "epp",
                "--config",
                str(config),
                "--model",
                MODEL,
                "--log-level",
                "warning",
            ),
            *("--listen", f"127.0.0.1:{epp}", "--metrics-listen", f"127.0.0.1:{epp_metrics}"),
        ],
        [
            *(find_envoy(), "-c", str(bootstrap), "--base-id", str(random.randint(10_000, 2_000_000))),
            *("--concurrency", "1", "-l", "error"),
        ],
    ]
    procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for a in argvs]
    try:
        _wait(f"http://127.0.0.1:{admin}/ready", procs)
        _wait(f"http://127.0.0.1:{epp_metrics}/metrics", procs)
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        _until_routed(url, procs)
        epp_proc, envoy_proc = psutil.Process(procs[1].pid), psutil.Process(procs[2].pid)
        for pad in CELLS.values():
            asyncio.run(_load(url, _body(pad), args.warmup, args.concurrency))
        metrics_url = f"http://127.0.0.1:{epp_metrics}/metrics"
        rows: dict[str, dict[str, list[float]]] = {
            c: {"epp": [], "envoy": [], "rps": [], "msgs": []} for c in CELLS
        }
        by_phase: dict[str, dict[str, float]] = {c: {} for c in CELLS}
        for _ in range(args.rounds):
            for cell, pad in CELLS.items():
                e0, v0, m0 = _cpu(epp_proc), _cpu(envoy_proc), _phases(metrics_url)
                rps = asyncio.run(_load(url, _body(pad), args.requests, args.concurrency))
                rows[cell]["epp"].append((_cpu(epp_proc) - e0) / args.requests * 1e6)
                rows[cell]["envoy"].append((_cpu(envoy_proc) - v0) / args.requests * 1e6)
                rows[cell]["rps"].append(rps)
                m1 = _phases(metrics_url)
                rows[cell]["msgs"].append((sum(m1.values()) - sum(m0.values())) / args.requests)
                for phase, n in m1.items():
                    by_phase[cell][phase] = (n - m0.get(phase, 0.0)) / args.requests
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    table = Table(
        title=f"epp CPU per request behind Envoy ({args.rounds} rounds x {args.requests} requests, "
        f"{args.concurrency} clients; median \\[min-max])"
    )
    for col in ("cell", "EPP CPU us/req", "Envoy CPU us/req", "EPP / Envoy", "messages/req", "req/s"):
        table.add_column(col, justify="right")

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):,.0f} [{min(xs):,.0f}-{max(xs):,.0f}]"

    for cell, r in rows.items():
        ratio = statistics.median(e / v for e, v in zip(r["epp"], r["envoy"], strict=True))
        msgs = f"{statistics.median(r['msgs']):.1f}"
        table.add_row(cell, fmt(r["epp"]), fmt(r["envoy"]), f"{ratio:.2f}x", msgs, fmt(r["rps"]))
    console = Console(width=140)
    console.print(table)
    for cell, phases in by_phase.items():
        console.print(
            f"{cell}, messages per request (last round): "
            + ", ".join(f"{p} {n:.2f}" for p, n in sorted(phases.items()))
        )


if __name__ == "__main__":
    main()
