"""The pieces every resource module shares: the xDS type URLs and the order they are pushed in, the
resource names, :class:`XdsResources` (one config's resources), and small proto helpers (durations,
``Any`` packing, socket addresses, the ADS config source).

The bottom of the package: it imports no other module of :mod:`xds_server.resources`.
"""

from __future__ import annotations

import functools
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from envoy.config.core.v3 import address_pb2, config_source_pb2
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message

from inferlb.config.schema import Config, GrpcAddress, HostPort, UnixSocket
from inferlb.errors import RequestError

# -- type URLs (envoy/api/v3; the ADS stream multiplexes on these) --------------------------------------
LISTENER_TYPE: Final = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE: Final = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER_TYPE: Final = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE: Final = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

#: The order an ADS server must push types in so Envoy never routes to something it does not know yet
#: ("make before break", envoy/api/xds_protocol: "eventual consistency considerations"): clusters, then
#: their endpoints, then listeners, then the routes they reference.
PUSH_ORDER: Final[tuple[str, ...]] = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)

# -- resource names ------------------------------------------------------------------------------------
LISTENER_NAME: Final = "inferlb_gateway"
ROUTE_CONFIG_NAME: Final = "inferlb_routes"
EXT_PROC_CLUSTER: Final = "inferlb_ext_proc"
#: The cluster of the ext_authz HTTP service (``ext_proc.protocol: ext_authz``), in place of
#: :data:`EXT_PROC_CLUSTER`.
EXT_AUTHZ_CLUSTER: Final = "inferlb_ext_authz"
#: The settler's gRPC access-log cluster (``ext_proc.protocol: ext_authz`` with ``account_responses``):
#: ``ext_proc.meter_listen`` over HTTP/2 (process 0's; the ``extra_listen`` processes' are
#: :func:`meter_cluster_name`).
METER_CLUSTER: Final = "inferlb_meter"
#: The ext_authz HTTP filter's name in the chain.
EXT_AUTHZ_FILTER: Final = "envoy.filters.http.ext_authz"
#: The second ext_authz HTTP filter's name (``ext_proc.protocol: ext_authz`` with a path in
#: ``ext_proc.path_failure_modes`` whose mode is not ``failure_mode_allow``'s): the same check with the other
#: failure mode, disabled in the chain and enabled (with :data:`EXT_AUTHZ_FILTER` disabled) on those paths'
#: routes (:func:`xds_server.resources.routes.ext_proc_filter_configs`). Its stats carry
#: :data:`EXT_AUTHZ_OTHER_MODE_STAT_PREFIX` (``http.inferlb_gateway.ext_authz.other_failure_mode.*``).
EXT_AUTHZ_OTHER_MODE_FILTER: Final = "inferlb.ext_authz.other_failure_mode"
EXT_AUTHZ_OTHER_MODE_STAT_PREFIX: Final = "other_failure_mode"
#: The Lua HTTP filter's name in the chain (ext_authz mode: it applies the service's body splices; skipped
#: by a matcher on requests without any).
LUA_FILTER: Final = "envoy.filters.http.lua"
#: The second Lua HTTP filter (ext_authz mode with ``account_responses``): the response half that meters
#: the usage (and hides the usage chunk the gateway asked for).
METER_LUA_FILTER: Final = "inferlb.meter"
VIRTUAL_HOST_NAME: Final = "inferlb"
NO_ROUTE_NAME: Final = "no_route"
#: The ext_proc HTTP filter's name in the chain; per-route ``ExtProcPerRoute`` configs are keyed by it.
EXT_PROC_FILTER: Final = "envoy.filters.http.ext_proc"
#: Name prefix of the per-path failure-mode routes
#: (:func:`xds_server.resources.routes.failure_mode_routes`): ``failure_mode:<path>``.
FAILURE_MODE_ROUTE_PREFIX: Final = "failure_mode:"
#: Response header on replies that took a fail-open route (ext_proc failed: the request was routed by
#: Envoy on the body's ``model`` and its API key checked by Envoy, but not counted against any quota), so
#: clients and logs can tell.
FAILED_OPEN_HEADER: Final = "x-inferlb-failed-open"
#: Name of the HTTP filter (Envoy's ``envoy.filters.http.transform``) that copies the body's ``model`` into
#: ``x-inferlb-body-model`` and clears the route cache; it acts only where a route's per-filter config
#: asks it to: the fail-open paths' failure-mode routes, which a request still holds after ext_proc
#: failed open (:func:`xds_server.resources.routes.failure_mode_routes`).
BODY_MODEL_FILTER: Final = "inferlb.fail_open.body_model"
#: Name of the second ``transform`` filter, which writes the model's canonical name into the ``model`` of a
#: failed-open request that named an alias (model servers know only the canonical name); it acts only on
#: the fail-open routes of aliases (:func:`xds_server.resources.routes.canonical_model_transform`).
CANONICAL_MODEL_FILTER: Final = "inferlb.fail_open.canonical_model"
#: Name of the HTTP filter (Envoy's ``envoy.filters.http.api_key_auth`` behind a matcher that skips it when
#: ext_proc routed the request) that checks a failed-open request's API key against the tenants' keys.
API_KEY_FILTER: Final = "inferlb.fail_open.api_key"
#: ``filter_metadata`` namespace on each LbEndpoint (``{"name", "gpu"}``), read back by status tools.
METADATA_NAMESPACE: Final = "inferlb"

