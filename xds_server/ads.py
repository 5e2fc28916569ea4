"""The grpcio aio Aggregated Discovery Service servicer: a thin adapter over :mod:`xds_server.sotw` (state of
the world, ``StreamAggregatedResources``) and :mod:`xds_server.delta` (incremental,
``DeltaAggregatedResources``).

One stream = one protocol state (:class:`~xds_server.sotw.SotwStream` or
:class:`~xds_server.delta.DeltaStream`) + one input queue. A reader task puts the client's requests on the
queue; the cache's watcher puts a wake-up there whenever a snapshot is published; the stream's loop takes
one input at a time, asks the protocol state what to send, and writes it. Requests and pushes are therefore
handled strictly in arrival order on each stream, with no locks. Wake-ups that pile up while a stream is
busy are merged: the stream only ever pushes the newest snapshot.

gRPC status codes appear only here (as only go-control-plane's ``pkg/server`` knows gRPC).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from xds_server.cache import Snapshot, SnapshotCache
from xds_server.delta import DeltaStream, SharedDeltaResponses
from xds_server.sotw import (
    AckReceived,
    NackReceived,
    OversizedResponseWithheld,
    ResponseSent,
    SotwStream,
    StaleNonceIgnored,
    StreamEvent,
    SubscriptionOpened,
    UnknownTypeIgnored,
)

log = logging.getLogger("xds_server.ads")


@dataclass(frozen=True, kw_only=True)
class _SnapshotPublished:
    """Wake-up put on a stream's queue by the cache watcher."""

    group: str


@dataclass(frozen=True, kw_only=True)
class _RequestsEnded:
    """The client half-closed the stream (or reading it failed)."""

    error: BaseException | None = None


_StreamInput: TypeAlias = (
    discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest | _SnapshotPublished | _RequestsEnded
)


def _short(type_url: str) -> str:
    return type_url.rsplit(".", 1)[-1]


#: gRPC's default maximum receive message size (bytes).
GRPC_DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024

Mode = Literal["sotw", "delta"]
MODES: tuple[Mode, ...] = ("sotw", "delta")


@dataclass
class AdsStats:
    """Counters of one servicer since it started (exported by :mod:`xds_server.metrics`).

    Attributes:
        streams_opened / streams_active: ADS streams, both modes.
        responses_sent: DiscoveryResponses written (both modes).
        acks / nacks / stale_nonces / unknown_types: requests by outcome (both modes).
        last_nack: the most recent NACK (node id, type, rejected version, detail), or None.
        pushes: ``{(mode, type_url): responses written}``; ``nacks_by``: ``{(mode, type_url): NACKs}``.
        streams_by_mode: ``{mode: streams opened}``.
        oversized_responses: responses over gRPC's 4 MiB default message size: SotW pushes withheld for
            it (logged as errors) and single Delta resources too big to split (logged as warnings).
    """

    streams_opened: int = 0
    streams_active: int = 0
    responses_sent: int = 0
    acks: int = 0
    nacks: int = 0
    stale_nonces: int = 0
    unknown_types: int = 0
    last_nack: NackReceived | None = None
    pushes: Counter[tuple[str, str]] = field(default_factory=Counter)
    nacks_by: Counter[tuple[str, str]] = field(default_factory=Counter)
    streams_by_mode: Counter[str] = field(default_factory=Counter)
    oversized_responses: int = 0


class _Protocol(Protocol):
    """What the stream loop needs from :class:`SotwStream` and :class:`DeltaStream`."""

    @property
    def node_id(self) -> str: ...

    @property
    def node_cluster(self) -> str: ...

    def handle_request(self, request: Any, snapshot: Snapshot | None) -> Any: ...

    def handle_snapshot(self, snapshot: Snapshot) -> Any: ...


