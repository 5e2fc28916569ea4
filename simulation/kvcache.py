"""A model of vLLM's automatic prefix caching (APC) for one GPU. Pure: no I/O, no clock.

Shared by the simulated GPU server's engine (:mod:`simulation.gpusim.engine`) and the fleet simulation
(:mod:`simulation.fleetsim`, through the engines injected into it), so that both apply the same rules. The
rules are those of vLLM's design doc "Automatic Prefix Caching"
(https://docs.vllm.ai/en/latest/design/prefix_caching/) and its v1 KV-cache manager:

* **Blocks.** A prompt's tokens are cut into blocks of ``block_size`` tokens (vLLM's default 16). Only
  *full* blocks are cached; the last, partial block of a prompt never is.
* **Chained hashes.** A block's hash covers its parent's hash and its own tokens (vLLM's
  ``hash_block_tokens(parent_block_hash, curr_block_token_ids, extra_keys)``); the first block's parent is a
  fixed seed (:data:`NONE_HASH`; vLLM's is random per process unless ``PYTHONHASHSEED`` is set, ours is a
  constant so runs reproduce). So a block is found only when its whole prefix is the same: one changed token
  misses its block and every later one. :func:`hash_block_tokens` uses SHA-256 (vLLM's
  ``--prefix-caching-hash-algo sha256``) over a fixed byte layout of our own: hashes are only ever compared
  with hashes made here, never with a real vLLM's.
* **The pool.** The GPU holds ``num_blocks`` physical blocks (its KV budget over the block size). A block is
  *in use* while a running sequence references it (reference counts: a block shared by two sequences has a
  count of 2) and *free* otherwise. Free blocks keep their hash and content until reused, and sit in an LRU
  queue (vLLM's ``FreeKVCacheBlockQueue``): allocation takes the queue's head, evicting the cached hash it
  had; a finished sequence's blocks go to the tail in *reverse* order, so that a prefix's tail blocks are
  evicted before its head. A block in use is never evicted. Two blocks may hold one hash, as in vLLM (a
  prompt's last block recomputed on a full hit, a block recomputed after its prefix's head was evicted).
* **A cache hit** is the longest run of leading blocks whose hashes are cached (``find_longest_cache_hit``);
  at most ``prompt_tokens - 1`` tokens can hit, since the last prompt token is always recomputed to get
  logits (vLLM's ``get_computed_blocks``). Hit blocks in the free queue leave it (their count goes to 1).
* **KV events** (with ``record_events``), as vLLM's KV-cache manager emits them for ``--kv-events-config``
  (``vllm/distributed/kv_events.py``): :class:`BlockRemoved` for the cached hashes an allocation evicted,
  then :class:`BlockStored` for each prompt's newly cached run of blocks (its hashes, the hash of the block
  before it, its tokens), and :class:`AllBlocksCleared` when :meth:`PrefixCache.clear` empties the cache.
  :meth:`PrefixCache.take_events` hands them over in order.
* **Counters**, in tokens as vLLM's ``PrefixCacheStats`` counts them (``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total``): every lookup adds its prompt tokens to the queries and its hit blocks
  x ``block_size`` to the hits.

What this model does differently from vLLM, on purpose:

* A sequence reserves its blocks for its whole length (prompt + every token it will generate) when it is
  scheduled; vLLM allocates the decode blocks one step at a time. A request of several prompts or samples
  reserves its prompts' full blocks once and ``ceil((partial tails + decode tokens) / block_size)`` blocks
  for the rest (vLLM gives each sequence its own tail block). The blocks evicted are the same ones, only
  earlier. Generated tokens' blocks are never cached (the simulator's completions are not real text).
* When the free blocks cannot hold a new sequence, :meth:`PrefixCache.allocate` still runs it, *without*
  blocks (:attr:`CacheAllocation.held` False, counted in :attr:`PrefixCache.unheld_total`): its hits are
  counted, it caches nothing and pins nothing. The engine (:mod:`simulation.scheduler` has its rules) never
  lets that happen: it admits a sequence only when :meth:`PrefixCache.blocks_needed` fit in the free blocks,
  grows a running sequence's blocks with :meth:`PrefixCache.extend` as it decodes, and preempts when they
  run out, as vLLM's scheduler does.

:class:`BlockPool` is the same pool without prefix caching (``--no-enable-prefix-caching``): blocks are
counted, never hashed, so that one KV-usage view (``vllm:kv_cache_usage_perc``) holds either way.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

#: vLLM's default ``--block-size`` (tokens per KV-cache block).
DEFAULT_BLOCK_SIZE: Final = 16
#: The parent of a prompt's first block (vLLM's ``NONE_HASH``; fixed here, see the module doc).
NONE_HASH: Final = hashlib.sha256(b"inferlb-simulation-prefix-cache-none-hash").digest()

#: A block hash: 32 bytes of SHA-256 from :func:`hash_block_tokens`, or an id a trace gives (the Mooncake
#: trace's ``hash_ids``, already chained by its authors).
BlockHash = bytes | int


def hash_block_tokens(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The hash of one block: SHA-256 over its parent's hash (:data:`NONE_HASH` for a prompt's first block)
    and its token ids, each an 8-byte big-endian signed integer (32 bytes).

    As vLLM's ``hash_block_tokens``, without ``extra_keys`` (LoRA, multimodal inputs, cache salt: the
    simulated requests carry none).

    Raises:
        struct.error: a token id outside the 64-bit signed range.
    """
    h = hashlib.sha256(parent if parent is not None else NONE_HASH)
    h.update(struct.pack(f">{len(tokens)}q", *tokens))
    return h.digest()


