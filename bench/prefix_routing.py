"""Prefix-aware routing at fleet scale, without Envoy: the discrete-event simulation (simulation.fleetsim) of
``--gpus`` GPUs of the config's mix (1,000: 250 H100, 375 A100, 375 V100), each a ``BatchEngine`` with a
``PrefixCache`` of 512-token blocks over its KV budget, under five placements. Not a test: it prints a
table and writes PNG plots.

Placements (:mod:`simulation.fleetsim.balancers`):

* ``round_robin`` and ``least_request``: Envoy's balancers, blind to the prompt.
* ``ring_hash``: Envoy's ring hash with bounded load (``hash_balance_factor`` 150) on the request's prefix
  key, the first ``affinity_blocks`` block ids (Mooncake: 2 blocks, the conversation's opening, as the
  gateway's prefix key covers the messages up to the first user message; shared-prefix: the system
  prompt's blocks, which is a better key than the live prefix key would give, since its single-turn
  questions differ: the best case for ring hash).
* ``approximate``: the endpoint picker (:func:`inferlb.policy.picker.pick`) over an
  :class:`inferlb.policy.prefix_index.ApproximatePrefixIndex` learnt from its own picks (per-GPU capacity
  the engine's cache blocks).
* ``precise``: the same picker over the engines' real prefix caches (what perfect KV events give: a block
  counts once its engine schedules the request that computes it).
* ``precise_speculative``: ``precise`` plus the picks not yet scheduled, as llm-d's speculative entries.

Workloads:

(a) the Mooncake conversation trace (Qin et al., "Mooncake", USENIX FAST 2025; ``hash_ids`` of 512-token
    blocks, chained), superposed and time-scaled to each ``--loads`` fraction of the fleet's capacity
    (:func:`simulation.fleetsim.workload.scale_trace`; copies of the trace stand for other users and share
    no block with each other);
(b) a shared-prefix workload shaped like llm-d's prefix-cache benchmark
    (:class:`simulation.fleetsim.workload.SharedPrefixSpec`: ``--groups-per-gpu`` x GPUs groups of a
    6,000-token system prompt, 5 users per group each with its own 1,200-token question, 1,000 completion
    tokens; Poisson arrivals) at each ``--sp-loads`` fraction of capacity (the ladder).

Capacity is the fleet's rate with full batches and no cache hit (:func:`simulation.fleetsim.workload.
fleet_capacity_rps`), so hits leave headroom. Per run: TTFT p50/p90/p99, end-to-end p50/p99, output
tokens/s, the prefix-cache hit rate (prompt tokens found cached over prompt tokens looked up, in the window)
against the workload's *ideal* (one never-evicting cache that sees every request: the most any placement
can hit), and each GPU's time-averaged in-flight requests: max over mean, raw and per unit of capacity
(in-flight / ``relative_capacity``; the picker weighs by capacity, so an H100 is meant to carry more).

Usage: ``.venv/bin/python bench/prefix_routing.py --mooncake shared/traces/mooncake/mooncake_conversation_
trace.jsonl [--quick] [--gpus 1000] [--duration 60] [--out bench/out]`` (``--help`` for the rest).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plots import save_figure  # bench/plots.py
from prefix_cache import ideal_hits  # bench/prefix_cache.py
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import Config, load_config
from inferlb.policy.picker import PickerWeights
from inferlb.traces import MOONCAKE_BLOCK_TOKENS, TraceRow, read_mooncake_trace
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.results import FleetRunResult
from simulation.fleetsim.scenario import Policy, Scenario
from simulation.fleetsim.workload import (
    FleetGpu,
    SharedPrefixSpec,
    fleet_capacity_rps,
    fleet_mix,
    scale_trace,
    shared_prefix_rows,
)
from simulation.gpusim.engine import BatchEngine, TimingModel
from simulation.kvcache import PrefixCache

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "inferlb" / "data" / "local.yaml"
PREFIX_POLICIES: tuple[Policy, ...] = (
    "round_robin",
    "least_request",
    "ring_hash",
    "approximate",
    "precise",
    "precise_speculative",
)
MOONCAKE_ATTRIBUTION = (
    "Trace: Mooncake conversation trace, Qin et al., 'Mooncake', USENIX FAST 2025 (Apache-2.0)"
)
SHARED_ATTRIBUTION = (
    "Workload: synthetic shared prefix (groups x 6,000-token system prompt, 5 users, 1,200-token questions)"
)


@dataclass(frozen=True)
class Run:
    """One simulated run and what it is of."""

    workload: str
    load: float
    rate_rps: float
    ideal_hit_rate: float
    result: FleetRunResult
    capacity: tuple[float, ...]
    wall_s: float

    @property
    def in_flight_ratio(self) -> float:
        """Max over mean of the GPUs' time-averaged in-flight requests."""
        xs = self.result.mean_in_flight
        mean = sum(xs) / len(xs)
        return max(xs) / mean if mean > 0 else float("nan")

    @property
    def per_capacity_ratio(self) -> float:
        """The same per unit of capacity (in-flight / relative_capacity)."""
        xs = [x / c for x, c in zip(self.result.mean_in_flight, self.capacity, strict=True)]
        mean = sum(xs) / len(xs)
        return max(xs) / mean if mean > 0 else float("nan")

    @property
    def of_ideal(self) -> float:
        """Hit rate over the ideal's."""
        return (
            self.result.prefix_cache_hit_rate / self.ideal_hit_rate if self.ideal_hit_rate else float("nan")
        )


