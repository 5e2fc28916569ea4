"""Fleet-scale routing benchmark without Envoy: a discrete-event simulation of N GPUs (simulation.fleetsim).

Not a test: it prints tables and writes PNG plots. For a fleet of ``--gpus`` GPUs in the config's GPU mix,
each a ``simulation.gpusim.engine.BatchEngine`` with the config's ``simulation:`` timing, it replays the
bundled Azure LLM inference trace 2023 (conversation; Patel et al., "Splitwise", ISCA 2024; CC-BY 4.0) scaled
to each ``--loads`` fraction of the fleet's capacity, under six Envoy balancers (round robin, least request
(P2C), weighted least request with static capacity weights, with telemetry-driven weights from
``inferlb.policy.weights.step``, length-aware placement: long completions to the fast GPUs, by those weights,
and tiered placement: one length class per GPU class),
then a second run per policy at ``--throttle-load`` where ``--throttle-fraction``
of the H100s slow to half speed mid-way. See simulation/fleetsim/ for the model and every definition.

Usage: ``.venv/bin/python bench/fleet_sim.py [--gpus 1000] [--duration 60] [--out bench/out]``
(``--help`` for the rest). Needs matplotlib for the plots.

Held-out check of ``length_aware`` (its defaults were chosen on the whole trace with seed 1): replay only a
window of the trace (``--trace-window 0.5 1``, fractions of its span), take the long-output threshold from
another window (``--threshold-window 0 0.5``: the ``--long-percentile`` of that window's completion tokens,
fixed in tokens) or give it directly (``--long-tokens``), and change ``--seed``. The completion tokens are
what ``inferlb replay`` (and bench/routing.py) sends as ``max_tokens``, so the threshold is on the cap the
gateway sees; real clients' caps are only upper bounds of their outputs (often a default).

``tiered`` (every GPU class a tier: the longest outputs on the fastest tier only, and so on) takes its
thresholds from the rule :func:`inferlb.policy.length_aware.tier_thresholds` (``--tier-fraction``) over the
``--threshold-window`` (else the replayed rows); ``--long-rule`` gives ``length_aware`` its threshold by the
same rule, for a like-for-like two-tier row; ``--no-spill`` keeps every confined request in its tier set
as Envoy's subsets do (the default lets a saturated set spill to the next wider one). ``tiered_live`` is
``tiered`` whose class sets follow the GPUs' clock throttle as the xDS server's do with telemetry weights
(:func:`inferlb.policy.length_aware.live_class_sets`; ``Scenario.live_classes``): a throttled H100 brings the
next fastest GPUs into its classes until each class has its nominal capacity again.

**Real clients' caps** (``--cap-mode``, :func:`inferlb.traces.client_caps`): the cap the gateway sees is the
completion (``exact``, the default: a tight cap, which flatters length-aware placement), one default for
every request (``fixed``, ``--fixed-cap``), none (``none``: the model's ``default_max_tokens`` applies),
the completion rounded up to 256/512/1,024/2,048/4,096 (``rounded``), the completion x lognormal(0,
``--noise-sigma``) but never below it (``noise``: a cap is an upper bound), or a seeded mix of tenants of
those habits (``mix``: 40% noise, 40% fixed, 20% none). The GPUs still write the trace's completions (vLLM
stops at the end of sequence); only the classing changes. Every length-aware threshold is fitted on the
caps of the training window (``--threshold-window``; the caps drawn with another seed), never on the true
completions, except the contrast row ``tiered_truefit`` (thresholds fitted on the true completions, the way
before caps were modelled, while the clients send the mode's caps). ``tiered_predicted`` classes a request
whose cap is uninformative by :class:`inferlb.policy.output_predictor.OutputPredictor`'s prediction (taught
every true completion as it finishes; ``Scenario.predict_lengths``), its thresholds fitted on the values the
training window is classed by (:func:`simulation.fleetsim.workload.predicted_caps`). ``tiered_auto`` learns
its thresholds online from the caps it sees (:class:`inferlb.policy.threshold_learner.ThresholdLearner`,
``Scenario.learn_thresholds``), confining nothing until its first derivation. Every table gives each
policy's latency per true output-length class (the longest 30% of completions against the rest), so the
cost to short requests shows. ``--trace`` takes an Azure CSV or a Mooncake JSONL trace (``.jsonl``; its
block ids are dropped: these engines have no prefix cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

from plots import ATTRIBUTION, save_figure  # bench/plots.py
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import Config, load_config
from inferlb.policy.length_aware import DEFAULT_TIER_WORK_FRACTION, tier_thresholds
from inferlb.policy.weights import WeightParams
from inferlb.traces import (
    CAP_MODES,
    DEFAULT_TRACE,
    TraceRow,
    client_caps,
    read_mooncake_trace,
    read_trace,
)
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.results import FleetRunResult, share_series
from simulation.fleetsim.scenario import POLICIES, Policy, Scenario
from simulation.fleetsim.workload import (
    FleetGpu,
    fleet_capacity_rps,
    fleet_mix,
    long_output_threshold,
    predicted_caps,
    request_service_seconds,
    scale_trace,
    tiered_thresholds,
)
from simulation.gpusim.engine import BatchEngine, TimingModel

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "inferlb" / "data" / "local.yaml"


#: The benchmark's policy names: the simulator's, ``tiered_live`` (``tiered`` with live class sets),
#: ``tiered_predicted`` (classed by predicted lengths where caps are uninformative), ``tiered_truefit``
#: (thresholds fitted on the true completions: the contrast) and ``tiered_auto`` (thresholds learnt online).
BENCH_POLICIES: tuple[str, ...] = (
    *POLICIES,
    "tiered_live",
    "tiered_predicted",
    "tiered_truefit",
    "tiered_auto",
)


#: A run's figures with its load (label) and the benchmark's policy name.
Run = tuple[str, str, FleetRunResult]


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _class_cell(r: FleetRunResult, name: str) -> str:
    c = r.length_class(name)
    return "-" if c is None else f"{_fmt(c.e2e_p50_s)}/{_fmt(c.e2e_p99_s)}"


def _table(title: str, results: list[Run], *, throttle: bool) -> Table:
    t = Table(title=title, caption=ATTRIBUTION)
    for col in ("load", "policy", "e2e p50 s", "e2e p99 s", "TTFT p50 s", "TTFT p99 s", "tokens/s"):
        t.add_column(col, justify="right" if col not in ("policy",) else "left")
    for col in ("p99 / RR", "p99 / LR", "p99 / TW", "short e2e p50/p99", "long e2e p50/p99"):
        t.add_column(col, justify="right")
    for col in ("TTFT p50 short/long", "work spread pts"):
        t.add_column(col, justify="right")
    for col in ("work % H/A/V", "refused", "preempted", "long > tok (fallback)"):
        t.add_column(col, justify="right")
    # p99 ratios against round robin and least request at the same load (and scenario)
    ref = {(load, name): r.e2e_p99_s for load, name, r in results}
    if throttle:
        for col in ("share fell after s", "window s", "weight fell after s", "share post/pre"):
            t.add_column(col, justify="right")
    for load, name, r in results:
        wt = r.work_by_type
        short, long_ = r.length_class("short"), r.length_class("long")
        row = [
            load,
            name,
            _fmt(r.e2e_p50_s),
            _fmt(r.e2e_p99_s),
            _fmt(r.ttft_p50_s),
            _fmt(r.ttft_p99_s),
            f"{r.throughput_tokens_per_s:,.0f}",
            _fmt(r.e2e_p99_s / ref.get((load, "round_robin"), math.nan)),
            _fmt(r.e2e_p99_s / ref.get((load, "least_request"), math.nan)),
            _fmt(r.e2e_p99_s / ref.get((load, "telemetry_weights"), math.nan)),
            _class_cell(r, "short"),
            _class_cell(r, "long"),
            "-" if short is None or long_ is None else f"{_fmt(short.ttft_p50_s)}/{_fmt(long_.ttft_p50_s)}",
            _fmt(r.work_spread_pts, 1),
            "/".join(f"{wt.get(k, math.nan):.0f}" for k in ("H100", "A100", "V100")),
            f"{r.refused}" + (f" (+{r.unfinished} unfinished)" if r.unfinished else ""),
            f"{r.preemptions:,}",
            _long_cell(r),
        ]
        if throttle:
            s = r.shift
            row += [
                "never" if s is None or s.seconds is None else f"{s.seconds:.2f}",
                "-" if s is None else f"{s.window_s:.2f}",
                "-" if r.weight_shift_s is None else f"{r.weight_shift_s:.2f}",
                "-" if s is None or not s.pre_share else f"{s.post_share / s.pre_share:.2f}",
            ]
        t.add_row(*row)
    return t


def _long_cell(r: FleetRunResult) -> str:
    """``threshold: long requests (fallbacks)``; for ``tiered``, thresholds and requests per confined
    class, longest first."""
    if r.tier_thresholds is not None:
        if not r.tier_thresholds:
            return "no confined class"
        ts = "/".join(str(t) for t in r.tier_thresholds)
        counts = "/".join(f"{c:,}" for c in r.class_requests[:-1])
        live = f", sets changed {r.class_set_changes}x" if r.live_classes else ""
        pred = f", predicted {r.predicted_requests:,}" if r.predicted_requests else ""
        pred += f", learnt {r.threshold_changes}x" if r.threshold_changes else ""
        return f"{ts}: {counts} ({r.long_fallbacks:,}){live}{pred}"
    if r.long_output_threshold is None:
        return "-"
    if not r.class_requests[:-1]:
        return "no confined class"
    return f"{r.long_output_threshold}: {r.long_requests:,} ({r.long_fallbacks:,})"


def _plots(
    out: Path,
    n: int,
    base: list[Run],
    thr: list[Run],
    scenario_thr: Scenario,
) -> list[Path]:
    import matplotlib  # noqa: PLC0415 - only the benchmark needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    loads = sorted({load for load, _, _ in base})
    # 1. latency bars per policy and load
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(loads))
    for ax, (metric, label) in zip(
        axes, (("e2e_p99_s", "end-to-end p99 (s)"), ("ttft_p99_s", "TTFT p99 (s)")), strict=True
    ):
        for j, load in enumerate(loads):
            rs = [r for ld, _, r in base if ld == load]
            names = [nm for ld, nm, _ in base if ld == load]
            xs = [i + j * width for i in range(len(rs))]
            ax.bar(xs, [getattr(r, metric) for r in rs], width=width, label=f"load {load}")
            ax.set_xticks([i + width * (len(loads) - 1) / 2 for i in range(len(rs))])
            ax.set_xticklabels([nm.replace("_", "\n") for nm in names])
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{n} simulated GPUs: p99 latency per balancer (log scale)")
    paths.append(save_figure(fig, out / f"fleet_sim_{n}_latency.png"))
    # 2. per-GPU work utilization at the highest load, by policy
    top = loads[-1]
    rs = [r for ld, _, r in base if ld == top]
    names = [nm for ld, nm, _ in base if ld == top]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.boxplot([list(r.work_percent) for r in rs], whis=(0, 100))
    ax.set_xticks(range(1, len(rs) + 1))
    ax.set_xticklabels(names)
    ax.set_ylabel("per-GPU work utilization (% of capacity)")
    ax.set_title(f"{n} GPUs at load {top}: per-GPU utilization (box: quartiles, whiskers: min/max)")
    ax.grid(axis="y", alpha=0.3)
    paths.append(save_figure(fig, out / f"fleet_sim_{n}_utilization.png"))
    # 3. throttled GPUs' share of arrivals over time, relative to before the fault
    if thr and scenario_thr.throttle_at_s is not None:
        fault = scenario_thr.throttle_at_s
        targets = frozenset(scenario_thr.throttle_gpus)
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for _, name, r in thr:
            pre = r.shift.pre_share if r.shift is not None and r.shift.pre_share else math.nan
            bin_s = max(0.5, (r.shift.window_s if r.shift else 1.0) / 2)
            series = share_series(
                r.arrival_times,
                r.arrival_gpus,
                targets,
                start=max(0.0, fault - 10.0),
                end=scenario_thr.duration_s,
                bin_s=bin_s,
            )
            ax.plot([t - fault for t, _ in series], [s / pre for _, s in series], label=name)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.axhline(0.6, color="grey", lw=0.8, ls="--")
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("seconds since the throttle (half speed)")
        ax.set_ylabel("throttled GPUs' share of arrivals / pre-fault share")
        ax.set_title(f"{n} GPUs: {len(targets)} H100(s) throttled to half speed")
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(save_figure(fig, out / f"fleet_sim_{n}_throttle_share.png"))
    return paths


def main() -> None:
    """Parse arguments, run every scenario, print the tables, write the plots."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="inferlb config (GPU mix, timing)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.7, 0.9], help="fractions of capacity")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (simulated)")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds left out of the figures")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=BENCH_POLICIES)
    ap.add_argument("--throttle-load", type=float, default=0.9)
    ap.add_argument("--throttle-fraction", type=float, default=0.01, help="of the fleet; at least 1 GPU")
    ap.add_argument("--throttle-at", type=float, default=None, help="default: the middle of the run")
    ap.add_argument("--push-delay", type=float, default=None, help="s; default: xds.push_debounce_ms")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--long-percentile", type=float, default=70.0, help="length_aware: completions above it are long"
    )
    ap.add_argument(
        "--long-min-capacity", type=float, default=1.5, help="length_aware: fast set's min relative capacity"
    )
    ap.add_argument(
        "--long-tokens",
        type=int,
        default=None,
        help="length_aware: fixed threshold (tokens), not a percentile",
    )
    ap.add_argument(
        "--trace-window",
        type=float,
        nargs=2,
        default=(0.0, 1.0),
        metavar=("START", "END"),
        help="replay only this part of the trace (fractions of its span)",
    )
    ap.add_argument(
        "--threshold-window",
        type=float,
        nargs=2,
        default=None,
        metavar=("START", "END"),
        help="length_aware: the threshold is --long-percentile of this part of the trace (fractions)",
    )
    ap.add_argument(
        "--tier-fraction",
        type=float,
        default=DEFAULT_TIER_WORK_FRACTION,
        help="tiered (and length_aware with --long-rule): share of each tier set's capacity its confined "
        "requests may take (inferlb.policy.length_aware.tier_thresholds)",
    )
    ap.add_argument(
        "--long-rule",
        action="store_true",
        help="length_aware: the threshold by the tiered rule for the fast set, not a percentile",
    )
    ap.add_argument(
        "--no-spill",
        action="store_true",
        help="length_aware/tiered: a saturated tier set never spills to a wider one (as Envoy's subsets)",
    )
    ap.add_argument("--no-throttle", action="store_true", help="skip the throttle runs")
    ap.add_argument("--cap-mode", choices=CAP_MODES, default="exact", help="how clients set max_tokens")
    ap.add_argument("--fixed-cap", type=int, default=1024, help="tokens: the cap of --cap-mode fixed (mix)")
    ap.add_argument(
        "--default-cap", type=int, default=None, help="tokens: the model default; default: the config's"
    )
    ap.add_argument("--noise-sigma", type=float, default=0.5, help="--cap-mode noise: lognormal sigma")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    args = ap.parse_args()

    console = Console(width=250)
    config: Config = load_config(args.config)
    gpus = fleet_mix(config, args.gpus)
    models = {g.gpu_type: TimingModel.for_endpoint(config, g.endpoint) for g in gpus}

    def make_engine(g: FleetGpu) -> BatchEngine:
        return BatchEngine(model=models[g.gpu_type])

    all_rows = read_any_trace(args.trace)
    rows = trace_part(all_rows, *args.trace_window)
    # The thresholds are learnt from the threshold window (the training part) when one is given, else
    # from the replayed rows (in-sample), on the caps its clients send (drawn with another seed).
    true_train = trace_part(all_rows, *args.threshold_window) if args.threshold_window is not None else rows
    default_cap = args.default_cap if args.default_cap is not None else config.models[0].default_max_tokens
    args.default_cap = default_cap

    def caps(part: list[TraceRow], seed: int) -> list[TraceRow]:
        return client_caps(
            part,
            args.cap_mode,
            seed=seed,
            fixed_cap=args.fixed_cap,
            default_cap=default_cap,
            noise_sigma=args.noise_sigma,
        )

    train = caps(true_train, args.seed + 1000)
    ref_model = models[gpus[0].gpu_type]
    args.tier_thresholds = tiered_thresholds(gpus, ref_model, train, fraction=args.tier_fraction)
    args.truefit_thresholds = tiered_thresholds(gpus, ref_model, true_train, fraction=args.tier_fraction)
    args.predicted_thresholds = tiered_thresholds(
        gpus, ref_model, predicted_caps(train, default_cap), fraction=args.tier_fraction
    )
    if args.long_rule:
        fast = [g.relative_capacity for g in gpus if g.relative_capacity >= args.long_min_capacity]
        share = sum(fast) / sum(g.relative_capacity for g in gpus)
        samples = [
            (r.output_cap, request_service_seconds(ref_model, r.prompt_tokens, r.output_tokens))
            for r in train
        ]
        # no GPU reaches the fast set's capacity (one GPU class): no threshold confines anything
        (args.long_tokens,) = tier_thresholds([share], samples, fraction=args.tier_fraction) if fast else (0,)
    elif args.threshold_window is not None:
        args.long_tokens = long_output_threshold(train, args.long_percentile)
    if args.trace_window != (0.0, 1.0) or args.long_tokens is not None:
        if args.long_tokens is None:
            rule = f"p{args.long_percentile:g} of the arrivals"
        elif args.threshold_window is None:
            rule = f"{args.long_tokens} tokens"
        else:
            lo, hi = args.threshold_window
            how = (
                f"work rule, fraction {args.tier_fraction:g}"
                if args.long_rule
                else f"p{args.long_percentile:g}"
            )
            rule = f"{args.long_tokens} tokens ({how} of window {lo:g}-{hi:g})"
        lo, hi = args.trace_window
        console.print(
            f"trace window {lo:g}-{hi:g} of the span: {len(rows):,} rows; length_aware threshold: {rule}; "
            f"seed {args.seed}"
        )
    if {"tiered", "tiered_live", "tiered_predicted", "tiered_truefit"} & set(args.policies):
        src = (
            "the replayed rows"
            if args.threshold_window is None
            else "window {:g}-{:g}".format(*args.threshold_window)
        )
        console.print(
            f"tiered thresholds (longest class first; work rule, fraction {args.tier_fraction:g}, "
            f"from {src}) "
            f"on the caps seen: {'/'.join(map(str, args.tier_thresholds)) or 'none'}; on the predicted "
            f"lengths: {'/'.join(map(str, args.predicted_thresholds)) or 'none'}; on the true completions "
            f"(contrast): {'/'.join(map(str, args.truefit_thresholds)) or 'none'} tokens"
        )
    console.print(
        f"trace {args.trace.name}: {len(rows):,} rows; cap mode {args.cap_mode} (fixed {args.fixed_cap}, "
        f"default {default_cap}, noise sigma {args.noise_sigma:g})"
    )
    capacity = fleet_capacity_rps([models[g.gpu_type] for g in gpus], rows)
    params = WeightParams.from_config(config.weights)
    policy_cfg = config.models[0].cluster
    push_delay = args.push_delay if args.push_delay is not None else config.xds.push_debounce_ms / 1000
    period = config.telemetry.scrape_interval_ms / 1000
    mix = {t: sum(1 for g in gpus if g.gpu_type == t) for t in models}
    console.print(
        f"fleet: {args.gpus} GPUs {mix}; capacity {capacity:,.1f} req/s (full batches of the trace's mix); "
        f"telemetry every {period:.2f} s, push delay {push_delay:.2f} s, active_request_bias "
        f"{policy_cfg.active_request_bias}"
    )
    wall0 = time.perf_counter()
    base: list[Run] = []
    for load in args.loads:
        arrivals = caps(scale_trace(rows, rate_rps=load * capacity, duration_s=args.duration), args.seed)
        console.print(f"load {load}: {len(arrivals):,} requests at {load * capacity:,.1f} req/s")
        for policy in args.policies:
            t0 = time.perf_counter()
            sc = _scenario(
                policy, args, push_delay=push_delay, period=period, bias=policy_cfg.active_request_bias
            )
            r = simulate(gpus, make_engine, arrivals, sc, params)
            console.print(f"  {policy}: {time.perf_counter() - t0:.1f} s wall, {r.events:,} events")
            base.append((str(load), policy, r))
    if args.no_throttle:
        wall = time.perf_counter() - wall0
        console.print(
            _table(f"{args.gpus} simulated GPUs, {args.duration:.0f} s of arrivals", base, throttle=False)
        )
        console.print(f"simulation wall time: {wall:.1f} s")
        return
    h100 = [g.index for g in gpus if g.gpu_type == "H100"] or [g.index for g in gpus]
    k = max(1, round(args.throttle_fraction * args.gpus))
    targets = tuple(h100[:: max(1, len(h100) // k)][:k])
    throttle_at = args.throttle_at if args.throttle_at is not None else args.duration / 2
    arrivals = caps(
        scale_trace(rows, rate_rps=args.throttle_load * capacity, duration_s=args.duration), args.seed
    )
    thr: list[Run] = []
    sc_thr = _scenario(
        "round_robin", args, push_delay=push_delay, period=period, bias=policy_cfg.active_request_bias
    )
    console.print(f"throttle: {len(targets)} GPU(s) {targets} to half speed at {throttle_at:.1f} s")
    for policy in args.policies:
        t0 = time.perf_counter()
        sc_thr = _scenario(
            policy,
            args,
            push_delay=push_delay,
            period=period,
            bias=policy_cfg.active_request_bias,
            targets=targets,
            throttle_at=throttle_at,
        )
        r = simulate(gpus, make_engine, arrivals, sc_thr, params)
        console.print(f"  {policy}: {time.perf_counter() - t0:.1f} s wall, {r.events:,} events")
        thr.append((str(args.throttle_load), policy, r))
    wall = time.perf_counter() - wall0
    console.print(
        _table(f"{args.gpus} simulated GPUs, {args.duration:.0f} s of arrivals", base, throttle=False)
    )
    console.print(
        _table(
            f"{args.gpus} GPUs, {len(targets)} H100(s) at half speed from {throttle_at:.0f} s",
            thr,
            throttle=True,
        )
    )
    console.print(f"simulation wall time: {wall:.1f} s")
    for p in _plots(args.out, args.gpus, base, thr, sc_thr):
        console.print(f"wrote {p}")


def read_any_trace(path: Path) -> list[TraceRow]:
    """A Mooncake JSONL trace (``.jsonl``; block ids dropped: this benchmark's engines have no prefix
    cache) or an Azure CSV trace.

    Raises:
        inferlb.traces.TraceError: the file cannot be read as such a trace.
    """
    if path.suffix == ".jsonl":
        return [dataclasses.replace(r, block_hashes=()) for r in read_mooncake_trace(path)]
    return read_trace(path)


def trace_part(rows: list[TraceRow], start: float, end: float) -> list[TraceRow]:
    """The rows whose offset lies in ``[start, end)`` of the trace's span (fractions; ``end`` 1.0 keeps the
    last row), offsets kept (:func:`simulation.fleetsim.workload.scale_trace` re-times them).

    Raises:
        SystemExit: the fractions are not ``0 <= start < end <= 1`` or the part holds no row.
    """
    if not 0.0 <= start < end <= 1.0:
        raise SystemExit(f"a trace window needs 0 <= START < END <= 1, got {start} {end}")
    span = rows[-1].offset_s - rows[0].offset_s
    lo, hi = rows[0].offset_s + start * span, rows[0].offset_s + end * span
    part = [r for r in rows if lo <= r.offset_s < hi or (end == 1.0 and r.offset_s == hi)]
    if not part:
        raise SystemExit(f"the trace window {start} {end} holds no request")
    return part


def _scenario(
    policy: str,
    args: argparse.Namespace,
    *,
    push_delay: float,
    period: float,
    bias: float,
    targets: tuple[int, ...] = (),
    throttle_at: float | None = None,
) -> Scenario:
    live = policy == "tiered_live"
    sim_policy: Policy = "tiered" if policy.startswith("tiered") else policy  # type: ignore[assignment]
    thresholds = (
        args.predicted_thresholds
        if policy == "tiered_predicted"
        else args.truefit_thresholds
        if policy == "tiered_truefit"
        else args.tier_thresholds
    )
    return Scenario(
        policy=sim_policy,
        live_classes=live,
        duration_s=args.duration,
        warmup_s=args.warmup,
        telemetry_period_s=period,
        push_delay_s=push_delay,
        active_request_bias=bias,
        throttle_at_s=throttle_at,
        throttle_gpus=targets,
        seed=args.seed,
        long_output_percentile=args.long_percentile,
        long_min_relative_capacity=args.long_min_capacity,
        long_output_tokens=args.long_tokens,
        tier_thresholds=thresholds,
        spill=not args.no_spill,
        predict_lengths=policy == "tiered_predicted",
        learn_thresholds=policy == "tiered_auto",
        default_max_tokens=args.default_cap,
    )


if __name__ == "__main__":
    main()
