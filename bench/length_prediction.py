"""The request path's CPU cost of live length classes per request (:mod:`ext_proc.length_state`); prints a
table.

For one length-aware model in six settings, it times :meth:`~ext_proc.length_state.LengthState.decide`,
:meth:`~ext_proc.length_state.LengthState.hold` and :meth:`~ext_proc.length_state.LengthState.release`
(with a 40-token answer, so the predictor learns every answer) over ``--requests`` prepared chat requests,
each a new conversation capped at ``max_tokens`` 1,024, the cells interleaved round by round so machine
noise lands on every cell alike, and reports the median and the least microseconds per request of
``--rounds`` rounds (``time.process_time``: CPU, not wall). Parsing and counting the requests is outside
the timing; a last row times it (:func:`ext_proc.handlers.prepare_body`) in the same rounds, for scale.

The settings: classes by the cap without the per-cluster threshold state (the request path before learnt
thresholds); by the cap, the static thresholds checked against the caps seen (the default);
``predict_output``; ``predict_output`` with ``capacity_guard_factor``; ``learn_thresholds`` with its
defaults (a derivation every 10 s at most); and with a derivation at every request (the worst case).

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
    "cap only, unchecked": {},
    "cap only": {},
    "predict_output": {"predict_output": True},
    "predict + guard": {"predict_output": True, "capacity_guard_factor": 1.5},
    "learn_thresholds": {"learn_thresholds": True},
    "learn, derive each request": {"learn_thresholds": {"rederive_every_s": 0, "min_samples": 16}},
}


#: Cases timed without the per-cluster threshold state (no learner, no check of the static thresholds): the
#: request path as it was before learnt thresholds, for the cost of the check.
UNCHECKED: frozenset[str] = frozenset({"cap only, unchecked"})


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


def bodies(n: int) -> list[bytes]:
    """``n`` chat request bodies, each its own question, capped at 1,024 tokens."""
    return [
        json.dumps(
            {"model": "llama", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 1024}
        ).encode()
        for i in range(n)
    ]


def prepare(gateway: Gateway, cfg: Config, raw: list[bytes]) -> list[PreparedRequest]:
    """``raw`` parsed and counted by the request path (:func:`ext_proc.handlers.prepare_body`)."""
    pending = PendingRequest(
        tenant=cfg.tenants[0], kind=EndpointKind.CHAT_COMPLETIONS, path="/v1/chat/completions"
    )
    out = []
    for body in raw:
        p = handlers.prepare_body(gateway, pending, body)
        assert isinstance(p, PreparedRequest), p
        out.append(p)
    return out


def requests(cfg: Config, n: int) -> list[PreparedRequest]:
    """``n`` prepared chat requests, each its own question, capped at 1,024 tokens."""
    return prepare(Gateway.from_config(cfg), cfg, bodies(n))


def main() -> None:
    """Time the cases interleaved and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    setups = {}
    for name, la in CASES.items():
        cfg = config(la)
        length = LengthState(ExtProcMetrics())
        if name in UNCHECKED:
            length._cluster_thresholds = lambda *_: None  # type: ignore[method-assign]
        setups[name] = (cfg, length, requests(cfg, args.requests))
    scale = "for scale: prepare_body (parse + count)"
    cells: dict[str, list[float]] = {name: [] for name in [*CASES, scale]}
    scale_cfg = config({})
    scale_gateway, raw = Gateway.from_config(scale_cfg), bodies(args.requests)
    for _ in range(args.rounds):
        started = time.process_time()
        prepare(scale_gateway, scale_cfg, raw)
        cells[scale].append((time.process_time() - started) / len(raw) * 1e6)
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
    for col in ("length_aware", "us/request", "least", "x cap only"):
        table.add_column(col, justify="left" if col == "length_aware" else "right")
    for name, values in cells.items():
        m = statistics.median(values)
        table.add_row(name, f"{m:.1f}", f"{min(values):.1f}", f"{m / base:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
