"""What several metering ext_authz processes cost and whether they settle every request: ``ext_proc.protocol:
ext_authz`` with ``account_responses`` (the default) and 1, 2, ... processes (``ext_proc.extra_listen``), each
its own settler, Envoy with one gRPC access logger per process (a prefix ``metadata_filter`` each, see
``ext_authz/meter.py``), in one run.

Run: ``.venv/bin/python bench/meter_processes.py [--processes 1,2,4] [--duration 3] [--rounds 3]
[--connections 16]`` (needs ``wrk``, ``nginx`` and ``redis-server``). Prints one table; not a test.

Set-up, all on 127.0.0.1: the nginx backend and the ~3 KB chat body of ``gateway_overhead.py`` (its JSON
answer carries ``usage``); one redis-server shared by every gateway (each its own key prefix,
``quota_backend: redis``, so the processes of a gateway share one quota); per process count one inferlb
stack (``inferlb.ops.stack.Stack``: xds_server, Envoy over ADS, the ext_authz processes), all started before
the first measurement. The tenant's limits are far above what a run sends, so every request is admitted,
reserved and settled.

Load: ``wrk`` POSTing the body for ``--duration`` s per cell (gateway x connections), cells shuffled anew per
round; each figure is the median over the rounds. Columns: req/s, p50/p99, non-2xx, CPU per request (user +
system) of Envoy and of all ext_authz processes together. Then each stack's Envoy is drained
(:meth:`~inferlb.ops.stack.Stack.drain_envoy`), one lease TTL (:data:`LEASE_TTL_MS`) waited, and its
processes' ``/metrics`` read: requests admitted (``inferlb_requests_total{status="forwarded"}``) against
settlements by outcome and entries ignored, per process: every admitted request must be settled once and
none ignored (an entry at the wrong settler would be an unknown id there). ``expired`` counts the
admissions whose entry never came, settled at their reservation by the TTL; wrk closes its connections at
each cell's end, and a request whose client left while its check was running is likely the cause (Envoy
logs it without the answer's meter id; not traced here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from extproc_overhead import wrk
from gateway_overhead import (
    CHAT_PATH,
    Gateway,
    Sample,
    _median,
    inferlb_config,
    interleaved,
    measure,
    start_nginx,
    wait_ready,
    wrk_script,
)
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from inferlb.ops.redis_server import RedisServer, find_redis_server
from inferlb.ops.stack import Child, Stack, free_ports

#: The gateways' route timeout and lease TTL (ms): an entry that never comes settles within the run.
REQUEST_TIMEOUT_MS = 3_000
LEASE_TTL_MS = 5_000


def metered_config(work: Path, n: int, backend: int, redis_url: str) -> Path:
    """``gateway_overhead.py``'s ext_authz config, metered, with ``n`` processes sharing ``redis_url``."""
    path = inferlb_config(work, f"authz-{n}", backend, protocol="ext_authz", accounting=True)
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    extra = n - 1
    ports = free_ports(1 + 3 * extra)
    doc["ext_proc"].update(
        quota_backend="redis",
        redis_url=redis_url,
        redis_key_prefix=f"bench-meter-{n}",
        meter_listen=f"127.0.0.1:{ports[0]}",
        extra_listen=[f"127.0.0.1:{p}" for p in ports[1 : 1 + extra]],
        extra_metrics_listen=[f"127.0.0.1:{p}" for p in ports[1 + extra : 1 + 2 * extra]],
        extra_meter_listen=[f"127.0.0.1:{p}" for p in ports[1 + 2 * extra :]],
    )
    # a bounded route and a short lease, so that a reservation whose entry never comes (a client that
    # left before the check's answer reached Envoy: wrk cuts its connections at each cell's end) expires
    # within the run
    doc["gateway"]["request_timeout_ms"] = REQUEST_TIMEOUT_MS
    doc["ext_proc"]["lease_ttl_ms"] = LEASE_TTL_MS
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def ledger(stack: Stack) -> list[dict[str, int]]:
    """Per process: admitted requests, settlements by outcome, entries ignored by reason."""
    ep = stack.config.ext_proc
    out = []
    for addr in (ep.metrics_listen, *ep.extra_metrics_addresses()):
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        row: dict[str, int] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "inferlb_requests_total" and s.labels.get("status") == "forwarded":
                    row["admitted"] = row.get("admitted", 0) + int(s.value)
                elif s.name == "inferlb_meter_settlements_total":
                    row[s.labels["outcome"]] = row.get(s.labels["outcome"], 0) + int(s.value)
                elif s.name == "inferlb_meter_entries_ignored_total":
                    row["ignored"] = row.get("ignored", 0) + int(s.value)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) and print its tables."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--processes", default="1,2,4", help="ext_authz process counts, one gateway each")
    p.add_argument("--duration", type=int, default=3, help="seconds per cell and round (1-30)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all cells (1-10)")
    p.add_argument("--connections", default="16")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if find_redis_server() is None:
        print("redis-server not found: apt-get install redis-server", file=sys.stderr)
        return 1
    counts = [int(x) for x in args.processes.split(",")]
    conns = [int(c) for c in args.connections.split(",")]
    duration, rounds = max(1, min(args.duration, 30)), max(1, min(args.rounds, 10))
    work = Path(tempfile.mkdtemp(prefix="meter-bench-"))
    script = wrk_script(work / "repeated.lua", unique=False)
    say = Console(stderr=True).log
    children: list[Child] = []
    stacks: dict[str, Stack] = {}
    with contextlib.ExitStack() as cleanup:
        (work / "redis").mkdir()
        redis = cleanup.enter_context(RedisServer(work / "redis"))
        try:
            (backend_port,) = free_ports(1)
            nginx = start_nginx(work, backend_port)
            children.append(nginx)
            assert nginx.proc is not None
            backend = [nginx.proc.pid]
            gateways: dict[str, Gateway] = {}
            for i, n in enumerate(counts):
                name = f"ext_authz metered x{n}"
                say(f"starting {name}")
                cfg = metered_config(work, n, backend_port, redis.url)
                base_id = (os.getpid() % 5_000) * 10 + 5 + i
                stack = Stack(cfg, workdir=work / f"x{n}", log_level="warning", base_id=base_id)
                stack.start(timeout_s=90)
                stacks[name] = stack
                pids = {c.name: c.proc.pid for c in stack.children if c.proc is not None}
                gw = Gateway(
                    name=name,
                    does=f"{n} ext_authz processes, {n} access loggers",
                    url=f"http://{stack.config.gateway.listen}{CHAT_PATH}",
                    procs={
                        "envoy": [pids["envoy"]],
                        "python": [pid for c, pid in pids.items() if c.startswith("ext_authz")],
                    },
                )
                problem = wait_ready(gw.url, None, 20)
                if problem is not None:
                    raise RuntimeError(f"{name} does not answer 200: {problem}")
                gateways[name] = gw
            for gw in gateways.values():  # warm-up
                wrk(gw.url, script, 4, 1, timeout_s=10)
            cells = interleaved(
                [(name, "repeated", c) for name in gateways for c in conns],
                rounds,
                random.Random(args.seed),
                lambda cell: measure(gateways[cell[0]], script, cell[2], duration, backend),
            )
            print_table(cells, conns, duration=duration, rounds=rounds)
            print_ledgers(stacks)
        finally:
            for stack in stacks.values():
                stack.stop()
            for c in children:
                c.stop()
    return 0


