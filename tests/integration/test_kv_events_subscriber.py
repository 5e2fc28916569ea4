"""The KV-event subscriber (inferlb.adapters.kv_events) against gpusim's publisher over real ZMQ sockets on
loopback: in-order batches rebuild the prefix cache in the precise index; a sequence gap is filled through
the publisher's replay ROUTER; a gap beyond its buffer drops the endpoint's entries, which new events then
rebuild; a restarted publisher clears them; malformed frames are counted and skipped."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from inferlb.adapters.kv_events import KvEventsCollector, KvEventSubscriber, MalformedBatch, decode_batch
from inferlb.config.schema import parse_config
from inferlb.policy.kv_index import PreciseKvIndex
from inferlb.request.blocks import block_keys_of_tokens, prompt_block_keys
from inferlb.request.parsing import EndpointKind, InferenceRequest, parse_request
from inferlb.request.prompt_ids import conversation_ids
from simulation import kvcache
from simulation.gpusim.kv_events import KvEventPublisher, KvEventsConfig
from simulation.gpusim.server import SimulatedEndpoint
from simulation.kvcache import PrefixCache, PromptBlocks

BS = 4
ADDRESS = "10.1.0.1:8000"
LOOPBACK = "tcp://127.0.0.1:*"
#: Bound of every wait for a message (s).
WAIT_S = 5.0


def prompt(family: int, length: int) -> PromptBlocks:
    tokens = [7] * min(length, 8) + [1000 * (family + 1) + i for i in range(max(0, length - 8))]
    return PromptBlocks(
        tokens=len(tokens), hashes=kvcache.block_hashes(tokens, block_size=BS), token_ids=tuple(tokens)
    )


def chat(messages: list[dict[str, str]]) -> InferenceRequest:
    return parse_request(
        EndpointKind.CHAT_COMPLETIONS, msgspec.json.encode({"model": "m", "messages": messages})
    )


def cached(cache: PrefixCache) -> Counter[bytes | int]:
    return Counter({h: len(b) for h, b in cache._blocks_of.items()})


@dataclass
class Fleet:
    """One simulated GPU's prefix cache and publisher, and the gateway's subscriber and index."""

    ctx: zmq.asyncio.Context
    cache: PrefixCache
    publisher: KvEventPublisher
    replay_task: asyncio.Task[None]
    sub: KvEventSubscriber
    index: PreciseKvIndex
    ops: int = 0

    def step(self, n: int = 1) -> None:
        """``n`` allocations (each frees the one before it), one published batch each."""
        for _ in range(n):
            self.ops += 1
            i = self.ops
            self.cache.free(f"s{i - 1}")
            self.cache.allocate(f"s{i}", [prompt(i % 5, 8 + 7 * (i % 6))], decode_tokens=2)
            events = self.cache.take_events()
            if not events:  # a full hit stores nothing: still one batch per step, so sequences are countable
                self.cache.free(f"s{i}")
                self.cache.allocate(f"s{i}", [prompt(10 + i, 12)])
                events = self.cache.take_events()
            self.publisher.publish(events)

    async def deliver(self, count: int, *, skip: range = range(0)) -> None:
        """Receive ``count`` messages from the SUB socket, handing each to the subscriber except those whose
        sequence is in ``skip`` (lost on the way, as past a high-water mark)."""
        for _ in range(count):
            frames = await asyncio.wait_for(self.sub.receive(), WAIT_S)
            if int.from_bytes(frames[1], "big") not in skip:
                await self.sub.handle(frames)

    async def drain(self) -> None:
        """Hand every message to the subscriber until it has taken the publisher's last batch."""
        while self.sub.last_seq != self.publisher.next_seq - 1:
            await self.sub.handle(await asyncio.wait_for(self.sub.receive(), WAIT_S))

    async def restart(self) -> None:
        """A new publisher (sequence from 0, the same sockets' addresses) on a new, empty cache: the server
        process restarted."""
        self.replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.replay_task
        replay = self.publisher.replay_address
        self.publisher.close()
        self.cache = PrefixCache(num_blocks=self.cache.num_blocks, block_size=BS, record_events=True)
        # ZMQ closes a socket in its I/O thread, so the old sockets' ports may still be bound for a moment
        # after close() returns: bind again for up to 5 s, as a restarted server would find them freed.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self.publisher, self.replay_task = publisher_for(self.sub.endpoint, 100, replay=replay)
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)


