"""The precise prefix index (inferlb.policy.kv_index): its state, rebuilt from the KV events of the
simulators' prefix cache (simulation.kvcache, vLLM's rules) alone, is the cache's state for any operation
sequence; matches are leading runs; orphans, removals, clears and the memory bound."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferlb.policy import kv_index
from inferlb.policy.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, PreciseKvIndex
from inferlb.policy.picker import PrefixIndex
from inferlb.request.blocks import block_keys_of_tokens, root_key
from simulation import kvcache
from simulation.kvcache import PrefixCache, PromptBlocks

BS = 4
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def tokens_of(family: int, length: int) -> list[int]:
    """Family ``f``: a shared head of 8 tokens (two blocks), then tokens of its own."""
    return [7] * min(length, 8) + [1000 * (family + 1) + i for i in range(max(0, length - 8))]


def prompt(tokens: list[int]) -> PromptBlocks:
    return PromptBlocks(
        tokens=len(tokens), hashes=kvcache.block_hashes(tokens, block_size=BS), token_ids=tuple(tokens)
    )


def converted(events: list[kvcache.CacheEvent]) -> list[KvEvent]:
    """The simulator's events as the subscriber decodes them."""
    out: list[KvEvent] = []
    for e in events:
        if isinstance(e, kvcache.BlockStored):
            out.append(
                BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                            token_ids=e.token_ids, block_size=e.block_size, medium="GPU")
            )  # fmt: skip
        elif isinstance(e, kvcache.BlockRemoved):
            out.append(BlockRemoved(block_hashes=e.block_hashes, medium="GPU"))
        else:
            out.append(AllBlocksCleared())
    return out


def cached(cache: PrefixCache) -> Counter[bytes | int]:
    """Hash -> blocks holding it, the cache's own state."""
    return Counter({h: len(b) for h, b in cache._blocks_of.items()})


@dataclass(frozen=True)
class Alloc:
    seq: int
    family: int
    length: int
    decode: int


@dataclass(frozen=True)
class Free:
    seq: int


@dataclass(frozen=True)
class Clear:
    pass


ops_strategy = st.lists(
    st.one_of(
        st.builds(Alloc, st.integers(0, 7), st.integers(0, 3), st.integers(0, 40), st.integers(0, 12)),
        st.builds(Free, st.integers(0, 7)),
        st.just(Clear()),
    ),
    max_size=60,
)


sizes = st.integers(1, 24)


def stored(
    hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...], bs: int = BS, **kw: str
) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs, **kw)


def run(cache: PrefixCache, op: Alloc | Free | Clear) -> None:
    sid = f"s{op.seq}" if not isinstance(op, Clear) else ""
    if isinstance(op, Alloc):
        if not cache.holds(sid):
            cache.allocate(sid, [prompt(tokens_of(op.family, op.length))], decode_tokens=op.decode)
    elif isinstance(op, Free):
        cache.free(sid)
    else:
        cache.clear()


def leading_cached(cache: PrefixCache, tokens: list[int]) -> int:
    n = 0
    for h in kvcache.block_hashes(tokens, block_size=BS):
        if not cache.is_cached(h):
            break
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from([A, B]), ops_strategy), max_size=4), num_blocks=sizes)
@example(
    ops=[
        (A, [Alloc(0, 0, 12, 0), Free(0), Alloc(1, 1, 20, 0), Clear(), Alloc(2, 0, 16, 0)]),
    ],
    num_blocks=4,
)
def test_the_index_rebuilt_from_the_events_is_the_caches_state(
    ops: list[tuple[str, list[Alloc | Free | Clear]]], num_blocks: int
) -> None:
    """Two endpoints (the second with twice the blocks), each its own cache and operation runs."""
    caches = {
        A: PrefixCache(num_blocks=num_blocks, block_size=BS, record_events=True),
        B: PrefixCache(num_blocks=2 * num_blocks, block_size=BS, record_events=True),
    }
    index = PreciseKvIndex(block_size=BS)
    for address, run_ops in ops:
        cache = caches[address]
        for op in run_ops:
            run(cache, op)
            index.apply(address, converted(cache.take_events()))
            assert index.held_hashes(address) == cached(cache)
            # a match is, per endpoint, the leading run of blocks its cache holds
            for family in range(4):
                tokens = tokens_of(family, 40)
                keys = block_keys_of_tokens(tokens, block_size=BS)
                matched = index.matched_blocks(keys, [A, B])
                assert matched == {a: n for a, c in caches.items() if (n := leading_cached(c, tokens))}
    assert index.counters.orphaned_blocks == 0  # the cache never stores a run after a parent it lacks


