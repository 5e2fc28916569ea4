"""The RouteConfiguration ``inferlb_routes`` (one virtual host ``*``), which the listener's HCM fetches
over RDS.

Per model version, a HIGH-priority route (``x-inferlb-priority: high``) then a DEFAULT one, both matching
``x-inferlb-model`` + ``x-inferlb-version``, each preceded by its ``--stream`` twin for streamed requests
(``x-inferlb-stream: true``: a per-try bound on the silence before the first byte and between chunks,
:func:`retry_policy`);
then one route per OpenAI inference path carrying that path's ext_proc failure mode
(:func:`failure_mode_routes`); a final catch-all answering 404 with an OpenAI-style
JSON error. Models balanced with ``ring_hash``/``maglev`` get a ``hash_policy`` on the affinity headers
ext_proc sets (:func:`affinity_hash_policy`). A model with ``cluster.length_aware`` gets two routes more per
version and confined length class, first (HIGH then DEFAULT), matching ``x-inferlb-length-class: long`` with
``metadata_match {envoy.lb: {gpu_tier: fast}}`` (two tiers), or ``long-k`` with
``{envoy.lb: {length_classes: long-k}}`` (tiered) (:mod:`inferlb.policy.length_aware`).
"""

from __future__ import annotations

import json
from typing import Final

from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.api_key_auth.v3 import api_key_auth_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.transform.v3 import transform_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import any_pb2, struct_pb2, wrappers_pb2

from inferlb.config.schema import Config, ModelConfig, cluster_name
from inferlb.errors import RequestError
from inferlb.policy.affinity import HASH_LB_POLICIES
from inferlb.policy.length_aware import ENVOY_LB_NAMESPACE, ConfinedClass, confined_classes
from inferlb.policy.routing import model_not_found, model_object_bodies, models_list_body
from inferlb.request import headers
from inferlb.request.parsing import INFERENCE_PATHS
from xds_server.resources.common import (
    API_KEY_FILTER,
    BODY_MODEL_FILTER,
    CANONICAL_MODEL_FILTER,
    EXT_AUTHZ_FILTER,
    EXT_AUTHZ_OTHER_MODE_FILTER,
    EXT_PROC_FILTER,
    FAILED_OPEN_HEADER,
    FAILURE_MODE_ROUTE_PREFIX,
    NO_ROUTE_NAME,
    ROUTE_CONFIG_NAME,
    VIRTUAL_HOST_NAME,
    duration_ms,
    json_error_body,
    pack,
)

#: Headers removed on every route to a model (``Route.request_headers_to_remove``), after ext_proc has read
#: them and the route has matched on them: the tenant's API key and the gateway's internal ``x-inferlb-*``
#: headers never reach a model server (no model server reads them: vLLM, SGLang, TGI and the simulated
#: GPUs route and count on the body alone). The affinity keys are removed too, except on routes with a
#: ``hash_policy`` (:data:`AFFINITY_HEADERS`).
UPSTREAM_REMOVED_HEADERS: Final[tuple[str, ...]] = (
    "authorization",
    headers.MODEL,
    headers.VERSION,
    headers.TENANT,
    headers.PRIORITY,
    headers.PROMPT_TOKENS,
    headers.LENGTH_CLASS,
    headers.STREAM,
    headers.BODY_MODEL,
    # Envoy's own, added with use_remote_address (the client's peer address): gateway internals
    "x-envoy-external-address",
    headers.BODY_SPLICE,
)
#: The affinity keys ext_proc sets (digests of the session and of the conversation's opening, not their
#: text). Kept on ring_hash/maglev routes, whose ``hash_policy`` reads them whenever Envoy picks a host
#: (a retry picks again, after the route's header removal); removed on every other route.
AFFINITY_HEADERS: Final[tuple[str, ...]] = (headers.PREFIX_KEY, headers.SESSION_KEY)


