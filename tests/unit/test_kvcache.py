"""The prefix-cache model (simulation.kvcache): vLLM's block hashing and block pool rules, property-tested."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulation.kvcache import (
    NONE_HASH,
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CacheAllocation,
    CacheEvent,
    PrefixCache,
    PromptBlocks,
    block_hashes,
    hash_block_tokens,
)

BS = 4  # a small block size keeps the examples readable


def prompt(tokens: list[int], bs: int = BS) -> PromptBlocks:
    return PromptBlocks(tokens=len(tokens), hashes=block_hashes(tokens, block_size=bs))


# -- hashing ------------------------------------------------------------------------------------------------


def test_first_block_hash_chains_on_none_hash() -> None:
    assert block_hashes([1, 2, 3, 4, 5], block_size=4) == (hash_block_tokens(NONE_HASH, [1, 2, 3, 4]),)
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])


def test_only_full_blocks_get_hashes() -> None:
    assert len(block_hashes(list(range(15)), block_size=16)) == 0
    assert len(block_hashes(list(range(33)), block_size=16)) == 2
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], block_size=0)


@given(
    tokens=st.lists(st.integers(0, 200_000), min_size=1, max_size=64),
    data=st.data(),
    bs=st.integers(1, 8),
)
def test_a_changed_token_misses_its_block_and_every_later_one(
    tokens: list[int], data: st.DataObject, bs: int
) -> None:
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = tokens[i] + 1
    a = block_hashes(tokens, block_size=bs)
    b = block_hashes(changed, block_size=bs)
    first_changed = i // bs
    assert a[:first_changed] == b[:first_changed]
    assert all(x != y for x, y in zip(a[first_changed:], b[first_changed:], strict=True))


@given(tokens=st.lists(st.integers(0, 1000), max_size=64), extra=st.lists(st.integers(0, 1000), max_size=32))
def test_equal_prefixes_give_equal_hashes(tokens: list[int], extra: list[int]) -> None:
    a = block_hashes(tokens, block_size=BS)
    assert block_hashes(tokens + extra, block_size=BS)[: len(a)] == a


# -- the block pool ------------------------------------------------------------------------------------------


def test_repeated_prompt_hits_its_full_blocks_but_recomputes_the_last_token() -> None:
    cache = PrefixCache(num_blocks=64, block_size=BS)
    p = prompt(list(range(10)))  # 2 full blocks + 2 tokens
    first = cache.allocate("a", [p], decode_tokens=3)
    assert (first.hit_tokens, first.held) == (0, True)
    cache.free("a")
    second = cache.allocate("b", [p])
    assert second.hit_tokens == 8
    assert (cache.queries_total, cache.hits_total) == (20, 8)
    cache.free("b")
    exact = prompt(list(range(8)))  # exactly 2 blocks: the last token is recomputed, so 1 block hits
    assert cache.allocate("c", [exact]).hit_tokens == 4


def test_running_sequences_share_blocks_by_reference_count() -> None:
    cache = PrefixCache(num_blocks=64, block_size=BS)
    p = prompt(list(range(9)))
    cache.allocate("a", [p])
    cache.allocate("b", [p])
    assert cache.ref_count(p.hashes[0]) == 2
    # a: 3 blocks; b: the 2 shared full blocks + its own partial one
    assert cache.blocks_in_use == 4
    cache.free("a")
    assert cache.ref_count(p.hashes[0]) == 1
    cache.free("b")
    assert (cache.ref_count(p.hashes[0]), cache.blocks_in_use, cache.cached_blocks) == (0, 0, 2)
    assert not cache.free("b")


def test_lru_evicts_the_oldest_free_blocks_and_a_prefix_tail_first() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS)
    old = prompt([*range(8), 99])  # 2 full blocks + 1 partial
    cache.allocate("old", [old])
    cache.free("old")
    # one new block is taken: the free queue is [partial, block 1, block 0]; the partial (uncached) goes
    # first, then the next allocation evicts block 1 (the prefix's tail) before block 0
    cache.allocate("x", [PromptBlocks(tokens=4)])
    assert cache.is_cached(old.hashes[0]) and cache.is_cached(old.hashes[1])
    cache.allocate("y", [PromptBlocks(tokens=8)])
    assert cache.is_cached(old.hashes[0]) and not cache.is_cached(old.hashes[1])
    assert cache.evictions_total == 1


def test_a_sequence_that_does_not_fit_runs_without_blocks() -> None:
    cache = PrefixCache(num_blocks=2, block_size=BS)
    out = cache.allocate("big", [PromptBlocks(tokens=12)])
    assert out == CacheAllocation(prompt_tokens=12, hit_tokens=0, held=False, blocks=0)
    assert (cache.unheld_total, cache.blocks_in_use, cache.holds("big")) == (1, 0, False)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        PrefixCache(num_blocks=0)
    cache = PrefixCache(num_blocks=8, block_size=BS)
    cache.allocate("a", [PromptBlocks(tokens=1)])
    with pytest.raises(ValueError, match="already holds"):
        cache.allocate("a", [PromptBlocks(tokens=1)])
    with pytest.raises(ValueError, match=">= 0"):
        cache.allocate("b", [PromptBlocks(tokens=1)], decode_tokens=-1)
    assert PrefixCache.for_budget(100, block_size=16).num_blocks == 6


# -- random operation sequences ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Alloc:
    seq: int
    family: int  # prompts of one family share a prefix
    length: int
    decode: int


@dataclass(frozen=True)
class Free:
    seq: int


@dataclass(frozen=True)
class Extend:
    seq: int
    blocks: int


def tokens_of(family: int, length: int) -> list[int]:
    # family f: a shared head of 8 tokens, then tokens that depend on f (so families share one block)
    return [7] * min(length, 8) + [1000 * (family + 1) + i for i in range(max(0, length - 8))]


ops_strategy = st.lists(
    st.one_of(
        st.builds(Alloc, st.integers(0, 7), st.integers(0, 3), st.integers(0, 40), st.integers(0, 12)),
        st.builds(Free, st.integers(0, 7)),
        st.builds(Extend, st.integers(0, 7), st.integers(0, 4)),
    ),
    max_size=60,
)


Op = Alloc | Free | Extend


def run_ops(cache: PrefixCache, ops: list[Op]) -> list[CacheAllocation | bool]:
    """Apply ``ops``, checking the invariants after each; returns what each op returned."""
    out: list[CacheAllocation | bool] = []
    pinned: dict[str, list[bytes | int]] = {}  # running sequence -> the hashes of its prompt's full blocks
    for op in ops:
        sid = f"s{op.seq}"
        if isinstance(op, Alloc):
            if cache.holds(sid):
                continue
            p = prompt(tokens_of(op.family, op.length))
            free, need = cache.free_blocks, cache.blocks_needed([p], decode_tokens=op.decode)
            a = cache.allocate(sid, [p], decode_tokens=op.decode)
            out.append(a)
            # blocks_needed says beforehand whether the allocation is held, and how many free blocks it takes
            assert a.held == (need <= free)
            if a.held:
                pinned[sid] = list(p.hashes)
                assert cache.free_blocks == free - need
        elif isinstance(op, Extend):
            if not cache.holds(sid):
                continue
            free = cache.free_blocks
            grew = cache.extend(sid, op.blocks)
            out.append(grew)
            assert grew == (op.blocks <= free)
            assert cache.free_blocks == (free - op.blocks if grew else free)
        else:
            out.append(cache.free(sid))
            pinned.pop(sid, None)
        # blocks in use never exceed the budget
        assert 0 <= cache.blocks_in_use <= cache.num_blocks
        # a pinned block is never evicted: every hash a running sequence's blocks hold is still cached
        for hashes in pinned.values():
            assert all(cache.is_cached(h) and cache.ref_count(h) >= 1 for h in hashes)
        assert cache.hits_total <= cache.queries_total
    return out


def snapshot(cache: PrefixCache) -> tuple[object, ...]:
    return (
        cache.queries_total, cache.hits_total, cache.unheld_total, cache.evictions_total,
        cache.blocks_in_use, sorted(map(repr, cache._blocks_of.items())), list(cache._free),
        sorted(cache._seqs.items()),
    )  # fmt: skip


@settings(max_examples=200)
@given(ops=ops_strategy, num_blocks=st.integers(1, 24))
def test_invariants_hold_over_any_operation_sequence(ops: list[Op], num_blocks: int) -> None:
    run_ops(PrefixCache(num_blocks=num_blocks, block_size=BS), ops)


@given(ops=ops_strategy, num_blocks=st.integers(1, 24))
def test_identical_operation_sequences_give_identical_states(ops: list[Op], num_blocks: int) -> None:
    a = PrefixCache(num_blocks=num_blocks, block_size=BS)
    b = PrefixCache(num_blocks=num_blocks, block_size=BS)
    assert run_ops(a, ops) == run_ops(b, ops)
    assert snapshot(a) == snapshot(b)


@given(ops=ops_strategy, num_blocks=st.integers(1, 24), family=st.integers(0, 3), length=st.integers(1, 40))
def test_a_repeated_prompt_hits_all_its_full_blocks_when_nothing_evicted_them(
    ops: list[Op], num_blocks: int, family: int, length: int
) -> None:
    cache = PrefixCache(num_blocks=num_blocks, block_size=BS)
    run_ops(cache, ops)
    p = prompt(tokens_of(family, length))
    first = cache.allocate("probe-1", [p])
    if not first.held:
        return
    cache.free("probe-1")  # freeing evicts nothing
    second = cache.allocate("probe-2", [p])
    # the first allocation cached every full block (or found it cached): all of them hit now
    assert second.hit_tokens == ((p.tokens - 1) // BS) * BS


# -- KV events ----------------------------------------------------------------------------------------------


def replay(events: list[CacheEvent], mirror: Counter[bytes | int]) -> None:
    """What a KV-event consumer (an indexer) does: count each hash's cached blocks."""
    for e in events:
        if isinstance(e, BlockStored):
            mirror.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            mirror.subtract(e.block_hashes)
        else:
            mirror.clear()
    for h in [h for h, n in mirror.items() if n == 0]:
        del mirror[h]


