"""gpusim's KV events over a real ZMQ socket on loopback: a SUB socket decodes vLLM's wire format (multipart
topic, 8-byte big-endian sequence, msgpack array-like tagged structs) and rebuilds the prefix cache's
state from the events alone."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from inferlb.config.schema import parse_config
from inferlb.request.parsing import EndpointKind, parse_request
from inferlb.request.prompt_ids import prompt_token_ids
from simulation.gpusim.engine import TimingModel
from simulation.gpusim.kv_events import (
    KvEventsConfig,
    encode_batch,
    parse_kv_events_config,
)
from simulation.gpusim.server import SimulatedEndpoint
from simulation.kvcache import BlockRemoved, BlockStored, block_hashes

MODEL = "sim-model"
TOPIC = "kv@sim"
#: Bounds of the waits for messages (each poll, and how many polls at most).
POLL_MS = 200
MAX_POLLS = 50

CONFIG = parse_config(
    {
        "gpu_profiles": {"H100": {"relative_capacity": 3.4, "memory_gb": 80}},
        "simulation": {"prefill_tokens_per_s": 1_000_000, "decode_tokens_per_s": 5_000, "max_batch": 4},
        "models": [{"name": MODEL, "default_max_tokens": 1, "context_length": 4096}],
        "endpoints": [{"name": "h100-kv", "address": "127.0.0.1:1", "model": MODEL, "gpu": "H100",
                       "simulated": True}],
    }
)  # fmt: skip


def chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}


class Subscriber:
    """A SUB socket bound on loopback keeping every batch it decodes (raw: lists, as msgpack gives them)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, "")
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.batches: list[tuple[bytes, int, list[Any]]] = []

    async def receive(self, count: int, *, polls: int = MAX_POLLS) -> None:
        """Wait until ``count`` batches in all have arrived (at most ``polls`` polls)."""
        for _ in range(polls):
            if len(self.batches) >= count:
                return
            if await self.sock.poll(POLL_MS):
                topic, seq, payload = await self.sock.recv_multipart()
                assert len(seq) == 8
                self.batches.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        raise AssertionError(f"{len(self.batches)} batches arrived, {count} expected")


@contextlib.asynccontextmanager
async def serving(budget_tokens: int) -> AsyncIterator[tuple[SimulatedEndpoint, str, Subscriber]]:
    ctx = zmq.asyncio.Context()
    sub = Subscriber(ctx)
    events = KvEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{sub.port}", topic=TOPIC
    )
    base = TimingModel.for_endpoint(CONFIG, CONFIG.endpoints[0])
    timing = TimingModel(
        relative_capacity=base.relative_capacity, prefill_tokens_per_s=base.prefill_tokens_per_s,
        decode_tokens_per_s=base.decode_tokens_per_s, max_batch=base.max_batch, max_queue=base.max_queue,
        kv_budget_tokens=budget_tokens,
    )  # fmt: skip
    server = SimulatedEndpoint(config=CONFIG, endpoint=CONFIG.endpoints[0], timing=timing, kv_events=events)
    _, port = await server.start(host="127.0.0.1", port=0)
    try:
        yield server, f"http://127.0.0.1:{port}", sub
    finally:
        await server.stop()
        sub.sock.close(linger=0)
        ctx.term()


def replay(batches: list[tuple[bytes, int, list[Any]]]) -> Counter[bytes]:
    """Rebuild {hash: cached blocks} from the decoded events, checking their layout on the way."""
    mirror: Counter[bytes] = Counter()
    for _, _, (ts, events, rank) in batches:
        assert isinstance(ts, float) and rank == 0
        for e in events:
            if e[0] == "BlockStored":
                _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = e
                assert block_size == 16 and len(tokens) == 16 * len(hashes)
                assert parent is None or isinstance(parent, bytes)
                assert (lora_id, medium, lora_name) == (None, "GPU", None)
                mirror.update(hashes)
            elif e[0] == "BlockRemoved":
                _, hashes, medium = e
                assert medium == "GPU"
                mirror.subtract(hashes)
            else:
                assert e == ["AllBlocksCleared"]
                mirror.clear()
    return +mirror


def cache_state(server: SimulatedEndpoint) -> Counter[bytes]:
    cache = server.engine.prefix_cache
    assert cache is not None
    return Counter({h: len(b) for h, b in cache._blocks_of.items() if isinstance(h, bytes)})


async def synced(http: aiohttp.ClientSession, url: str, server: SimulatedEndpoint, sub: Subscriber) -> int:
    """Get the subscriber in step: the PUB socket connects to it, and batches sent before the connection is
    up are lost (ZMQ's slow joiner), so probe until one arrives; then reset the prefix cache and wait for its
    ``AllBlocksCleared``. Returns the index of that batch: from it on, the events tell the whole state."""
    for i in range(MAX_POLLS):
        async with http.post(f"{url}/v1/chat/completions", json=chat(f"probe {i} " * 20)) as resp:
            assert resp.status == 200
        with contextlib.suppress(AssertionError):
            await sub.receive(1, polls=2)
            break
    async with http.post(f"{url}/reset_prefix_cache") as resp:
        assert resp.status == 200 and await resp.json() == {"cleared": True}
    await wait_all(server, sub)
    assert sub.batches[-1][2][1] == [["AllBlocksCleared"]]
    return len(sub.batches) - 1