def block_hashes(token_ids: Sequence[int], *, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[bytes, ...]:
    """The chained hashes of the full blocks of ``token_ids`` (``len(token_ids) // block_size`` of them; the
    partial last block has none): :func:`hash_block_tokens` of each block on its parent's, computed over the
    prompt's ids packed once.

    Raises:
        ValueError: ``block_size < 1``.
        OverflowError: a token id outside the 64-bit signed range.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    # the bytes hash_block_tokens hashes, packed once for the whole prompt (8-byte big-endian signed ids)
    packed = array("q", token_ids)
    if sys.byteorder == "little":
        packed.byteswap()
    data = memoryview(packed.tobytes())
    step = 8 * block_size
    out: list[bytes] = []
    parent = NONE_HASH
    for start in range(0, (len(token_ids) // block_size) * step, step):
        h = hashlib.sha256(parent)
        h.update(data[start : start + step])
        parent = h.digest()
        out.append(parent)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class PromptBlocks:
    """One prompt as the cache sees it: its token count and the chained hashes of its full blocks.

    Attributes:
        tokens: prompt tokens (>= 0).
        hashes: hashes of its full blocks, in order (at most ``tokens // block_size`` are used; a trace may
            give fewer, then the rest cannot hit nor be cached).
        token_ids: its token ids when known (for :class:`BlockStored` events; a trace has none).
    """

    tokens: int
    hashes: tuple[BlockHash, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Blocks were cached: ``block_hashes`` in prompt order, after the block of ``parent_block_hash`` (None:
    they start the prompt), holding ``token_ids`` (``block_size`` per block; empty when unknown)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    """Cached blocks were evicted (their blocks reused): one entry per evicted block."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block was dropped (:meth:`PrefixCache.clear`)."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, kw_only=True)
