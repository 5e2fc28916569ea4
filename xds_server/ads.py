"""The grpcio aio Aggregated Discovery Service servicer: a thin adapter over :mod:`xds_server.sotw`.

One stream = one :class:`~xds_server.sotw.SotwStream` + one input queue. A reader task puts the client's
requests on the queue; the cache's watcher puts a wake-up there whenever a snapshot is published; the
stream's loop takes one input at a time, asks the protocol state what to send, and writes it. Requests and
pushes are therefore handled strictly in arrival order on each stream, with no locks.

gRPC status codes appear only here (shared/STYLE.md, item 3). Delta xDS (``DeltaAggregatedResources``)
is answered ``UNIMPLEMENTED`` until issue 3 adds it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeAlias

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from xds_server.cache import Snapshot, SnapshotCache
from xds_server.sotw import (
    AckReceived,
    NackReceived,
    ResponseSent,
    SotwStream,
    StaleNonceIgnored,
    Step,
    StreamEvent,
    SubscriptionOpened,
    UnknownTypeIgnored,
)

log = logging.getLogger("xds_server.ads")


@dataclass
class AdsStats:
    """Counters of one servicer since it started (issue 3 exports them as Prometheus metrics).

    Attributes:
        streams_opened / streams_active: SotW ADS streams.
        responses_sent: DiscoveryResponses written.
        acks / nacks / stale_nonces / unknown_types: requests by outcome.
        last_nack: the most recent NACK (node id, type, rejected version, detail), or None.
    """

    streams_opened: int = 0
    streams_active: int = 0
    responses_sent: int = 0
    acks: int = 0
    nacks: int = 0
    stale_nonces: int = 0
    unknown_types: int = 0
    last_nack: NackReceived | None = None


@dataclass(frozen=True, kw_only=True)
class _SnapshotPublished:
    """Wake-up put on a stream's queue by the cache watcher."""

    group: str


@dataclass(frozen=True, kw_only=True)
class _RequestsEnded:
    """The client half-closed the stream (or reading it failed)."""

    error: BaseException | None = None


_StreamInput: TypeAlias = "discovery_pb2.DiscoveryRequest | _SnapshotPublished | _RequestsEnded"


def _short(type_url: str) -> str:
    return type_url.rsplit(".", 1)[-1]


class AggregatedDiscoveryServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    """ADS over grpcio aio, state of the world, reading snapshots from ``cache``.

    Args:
        cache: where snapshots come from; each stream serves ``cache.snapshot_for(node.cluster)``.

    Attributes:
        stats: :class:`AdsStats`, updated as streams run.
    """

    def __init__(self, cache: SnapshotCache) -> None:
        self._cache = cache
        self._stream_ids = itertools.count(1)
        self.stats = AdsStats()

    async def StreamAggregatedResources(  # the gRPC method name
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext[discovery_pb2.DiscoveryRequest, discovery_pb2.DiscoveryResponse],
    ) -> None:
        """Serve one SotW ADS stream until the client closes or cancels it."""
        stream_id = next(self._stream_ids)
        stream = SotwStream(control_plane_id=self._cache.instance_id)
        inputs: asyncio.Queue[_StreamInput] = asyncio.Queue()
        unsubscribe = self._cache.subscribe(
            lambda group, _s: inputs.put_nowait(_SnapshotPublished(group=group))
        )
        reader = asyncio.create_task(_read_requests(request_iterator, inputs), name=f"ads-reader-{stream_id}")
        self.stats.streams_opened += 1
        self.stats.streams_active += 1
        try:
            while True:
                item = await inputs.get()
                if isinstance(item, _RequestsEnded):
                    if item.error is not None:
                        log.info("ads stream %d (node %r) ended: %s", stream_id, stream.node_id, item.error)
                    return
                snapshot: Snapshot | None = self._cache.snapshot_for(stream.node_cluster)
                if isinstance(item, _SnapshotPublished):
                    if snapshot is None:
                        continue
                    step = stream.handle_snapshot(snapshot)
                else:
                    step = stream.handle_request(item, snapshot)
                self._observe(stream_id, stream, step)
                for response in step.responses:
                    await context.write(response)
        finally:
            # Envoy restarts and test clients cancel streams all the time: clean up quietly.
            unsubscribe()
            reader.cancel()
            self.stats.streams_active -= 1

    async def DeltaAggregatedResources(  # the gRPC method name
        self,
        request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext[
            discovery_pb2.DeltaDiscoveryRequest, discovery_pb2.DeltaDiscoveryResponse
        ],
    ) -> None:
        """Incremental xDS is not served yet: answer ``UNIMPLEMENTED`` so Envoy's log says why."""
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "inferlb xds_server serves state-of-the-world ADS only"
        )

    def _observe(self, stream_id: int, stream: SotwStream, step: Step) -> None:
        for event in step.events:
            self._count(stream_id, stream, event)

    def _count(self, stream_id: int, stream: SotwStream, event: StreamEvent) -> None:
        s = self.stats
        node = stream.node_id
        match event:
            case ResponseSent():
                s.responses_sent += 1
                log.debug(
                    "ads stream %d node %r: sent %s version %s nonce %s (%d resources)",
                    stream_id, node, _short(event.type_url), event.version, event.nonce, event.resource_count,
                )  # fmt: skip
            case AckReceived():
                s.acks += 1
                log.debug(
                    "ads stream %d node %r: ACK %s %s", stream_id, node, _short(event.type_url), event.version
                )
            case NackReceived():
                s.nacks += 1
                s.last_nack = event
                log.warning(
                    "ads stream %d node %r NACKed %s version %s (keeps %s): code %d: %s",
                    stream_id, event.node_id, _short(event.type_url), event.rejected_version,
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
            case SubscriptionOpened():
                log.info(
                    "ads stream %d node %r subscribed to %s %s",
                    stream_id, node, _short(event.type_url), list(event.resource_names) or "(all)",
                )  # fmt: skip


async def _read_requests(
    request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], inputs: asyncio.Queue[_StreamInput]
) -> None:
    try:
        async for request in request_iterator:
            inputs.put_nowait(request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a broken client stream just ends the stream
        inputs.put_nowait(_RequestsEnded(error=exc))
        return
    inputs.put_nowait(_RequestsEnded())