def publisher_for(
    endpoint: str, buffer_steps: int, *, replay: str | None = None
) -> tuple[KvEventPublisher, asyncio.Task[None]]:
    config = KvEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
        replay_endpoint=replay or "tcp://127.0.0.1:*", buffer_steps=buffer_steps,
    )  # fmt: skip
    publisher = KvEventPublisher(config)
    return publisher, asyncio.create_task(publisher.serve_replay())


async def connected(fleet: Fleet) -> None:
    """Wait until the PUB socket reaches the SUB socket (ZMQ drops what is sent before): a probe batch on
    a scratch cache, repeated until one arrives; the probes are then forgotten (entries and sequence)."""
    scratch = PrefixCache(num_blocks=4, block_size=BS, record_events=True)
    scratch.allocate("probe", [prompt(99, 4)])
    probe = scratch.take_events()
    for _ in range(50):
        fleet.publisher.publish(probe)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fleet.sub.receive(), 0.1)
            break
    else:
        raise AssertionError("the publisher never reached the subscriber")
    # the batches a subscriber joining now has missed: the probes; start the sequence after them
    fleet.sub.last_seq = fleet.publisher.next_seq - 1
    with contextlib.suppress(TimeoutError):
        while True:  # probes still in flight
            await asyncio.wait_for(fleet.sub.receive(), 0.2)


@contextlib.asynccontextmanager
async def fleet(*, buffer_steps: int = 100, num_blocks: int = 24) -> AsyncIterator[Fleet]:
    ctx = zmq.asyncio.Context()
    index = PreciseKvIndex(block_size=BS)
    sub = KvEventSubscriber(address=ADDRESS, endpoint=LOOPBACK, index=index, bind=True, context=ctx)
    endpoint = sub.open()
    publisher, task = publisher_for(endpoint, buffer_steps)
    sub.replay_endpoint = publisher.replay_address
    f = Fleet(ctx=ctx, cache=PrefixCache(num_blocks=num_blocks, block_size=BS, record_events=True),
              publisher=publisher, replay_task=task, sub=sub, index=index)  # fmt: skip
    await connected(f)
    try:
        yield f
    finally:
        f.replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await f.replay_task
        f.publisher.close()
        sub.close()
        ctx.term()


def lacks_nothing_it_claims(f: Fleet) -> bool:
    """The index claims no copy the cache does not hold (the safe side of a partial state)."""
    return not (Counter(f.index.held_hashes(ADDRESS)) - cached(f.cache))


async def test_in_order_batches_rebuild_the_cache() -> None:
    async with fleet() as f:
        f.step(30)
        await f.deliver(30)
        assert f.index.held_hashes(ADDRESS) == cached(f.cache) and cached(f.cache)
        assert f.sub.counters.batches == 30 and f.sub.counters.gaps == 0
        tokens = list(prompt(30 % 5, 8 + 7 * (30 % 6)).token_ids)
        keys = block_keys_of_tokens(tokens, block_size=BS)
        assert f.index.matched_blocks(keys, [ADDRESS]) == {ADDRESS: len(keys)}


async def test_a_sequence_gap_is_filled_by_the_replay() -> None:
    async with fleet() as f:
        first = f.publisher.next_seq
        f.step(20)
        await f.deliver(20, skip=range(first + 5, first + 12))  # 7 batches lost
        c = f.sub.counters
        assert (c.gaps, c.missed_batches, c.replays, c.replayed_batches) == (1, 7, 1, 7)
        assert c.dropped_states == 0 and f.publisher.replays == 1
        assert f.index.held_hashes(ADDRESS) == cached(f.cache)
        # a second gap on the same replay socket
        first = f.publisher.next_seq
        f.step(10)
        await f.deliver(10, skip=range(first, first + 3))
        assert (c.gaps, c.replayed_batches, c.dropped_states) == (2, 10, 0)
        assert f.index.held_hashes(ADDRESS) == cached(f.cache)


