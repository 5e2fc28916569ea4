"""Decoding vLLM's KV-event batches (inferlb.adapters.kv_events): whatever a server sends, the decoder
answers a batch or MalformedBatch, and the subscriber takes it without raising (no socket is opened: the
sequences are in order)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.adapters.kv_events import DecodedBatch, KvEventSubscriber, MalformedBatch, decode_batch
from inferlb.policy.kv_index import PreciseKvIndex

TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_name"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=8), st.binary(max_size=8), st.sampled_from([*TAGS, "type"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)
#: Event-shaped values: a known tag first, fields of any type after it (what a buggy server might send)
events = st.one_of(
    st.tuples(st.sampled_from(TAGS), st.lists(values, max_size=8)).map(lambda t: [t[0], *t[1]]),
    st.builds(lambda tag, rest: {**rest, "type": tag}, st.sampled_from(TAGS),
              st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)),
    values,
)  # fmt: skip
stamps, event_lists = st.floats(allow_nan=False), st.lists(events, max_size=4)
batches = st.one_of(
    st.tuples(stamps, event_lists).map(lambda t: [t[0], t[1], 0]),
    st.builds(lambda ts, e: {"ts": ts, "events": e}, stamps, event_lists),
    values,
)  # fmt: skip


def decode_or_refuse(payload: bytes) -> DecodedBatch | None:
    try:
        return decode_batch(payload)
    except MalformedBatch:
        return None


@settings(max_examples=150, deadline=None)
@given(batch=batches)
def test_any_structure_decodes_or_is_refused_as_malformed(batch: Any) -> None:
    decode_or_refuse(msgspec.msgpack.encode(batch))


@settings(deadline=None)
@given(payload=st.binary(max_size=64))
def test_any_bytes_decode_or_are_refused_as_malformed(payload: bytes) -> None:
    decode_or_refuse(payload)


@settings(max_examples=40, deadline=None)
@given(payloads=st.lists(st.one_of(batches.map(msgspec.msgpack.encode), st.binary(max_size=32)), max_size=8))
def test_the_subscriber_takes_any_payloads_without_raising(payloads: list[bytes]) -> None:
    index = PreciseKvIndex(block_size=1)
    sub = KvEventSubscriber(address="10.0.0.1:8000", endpoint="tcp://127.0.0.1:1", index=index)

    async def feed() -> None:
        for seq, payload in enumerate(payloads):
            await sub.handle([b"", seq.to_bytes(8, "big"), payload])
        await sub.handle([b"only one frame"])

    asyncio.run(feed())
    c = sub.counters
    assert c.batches + c.malformed == len(payloads) + 1 and sub.last_seq == (
        len(payloads) - 1 if payloads else None
    )
