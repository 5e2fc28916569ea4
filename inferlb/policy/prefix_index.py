"""The approximate prefix index (pure): where each endpoint's prefix cache is *believed* to hold a request's
prompt blocks, learnt only from the gateway's own picks.

A :class:`~inferlb.policy.picker.PrefixIndex` for :func:`inferlb.policy.picker.pick`, like the approximate
radix trees of sglang's router (``sgl-router``'s cache-aware policy) and vLLM's production-stack router
(``vllm-router``'s prefix-aware routing), but over chained block keys: a key names its block *and* every
block before it (vLLM's chained block hashes), so a flat map ``key -> endpoints that hold it`` answers the
longest-leading-run question a tree answers, and needs no tree.

**What it records.** :meth:`ApproximatePrefixIndex.record_pick` notes that every key of the request is now
held by the endpoint it was sent to: the endpoint's prefix cache (vLLM's automatic prefix caching) stores
each full prompt block it computes, and a hit refreshes the blocks it reuses. Each endpoint's keys sit in
an LRU list, the request's first key the most recently used (recorded last-to-first, so that a prefix's
tail goes before its head, as vLLM frees a sequence's blocks in reverse order into its LRU free queue).

**Bounded memory.** Each endpoint holds at most its capacity in blocks (``capacity_blocks``: what its KV
cache holds, vLLM's ``num_gpu_blocks`` times its block size over the index's block size); a record past it
evicts that endpoint's least recently used keys first. All endpoints together hold at most
``max_entries`` (key, endpoint) entries: past it the entry least recently used across the whole index
goes. An optional ``ttl_s`` forgets entries not refreshed within that many seconds of ``clock``.
Memory is ``O(max_entries)``; a lookup is ``O(len(keys) * holders)``, a record ``O(len(keys))``.

**It is an estimate, and it drifts from the real caches**, because:

* the real cache evicts only *free* blocks (those no running sequence holds) and pins the rest, so under
  memory pressure it evicts in a different order from this LRU;
* a request may never be cached where it was recorded: refused or failed, sent by Envoy to a fallback
  host (``override_host`` tries the next listed host), or run without blocks when memory is short;
* traffic the index never sees (another gateway replica's, a client's straight to the server) evicts
  blocks the index still believes held; a model server restart or ``reset_prefix_cache`` drops them all;
* generated tokens are cached by the server as the conversation's next turn will need them, which the
  index learns only when that turn is picked (and then it records them as new).

What bounds the drift: the per-endpoint capacity never lets the index believe an endpoint holds more
blocks than its KV cache can (so a stale belief ages out after at most one cache's worth of newer picks
to that endpoint); the TTL bounds it in time where the traffic is light; and a wrong belief costs one
miss and is then made true by the very request it misrouted (the endpoint caches what it computes).
A false positive sends a request to an endpoint that recomputes its prefix (a miss, as with no index); a
false negative loses a hit. :func:`inferlb.policy.picker.pick`'s load guard bounds what either can do to
any endpoint's load. The precise alternative rebuilds the state from the servers' KV events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence

__all__ = ["ApproximatePrefixIndex"]


class ApproximatePrefixIndex:
    """A :class:`~inferlb.policy.picker.PrefixIndex` learnt from picks (see the module doc).

    Args:
        capacity_blocks: blocks one endpoint holds at most unless ``capacities`` names it (>= 1; e.g. the
            GPU's ``num_gpu_blocks``, in the index's block size).
        max_entries: (key, endpoint) entries held at most over all endpoints (>= 1).
        capacities: address -> its own capacity in blocks (>= 1), for a fleet of unequal GPUs.
        ttl_s: entries not refreshed for this many seconds of ``clock`` are forgotten (> 0; None: never).
        clock: seconds, non-decreasing (required with ``ttl_s``; e.g. ``time.monotonic``).

    Raises:
        ValueError: a capacity or ``max_entries`` below 1, a non-positive ``ttl_s``, or ``ttl_s`` without
            ``clock``.
    """

    def __init__(
        self,
        *,
        capacity_blocks: int,
        max_entries: int = 1 << 22,
        capacities: Mapping[str, int] | None = None,
        ttl_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if ttl_s is not None and clock is None:
            raise ValueError("ttl_s needs a clock")
        self._default = capacity_blocks
        self._caps: dict[str, int] = {}
        for address, cap in (capacities or {}).items():
            self.set_capacity(address, cap)
        self.max_entries = max_entries
        self._ttl = ttl_s
        self._clock = clock
        # key -> endpoints believed to hold it (insertion-ordered set)
        self._holders: dict[int, dict[str, None]] = {}
        # endpoint -> its keys, least recently used first, with the time each was last recorded
        self._lru: dict[str, OrderedDict[int, float]] = {}
        # every (endpoint, key) entry, least recently used first: the global bound's order
        self._all: OrderedDict[tuple[str, int], None] = OrderedDict()
        #: entries evicted by a capacity bound or the TTL (not by :meth:`forget`)
        self.evictions_total = 0

    # -- the PrefixIndex protocol -------------------------------------------------------------------------

    def matched_blocks(self, keys: Sequence[int], addresses: Collection[str]) -> Mapping[str, int]:
        """Address (among ``addresses``) -> leading keys it is believed to hold; endpoints holding none are
        left out. With a TTL, expired entries do not match."""
        if not keys:
            return {}
        holders = self._holders.get(keys[0])
        if not holders:
            return {}
        alive = [a for a in holders if a in addresses]
        if self._ttl is not None:
            alive = [a for a in alive if self._fresh(a, keys[0])]
        out: dict[str, int] = {}
        i = 1
        while alive and i < len(keys):
            h = self._holders.get(keys[i])
            still: list[str] = []
            for a in alive:
                if h is not None and a in h and (self._ttl is None or self._fresh(a, keys[i])):
                    still.append(a)
                else:
                    out[a] = i
            alive = still
            i += 1
        for a in alive:
            out[a] = i
        return out

    def record_pick(self, address: str, keys: Sequence[int]) -> None:
        """``address`` now holds every key of ``keys`` (the first the most recently used); then the bounds
        evict what they must (the endpoint's LRU keys, then the index's)."""
        if not keys:
            return
        now = self._clock() if self._clock is not None else 0.0
        lru = self._lru.get(address)
        if lru is None:
            lru = self._lru[address] = OrderedDict()
        all_entries = self._all
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
                all_entries.move_to_end((address, k))
            else:
                self._holders.setdefault(k, {})[address] = None
                all_entries[(address, k)] = None
            lru[k] = now
        cap = self._caps.get(address, self._default)
        while len(lru) > cap:
            k, _ = lru.popitem(last=False)
            self._drop(address, k)
            del all_entries[(address, k)]
        while len(all_entries) > self.max_entries:
            (a, k), _ = all_entries.popitem(last=False)
            del self._lru[a][k]
            self._drop(a, k)
        if self._ttl is not None:
            self._expire(lru, address, now)

    # -- administration -----------------------------------------------------------------------------------

    def set_capacity(self, address: str, capacity_blocks: int) -> None:
        """``address`` holds at most ``capacity_blocks`` from its next record on (its profile changed).

        Raises:
            ValueError: ``capacity_blocks < 1``.
        """
        if capacity_blocks < 1:
            raise ValueError(f"capacity of {address} must be >= 1 block, got {capacity_blocks}")
        self._caps[address] = capacity_blocks

    def forget(self, address: str) -> None:
        """Drop everything ``address`` is believed to hold (it left the cluster, or its server restarted and
        its cache is empty)."""
        lru = self._lru.pop(address, None)
        if lru is None:
            return
        for k in lru:
            holders = self._holders[k]
            del holders[address]
            if not holders:
                del self._holders[k]
            del self._all[(address, k)]

    def __len__(self) -> int:
        """(key, endpoint) entries held."""
        return len(self._all)

    def blocks_of(self, address: str) -> int:
        """Keys ``address`` is believed to hold."""
        lru = self._lru.get(address)
        return 0 if lru is None else len(lru)

    def keys_of(self, address: str) -> tuple[int, ...]:
        """The keys ``address`` is believed to hold, least recently used first."""
        return tuple(self._lru.get(address, ()))

    # -- internals ----------------------------------------------------------------------------------------

    def _drop(self, address: str, key: int) -> None:
        holders = self._holders[key]
        del holders[address]
        if not holders:
            del self._holders[key]
        self.evictions_total += 1

    def _fresh(self, address: str, key: int) -> bool:
        assert self._clock is not None and self._ttl is not None
        return self._clock() - self._lru[address][key] <= self._ttl

    def _expire(self, lru: OrderedDict[int, float], address: str, now: float) -> None:
        """Evict ``address``'s entries older than the TTL (they are at its LRU head: times only grow)."""
        assert self._ttl is not None
        while lru:
            k, at = next(iter(lru.items()))
            if now - at <= self._ttl:
                return
            del lru[k]
            self._drop(address, k)
            del self._all[(address, k)]
