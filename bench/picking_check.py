"""What endpoint picking adds to one ext_authz check, in-process (no sockets, no Envoy).

Run: ``.venv/bin/python bench/picking_check.py [--checks 2000] [--rounds 5] [--sizes 3,64,512]
[--modes load,approximate,precise]``. Prints one table; not a test.

Set-up: one model, one tenant with quota limits (every check is admitted, reserved and metered), a 3 KB
chat body repeated (the token count is cached after the first, so the check's own work is the floor the
pick adds to). Cells: picking ``off`` against ``load`` with an endpoint state of N endpoints in the model's
cluster (:class:`inferlb.policy.endpoint_book.EndpointBook`, as the poller fills it; every endpoint healthy,
a queue of 0-3 drawn once). Each check's pick is left again right after it (as its settlement would), so
the book's in-flight counts stay at what the telemetry says. ``approximate`` adds the prompt's block keys
(the same conversation every check: after the first, the memo's) and its index's match and record (the
index learns the prompt at its first pick, so every later check matches it in full on that endpoint);
``precise`` adds the keys and a match in an index that holds nothing (no subscriber runs here). Each cell
runs ``--checks`` checks once per round, the cells shuffled anew every round; a figure is the median over
the rounds of the process CPU time per check (``time.process_time``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from ext_authz.meter import Meter
from ext_proc.state import ExtProcState
from inferlb.config.schema import parse_config
from inferlb.policy.endpoint_book import BookedEndpoint, BookedState
from inferlb.request import headers as h

KEY = "sk-bench-0001"
CLUSTER = "m--v1"
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 64}
).encode()


def service(mode: str, size: int) -> CheckService:
    """A check service for the model with ``endpoint_picking.mode`` ``mode`` and, picking, a state of
    ``size`` endpoints."""
    config = parse_config(
        {
            "ext_proc": {"protocol": "ext_authz"},
            "models": [{"name": "m", "endpoint_picking": {"mode": mode}}],
            "tenants": [
                {"name": "t", "api_keys": [KEY], "requests_per_minute": 10**9, "tokens_per_minute": 10**12}
            ],
        }
    )
    state = ExtProcState(config)
    rng = random.Random(size)
    rows = tuple(
        BookedEndpoint(
            address=f"10.{i // 250}.{i % 250}.1:8000",
            weight=rng.choice((10, 17, 34)),
            healthy=True,
            waiting=rng.randint(0, 3),
            kv_usage=rng.random(),
            telemetry_age_ms=0,
        )
        for i in range(size)
    )
    state.picking.book.update(BookedState(clusters={CLUSTER: rows}, stale_after_ms=10**9), time.monotonic())
    return CheckService(state, meter=Meter(state))


def run_cell(svc: CheckService, checks: int) -> float:
    """CPU seconds per check over ``checks`` checks."""
    request = CheckRequest(
        method="POST",
        path="/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        body=BODY,
    )
    book = svc.state.picking.book
    started = time.process_time()
    for _ in range(checks):
        answer = svc.check(request)
        assert isinstance(answer, CheckAnswer) and answer.status == 200, answer
        picked = dict(answer.headers).get(h.DESTINATION_ENDPOINT)
        if picked is not None:
            book.leave(picked.split(",", 1)[0])
    return (time.process_time() - started) / checks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checks", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default="3,64,512")
    p.add_argument("--modes", default="load", help="picking modes to run beside off, comma-separated")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    cells = [("off", 0)] + [(m, n) for m in args.modes.split(",") for n in sizes]
    services = {c: service(*c) for c in cells}
    for c in cells:  # warm the token cache and the code paths
        run_cell(services[c], 50)
    results: dict[tuple[str, int], list[float]] = {c: [] for c in cells}
    for _ in range(args.rounds):
        order = cells[:]
        random.shuffle(order)
        for c in order:
            results[c].append(run_cell(services[c], args.checks))
    base = statistics.median(results[("off", 0)])
    table = Table(title=f"ext_authz check CPU, {args.checks} checks x {args.rounds} rounds (median)")
    for col in ("picking", "endpoints", "us / check", "added us", "x off"):
        table.add_column(col, justify="right")
    for mode, n in cells:
        med = statistics.median(results[(mode, n)])
        table.add_row(
            mode, str(n) if n else "-", f"{med * 1e6:.1f}", f"{(med - base) * 1e6:+.1f}", f"{med / base:.2f}"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
