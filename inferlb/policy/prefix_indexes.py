"""The prefix index of one picking mode (pure), built the same way for the request path
(:func:`ext_proc.picking.prefix_source`) and the endpoint picker (:mod:`epp.picking`).

Modes: ``load`` and ``off`` know no cached block (:class:`~inferlb.policy.picker.NoPrefixIndex`);
``approximate`` learns from the process's own picks
(:class:`~inferlb.policy.prefix_index.ApproximatePrefixIndex`); ``precise`` is rebuilt from the model
servers' KV events (:class:`~inferlb.policy.kv_index.PreciseKvIndex`, fed by
:class:`inferlb.adapters.kv_events.KvEventSubscriber`).
"""

from __future__ import annotations

from typing import Final, Literal

from inferlb.policy.kv_index import PreciseKvIndex
from inferlb.policy.picker import NoPrefixIndex, PrefixIndex
from inferlb.policy.prefix_index import ApproximatePrefixIndex

__all__ = ["APPROXIMATE_CAPACITY_TOKENS", "KEYED_MODES", "IndexMode", "make_prefix_index"]

#: Prompt tokens the approximate index believes one endpoint's prefix cache holds at most: about what an
#: 80 GB GPU running an 8B model caches (Llama-3-8B's KV cache is 128 KiB per token: 32 layers x 8 KV
#: heads x 128 dims x 2 (K, V) x 2 bytes, so ~64 GB of free memory hold ~500k tokens). A bound, not a
#: measurement: a smaller cache only means the index believes some blocks held that were evicted.
APPROXIMATE_CAPACITY_TOKENS: Final = 1 << 19

#: The picking modes (``endpoint_picking.mode``, and the EPP's ``--prefix-index``).
IndexMode = Literal["off", "load", "approximate", "precise"]
#: The modes with an index, whose requests carry prompt block keys.
KEYED_MODES: Final = frozenset({"approximate", "precise"})


def make_prefix_index(mode: IndexMode, *, block_size: int) -> PrefixIndex:
    """A fresh, empty prefix index for ``mode`` over ``block_size``-token blocks: ``approximate`` holds at
    most :data:`APPROXIMATE_CAPACITY_TOKENS` / ``block_size`` blocks per endpoint; ``precise`` keys the KV
    events' blocks at ``block_size``; ``off`` and ``load`` get :class:`~inferlb.policy.picker.NoPrefixIndex`.

    Raises:
        ValueError: ``block_size < 1``, or an unknown ``mode``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if mode == "approximate":
        return ApproximatePrefixIndex(capacity_blocks=max(1, APPROXIMATE_CAPACITY_TOKENS // block_size))
    if mode == "precise":
        return PreciseKvIndex(block_size=block_size)
    if mode in ("off", "load"):
        return NoPrefixIndex()
    raise ValueError(f"prefix index mode must be off, load, approximate or precise, got {mode!r}")