@dataclass
class ConnectedClient:
    """One open ADS stream, for ``inferlb xds clients`` and the stream gauges.

    Attributes:
        stream_id: the servicer's stream number; mode: ``sotw`` or ``delta``; peer: gRPC peer string.
        connected_at: wall-clock time (s since the epoch) the stream opened.
        state: the stream's protocol state (read its ``types`` for versions).
        last_nack: the stream's most recent NACK, or None.
    """

    stream_id: int
    mode: Mode
    peer: str
    connected_at: float
    state: SotwStream | DeltaStream
    last_nack: NackReceived | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: node, mode, peer, connected_at, per type (short name) the sent, ACKed and
        NACKed versions, and the last NACK."""
        types = {
            _short(t): {
                "sent_version": s.sent_version,
                "acked_version": s.acked_version,
                "nacked_version": s.nacked_version,
            }
            for t, s in self.state.types.items()
        }
        nack = self.last_nack
        return {
            "stream_id": self.stream_id,
            "node_id": self.state.node_id,
            "node_cluster": self.state.node_cluster,
            "mode": self.mode,
            "peer": self.peer,
            "connected_at": self.connected_at,
            "types": types,
            "last_nack": None
            if nack is None
            else {
                "type": _short(nack.type_url),
                "rejected_version": nack.rejected_version,
                "kept_version": nack.kept_version,
                "error_code": nack.error_code,
                "error_message": nack.error_message,
            },
        }


class AggregatedDiscoveryServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    """ADS over grpcio aio, state of the world and Delta, reading snapshots from ``cache``.

    Args:
        cache: where snapshots come from; each stream serves ``cache.snapshot_for(node.cluster)``.
        on_push: called as ``on_push(mode, seconds)`` for each response a snapshot push writes, with the
            time since the snapshot's first change (the push-latency metric); None: not measured.

    Attributes:
        stats: :class:`AdsStats`, updated as streams run.
        clients: ``{stream_id: ConnectedClient}`` of the open streams.
    """

    def __init__(self, cache: SnapshotCache, *, on_push: Callable[[str, float], None] | None = None) -> None:
        self._cache = cache
        self._stream_ids = itertools.count(1)
        self.stats = AdsStats()
        self.clients: dict[int, ConnectedClient] = {}
        self.on_push = on_push
        #: Delta responses built and serialized once, shared by the streams that send the same content
        self.shared_delta = SharedDeltaResponses(cache.instance_id)
        #: set by :func:`add_ads_to_server`: ADS writes may be pre-serialized bytes
        self.pass_through_serializer = False

    def clients_json(self) -> list[dict[str, Any]]:
        """Every open stream as :meth:`ConnectedClient.to_json`, by stream id."""
        return [c.to_json() for _, c in sorted(self.clients.items())]

    async def StreamAggregatedResources(  # the gRPC method name
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext[discovery_pb2.DiscoveryRequest, discovery_pb2.DiscoveryResponse],
    ) -> None:
        """Serve one SotW ADS stream until the client closes or cancels it."""
        await self._serve(
            "sotw", SotwStream(control_plane_id=self._cache.instance_id), request_iterator, context
        )

    async def DeltaAggregatedResources(  # the gRPC method name
        self,
        request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext[
            discovery_pb2.DeltaDiscoveryRequest, discovery_pb2.DeltaDiscoveryResponse
        ],
    ) -> None:
        """Serve one Delta (incremental) ADS stream until the client closes or cancels it."""
        stream = DeltaStream(control_plane_id=self._cache.instance_id, shared=self.shared_delta)
        await self._serve("delta", stream, request_iterator, context)

    async def serve_stream(
        self,
        mode: Mode,
        request_iterator: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        only_type: str | None = None,
    ) -> None:
        """Serve one stream of either mode; ``only_type`` restricts it to one resource type (the per-type
        discovery services of :mod:`xds_server.per_type`: requests for other types are ignored)."""
        cp = self._cache.instance_id
        stream: SotwStream | DeltaStream = (
            SotwStream(control_plane_id=cp, only_type=only_type)
            if mode == "sotw"
            else DeltaStream(control_plane_id=cp, only_type=only_type, shared=self.shared_delta)
        )
        await self._serve(mode, stream, request_iterator, context, only_type=only_type)

    async def _serve(
        self,
        mode: Mode,
        stream: SotwStream | DeltaStream,
        request_iterator: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        only_type: str | None = None,
    ) -> None:
        stream_id = next(self._stream_ids)
        proto: _Protocol = stream
        pass_through = mode == "delta" and only_type is None and self.pass_through_serializer
        inputs: asyncio.Queue[_StreamInput] = asyncio.Queue()
        woken = [False]  # a wake-up is already queued: later publishes merge into it

        def on_publish(group: str, _snapshot: Snapshot) -> None:
            if not woken[0]:
                woken[0] = True
                inputs.put_nowait(_SnapshotPublished(group=group))

        unsubscribe = self._cache.subscribe(on_publish)
        reader = asyncio.create_task(
            _read_requests(request_iterator, inputs, only_type), name=f"xds-reader-{stream_id}"
        )
        client = ConnectedClient(
            stream_id=stream_id, mode=mode, peer=context.peer() or "", connected_at=time.time(), state=stream
        )
        self.clients[stream_id] = client
        self.stats.streams_opened += 1
        self.stats.streams_active += 1
        self.stats.streams_by_mode[mode] += 1
        try:
            while True:
                item = await inputs.get()
                if isinstance(item, _RequestsEnded):
                    if item.error is not None:
                        log.info("ads stream %d (node %r) ended: %s", stream_id, proto.node_id, item.error)
                    return
                pushed = isinstance(item, _SnapshotPublished)
                if not isinstance(item, _SnapshotPublished) and stream.node is None and item.HasField("node"):
                    # the node (sent on the first request only) picks the snapshot group: take it before
                    # choosing the snapshot that answers this very request
                    stream.node = item.node
                snapshot: Snapshot | None = self._cache.snapshot_for(
                    proto.node_cluster, per_type=only_type is not None
                )
                if pushed:
                    woken[0] = False
                    if snapshot is None:
                        continue
                    step = proto.handle_snapshot(snapshot)
                else:
                    step = proto.handle_request(item, snapshot)
                self._observe(stream_id, client, step.events)
                for response in step.responses:
                    # on ADS (registered by add_ads_to_server) a shared Delta response goes out as the
                    # bytes serialized once for every stream
                    data = self.shared_delta.serialized(response) if pass_through else None
                    await context.write(response if data is None else Serialized(data))
                if pushed and step.responses and snapshot is not None and self.on_push is not None:
                    self.on_push(mode, time.monotonic() - snapshot.changed_at)
        finally:
            # Envoy restarts and test clients cancel streams all the time: clean up quietly.
            unsubscribe()
            reader.cancel()
            self.clients.pop(stream_id, None)
            self.stats.streams_active -= 1

    def _observe(self, stream_id: int, client: ConnectedClient, events: tuple[StreamEvent, ...]) -> None:
        for event in events:
            self._count(stream_id, client, event)

    def _count(self, stream_id: int, client: ConnectedClient, event: StreamEvent) -> None:
        s = self.stats
        node = client.state.node_id
        mode = client.mode
        match event:
            case ResponseSent():
                s.responses_sent += 1
                s.pushes[(mode, event.type_url)] += 1
                if event.byte_size > GRPC_DEFAULT_MAX_MESSAGE:
                    # SotW withholds such pushes; a Delta chunk is this big only for one huge resource
                    s.oversized_responses += 1
                    log.warning(
                        "ads %s stream %d node %r: %s response of %d bytes is over gRPC's 4 MiB default; "
                        "clients may refuse it (Delta ADS splits large pushes)",
                        mode, stream_id, node, _short(event.type_url), event.byte_size,
                    )  # fmt: skip
                log.debug(
                    "ads %s stream %d node %r: sent %s version %s nonce %s (%d resources)",
                    mode, stream_id, node, _short(event.type_url), event.version, event.nonce,
                    event.resource_count,
                )  # fmt: skip
            case AckReceived():
                s.acks += 1
                log.debug(
                    "ads stream %d node %r: ACK %s %s", stream_id, node, _short(event.type_url), event.version
                )
            case NackReceived():
                s.nacks += 1
                s.nacks_by[(mode, event.type_url)] += 1
                s.last_nack = event
                client.last_nack = event
                log.warning(
                    "ads %s stream %d node %r NACKed %s version %s (keeps %s): code %d: %s",
                    mode, stream_id, event.node_id, _short(event.type_url), event.rejected_version,
                    event.kept_version or "<none>", event.error_code, event.error_message,
                )  # fmt: skip
            case StaleNonceIgnored():
                s.stale_nonces += 1
                log.debug(
                    "ads stream %d node %r: stale nonce %s for %s (latest %s) ignored",
                    stream_id, node, event.nonce, _short(event.type_url), event.latest_nonce,
                )  # fmt: skip
            case UnknownTypeIgnored():
                s.unknown_types += 1
                log.warning(
                    "ads stream %d node %r asked for unserved type %s", stream_id, node, event.type_url
                )
            case OversizedResponseWithheld():
                s.oversized_responses += 1
                log.error(
                    "ads %s stream %d node %r: %s version %s needs a %d-byte response, over the %d-byte "
                    "limit (gRPC clients refuse messages over 4 MiB; SotW cannot split a type): push "
                    "withheld, the client keeps its last version; use Delta ADS for a fleet this size",
                    mode, stream_id, node, _short(event.type_url), event.version, event.byte_size,
                    event.limit,
                )  # fmt: skip
            case SubscriptionOpened():
                log.info(
                    "ads %s stream %d node %r subscribed to %s %s",
                    mode, stream_id, node, _short(event.type_url), list(event.resource_names) or "(all)",
                )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Serialized:
    """A response already serialized (bytes on the wire), written as is by :func:`serialize_response`."""

    data: bytes


def serialize_response(response: Any) -> bytes:
    """The ADS response serializer: :class:`Serialized` bytes as they are, a proto serialized."""
    if isinstance(response, Serialized):
        return response.data
    data: bytes = response.SerializeToString()
    return data


def add_ads_to_server(servicer: AggregatedDiscoveryServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as ``envoy.service.discovery.v3.AggregatedDiscoveryService`` on ``server``,
    like ``ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server`` but with
    :func:`serialize_response`, so shared Delta responses are serialized once for all streams."""
    service = "envoy.service.discovery.v3.AggregatedDiscoveryService"
    handlers = {
        "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.StreamAggregatedResources,
            request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
            response_serializer=serialize_response,
        ),
        "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.DeltaAggregatedResources,
            request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
            response_serializer=serialize_response,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
    servicer.pass_through_serializer = True


async def _read_requests(
    request_iterator: AsyncIterator[Any], inputs: asyncio.Queue[_StreamInput], only_type: str | None = None
) -> None:
    try:
        async for request in request_iterator:
            # a per-type service (CDS, EDS, ...) serves its own type: requests may leave type_url empty
            if only_type is not None and not request.type_url:
                request.type_url = only_type
            inputs.put_nowait(request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a broken client stream just ends the stream
        inputs.put_nowait(_RequestsEnded(error=exc))
        return
    inputs.put_nowait(_RequestsEnded())