#: The response headers naming who served a request, set by Envoy from the upstream host it picked
#: (header formatters, Envoy docs "Custom request/response headers"): the endpoint's name and model version
#: from its EDS metadata ``inferlb`` (:func:`xds_server.resources.endpoints.build_endpoints`), and its
#: address. Set on the RouteConfiguration, so on every route; a header whose value formats empty (a direct
#: or local reply, no upstream host) is not added. A model server's own values are replaced.
SERVED_BY_HEADERS: Final[tuple[tuple[str, str], ...]] = (
    (headers.ENDPOINT, "%UPSTREAM_METADATA(inferlb:name)%"),
    (headers.MODEL_VERSION, "%UPSTREAM_METADATA(inferlb:version)%"),
    (headers.UPSTREAM_HOST, "%UPSTREAM_HOST%"),
)


def served_by_headers() -> list[base_pb2.HeaderValueOption]:
    """:data:`SERVED_BY_HEADERS` as ``response_headers_to_add`` entries (overwriting the upstream's)."""
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=name, value=value),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for name, value in SERVED_BY_HEADERS
    ]


def upstream_removed_headers(*, hashed: bool) -> list[str]:
    """The ``request_headers_to_remove`` of a route to a model: :data:`UPSTREAM_REMOVED_HEADERS`, and
    :data:`AFFINITY_HEADERS` unless the route hashes on them (``hashed``)."""
    return [*UPSTREAM_REMOVED_HEADERS, *(() if hashed else AFFINITY_HEADERS)]


#: Envoy's retry conditions for inference requests (``RetryPolicy.retry_on``, router filter docs
#: "x-envoy-retry-on"): the connection failed (``connect-failure``), the server refused or reset the stream
#: (``refused-stream``, ``reset``; a per-try timeout resets the attempt, so a hung server is retried too),
#: or it answered one of ``gateway.retry_status_codes`` (``retriable-status-codes``: 503 from a failed GPU
#: or a full queue). Envoy retries only while nothing of the response has been sent downstream: a
#: non-streamed answer is retried whole, a stream only until its 200 headers; a server that fails after
#: that (a cut stream) cannot be retried, whatever it sends.
RETRY_ON: Final = "connect-failure,refused-stream,reset,retriable-status-codes"
#: How often Envoy re-picks a host to avoid ones already tried (``host_selection_retry_max_attempts``).
HOST_SELECTION_RETRY_MAX_ATTEMPTS: Final = 3
#: Name suffix of the route of streamed requests (``x-inferlb-stream: true``), placed before its twin.
STREAM_ROUTE_SUFFIX: Final = "--stream"


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


