"""Pure functions turning an :class:`inferlb.config.schema.Config` into Envoy v3 xDS resources (xds-protos).

Nothing here does I/O: a config goes in, protos come out, so every resource can be checked in unit tests and
the same config always yields byte-identical resources (the snapshot cache relies on that to keep a type's
version when nothing in it changed). Resource names are stable; the bootstrap and ``inferlb status`` rely
on them.

One module per Envoy resource, each importing only the ones before it:

- :mod:`xds_server.resources.common`: the type URLs and :data:`PUSH_ORDER`, the resource names,
  :class:`XdsResources`, and the proto helpers the others share (durations, ``Any`` packing, addresses,
  the ADS config source).
- :mod:`xds_server.resources.transport_sockets`: the TLS transport sockets (the gateway listener's
  ``DownstreamTlsContext``, the ``UpstreamTlsContext`` of the clusters that dial inferlb's services) and
  Envoy's SDS files they read the certificate files through.
- :mod:`xds_server.resources.endpoints`: one ClusterLoadAssignment per model-version cluster; endpoint
  keys, :class:`EndpointOverride`, the :class:`LbEndpointCache` memo, locality priorities, the endpoint
  address check.
- :mod:`xds_server.resources.clusters`: one EDS Cluster per model version (LB policy, outlier detection,
  circuit breakers, health checks, slow start, length-aware subsets) and the ``inferlb_ext_proc`` cluster.
- :mod:`xds_server.resources.listener`: the Listener ``inferlb_gateway`` with its HTTP connection manager,
  HTTP filters (early header mutation, ext_proc, router) and local replies.
- :mod:`xds_server.resources.routes`: the RouteConfiguration ``inferlb_routes`` (it reuses one of the
  listener's JSON error bodies).
- :mod:`xds_server.resources.build`: :func:`build_resources`, the whole set of a config.

This ``__init__`` re-exports the public API of those modules (``__all__``), so callers outside
``xds_server`` (tests, bench) keep ``from xds_server import resources as r``; the modules of
``xds_server`` import from the defining submodule. The shared proto helpers of
:mod:`~xds_server.resources.common` are not re-exported.
"""

from xds_server.resources.build import build_resources
from xds_server.resources.clusters import (
    EXT_PROC_CONNECT_TIMEOUT_MS,
    EXT_PROC_MAX_REQUESTS,
    build_clusters,
    build_ext_proc_cluster,
    build_model_cluster,
    length_aware_subsets,
)
from xds_server.resources.common import (
    API_KEY_FILTER,
    BODY_MODEL_FILTER,
    CANONICAL_MODEL_FILTER,
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    EXT_PROC_CLUSTER,
    EXT_PROC_FILTER,
    FAILED_OPEN_HEADER,
    FAILURE_MODE_ROUTE_PREFIX,
    LISTENER_NAME,
    LISTENER_TYPE,
    METADATA_NAMESPACE,
    NO_ROUTE_NAME,
    PUSH_ORDER,
    ROUTE_CONFIG_NAME,
    ROUTE_TYPE,
    VIRTUAL_HOST_NAME,
    XdsResources,
)
from xds_server.resources.endpoints import (
    MAX_LOCALITY_WEIGHT,
    EndpointOverride,
    LbEndpointCache,
    build_load_assignment,
    build_load_assignments,
    check_endpoint_addresses,
    endpoint_key,
    locality_priority,
)
from xds_server.resources.listener import (
    API_KEY_MISSING_DETAILS,
    API_KEY_REFUSED_DETAILS,
    CEL_FILTER,
    EARLY_HEADER_MUTATION,
    ENVOY_CONTROL_HEADERS,
    EXT_PROC_FAILURE_DETAILS_PREFIX,
    EXT_PROC_REPLY_DETAILS_PREFIX,
    OVERFLOW_FLAG,
    REPLACED_CLIENT_HEADERS,
    STRIPPED_REQUEST_HEADERS,
    UPSTREAM_FAILURE_CODES,
    body_too_large_body,
    build_listener,
    build_local_reply_config,
    fail_open_filters,
    missing_api_key_body,
    overflow_body,
    processor_timeout_body,
    processor_unavailable_body,
    unknown_api_key_body,
)
from xds_server.resources.routes import (
    FAIL_OPEN_ROUTE_PREFIX,
    FAIL_OPEN_UNKNOWN_MODEL_ROUTE,
    HOST_SELECTION_RETRY_MAX_ATTEMPTS,
    RETRY_ON,
    STREAM_ROUTE_SUFFIX,
    UPSTREAM_REMOVED_HEADERS,
    affinity_hash_policy,
    api_key_per_route,
    body_model_transform,
    build_route_configuration,
    canonical_model_transform,
    class_match,
    ext_proc_per_route,
    fail_open_cluster,
    fail_open_routes,
    fails_open,
    failure_mode_routes,
    main_version_cluster,
    no_body_model_body,
    no_route_body,
    path_failure_modes,
    retry_policy,
    unknown_body_model_body,
    upstream_removed_headers,
)