async def test_a_gap_beyond_the_replay_buffer_drops_the_entries_then_new_events_rebuild_them() -> None:
    async with fleet(buffer_steps=4) as f:
        first = f.publisher.next_seq
        f.step(12)
        await f.deliver(12, skip=range(first + 1, first + 9))  # 8 lost; the buffer holds the last 4 only
        c = f.sub.counters
        assert (c.gaps, c.replays, c.dropped_states) == (1, 1, 1)
        # what the replay had (the run just before the live batch) and the live batch are applied: a partial
        # state that may miss blocks, never claims one
        assert c.replayed_batches == 1 and lacks_nothing_it_claims(f)
        # the cache reset (or every old block evicted and re-stored): the index is whole again
        f.cache.free(f"s{f.ops}")
        assert f.cache.clear()
        f.publisher.publish(f.cache.take_events())
        f.step(10)
        await f.deliver(11)
        assert f.index.held_hashes(ADDRESS) == cached(f.cache) and c.dropped_states == 1


async def test_a_gap_without_a_replay_socket_drops_the_entries() -> None:
    async with fleet() as f:
        f.sub.replay_endpoint = None
        f.step(6)
        await f.deliver(6)
        assert f.index.held_hashes(ADDRESS)
        first = f.publisher.next_seq
        f.step(4)
        await f.deliver(4, skip=range(first, first + 1))
        c = f.sub.counters
        assert (c.replays, c.dropped_states) == (0, 1) and lacks_nothing_it_claims(f)


async def test_a_replay_that_never_answers_times_out_and_drops_the_entries() -> None:
    async with fleet() as f:
        f.replay_task.cancel()  # the ROUTER stays bound, nobody answers
        with contextlib.suppress(asyncio.CancelledError):
            await f.replay_task
        f.sub.replay_timeout_s = 0.3
        first = f.publisher.next_seq
        f.step(4)
        await f.deliver(4, skip=range(first, first + 2))
        c = f.sub.counters
        assert (c.replays, c.replayed_batches, c.dropped_states) == (1, 0, 1) and lacks_nothing_it_claims(f)


async def test_a_restarted_publisher_clears_the_endpoint() -> None:
    async with fleet() as f:
        f.step(15)
        await f.deliver(15)
        old = set(f.index.held_hashes(ADDRESS))
        assert old
        await f.restart()  # sequence back to 0, an empty cache
        f.ops = 100  # other prompts than before
        # the new publisher's first batches may be lost while it connects: the first to arrive has a
        # sequence at or below the last one seen (a restart), the rest come from the replay
        for _ in range(50):
            f.step(1)
            with contextlib.suppress(TimeoutError):
                await f.sub.handle(await asyncio.wait_for(f.sub.receive(), 0.1))
                break
        f.step(5)
        await f.drain()
        assert f.sub.counters.restarts == 1
        assert f.index.held_hashes(ADDRESS) == cached(f.cache)
        assert not old & set(f.index.held_hashes(ADDRESS)) - set(cached(f.cache))


async def test_a_restart_seen_as_a_jump_forward_after_a_lost_connection_is_a_restart() -> None:
    """The new publisher's first batches, up to past the last sequence seen, are lost while it connects:
    the sequence jumps forward, but the SUB socket saw the old connection drop, so it is a restart."""
    async with fleet() as f:
        f.step(3)
        await f.deliver(3)
        last = f.sub.last_seq
        assert last is not None and f.index.held_hashes(ADDRESS)
        await f.restart()
        f.ops = 100
        f.step(last + 3)
        for _ in range(100):  # connecting: what arrives before sequence last + 3 is lost on the way
            f.step(1)
            with contextlib.suppress(TimeoutError):
                frames = await asyncio.wait_for(f.sub.receive(), 0.05)
                if int.from_bytes(frames[1], "big") >= last + 3:
                    await f.sub.handle(frames)
                    break
        await f.drain()
        assert f.sub.counters.restarts == 1 and f.sub.counters.replayed_batches >= last + 3
        assert f.index.held_hashes(ADDRESS) == cached(f.cache)


