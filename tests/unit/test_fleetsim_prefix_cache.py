"""The fleet simulation with prefix caches: Mooncake block ids reach the engines' caches, placement changes
the hits as the cache rules say, and runs without block ids or without caches are what they were."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

import inferlb
from inferlb.config.schema import Config, load_config
from inferlb.traces import MOONCAKE_BLOCK_TOKENS, TraceError, TraceRow, read_mooncake_trace, window
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.results import FleetRunResult
from simulation.fleetsim.scenario import Policy, Scenario
from simulation.fleetsim.workload import COPY_HASH_STRIDE, FleetGpu, fleet_mix, scale_trace
from simulation.gpusim.engine import BatchEngine, TimingModel
from simulation.kvcache import PrefixCache

LOCAL = Path(inferlb.__file__).parent / "data" / "local.yaml"
BS = MOONCAKE_BLOCK_TOKENS


@cache
def config() -> Config:
    return load_config(LOCAL)


def cached_engine(g: FleetGpu) -> BatchEngine:
    model = TimingModel.for_endpoint(config(), g.endpoint)
    return BatchEngine(
        model=model, prefix_cache=PrefixCache.for_budget(model.kv_budget_tokens, block_size=BS)
    )


def plain_engine(g: FleetGpu) -> BatchEngine:
    return BatchEngine(model=TimingModel.for_endpoint(config(), g.endpoint))


def conversation(turns: int, *, gap_s: float = 30.0) -> list[TraceRow]:
    """One conversation: turn k (1-based) resends the k blocks before it plus 100 tokens, far apart in time
    (each turn finishes before the next arrives)."""
    return [
        TraceRow(
            offset_s=k * gap_s, prompt_tokens=(k + 1) * BS + 100, output_tokens=4,
            block_hashes=tuple(range(1, k + 2)),
        )
        for k in range(turns)
    ]  # fmt: skip


def run(
    rows: list[TraceRow], gpus: int, make: Callable[[FleetGpu], BatchEngine], policy: Policy = "round_robin"
) -> FleetRunResult:
    fleet = fleet_mix(config(), gpus)
    sc = Scenario(policy=policy, duration_s=rows[-1].offset_s + 1.0, drain_s=120.0)
    return simulate(fleet, make, rows, sc)


def test_one_gpu_hits_every_resent_block_of_a_conversation() -> None:
    rows = conversation(6)
    r = run(rows, 1, cached_engine)
    # turn k (0-based) resends k blocks it finds cached; every prompt token is a query
    assert r.prefix_cache_queries == sum(row.prompt_tokens for row in rows)
    assert r.prefix_cache_hits == sum(k * BS for k in range(6))
    assert r.finished == 6


def test_round_robin_over_two_gpus_finds_only_what_the_same_gpu_saw() -> None:
    rows = conversation(6)
    r = run(rows, 2, cached_engine)
    # turn k lands on GPU k % 2, which served turn k - 2 last: k - 1 blocks of it are cached (k >= 2)
    assert r.prefix_cache_hits == sum((k - 1) * BS for k in range(2, 6))
    assert r.prefix_cache_hit_rate < run(rows, 1, cached_engine).prefix_cache_hit_rate


def test_cached_tokens_are_not_prefilled() -> None:
    rows = conversation(2)
    with_cache = run(rows, 1, cached_engine)
    without = run(rows, 1, plain_engine)
    assert without.prefix_cache_queries == 0
    # the second turn prefills 100 + 512 tokens instead of 1124: its TTFT (the p99 of two) is shorter
    model = TimingModel.for_endpoint(config(), fleet_mix(config(), 1)[0].endpoint)
    assert with_cache.ttft_p99_s == pytest.approx(model.prefill_seconds(rows[0].prompt_tokens))
    assert without.ttft_p99_s == pytest.approx(model.prefill_seconds(rows[1].prompt_tokens))


def test_without_a_cache_block_ids_change_nothing() -> None:
    rows = conversation(8, gap_s=0.05)
    bare = [dataclasses.replace(r, block_hashes=()) for r in rows]
    assert run(rows, 3, plain_engine, "least_request") == run(bare, 3, plain_engine, "least_request")


def test_scaled_copies_of_a_trace_share_no_blocks() -> None:
    rows = conversation(3)
    out = scale_trace(rows, rate_rps=1.0, duration_s=9.0)
    assert len(out) == 9
    ids = {r.block_hashes[0] for r in out}
    assert ids == {1, 1 + COPY_HASH_STRIDE, 1 + 2 * COPY_HASH_STRIDE}
    assert window(out, start_s=0.0)[0].block_hashes == out[0].block_hashes


def test_a_mooncake_trace_reads_into_rows_with_full_block_ids(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    recs = [
        {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 300, "output_length": 1, "hash_ids": [0]},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert read_mooncake_trace(p) == [
        TraceRow(offset_s=0.0, prompt_tokens=300, output_tokens=1, block_hashes=()),
        TraceRow(offset_s=1.0, prompt_tokens=1100, output_tokens=7, block_hashes=(0, 1)),
    ]
    p.write_text(json.dumps({"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0]}))
    with pytest.raises(TraceError, match=r"t.jsonl:1: .*hash id per full 512-token block"):
        read_mooncake_trace(p)
    p.write_text('{"timestamp": 0}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:1: malformed row"):
        read_mooncake_trace(p)
    p.write_text("")
    with pytest.raises(TraceError, match="no rows"):
        read_mooncake_trace(p)