def retry_policy(config: Config, *, stream: bool) -> route_components_pb2.RetryPolicy:
    """The ``RetryPolicy`` of a model route: :data:`RETRY_ON` with ``gateway.retry_status_codes``
    (``retriable_status_codes``), ``gateway.num_retries`` to hosts not tried yet (``previous_hosts``
    predicate, ``host_selection_retry_max_attempts``), and the per-attempt bounds.

    ``per_try_timeout`` bounds an attempt until the response headers: Envoy ignores it once the response
    has started downstream. ``per_try_idle_timeout`` bounds the silence of the attempt, from the request on
    (so the first byte too) and between chunks, and keeps running while the response streams
    (route_components.proto, ``RetryPolicy``). Either one that fires before the response started is
    retried like a reset, to another host.

    * Non-streamed (a non-streamed answer's headers come with its last byte): ``per_try_timeout`` =
      ``gateway.per_try_timeout_ms``, no idle timeout (it would have to exceed the longest generation too).
    * Streamed (``stream``): ``per_try_idle_timeout`` = ``gateway.stream_idle_timeout_ms`` and no
      ``per_try_timeout``: on Envoy 1.40 a ``per_try_timeout`` that fires after the stream started (and
      is ignored) also stops the idle timer of that attempt, so a stream that outlived it and then stalled
      was held until the client gave up (measured: tests/e2e/test_upstream_hang.py).

    0 leaves a bound unset.
    """
    gw = config.gateway
    retry = route_components_pb2.RetryPolicy(
        retry_on=RETRY_ON,
        num_retries=wrappers_pb2.UInt32Value(value=gw.num_retries),
        retry_host_predicate=[
            route_components_pb2.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=HOST_SELECTION_RETRY_MAX_ATTEMPTS,
        retriable_status_codes=list(gw.retry_status_codes),
    )
    if stream and gw.stream_idle_timeout_ms:
        retry.per_try_idle_timeout.CopyFrom(duration_ms(gw.stream_idle_timeout_ms))
    elif not stream and gw.per_try_timeout_ms:
        retry.per_try_timeout.CopyFrom(duration_ms(gw.per_try_timeout_ms))
    return retry


def _route_action(
    config: Config,
    cluster: str,
    *,
    model: str,
    high: bool,
    hashed: bool = False,
    confined: ConfinedClass | None = None,
    stream: bool = False,
) -> route_components_pb2.RouteAction:
    gw = config.gateway
    retry = retry_policy(config, stream=stream)
    return route_components_pb2.RouteAction(
        cluster=cluster,
        # HIGH has its own circuit-breaker thresholds on every cluster, so high-priority tenants keep a
        # budget when DEFAULT traffic saturates the cluster.
        priority=base_pb2.RoutingPriority.HIGH if high else base_pb2.RoutingPriority.DEFAULT,
        timeout=duration_ms(gw.request_timeout_ms),
        # the upstream Host (HTTP/1 Host, HTTP/2 :authority) is the model's canonical name, never what the
        # client sent: model servers (vLLM, SGLang, TGI) ignore it, and a proxy in front of them sees
        # which model the request is for
        host_rewrite_literal=model,
        # the client side's stream idle bound (overrides the HCM's stream_idle_timeout): longer than every
        # silence of an accepted request, all its attempts included
        idle_timeout=duration_ms(gw.downstream_stream_idle_ms()),
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


def main_version_cluster(model: ModelConfig) -> str:
    """The cluster of ``model``'s main version: the largest ``traffic_percent``, the first on a tie."""
    main = max(model.versions, key=lambda v: v.traffic_percent)  # max keeps the first of equals
    return model.cluster_name(main.name)


def fail_open_cluster(config: Config) -> str | None:
    """The cluster a failed-open request whose body names no model goes to: ``ext_proc.fail_open_model``'s
    main version (:func:`main_version_cluster`), or None when no fail-open model is configured."""
    name = config.ext_proc.fail_open_model
    if name is None:
        return None
    return main_version_cluster(config.model_by_name()[name])


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
    :func:`~xds_server.resources.listener.build_listener`) with ``failure_mode_allow`` set explicitly: a
    ``FilterConfig`` wrapping an ``ExtProcPerRoute``."""
    per_route = ext_proc_pb2.ExtProcPerRoute(
        overrides=ext_proc_pb2.ExtProcOverrides(failure_mode_allow=wrappers_pb2.BoolValue(value=fail_open))
    )
    return pack(route_components_pb2.FilterConfig(config=pack(per_route)))


def ext_proc_filter_configs(config: Config, *, fail_open: bool) -> dict[str, any_pb2.Any]:
    """A route's (or the virtual host's) ``typed_per_filter_config`` for the request path: the ext_proc
    filter enabled with ``fail_open`` (:func:`ext_proc_per_route`) with ``ext_proc.protocol: ext_proc``.
    With ``ext_authz`` nothing when ``fail_open`` is ``ext_proc.failure_mode_allow`` (the listener's
    first ext_authz filter has that mode), else that filter disabled and the second one, which has the
    other mode, enabled (:func:`ext_authz_other_mode_per_route`)."""
    if config.ext_proc.protocol == "ext_proc":
        return {EXT_PROC_FILTER: ext_proc_per_route(fail_open)}
    if fail_open == config.ext_proc.failure_mode_allow:
        return {}
    return ext_authz_other_mode_per_route()


def ext_authz_other_mode_per_route() -> dict[str, any_pb2.Any]:
    """The per-filter configs of a route whose path has the failure mode that is not
    ``ext_proc.failure_mode_allow``'s, in ext_authz mode: :data:`EXT_AUTHZ_FILTER` disabled
    (``FilterConfig.disabled``) and :data:`EXT_AUTHZ_OTHER_MODE_FILTER`, disabled in the listener, enabled
    (a ``FilterConfig`` wrapping an ``ExtAuthzPerRoute`` with empty ``check_settings``: the check as
    configured), as :func:`xds_server.resources.listener.ext_authz_filters` explains."""
    enabled = ext_authz_pb2.ExtAuthzPerRoute(check_settings=ext_authz_pb2.CheckSettings())
    return {
        EXT_AUTHZ_FILTER: pack(route_components_pb2.FilterConfig(disabled=True)),
        EXT_AUTHZ_OTHER_MODE_FILTER: pack(route_components_pb2.FilterConfig(config=pack(enabled))),
    }


#: Name prefix of the routes of failed-open requests by the body's model: ``fail_open:<name or alias>``.
FAIL_OPEN_ROUTE_PREFIX: Final = "fail_open:"
#: Name of the route that answers a failed-open request whose body names a model this gateway does not
#: serve (404 ``model_not_found``).
FAIL_OPEN_UNKNOWN_MODEL_ROUTE: Final = "fail_open_unknown_model"


def fails_open(config: Config) -> bool:
    """True when some path fails open (:func:`path_failure_modes`): the gateway then needs the fail-open
    routes and the API key check (:func:`api_key_per_route`)."""
    return any(path_failure_modes(config).values())


def no_body_model_body() -> str:
    """The JSON body of the 400 a failed-open request gets when Envoy could not read a ``model`` string from
    its body (not JSON, ``Content-Type`` not JSON, no ``model``) and no ``ext_proc.fail_open_model`` is
    configured: ext_proc's "you must provide a model parameter", with what Envoy needs to read it."""
    return json_error_body(
        RequestError(
            400,
            "you must provide a model parameter (a JSON body with Content-Type: application/json)",
            type="invalid_request_error",
            param="model",
        )
    )


