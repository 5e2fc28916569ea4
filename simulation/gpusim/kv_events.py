"""KV events of a simulated GPU, published as vLLM publishes them with ``--kv-events-config``.

The wire format is vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``): a ZMQ PUB socket sends
one multipart message per batch, ``[topic, sequence, payload]``, where ``sequence`` counts batches from 0 as
an 8-byte big-endian integer and ``payload`` is the msgpack of an ``EventBatch``. The structs are msgspec
structs encoded *array-like* with *tags* (the layout vLLM's consumers, such as llm-d's KV-cache indexer,
decode):

* ``EventBatch``: ``[ts, events, data_parallel_rank]`` (``ts`` in Unix seconds; the rank is 0 here);
* ``BlockStored``: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]`` (``lora_id`` and ``lora_name`` None, ``medium`` ``"GPU"``; later optional fields
  left out, as msgspec's ``omit_defaults`` leaves them);
* ``BlockRemoved``: ``["BlockRemoved", block_hashes, medium]``;
* ``AllBlocksCleared``: ``["AllBlocksCleared"]``.

Block hashes are the 32-byte SHA-256 digests of :func:`simulation.kvcache.hash_block_tokens` (msgpack bin;
vLLM's ``ExternalBlockHash`` is ``bytes | int``). Newer vLLM releases encode the structs as maps instead of
arrays; this module sends the array layout only. Not modelled: the data-parallel port offset (each endpoint
of a process gets its own port: :meth:`KvEventsConfig.for_endpoint`).

**Replay**, as vLLM's ``ZmqEventPublisher`` serves it: with ``replay_endpoint`` a ROUTER socket is bound
there and the last ``buffer_steps`` batches are kept (sequence and payload, as sent). A subscriber that saw
a gap sends ``[b"", start]`` from a DEALER (or REQ) socket, ``start`` the first sequence it lacks as 8
bytes big-endian; the publisher answers ``[b"", seq, payload]`` for every buffered batch from ``start`` on,
then the end marker ``[b"", -1 as 8 signed bytes, b""]``. A batch that ZMQ dropped past the high-water
mark is buffered too: replay is how a subscriber gets it back. A request of another shape is logged and
ignored, as vLLM does.

The config is the JSON of vLLM's ``--kv-events-config`` (``KVEventsConfig``): ``enable_kv_cache_events``,
``publisher`` (``"zmq"`` or ``"null"``), ``endpoint`` (``tcp://*:5557`` by default: a wildcard endpoint is
bound, any other is connected to, a subscriber having bound it, as vLLM does), ``replay_endpoint`` (None:
no replay), ``buffer_steps`` (10,000), ``topic``, ``hwm`` (``max_queue_size`` is accepted and unused: no
queue here). Publishing never blocks the event loop: past the
high-water mark ZMQ drops messages, as vLLM's PUB socket does.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Final, Literal

import msgspec
import zmq
import zmq.asyncio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from simulation.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

#: vLLM's ``MEDIUM_GPU``.
MEDIUM_GPU = "GPU"
#: The sequence of the replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``).
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)

log = logging.getLogger("gpusim")


class KvEventsConfig(BaseModel):
    """vLLM's ``KVEventsConfig`` as far as the simulator publishes (see the module doc). Unknown fields are
    refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(default=10_000, ge=1)
    #: accepted as vLLM's field; batches are sent as they are made here, with no queue between
    max_queue_size: int = Field(default=100_000, ge=1)
    topic: str = ""
    hwm: int = Field(default=100_000, ge=0)

    @property
    def publishes(self) -> bool:
        """True when events are enabled and go to a ZMQ socket."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_endpoint(self, index: int) -> KvEventsConfig:
        """The config of the ``index``-th endpoint of a process: a ``tcp://`` endpoint's port plus ``index``
        (as vLLM offsets it by data-parallel rank), the replay endpoint's too, so each simulated GPU has its
        own sockets.

        Raises:
            ValueError: a ``tcp://`` endpoint without a numeric port.
        """
        if index == 0:
            return self
        update = {"endpoint": _offset(self.endpoint, index)}
        if self.replay_endpoint is not None:
            update["replay_endpoint"] = _offset(self.replay_endpoint, index)
        return self.model_copy(update=update)


def _offset(endpoint: str, index: int) -> str:
    if not endpoint.startswith("tcp://"):
        return endpoint
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"kv-events-config endpoint {endpoint!r} has no port")
    return f"{head}:{int(port) + index}"


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """Parse ``--kv-events-config`` JSON.

    Raises:
        ValueError: not JSON, or a field unknown or of the wrong type (the message names it).
    """
    try:
        return KvEventsConfig.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(root)"
        raise ValueError(f"--kv-events-config: {where}: {first['msg']}") from None


# -- the wire structs (array-like, tagged; see the module doc) ---------------------------------------------


class _WireEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """The base of the events: each encodes as an array whose first item is its tag (the event name)."""


class _WireBlockStored(_WireEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _WireBlockRemoved(_WireEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class _WireAllBlocksCleared(_WireEvent, tag="AllBlocksCleared"):
    """Every cached block was dropped (vLLM's prefix-cache reset): the tag alone."""


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_WireBlockStored | _WireBlockRemoved | _WireAllBlocksCleared]
    data_parallel_rank: int | None = None


