"""Routing benchmark: the Azure conversation trace through the live stack on a simulated heterogeneous fleet,
under six balancing policies, at ~70% and ~90% of the fleet's capacity, and with one GPU throttled mid-run.

Not a test: it prints a table and writes PNG plots under ``bench/out/``. For each run it

1. writes a config with one model served by 8 simulated GPUs of 3 types (2 x H100, 3 x A100, 3 x V100;
   relative capacity 3.4 / 1.7 / 1.0, 14.9 V100-units in all) and starts the whole stack (gpusim, xds_server,
   ext_proc, a real Envoy) with :class:`inferlb.ops.stack.Stack`;
2. applies the policy:

   - ``rr-equal``: Envoy ``ROUND_ROBIN``, every weight pinned to 1 over the fleet API (``PUT /v1/weights``);
   - ``lr-equal``: Envoy ``LEAST_REQUEST`` (``active_request_bias`` 1.0), every weight pinned to 1;
   - ``static``: ``LEAST_REQUEST`` with the capacity weights (``weights.mode: static``: 34 / 17 / 10);
   - ``telemetry``: ``LEAST_REQUEST`` with the telemetry weights (``weights.mode: telemetry``, the default
     policy parameters, ``/metrics`` and ``/sim/telemetry`` scraped every 500 ms);
   - ``length-aware``: ``telemetry`` plus length-aware placement (``cluster.length_aware``,
     :mod:`inferlb.policy.length_aware`): requests whose ``max_tokens`` exceeds ``--long-tokens`` (default:
     the config default, 384, chosen in the 1,000-GPU simulation) go to the GPUs of relative capacity >=
     ``--long-min-capacity`` (1.5: the H100s and A100s) through Envoy's subset load balancer; the others to
     every GPU. By default the replay's ``max_tokens`` is the trace's completion length
     (:func:`inferlb.ops.replay.plan`), so the gateway knows each output length exactly: the best case for
     this policy, since real clients send an upper bound (often a default). ``--cap-mode`` sends the caps
     of another client habit instead (:func:`inferlb.traces.client_caps`: ``fixed`` ``--fixed-cap``,
     ``none``, ``rounded``, ``noise``, ``mix``), and every request carries gpusim's
     ``x-gpusim-eos-after`` header with its true completion, so the simulated server still writes the
     trace's length (as vLLM stops at the end of sequence); the ``length-tiered`` thresholds are then
     fitted on the training window's caps of that habit;
   - ``length-tiered``: ``telemetry`` plus tiered placement (``cluster.length_aware.tiers``): the longest
     requests on the H100s only, the next on the H100s and A100s, the rest anywhere. The thresholds come
     from the rule :func:`inferlb.policy.length_aware.tier_thresholds` (fraction ``--tier-fraction``, default
     0.75) over the *first half* of the trace (the training window; the run's own window is held out
     when ``--trace-start`` lies in the second half, from 1751 s), printed before the runs. With
     ``weights.mode: telemetry`` the classes' GPU sets are live (:func:`inferlb.policy.length_aware.
     live_class_sets`): when ``h100-0`` throttles, the next fastest GPUs join its classes, so "on their
     tiers" (by GPU type) then counts fewer than all;

3. replays a window of ``inferlb/data/azure_llm_2023_conv.csv`` (Azure LLM inference trace 2023, Patel et
   al., "Splitwise", ISCA 2024; CC-BY 4.0) with :func:`inferlb.ops.replay.plan` /
   :func:`~inferlb.ops.replay.send_all` (streamed chat completions, so the client measures TTFT), compressed
   in time so that its request rate is the target fraction of the fleet's capacity and the replay lasts
   ``--load-s`` seconds;
4. in the throttle scenario, puts ``h100-0`` at half speed (``POST /sim/fault`` throttle 2.0: clock halved,
   thermal reason set) half-way through the load;
5. reads each GPU's busy seconds (``gpusim:gpu_busy_seconds_total``) before and after the load, and polls
   Envoy's ``/clusters`` every 250 ms for the throttled GPU's weight.

**Capacity** (requests/s) comes from the simulation parameters (simulation/gpusim/engine.py's timing model):
at a full batch of ``B`` sequences one decode step of a GPU of capacity ``c`` takes ``(1 + 0.02 (B - 1)) / (c
D)`` s and yields ``B`` tokens, a prefill of ``p`` tokens takes ``p / (c P)`` s, so a request costs ``c``-GPU
seconds ``E[p] / (c P) + E[o] (1 + 0.02 (B - 1)) / (c D B)``, and the fleet serves ``sum(c) / (E[p] / P + E[o]
(1 + 0.02 (B - 1)) / (D B))`` requests/s with ``E[p]``, ``E[o]`` the means of the replayed window. It is the
saturation rate with every batch full: a real fleet never reaches it (batches are not always full), so
"90%" is a heavy load. The simulated GPUs run at ``--decode-tps`` (40) tokens/s per sequence and
``--prefill-tps`` (6000) tokens/s at capacity 1.0, faster than ``local.yaml``'s 30 / 4000 (same ratios
between GPU types) so that more requests fit in a short run.

Figures: latency (arrival to last token) and TTFT p50/p99 of successful requests, measured by the client;
throughput (successful requests/s and completion tokens/s over the replay's wall time); utilization per GPU
over the load window (busy seconds / wall seconds; spread = max - min); errors (non-200 and transport
errors); for the throttle scenario, the seconds from the throttle until the throttled GPU's share of
dispatched requests (2-s sliding window) fell below 75% of its share before the throttle (``-`` when it never
did), and for the telemetry policy, until Envoy's weight for it fell by 25%.

Limits: everything (Envoy, ext_proc, xds_server, 8 simulated GPUs in one process, the client) shares this
machine's cores, so latencies include CPU contention; one run per cell (no repetitions); the simulated GPUs
are a timing model, not real GPUs.

Usage: ``.venv/bin/python bench/routing.py [--load-s 45] [--loads 0.7,0.9] [--policies ...]
[--out bench/out]``.
Needs matplotlib (a benchmark extra).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from plots import ATTRIBUTION, save_figure  # bench/plots.py
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import Config, LengthAwareRouting, LengthTier, parse_config
from inferlb.ops.replay import (
    Outcome,
    PlannedRequest,
    plan,
    send_all,
)
from inferlb.ops.stack import Stack, clusters_json, free_ports
from inferlb.ops.status import host_rows
from inferlb.policy.length_aware import (
    DEFAULT_TIER_WORK_FRACTION,
    SHORT,
    allowed_classes,
    length_class,
    tier_capacity_shares,
    tier_thresholds,
)
from inferlb.traces import CAP_MODES, DEFAULT_TRACE, TraceRow, client_caps, percentile, read_trace, window
from simulation.fleetsim.workload import request_service_seconds
from simulation.gpusim.engine import BATCH_SLOWDOWN_PER_SEQUENCE, TimingModel
from simulation.gpusim.server import EOS_AFTER_HEADER

MODEL = "bench-model"
CLUSTER = f"{MODEL}--v1"
TOKEN = "bench-routing-token-0123456789"
API_KEY = "sk-bench-routing"
FLEET = (("h100", "H100", 2), ("a100", "A100", 3), ("v100", "V100", 3))
THROTTLED = "h100-0"
POLICIES = ("rr-equal", "lr-equal", "static", "telemetry", "length-aware", "length-tiered")
#: The policies whose weights follow the telemetry.
TELEMETRY_POLICIES = frozenset({"telemetry", "length-aware", "length-tiered"})
#: The policies with a ``cluster.length_aware`` block.
LENGTH_POLICIES = frozenset({"length-aware", "length-tiered"})


def config_doc(
    policy: str,
    *,
    prefill_tps: float,
    decode_tps: float,
    max_batch: int,
    length_aware: LengthAwareRouting | None = None,
) -> dict[str, Any]:
    """The bench config for one policy on free ports (``length_aware``: the ``length-aware`` or
    ``length-tiered`` policy's block; the two-tier defaults when None)."""
    n = sum(k for _, _, k in FLEET)
    ports = free_ports(6 + n)
    endpoints = []
    i = 6
    for prefix, gpu, count in FLEET:
        for j in range(count):
            endpoints.append(
                {
                    "name": f"{prefix}-{j}",
                    "address": f"127.0.0.1:{ports[i]}",
                    "model": MODEL,
                    "gpu": gpu,
                    "simulated": True,
                }
            )
            i += 1
    return {
        "gateway": {
            "listen": f"127.0.0.1:{ports[0]}",
            "admin": f"127.0.0.1:{ports[1]}",
            "num_retries": 0,
            "concurrency": 1,
        },
        "xds": {
            "listen": f"127.0.0.1:{ports[2]}",
            "api_listen": f"127.0.0.1:{ports[3]}",
            "api_token": TOKEN,
            "push_debounce_ms": 50,
        },
        "ext_proc": {
            "listen": f"127.0.0.1:{ports[4]}",
            "metrics_listen": f"127.0.0.1:{ports[5]}",
            # response accounting streams every SSE chunk through ext_proc: not what this bench measures
            "account_responses": False,
        },
        "gpu_profiles": {
            "H100": {"relative_capacity": 3.4, "memory_gb": 80},
            "A100": {"relative_capacity": 1.7, "memory_gb": 80},
            "V100": {"relative_capacity": 1.0, "memory_gb": 32},
        },
        "simulation": {
            "prefill_tokens_per_s": prefill_tps,
            "decode_tokens_per_s": decode_tps,
            "max_batch": max_batch,
            "max_queue": 4096,
        },
        "weights": {"mode": "telemetry" if policy in TELEMETRY_POLICIES else "static"},
        "models": [
            {
                "name": MODEL,
                "context_length": 32768,
                "cluster": {
                    "lb_policy": "round_robin" if policy == "rr-equal" else "least_request",
                    **(
                        {
                            "length_aware": (length_aware or LengthAwareRouting()).model_dump(
                                exclude_unset=True
                            )
                        }
                        if policy in LENGTH_POLICIES
                        else {}
                    ),
                },
            }
        ],
        "endpoints": endpoints,
        "tenants": [{"name": "bench", "api_keys": [API_KEY]}],
    }


def fleet_capacity_rps(config: Config, rows: Sequence[TraceRow]) -> float:
    """Saturation request rate of the fleet for requests like ``rows`` (see the module doc)."""
    sim = config.simulation
    mean_p = statistics.fmean(r.prompt_tokens for r in rows)
    mean_o = statistics.fmean(max(1, r.output_tokens) for r in rows)
    b = sim.max_batch
    per_unit_s = mean_p / sim.prefill_tokens_per_s + mean_o * (1 + BATCH_SLOWDOWN_PER_SEQUENCE * (b - 1)) / (
        sim.decode_tokens_per_s * b
    )
    units = sum(config.gpu_profiles[e.gpu].relative_capacity for e in config.endpoints)
    return units / per_unit_s


def _http(method: str, url: str, body: dict[str, Any] | None = None, timeout_s: float = 5.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        raw = resp.read()
    ctype = resp.headers.get("Content-Type", "")
    return json.loads(raw) if "json" in ctype else raw.decode()


def envoy_weights(config: Config) -> dict[str, int]:
    """Envoy's current weight per endpoint name (``/clusters``)."""
    return {r.name: r.weight for r in host_rows(config, clusters_json(config))}


def busy_seconds(config: Config) -> dict[str, float]:
    """``gpusim:gpu_busy_seconds_total`` per endpoint name."""
    out = {}
    for e in config.endpoints:
        text = _http("GET", f"http://{e.address}/metrics")
        for line in str(text).splitlines():
            if line.startswith("gpusim:gpu_busy_seconds_total"):
                out[e.display_name] = float(line.rsplit(" ", 1)[1])
    return out


def wait_for(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` every 100 ms until true. Raises RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


@dataclass
class RunResult:
    """One (policy, load, scenario) run."""

    policy: str
    load: float
    scenario: str
    rate_rps: float
    sent: int
    ok: int
    errors: int
    wall_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    tokens_per_s: float
    utilization: dict[str, float]
    share_fell_after_s: float | None = None
    weight_fell_after_s: float | None = None
    share_series: list[tuple[float, float]] = field(default_factory=list)
    weight_series: list[tuple[float, int]] = field(default_factory=list)

    @property
    def spread(self) -> float:
        """Utilization spread max - min (percentage points)."""
        return (
            max(self.utilization.values()) - min(self.utilization.values()) if self.utilization else math.nan
        )


def _share_series(
    planned: Sequence[PlannedRequest], outcomes: Sequence[Outcome], endpoint: str, *, window_s: float = 2.0
) -> list[tuple[float, float]]:
    """The share of dispatched requests that went to ``endpoint``, in a sliding window, every 0.5 s (by the
    request's planned send time; requests without an endpoint are left out)."""
    at = {p.index: p.at_s for p in planned}
    points = sorted((at[o.index], o.endpoint == endpoint) for o in outcomes if o.endpoint)
    if not points:
        return []
    end = points[-1][0]
    out = []
    t = window_s
    while t <= end + 1e-9:
        inside = [hit for s, hit in points if t - window_s <= s < t]
        if inside:
            out.append((t, sum(inside) / len(inside)))
        t += 0.5
    return out


def rule_tiers(rows: Sequence[TraceRow], args: argparse.Namespace) -> LengthAwareRouting:
    """The ``length-tiered`` block: :func:`inferlb.policy.length_aware.tier_thresholds` (fraction
    ``args.tier_fraction``) over ``rows`` (the training window, with its clients' caps) for the bench fleet,
    each request's work priced by the bench's timing model from its true completion."""
    config = parse_config(
        config_doc(
            "length-tiered",
            prefill_tps=args.prefill_tps,
            decode_tps=args.decode_tps,
            max_batch=args.max_batch,
        )
    )
    model = TimingModel.for_endpoint(config, config.endpoints[0])
    tiers = tier_capacity_shares([config.gpu_profiles[e.gpu].relative_capacity for e in config.endpoints])
    samples = [(r.output_cap, request_service_seconds(model, r.prompt_tokens, r.output_tokens)) for r in rows]
    thresholds = tier_thresholds([share for _, share in tiers], samples, fraction=args.tier_fraction)
    # A class whose threshold equals a longer class's holds no cap (one default cap gives (1024, 1024)):
    # left out, as the config takes strictly falling thresholds.
    kept = [
        (t, c) for i, (t, (c, _)) in enumerate(zip(thresholds, tiers, strict=True)) if t not in thresholds[:i]
    ]
    return LengthAwareRouting(
        tiers=tuple(LengthTier(above_output_tokens=t, min_relative_capacity=c) for t, c in kept)
    )


def run_one(
    *,
    policy: str,
    load: float,
    scenario: str,
    rows_all: Sequence[TraceRow],
    args: argparse.Namespace,
    out: Console,
) -> RunResult:
    """Start the stack for ``policy``, replay at ``load`` x capacity, return the figures."""
    doc = config_doc(
        policy,
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        max_batch=args.max_batch,
        length_aware=LengthAwareRouting.model_validate(args.tiered)
        if policy == "length-tiered"
        else LengthAwareRouting(
            long_output_tokens=args.long_tokens, fast_min_relative_capacity=args.long_min_capacity
        ),
    )
    config = parse_config(doc)
    # the trace's rate over a long stretch gives the speed-up; then take the window that lasts --load-s
    head = window(rows_all, start_s=args.trace_start, duration_s=600)
    capacity = fleet_capacity_rps(config, head)
    trace_rps = len(head) / 600
    speedup = load * capacity / trace_rps
    rows = window(rows_all, start_s=args.trace_start, duration_s=args.load_s * speedup, speedup=speedup)
    rows = client_caps(
        rows[: args.max_requests],
        args.cap_mode,
        seed=1,
        fixed_cap=args.fixed_cap,
        default_cap=config.models[0].default_max_tokens,
    )
    planned = plan(config, rows, model=MODEL)
    if args.cap_mode != "exact":
        # the simulated server writes the true completion whatever the cap (vLLM stops at end of sequence)
        planned = [
            replace(q, headers=((EOS_AFTER_HEADER, str(max(1, r.output_tokens))),))
            for q, r in zip(planned, rows, strict=True)
        ]
    with tempfile.TemporaryDirectory(prefix="inferlb-bench-") as work:
        path = Path(work) / "inferlb.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        stack = Stack(path, workdir=work, log_level="warning")
        stack.start(timeout_s=60)
        try:
            api = f"http://{config.xds.api_listen}"
            names = [e.display_name for e in config.endpoints]
            if policy in ("rr-equal", "lr-equal"):
                _http("PUT", api + "/v1/weights", {"weights": {str(e.address): 1 for e in config.endpoints}})
                wait_for(lambda: set(envoy_weights(config).values()) == {1}, "equal weights in Envoy")
            elif policy in TELEMETRY_POLICIES:
                wait_for(lambda: envoy_weights(config)[THROTTLED] == 340, "telemetry weights in Envoy")
            weight_series: list[tuple[float, int]] = []
            stop = threading.Event()
            t0 = time.monotonic()

            def poll_weights() -> None:
                while not stop.is_set():
                    # a missed poll is a gap in the plot, not a failure
                    with contextlib.suppress(OSError, KeyError, ValueError):
                        weight_series.append((time.monotonic() - t0, envoy_weights(config)[THROTTLED]))
                    stop.wait(0.25)

            def throttle_later() -> None:
                if not stop.wait(args.load_s / 2):
                    addr = next(str(e.address) for e in config.endpoints if e.display_name == THROTTLED)
                    _http("POST", f"http://{addr}/sim/fault", {"action": "throttle", "factor": 2.0})

            poller = threading.Thread(target=poll_weights, daemon=True)
            poller.start()
            thrower = threading.Thread(target=throttle_later, daemon=True) if scenario == "throttle" else None
            before = busy_seconds(config)
            t_load = time.monotonic()
            if thrower is not None:
                thrower.start()
            busy_end: dict[str, float] = {}
            load_end = [0.0]

            async def replay() -> list[Outcome]:
                async def sample_end() -> None:
                    await asyncio.sleep(args.load_s)
                    load_end[0] = time.monotonic()
                    busy_end.update(await asyncio.to_thread(busy_seconds, config))

                sampler = asyncio.create_task(sample_end())
                result = await send_all(
                    str(config.gateway.listen), planned, stream=True, timeout_s=args.request_timeout
                )
                await sampler
                return result

            outcomes = asyncio.run(replay())
            wall = time.monotonic() - t_load
            stop.set()
            poller.join(timeout=5)
            if thrower is not None:
                thrower.join(timeout=5)
            span = load_end[0] - t_load
            util = {n: 100 * (busy_end[n] - before[n]) / span for n in names}
        finally:
            stack.stop()
    ok = [o for o in outcomes if o.status == 200]
    lat = [o.latency_s for o in ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    result = RunResult(
        policy=policy,
        load=load,
        scenario=scenario,
        rate_rps=len(planned) / args.load_s,
        sent=len(outcomes),
        ok=len(ok),
        errors=len(outcomes) - len(ok),
        wall_s=wall,
        latency_p50_s=percentile(lat, 50),
        latency_p99_s=percentile(lat, 99),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        throughput_rps=len(ok) / wall,
        tokens_per_s=sum(o.completion_tokens for o in ok) / wall,
        utilization=util,
        weight_series=weight_series,
    )
    if scenario == "throttle":
        t_throttle = args.load_s / 2
        series = _share_series(planned, outcomes, THROTTLED)
        result.share_series = series
        before_share = [s for t, s in series if t <= t_throttle]
        baseline = statistics.fmean(before_share) if before_share else math.nan
        fell = next((t for t, s in series if t > t_throttle + 0.5 and s < 0.75 * baseline), None)
        result.share_fell_after_s = None if fell is None else fell - t_throttle
        w0 = [w for t, w in weight_series if t <= t_throttle]
        if w0:
            base_w = w0[-1]
            wf = next((t for t, w in weight_series if t > t_throttle and w <= 0.75 * base_w), None)
            result.weight_fell_after_s = None if wf is None else wf - t_throttle
    errs: defaultdict[int, int] = defaultdict(int)
    for o in outcomes:
        if o.status != 200:
            errs[o.status] += 1
    placed = ""
    policy_block = config.models[0].cluster.length_aware
    if policy_block is not None:
        # where each confined class went: only to the GPUs allowed to serve it, unless none was
        serves = {e.display_name: allowed_classes(config, e.gpu, policy_block) for e in config.endpoints}
        by_class: defaultdict[str, list[bool]] = defaultdict(list)
        for o in ok:
            cap = planned[o.index].max_tokens
            cls = length_class(cap if cap is not None else config.models[0].default_max_tokens, policy_block)
            if cls != SHORT:
                by_class[cls].append(o.endpoint is not None and cls in serves.get(o.endpoint, ()))
        placed = ", " + ", ".join(
            f"{cls} {sum(hits)}/{len(hits)} on their tiers" for cls, hits in sorted(by_class.items())
        )
    out.print(
        f"  {policy:9} load {load:.0%} {scenario:8}: {len(ok)}/{len(outcomes)} ok, "
        f"p99 {result.latency_p99_s:.2f} s, "
        f"spread {result.spread:.0f} pts, errors {dict(errs) or 'none'}{placed}",
        highlight=False,
    )
    return result


def _fmt(v: float | None, f: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, f)


def results_table(results: Sequence[RunResult]) -> Table:
    """The benchmark table, one row per run."""
    t = Table(
        title="inferlb routing benchmark (8 simulated GPUs: 2 H100, 3 A100, 3 V100)", caption=ATTRIBUTION
    )
    for col in (
        "scenario", "load", "policy", "req/s in", "ok", "err", "lat p50 s", "lat p99 s", "TTFT p50 s",
        "TTFT p99 s", "ok req/s", "tok/s", "util min-max %", "spread pts", "share fell s", "weight fell s",
    ):  # fmt: skip
        t.add_column(col, justify="left" if col in ("scenario", "policy") else "right")
    for r in results:
        u = r.utilization.values()
        t.add_row(
            r.scenario,
            f"{r.load:.0%}",
            r.policy,
            f"{r.rate_rps:.1f}",
            str(r.ok),
            str(r.errors),
            _fmt(r.latency_p50_s),
            _fmt(r.latency_p99_s),
            _fmt(r.ttft_p50_s, ".3f"),
            _fmt(r.ttft_p99_s, ".3f"),
            _fmt(r.throughput_rps, ".1f"),
            _fmt(r.tokens_per_s, ".0f"),
            f"{min(u):.0f}-{max(u):.0f}" if r.utilization else "-",
            _fmt(r.spread, ".0f"),
            _fmt(r.share_fell_after_s, ".1f") if r.scenario == "throttle" else "",
            _fmt(r.weight_fell_after_s, ".1f") if r.scenario == "throttle" else "",
        )
    return t


def p99_ratios(results: Sequence[RunResult]) -> list[str]:
    """One line per steady load and weighted policy: its latency p99 over round robin's and least request's
    (the targets at 90% load: <= 0.5 and <= 0.7)."""
    p99 = {(r.load, r.policy): r.latency_p99_s for r in results if r.scenario == "steady"}
    lines = []
    for (load, policy), v in sorted(p99.items()):
        if policy not in ("static", *TELEMETRY_POLICIES):
            continue
        rr, lr = p99.get((load, "rr-equal")), p99.get((load, "lr-equal"))
        over_rr = _fmt(None if rr is None else v / rr)
        over_lr = _fmt(None if lr is None else v / lr)
        lines.append(
            f"steady {load:.0%} {policy}: p99 {v:.2f} s = {over_rr} x rr-equal, {over_lr} x lr-equal"
        )
    return lines


def write_plots(results: Sequence[RunResult], out_dir: Path, load_s: float) -> list[Path]:
    """PNG plots: p99 latency and TTFT per policy and load; utilization per GPU; the throttled GPU's share."""
    import matplotlib  # noqa: PLC0415 - a benchmark-only dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    steady = [r for r in results if r.scenario == "steady"]
    loads = sorted({r.load for r in steady})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in (
        (axes[0], "latency_p99_s", "latency p99 (s)"),
        (axes[1], "ttft_p99_s", "TTFT p99 (s)"),
    ):
        width = 0.8 / max(1, len(loads))
        for i, load in enumerate(loads):
            rs = [r for r in steady if r.load == load]
            xs = [j + i * width for j in range(len(rs))]
            ax.bar(xs, [getattr(r, metric) for r in rs], width, label=f"{load:.0%} load")
            ax.set_xticks([j + width * (len(loads) - 1) / 2 for j in range(len(rs))], [r.policy for r in rs])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("p99 by policy (steady runs)")
    paths.append(save_figure(fig, out_dir / "routing_p99.png"))

    for load in loads:
        rs = [r for r in steady if r.load == load]
        if not rs:
            continue
        fig, ax = plt.subplots(figsize=(11, 4))
        gpus = list(rs[0].utilization)
        width = 0.8 / len(rs)
        for i, r in enumerate(rs):
            ax.bar(
                [j + i * width for j in range(len(gpus))],
                [r.utilization[g] for g in gpus],
                width,
                label=r.policy,
            )
        ax.set_xticks([j + width * (len(rs) - 1) / 2 for j in range(len(gpus))], gpus)
        ax.set_ylabel("GPU busy (%)")
        ax.set_title(f"per-GPU utilization at {load:.0%} load")
        ax.legend()
        paths.append(save_figure(fig, out_dir / f"routing_utilization_{round(load * 100)}.png"))

    throttled = [r for r in results if r.scenario == "throttle"]
    if throttled:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
        for r in throttled:
            if r.share_series:
                ax.plot([t for t, _ in r.share_series], [s for _, s in r.share_series], label=r.policy)
        ax.axvline(load_s / 2, color="k", linestyle="--", linewidth=1)
        ax.set_ylabel(f"{THROTTLED} share of requests (2 s window)")
        ax.legend()
        for r in throttled:
            if r.policy in TELEMETRY_POLICIES and r.weight_series:
                ax2.step([t for t, _ in r.weight_series], [w for _, w in r.weight_series], where="post")
        ax2.axvline(load_s / 2, color="k", linestyle="--", linewidth=1)
        ax2.set_ylabel(f"Envoy weight of {THROTTLED} (telemetry)")
        ax2.set_xlabel("seconds since the load started (throttle at the dashed line)")
        paths.append(save_figure(fig, out_dir / "routing_throttle.png"))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """Run every (scenario, load, policy) cell, print the table, write the plots and a JSON of the results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--load-s", type=float, default=45.0, help="seconds of load per run (default 45)")
    p.add_argument("--loads", default="0.7,0.9", help="fractions of fleet capacity (default 0.7,0.9)")
    p.add_argument(
        "--throttle-load", type=float, default=0.7, help="load of the throttle scenario (0 = skip)"
    )
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--prefill-tps", type=float, default=6000.0)
    p.add_argument("--decode-tps", type=float, default=40.0)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--trace-start", type=float, default=0.0, help="trace offset (s) to start from")
    p.add_argument("--max-requests", type=int, default=5000, help="bound on requests per run")
    p.add_argument("--request-timeout", type=float, default=90.0, help="per-request timeout (s)")
    p.add_argument(
        "--long-tokens",
        type=int,
        default=LengthAwareRouting().long_output_tokens,
        help="length-aware: max_tokens above this go to the fast GPUs",
    )
    p.add_argument(
        "--long-min-capacity",
        type=float,
        default=LengthAwareRouting().fast_min_relative_capacity,
        help="length-aware: relative capacity of the fast GPUs",
    )
    p.add_argument(
        "--tier-fraction",
        type=float,
        default=DEFAULT_TIER_WORK_FRACTION,
        help="length-tiered: the threshold rule's fraction (inferlb.policy.length_aware.tier_thresholds)",
    )
    p.add_argument("--cap-mode", choices=CAP_MODES, default="exact", help="how clients set max_tokens")
    p.add_argument("--fixed-cap", type=int, default=1024, help="tokens: the cap of --cap-mode fixed (mix)")
    p.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = p.parse_args(argv)
    out = Console(highlight=False, width=200)
    rows_all = read_trace(args.trace)
    half = rows_all[0].offset_s + (rows_all[-1].offset_s - rows_all[0].offset_s) / 2
    train = client_caps(
        [r for r in rows_all if r.offset_s < half],
        args.cap_mode,
        seed=1001,
        fixed_cap=args.fixed_cap,
        default_cap=parse_config(
            config_doc(
                "telemetry",
                prefill_tps=args.prefill_tps,
                decode_tps=args.decode_tps,
                max_batch=args.max_batch,
            )
        )
        .models[0]
        .default_max_tokens,
    )
    tiered = rule_tiers(train, args)
    args.tiered = tiered.model_dump(exclude_unset=True)  # JSON-able, for routing.json
    if "length-tiered" in args.policies:
        assert tiered.tiers is not None
        out.print(
            "length-tiered: "
            + ", ".join(
                f"caps > {t.above_output_tokens} on GPUs >= {t.min_relative_capacity:g}" for t in tiered.tiers
            )
            + f" (rule fraction {args.tier_fraction:g} over the trace's first half, offsets < {half:.0f} s; "
            f"this run starts at {args.trace_start:g} s)"
        )
    policies = [x for x in args.policies.split(",") if x]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)} (known: {list(POLICIES)})")
    cells = [("steady", float(x), pol) for x in args.loads.split(",") for pol in policies]
    if args.throttle_load > 0:
        cells += [("throttle", args.throttle_load, pol) for pol in policies]
    results = []
    started = time.monotonic()
    for scenario, load, policy in cells:
        results.append(
            run_one(policy=policy, load=load, scenario=scenario, rows_all=rows_all, args=args, out=out)
        )
    out.print(results_table(results))
    for line in p99_ratios(results):
        out.print(line)
    out_dir = Path(args.out)
    paths = write_plots(results, out_dir, args.load_s)
    (out_dir / "routing.json").write_text(
        json.dumps(
            {"attribution": ATTRIBUTION, "args": vars(args), "results": [r.__dict__ for r in results]},
            indent=1,
        ),
        encoding="utf-8",
    )
    out.print(f"plots: {', '.join(str(x) for x in paths)}; total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