async def test_malformed_frames_are_counted_and_skipped() -> None:
    async with fleet() as f:
        raw = f.ctx.socket(zmq.PUB)
        raw.connect(f.sub.endpoint)
        try:
            await asyncio.sleep(0.3)  # the second PUB's connection (ZMQ drops what is sent before it)
            seq = f.publisher.next_seq
            map_batch = msgspec.msgpack.encode({"ts": 1.0, "events": [
                {"type": "BlockStored", "block_hashes": [b"m1"], "parent_block_hash": None,
                 "token_ids": [1, 2, 3, 4], "block_size": BS, "medium": "GPU", "lora_name": None},
                {"type": "SomethingNew", "x": 1},
            ]})  # fmt: skip
            messages = [
                [b"", b"short"],  # two frames
                [b"", b"\x00" * 4, b"payload"],  # a 4-byte sequence
                [b"", seq.to_bytes(8, "big"), b"\xc1 not msgpack"],  # unreadable: entries dropped
                [b"", (seq + 1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [["BlockStored", "x"]]])],
                [b"", (seq + 2).to_bytes(8, "big"), map_batch],  # newer vLLM's map layout, an unknown event
            ]
            # and after them a good batch in the array layout
            good = msgspec.msgpack.encode([2.0, [["BlockRemoved", [b"m1"], "GPU"]], 0])
            messages.append([b"", (seq + 3).to_bytes(8, "big"), good])
            for m in messages:
                await raw.send_multipart(m)
            received = [await asyncio.wait_for(f.sub.receive(), WAIT_S) for _ in range(5)]
            for frames in received:
                await f.sub.handle(frames)
            c = f.sub.counters
            assert (c.malformed, c.dropped_states, c.unknown_events) == (4, 2, 1)
            assert f.sub.last_seq == seq + 2 and set(f.index.held_hashes(ADDRESS)) == {b"m1"}
            keys = block_keys_of_tokens([1, 2, 3, 4], block_size=BS)
            assert f.index.matched_blocks(keys, [ADDRESS]) == {ADDRESS: 1}
            await f.sub.handle(await asyncio.wait_for(f.sub.receive(), WAIT_S))
            assert f.sub.last_seq == seq + 3 and f.index.held_hashes(ADDRESS) == {}
            assert c.gaps == 0 and c.restarts == 0
        finally:
            raw.close(linger=0)


async def test_run_applies_batches_until_cancelled_and_the_collector_exports_the_counters() -> None:
    async with fleet() as f:
        task = asyncio.create_task(f.sub.run())
        f.step(8)
        for _ in range(100):
            if f.sub.counters.batches >= 8:
                break
            await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert f.index.held_hashes(ADDRESS) == cached(f.cache)
        families = {m.name: m for m in KvEventsCollector([f.sub]).collect()}
        (sample,) = families["inferlb_kv_events_batches"].samples
        assert sample.labels == {"endpoint": ADDRESS} and sample.value == 8