def test_keys_are_the_gateways_keys_of_the_stored_tokens() -> None:
    cache = PrefixCache(num_blocks=64, block_size=BS, record_events=True)
    index = PreciseKvIndex(block_size=BS)
    short, long = list(range(10)), list(range(23))
    cache.allocate("a", [prompt(short)])
    cache.allocate("b", [prompt(long)])  # hits 2 blocks, stores 3 more chained on the second
    index.apply(A, converted(cache.take_events()))
    assert index.held_keys(A) == frozenset(block_keys_of_tokens(long, block_size=BS))
    keys = block_keys_of_tokens([*range(20), 99, 99, 99, 99], block_size=BS)
    assert index.matched_blocks(keys, [A, B]) == {A: 5}
    assert index.matched_blocks(keys, [B]) == {}
    assert index.matched_blocks((), [A]) == {}


def test_matches_are_leading_runs_per_endpoint() -> None:
    index = PreciseKvIndex(block_size=BS)
    tokens = list(range(24))  # 6 blocks
    keys = block_keys_of_tokens(tokens, block_size=BS)
    hashes = tuple(f"h{i}".encode() for i in range(6))
    index.apply(A, [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tuple(tokens),
                                block_size=BS)])  # fmt: skip
    index.apply(B, [BlockStored(block_hashes=hashes[:3], parent_block_hash=None, token_ids=tuple(tokens[:12]),
                                block_size=BS)])  # fmt: skip
    assert index.matched_blocks(keys, [A, B]) == {A: 6, B: 3}
    # a hole (an evicted head block) ends the run there, whatever follows it
    index.apply(A, [BlockRemoved(block_hashes=(hashes[1],))])
    assert index.matched_blocks(keys, [A, B]) == {A: 1, B: 3}
    assert index.matched_blocks(keys[:2], [A, B]) == {A: 1, B: 2}
    index.remove_endpoint(B)
    assert index.matched_blocks(keys, [A, B]) == {A: 1} and index.endpoints == {A}
    index.apply(A, [AllBlocksCleared()])
    assert index.matched_blocks(keys, [A, B]) == {} and index._holders == {}


def test_copies_orphans_unknown_removals_other_block_sizes_and_lora() -> None:
    index = PreciseKvIndex(block_size=BS)
    tokens = tuple(range(8))
    index.apply(A, [stored((1, 2), None, tokens), stored((2,), 1, tokens[4:], medium="CPU")])
    assert index.held_hashes(A) == {1: 1, 2: 2}
    index.apply(A, [BlockRemoved(block_hashes=(2,), medium="GPU")])  # the CPU copy stays: still a hit
    keys = block_keys_of_tokens(tokens, block_size=BS)
    assert index.matched_blocks(keys, [A]) == {A: 2}
    # a parent never seen: the run is skipped, and so is its child
    orphans = [stored((9,), 8, tokens[:4]), stored((10,), 9, tokens[:4])]
    index.apply(A, [*orphans, BlockRemoved(block_hashes=(9, 77))])
    assert index.counters.orphaned_blocks == 2 and index.counters.unknown_removals == 2
    assert set(index.held_hashes(A)) == {1, 2}
    index.apply(A, [stored((5,), None, tokens[:8], bs=8)])
    assert index.counters.other_block_size == 1 and set(index.held_hashes(A)) == {1, 2}
    index.apply(B, [stored((1,), None, tokens[:4], lora_name="sql")])
    assert index.matched_blocks(keys, [B]) == {}
    lora_keys = block_keys_of_tokens(tokens, block_size=BS, parent=root_key("sql"))
    assert index.matched_blocks(lora_keys, [A, B]) == {B: 1}
    with pytest.raises(ValueError, match="token ids"):
        index.apply(A, [stored((3,), None, (1,))])
    with pytest.raises(ValueError, match="token ids"):
        index.apply(A, [stored((3,), None, (-1, 0, 0, 0))])
    assert set(index.held_hashes(A)) == {1, 2}  # a refused event changed nothing