def unknown_body_model_body() -> str:
    """The JSON body of the 404 a failed-open request gets when its body's ``model`` is none of the models'
    names or aliases: ext_proc's ``model_not_found`` (:func:`inferlb.policy.routing.model_not_found`),
    without the name, which a route's fixed reply cannot repeat."""
    err = model_not_found("")
    err.message = "The model named in the request does not exist or you do not have access to it."
    return json_error_body(err)


def body_model_transform() -> any_pb2.Any:
    """The per-route config of the :data:`~xds_server.resources.common.BODY_MODEL_FILTER` (Envoy's
    ``transform`` filter) on a fail-open path's failure-mode route: set ``x-inferlb-body-model`` to the
    body's ``model`` (``%REQUEST_BODY(model)%``; the body is parsed only when ``Content-Type`` contains
    ``application/json``, and a body that is not JSON or has no ``model`` leaves the header unset) and clear
    the route cache, so the router picks the request's route again, now with that header
    (:func:`fail_open_routes`)."""
    set_model = mutation_rules_pb2.HeaderMutation(
        append=base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=headers.BODY_MODEL, value="%REQUEST_BODY(model)%"),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )
    return pack(
        transform_pb2.TransformConfig(
            request_transformation=transform_pb2.Transformation(headers_mutations=[set_model]),
            clear_route_cache=True,
        )
    )


