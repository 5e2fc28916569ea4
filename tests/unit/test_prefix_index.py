"""The approximate prefix index: what it records matches, its memory stays bounded, it evicts in LRU order
(a prefix's tail first), and identical inputs give identical state."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferlb.policy.picker import PrefixIndex
from inferlb.policy.prefix_index import ApproximatePrefixIndex

A, B, C = "127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002"
ALL = frozenset({A, B, C})


def test_a_recorded_prefix_matches_its_leading_run_only_where_it_was_sent() -> None:
    index: PrefixIndex = ApproximatePrefixIndex(capacity_blocks=100)
    index.record_pick(A, [1, 2, 3, 4])
    assert index.matched_blocks([1, 2, 3, 4], ALL) == {A: 4}
    assert index.matched_blocks([1, 2], ALL) == {A: 2}
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ALL) == {A: 4}
    assert index.matched_blocks([1, 2, 9, 4], ALL) == {A: 2}
    assert index.matched_blocks([9, 1], ALL) == {}
    assert index.matched_blocks([1, 2], {B, C}) == {}
    assert index.matched_blocks([], ALL) == {}
    index.record_pick(B, [1, 2, 7])
    assert index.matched_blocks([1, 2, 7, 8], ALL) == {A: 2, B: 3}


def test_eviction_takes_the_least_recent_keys_a_prefix_tail_first() -> None:
    index = ApproximatePrefixIndex(capacity_blocks=4)
    index.record_pick(A, [1, 2, 3])
    index.record_pick(A, [4, 5])
    # [1, 2, 3] was recorded tail first, so 3 is its least recent key and goes first
    assert index.keys_of(A) == (2, 1, 5, 4)
    assert index.matched_blocks([1, 2, 3], ALL) == {A: 2}
    index.record_pick(A, [1, 2])  # refreshes 1 and 2: now 5 and 4 are the oldest
    index.record_pick(A, [6])
    assert index.keys_of(A) == (4, 2, 1, 6)
    assert index.matched_blocks([4, 5], ALL) == {A: 1}
    assert index.evictions_total == 2


def test_the_global_bound_evicts_across_endpoints() -> None:
    index = ApproximatePrefixIndex(capacity_blocks=10, max_entries=3)
    index.record_pick(A, [1, 2])
    index.record_pick(B, [1, 2])
    assert len(index) == 3
    assert index.matched_blocks([1, 2], ALL) == {A: 1, B: 2}


def test_per_endpoint_capacities_ttl_and_forget() -> None:
    now = [0.0]
    index = ApproximatePrefixIndex(capacity_blocks=10, capacities={A: 2}, ttl_s=5.0, clock=lambda: now[0])
    index.record_pick(A, [1, 2, 3])
    assert index.blocks_of(A) == 2
    index.record_pick(B, [1, 2, 3])
    now[0] = 4.0
    index.record_pick(C, [1])
    assert index.matched_blocks([1, 2, 3], ALL) == {A: 2, B: 3, C: 1}
    now[0] = 6.0  # A's and B's entries are 6 s old, past the TTL; C's 2 s
    assert index.matched_blocks([1, 2, 3], ALL) == {C: 1}
    index.record_pick(B, [9])  # a record expires its endpoint's stale entries
    assert index.keys_of(B) == (9,)
    index.forget(C)
    assert index.matched_blocks([1], ALL) == {}
    assert index.blocks_of(C) == 0
    index.forget(C)  # forgetting twice is harmless


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        ApproximatePrefixIndex(capacity_blocks=0)
    with pytest.raises(ValueError, match="max_entries"):
        ApproximatePrefixIndex(capacity_blocks=1, max_entries=0)
    with pytest.raises(ValueError, match="clock"):
        ApproximatePrefixIndex(capacity_blocks=1, ttl_s=1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        ApproximatePrefixIndex(capacity_blocks=1, ttl_s=0.0, clock=lambda: 0.0)
    with pytest.raises(ValueError, match=A):
        ApproximatePrefixIndex(capacity_blocks=1, capacities={A: 0})


_records = st.lists(
    st.tuples(st.sampled_from(sorted(ALL)), st.lists(st.integers(0, 30), max_size=12, unique=True)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(records=_records, cap=st.integers(1, 8), max_entries=st.integers(1, 20))
@example(records=[(A, [1, 2, 3]), (B, [1, 2, 3])], cap=2, max_entries=3)
def test_memory_stays_bounded_and_the_newest_record_matches(
    records: list[tuple[str, list[int]]], cap: int, max_entries: int
) -> None:
    index = ApproximatePrefixIndex(capacity_blocks=cap, max_entries=max_entries)
    for address, keys in records:
        index.record_pick(address, keys)
        assert all(index.blocks_of(a) <= cap for a in ALL)
        assert len(index) == sum(index.blocks_of(a) for a in ALL) <= max_entries
        # the record just made is the most recent: its leading run up to the bounds still matches
        if keys:
            kept = min(len(keys), cap, max_entries)
            assert index.matched_blocks(keys, ALL).get(address, 0) >= kept
        # what a lookup reports is what the endpoint's keys say
        for a in ALL:
            held = set(index.keys_of(a))
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            assert index.matched_blocks(keys, {a}).get(a, 0) == n


@settings(max_examples=100, deadline=None)
@given(records=_records, cap=st.integers(1, 8))
def test_identical_inputs_give_identical_state(records: list[tuple[str, list[int]]], cap: int) -> None:
    one = ApproximatePrefixIndex(capacity_blocks=cap, max_entries=15)
    two = ApproximatePrefixIndex(capacity_blocks=cap, max_entries=15)
    for address, keys in records:
        one.record_pick(address, keys)
        two.record_pick(address, keys)
    assert [one.keys_of(a) for a in sorted(ALL)] == [two.keys_of(a) for a in sorted(ALL)]
    probe = [k for _, keys in records for k in keys][:12]
    assert one.matched_blocks(probe, ALL) == two.matched_blocks(probe, ALL)