def ideal_hit_rate(rows: list[TraceRow], *, start_s: float, end_s: float) -> float:
    """The ideal hit rate of the rows arriving in ``[start_s, end_s)`` (``bench/prefix_cache.py``'s
    :func:`ideal_hits`: one never-evicting cache that saw every row before them)."""
    hits, queries = ideal_hits(rows, start_s=start_s, end_s=end_s, block_tokens=MOONCAKE_BLOCK_TOKENS)
    return hits / queries if queries else float("nan")


def run_one(
    config: Config,
    gpus: tuple[FleetGpu, ...],
    rows: list[TraceRow],
    scenario: Scenario,
) -> tuple[FleetRunResult, float]:
    """One run with fresh cached engines; (result, wall seconds)."""

    def make(g: FleetGpu) -> BatchEngine:
        model = TimingModel.for_endpoint(config, g.endpoint)
        cache = PrefixCache.for_budget(model.kv_budget_tokens, block_size=MOONCAKE_BLOCK_TOKENS)
        return BatchEngine(model=model, prefix_cache=cache)

    t0 = time.perf_counter()
    r = simulate(gpus, make, rows, scenario)
    return r, time.perf_counter() - t0


def table(title: str, runs: list[Run], caption: str) -> Table:
    t = Table(title=title, caption=caption)
    cols = ("load", "req/s", "policy", "TTFT p50 s", "p90 s", "p99 s", "e2e p50 s", "p99 s", "out tok/s",
            "hit rate", "ideal", "of ideal", "in-flight max/mean", "per capacity", "wall s")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for x in runs:
        r = x.result
        cells = [
            f"{x.load:.0%}",
            f"{x.rate_rps:.0f}",
            r.policy,
            *(f"{v:.2f}" for v in (r.ttft_p50_s, r.ttft_p90_s, r.ttft_p99_s)),
            *(f"{v:.1f}" for v in (r.e2e_p50_s, r.e2e_p99_s)),
            f"{r.throughput_tokens_per_s:,.0f}",
            f"{r.prefix_cache_hit_rate:.1%}",
            f"{x.ideal_hit_rate:.1%}",
            f"{x.of_ideal:.0%}",
            f"{x.in_flight_ratio:.2f}",
            f"{x.per_capacity_ratio:.2f}",
            f"{x.wall_s:.0f}",
        ]
        t.add_row(*cells)
    return t


