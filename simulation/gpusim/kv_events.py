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
arrays; this module sends the array layout only. Not modelled: the replay ROUTER socket
(``replay_endpoint``, refused), the data-parallel port offset (each endpoint of a process gets its own port:
:meth:`KvEventsConfig.for_endpoint`).

The config is the JSON of vLLM's ``--kv-events-config`` (``KVEventsConfig``): ``enable_kv_cache_events``,
``publisher`` (``"zmq"`` or ``"null"``), ``endpoint`` (``tcp://*:5557`` by default: a wildcard endpoint is
bound, any other is connected to, a subscriber having bound it, as vLLM does), ``topic``, ``hwm``.
Publishing never blocks the event loop: past the high-water mark ZMQ drops messages, as vLLM's PUB socket
does.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec
import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from simulation.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

#: vLLM's ``MEDIUM_GPU``.
MEDIUM_GPU = "GPU"


class KvEventsConfig(BaseModel):
    """vLLM's ``KVEventsConfig`` as far as the simulator publishes (see the module doc). Unknown fields are
    refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = Field(default=100_000, ge=0)

    @property
    def publishes(self) -> bool:
        """True when events are enabled and go to a ZMQ socket."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_endpoint(self, index: int) -> KvEventsConfig:
        """The config of the ``index``-th endpoint of a process: a ``tcp://`` endpoint's port plus ``index``
        (as vLLM offsets it by data-parallel rank), so each simulated GPU has its own socket.

        Raises:
            ValueError: a ``tcp://`` endpoint without a numeric port.
        """
        if index == 0 or not self.endpoint.startswith("tcp://"):
            return self
        head, _, port = self.endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv-events-config endpoint {self.endpoint!r} has no port")
        return self.model_copy(update={"endpoint": f"{head}:{int(port) + index}"})


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
    """A ZMQ PUB socket sending KV event batches in vLLM's wire format.

    Args:
        config: the endpoint's config (``config.publishes`` must be True).

    Raises:
        ValueError: the config does not publish.
        zmq.ZMQError: the endpoint cannot be bound or connected.
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
        #: batches sent, and batches ZMQ refused (past the high-water mark)
        self.sent = 0
        self.dropped = 0

    def publish(self, events: list[CacheEvent], *, ts: float | None = None) -> None:
        """Send one batch of ``events`` (nothing when empty), without blocking."""
        if not events:
            return
        payload = encode_batch(events, ts=time.time() if ts is None else ts)
        try:
            self._socket.send_multipart(
                (self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
            self.sent += 1
        except zmq.Again:
            self.dropped += 1
        self._seq += 1

    def close(self) -> None:
        """Close the socket at once (pending messages are dropped)."""
        self._socket.close(linger=0)