async def wait_all(server: SimulatedEndpoint, sub: Subscriber) -> None:
    """Wait for every batch the server has sent since the subscriber's first."""
    publisher = server._publisher
    assert publisher is not None
    await sub.receive(publisher.sent - sub.batches[0][1])


async def test_kv_events_over_zmq_rebuild_the_cache_and_name_the_prompts_blocks() -> None:
    async with serving(budget_tokens=4096) as (server, url, sub), aiohttp.ClientSession() as http:
        start = await synced(http, url, server, sub)
        text = "Tell me about the simulated fleet and its prefix caches, please. " * 8
        for payload in (chat(text), chat(text), chat("Something else entirely. " * 10)):
            async with http.post(f"{url}/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200
        await wait_all(server, sub)
        seqs = [seq for _, seq, _ in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert {topic for topic, _, _ in sub.batches} == {TOPIC.encode()}
        # the events alone give the cache's state
        state = cache_state(server)
        assert state and replay(sub.batches[start:]) == state
        body = msgspec.json.encode(chat(text))
        (ids,) = prompt_token_ids(parse_request(EndpointKind.CHAT_COMPLETIONS, body))
        stored = [e for _, _, (_, events, _) in sub.batches[start:] for e in events if e[0] == "BlockStored"]
        # the first send of the text stored all its full blocks, from its first (parent None)
        hashes = list(block_hashes(ids))
        (first,) = [e for e in stored if e[1] == hashes]
        assert first[2] is None and first[3] == list(ids[: 16 * len(hashes)])

        async with http.post(f"{url}/reset_prefix_cache") as resp:
            assert resp.status == 200 and await resp.json() == {"cleared": True}
        await wait_all(server, sub)
        assert sub.batches[-1][2][1] == [["AllBlocksCleared"]]
        assert cache_state(server) == Counter()


async def test_a_full_cache_publishes_what_it_evicts() -> None:
    async with serving(budget_tokens=256) as (server, url, sub), aiohttp.ClientSession() as http:
        start = await synced(http, url, server, sub)
        cache = server.engine.prefix_cache
        assert cache is not None
        before = cache.evictions_total
        for i in range(6):  # ~100-token prompts through 16 blocks of 16: later ones evict earlier ones
            async with http.post(f"{url}/v1/chat/completions", json=chat(f"evict {i} " * 30)) as resp:
                assert resp.status == 200
        await wait_all(server, sub)
        events = [e for _, _, (_, evs, _) in sub.batches[start:] for e in evs]
        removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
        assert removed and len(removed) == cache.evictions_total - before
        assert replay(sub.batches[start:]) == cache_state(server)


def test_the_wire_layout_is_array_like_and_tagged() -> None:
    payload = encode_batch(
        [BlockStored(block_hashes=(b"h1", b"h2"), parent_block_hash=b"h0", token_ids=(1, 2), block_size=1),
         BlockRemoved(block_hashes=(7,))],
        ts=12.5,
    )  # fmt: skip
    assert msgspec.msgpack.decode(payload) == [
        12.5,
        [["BlockStored", [b"h1", b"h2"], b"h0", [1, 2], 1, None, "GPU", None], ["BlockRemoved", [7], "GPU"]],
        0,
    ]


def test_kv_events_config_is_vllms_json_and_refuses_unknown_fields() -> None:
    c = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'
    )
    assert c.publishes and c.for_endpoint(2).endpoint == "tcp://*:5559" and c.replay_endpoint is None
    assert not parse_kv_events_config('{"publisher": "zmq"}').publishes
    r = parse_kv_events_config('{"replay_endpoint": "tcp://*:5558", "buffer_steps": 50, "max_queue_size": 9}')
    assert (r.for_endpoint(1).replay_endpoint, r.buffer_steps) == ("tcp://*:5559", 50)
    with pytest.raises(ValueError, match="buffer_steps"):
        parse_kv_events_config('{"buffer_steps": 0}')
    with pytest.raises(ValueError, match="replay_endpoints"):
        parse_kv_events_config('{"replay_endpoints": "tcp://*:5558"}')
    with pytest.raises(ValueError, match="publisher"):
        parse_kv_events_config('{"publisher": "kafka"}')
    no_cache = CONFIG.model_copy(
        update={"simulation": CONFIG.simulation.model_copy(update={"prefix_caching": False})}
    )
    with pytest.raises(ValueError, match="prefix_caching"):
        SimulatedEndpoint(config=no_cache, endpoint=no_cache.endpoints[0], kv_events=c)