@settings(max_examples=150)
@given(ops=ops_strategy, num_blocks=st.integers(1, 24), clear_at=st.integers(0, 60))
def test_replayed_kv_events_rebuild_the_cached_hashes(
    ops: list[Alloc | Free], num_blocks: int, clear_at: int
) -> None:
    cache = PrefixCache(num_blocks=num_blocks, block_size=BS, record_events=True)
    mirror: Counter[bytes | int] = Counter()
    for i, op in enumerate(ops):
        if i == clear_at:
            cache.clear()
        run_ops(cache, [op])
        replay(cache.take_events(), mirror)
        assert mirror == Counter({h: len(bs) for h, bs in cache._blocks_of.items()})


def test_kv_events_name_the_parent_and_the_tokens_of_each_stored_run() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS, record_events=True)
    tokens = list(range(10))
    p = PromptBlocks(tokens=10, hashes=block_hashes(tokens, block_size=BS), token_ids=tuple(tokens))
    cache.allocate("a", [p])
    assert cache.take_events() == [
        BlockStored(block_hashes=p.hashes, parent_block_hash=None, token_ids=tuple(range(8)), block_size=BS)
    ]
    cache.free("a")
    longer = list(range(14))
    q = PromptBlocks(tokens=14, hashes=block_hashes(longer, block_size=BS), token_ids=tuple(longer))
    cache.allocate("b", [q])  # hits 2 blocks, stores the third after the second; no block is evicted
    assert cache.take_events() == [
        BlockStored(block_hashes=q.hashes[2:], parent_block_hash=q.hashes[1], token_ids=(8, 9, 10, 11),
                    block_size=BS),
    ]  # fmt: skip
    assert not cache.clear()  # "b" holds blocks
    cache.free("b")
    cache.allocate("c", [PromptBlocks(tokens=16)])  # 4 blocks: the 3 cached ones are evicted
    assert cache.take_events() == [BlockRemoved(block_hashes=(q.hashes[2], q.hashes[1], q.hashes[0]))]
    cache.free("c")
    assert cache.clear() and cache.take_events() == [AllBlocksCleared()]
    assert PrefixCache(num_blocks=4).take_events() == []