def canonical_model_transform(model: str) -> any_pb2.Any:
    """The per-route config of the :data:`~xds_server.resources.common.CANONICAL_MODEL_FILTER` on the
    fail-open route of an alias of ``model``: merge ``{"model": model}`` into the JSON body (Envoy parses
    the body into a ``Struct`` and writes it out again, so numbers come back as JSON doubles' shortest
    text and integers past 2**53 lose precision; only a failed-open request naming an alias pays this)."""
    fmt = struct_pb2.Struct()
    fmt.update({"model": model})
    return pack(
        transform_pb2.TransformConfig(
            request_transformation=transform_pb2.Transformation(
                body_transformation=transform_pb2.BodyTransformation(
                    body_format=substitution_format_string_pb2.SubstitutionFormatString(json_format=fmt),
                    action=transform_pb2.BodyTransformation.MERGE,
                )
            )
        )
    )


def api_key_per_route(config: Config) -> any_pb2.Any:
    """The virtual host's config of the :data:`~xds_server.resources.common.API_KEY_FILTER` (Envoy's
    ``api_key_auth``, disabled in the HCM): a ``FilterConfig`` that enables it, wrapping an
    ``ApiKeyAuthPerRoute`` with every tenant's keys (``credentials``: key -> tenant name; both fields are
    ``sensitive`` in Envoy's API, so ``/config_dump`` shows ``[redacted]``). With no tenant it holds no
    credentials and Envoy refuses every request that reaches it (401), as ext_proc would."""
    credentials = [
        api_key_auth_pb2.Credential(key=key, client=tenant.name)
        for tenant in config.tenants
        for key in tenant.plaintext_keys()
    ]
    per_route = api_key_auth_pb2.ApiKeyAuthPerRoute(credentials=credentials)
    return pack(route_components_pb2.FilterConfig(config=pack(per_route)))


def _failed_open_route(
    config: Config, name: str, match: route_components_pb2.RouteMatch, model: ModelConfig
) -> route_components_pb2.Route:
    """A route of failed-open requests to ``model``'s main version: DEFAULT priority, the non-streamed
    retry policy (ext_proc did not say whether the request streams), the upstream header removal of every
    model route, ``x-inferlb-failed-open: true`` on the response, and ext_proc's fail-open mode (the
    request only gets here when it failed open)."""
    hashed = model.cluster.lb_policy in HASH_LB_POLICIES
    cluster = main_version_cluster(model)
    return route_components_pb2.Route(
        name=name,
        match=match,
        route=_route_action(config, cluster, model=model.name, high=False, hashed=hashed),
        request_headers_to_remove=upstream_removed_headers(hashed=hashed),
        response_headers_to_add=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=FAILED_OPEN_HEADER, value="true"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
        typed_per_filter_config=ext_proc_filter_configs(config, fail_open=True),
    )


def fail_open_routes(config: Config) -> list[route_components_pb2.Route]:
    """The routes of requests that failed open and whose body names a model, when some path fails open
    (else none): per model, one route per name and alias matching ``x-inferlb-body-model`` exactly
    (``fail_open:<name>``, :func:`_failed_open_route` to the model's main version; an alias's route also
    has the body's ``model`` replaced by the canonical name, :func:`canonical_model_transform`); then
    :data:`FAIL_OPEN_UNKNOWN_MODEL_ROUTE`, any other value: 404 ``model_not_found`` JSON.

    They need no path match: only the fail-open paths' failure-mode routes have Envoy set that header
    (:func:`body_model_transform`), and a client's own is removed before routing.
    """
    if not fails_open(config):
        return []
    out = []
    for model in config.models:
        for name in dict.fromkeys((model.name, *model.aliases)):
            route = _failed_open_route(
                config,
                f"{FAIL_OPEN_ROUTE_PREFIX}{name}",
                route_components_pb2.RouteMatch(prefix="/", headers=[_exact(headers.BODY_MODEL, name)]),
                model,
            )
            if name != model.name:
                route.typed_per_filter_config[CANONICAL_MODEL_FILTER].CopyFrom(
                    canonical_model_transform(model.name)
                )
            out.append(route)
    out.append(
        route_components_pb2.Route(
            name=FAIL_OPEN_UNKNOWN_MODEL_ROUTE,
            match=route_components_pb2.RouteMatch(
                prefix="/",
                headers=[route_components_pb2.HeaderMatcher(name=headers.BODY_MODEL, present_match=True)],
            ),
            **_json_direct_response(404, unknown_body_model_body()),
        )
    )
    return out


