"""xds_server.resources: ext_proc failure modes per path, the fail-open routes (by the body's model, API
key checked by Envoy), and local replies that reach clients as OpenAI JSON (the real-Envoy side is
tests/e2e/test_extproc_failure.py and tests/e2e/test_extproc_fail_open.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.common.matching.v3 import extension_matcher_pb2
from envoy.extensions.filters.common.matcher.action.v3 import skip_action_pb2
from envoy.extensions.filters.http.api_key_auth.v3 import api_key_auth_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.transform.v3 import transform_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.type.matcher.v3 import http_inputs_pb2

from ext_proc import handlers
from inferlb.config.schema import Config, default_config_path, parse_config
from inferlb.errors import ConfigError
from inferlb.request import headers
from inferlb.request.parsing import INFERENCE_PATHS
from tests.unit.test_xds_resources import _hcm
from xds_server import resources as r
from xds_server.resources.common import EXT_AUTHZ_FILTER, EXT_AUTHZ_OTHER_MODE_FILTER


def _doc(**ext_proc: Any) -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    # the ext_proc filter's failure modes unless the caller names the protocol (ext_authz mode: two filters)
    doc["ext_proc"].update({"protocol": "ext_proc", **ext_proc})
    return doc


def _failure_routes(config: Config) -> dict[str, route_components_pb2.Route]:
    routes = list(r.build_route_configuration(config).virtual_hosts[0].routes)
    return {rt.match.path: rt for rt in routes if rt.name.startswith(r.FAILURE_MODE_ROUTE_PREFIX)}


def _allow(holder: route_components_pb2.Route | route_components_pb2.VirtualHost) -> bool:
    wrapper = route_components_pb2.FilterConfig()
    assert holder.typed_per_filter_config[r.EXT_PROC_FILTER].Unpack(wrapper)
    assert not wrapper.disabled  # enables the filter, disabled in the HCM
    per_route = ext_proc_pb2.ExtProcPerRoute()
    assert wrapper.config.Unpack(per_route)
    assert per_route.overrides.HasField("failure_mode_allow")  # explicit, never inherited
    return per_route.overrides.failure_mode_allow.value


def _error(body: str) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert isinstance(err, dict)
    return err


def test_every_inference_path_gets_an_explicit_fail_closed_route_by_default() -> None:
    config = parse_config(_doc())
    routes = list(r.build_route_configuration(config).virtual_hosts[0].routes)
    failure = _failure_routes(config)
    assert list(failure) == list(INFERENCE_PATHS)
    # after every model route (they match on ext_proc's headers first), before the catch-all
    names = [rt.name for rt in routes]
    first = names.index(f"{r.FAILURE_MODE_ROUTE_PREFIX}/v1/chat/completions")
    assert all(rt.route.cluster for rt in routes[:first])
    assert names[-1] == r.NO_ROUTE_NAME
    for path, route in failure.items():
        assert _allow(route) is False, path
        assert route.direct_response.status == 404
        assert _error(route.direct_response.body.inline_string)["code"] == "no_route"
    # the filter-level default is the global one
    ep = ext_proc_pb2.ExternalProcessor()
    assert _hcm(r.build_listener(config)).http_filters[0].typed_config.Unpack(ep)
    assert ep.failure_mode_allow is False


@pytest.mark.parametrize("allow", [False, True])
def test_ext_proc_is_off_until_the_virtual_host_enables_it(allow: bool) -> None:
    # Envoy's codec-error replies (no route yet) must skip ext_proc, or the client gets no reply at all
    config = parse_config(_doc(failure_mode_allow=allow))
    [ext_proc_filter, body_model, canonical, api_key, router] = _hcm(r.build_listener(config)).http_filters
    assert (ext_proc_filter.name, ext_proc_filter.disabled) == (r.EXT_PROC_FILTER, True)
    assert (api_key.name, api_key.disabled) == (r.API_KEY_FILTER, True)
    assert not body_model.disabled and not canonical.disabled and not router.disabled
    [vh] = r.build_route_configuration(config).virtual_hosts
    assert _allow(vh) is allow
    # the API key check is enabled only when some path fails open
    assert (r.API_KEY_FILTER in vh.typed_per_filter_config) is allow


def _transform(route: route_components_pb2.Route, name: str) -> transform_pb2.TransformConfig:
    config = transform_pb2.TransformConfig()
    assert route.typed_per_filter_config[name].Unpack(config)
    return config


def test_fail_open_paths_read_the_bodys_model_and_answer_400_without_one() -> None:
    config = parse_config(_doc(failure_mode_allow=True))
    for path, route in _failure_routes(config).items():
        assert _allow(route) is True, path
        # Envoy copies the body's model into x-inferlb-body-model and routes the request again
        transform = _transform(route, r.BODY_MODEL_FILTER)
        assert transform.clear_route_cache
        [mutation] = transform.request_transformation.headers_mutations
        assert (mutation.append.header.key, mutation.append.header.value) == (
            headers.BODY_MODEL,
            "%REQUEST_BODY(model)%",
        )
        # still on this route afterwards: the body named no model
        assert route.direct_response.status == 400
        err = _error(route.direct_response.body.inline_string)
        assert (err["type"], err["param"]) == ("invalid_request_error", "model")
        assert ("content-type", "application/json") in {
            (h.header.key, h.header.value) for h in route.response_headers_to_add
        }


def _routes(config: Config) -> list[route_components_pb2.Route]:
    return list(r.build_route_configuration(config).virtual_hosts[0].routes)


def test_fail_open_routes_go_by_the_bodys_model_or_alias_to_its_main_version() -> None:
    config = parse_config(_doc(failure_mode_allow=True))
    routes = _routes(config)
    names = [rt.name for rt in routes]
    fail_open = {rt.name: rt for rt in routes if rt.name.startswith(r.FAIL_OPEN_ROUTE_PREFIX)}
    assert set(fail_open) == {
        f"{r.FAIL_OPEN_ROUTE_PREFIX}{n}"
        for n in ("llama-3.1-8b-instruct", "llama3", "llama-3.1-8b", "qwen2.5-7b-instruct", "qwen")
    }
    # after every model route (ext_proc's headers win), before the unknown-model 404 and the path routes
    first = min(names.index(n) for n in fail_open)
    assert all(rt.route.cluster and not rt.name.startswith("fail") for rt in routes[:first])
    assert names.index(r.FAIL_OPEN_UNKNOWN_MODEL_ROUTE) == first + len(fail_open)
    assert names.index(f"{r.FAILURE_MODE_ROUTE_PREFIX}/v1/chat/completions") == first + len(fail_open) + 1
    for name, route in fail_open.items():
        body_name = name.removeprefix(r.FAIL_OPEN_ROUTE_PREFIX)
        [matcher] = route.match.headers
        assert (matcher.name, matcher.string_match.exact) == (headers.BODY_MODEL, body_name)
        assert route.match.prefix == "/"
        model = config.model_by_name()[body_name]
        assert route.route.cluster == r.main_version_cluster(model)
        assert route.route.host_rewrite_literal == model.name
        assert route.route.priority == base_pb2.RoutingPriority.DEFAULT
        assert list(route.request_headers_to_remove) == r.upstream_removed_headers(hashed=False)
        assert headers.BODY_MODEL in route.request_headers_to_remove
        assert "authorization" in route.request_headers_to_remove
        assert (r.FAILED_OPEN_HEADER, "true") in {
            (h.header.key, h.header.value) for h in route.response_headers_to_add
        }
        assert _allow(route) is True
        # an alias is replaced by the canonical name in the body; a canonical name is left alone
        if body_name == model.name:
            assert r.CANONICAL_MODEL_FILTER not in route.typed_per_filter_config
        else:
            body = _transform(route, r.CANONICAL_MODEL_FILTER).request_transformation.body_transformation
            assert body.action == transform_pb2.BodyTransformation.MERGE
            assert dict(body.body_format.json_format) == {"model": model.name}
    assert fail_open[f"{r.FAIL_OPEN_ROUTE_PREFIX}llama3"].route.cluster == "llama-3.1-8b-instruct--v1"
    unknown = routes[names.index(r.FAIL_OPEN_UNKNOWN_MODEL_ROUTE)]
    [present] = unknown.match.headers
    assert (present.name, present.present_match) == (headers.BODY_MODEL, True)
    assert unknown.direct_response.status == 404
    err = _error(unknown.direct_response.body.inline_string)
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "model_not_found", "model")


def test_without_a_fail_open_path_there_are_no_fail_open_routes() -> None:
    config = parse_config(_doc())
    assert not r.fails_open(config)
    assert r.fail_open_routes(config) == []
    for route in _failure_routes(config).values():
        assert r.BODY_MODEL_FILTER not in route.typed_per_filter_config


def test_the_virtual_host_carries_every_tenants_key_for_the_fail_open_check() -> None:
    config = parse_config(_doc(path_failure_modes={"/v1/embeddings": "open"}))
    [vh] = r.build_route_configuration(config).virtual_hosts
    wrapper = route_components_pb2.FilterConfig()
    assert vh.typed_per_filter_config[r.API_KEY_FILTER].Unpack(wrapper)
    assert not wrapper.disabled
    per_route = api_key_auth_pb2.ApiKeyAuthPerRoute()
    assert wrapper.config.Unpack(per_route)
    assert {(c.key, c.client) for c in per_route.credentials} == {
        (k, t.name) for t in config.tenants for k in t.api_keys
    }
    # the filter in the HCM: the key from Authorization, skipped when ext_proc set x-inferlb-model
    api_key = next(f for f in _hcm(r.build_listener(config)).http_filters if f.name == r.API_KEY_FILTER)
    wrapped = extension_matcher_pb2.ExtensionWithMatcher()
    assert api_key.typed_config.Unpack(wrapped)
    base = api_key_auth_pb2.ApiKeyAuth()
    assert wrapped.extension_config.typed_config.Unpack(base)
    assert [s.header for s in base.key_sources] == ["authorization"] and not base.credentials
    [field] = wrapped.xds_matcher.matcher_list.matchers
    header_input = http_inputs_pb2.HttpRequestHeaderMatchInput()
    assert field.predicate.single_predicate.input.typed_config.Unpack(header_input)
    assert header_input.header_name == headers.MODEL
    assert field.on_match.action.typed_config.Is(skip_action_pb2.SkipFilter.DESCRIPTOR)


def test_api_key_refusals_become_ext_procs_401_json() -> None:
    mappers = _mappers(parse_config(_doc(failure_mode_allow=True)))
    missing, refused = mappers[3:5]
    expected = f"response.code == 401 && response.code_details == '{r.API_KEY_MISSING_DETAILS}'"
    assert _expression(missing) == expected
    assert "'unkonwn_api_key'" in _expression(refused)  # Envoy 1.40's spelling
    for mapper in (missing, refused):
        assert not mapper.HasField("status_code")
        err = _error(mapper.body.inline_string)
        assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
    assert _error(missing.body.inline_string)["message"].startswith("You didn't provide an API key")


def test_fail_open_model_takes_failed_open_requests_whose_body_names_no_model() -> None:
    config = parse_config(
        _doc(
            path_failure_modes={
                "/v1/embeddings": "open",
                "/v1/rerank": "open",
                "/v1/chat/completions": "closed",
            },
            fail_open_model="llama-3.1-8b-instruct",
        )
    )
    failure = _failure_routes(config)
    assert list(failure) == [*INFERENCE_PATHS, "/v1/rerank"]
    assert {p for p, rt in failure.items() if _allow(rt)} == {"/v1/embeddings", "/v1/rerank"}
    open_route = failure["/v1/embeddings"]
    assert _transform(open_route, r.BODY_MODEL_FILTER).clear_route_cache  # the body's model comes first
    fallback = _transform(open_route, r.CANONICAL_MODEL_FILTER).request_transformation.body_transformation
    assert dict(fallback.body_format.json_format) == {"model": "llama-3.1-8b-instruct"}
    # v1 carries 90% of llama's traffic, the v2 canary 10%
    assert open_route.route.cluster == "llama-3.1-8b-instruct--v1" == r.fail_open_cluster(config)
    assert open_route.route.priority == base_pb2.RoutingPriority.DEFAULT
    assert open_route.route.timeout.ToMilliseconds() == config.gateway.request_timeout_ms
    assert list(open_route.request_headers_to_remove) == r.upstream_removed_headers(hashed=False)
    assert open_route.route.host_rewrite_literal == "llama-3.1-8b-instruct"
    assert (r.FAILED_OPEN_HEADER, "true") in {
        (h.header.key, h.header.value) for h in open_route.response_headers_to_add
    }
    assert failure["/v1/chat/completions"].direct_response.status == 404


def test_fail_open_model_by_alias_and_equal_shares_pick_the_first_version() -> None:
    doc = _doc(failure_mode_allow=True, fail_open_model="llama3")
    doc["models"][0]["versions"] = [
        {"name": "a", "traffic_percent": 50},
        {"name": "b", "traffic_percent": 50},
    ]
    doc["endpoints"] = [e for e in doc["endpoints"] if not e["model"].startswith("llama")]
    assert r.fail_open_cluster(parse_config(doc)) == "llama-3.1-8b-instruct--a"


@pytest.mark.parametrize(
    ("ext_proc", "field"),
    [
        ({"fail_open_model": "no-such-model"}, "ext_proc.fail_open_model"),
        ({"path_failure_modes": {"v1/embeddings": "open"}}, "ext_proc.path_failure_modes"),
        ({"path_failure_modes": {"/v1/embeddings": "sometimes"}}, "ext_proc.path_failure_modes"),
    ],
)
def test_bad_failure_policy_is_refused_with_the_field_named(ext_proc: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_doc(**ext_proc), "f.yaml")
    assert any(f.startswith(field) for f, _ in info.value.problems), info.value.problems


def _mappers(config: Config) -> list[http_connection_manager_pb2.ResponseMapper]:
    return list(_hcm(r.build_listener(config)).local_reply_config.mappers)


def _expression(mapper: http_connection_manager_pb2.ResponseMapper) -> str:
    cel = cel_pb2.ExpressionFilter()
    assert mapper.filter.extension_filter.name == r.CEL_FILTER
    assert mapper.filter.extension_filter.typed_config.Unpack(cel)
    return cel.expression


def test_ext_proc_failures_get_json_bodies_and_keep_their_status() -> None:
    config = parse_config(_doc(message_timeout_ms=750))
    timeout, failed = _mappers(config)[:2]
    assert "startsWith('ext_proc')" in _expression(timeout) and "response.code == 504" in _expression(timeout)
    assert _expression(failed) == "response.code_details.startsWith('ext_proc')"
    for mapper, code in ((timeout, "gateway_processor_timeout"), (failed, "gateway_processor_unavailable")):
        assert not mapper.HasField("status_code")  # 500 / 504 as Envoy chose
        assert mapper.body_format_override.content_type == "application/json"
        err = _error(mapper.body.inline_string)
        assert (err["type"], err["code"]) == ("server_error", code)
    assert "750 ms" in _error(timeout.body.inline_string)["message"]


def test_mappers_leave_ext_procs_own_replies_and_direct_responses_alone() -> None:
    mappers = _mappers(parse_config(_doc()))
    # ext_proc's immediate replies are told apart by their code details
    assert handlers.COUNTING_BUDGET_DETAILS.startswith(r.EXT_PROC_REPLY_DETAILS_PREFIX)
    assert not r.EXT_PROC_REPLY_DETAILS_PREFIX.startswith(r.EXT_PROC_FAILURE_DETAILS_PREFIX)
    for m in mappers:
        if m.filter.HasField("response_flag_filter"):
            continue  # UO / upstream flags: ext_proc's replies never carry them
        expr = _expression(m)
        if expr.startswith("response.code_details.startsWith('ext_proc')"):
            continue  # Envoy's own ext_proc failures
        if expr.startswith("response.code == 401 && response.code_details"):
            continue  # the fail-open API key check's own code details, never ext_proc's
        assert "!response.code_details.startsWith('inferlb_')" in expr, expr
        assert "response.code_details != 'direct_response'" in expr, expr
    # the 413 mapper is Envoy's buffer limit only: ext_proc's own 413 (counting budget) passes unchanged
    too_large = mappers[2]
    assert _expression(too_large).startswith("response.code == 413 && ")
    assert _error(too_large.body.inline_string)["code"] == "request_too_large"


def test_any_other_envoy_error_reply_becomes_json_by_class() -> None:
    mappers = _mappers(parse_config(_doc()))
    client, server = mappers[-2:]
    assert "response.code >= 400 && response.code < 500" in _expression(client)
    assert "response.code >= 500 && response.code < 600" in _expression(server)
    for mapper, kind in ((client, "invalid_request_error"), (server, "server_error")):
        fmt = mapper.body_format_override
        assert fmt.content_type == "application/json"
        err = dict(fmt.json_format["error"])
        assert err == {
            "message": "%LOCAL_REPLY_BODY%",
            "type": kind,
            "param": None,
            "code": "%RESPONSE_CODE_DETAILS%",
        }


def test_each_upstream_failure_flag_gets_a_readable_code_causes_before_the_retry_limit() -> None:
    mappers = [m for m in _mappers(parse_config(_doc())) if m.filter.HasField("response_flag_filter")]
    overflow, *upstream = mappers
    assert list(overflow.filter.response_flag_filter.flags) == [r.OVERFLOW_FLAG]
    flags = [list(m.filter.response_flag_filter.flags) for m in upstream]
    assert flags == [[f] for f, _ in r.UPSTREAM_FAILURE_CODES]
    assert {f for (f,) in flags} == {"UH", "UF", "URX", "UT", "UC", "NC", "DF"}
    assert flags[-1] == ["URX"]  # "URX,UF" reads as its cause, upstream_connect_failure
    for m, (_, code) in zip(upstream, r.UPSTREAM_FAILURE_CODES, strict=True):
        err = dict(m.body_format_override.json_format["error"])
        assert err["code"] == code and code.replace("_", "").isalpha()
        assert err["param"] is None and err["type"] == "server_error"
        assert "%RESPONSE_FLAGS%" in err["message"]  # the flags stay readable in the message


def test_extra_ext_proc_processes_get_metrics_addresses_and_their_sockets_are_checked() -> None:
    # several processes share the default tenants' limits through Redis (memory quotas are refused)
    config = parse_config(_doc(extra_listen=["127.0.0.1:18090", "127.0.0.1:18091"], quota_backend="redis"))
    derived = [str(hp) for hp in config.ext_proc.extra_metrics_addresses()]
    assert derived == ["127.0.0.1:18082", "127.0.0.1:18083"]  # metrics_listen 18081 + 1, + 2
    sockets = dict(config.listen_sockets())
    assert str(sockets["ext_proc.extra_listen[1]"]) == "127.0.0.1:18091"
    assert str(sockets["ext_proc.extra_metrics_listen[0]"]) == "127.0.0.1:18082"
    explicit = parse_config(
        _doc(
            extra_listen=["127.0.0.1:18090"], extra_metrics_listen=["127.0.0.1:19999"], quota_backend="redis"
        )
    )
    assert [str(hp) for hp in explicit.ext_proc.extra_metrics_addresses()] == ["127.0.0.1:19999"]


@pytest.mark.parametrize(
    ("ext_proc", "field"),
    [
        ({"extra_listen": ["127.0.0.1:18080"]}, "ext_proc.extra_listen[0]"),  # = ext_proc.listen
        ({"extra_listen": ["127.0.0.1:18001"]}, "ext_proc.extra_listen[0]"),  # = xds.api_listen
        (
            {
                "extra_listen": ["127.0.0.1:18090", "127.0.0.1:18091"],
                "extra_metrics_listen": ["127.0.0.1:19999"],
            },
            "ext_proc.extra_metrics_listen: 1 addresses for 2",
        ),
        (
            {"extra_listen": ["127.0.0.1:18090"], "extra_metrics_listen": ["127.0.0.1:18080"]},
            "ext_proc.extra_metrics_listen[0]",
        ),
    ],
)
def test_clashing_or_miscounted_extra_ext_proc_addresses_are_refused(
    ext_proc: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_doc(**ext_proc), "f.yaml")
    text = "; ".join(f"{f}: {m}" for f, m in info.value.problems)
    assert field in text, text


def _authz_filters(config: Config) -> dict[str, tuple[bool, ext_authz_pb2.ExtAuthz]]:
    """The listener's ext_authz filters: name -> (disabled in the HCM, config)."""
    out = {}
    for f in _hcm(r.build_listener(config)).http_filters:
        if f.typed_config.Is(ext_authz_pb2.ExtAuthz.DESCRIPTOR):
            authz = ext_authz_pb2.ExtAuthz()
            assert f.typed_config.Unpack(authz)
            out[f.name] = (f.disabled, authz)
    return out


