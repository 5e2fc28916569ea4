"""The fault trials in one run: what a burst, a failing GPU, a hung GPU, a killed xDS server, a config file
caught half-written and a long soak cost clients, each against its target, in one table.

Not a test: it runs the four fault scripts one after the other as subprocesses (each prints its own
table, passed through), reads the figures each writes with ``--json``, and prints the summary:

- **cold burst** (``bench/quota_burst.py --runs R``): ``--burst`` concurrent requests from one tenant at
  ``--rpm`` requests/min over two ext_proc replicas sharing a fresh Redis. Target: admitted <= the quota in
  every run, no 503 with Redis healthy.
- **failing GPU, hung GPU, xDS restart** (``bench/gpu_faults.py --scenario-s T --fault-s F``): 1 of the 8
  simulated GPUs answers 503 for ``F`` s, then another accepts requests and answers nothing for ``F`` s,
  under closed-loop load (half the clients streaming); then the xDS server is stopped and started again.
  Targets: 0 errors for non-streamed requests, the slowest non-streamed request within the configured
  bound (``(num_retries + 1) x per_try_timeout``, the script's setting), Envoy resynced (every type ACKed)
  <= 2 s after the xDS server is back.
- **kill -9 and truncated write** (``bench/fleet_restart.py``): four fleet API changes, ``kill -9`` of the
  xDS server, restart; then the config file rewritten in place and left cut for 2 s, twice. Targets: the
  API's listing and Envoy's hosts identical after the restart, the drained and the deregistered GPUs serve
  nothing after it; 0 errors during the truncated writes.
- **soak** (``bench/soak.py --duration S``, skipped with ``--soak-s 0``): steady load on the whole stack.
  Target: every process's RSS flat (soak.py's verdict) over the second half.

Usage: ``.venv/bin/python bench/faults.py [--soak-s 1800] [--fault-s 80] [--scenario-s 120]`` (about
10 minutes plus the soak; needs ``redis-server``). Exit status 0 when every target was met. Every request
goes to 127.0.0.1; every script is bounded in time here (``--script-timeout-s`` on top of the script's
own bounds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent
#: The resync target: Envoy ACKs every type within this many seconds of the xDS server's return.
RESYNC_TARGET_S = 2.0


@dataclass
class Row:
    """One line of the summary: the trial, its target, what was measured, and whether it met the target."""

    trial: str
    target: str
    measured: str
    met: bool | None  # None: not run


def run_script(console: Console, script: str, args: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``bench/<script>`` with ``args`` and ``--json out``, its output passed through; its figures.

    Raises:
        RuntimeError: the script failed to write its figures (it crashed or ran past ``timeout_s``).
    """
    cmd = [sys.executable, str(BENCH / script), *args, "--json", str(out)]
    console.rule(" ".join(["bench/" + script, *args]))
    try:
        subprocess.run(cmd, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"bench/{script} ran past {timeout_s:g} s") from exc
    if not out.exists():
        raise RuntimeError(f"bench/{script} wrote no figures (see its output above)")
    figures: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return figures


def burst_rows(f: dict[str, Any]) -> list[Row]:
    """The cold-burst line from ``quota_burst.py``'s figures."""
    runs = f["runs"]
    admitted = [r["admitted"] for r in runs]
    r503 = sum(r["503"] for r in runs)
    met = all(a <= f["rpm"] for a in admitted) and r503 == 0
    return [
        Row(
            f"cold burst of {f['requests']} at {f['rpm']} rpm, 2 replicas, {len(runs)} runs",
            f"admitted <= {f['rpm']} in every run, 0 x 503",
            f"admitted {', '.join(map(str, admitted))}; 429 {', '.join(str(r['429']) for r in runs)}; "
            f"503 {r503}",
            met,
        )
    ]


def gpu_rows(f: dict[str, Any]) -> list[Row]:
    """The failing-GPU, hung-GPU and resync lines from ``gpu_faults.py``'s figures."""
    rows = []
    bound = f["held_bound_s"]
    for s in f["scenarios"]:
        ns, st = s["non_streamed"], s["streamed"]
        if s["resync_s"] is not None or s["name"] == "xds restart":
            resync = s["resync_s"]
            rows.append(
                Row(
                    "Envoy resync after the xDS server's return",
                    f"<= {RESYNC_TARGET_S:g} s",
                    "no resync" if resync is None else f"{resync:.2f} s",
                    resync is not None and resync <= RESYNC_TARGET_S,
                )
            )
            continue
        errors = sum(ns["errors"].values())
        held = ns["max_s"] or 0.0
        streamed = ", ".join(f"{k}: {v}" for k, v in st["errors"].items()) or "none"
        rows.append(
            Row(
                f"{s['name']} (1 of 8 GPUs), {f['clients']} clients",
                f"0 non-streamed errors, none held > {bound:g} s",
                f"{errors} errors in {ns['requests']} non-streamed, slowest {held:.2f} s; "
                f"streamed {st['requests']}, errors {streamed}; {'; '.join(s['notes'])}",
                errors == 0 and held <= bound,
            )
        )
    return rows