__all__ = [
    "API_KEY_FILTER",
    "API_KEY_MISSING_DETAILS",
    "API_KEY_REFUSED_DETAILS",
    "BODY_MODEL_FILTER",
    "CANONICAL_MODEL_FILTER",
    "CEL_FILTER",
    "CLUSTER_TYPE",
    "EARLY_HEADER_MUTATION",
    "ENDPOINT_TYPE",
    "ENVOY_CONTROL_HEADERS",
    "EXT_PROC_CLUSTER",
    "EXT_PROC_CONNECT_TIMEOUT_MS",
    "EXT_PROC_FAILURE_DETAILS_PREFIX",
    "EXT_PROC_FILTER",
    "EXT_PROC_MAX_REQUESTS",
    "EXT_PROC_REPLY_DETAILS_PREFIX",
    "FAILED_OPEN_HEADER",
    "FAILURE_MODE_ROUTE_PREFIX",
    "FAIL_OPEN_ROUTE_PREFIX",
    "FAIL_OPEN_UNKNOWN_MODEL_ROUTE",
    "HOST_SELECTION_RETRY_MAX_ATTEMPTS",
    "LISTENER_NAME",
    "LISTENER_TYPE",
    "MAX_LOCALITY_WEIGHT",
    "METADATA_NAMESPACE",
    "NO_ROUTE_NAME",
    "OVERFLOW_FLAG",
    "PUSH_ORDER",
    "REPLACED_CLIENT_HEADERS",
    "RETRY_ON",
    "ROUTE_CONFIG_NAME",
    "ROUTE_TYPE",
    "STREAM_ROUTE_SUFFIX",
    "STRIPPED_REQUEST_HEADERS",
    "UPSTREAM_FAILURE_CODES",
    "UPSTREAM_REMOVED_HEADERS",
    "VIRTUAL_HOST_NAME",
    "EndpointOverride",
    "LbEndpointCache",
    "XdsResources",
    "affinity_hash_policy",
    "api_key_per_route",
    "body_model_transform",
    "body_too_large_body",
    "build_clusters",
    "build_ext_proc_cluster",
    "build_listener",
    "build_load_assignment",
    "build_load_assignments",
    "build_local_reply_config",
    "build_model_cluster",
    "build_resources",
    "build_route_configuration",
    "canonical_model_transform",
    "check_endpoint_addresses",
    "class_match",
    "endpoint_key",
    "ext_proc_per_route",
    "fail_open_cluster",
    "fail_open_filters",
    "fail_open_routes",
    "fails_open",
    "failure_mode_routes",
    "length_aware_subsets",
    "locality_priority",
    "main_version_cluster",
    "missing_api_key_body",
    "no_body_model_body",
    "no_route_body",
    "overflow_body",
    "path_failure_modes",
    "processor_timeout_body",
    "processor_unavailable_body",
    "retry_policy",
    "unknown_api_key_body",
    "unknown_body_model_body",
    "upstream_removed_headers",
]