def _authz_overrides(holder: route_components_pb2.Route | route_components_pb2.VirtualHost) -> str:
    """Which ext_authz filter ``holder`` switches to: "" (none: the listener's first filter checks), or
    "other" (the first disabled, the second enabled), asserting the shape."""
    configs = holder.typed_per_filter_config
    if EXT_AUTHZ_FILTER not in configs:
        assert EXT_AUTHZ_OTHER_MODE_FILTER not in configs
        return ""
    off, on = route_components_pb2.FilterConfig(), route_components_pb2.FilterConfig()
    assert configs[EXT_AUTHZ_FILTER].Unpack(off) and off.disabled and not off.HasField("config")
    assert configs[EXT_AUTHZ_OTHER_MODE_FILTER].Unpack(on) and not on.disabled
    per_route = ext_authz_pb2.ExtAuthzPerRoute()
    assert on.config.Unpack(per_route) and per_route.HasField("check_settings")
    return "other"


@pytest.mark.parametrize("default_open", [False, True])
def test_ext_authz_paths_of_the_other_mode_switch_to_a_second_filter_with_that_mode(
    default_open: bool,
) -> None:
    other_mode = "closed" if default_open else "open"
    config = parse_config(
        _doc(
            protocol="ext_authz",
            failure_mode_allow=default_open,
            path_failure_modes={"/v1/embeddings": other_mode, "/v1/rerank": other_mode},
        )
    )
    filters = _authz_filters(config)
    assert list(filters) == [EXT_AUTHZ_FILTER, EXT_AUTHZ_OTHER_MODE_FILTER]  # the first one asks first
    (first_off, first), (second_off, second) = filters.values()
    assert (first_off, first.failure_mode_allow, first.stat_prefix) == (False, default_open, "")
    assert (second_off, second.failure_mode_allow) == (True, not default_open)
    assert second.stat_prefix == "other_failure_mode"
    # the same check otherwise: same service, headers, body, route cache clearing, metering
    first.failure_mode_allow, first.stat_prefix = second.failure_mode_allow, second.stat_prefix
    assert first == second
    failure = _failure_routes(config)
    switched = {p for p, rt in failure.items() if _authz_overrides(rt)}
    assert switched == {"/v1/embeddings", "/v1/rerank"}
    routes = r.build_route_configuration(config).virtual_hosts[0]
    assert _authz_overrides(routes) == ""  # the virtual host: the first filter's mode
    model_routes = [
        rt
        for rt in routes.routes
        if rt.HasField("route")
        and not rt.name.startswith((r.FAILURE_MODE_ROUTE_PREFIX, r.FAIL_OPEN_ROUTE_PREFIX))
    ]
    assert model_routes and not any(_authz_overrides(rt) for rt in model_routes)


def test_ext_authz_without_a_path_of_the_other_mode_has_one_filter() -> None:
    config = parse_config(
        _doc(protocol="ext_authz", failure_mode_allow=True, path_failure_modes={"/v1/embeddings": "open"})
    )
    assert list(_authz_filters(config)) == [EXT_AUTHZ_FILTER]
    assert not any(_authz_overrides(rt) for rt in _failure_routes(config).values())