def restart_rows(f: dict[str, Any], drained: str, deregistered: str) -> list[Row]:
    """The kill -9 and truncated-write lines from ``fleet_restart.py``'s figures."""
    r = f["restart"]
    served = r["served_after"]
    leaked = served.get(drained, 0) + served.get(deregistered, 0)
    rows = [
        Row(
            "fleet API changes across kill -9 of the xDS server",
            "listing and Envoy's hosts identical; drained and deregistered serve 0",
            f"listing same: {r['listing_same']}, Envoy same: {r['envoy_same']}, served by {drained} and "
            f"{deregistered} after: {leaked}; Envoy back {r['reconnect_s']:.1f} s after the kill",
            bool(r["listing_same"] and r["envoy_same"] and leaked == 0),
        )
    ]
    for t in f["truncated"]:
        bad = int(t["requests"]) - int(t["ok"])
        rows.append(
            Row(f"config file {t['trial']} for 2 s, under load", "0 errors",
                f"{bad} errors in {t['requests']} requests (401: {t['401']}, other: {t['other']})", bad == 0)
        )  # fmt: skip
    return rows


def soak_rows(f: dict[str, Any] | None, seconds: float) -> list[Row]:
    """The soak line from ``soak.py``'s figures (``None``: not run)."""
    if f is None:
        return [Row("soak", "flat RSS in every process", "not run (--soak-s 0)", None)]
    procs = f["processes"]
    growth = ", ".join(f"{n} {p['mb_per_min']:+.3f}" for n, p in procs.items())
    errors = sum(v for k, v in f["statuses"].items() if k != "200")
    return [
        Row(
            f"soak, {seconds / 60:g} min, {f['requests']:,} requests",
            "flat RSS in every process, 0 errors",
            f"MB/min: {growth}; errors {errors}",
            all(p["flat"] for p in procs.values()) and errors == 0,
        )
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--burst", type=int, default=300, help="concurrent requests of the cold burst")
    p.add_argument("--rpm", type=int, default=50, help="the burst tenant's requests_per_minute")
    p.add_argument("--burst-runs", type=int, default=3)
    p.add_argument("--scenario-s", type=float, default=120.0, help="length of each GPU scenario (s)")
    p.add_argument("--fault-s", type=float, default=80.0, help="how long each GPU fault lasts (s)")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients in the GPU scenarios")
    p.add_argument("--soak-s", type=float, default=1800.0, help="soak length (s); 0 skips it")
    p.add_argument("--script-timeout-s", type=float, default=1200.0, help="bound on each script but the soak")
    args = p.parse_args(argv)
    if args.soak_s and args.soak_s < 120:
        p.error("--soak-s: 0 (skip) or at least 120 s (the growth is read over the second half)")
    console = Console(width=170)
    steps: list[tuple[str, list[str], float, Callable[[dict[str, Any]], list[Row]]]] = [
        ("quota_burst.py", ["--runs", str(args.burst_runs), "--requests", str(args.burst), "--rpm",
                            str(args.rpm)], args.script_timeout_s, burst_rows),
        ("gpu_faults.py", ["--scenario-s", f"{args.scenario_s:g}", "--fault-s", f"{args.fault_s:g}",
                           "--clients", str(args.clients)], args.script_timeout_s, gpu_rows),
        ("fleet_restart.py", [], args.script_timeout_s, lambda f: restart_rows(f, "h100-1", "v100-2")),
    ]  # fmt: skip
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="inferlb-faults-") as tmp:
        for i, (script, script_args, timeout_s, read) in enumerate(steps):
            try:
                rows += read(run_script(console, script, script_args, Path(tmp) / f"{i}.json", timeout_s))
            except RuntimeError as exc:
                rows.append(Row(script, "runs to the end", str(exc), False))
        if args.soak_s:
            interval = max(10.0, args.soak_s / 30)
            try:
                soak = run_script(console, "soak.py", ["--duration", f"{args.soak_s:g}", "--interval",
                                  f"{interval:g}"], Path(tmp) / "soak.json", args.soak_s + 300)  # fmt: skip
                rows += soak_rows(soak, args.soak_s)
            except RuntimeError as exc:
                rows.append(Row("soak.py", "runs to the end", str(exc), False))
        else:
            rows += soak_rows(None, 0)
    table = Table(title="Fault trials: each against its target", show_lines=True)
    for col in ("trial", "target", "measured", "met"):
        table.add_column(col, justify="center" if col == "met" else "left")
    for r in rows:
        table.add_row(r.trial, r.target, r.measured, "-" if r.met is None else "yes" if r.met else "NO")
    console.print(table)
    return 0 if all(r.met is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