def targets(runs: list[Run], console: Console) -> None:
    """The targets at the highest load of each workload, as measured."""
    for workload in sorted({x.workload for x in runs}):
        rs = [x for x in runs if x.workload == workload]
        top = max(x.load for x in rs)
        at = {x.result.policy: x for x in rs if x.load == top}
        for p in ("approximate", "precise", "precise_speculative"):
            if p in at:
                x = at[p]
                console.print(
                    f"{workload} @ {top:.0%}, {p}: hit rate {x.of_ideal:.0%} of ideal (target >= 90%); "
                    f"in-flight max/mean {x.in_flight_ratio:.2f}, per capacity {x.per_capacity_ratio:.2f} "
                    "(target <= 1.3)"
                )
        if "precise" in at and "least_request" in at:
            ratio = at["precise"].result.ttft_p90_s / at["least_request"].result.ttft_p90_s
            console.print(
                f"{workload} @ {top:.0%}: precise TTFT p90 / least_request = {ratio:.3f} (target <= 0.1)"
            )


def plots(out: Path, runs: list[Run], n: int) -> list[Path]:
    import matplotlib  # noqa: PLC0415 - only the benchmark needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for workload, attribution in (("mooncake", MOONCAKE_ATTRIBUTION), ("shared-prefix", SHARED_ATTRIBUTION)):
        rs = [x for x in runs if x.workload == workload]
        if not rs:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        for policy in PREFIX_POLICIES:
            ps = sorted((x for x in rs if x.result.policy == policy), key=lambda x: x.load)
            if not ps:
                continue
            loads = [100 * x.load for x in ps]
            axes[0].plot(loads, [x.result.ttft_p90_s for x in ps], marker="o", label=policy)
            axes[1].plot(loads, [100 * x.of_ideal for x in ps], marker="o", label=policy)
            axes[2].plot(loads, [x.result.throughput_tokens_per_s for x in ps], marker="o", label=policy)
        axes[0].set_ylabel("TTFT p90 (s, log)")
        axes[0].set_yscale("log")
        axes[1].set_ylabel("prefix-cache hit rate (% of ideal)")
        axes[1].axhline(90, color="grey", lw=0.8, ls="--")
        axes[2].set_ylabel("output tokens/s")
        for ax in axes:
            ax.set_xlabel("offered load (% of no-hit capacity)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{n} simulated GPUs, {workload}: placement by prefix")
        paths.append(save_figure(fig, out / f"prefix_routing_{n}_{workload}.png", attribution))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--mooncake", type=Path, help="the Mooncake JSONL trace (for the mooncake workload)")
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds left out of the figures")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.7, 0.9], help="Mooncake load fractions")
    ap.add_argument(
        "--sp-loads", type=float, nargs="+", default=[0.5, 0.7, 0.9, 1.1], help="shared-prefix ladder"
    )
    ap.add_argument("--groups-per-gpu", type=float, default=1.5)
    ap.add_argument("--policies", nargs="+", default=list(PREFIX_POLICIES), choices=PREFIX_POLICIES)
    ap.add_argument("--workloads", nargs="+", default=["mooncake", "shared-prefix"],
                    choices=["mooncake", "shared-prefix"])  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="20 s runs (5 s warm-up), the top load only")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--load-factor", type=float, default=PickerWeights().load_factor, help="the picker's guard"
    )
    ap.add_argument("--prefix-weight", type=float, default=PickerWeights().prefix)
    ap.add_argument("--candidates", type=int, default=0, help="the picker's sampled candidates (0: exact)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.warmup = 20.0, 5.0
        args.loads, args.sp_loads = [max(args.loads)], [max(args.sp_loads)]
    config = load_config(args.config)
    gpus = fleet_mix(config, args.gpus)
    models = [TimingModel.for_endpoint(config, g.endpoint) for g in gpus]
    capacity = tuple(g.relative_capacity for g in gpus)
    console = Console(width=200)
    runs: list[Run] = []
    weights = PickerWeights(
        load_factor=args.load_factor, prefix=args.prefix_weight, candidates=args.candidates
    )

    def scenario(policy: Policy, affinity_blocks: int) -> Scenario:
        return Scenario(policy=policy, duration_s=args.duration, warmup_s=args.warmup, seed=args.seed,
                        affinity_blocks=affinity_blocks, picker_weights=weights,
                        block_tokens=MOONCAKE_BLOCK_TOKENS)  # fmt: skip

    def series(
        workload: str,
        loads: list[float],
        make_rows: Callable[[float], tuple[list[TraceRow], float]],
        affinity_blocks: int,
    ) -> None:
        for load in loads:
            rows, rate = make_rows(load)
            ideal = ideal_hit_rate(rows, start_s=args.warmup, end_s=args.duration)
            for policy in args.policies:
                r, wall = run_one(config, gpus, rows, scenario(policy, affinity_blocks))
                runs.append(Run(workload, load, rate, ideal, r, capacity, wall))
                x = runs[-1]
                console.print(
                    f"  {workload} {load:.0%} {policy}: TTFT p50/p90/p99 {r.ttft_p50_s:.2f}/"
                    f"{r.ttft_p90_s:.2f}/{r.ttft_p99_s:.2f} s, "
                    f"e2e p50/p99 {r.e2e_p50_s:.1f}/{r.e2e_p99_s:.1f} s, "
                    f"{r.throughput_tokens_per_s:,.0f} tok/s, hit {r.prefix_cache_hit_rate:.1%} "
                    f"({x.of_ideal:.0%} of ideal {ideal:.1%}), in-flight max/mean {x.in_flight_ratio:.2f} "
                    f"(per capacity {x.per_capacity_ratio:.2f}); {wall:.0f} s",
                    highlight=False,
                )

    if "mooncake" in args.workloads:
        if args.mooncake is None:
            ap.error("the mooncake workload needs --mooncake FILE (or --workloads shared-prefix)")
        trace = read_mooncake_trace(args.mooncake)
        cap = fleet_capacity_rps(models, trace)

        def mooncake_rows(load: float) -> tuple[list[TraceRow], float]:
            return scale_trace(trace, rate_rps=load * cap, duration_s=args.duration), load * cap

        series("mooncake", args.loads, mooncake_rows, 2)
    if "shared-prefix" in args.workloads:
        spec = SharedPrefixSpec(groups=max(1, round(args.groups_per_gpu * args.gpus)))
        probe = [TraceRow(offset_s=0.0, prompt_tokens=spec.prompt_tokens, output_tokens=spec.output_tokens)]
        sp_cap = fleet_capacity_rps(models, probe)

        def sp_rows(load: float) -> tuple[list[TraceRow], float]:
            rate = load * sp_cap
            return shared_prefix_rows(spec, rate_rps=rate, duration_s=args.duration, seed=args.seed), rate

        series("shared-prefix", args.sp_loads, sp_rows, spec.system_tokens // MOONCAKE_BLOCK_TOKENS)
    caption = (
        f"{args.gpus} GPUs; arrivals {args.duration:.0f} s, figures after {args.warmup:.0f} s; "
        f"picker weights prefix {weights.prefix}, load {weights.load}, tokens {weights.tokens}, "
        f"decode {weights.decode}, load_factor {weights.load_factor}, candidates {weights.candidates}; "
        f"seed {args.seed}"
    )
    for workload in ("mooncake", "shared-prefix"):
        rs = [x for x in runs if x.workload == workload]
        if rs:
            console.print(table(f"{workload}: {args.gpus} simulated GPUs, 512-token blocks", rs, caption))
    targets(runs, console)
    for p in plots(args.out, runs, args.gpus):
        console.print(f"wrote {p}")


if __name__ == "__main__":
    main()
