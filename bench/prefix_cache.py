"""Prefix caching in the simulators (simulation.kvcache): what a cache hit buys, and what placement does to
the hits. Not a test: it prints two tables.

1. **gpusim** (one real aiohttp server on loopback, the config's H100 timing): time to first token of a long
   chat, cold (a system prompt never seen) and warm (the same conversation again), measured by the client
   on streamed requests, cold and warm interleaved, ``--pairs`` of each; and the server's own
   ``vllm:prefix_cache_hits_total`` / ``queries_total``.
2. **fleetsim** (the discrete-event simulation) on a window of the Mooncake conversation trace (Qin et al.,
   "Mooncake", USENIX FAST 2025; ``--mooncake FILE``, e.g. shared/traces/mooncake/
   mooncake_conversation_trace.jsonl): ``--gpus`` GPUs of the config's mix, each a ``BatchEngine`` with a
   ``PrefixCache`` of 512-token blocks over its KV budget, under round robin and least request, against
   the trace's *ideal* reuse: one cache that never evicts, seeing every request (the hits vLLM's rules would
   count: the longest run of leading blocks seen before, at most ``prompt - 1`` tokens).

Usage: ``.venv/bin/python bench/prefix_cache.py --mooncake FILE [--gpus 8] [--window-s 600] [--pairs 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import Config, load_config
from inferlb.traces import MOONCAKE_BLOCK_TOKENS, TraceRow, read_mooncake_trace, window
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.scenario import Policy, Scenario
from simulation.fleetsim.workload import FleetGpu, fleet_mix
from simulation.gpusim.engine import BatchEngine, TimingModel
from simulation.gpusim.server import SimulatedEndpoint
from simulation.kvcache import PrefixCache

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "inferlb" / "data" / "local.yaml"


# -- gpusim: cold vs warm ------------------------------------------------------------------------------------


async def _ttft(http: aiohttp.ClientSession, url: str, payload: dict[str, object]) -> float:
    """Seconds from sending a streamed chat to its first content chunk (the stream is read to its end)."""
    t0 = time.perf_counter()
    first: float | None = None
    async with http.post(f"{url}/v1/chat/completions", json={**payload, "stream": True}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and line.startswith(b"data: ") and b'"content"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


async def gpusim_cold_warm(config: Config, pairs: int) -> tuple[list[float], list[float], int, int, int]:
    """``pairs`` cold and warm TTFTs (s, interleaved), the server's hits and queries, the prompt tokens."""
    endpoint = next(e for e in config.endpoints if e.gpu == "H100")
    server = SimulatedEndpoint(config=config, endpoint=endpoint)
    _, port = await server.start(host="127.0.0.1", port=0)
    url = f"http://127.0.0.1:{port}"
    model = endpoint.model
    cold: list[float] = []
    warm: list[float] = []
    tokens = 0
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(pairs):
                system = f"Session {i}. " + "You are the operator's assistant for a fleet of GPUs. " * 550
                chat = {"model": model, "max_tokens": 2, "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": "Status?"},
                ]}  # fmt: skip
                cold.append(await _ttft(http, url, chat))
                warm.append(await _ttft(http, url, chat))
            stats = server.engine.stats()
            tokens = stats.prompt_tokens_total // (2 * pairs)
            return cold, warm, stats.prefix_cache_hits_total, stats.prefix_cache_queries_total, tokens
    finally:
        await server.stop()


# -- fleetsim: placement vs the ideal ------------------------------------------------------------------------


