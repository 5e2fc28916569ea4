"""Length-aware placement under real clients' output caps, in the fleet simulation (bench/fleet_sim.py's
model, no Envoy): every cap mode x policy on one trace, one table.

Not a test: it prints a table and writes a PNG plot. The policies that never read a request's cap
(``round_robin``, ``least_request``, ``static_weights``, ``telemetry_weights``) run once; the length-aware
ones (``tiered``, ``length_aware`` (two tiers, by the same rule: ``--long-rule`` of fleet_sim.py),
``tiered_predicted``, ``tiered_auto``, ``tiered_truefit``) once per ``--cap-modes`` entry, each with its
thresholds fitted on the caps of the training window (``--threshold-window``) as the clients of that mode
send them (:func:`inferlb.traces.client_caps`, drawn with another seed than the replayed window's), except
``tiered_truefit`` (fitted on the true completions: the way before caps were modelled) and
``tiered_auto`` (learnt online). See bench/fleet_sim.py's docstring for each policy and cap mode.

Each row gives the all-request e2e p50/p99 and TTFT p50, the p99 over least request's (LR) and telemetry
weights' (TW) at the same load, and per true output-length class (the longest 30% of completions, "long",
and the rest, "short") the e2e p50/p99 and TTFT p50, so the cost to short requests shows. The summary
checks the targets: with every cap mode the tiered policies' p99 <= 1.0x TW and <= 0.7x LR; with
predicted lengths and uninformative caps (``fixed``, ``none``, ``mix``) at least half of the exact-cap gain,
the gain being ``1 - p99 / p99(TW)``.

Usage: ``.venv/bin/python bench/fleet_caps.py --trace PATH --gpus 1000 --loads 0.9 --duration 60``
(``--help`` for the rest; ~15 s of wall time per run at 1,000 GPUs on one core).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from fleet_sim import DEFAULT_CONFIG, _scenario, read_any_trace, trace_part  # bench/fleet_sim.py
from plots import save_figure  # bench/plots.py
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import load_config
from inferlb.policy.length_aware import DEFAULT_TIER_WORK_FRACTION, tier_thresholds
from inferlb.policy.weights import WeightParams
from inferlb.traces import CAP_MODES, DEFAULT_TRACE, CapMode, TraceRow, client_caps
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.results import FleetRunResult
from simulation.fleetsim.workload import (
    FleetGpu,
    fleet_capacity_rps,
    fleet_mix,
    predicted_caps,
    request_service_seconds,
    scale_trace,
    tiered_thresholds,
)
from simulation.gpusim.engine import BatchEngine, TimingModel

#: Policies that never read a request's cap: one run per load.
CAP_BLIND: tuple[str, ...] = ("round_robin", "least_request", "static_weights", "telemetry_weights")
#: Policies that class by the cap: one run per load and cap mode.
CAP_READING: tuple[str, ...] = ("tiered", "length_aware", "tiered_predicted", "tiered_auto", "tiered_truefit")
#: Cap modes whose caps carry (near) no length: where predicted lengths must earn their keep.
UNINFORMATIVE: frozenset[str] = frozenset({"fixed", "none", "mix"})

#: One run: (load label, cap mode or "-", policy, figures).
Cell = tuple[str, str, str, FleetRunResult]


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _classes(r: FleetRunResult) -> str:
    if r.tier_thresholds is not None:
        if not r.tier_thresholds or not any(r.class_requests[:-1]):
            return f"{'/'.join(map(str, r.tier_thresholds)) or '-'}: none confined"
        counts = "/".join(f"{c:,}" for c in r.class_requests[:-1])
        extra = f", pred {r.predicted_requests:,}" if r.predicted_requests else ""
        extra += f", learnt {r.threshold_changes}x" if r.threshold_changes else ""
        return f"{'/'.join(map(str, r.tier_thresholds))}: {counts} ({r.long_fallbacks:,}){extra}"
    if r.long_output_threshold is not None:
        if not r.long_requests:
            return f"{r.long_output_threshold}: none confined"
        return f"{r.long_output_threshold}: {r.long_requests:,} ({r.long_fallbacks:,})"
    return "-"


def table(title: str, cells: list[Cell]) -> Table:
    """The runs of one trace: one row per (load, cap mode, policy)."""
    t = Table(title=title, caption="Azure LLM inference trace 2023 (CC-BY 4.0) / Mooncake (Apache-2.0)")
    cols: tuple[str, ...] = (
        "load",
        "caps",
        "policy",
        "e2e p50 s",
        "e2e p99 s",
        "TTFT p50 s",
        "p99/LR",
        "p99/TW",
    )
    cols += ("short p50/p99 s", "long p50/p99 s", "TTFT p50 short/long", "refused", "work % H/A/V")
    cols += ("thresholds: confined (spilled)",)
    for c in cols:
        t.add_column(
            c, justify="left" if c in ("caps", "policy", "thresholds: confined (spilled)") else "right"
        )
    ref = {(load, p): r.e2e_p99_s for load, _, p, r in cells if p in CAP_BLIND}
    for load, mode, policy, r in cells:
        s, lg = r.length_class("short"), r.length_class("long")
        wt = r.work_by_type
        t.add_row(
            load,
            mode,
            policy,
            _fmt(r.e2e_p50_s),
            _fmt(r.e2e_p99_s),
            _fmt(r.ttft_p50_s),
            _fmt(r.e2e_p99_s / ref.get((load, "least_request"), math.nan)),
            _fmt(r.e2e_p99_s / ref.get((load, "telemetry_weights"), math.nan)),
            "-" if s is None else f"{_fmt(s.e2e_p50_s)}/{_fmt(s.e2e_p99_s)}",
            "-" if lg is None else f"{_fmt(lg.e2e_p50_s)}/{_fmt(lg.e2e_p99_s)}",
            "-" if s is None or lg is None else f"{_fmt(s.ttft_p50_s)}/{_fmt(lg.ttft_p50_s)}",
            f"{r.refused:,}" + (f" (+{r.unfinished:,})" if r.unfinished else ""),
            "/".join(f"{wt.get(k, math.nan):.0f}" for k in ("H100", "A100", "V100")),
            _classes(r),
        )
    return t


def summary(cells: list[Cell]) -> list[str]:
    """The targets, per load: met or not, with the numbers."""
    out: list[str] = []
    for load in sorted({c[0] for c in cells}):
        at = [c for c in cells if c[0] == load]
        ref = {p: r.e2e_p99_s for _, _, p, r in at if p in CAP_BLIND}
        tw, lr = ref.get("telemetry_weights", math.nan), ref.get("least_request", math.nan)
        for policy in ("tiered", "tiered_auto"):
            rows = [(m, r.e2e_p99_s) for _, m, p, r in at if p == policy]
            if not rows:
                continue
            ok_tw = all(p99 <= tw for _, p99 in rows)
            ok_lr = all(p99 <= 0.7 * lr for _, p99 in rows)
            detail = ", ".join(f"{m} {p99 / tw:.2f}/{p99 / lr:.2f}" for m, p99 in rows)
            out.append(
                f"load {load}: {policy} p99 <= 1.0x TW with every cap mode: {'met' if ok_tw else 'NOT met'}; "
                f"<= 0.7x LR: {'met' if ok_lr else 'NOT met'} (p99/TW / p99/LR: {detail})"
            )
        exact = next((r.e2e_p99_s for _, m, p, r in at if p == "tiered" and m == "exact"), math.nan)
        gain_exact = 1 - exact / tw
        for _, m, p, r in at:
            if p == "tiered_predicted" and m in UNINFORMATIVE:
                gain = 1 - r.e2e_p99_s / tw
                share = gain / gain_exact if gain_exact > 0 else math.nan
                out.append(
                    f"load {load}: predicted lengths with {m} caps: gain {gain:+.2f} vs exact caps' "
                    f"{gain_exact:+.2f} (gain = 1 - p99/TW): {_fmt(share)} of it; target >= 0.5 "
                    f"{'met' if share >= 0.5 else 'NOT met'}"
                )
    return out


def plot(out: Path, stem: str, title: str, cells: list[Cell]) -> Path:
    """p99 over telemetry weights' per cap mode and length-aware policy, at the highest load."""
    import matplotlib  # noqa: PLC0415 - only the benchmark needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    top = max(c[0] for c in cells)
    at = [c for c in cells if c[0] == top]
    ref = {p: r.e2e_p99_s for _, _, p, r in at if p in CAP_BLIND}
    tw = ref.get("telemetry_weights", math.nan)
    modes = [m for m in CAP_MODES if any(c[1] == m for c in at)]
    policies = [p for p in CAP_READING if any(c[2] == p for c in at)]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.8 / max(1, len(policies))
    for j, p in enumerate(policies):
        ys = [next((r.e2e_p99_s / tw for _, m2, p2, r in at if m2 == m and p2 == p), math.nan) for m in modes]
        ax.bar([i + j * width for i in range(len(modes))], ys, width=width, label=p)
    if "least_request" in ref:
        ax.axhline(ref["least_request"] / tw, color="k", ls="--", lw=0.9, label="least_request")
    ax.axhline(1.0, color="grey", lw=0.9, label="telemetry_weights")
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(modes))])
    ax.set_xticklabels(modes)
    ax.set_xlabel("how clients set max_tokens")
    ax.set_ylabel("e2e p99 / telemetry weights' p99")
    ax.set_title(f"{title}, load {top}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    out.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out / f"{stem}.png")


def main() -> None:
    """Parse arguments, run the matrix, print the table and the targets, write the plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure CSV or Mooncake JSONL")
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.9])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (simulated)")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cap-modes", nargs="+", choices=CAP_MODES, default=list(CAP_MODES))
    ap.add_argument("--policies", nargs="+", choices=CAP_BLIND + CAP_READING, default=None)
    ap.add_argument("--trace-window", type=float, nargs=2, default=(0.5, 1.0), metavar=("START", "END"))
    ap.add_argument("--threshold-window", type=float, nargs=2, default=(0.0, 0.5), metavar=("START", "END"))
    ap.add_argument("--tier-fraction", type=float, default=DEFAULT_TIER_WORK_FRACTION)
    ap.add_argument("--long-min-capacity", type=float, default=1.5)
    ap.add_argument("--fixed-cap", type=int, default=1024)
    ap.add_argument("--default-cap", type=int, default=None, help="tokens; default: the config's")
    ap.add_argument("--noise-sigma", type=float, default=0.5)
    ap.add_argument(
        "--some-modes",
        nargs="+",
        default=[],
        metavar="POLICY=MODE,MODE",
        help="run POLICY only with these cap modes (the rest: every --cap-modes entry), to fit a time budget",
    )
    ap.add_argument("--no-spill", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--stem", default=None, help="plot file name (default: fleet_caps_<trace>_<gpus>)")
    args = ap.parse_args()
    policies = args.policies or ["round_robin", "least_request", "telemetry_weights", *CAP_READING]
    only: dict[str, set[str]] = {}
    for item in args.some_modes:
        name, _, modes = item.partition("=")
        if name not in CAP_READING or not set(modes.split(",")) <= set(CAP_MODES):
            ap.error(f"--some-modes {item!r}: need POLICY=MODE,MODE with a cap-reading policy and cap modes")
        only[name] = set(modes.split(","))

    console = Console(width=260)
    config = load_config(args.config)
    gpus = fleet_mix(config, args.gpus)
    models = {g.gpu_type: TimingModel.for_endpoint(config, g.endpoint) for g in gpus}

    def make_engine(g: FleetGpu) -> BatchEngine:
        return BatchEngine(model=models[g.gpu_type])

    all_rows = read_any_trace(args.trace)
    rows = trace_part(all_rows, *args.trace_window)
    true_train = trace_part(all_rows, *args.threshold_window)
    default_cap = args.default_cap if args.default_cap is not None else config.models[0].default_max_tokens
    ref_model = models[gpus[0].gpu_type]
    capacity = fleet_capacity_rps([models[g.gpu_type] for g in gpus], rows)
    params = WeightParams.from_config(config.weights)
    bias = config.models[0].cluster.active_request_bias
    push_delay = config.xds.push_debounce_ms / 1000
    period = config.telemetry.scrape_interval_ms / 1000
    mix = {t: sum(1 for g in gpus if g.gpu_type == t) for t in models}
    console.print(
        f"trace {args.trace.name}: replayed window {args.trace_window[0]:g}-{args.trace_window[1]:g} "
        f"({len(rows):,} rows), thresholds from window {args.threshold_window[0]:g}-"
        f"{args.threshold_window[1]:g}; fleet {args.gpus} GPUs {mix}, capacity {capacity:,.1f} req/s; "
        f"caps: fixed {args.fixed_cap}, default {default_cap}, noise sigma {args.noise_sigma:g}; "
        f"seed {args.seed}"
    )

    def caps(part: list[TraceRow], mode: CapMode, seed: int) -> list[TraceRow]:
        return client_caps(
            part,
            mode,
            seed=seed,
            fixed_cap=args.fixed_cap,
            default_cap=default_cap,
            noise_sigma=args.noise_sigma,
        )

    def fit(mode: CapMode) -> argparse.Namespace:
        train = caps(true_train, mode, args.seed + 1000)
        fast = [g.relative_capacity for g in gpus if g.relative_capacity >= args.long_min_capacity]
        share = sum(fast) / sum(g.relative_capacity for g in gpus)
        samples = [
            (r.output_cap, request_service_seconds(ref_model, r.prompt_tokens, r.output_tokens))
            for r in train
        ]
        ns = argparse.Namespace(
            duration=args.duration,
            warmup=args.warmup,
            seed=args.seed,
            long_percentile=70.0,
            long_min_capacity=args.long_min_capacity,
            long_tokens=(tier_thresholds([share], samples, fraction=args.tier_fraction) if fast else (0,))[0],
            tier_thresholds=tiered_thresholds(gpus, ref_model, train, fraction=args.tier_fraction),
            truefit_thresholds=tiered_thresholds(gpus, ref_model, true_train, fraction=args.tier_fraction),
            predicted_thresholds=tiered_thresholds(
                gpus, ref_model, predicted_caps(train, default_cap), fraction=args.tier_fraction
            ),
            no_spill=args.no_spill,
            default_cap=default_cap,
        )
        console.print(
            f"  caps {mode}: tiered thresholds on the caps seen {'/'.join(map(str, ns.tier_thresholds))}, on "
            f"the predicted lengths {'/'.join(map(str, ns.predicted_thresholds))}, on the true completions "
            f"{'/'.join(map(str, ns.truefit_thresholds))}; length_aware {ns.long_tokens}"
        )
        return ns

    cells: list[Cell] = []
    wall0 = time.perf_counter()
    for load in args.loads:
        base = scale_trace(rows, rate_rps=load * capacity, duration_s=args.duration)
        console.print(f"load {load}: {len(base):,} requests at {load * capacity:,.1f} req/s")
        blind_ns = fit("exact")
        for policy in [p for p in policies if p in CAP_BLIND]:
            t0 = time.perf_counter()
            sc = _scenario(policy, blind_ns, push_delay=push_delay, period=period, bias=bias)
            r = simulate(gpus, make_engine, base, sc, params)
            console.print(f"    {policy}: {time.perf_counter() - t0:.1f} s wall")
            cells.append((str(load), "-", policy, r))
        for mode in args.cap_modes:
            ns = fit(mode)
            arrivals = caps(base, mode, args.seed)
            for policy in [p for p in policies if p in CAP_READING and mode in only.get(p, {mode})]:
                t0 = time.perf_counter()
                sc = _scenario(policy, ns, push_delay=push_delay, period=period, bias=bias)
                r = simulate(gpus, make_engine, arrivals, sc, params)
                console.print(f"    {mode} {policy}: {time.perf_counter() - t0:.1f} s wall")
                cells.append((str(load), mode, policy, r))
    title = f"{args.gpus} simulated GPUs, {args.duration:.0f} s of arrivals, {args.trace.name}"
    console.print(table(title, cells))
    for line in summary(cells):
        console.print(line)
    console.print(f"simulation wall time: {time.perf_counter() - wall0:.1f} s")
    stem = args.stem or f"fleet_caps_{args.trace.stem}_{args.gpus}"
    console.print(f"wrote {plot(args.out, stem, title, cells)}")


if __name__ == "__main__":
    main()