def _wire(event: CacheEvent) -> _WireBlockStored | _WireBlockRemoved | _WireAllBlocksCleared:
    if isinstance(event, BlockStored):
        return _WireBlockStored(
            block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None, medium=MEDIUM_GPU,
            lora_name=None,
        )  # fmt: skip
    if isinstance(event, BlockRemoved):
        return _WireBlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM_GPU)
    assert isinstance(event, AllBlocksCleared)
    return _WireAllBlocksCleared()


def encode_batch(events: list[CacheEvent], *, ts: float, data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one ``EventBatch`` of ``events`` (see the module doc)."""
    batch = _WireBatch(ts=ts, events=[_wire(e) for e in events], data_parallel_rank=data_parallel_rank)
    return msgspec.msgpack.encode(batch)


class KvEventPublisher:
    """A ZMQ PUB socket sending KV event batches in vLLM's wire format, and with ``replay_endpoint`` a ROUTER
    socket replaying the last ``buffer_steps`` of them (see the module doc; the replay is served by
    :meth:`serve_replay`, a task the caller runs).

    Args:
        config: the endpoint's config (``config.publishes`` must be True).

    Raises:
        ValueError: the config does not publish.
        zmq.ZMQError: an endpoint cannot be bound or connected.
    """

    def __init__(self, config: KvEventsConfig) -> None:
        if not config.publishes:
            raise ValueError("kv-events-config does not publish (enable_kv_cache_events and publisher 'zmq')")
        self.config = config
        self._topic = config.topic.encode()
        self._seq = 0
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        # vLLM's rule: bind a wildcard ("*", "::") or ipc/inproc endpoint ("bind stable"), else connect to a
        # subscriber that bound it ("connect volatile")
        e = config.endpoint
        if "*" in e or "::" in e or e.startswith(("ipc://", "inproc://")):
            self._socket.bind(e)
        else:
            self._socket.connect(e)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._replay: zmq.asyncio.Socket | None = None
        if config.replay_endpoint is not None:
            self._replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            try:
                self._replay.bind(config.replay_endpoint)
            except zmq.ZMQError:
                self.close()
                raise
        #: batches sent, batches ZMQ refused (past the high-water mark), replay requests served
        self.sent = 0
        self.dropped = 0
        self.replays = 0

    @property
    def next_seq(self) -> int:
        """The sequence the next batch will carry (batches published so far)."""
        return self._seq

    @property
    def replay_address(self) -> str | None:
        """The bound replay endpoint (``tcp://host:port``, the port resolved), or None without replay."""
        if self._replay is None:
            return None
        return str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, events: list[CacheEvent], *, ts: float | None = None) -> None:
        """Send one batch of ``events`` (nothing when empty), without blocking; keep it for replay."""
        if not events:
            return
        payload = encode_batch(events, ts=time.time() if ts is None else ts)
        seq = self._seq.to_bytes(8, "big")
        if self._replay is not None:
            self._buffer.append((self._seq, payload))
        try:
            self._socket.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1
        self._seq += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (returns at once without ``replay_endpoint``)."""
        if self._replay is None:
            return
        while True:
            try:
                frames = await self._replay.recv_multipart()
            except zmq.ZMQError as exc:  # the socket was closed under the task
                log.warning("kv-events replay: %s; replay stopped", exc)
                return
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                log.warning("kv-events replay: request of %d frames ignored", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((identity, b"", END_SEQ, b""))
            self.replays += 1

    def close(self) -> None:
        """Close the sockets at once (pending messages are dropped)."""
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