def failure_mode_routes(config: Config) -> list[route_components_pb2.Route]:
    """One route per path of :func:`path_failure_modes`, matched exactly (query string excluded), each
    with an ``ExtProcPerRoute`` that sets ``failure_mode_allow`` for that path (ext_authz mode: the
    per-filter configs that pick the ext_authz filter of the path's mode, :func:`ext_proc_filter_configs`).

    Envoy's ext_proc filter reads its per-route config from the route chosen when the request arrives,
    before ext_proc has set ``x-inferlb-model`` (measured on Envoy 1.40): that is this route, never a model
    route, so the failure mode is per path, not per model. A request is still on this route after ext_proc
    only when ext_proc let it through without routing headers, i.e. it failed open. On a fail-open path the
    route then has Envoy read the body's ``model`` (:func:`body_model_transform`), which moves the request
    to a :func:`fail_open_routes` route; it reaches this route's *action* only when Envoy found no
    ``model``: it goes to :func:`fail_open_cluster` (as a failed-open request, the fail-open model's name
    merged into a JSON body by :func:`canonical_model_transform`) or, with no fail-open model, gets 400
    "you must provide a model parameter". A fail-closed path never gets there (Envoy answers 5xx
    first); its action is the same 404 as the catch-all.
    """
    fallback = config.ext_proc.fail_open_model
    out = []
    for path, fail_open in path_failure_modes(config).items():
        name = f"{FAILURE_MODE_ROUTE_PREFIX}{path}"
        match = route_components_pb2.RouteMatch(path=path)
        if not fail_open:
            out.append(
                route_components_pb2.Route(
                    name=name,
                    match=match,
                    typed_per_filter_config=ext_proc_filter_configs(config, fail_open=False),
                    **_json_direct_response(404, no_route_body()),
                )
            )
            continue
        if fallback is None:
            route = route_components_pb2.Route(
                name=name, match=match, **_json_direct_response(400, no_body_model_body())
            )
        else:
            model = config.model_by_name()[fallback]
            route = _failed_open_route(config, name, match, model)
            # the model server needs a model in the body: the fail-open model's canonical name
            route.typed_per_filter_config[CANONICAL_MODEL_FILTER].CopyFrom(
                canonical_model_transform(model.name)
            )
        route.typed_per_filter_config[BODY_MODEL_FILTER].CopyFrom(body_model_transform())
        for filter_name, value in ext_proc_filter_configs(config, fail_open=True).items():
            route.typed_per_filter_config[filter_name].CopyFrom(value)
        out.append(route)
    return out


def _stream_and_whole(
    config: Config,
    name: str,
    match: list[route_components_pb2.HeaderMatcher],
    cluster: str,
    *,
    model: str,
    high: bool,
    hashed: bool = False,
    confined: ConfinedClass | None = None,
) -> list[route_components_pb2.Route]:
    """Two routes of one model version with the same ``match``: ``<name>--stream`` (also requiring
    ``x-inferlb-stream: true``, with the stream retry policy) then ``<name>`` (non-streamed answers)."""
    return [
        route_components_pb2.Route(
            name=f"{name}{STREAM_ROUTE_SUFFIX}" if stream else name,
            match=route_components_pb2.RouteMatch(
                prefix="/", headers=[*match, _exact(headers.STREAM, "true")] if stream else match
            ),
            route=_route_action(
                config, cluster, model=model, high=high, hashed=hashed, confined=confined, stream=stream
            ),
            request_headers_to_remove=upstream_removed_headers(hashed=hashed),
        )
        for stream in (True, False)
    ]


