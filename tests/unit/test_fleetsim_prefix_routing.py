"""Prefix-aware placement in the fleet simulation: ring hash keeps a prefix on one host within its bounded
load, the precise picker reads the engines' own caches, and on a small shared-prefix workload the
prefix-aware placements hit the caches far more than round robin."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.policy.picker import PickerWeights
from inferlb.traces import MOONCAKE_BLOCK_TOKENS, TraceRow
from simulation.fleetsim.balancers import (
    EngineCacheIndex,
    PickerBalancer,
    RingHashBalancer,
    SpeculativeCacheIndex,
)
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.results import FleetRunResult
from simulation.fleetsim.scenario import Policy, Scenario
from simulation.fleetsim.workload import SharedPrefixSpec, fleet_mix, shared_prefix_rows
from simulation.kvcache import PrefixCache, PromptBlocks
from tests.unit.test_fleetsim_prefix_cache import cached_engine, config

BS = MOONCAKE_BLOCK_TOKENS

# 40 groups of 8 + 3 x 2 blocks: more than a V100's cache (222 blocks) holds, so placement decides the hits
SPEC = SharedPrefixSpec(groups=40, users=3, system_tokens=4096, question_tokens=1024, output_tokens=32)


@cache
def shared_run(policy: Policy) -> FleetRunResult:
    rows = shared_prefix_rows(SPEC, rate_rps=6.0, duration_s=60.0, seed=3)
    scenario = Scenario(
        policy=policy, duration_s=60.0, warmup_s=10.0, seed=3, affinity_blocks=SPEC.system_tokens // BS
    )
    return simulate(fleet_mix(config(), 6), cached_engine, rows, scenario)


def test_prefix_aware_placement_beats_round_robin_on_hits() -> None:
    rr = shared_run("round_robin")
    for policy in ("precise", "precise_speculative", "approximate", "ring_hash"):
        r = shared_run(policy)
        assert r.finished == r.arrivals, policy
        assert r.prefix_cache_hit_rate > rr.prefix_cache_hit_rate + 0.25, (policy, r.prefix_cache_hit_rate)
    assert shared_run("precise").ttft_p50_s < rr.ttft_p50_s
    assert len(shared_run("precise").mean_in_flight) == 6
    assert shared_run("precise").ttft_p90_s <= shared_run("precise").ttft_p99_s


def test_runs_are_deterministic() -> None:
    rows = shared_prefix_rows(SPEC, rate_rps=4.0, duration_s=20.0, seed=5)
    assert rows == shared_prefix_rows(SPEC, rate_rps=4.0, duration_s=20.0, seed=5)
    for policy in ("approximate", "ring_hash"):
        scenario = Scenario(policy=policy, duration_s=20.0, seed=5)
        a = simulate(fleet_mix(config(), 4), cached_engine, rows, scenario)
        b = simulate(fleet_mix(config(), 4), cached_engine, rows, scenario)
        assert a.arrival_gpus == b.arrival_gpus


def test_shared_prefix_prompts_share_exactly_their_group_system_blocks() -> None:
    spec = SharedPrefixSpec(groups=3, users=2, system_tokens=2000, question_tokens=600, block_tokens=512)
    a, b, c = spec.prompt_blocks(0, 0), spec.prompt_blocks(0, 1), spec.prompt_blocks(1, 0)
    assert len(a) == spec.prompt_tokens // 512 == 5
    assert a[:3] == b[:3] and a[3:] != b[3:]  # 2000 // 512 = 3 blocks lie wholly in the system prompt
    assert not set(a) & set(c)
    with pytest.raises(ValueError, match="groups"):
        SharedPrefixSpec(groups=0)
    with pytest.raises(ValueError, match="rate_rps"):
        shared_prefix_rows(spec, rate_rps=0.0, duration_s=1.0, seed=1)


def test_engine_cache_index_reads_what_the_caches_hold() -> None:
    caches = [PrefixCache(num_blocks=16, block_size=4) for _ in range(3)]
    caches[1].allocate("a", [PromptBlocks(tokens=12, hashes=(1, 2, 3))])
    caches[2].allocate("b", [PromptBlocks(tokens=8, hashes=(1, 2))])
    index = EngineCacheIndex(caches)
    assert index.matched_blocks([1, 2, 3, 4], {"0", "1", "2"}) == {"1": 3, "2": 2}
    assert index.matched_blocks([5], {"0"}) == {}


def test_speculative_index_counts_pending_picks_until_they_settle() -> None:
    caches = [PrefixCache(num_blocks=16, block_size=4) for _ in range(2)]
    caches[0].allocate("a", [PromptBlocks(tokens=8, hashes=(1, 2))])
    index = SpeculativeCacheIndex(caches)
    index.add(7, "1", [1, 2, 3])
    index.add(8, "1", [1, 2])
    index.add(9, "0", [1])  # shorter than what cache 0 holds: the cache's match stands
    assert index.matched_blocks([1, 2, 3], {"0", "1"}) == {"0": 2, "1": 3}
    index.settle(7)
    assert index.matched_blocks([1, 2, 3], {"0", "1"}) == {"0": 2, "1": 2}
    index.settle(8)
    index.settle(8)  # twice: ignored
    index.settle(9)
    assert index.matched_blocks([1, 2, 3], {"0", "1"}) == {"0": 2}


def test_picker_balancer_tracks_the_gateway_counts() -> None:
    b = PickerBalancer([1.0, 1.0], index=EngineCacheIndex([PrefixCache(num_blocks=8, block_size=BS)] * 2),
                       weights=PickerWeights(), block_tokens=BS)  # fmt: skip
    row = TraceRow(offset_s=0.0, prompt_tokens=2048, output_tokens=10, block_hashes=(1, 2, 3, 4))
    g = b.pick_request([0, 0], 0, row)
    h = b.pick_request([1 if g == 0 else 0, 1 if g == 1 else 0], 1, row)
    assert g != h  # the first request's queued prefill weighs against its host
    b.first_token(g, 0)
    b.finished(g, 0)
    b.finished(h, 1)
    b.finished(h, 1)  # twice: ignored
    with pytest.raises(ValueError, match="capacities"):
        PickerBalancer([0.0], index=EngineCacheIndex([]), weights=PickerWeights(), block_tokens=BS)


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.sampled_from([1.0, 1.7, 3.4]), min_size=1, max_size=12),
    keys=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=60),
    balance=st.sampled_from([1.0, 1.25, 1.5, 3.0]),
)
def test_ring_hash_keeps_a_key_on_its_host_within_the_bounded_load(
    weights: list[float], keys: list[int], balance: float
) -> None:
    ring = RingHashBalancer(weights, key_blocks=1, balance=balance, minimum_ring_size=64)
    idle = [0] * len(weights)
    assert ring.ring_size >= len(weights)
    active = [0] * len(weights)
    total_w = sum(weights)
    for k in keys:
        assert ring.pick_key(idle, k) == ring.pick_key(idle, k)
        h = ring.pick_key(active, k)
        active[h] += 1
        # Envoy's bound: a host takes a key only while active + 1 <= ceil(balance * (A + 1) * w / W)
        assert active[h] <= balance * sum(active) * weights[h] / total_w + 1
    with pytest.raises(ValueError, match="at least one host"):
        RingHashBalancer([], key_blocks=1)
    with pytest.raises(ValueError, match="key_blocks"):
        RingHashBalancer([1.0], key_blocks=0)