def test_an_endpoint_over_its_bound_is_dropped_not_grown() -> None:
    index = PreciseKvIndex(block_size=1, max_blocks=4)
    index.apply(A, [BlockStored(block_hashes=(1, 2, 3), parent_block_hash=None, token_ids=(1, 2, 3),
                                block_size=1)])  # fmt: skip
    index.apply(B, [BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(1,), block_size=1)])
    index.apply(A, [BlockStored(block_hashes=(4, 5), parent_block_hash=3, token_ids=(4, 5), block_size=1)])
    assert index.counters.overflow_resets == 1 and index.held_hashes(A) == {}
    assert index.matched_blocks(block_keys_of_tokens([1, 2], block_size=1), [A, B]) == {B: 1}
    with pytest.raises(ValueError, match="max_blocks"):
        PreciseKvIndex(max_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        PreciseKvIndex(block_size=0)


def test_it_is_a_prefix_index() -> None:
    index: PrefixIndex = PreciseKvIndex()
    index.record_pick(A, (1, 2))  # learns nothing from picks
    assert index.matched_blocks((1, 2), [A]) == {}
    assert kv_index.DEFAULT_MAX_BLOCKS >= 1 << 16


@settings(max_examples=300, deadline=None)
@given(
    holdings=st.lists(st.tuples(st.integers(0, 2), st.integers(-1, 3), st.booleans()), max_size=30),
    asked=st.lists(st.integers(0, 2), max_size=3),
)
@example(holdings=[(0, 0, True), (0, 1, True), (0, -1, True), (1, 0, True)], asked=[1])
def test_matches_agree_with_a_naive_leading_run_as_endpoints_come_and_go(
    holdings: list[tuple[int, int, bool]], asked: list[int]
) -> None:
    """Endpoints store and remove single blocks of one 4-block prompt, or are cleared (block -1; their bits
    are reused by the next endpoint seen): each match is the naive leading run of what each asked endpoint
    holds."""
    tokens = tuple(range(4 * BS))
    keys = block_keys_of_tokens(tokens, block_size=BS)
    index = PreciseKvIndex(block_size=BS)
    held: dict[str, set[int]] = {}
    for endpoint, block, store in holdings:
        address = f"10.0.0.{endpoint}:8000"
        mine = held.get(address, set())
        if block < 0:
            index.clear(address)
            held.pop(address, None)
        elif store and block not in mine and (block == 0 or block - 1 in mine):
            index.apply(
                address,
                [stored((block,), block - 1 if block else None, tokens[block * BS : (block + 1) * BS])],
            )
            held.setdefault(address, set()).add(block)
        elif not store and block in mine:
            index.apply(address, [BlockRemoved(block_hashes=(block,))])
            mine.discard(block)
    addresses = [f"10.0.0.{e}:8000" for e in asked]
    expected = {}
    for a in addresses:
        n = 0
        while n < len(keys) and n in held.get(a, set()):
            n += 1
        if n:
            expected[a] = n
    assert index.matched_blocks(keys, addresses) == expected
