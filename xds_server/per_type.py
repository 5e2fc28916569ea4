"""The per-type discovery services (CDS, EDS, LDS, RDS), state of the world and Delta, on grpcio aio.

Each is one resource type of the same snapshots ADS serves, on its own stream: ``StreamClusters`` is a
SotW stream restricted to clusters, ``DeltaEndpoints`` a Delta stream restricted to endpoint assignments,
and so on; the protocol rules are those of :mod:`xds_server.sotw` and :mod:`xds_server.delta`. ``Fetch*``
(the unary, REST-like form) answers the current resources of the type (all of them, or those named).
These streams serve each group's per-type variant (:meth:`SnapshotCache.snapshot_for` with
``per_type=True``): its clusters fetch endpoints, and its listener routes, over these services rather than
ADS, so an Envoy bootstrapped with ``inferlb bootstrap --ads-mode xds`` (LDS and CDS streams, no ADS) gets
resources that point at the services it uses. Without ADS, Envoy cannot order types across streams; it
copes by warming a cluster until its endpoints arrive and a listener until its routes do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.listener.v3 import lds_pb2_grpc
from envoy.service.route.v3 import rds_pb2_grpc

from xds_server.ads import AggregatedDiscoveryServicer
from xds_server.cache import SnapshotCache
from xds_server.resources.common import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE
from xds_server.sotw import NAMED_TYPES


class _PerType:
    """Shared behaviour: the three methods of one per-type service over one type URL."""

    type_url = ""

    def __init__(self, ads: AggregatedDiscoveryServicer, cache: SnapshotCache) -> None:
        self._ads = ads
        self._cache = cache

    async def _stream(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._ads.serve_stream("sotw", request_iterator, context, only_type=self.type_url)

    async def _delta(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._ads.serve_stream("delta", request_iterator, context, only_type=self.type_url)

    async def _fetch(
        self, request: discovery_pb2.DiscoveryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> discovery_pb2.DiscoveryResponse:
        snapshot = self._cache.snapshot_for(
            request.node.cluster if request.HasField("node") else "", per_type=True
        )
        if snapshot is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no snapshot published yet")
            raise AssertionError("unreachable: abort raises")
        if request.type_url and request.type_url != self.type_url:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this service serves {self.type_url}, not {request.type_url}",
            )
        names = request.resource_names if self.type_url in NAMED_TYPES else []
        selected = snapshot.select(self.type_url, names)
        return discovery_pb2.DiscoveryResponse(
            version_info=snapshot.version(self.type_url),
            type_url=self.type_url,
            resources=[r.packed for r in selected],
            control_plane=base_pb2.ControlPlane(identifier=self._cache.instance_id),
        )


class ClusterDiscoveryServicer(_PerType, cds_pb2_grpc.ClusterDiscoveryServiceServicer):  # type: ignore[misc]
    """CDS: ``StreamClusters`` (SotW), ``DeltaClusters``, ``FetchClusters``."""

    type_url = CLUSTER_TYPE

    async def StreamClusters(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._stream(request_iterator, context)

    async def DeltaClusters(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._delta(request_iterator, context)

    async def FetchClusters(self, request: Any, context: Any) -> discovery_pb2.DiscoveryResponse:
        return await self._fetch(request, context)


class EndpointDiscoveryServicer(_PerType, eds_pb2_grpc.EndpointDiscoveryServiceServicer):  # type: ignore[misc]
    """EDS: ``StreamEndpoints`` (SotW), ``DeltaEndpoints``, ``FetchEndpoints``."""

    type_url = ENDPOINT_TYPE

    async def StreamEndpoints(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._stream(request_iterator, context)

    async def DeltaEndpoints(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._delta(request_iterator, context)

    async def FetchEndpoints(self, request: Any, context: Any) -> discovery_pb2.DiscoveryResponse:
        return await self._fetch(request, context)


class ListenerDiscoveryServicer(_PerType, lds_pb2_grpc.ListenerDiscoveryServiceServicer):  # type: ignore[misc]
    """LDS: ``StreamListeners`` (SotW), ``DeltaListeners``, ``FetchListeners``."""

    type_url = LISTENER_TYPE

    async def StreamListeners(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._stream(request_iterator, context)

    async def DeltaListeners(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._delta(request_iterator, context)

    async def FetchListeners(self, request: Any, context: Any) -> discovery_pb2.DiscoveryResponse:
        return await self._fetch(request, context)


class RouteDiscoveryServicer(_PerType, rds_pb2_grpc.RouteDiscoveryServiceServicer):  # type: ignore[misc]
    """RDS: ``StreamRoutes`` (SotW), ``DeltaRoutes``, ``FetchRoutes``."""

    type_url = ROUTE_TYPE

    async def StreamRoutes(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._stream(request_iterator, context)

    async def DeltaRoutes(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._delta(request_iterator, context)

    async def FetchRoutes(self, request: Any, context: Any) -> discovery_pb2.DiscoveryResponse:
        return await self._fetch(request, context)


def add_per_type_services(
    server: grpc.aio.Server, ads: AggregatedDiscoveryServicer, cache: SnapshotCache
) -> None:
    """Register CDS, EDS, LDS and RDS on ``server``, sharing ``ads``'s streams, stats and client list."""
    cds_pb2_grpc.add_ClusterDiscoveryServiceServicer_to_server(ClusterDiscoveryServicer(ads, cache), server)
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(EndpointDiscoveryServicer(ads, cache), server)
    lds_pb2_grpc.add_ListenerDiscoveryServiceServicer_to_server(ListenerDiscoveryServicer(ads, cache), server)
    rds_pb2_grpc.add_RouteDiscoveryServiceServicer_to_server(RouteDiscoveryServicer(ads, cache), server)