def test_both_wire_layouts_decode_alike() -> None:
    array_like = msgspec.msgpack.encode(
        [2.5, [["BlockStored", [b"a", 7], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", "lora-x"],
               ["BlockRemoved", [b"a"], "GPU"], ["AllBlocksCleared"]], 0]
    )  # fmt: skip
    as_map = msgspec.msgpack.encode({"ts": 2.5, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [b"a", 7], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4, "lora_id": None, "medium": "GPU",
         "lora_name": "lora-x", "extra_keys": None, "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [b"a"], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]})  # fmt: skip
    older = msgspec.msgpack.encode(
        [2.5, [["BlockStored", [b"a", 7], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None]]]
    )
    a, b = decode_batch(array_like), decode_batch(as_map)
    assert a == b and len(a.events) == 3 and a.events[0].lora_name == "lora-x"  # type: ignore[union-attr]
    assert decode_batch(older).events[0] == a.events[0].__class__(  # type: ignore[call-arg]
        block_hashes=(b"a", 7), parent_block_hash=None, token_ids=(1, 2, 3, 4, 5, 6, 7, 8), block_size=4
    )


@pytest.mark.parametrize(
    "payload",
    [
        msgspec.msgpack.encode([1.0, [["BlockStored", [b"a"], None, [1, 2, 3], 4, None, "GPU"]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [b"a"], None, [-1, 2, 3, 4], 4, None, "GPU"]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [b"a"], None, [1, 2, 3, 4], 0, None, "GPU"]]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", ["not bytes"], "GPU"]]]),
        msgspec.msgpack.encode([1.0, [42]]),
        msgspec.msgpack.encode("a string"),
        msgspec.msgpack.encode({"ts": "x", "events": []}),
        b"\xc1",
    ],
)
def test_shapes_that_are_not_an_event_batch_are_refused(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


# -- a gpusim server end to end ------------------------------------------------------------------------------


async def test_the_gateways_keys_of_a_request_match_what_a_gpusim_server_caches() -> None:
    """Chats to a real gpusim server; the subscriber (joining late: the first batches come from the
    server's replay socket) rebuilds its cache, and the gateway's keys of each request match all their
    blocks there; a new question on a shared system prompt matches the prompt's blocks."""
    config = parse_config({
        "gpu_profiles": {"H100": {"relative_capacity": 3.4, "memory_gb": 80}},
        "simulation": {"prefill_tokens_per_s": 1_000_000, "decode_tokens_per_s": 5_000, "max_batch": 4},
        "models": [{"name": "m", "default_max_tokens": 1, "context_length": 8192}],
        "endpoints": [{"name": "kv", "address": "127.0.0.1:1", "model": "m", "gpu": "H100",
                       "simulated": True}],
    })  # fmt: skip
    ctx = zmq.asyncio.Context()
    index = PreciseKvIndex()  # block size 16, as gpusim's cache
    sub = KvEventSubscriber(address=ADDRESS, endpoint=LOOPBACK, index=index, bind=True, context=ctx)
    events = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=sub.open(),
                            replay_endpoint="tcp://127.0.0.1:*")  # fmt: skip
    server = SimulatedEndpoint(config=config, endpoint=config.endpoints[0], kv_events=events)
    _, port = await server.start(host="127.0.0.1", port=0)

    system = {"role": "system", "content": "You answer questions about prefix caches, briefly. " * 20}
    bodies = [
        {
            "model": "m",
            "max_tokens": 1,
            "messages": [system, {"role": "user", "content": f"Question {q}?" * 9}],
        }
        for q in range(3)
    ]
    try:
        assert server._publisher is not None
        sub.replay_endpoint = server._publisher.replay_address
        task = asyncio.create_task(sub.run())
        async with aiohttp.ClientSession() as http:
            for body in bodies:
                async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
            # PUB drops what it sends before the subscriber's connection is up (ZMQ's slow joiner): when
            # all three batches went before it, nothing arrives to show the gap, so new questions follow
            # (as live traffic would) until one batch does; the gap before it is replayed
            for extra in range(20):
                for _ in range(20):
                    if sub.last_seq is not None:
                        break
                    await asyncio.sleep(0.05)
                if sub.last_seq is not None:
                    break
                body = {**bodies[0], "messages": [system, {"role": "user", "content": f"Filler {extra}."}]}
                async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
            for _ in range(400):  # <= 20 s for the batches (late joiners get them replayed)
                if sub.last_seq == server._publisher.next_seq - 1:
                    break
                await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        cache = server.engine.prefix_cache
        assert cache is not None and sub.last_seq == server._publisher.next_seq - 1
        assert index.held_hashes(ADDRESS) == cached(cache)
        for body in bodies:
            keys = prompt_block_keys(chat(body["messages"]))
            assert len(keys) > 10 and index.matched_blocks(keys, [ADDRESS]) == {ADDRESS: len(keys)}
        # a new question after the shared system prompt: the blocks up to the question's first match
        new = {
            **bodies[0],
            "messages": [system, {"role": "user", "content": "Something else entirely. " * 9}],
        }
        keys = prompt_block_keys(parse_request(EndpointKind.CHAT_COMPLETIONS, msgspec.json.encode(new)))
        ends: list[int] = []
        conversation_ids(
            parse_request(EndpointKind.CHAT_COMPLETIONS, msgspec.json.encode(new)), message_ends=ends
        )
        shared = (ends[0] + 3) // 16  # the system message, then the user turn's [START] role [SEP]
        assert 10 < shared < len(keys) and index.matched_blocks(keys, [ADDRESS]) == {ADDRESS: shared}
    finally:
        await server.stop()
        sub.close()
        ctx.term()