# -- proto helpers ---------------------------------------------------------------------------------------
_V3 = config_source_pb2.ApiVersion.V3


@dataclass(frozen=True, kw_only=True)
class XdsResources:
    """Everything one config yields, by type URL then resource name.

    Attributes:
        by_type: ``{type_url: {name: proto}}`` for the four types in :data:`PUSH_ORDER` (each present,
            possibly empty).
    """

    by_type: Mapping[str, Mapping[str, Message]]


def meter_cluster_name(process: int) -> str:
    """The access-log cluster of request-path process ``process``'s settler (0: ``ext_proc.meter_listen``,
    :data:`METER_CLUSTER`; ``i + 1``: ``extra_meter_listen[i]``, ``inferlb_meter_<i + 1>``)."""
    return METER_CLUSTER if process == 0 else f"{METER_CLUSTER}_{process}"


def json_error_body(err: RequestError) -> str:
    """``err`` as the compact JSON text of an OpenAI error body (a route's or a local reply's fixed body)."""
    return json.dumps(err.to_openai_json(), separators=(",", ":"))


def duration_ms(ms: int) -> duration_pb2.Duration:
    """A ``google.protobuf.Duration`` of ``ms`` milliseconds."""
    d = duration_pb2.Duration()
    d.FromMilliseconds(ms)
    return d


def pack(msg: Message) -> any_pb2.Any:
    """``msg`` packed into a ``google.protobuf.Any`` (typed configs, per-filter configs)."""
    a = any_pb2.Any()
    a.Pack(msg)
    return a


@functools.lru_cache(maxsize=65_536)
def is_ip(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (else a name). Cached: ``ipaddress`` parsing costs
    ~7 us and a 10,000-endpoint fleet asks for each host on every publish."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def socket_address(hp: HostPort) -> address_pb2.Address:
    """The Envoy TCP ``Address`` of ``hp``."""
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=hp.host, port_value=hp.port))


def grpc_service_address(addr: GrpcAddress) -> address_pb2.Address:
    """The Envoy ``Address`` Envoy dials one of our gRPC services at: a ``pipe`` (``path``) for a Unix
    socket, else the TCP ``socket_address``."""
    if isinstance(addr, UnixSocket):
        return address_pb2.Address(pipe=address_pb2.Pipe(path=addr.path))
    return socket_address(addr)


def ads_source() -> config_source_pb2.ConfigSource:
    """A ``ConfigSource`` naming the ADS stream (v3): where EDS clusters and the listener's RDS fetch from."""
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=_V3
    )


def ext_authz_other_mode_paths(config: Config) -> list[str]:
    """``ext_proc.protocol: ext_authz`` only: the paths of ``ext_proc.path_failure_modes`` whose mode is not
    ``ext_proc.failure_mode_allow``'s, which the second ext_authz filter
    (:data:`EXT_AUTHZ_OTHER_MODE_FILTER`) checks; empty in ext_proc mode (ext_proc's per-route config
    sets the mode itself)."""
    ep = config.ext_proc
    if ep.protocol != "ext_authz":
        return []
    return [p for p, mode in ep.path_failure_modes.items() if (mode == "open") != ep.failure_mode_allow]
