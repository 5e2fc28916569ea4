"""The model servers' KV events over ZMQ, into the precise prefix index (:mod:`inferlb.policy.kv_index`).

One :class:`KvEventSubscriber` per endpoint: a ZMQ SUB socket on the endpoint's ``--kv-events-config``
``endpoint`` (connected to it, vLLM's default ``tcp://*:5557`` binding on the server's side, or bound when
the server connects), decoding vLLM's wire format (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):
multipart ``[topic, sequence, payload]``, the sequence an 8-byte big-endian count of batches from 0 and the
payload the msgpack of an ``EventBatch``. Both encodings vLLM has used are read: msgspec structs
*array-like* with tags (``[ts, events, data_parallel_rank]``, each event ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...]``, what gpusim sends) and the
*map* layout of newer releases (``{"ts":..., "events": [{"type": "BlockStored", "block_hashes": ...}]}``).
Fields after the ones the index uses are ignored; an event of an unknown type is skipped and counted.

The sequence is what keeps the index right (counted in :class:`SubscriberCounters`, exported by
:class:`KvEventsCollector`):

* **In order** (the last sequence plus one): the batch is applied.
* **A gap** (a later sequence: ZMQ dropped batches past a high-water mark, or the subscriber was slow to
  join): with the server's ``replay_endpoint`` the subscriber asks for the missing batches as vLLM's replay
  protocol has it (a DEALER sends ``[b"", first missing sequence]``; the server's ROUTER answers ``[b"", seq,
  payload]`` per buffered batch, then ``[b"", -1, b""]``) and applies them, then the live batch. When the
  replay does not cover the gap (its buffer of ``buffer_steps`` batches starts later, no replay socket, no
  answer within ``replay_timeout_s``) the endpoint's entries are **dropped**: it is matched by nothing, so
  the picker places by load alone for it, until new events rebuild it (what the replay did return, when it
  is the run just before the live batch, is applied after the drop). Rebuilt that way the index can only
  miss blocks the server has (their runs were stored before the window), never claim one it has not.
* **The first batch** of a subscriber (or after a restart) with a sequence above 0: a gap from 0.
* **A publisher restart** (a sequence at or below the last applied: a restarted vLLM counts from 0 again,
  with an empty cache; or, after the SUB socket's monitor saw a publisher's connection drop, any sequence
  but the next one): the endpoint's entries are cleared, and the batch is taken as its first (so a
  restarted server's replay buffer fills in from 0 what the subscriber missed while it reconnected).
* **A malformed message** (not three frames, a sequence not of 8 bytes): counted and skipped. A payload that
  does not decode, or an event of the wrong shape: counted, the sequence taken, and the endpoint's entries
  dropped (what that batch changed is unknown). Nothing a server sends stops the subscriber.

Not covered: a restart whose dropped connection ZMQ did not see (the new process up before the old
connection timed out) and whose sequence has passed the last one seen is taken as a gap. The glue clears an
endpoint's entries when it leaves the fleet or fails its health checks (:meth:`PreciseKvIndex.clear`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from zmq.utils.monitor import parse_monitor_message

from inferlb.policy.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, PreciseKvIndex

log = logging.getLogger("inferlb.kv_events")

#: The sequence of the replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``).
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
#: How long a replay may take before the gap is taken as not covered (s).
DEFAULT_REPLAY_TIMEOUT_S: Final = 1.0


class MalformedBatch(ValueError):
    """A payload that is not an ``EventBatch`` of known shape (the message names what is wrong)."""


# -- decoding (pure) -----------------------------------------------------------------------------------------


def _hashes(value: Any, what: str) -> tuple[bytes | int, ...]:
    if not isinstance(value, list) or not all(isinstance(h, bytes | int) for h in value):
        raise MalformedBatch(f"{what}: block_hashes must be a list of bytes or ints")
    return tuple(value)


def _optional_str(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise MalformedBatch(f"{what} must be a string or nil")
    return value


def _stored(f: dict[str, Any]) -> BlockStored:
    parent, token_ids, block_size = f.get("parent_block_hash"), f.get("token_ids"), f.get("block_size")
    hashes = _hashes(f.get("block_hashes"), "BlockStored")
    if parent is not None and not isinstance(parent, bytes | int):
        raise MalformedBatch("BlockStored: parent_block_hash must be bytes, an int or nil")
    if not isinstance(token_ids, list):
        raise MalformedBatch("BlockStored: token_ids must be a list")
    try:
        array("I", token_ids)  # ints in 0..2**32-1, checked in C
    except (TypeError, OverflowError):
        raise MalformedBatch("BlockStored: token_ids must be ints in 0..2**32-1") from None
    if type(block_size) is not int or block_size < 1:
        raise MalformedBatch("BlockStored: block_size must be an int >= 1")
    if len(token_ids) != len(hashes) * block_size:
        raise MalformedBatch(
            f"BlockStored: {len(token_ids)} token ids for {len(hashes)} blocks of {block_size}"
        )
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tuple(token_ids), block_size=block_size,
        lora_name=_optional_str(f.get("lora_name"), "BlockStored: lora_name"),
        medium=_optional_str(f.get("medium"), "BlockStored: medium"),
    )  # fmt: skip


#: Field names of the array-like layout, in order after the tag (vLLM's struct field order).
_ARRAY_FIELDS: Final = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _event(raw: Any) -> KvEvent | None:
    """One event, either layout; None for an unknown type."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _ARRAY_FIELDS.get(tag)
        if names is None:
            return None
        f = dict(zip(names, raw[1:], strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, f = raw["type"], raw
        if tag not in _ARRAY_FIELDS:
            return None
    else:
        raise MalformedBatch("an event must be a tagged array or a map with a 'type'")
    if tag == "BlockStored":
        return _stored(f)
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes"), "BlockRemoved"),
            medium=_optional_str(f.get("medium"), "BlockRemoved: medium"),
        )
    return AllBlocksCleared()


@dataclass(frozen=True, kw_only=True)
class DecodedBatch:
    """One ``EventBatch``: its events the index knows (in order) and how many it skipped as unknown."""

    ts: float
    events: tuple[KvEvent, ...]
    unknown: int = 0


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one ``EventBatch`` payload, array-like or map layout (see the module doc).

    Raises:
        MalformedBatch: not msgpack, or not of the shape of an ``EventBatch``.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedBatch(f"not msgpack: {exc}") from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
    else:
        raise MalformedBatch("an EventBatch must be an array [ts, events, ...] or a map")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise MalformedBatch("an EventBatch needs a number ts and a list of events")
    out: list[KvEvent] = []
    unknown = 0
    for e in events:
        ev = _event(e)
        if ev is None:
            unknown += 1
        else:
            out.append(ev)
    return DecodedBatch(ts=float(ts), events=tuple(out), unknown=unknown)


# -- the subscriber ------------------------------------------------------------------------------------------


@dataclass
class SubscriberCounters:
    """What one subscriber saw (counts since it started).

    Attributes:
        batches: batches applied (live and replayed).
        events: events applied.
        unknown_events: events of a type the index does not know, skipped.
        gaps: sequence gaps seen (a first batch above 0 counts as one).
        missed_batches: batches those gaps spanned.
        replays: replay requests sent.
        replayed_batches: batches applied from replays.
        dropped_states: times the endpoint's entries were dropped because a gap was not covered or a batch
            could not be read.
        restarts: publisher restarts seen (a sequence at or below the last applied).
        malformed: messages or payloads that could not be read.
    """

    batches: int = 0
    events: int = 0
    unknown_events: int = 0
    gaps: int = 0
    missed_batches: int = 0
    replays: int = 0
    replayed_batches: int = 0
    dropped_states: int = 0
    restarts: int = 0
    malformed: int = 0


class KvEventSubscriber:
    """Subscribe to one endpoint's KV events and keep its entries of ``index`` (see the module doc).

    Args:
        address: the endpoint's ``ip:port`` as the picker names it (the index's key).
        endpoint: the ZMQ endpoint its events come from (``tcp://10.0.0.7:5557``).
        index: the index to feed (shared by the subscribers of a model's endpoints).
        replay_endpoint: the server's replay ROUTER (``tcp://10.0.0.7:5558``), or None.
        topic: the topic prefix to subscribe to (vLLM's ``topic``; "" is every topic).
        bind: bind ``endpoint`` instead of connecting (when the server connects to the subscriber).
        replay_timeout_s: how long a replay may take (s, > 0).
        context: the ZMQ context (default: the process's asyncio one).

    Raises:
        ValueError: ``replay_timeout_s`` not above 0.
    """

    def __init__(
        self,
        *,
        address: str,
        endpoint: str,
        index: PreciseKvIndex,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool = False,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if not replay_timeout_s > 0:
            raise ValueError(f"replay_timeout_s must be > 0, got {replay_timeout_s}")
        self.address = address
        self.endpoint = endpoint
        self.index = index
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.counters = SubscriberCounters()
        #: the sequence of the last batch taken (applied, or dropped as unreadable), None before the first
        self.last_seq: int | None = None
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        #: a publisher's connection dropped since the last message (it may have restarted)
        self._peer_lost = False
        self._dealer: zmq.asyncio.Socket | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------

    def open(self) -> str:
        """Open the SUB socket (idempotent). Returns its endpoint (the bound one, port resolved, with
        ``bind``).

        Raises:
            zmq.ZMQError: the endpoint cannot be bound or connected.
        """
        if self._sub is None:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
            try:
                if self.bind:
                    sub.bind(self.endpoint)
                    self.endpoint = str(sub.getsockopt_string(zmq.LAST_ENDPOINT))
                else:
                    sub.connect(self.endpoint)
            except zmq.ZMQError:
                sub.close(linger=0)
                raise
            self._sub = sub
            self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return self.endpoint

    def close(self) -> None:
        """Close the sockets (idempotent); the index keeps the endpoint's entries."""
        if self._sub is not None and self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        for sock in (self._monitor, self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = self._monitor = None

    async def run(self) -> None:
        """Receive and apply batches until cancelled (opens the socket first)."""
        self.open()
        try:
            while True:
                await self.handle(await self.receive())
        finally:
            self.close()

    async def receive(self) -> list[bytes]:
        """The next message of the SUB socket, as :meth:`run` hands it to :meth:`handle` (opens it first)."""
        self.open()
        assert self._sub is not None
        return await self._sub.recv_multipart()

    # -- one message ----------------------------------------------------------------------------------------

    async def handle(self, frames: Sequence[bytes]) -> None:
        """Take one multipart message of the SUB socket (see the module doc for what each case does)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters.malformed += 1
            log.warning("kv events from %s: a message of %d frames skipped", self.address, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        await self._read_monitor()
        lost, self._peer_lost = self._peer_lost, False
        if self.last_seq is not None and (seq <= self.last_seq or (lost and seq != self.last_seq + 1)):
            self.counters.restarts += 1
            log.info("kv events from %s: sequence %d after %d%s, a restarted publisher: entries cleared",
                     self.address, seq, self.last_seq, " and a lost connection" if lost else "")  # fmt: skip
            self.index.clear(self.address)
            self.last_seq = None
        first_missing = 0 if self.last_seq is None else self.last_seq + 1
        if seq > first_missing:
            await self._fill_gap(first_missing, seq)
        self._take(seq, frames[2])

    async def _read_monitor(self) -> None:
        """Note the publisher connections that dropped (the SUB socket's monitor events waiting now)."""
        monitor = self._monitor
        while monitor is not None and await monitor.poll(0):
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._peer_lost = True

    def _take(self, seq: int, payload: bytes) -> None:
        """Apply the batch ``seq``; an unreadable one drops the entries (its changes are unknown)."""
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
            self.index.apply(self.address, batch.events)
        except (MalformedBatch, ValueError) as exc:
            self.counters.malformed += 1
            self.counters.dropped_states += 1
            log.warning("kv events from %s: batch %d unreadable (%s): entries dropped",
                        self.address, seq, exc)  # fmt: skip
            self.index.clear(self.address)
            return
        self.counters.batches += 1
        self.counters.events += len(batch.events)
        self.counters.unknown_events += batch.unknown

    async def _fill_gap(self, start: int, seq: int) -> None:
        """Batches ``start..seq-1`` are missing: replay them, or drop the entries when that fails."""
        self.counters.gaps += 1
        self.counters.missed_batches += seq - start
        replayed = await self._replay(start) if self.replay_endpoint is not None else []
        # the replayed run that ends just before the live batch
        wanted = [(s, p) for s, p in replayed if start <= s < seq]
        run: list[tuple[int, bytes]] = []
        for s, p in reversed(wanted):
            if s != (run[-1][0] - 1 if run else seq - 1):
                break
            run.append((s, p))
        run.reverse()
        covered = bool(run) and run[0][0] == start
        if not covered:
            self.counters.dropped_states += 1
            log.info("kv events from %s: batches %d..%d missing and not replayed: entries dropped",
                     self.address, start, seq - 1)  # fmt: skip
            self.index.clear(self.address)
        for s, p in run:
            self._take(s, p)
            self.counters.replayed_batches += 1

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """Ask the replay socket for the batches from ``start`` on; what came before the end marker or the
        timeout (sequence, payload), in order. A timed-out socket is closed (its late answers would be
        read as the next replay's)."""
        self.counters.replays += 1
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            assert self.replay_endpoint is not None
            self._dealer.connect(self.replay_endpoint)
        dealer = self._dealer
        out: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(self.replay_timeout_s):
                await dealer.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 3 or frames[0] or len(frames[1]) != 8:
                        self.counters.malformed += 1
                        continue
                    if frames[1] == END_SEQ:
                        return out
                    out.append((int.from_bytes(frames[1], "big"), frames[2]))
        except TimeoutError:
            log.info("kv events from %s: no replay end within %.1f s", self.address, self.replay_timeout_s)
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)
            self._dealer = None
        return out


class KvEventsCollector(Collector):
    """The subscribers' counters as Prometheus counters ``inferlb_kv_events_<counter>_total{endpoint}``
    (one family per :class:`SubscriberCounters` field), read at each scrape."""

    def __init__(self, subscribers: Iterable[KvEventSubscriber] = ()) -> None:
        self.subscribers: list[KvEventSubscriber] = list(subscribers)

    def collect(self) -> Iterator[CounterMetricFamily]:
        """One counter family per field, one sample per subscriber."""
        for f in fields(SubscriberCounters):
            family = CounterMetricFamily(
                f"inferlb_kv_events_{f.name}", f"KV events: {f.name.replace('_', ' ')}", labels=["endpoint"]
            )
            for s in self.subscribers:
                family.add_metric([s.address], getattr(s.counters, f.name))
            yield family