#: Name prefix of the ``GET /v1/models`` routes of the ext_authz mode (:func:`models_routes`).
MODELS_ROUTE_PREFIX: Final = "models:"


def models_routes(config: Config) -> list[route_components_pb2.Route]:
    """``ext_proc.protocol: ext_authz`` only: direct responses for ``GET /v1/models`` and
    ``GET /v1/models/{name or alias}`` (200, the JSON :func:`inferlb.policy.routing.models_list_body` and
    :func:`~inferlb.policy.routing.model_object_bodies` build, the bodies ext_proc answers with). An
    authorization service cannot answer 200 itself (200 lets the request through), so the service checks
    the key and the model, refuses what ext_proc would (401, 404, 405), and lets the rest reach these.
    Empty in ext_proc mode (ext_proc answers them)."""
    if config.ext_proc.protocol != "ext_authz":
        return []
    get = [
        route_components_pb2.HeaderMatcher(name=":method", string_match=string_pb2.StringMatcher(exact="GET"))
    ]
    bodies = {"/v1/models": models_list_body(config)}
    bodies.update({f"/v1/models/{name}": body for name, body in model_object_bodies(config).items()})
    return [
        route_components_pb2.Route(
            name=f"{MODELS_ROUTE_PREFIX}{path}",
            match=route_components_pb2.RouteMatch(path=path, headers=get),
            **_json_direct_response(200, body.decode()),
        )
        for path, body in bodies.items()
    ]


def build_route_configuration(config: Config) -> route_pb2.RouteConfiguration:
    """RouteConfiguration ``inferlb_routes`` (one virtual host ``*``).

    Routes are matched in order: per model version the HIGH variant (also requiring
    ``x-inferlb-priority: high``) precedes the DEFAULT one; a length-aware model's variants for each
    confined length class, longest first (``x-inferlb-length-class: long``, to the fast subset,
    ``<cluster>--long-high`` and ``<cluster>--long``; tiered: ``long-k``, ``<cluster>--long-k-high`` and
    ``<cluster>--long-k``) precede both; each of these comes as a pair, its ``--stream`` twin for
    streamed requests first (:func:`retry_policy`); then the per-path failure-mode routes
    (:func:`failure_mode_routes`, which ext_proc never saw: the non-streamed policy); the catch-all 404
    comes last.
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
                    routes += _stream_and_whole(
                        config,
                        f"{cluster}{suffix}",
                        match,
                        cluster,
                        model=model.name,
                        high=high,
                        confined=confined,
                    )
            routes += _stream_and_whole(
                config,
                f"{cluster}--high",
                [*base, _exact(headers.PRIORITY, "high")],
                cluster,
                model=model.name,
                high=True,
                hashed=hashed,
            )
            routes += _stream_and_whole(
                config, cluster, base, cluster, model=model.name, high=False, hashed=hashed
            )
    routes += fail_open_routes(config)
    routes += models_routes(config)
    routes += failure_mode_routes(config)
    routes.append(
        route_components_pb2.Route(
            name=NO_ROUTE_NAME,
            match=route_components_pb2.RouteMatch(prefix="/"),
            **_json_direct_response(404, no_route_body()),
        )
    )
    # enables ext_proc for every route (the failure-mode routes override it per path; the first ext_authz
    # filter is enabled in the listener itself, the failure-mode routes of the other mode switch to the
    # second), and the fail-open API key check when some path fails open
    per_filter = ext_proc_filter_configs(config, fail_open=config.ext_proc.failure_mode_allow)
    if fails_open(config):
        per_filter[API_KEY_FILTER] = api_key_per_route(config)
    return route_pb2.RouteConfiguration(
        name=ROUTE_CONFIG_NAME,
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name=VIRTUAL_HOST_NAME, domains=["*"], routes=routes, typed_per_filter_config=per_filter
            )
        ],
        response_headers_to_add=served_by_headers(),
    )
