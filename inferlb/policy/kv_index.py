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
  (the safe side: a miss places a request by load, a false hit would send it to a cold cache). A block
  held costs ~170-260 bytes (tracemalloc, 32-byte hashes, one endpoint or eight sharing the keys) plus the
  engine hash itself: ~10 MB for an endpoint of 30,000 blocks, ~70 MB at the default bound.
* **Clearing** (:meth:`PreciseKvIndex.clear`, on ``AllBlocksCleared``, a publisher restart or a sequence
  gap the replay could not fill) and **removing** an endpoint (:meth:`PreciseKvIndex.remove_endpoint`) drop
  its state; an endpoint with no state matches nothing (the picker places by load alone).

A match (:meth:`PreciseKvIndex.matched_blocks`) is the leading run of a request's keys an endpoint holds,
walked once for all endpoints at a time: each key's holders are a bit mask over the endpoints, so each
block costs one integer AND of the endpoints still in the run (measured A/B against a set of addresses per
key, every endpoint holding the prompt: 1.5x cheaper at 8 endpoints, 4.7-20x at 64, 4-11x at 256, on a
loaded machine; ``bench/block_keys.py`` prints the costs).
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
    bit: int  # the endpoint's bit in the holder masks
    #: engine hash -> [our key, copies held (>= 1)]
    held: dict[EngineHash, list[int]] = field(default_factory=dict)
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
        #: our key -> a mask of the endpoints holding it (bit ``_Endpoint.bit``): a match intersects one int
        #: per block, whatever the number of endpoints
        self._holders: dict[int, int] = {}
        self._address_of: list[str | None] = []  # bit -> its endpoint
        self._free_bits: list[int] = []

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
        off = ~(1 << state.bit)
        holders = self._holders
        for key in state.hashes_of:
            mask = holders[key] & off
            if mask:
                holders[key] = mask
            else:
                del holders[key]
        self._address_of[state.bit] = None
        self._free_bits.append(state.bit)

    def remove_endpoint(self, address: str) -> None:
        """``address`` left the fleet: the same as :meth:`clear`."""
        self.clear(address)

    def _state(self, address: str) -> _Endpoint:
        state = self._endpoints.get(address)
        if state is None:
            if self._free_bits:
                bit = self._free_bits.pop()
                self._address_of[bit] = address
            else:
                bit = len(self._address_of)
                self._address_of.append(address)
            state = self._endpoints[address] = _Endpoint(bit=bit)
        return state

    def _store(self, address: str, event: BlockStored) -> None:
        n = len(event.block_hashes)
        if event.block_size != self.block_size:
            self.counters.other_block_size += n
            return
        if len(event.token_ids) != n * event.block_size:
            raise ValueError(
                f"BlockStored has {len(event.token_ids)} token ids for {n} blocks of {event.block_size}"
            )
        known = self._endpoints.get(address)
        if event.parent_block_hash is None:
            parent = root_key(event.lora_name)
        elif known is not None and event.parent_block_hash in known.held:
            parent = known.held[event.parent_block_hash][0]
        else:
            self.counters.orphaned_blocks += n
            return
        keys = block_keys_of_tokens(event.token_ids, block_size=self.block_size, parent=parent)
        state = self._state(address)
        held, hashes_of, holders, bit = state.held, state.hashes_of, self._holders, 1 << state.bit
        for h, key in zip(event.block_hashes, keys, strict=True):
            entry = held.get(h)
            if entry is not None:
                entry[1] += 1
                continue
            held[h] = [key, 1]
            count = hashes_of.get(key, 0)
            hashes_of[key] = count + 1
            if not count:
                holders[key] = holders.get(key, 0) | bit
        self.counters.stored_blocks += n
        if len(held) > self.max_blocks:
            self.counters.overflow_resets += 1
            self.clear(address)

    def _remove(self, address: str, hashes: Sequence[EngineHash]) -> None:
        state = self._endpoints.get(address)
        if state is None:
            self.counters.unknown_removals += len(hashes)
            return
        held, hashes_of, holders, off = state.held, state.hashes_of, self._holders, ~(1 << state.bit)
        for h in hashes:
            entry = held.get(h)
            if entry is None:
                self.counters.unknown_removals += 1
                continue
            self.counters.removed_blocks += 1
            if entry[1] > 1:
                entry[1] -= 1
                continue
            del held[h]
            key = entry[0]
            count = hashes_of[key] - 1
            if count:
                hashes_of[key] = count
                continue
            del hashes_of[key]
            mask = holders[key] & off
            if mask:
                holders[key] = mask
            else:
                del holders[key]

    # -- queries --------------------------------------------------------------------------------------------

    def matched_blocks(self, keys: Sequence[int], addresses: Collection[str]) -> Mapping[str, int]:
        """Address -> how many of ``keys``, from the first, the endpoint holds; endpoints holding none (or
        unknown to the index) are left out."""
        if not keys:
            return {}
        want = 0
        for a in addresses:
            state = self._endpoints.get(a)
            if state is not None:
                want |= 1 << state.bit
        holders = self._holders
        alive = holders.get(keys[0], 0) & want
        out: dict[str, int] = {}
        matched = 1
        for key in keys[1:]:
            if not alive:
                return out
            still = alive & holders.get(key, 0)
            if still != alive:
                self._name(alive & ~still, matched, out)
                alive = still
            matched += 1
        self._name(alive, matched, out)
        return out

    def _name(self, mask: int, matched: int, out: dict[str, int]) -> None:
        """``out[address] = matched`` for each endpoint of ``mask``."""
        while mask:
            low = mask & -mask
            address = self._address_of[low.bit_length() - 1]
            assert address is not None
            out[address] = matched
            mask ^= low

    def record_pick(self, address: str, keys: Sequence[int]) -> None:
        """Nothing to learn: the events say what each endpoint caches."""

    def held_keys(self, address: str) -> frozenset[int]:
        """The keys ``address`` holds now (empty when unknown)."""
        state = self._endpoints.get(address)
        return frozenset(state.hashes_of) if state is not None else frozenset()

    def held_hashes(self, address: str) -> Mapping[EngineHash, int]:
        """Engine hash -> copies ``address`` holds now (a copy: the caller may keep it)."""
        state = self._endpoints.get(address)
        return {h: e[1] for h, e in state.held.items()} if state is not None else {}

    @property
    def endpoints(self) -> frozenset[str]:
        """The endpoints the index holds blocks of."""
        return frozenset(self._endpoints)