class CacheAllocation:
    """What :meth:`PrefixCache.allocate` did for one sequence.

    Attributes:
        prompt_tokens: tokens of its prompts (the lookup's queries).
        hit_tokens: prompt tokens found in the cache (the lookup's hits; their prefill is skipped).
        held: True when its blocks were allocated (pinned until :meth:`PrefixCache.free`); False when the
            free blocks could not hold it (see the module doc).
        blocks: blocks it holds (0 when not held).
    """

    prompt_tokens: int
    hit_tokens: int
    held: bool
    blocks: int

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens to prefill: ``prompt_tokens - hit_tokens``."""
        return self.prompt_tokens - self.hit_tokens


@dataclass(kw_only=True)
class PrefixCache:
    """The KV-cache blocks of one GPU under vLLM's prefix caching (see the module doc). Sequences are named by
    the caller (a request id).

    Physical blocks are numbered ``0..num_blocks-1`` and created lazily: blocks never used yet stand at the
    head of the free queue (as in vLLM, where every block starts free, in order), so a 1,000-GPU simulation
    only holds the blocks its traffic touched.

    Args:
        num_blocks: physical blocks (the KV budget in tokens // ``block_size``, >= 1).
        block_size: tokens per block (>= 1).
        record_events: keep the KV events for :meth:`take_events` (off: none are kept).

    Raises:
        ValueError: ``num_blocks < 1`` or ``block_size < 1``.
    """

    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    record_events: bool = False
    #: tokens of prompts looked up (``vllm:prefix_cache_queries_total``)
    queries_total: int = 0
    #: prompt tokens found cached (``vllm:prefix_cache_hits_total``)
    hits_total: int = 0
    #: sequences run without blocks because the free blocks could not hold them
    unheld_total: int = 0
    #: cached hashes evicted to reuse their blocks
    evictions_total: int = 0
    _fresh: int = 0  # blocks 0.._fresh-1 have been used; the rest were never allocated
    _ref: dict[int, int] = field(default_factory=dict)  # block -> reference count, blocks in use only
    _free: OrderedDict[int, None] = field(default_factory=OrderedDict)  # used free blocks, LRU head first
    _hash_of: dict[int, BlockHash] = field(default_factory=dict)  # block -> its cached hash
    #: cached hash -> the blocks holding it (in the order cached; a lookup takes the first, as vLLM's
    #: ``BlockHashToBlockMap.get_one_block``)
    _blocks_of: dict[BlockHash, dict[int, None]] = field(default_factory=dict)
    _seqs: dict[str, list[int]] = field(default_factory=dict)  # sequence -> its blocks, in order
    _events: list[CacheEvent] = field(default_factory=list)
    _evicted: list[BlockHash] = field(default_factory=list)  # hashes evicted by the allocation under way

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @classmethod
    def for_budget(cls, kv_budget_tokens: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> PrefixCache:
        """A cache of ``max(1, kv_budget_tokens // block_size)`` blocks (vLLM's ``num_gpu_blocks``)."""
        return cls(num_blocks=max(1, kv_budget_tokens // block_size), block_size=block_size)

    # -- queries --------------------------------------------------------------------------------------------

    @property
    def blocks_in_use(self) -> int:
        """Blocks referenced by a sequence (never more than :attr:`num_blocks`)."""
        return len(self._ref)

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence references (cached or not): ``num_blocks - blocks_in_use``."""
        return self.num_blocks - len(self._ref)

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a cached hash (in use or free)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Blocks in use over all blocks, 0..1 (vLLM's ``kv_cache_usage``)."""
        return len(self._ref) / self.num_blocks

    def is_cached(self, block_hash: BlockHash) -> bool:
        """True when a block holds ``block_hash``."""
        return block_hash in self._blocks_of

    def ref_count(self, block_hash: BlockHash) -> int:
        """References to the blocks holding ``block_hash`` (0 when they are all free, or none holds it)."""
        return sum(self._ref.get(b, 0) for b in self._blocks_of.get(block_hash, ()))

    def holds(self, seq_id: str) -> bool:
        """True while ``seq_id`` holds blocks (allocated, not yet freed)."""
        return seq_id in self._seqs

    def cached_prefix_blocks(self, prompt: PromptBlocks) -> int:
        """Leading blocks of ``prompt`` a lookup would hit now (at most ``(tokens - 1) // block_size``); no
        side effect."""
        most = max(0, prompt.tokens - 1) // self.block_size
        n = 0
        for h in prompt.hashes[:most]:
            if h not in self._blocks_of:
                break
            n += 1
        return n

    def blocks_needed(self, prompts: Sequence[PromptBlocks], *, decode_tokens: int = 0) -> int:
        """Free blocks :meth:`allocate` would take now for ``prompts`` and ``decode_tokens`` more tokens: its
        new blocks plus the hit blocks that are free now (pinning takes them out of the free pool). No side
        effect; the allocation is held when this is at most :attr:`free_blocks`.

        Raises:
            ValueError: a negative token count.
        """
        if decode_tokens < 0 or any(p.tokens < 0 for p in prompts):
            raise ValueError("token counts must be >= 0")
        new_needed, hit_blocks = self._plan(prompts, decode_tokens)
        return new_needed + len({b for b in hit_blocks if b not in self._ref})

    def _plan(self, prompts: Sequence[PromptBlocks], decode_tokens: int) -> tuple[int, list[int]]:
        """(new blocks needed, the blocks the prompts' cached prefixes hit, in order)."""
        bs = self.block_size
        hits = [self.cached_prefix_blocks(p) for p in prompts]
        full_new = sum(p.tokens // bs - k for p, k in zip(prompts, hits, strict=True))
        new_needed = full_new + math.ceil((sum(p.tokens % bs for p in prompts) + decode_tokens) / bs)
        hit_blocks = [
            next(iter(self._blocks_of[h])) for p, k in zip(prompts, hits, strict=True) for h in p.hashes[:k]
        ]
        return new_needed, hit_blocks

    # -- operations -----------------------------------------------------------------------------------------

    def extend(self, seq_id: str, blocks: int) -> bool:
        """Give sequence ``seq_id`` ``blocks`` more blocks for the tokens it decodes (never cached), taken
        from the LRU head of the free queue as :meth:`allocate` takes them (evicting their cached hashes).
        Returns False, changing nothing, when fewer than ``blocks`` are free.

        Raises:
            KeyError: ``seq_id`` holds no blocks.
            ValueError: ``blocks < 0``.
        """
        held = self._seqs[seq_id]
        if not _extension_fits(blocks, self.free_blocks):
            return False
        held.extend(self._take_free_block() for _ in range(blocks))
        if self._evicted:
            if self.record_events:
                self._events.append(BlockRemoved(block_hashes=tuple(self._evicted)))
            self._evicted.clear()
        return True

    def allocate(
        self, seq_id: str, prompts: Sequence[PromptBlocks], *, decode_tokens: int = 0
    ) -> CacheAllocation:
        """Schedule sequence ``seq_id``: look up each prompt's cached prefix (counting queries and hits),
        then pin the hit blocks, take new blocks for the rest of the prompts and ``decode_tokens`` more
        tokens, and cache the prompts' new full blocks under their hashes.

        A request of several prompts (legacy completions, embeddings) is one sequence here with one chain
        per prompt; a request of ``n`` samples passes its prompt once and ``n`` x its completion tokens as
        ``decode_tokens``.

        Raises:
            ValueError: ``seq_id`` already holds blocks, or a negative token count.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if decode_tokens < 0 or any(p.tokens < 0 for p in prompts):
            raise ValueError("token counts must be >= 0")
        bs = self.block_size
        hits = [self.cached_prefix_blocks(p) for p in prompts]
        prompt_tokens = sum(p.tokens for p in prompts)
        hit_tokens = sum(hits) * bs
        self.queries_total += prompt_tokens
        self.hits_total += hit_tokens
        # blocks: the prompts' full blocks not hit, then blocks for the prompts' partial tails and the decode
        # tokens together (one prompt: ceil((prompt + decode tokens) / block_size) blocks in all)
        new_needed, hit_blocks = self._plan(prompts, decode_tokens)
        # hit blocks that are free now leave the free pool when pinned: they cannot also be reused
        hit_free = len({b for b in hit_blocks if b not in self._ref})
        if new_needed > self.free_blocks - hit_free:
            self.unheld_total += 1
            return CacheAllocation(prompt_tokens=prompt_tokens, hit_tokens=hit_tokens, held=False, blocks=0)
        held: list[int] = []
        for b in hit_blocks:
            self._touch(b)
            held.append(b)
        # every new block first (evicting what it must), then the caching, as vLLM's allocate_slots does:
        # a hash that was cached elsewhere and evicted by this very allocation is cached again
        fresh = [self._take_free_block() for _ in range(new_needed)]
        if self._evicted:
            if self.record_events:
                self._events.append(BlockRemoved(block_hashes=tuple(self._evicted)))
            self._evicted.clear()
        taken = iter(fresh)
        for p, k in zip(prompts, hits, strict=True):
            for i in range(k, p.tokens // bs):
                b = next(taken)
                if i < len(p.hashes):
                    self._cache(b, p.hashes[i])
            stored = min(p.tokens // bs, len(p.hashes))
            if self.record_events and stored > k:
                self._events.append(
                    BlockStored(
                        block_hashes=p.hashes[k:stored],
                        parent_block_hash=p.hashes[k - 1] if k else None,
                        token_ids=p.token_ids[k * bs : stored * bs],
                        block_size=bs,
                    )
                )
        held.extend(fresh)
        self._seqs[seq_id] = held
        return CacheAllocation(
            prompt_tokens=prompt_tokens, hit_tokens=hit_tokens, held=True, blocks=len(held)
        )

    def free(self, seq_id: str) -> bool:
        """Sequence ``seq_id`` finished or was cancelled: drop its references, in reverse order, so that its
        tail blocks reach the LRU head first. Returns False when it held no blocks."""
        blocks = self._seqs.pop(seq_id, None)
        if blocks is None:
            return False
        for b in reversed(blocks):
            n = self._ref[b] - 1
            if n:
                self._ref[b] = n
            else:
                del self._ref[b]
                self._free[b] = None
        return True

    def clear(self) -> bool:
        """Drop every cached hash (vLLM's ``reset_prefix_cache``), only when no sequence holds blocks; then
        an :class:`AllBlocksCleared` event. Returns False (and changes nothing) while blocks are in use."""
        if self._ref:
            return False
        self._hash_of.clear()
        self._blocks_of.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[CacheEvent]:
        """The KV events since the last call, in order (empty without ``record_events``)."""
        out, self._events = self._events, []
        return out

    # -- blocks ---------------------------------------------------------------------------------------------

    def _touch(self, block: int) -> None:
        n = self._ref.get(block, 0)
        if n == 0:
            del self._free[block]
        self._ref[block] = n + 1

    def _take_free_block(self) -> int:
        """The LRU head of the free queue (never-used blocks first), its cached hash evicted, referenced once.
        The caller has checked that a free block exists."""
        if self._fresh < self.num_blocks:
            b = self._fresh
            self._fresh += 1
        else:
            b, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(b, None)
            if old is not None:
                holders = self._blocks_of[old]
                del holders[b]
                if not holders:
                    del self._blocks_of[old]
                self.evictions_total += 1
                self._evicted.append(old)
        self._ref[b] = 1
        return b

    def _cache(self, block: int, block_hash: BlockHash) -> None:
        """Register ``block`` under ``block_hash``, beside any other block that holds it already (a prompt
        whose last block was recomputed, or a prefix whose head was evicted before its tail), as vLLM does."""
        self._blocks_of.setdefault(block_hash, {})[block] = None
        self._hash_of[block] = block_hash


def _extension_fits(blocks: int, free_blocks: int) -> bool:
    """True when ``blocks`` more blocks are free. Raises ValueError for ``blocks < 0``."""
    if blocks < 0:
        raise ValueError(f"blocks must be >= 0, got {blocks}")
    return blocks <= free_blocks


@dataclass(kw_only=True)
class BlockPool:
    """The KV-cache blocks of one GPU without prefix caching: the interface of :class:`PrefixCache` that the
    engine uses, counting blocks only (nothing is hashed, so nothing hits nor is evicted). A sequence takes
    ``sum(tokens // block_size) + ceil((sum(tokens % block_size) + decode_tokens) / block_size)`` blocks, as
    in :class:`PrefixCache`.

    Args:
        num_blocks: physical blocks (>= 1).
        block_size: tokens per block (>= 1).

    Raises:
        ValueError: ``num_blocks < 1`` or ``block_size < 1``.
    """

    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    #: prompt tokens of the sequences allocated (no lookup hits: the hits stay 0)
    queries_total: int = 0
    hits_total: int = 0
    _used: int = 0
    _seqs: dict[str, int] = field(default_factory=dict)  # sequence -> blocks it holds

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by sequences."""
        return self._used

    @property
    def free_blocks(self) -> int:
        """``num_blocks - blocks_in_use``."""
        return self.num_blocks - self._used

    @property
    def usage(self) -> float:
        """Blocks in use over all blocks, 0..1."""
        return self._used / self.num_blocks

    def holds(self, seq_id: str) -> bool:
        """True while ``seq_id`` holds blocks."""
        return seq_id in self._seqs

    def blocks_needed(self, prompts: Sequence[PromptBlocks], *, decode_tokens: int = 0) -> int:
        """Blocks :meth:`allocate` would take (see the class doc). Raises ValueError on a negative count."""
        if decode_tokens < 0 or any(p.tokens < 0 for p in prompts):
            raise ValueError("token counts must be >= 0")
        bs = self.block_size
        return sum(p.tokens // bs for p in prompts) + math.ceil(
            (sum(p.tokens % bs for p in prompts) + decode_tokens) / bs
        )

    def allocate(
        self, seq_id: str, prompts: Sequence[PromptBlocks], *, decode_tokens: int = 0
    ) -> CacheAllocation:
        """Take :meth:`blocks_needed` blocks for ``seq_id`` (not held, as :meth:`PrefixCache.allocate`, when
        they are not free).

        Raises:
            ValueError: ``seq_id`` already holds blocks, or a negative token count.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        need = self.blocks_needed(prompts, decode_tokens=decode_tokens)
        prompt_tokens = sum(p.tokens for p in prompts)
        self.queries_total += prompt_tokens
        if need > self.free_blocks:
            return CacheAllocation(prompt_tokens=prompt_tokens, hit_tokens=0, held=False, blocks=0)
        self._seqs[seq_id] = need
        self._used += need
        return CacheAllocation(prompt_tokens=prompt_tokens, hit_tokens=0, held=True, blocks=need)

    def extend(self, seq_id: str, blocks: int) -> bool:
        """``blocks`` more for ``seq_id``; False, changing nothing, when they are not free.

        Raises:
            KeyError: ``seq_id`` holds no blocks.
            ValueError: ``blocks < 0``.
        """
        held = self._seqs[seq_id]
        if not _extension_fits(blocks, self.free_blocks):
            return False
        self._seqs[seq_id] = held + blocks
        self._used += blocks
        return True

    def free(self, seq_id: str) -> bool:
        """Release ``seq_id``'s blocks. False when it held none."""
        n = self._seqs.pop(seq_id, None)
        if n is None:
            return False
        self._used -= n
        return True
