"""The request path's CPU cost of live length classes per request (:mod:`ext_proc.length_state`); prints a
table.

For one length-aware model in three settings (classes by the cap; ``predict_output``; ``predict_output``
with ``capacity_guard_factor``), it times :meth:`~ext_proc.length_state.LengthState.decide`,
:meth:`~ext_proc.length_state.LengthState.hold` and :meth:`~ext_proc.length_state.LengthState.release`
(with a 40-token answer, so the predictor learns every answer) over ``--requests`` prepared chat requests,
each a new conversation capped at ``max_tokens`` 1,024, the cells interleaved round by round so machine
noise lands on every cell alike, and reports the median microseconds per request of ``--rounds`` rounds
(``time.process_time``: CPU, not wall). Parsing and counting the requests is outside the timing.

Usage: ``.venv/bin/python bench/length_prediction.py [--rounds 7] [--requests 2000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from ext_proc import handlers
from ext_proc.handlers import Gateway, PendingRequest, PreparedRequest
from ext_proc.length_state import LengthState
from ext_proc.metrics import ExtProcMetrics
from inferlb.config.schema import Config, parse_config
from inferlb.request.parsing import EndpointKind

CASES: dict[str, dict[str, Any]] = {
    "cap only": {},
    "predict_output": {"predict_output": True},
    "predict + guard": {"predict_output": True, "capacity_guard_factor": 1.5},
}


def config(length_aware: dict[str, Any]) -> Config:
    """One length-aware model on an H100 and two V100s, one tenant."""
    return parse_config(
        {
            "models": [
                {"name": "llama", "cluster": {"length_aware": {"long_output_tokens": 100, **length_aware}}}
            ],
            "endpoints": [
                {"address": f"10.0.0.{i}:80", "model": "llama", "gpu": g}
                for i, g in enumerate(("H100", "V100", "V100"), start=1)
            ],
            "tenants": [{"name": "t", "api_keys": ["sk-t-000001"]}],
        }
    )


def requests(cfg: Config, n: int) -> list[PreparedRequest]:
    """``n`` prepared chat requests, each its own question, capped at 1,024 tokens."""
    gateway = Gateway.from_config(cfg)
    pending = PendingRequest(
        tenant=cfg.tenants[0], kind=EndpointKind.CHAT_COMPLETIONS, path="/v1/chat/completions"
    )
    out = []
    for i in range(n):
        body = {
            "model": "llama",
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 1024,
        }
        p = handlers.prepare_body(gateway, pending, json.dumps(body).encode())
        assert isinstance(p, PreparedRequest), p
        out.append(p)
    return out


def main() -> None:
    """Time the cases interleaved and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    setups = {}
    for name, la in CASES.items():
        cfg = config(la)
        setups[name] = (cfg, LengthState(ExtProcMetrics()), requests(cfg, args.requests))
    cells: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, (cfg, length, prepared) in setups.items():
            cluster = cfg.models[0].cluster_name("v1")
            started = time.process_time()
            for p in prepared:
                hold = length.hold(length.decide(cfg, p, "v1"), cluster)
                assert hold is not None
                length.release(hold, 40)
            cells[name].append((time.process_time() - started) / len(prepared) * 1e6)
    base = statistics.median(cells["cap only"])
    table = Table(
        title=f"decide + hold + release per request (us CPU, median of {args.rounds} interleaved rounds "
        f"x {args.requests}; load {os.getloadavg()[0]:.1f})"
    )
    for col in ("length_aware", "us/request", "x cap only"):
        table.add_column(col, justify="left" if col == "length_aware" else "right")
    for name, values in cells.items():
        m = statistics.median(values)
        table.add_row(name, f"{m:.1f}", f"{m / base:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