def print_table(
    cells: dict[tuple[str, str, int], list[Sample]], conns: list[int], *, duration: int, rounds: int
) -> None:
    """The load table of the module docstring."""
    table = Table(
        title=f"metered ext_authz by process count: POST {CHAT_PATH}, {duration} s per cell, median of "
        f"{rounds} rounds, cells shuffled per round"
    )
    for col in ("gateway", "conns", "req/s", "p50 ms", "p99 ms", "bad", "CPU us/req envoy", "python (all)"):
        table.add_column(col, justify="left" if col == "gateway" else "right")
    for (name, _, c), got in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        if c not in conns:
            continue
        table.add_row(
            name,
            str(c),
            f"{_median(got, lambda s: s.result.rps):,.0f}",
            f"{_median(got, lambda s: s.result.p50_ms):.2f}",
            f"{_median(got, lambda s: s.result.p99_ms):.2f}",
            str(sum(s.result.non_2xx + s.result.socket_errors for s in got)),
            f"{_median(got, lambda s: s.cpu_us['envoy']):.0f}",
            f"{_median(got, lambda s: s.cpu_us['python']):.0f}",
        )
    Console(width=200).print(table)


def print_ledgers(stacks: dict[str, Stack]) -> None:
    """After a drain of each Envoy and one lease TTL: admitted against settled, per process."""
    for stack in stacks.values():
        stack.drain_envoy()
    time.sleep(LEASE_TTL_MS / 1000 + 2)  # the TTL's sweep settles what never got an entry
    table = Table(title=f"after each Envoy's drain and {LEASE_TTL_MS} ms: admitted vs settled, per process")
    for col in (
        "gateway",
        "process",
        "admitted",
        "metered",
        "unmetered",
        "expired",
        "ignored",
        "settled = admitted",
    ):
        table.add_column(col, justify="left" if col == "gateway" else "right")
    for name, stack in stacks.items():
        for i, row in enumerate(ledger(stack)):
            settled = sum(
                row.get(k, 0) for k in ("metered", "unmetered", "produced", "not_served", "expired")
            )
            table.add_row(
                name,
                str(i),
                str(row.get("admitted", 0)),
                str(row.get("metered", 0)),
                str(row.get("unmetered", 0)),
                str(row.get("expired", 0)),
                str(row.get("ignored", 0)),
                "yes" if settled == row.get("admitted", 0) else f"NO ({settled})",
            )
    Console(width=200).print(table)


if __name__ == "__main__":
    sys.exit(main())