def ideal_hits(
    rows: list[TraceRow],
    *,
    start_s: float = 0.0,
    end_s: float = math.inf,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> tuple[int, int]:
    """(hit tokens, query tokens) of one never-evicting cache that sees every row, by vLLM's counting (the
    longest run of leading blocks seen before, at most ``prompt - 1`` tokens), counted over the rows that
    arrive in ``[start_s, end_s)`` (rows must be sorted by arrival; earlier ones still fill the cache)."""
    seen: set[int] = set()
    hits = queries = 0
    for r in rows:
        if r.offset_s >= end_s:
            break
        if r.offset_s >= start_s:
            most = (r.prompt_tokens - 1) // block_tokens
            n = 0
            for h in r.block_hashes[:most]:
                if h not in seen:
                    break
                n += 1
            hits += n * block_tokens
            queries += r.prompt_tokens
        seen.update(r.block_hashes)
    return hits, queries


def fleet_run(
    config: Config, rows: list[TraceRow], gpus: int, policy: Policy, *, unbounded: bool = False
) -> tuple[float, float, float, int, int, float]:
    """(hit rate, TTFT p50, TTFT p99, unheld sequences, evictions, wall seconds) of one run; ``unbounded``:
    every GPU's cache has room for the whole trace (nothing is evicted: what placement alone loses)."""
    caches: list[PrefixCache] = []

    def make(g: FleetGpu) -> BatchEngine:
        model = TimingModel.for_endpoint(config, g.endpoint)
        budget = 2**40 if unbounded else model.kv_budget_tokens
        cache = PrefixCache.for_budget(budget, block_size=MOONCAKE_BLOCK_TOKENS)
        caches.append(cache)
        return BatchEngine(model=model, prefix_cache=cache)

    duration = rows[-1].offset_s + 1.0
    t0 = time.perf_counter()
    r = simulate(fleet_mix(config, gpus), make, rows, Scenario(policy=policy, duration_s=duration))
    wall = time.perf_counter() - t0
    return (
        r.prefix_cache_hit_rate, r.ttft_p50_s, r.ttft_p99_s,
        sum(c.unheld_total for c in caches), sum(c.evictions_total for c in caches), wall,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--mooncake", type=Path, required=True, help="a Mooncake JSONL trace")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--window-s", type=float, default=600.0, help="seconds of the trace from its start")
    ap.add_argument("--speedup", type=float, default=1.0, help="trace time divided by this (0.5: half load)")
    ap.add_argument("--pairs", type=int, default=4, help="cold/warm pairs on gpusim")
    args = ap.parse_args()
    config = load_config(args.config)
    console = Console(width=150)

    cold, warm, hits, queries, tokens = asyncio.run(gpusim_cold_warm(config, args.pairs))
    t = Table(
        title=f"gpusim (H100 timing): a {tokens}-token chat, cold vs warm, {args.pairs} pairs interleaved"
    )
    for col in ("request", "TTFT min ms", "TTFT median ms", "TTFT max ms"):
        t.add_column(col, justify="left" if col == "request" else "right")
    for name, xs in (("cold (new system prompt)", cold), ("warm (same conversation)", warm)):
        s = sorted(xs)
        t.add_row(name, f"{s[0] * 1e3:.1f}", f"{s[len(s) // 2] * 1e3:.1f}", f"{s[-1] * 1e3:.1f}")
    t.caption = (
        f"server: vllm:prefix_cache_hits_total {hits} of queries_total {queries} ({hits / queries:.1%})"
    )
    console.print(t)

    rows = window(
        read_mooncake_trace(args.mooncake), start_s=0.0, duration_s=args.window_s, speedup=args.speedup
    )
    ih, iq = ideal_hits(rows)
    t = Table(
        title=f"fleetsim: Mooncake conversation trace, first {args.window_s:.0f} s ({len(rows)} requests, "
        f"speedup {args.speedup:g}), {args.gpus} GPUs of the config's mix, 512-token blocks",
        caption="Trace: Mooncake conversation trace, Qin et al., 'Mooncake', USENIX FAST 2025 (Apache-2.0)",
    )
    for col in ("placement", "hit rate", "of ideal", "TTFT p50 s", "TTFT p99 s", "unheld seqs", "evictions",
                "wall s"):  # fmt: skip
        t.add_column(col, justify="left" if col == "placement" else "right")
    t.add_row("ideal (one infinite cache)", f"{ih / iq:.1%}", "100%", "-", "-", "-", "-", "-")
    runs: list[tuple[str, Policy, bool]] = [
        ("round_robin", "round_robin", False),
        ("least_request", "least_request", False),
        ("round_robin, caches never full", "round_robin", True),
        ("least_request, caches never full", "least_request", True),
    ]
    for name, policy, unbounded in runs:
        rate, p50, p99, unheld, evictions, wall = fleet_run(
            config, rows, args.gpus, policy, unbounded=unbounded
        )
        t.add_row(name, f"{rate:.1%}", f"{rate / (ih / iq):.0%}", f"{p50:.2f}", f"{p99:.2f}", str(unheld),
                  str(evictions), f"{wall:.1f}")  # fmt: skip
    console.print(t)


if __name__ == "__main__":
    main()
