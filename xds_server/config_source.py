"""Where Envoy fetches endpoints and routes from: the ADS stream, or this server's per-type services.

:func:`xds_server.resources.build.build_resources` points every EDS cluster and the listener's RDS at ADS
(``ConfigSource.ads``). An Envoy bootstrapped for the per-type discovery services (``inferlb bootstrap
--ads-mode xds``: LDS and CDS each on its own gRPC stream, no ADS) must instead be told to fetch them over
``ApiConfigSource`` gRPC streams to the same ``inferlb_xds`` cluster (EDS and RDS on their own streams).
Envoy's ``ConfigSource.self`` would say "the server that sent this" but is not implemented in Envoy
(``[#not-implemented-hide:]`` in config_source.proto), so the resources themselves differ: the per-type
services serve a variant of each snapshot rewritten here (the protocol a client uses picks the variant,
no config needed). Pure: protos in, protos out.
"""

from __future__ import annotations

from typing import Final

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2, grpc_service_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from xds_server.bootstrap import XDS_CLUSTER
from xds_server.resources.common import CLUSTER_TYPE, LISTENER_TYPE, XdsResources

_HCM_TYPE: Final = (
    f"type.googleapis.com/{http_connection_manager_pb2.HttpConnectionManager.DESCRIPTOR.full_name}"
)


def per_type_source(
    api_type: int = config_source_pb2.ApiConfigSource.GRPC, *, reconnect_ms: tuple[int, int] | None = None
) -> config_source_pb2.ConfigSource:
    """A ConfigSource naming this server's per-type discovery service over gRPC (state of the world by
    default), through the bootstrap's ``inferlb_xds`` cluster, node sent on the first message only.

    ``reconnect_ms`` = ``(base, max)``: the stream's reconnect backoff (``EnvoyGrpc.retry_policy
    .retry_back_off``, as :func:`xds_server.bootstrap.reconnect_policy` sets for the bootstrap's streams);
    None: Envoy's default (1 s to 10 s)."""
    envoy_grpc = grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=XDS_CLUSTER)
    if reconnect_ms is not None:
        base_ms, max_ms = reconnect_ms
        envoy_grpc.retry_policy.retry_back_off.base_interval.FromMilliseconds(base_ms)
        envoy_grpc.retry_policy.retry_back_off.max_interval.FromMilliseconds(max_ms)
    return config_source_pb2.ConfigSource(
        api_config_source=config_source_pb2.ApiConfigSource(
            api_type=api_type,
            transport_api_version=config_source_pb2.ApiVersion.V3,
            grpc_services=[grpc_service_pb2.GrpcService(envoy_grpc=envoy_grpc)],
            set_node_on_first_message_only=True,
        ),
        resource_api_version=config_source_pb2.ApiVersion.V3,
    )


def _cluster(c: cluster_pb2.Cluster, source: config_source_pb2.ConfigSource) -> cluster_pb2.Cluster:
    if c.type != cluster_pb2.Cluster.EDS or not c.eds_cluster_config.eds_config.HasField("ads"):
        return c
    out = cluster_pb2.Cluster()
    out.CopyFrom(c)
    out.eds_cluster_config.eds_config.CopyFrom(source)
    return out


def _listener(
    listener: listener_pb2.Listener, source: config_source_pb2.ConfigSource
) -> listener_pb2.Listener:
    out = listener_pb2.Listener()
    out.CopyFrom(listener)
    changed = False
    for chain in out.filter_chains:
        for f in chain.filters:
            if f.typed_config.type_url != _HCM_TYPE:
                continue
            hcm = http_connection_manager_pb2.HttpConnectionManager()
            f.typed_config.Unpack(hcm)
            if hcm.HasField("rds") and hcm.rds.config_source.HasField("ads"):
                hcm.rds.config_source.CopyFrom(source)
                packed = any_pb2.Any()
                packed.Pack(hcm, deterministic=True)
                f.typed_config.CopyFrom(packed)
                changed = True
    return out if changed else listener


class ConfigSourceRewriter:
    """Rewrites a group's resources for the per-type discovery services, reusing the rewritten proto of
    every input proto seen in the previous call (builders hand back the very same object for an unchanged
    resource, and the snapshot then reuses its serialization). Not thread-safe; one per node group.

    Args:
        reconnect_ms: ``(xds.reconnect_base_ms, xds.reconnect_max_ms)``, the EDS and RDS streams' reconnect
            backoff (:func:`per_type_source`); None: Envoy's default.
    """

    def __init__(self, reconnect_ms: tuple[int, int] | None = None) -> None:
        self.reconnect_ms = reconnect_ms
        self._source = per_type_source(reconnect_ms=reconnect_ms)
        self._memo: dict[int, tuple[Message, Message]] = {}

    def apply(self, resources: XdsResources) -> XdsResources:
        """The resources with every EDS cluster's ``eds_config`` and the listener's RDS ``config_source``
        pointing at the per-type services (:func:`per_type_source`) instead of ADS."""
        memo: dict[int, tuple[Message, Message]] = {}
        by_type: dict[str, dict[str, Message]] = {}
        for t, table in resources.by_type.items():
            out: dict[str, Message] = {}
            for name, msg in table.items():
                hit = self._memo.get(id(msg))
                if hit is not None and hit[0] is msg:
                    new = hit[1]
                elif t == CLUSTER_TYPE:
                    assert isinstance(msg, cluster_pb2.Cluster)
                    new = _cluster(msg, self._source)
                elif t == LISTENER_TYPE:
                    assert isinstance(msg, listener_pb2.Listener)
                    new = _listener(msg, self._source)
                else:
                    new = msg
                memo[id(msg)] = (msg, new)  # the input is kept alive, so its id cannot be reused
                out[name] = new
            by_type[t] = out
        self._memo = memo
        return XdsResources(by_type=by_type)
