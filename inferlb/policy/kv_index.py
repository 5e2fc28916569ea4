"""The precise prefix index (pure): which blocks each endpoint's prefix cache holds, rebuilt from the model
servers' KV events, as a :class:`~inferlb.policy.picker.PrefixIndex` for the endpoint picker.

vLLM publishes its prefix cache's changes with ``--kv-events-config`` (``vllm/distributed/kv_events.py``):
``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_name, medium}`` when a run of
full blocks is cached, ``BlockRemoved{block_hashes, medium}`` when blocks are evicted and
``AllBlocksCleared`` when the cache is reset. The engine's block hashes are its own (SHA-256 seeded per
process), so, as llm-d's KV-cache indexer does, the index recomputes the gateway's keys
(:mod:`inferlb.request.blocks`) from each stored run's ``token_ids``, chained on the key of the run's parent,
and maps each engine hash to its key. The ZMQ subscriber that decodes the wire format and feeds this index
is :mod:`inferlb.adapters.kv_events`; nothing here does I/O.

The rules, per endpoint:

* **Copies.** A hash may be stored more than once (vLLM caches a prompt's last block again on a full hit;
  an offloading connector stores a block again under another ``medium``), and each ``BlockRemoved`` drops one
  copy: a key is held while any copy of any hash mapped to it is. Every medium counts (a block offloaded to
  CPU memory is still a hit, loaded instead of recomputed).
* **A parent the index has never seen** (a ``BlockStored`` whose ``parent_block_hash`` maps to no key: the
  events before it were lost, or it was stored before the subscriber joined): the run is *skipped* and
  counted (:attr:`IndexCounters.orphaned_blocks`). Its keys cannot be computed without the parent's, and a
  run without its parent can never extend a leading match anyway. Its own children are skipped in turn.
* **Removal of an unknown hash** (never stored here, or skipped): ignored and counted.
* **Another block size** than the index's: skipped and counted (the picker's block size must be the
  engines' ``--block-size``, which ``vllm:cache_config_info`` shows).
* **LoRA**: a run stored under ``lora_name`` without a parent chains on
  :func:`~inferlb.request.blocks.root_key` of the adapter, as vLLM puts the adapter into its block hashes.
* **Bounded memory**: an endpoint holds at most ``max_blocks`` hashes. vLLM's pool bounds what it caches
  (``num_gpu_blocks``), so more means removals were lost: the endpoint's state is dropped (counted in
  :attr:`IndexCounters.overflow_resets`) and rebuilt from the next events, which only ever misses blocks
  (the safe side: a miss places a request by load, a false hit would send it to a cold cache).
* **Clearing** (:meth:`PreciseKvIndex.clear`, on ``AllBlocksCleared``, a publisher restart or a sequence
  gap the replay could not fill) and **removing** an endpoint (:meth:`PreciseKvIndex.remove_endpoint`) drop
  its state; an endpoint with no state matches nothing (the picker places by load alone).

A match (:meth:`PreciseKvIndex.matched_blocks`) is the leading run of a request's keys an endpoint holds,
walked once over all endpoints at a time: per block, one set intersection of the endpoints still matching
with the block's holders, so its cost is the matched length times the endpoints still in the run.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec

from inferlb.request.blocks import DEFAULT_BLOCK_SIZE, block_keys_of_tokens, root_key

#: An engine's block hash as vLLM's events carry it (``ExternalBlockHash``: bytes or int).
EngineHash = bytes | int

#: Hashes one endpoint may hold before its state is taken as wrong and dropped (see the module doc).
DEFAULT_MAX_BLOCKS: Final = 1 << 18


class BlockStored(msgspec.Struct, frozen=True, kw_only=True):
    """A run of full blocks was cached (vLLM's ``BlockStored``).

    Attributes:
        block_hashes: the engine's hashes of the run's blocks, in order.
        parent_block_hash: the hash of the block before the run, None when the run starts a prompt.
        token_ids: the run's token ids (``len(block_hashes) * block_size`` of them).
        block_size: tokens per block.
        lora_name: the LoRA adapter the blocks were computed under, None for the base model.
        medium: where the blocks are (``"GPU"``, ``"CPU"``, ...), None when the server does not say.
    """

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks were evicted (vLLM's ``BlockRemoved``): one copy of each hash."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, kw_only=True):
    """The prefix cache was reset (vLLM's ``AllBlocksCleared``)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class IndexCounters:
    """What the index skipped or dropped, since it was made (counts; for the adapter's metrics).

    Attributes:
        stored_blocks: blocks of ``BlockStored`` events applied.
        removed_blocks: copies dropped by ``BlockRemoved`` events.
        orphaned_blocks: blocks skipped because their parent was unknown.
        unknown_removals: removed hashes the index did not hold.
        other_block_size: blocks skipped because their event had another block size.
        overflow_resets: endpoint states dropped for holding more than ``max_blocks`` hashes.
    """

    stored_blocks: int = 0
    removed_blocks: int = 0
    orphaned_blocks: int = 0
    unknown_removals: int = 0
    other_block_size: int = 0
    overflow_resets: int = 0


@dataclass
class _Endpoint:
    key_of: dict[EngineHash, int] = field(default_factory=dict)  # engine hash -> our key
    copies: dict[EngineHash, int] = field(default_factory=dict)  # engine hash -> copies held (>= 1)
    hashes_of: dict[int, int] = field(default_factory=dict)  # our key -> engine hashes held mapped to it


class PreciseKvIndex:
    """A :class:`~inferlb.policy.picker.PrefixIndex` rebuilt from each endpoint's KV events (see the module
    doc). Not thread-safe: one owner (the event loop of the subscriber and the picker) applies and reads.

    Args:
        block_size: tokens per block of the keys the picker asks about (the engines' ``--block-size``).
        max_blocks: hashes one endpoint may hold (see the module doc).

    Raises:
        ValueError: ``block_size`` or ``max_blocks`` below 1.
    """

    def __init__(self, *, block_size: int = DEFAULT_BLOCK_SIZE, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.counters = IndexCounters()
        self._endpoints: dict[str, _Endpoint] = {}
        self._holders: dict[int, set[str]] = {}  # our key -> the endpoints holding it

    # -- events ---------------------------------------------------------------------------------------------

    def apply(self, address: str, events: Iterable[KvEvent]) -> None:
        """Apply one endpoint's events, in order (one ``EventBatch``'s, or several in sequence).

        Raises:
            ValueError: a ``BlockStored`` whose token count is not ``len(block_hashes) * block_size`` or
                whose token ids are not in 0..2**32-1; the events before it stay applied.
        """
        for event in events:
            if isinstance(event, BlockStored):
                self._store(address, event)
            elif isinstance(event, BlockRemoved):
                self._remove(address, event.block_hashes)
            else:
                self.clear(address)

    def clear(self, address: str) -> None:
        """Drop everything ``address`` holds (its cache was reset, or its events can no longer be trusted)."""
        state = self._endpoints.pop(address, None)
        if state is None:
            return
        for key in state.hashes_of:
            holders = self._holders[key]
            holders.discard(address)
            if not holders:
                del self._holders[key]

    def remove_endpoint(self, address: str) -> None:
        """``address`` left the fleet: the same as :meth:`clear`."""
        self.clear(address)

    def _store(self, address: str, event: BlockStored) -> None:
        n = len(event.block_hashes)
        if event.block_size != self.block_size:
            self.counters.other_block_size += n
            return
        if len(event.token_ids) != n * event.block_size:
            raise ValueError(
                f"BlockStored has {len(event.token_ids)} token ids for {n} blocks of {event.block_size}"
            )
        state = self._endpoints.get(address)
        if event.parent_block_hash is None:
            parent = root_key(event.lora_name)
        elif state is not None and event.parent_block_hash in state.key_of:
            parent = state.key_of[event.parent_block_hash]
        else:
            self.counters.orphaned_blocks += n
            return
        keys = block_keys_of_tokens(event.token_ids, block_size=self.block_size, parent=parent)
        if state is None:
            state = self._endpoints[address] = _Endpoint()
        for h, key in zip(event.block_hashes, keys, strict=True):
            held = state.copies.get(h, 0)
            if held:
                state.copies[h] = held + 1
                continue
            state.copies[h] = 1
            state.key_of[h] = key
            count = state.hashes_of.get(key, 0)
            state.hashes_of[key] = count + 1
            if not count:
                self._holders.setdefault(key, set()).add(address)
        self.counters.stored_blocks += n
        if len(state.copies) > self.max_blocks:
            self.counters.overflow_resets += 1
            self.clear(address)

    def _remove(self, address: str, hashes: Sequence[EngineHash]) -> None:
        state = self._endpoints.get(address)
        for h in hashes:
            held = state.copies.get(h, 0) if state is not None else 0
            if not held:
                self.counters.unknown_removals += 1
                continue
            assert state is not None
            self.counters.removed_blocks += 1
            if held > 1:
                state.copies[h] = held - 1
                continue
            del state.copies[h]
            key = state.key_of.pop(h)
            count = state.hashes_of[key] - 1
            if count:
                state.hashes_of[key] = count
                continue
            del state.hashes_of[key]
            holders = self._holders[key]
            holders.discard(address)
            if not holders:
                del self._holders[key]

    # -- queries --------------------------------------------------------------------------------------------

    def matched_blocks(self, keys: Sequence[int], addresses: Collection[str]) -> Mapping[str, int]:
        """Address -> how many of ``keys``, from the first, the endpoint holds; endpoints holding none (or
        unknown to the index) are left out."""
        if not keys:
            return {}
        first = self._holders.get(keys[0])
        if first is None:
            return {}
        alive = first.intersection(addresses)
        out: dict[str, int] = {}
        matched = 1
        for key in keys[1:]:
            if not alive:
                break
            holders = self._holders.get(key)
            if holders is None:
                break
            if not alive <= holders:
                still = alive & holders
                for a in alive - still:
                    out[a] = matched
                alive = still
            matched += 1
        for a in alive:
            out[a] = matched
        return out

    def record_pick(self, address: str, keys: Sequence[int]) -> None:
        """Nothing to learn: the events say what each endpoint caches."""

    def held_keys(self, address: str) -> frozenset[int]:
        """The keys ``address`` holds now (empty when unknown)."""
        state = self._endpoints.get(address)
        return frozenset(state.hashes_of) if state is not None else frozenset()

    def held_hashes(self, address: str) -> Mapping[EngineHash, int]:
        """Engine hash -> copies ``address`` holds now (a copy: the caller may keep it)."""
        state = self._endpoints.get(address)
        return dict(state.copies) if state is not None else {}

    @property
    def endpoints(self) -> frozenset[str]:
        """The endpoints the index holds blocks of."""
        return frozenset(self._endpoints)