@given(tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), bs=st.integers(1, 8))
def test_block_hashes_chain_hash_block_tokens(tokens: list[int], bs: int) -> None:
    parent: bytes | None = None
    expected = []
    for start in range(0, len(tokens) - bs + 1, bs):
        parent = hash_block_tokens(parent, tokens[start : start + bs])
        expected.append(parent)
    assert block_hashes(tokens, block_size=bs) == tuple(expected)


@given(ops=ops_strategy, num_blocks=st.integers(1, 24))
def test_the_block_pool_counts_as_a_prefix_cache_that_never_hits(ops: list[Op], num_blocks: int) -> None:
    # prompts without hashes: the prefix cache hits and caches nothing, so it holds what the BlockPool holds
    cache = PrefixCache(num_blocks=num_blocks, block_size=BS)
    pool = BlockPool(num_blocks=num_blocks, block_size=BS)
    for op in ops:
        sid = f"s{op.seq}"
        if isinstance(op, Alloc):
            if cache.holds(sid):
                continue
            p = PromptBlocks(tokens=op.length)
            assert pool.blocks_needed([p], decode_tokens=op.decode) == cache.blocks_needed(
                [p], decode_tokens=op.decode
            )
            assert pool.allocate(sid, [p], decode_tokens=op.decode) == cache.allocate(
                sid, [p], decode_tokens=op.decode
            )
        elif isinstance(op, Extend):
            if cache.holds(sid):
                assert pool.extend(sid, op.blocks) == cache.extend(sid, op.blocks)
        else:
            assert pool.free(sid) == cache.free(sid)
        assert (pool.blocks_in_use, pool.free_blocks, pool.usage, pool.holds(sid)) == (
            cache.blocks_in_use,
            cache.free_blocks,
            cache.usage,
            cache.holds(sid),
        )
    assert pool.queries_total == cache.queries_total and pool.hits_total == cache.hits_total == 0


def test_extend_takes_lru_blocks_and_reports_their_eviction() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS, record_events=True)
    p = prompt(list(range(2 * BS)))
    assert cache.allocate("a", [p]).blocks == 2
    cache.free("a")  # its 2 cached blocks are free, LRU
    cache.take_events()
    assert cache.allocate("b", [PromptBlocks(tokens=1)]).blocks == 1  # a never-used block first
    assert cache.extend("b", 2)  # the last never-used block, then the LRU head: one of a's cached blocks
    assert cache.evictions_total == 1
    assert [type(e) for e in cache.take_events()] == [BlockRemoved]
    assert not cache.extend("b", 2)  # one block is free
    assert cache.blocks_in_use == 3
    with pytest.raises(KeyError):
        cache.extend("nobody", 1)
    with pytest.raises(ValueError, match="blocks must be >= 0"):
        cache.extend("b", -1)
