"""xds_server.resources: the gateway's downstream bounds, the upstream request's headers and the
co-located gRPC services on Unix domain sockets, as built protos."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2

from inferlb.config.schema import Config, default_config_path, parse_config
from inferlb.errors import ConfigError
from xds_server import resources as r


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _hcm(config: Config) -> http_connection_manager_pb2.HttpConnectionManager:
    listener: listener_pb2.Listener = r.build_listener(config)
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def _model_routes(config: Config) -> list[route_components_pb2.Route]:
    routes = r.build_route_configuration(config).virtual_hosts[0].routes
    return [rt for rt in routes if rt.HasField("route")]


def _route_idle_ms(config: Config) -> set[int]:
    return {rt.route.idle_timeout.ToMilliseconds() for rt in _model_routes(config)}


def test_downstream_timeouts_are_set_explicitly_with_the_documented_defaults() -> None:
    hcm = _hcm(parse_config(_doc()))
    assert hcm.HasField("request_headers_timeout")
    assert hcm.request_headers_timeout.ToMilliseconds() == 10_000
    assert hcm.stream_idle_timeout.ToMilliseconds() == 300_000
    # (num_retries 2 + 1) x per_try_timeout 300 s + 10 s on every route to a model: a non-streamed request
    # retried after two hung attempts is not cut by the client-side idle bound
    config = parse_config(_doc())
    assert all(rt.route.HasField("idle_timeout") for rt in _model_routes(config))
    assert _route_idle_ms(config) == {3 * 300_000 + 10_000}
    assert hcm.common_http_protocol_options.idle_timeout.ToMilliseconds() == 60_000
    assert hcm.HasField("request_timeout") and hcm.request_timeout.ToMilliseconds() == 0


def test_downstream_timeouts_follow_the_config() -> None:
    doc = _doc()
    doc["gateway"].update(
        request_headers_timeout_ms=2_500,
        downstream_stream_idle_timeout_ms=400_000,
        downstream_idle_timeout_ms=5_000,
        downstream_request_timeout_ms=30_000,
    )
    hcm = _hcm(parse_config(doc))
    assert hcm.request_headers_timeout.ToMilliseconds() == 2_500
    assert _route_idle_ms(parse_config(doc)) == {400_000}
    assert hcm.common_http_protocol_options.idle_timeout.ToMilliseconds() == 5_000
    assert hcm.request_timeout.ToMilliseconds() == 30_000


def test_derived_stream_idle_follows_retries_and_per_try_bounds() -> None:
    doc = _doc()
    doc["gateway"].update(num_retries=0, per_try_timeout_ms=20_000, stream_idle_timeout_ms=30_000)
    assert _route_idle_ms(parse_config(doc)) == {40_000}
    doc["gateway"].update(per_try_timeout_ms=0, stream_idle_timeout_ms=0)
    assert _route_idle_ms(parse_config(doc)) == {0}
    # a retry change reaches the routes only: the listener (whose change drains connections) stays
    assert _hcm(parse_config(doc)) == _hcm(parse_config(_doc()))


@pytest.mark.parametrize("idle", [1_000, 300_000])
def test_a_stream_idle_bound_within_one_attempt_is_refused(idle: int) -> None:
    doc = _doc()
    doc["gateway"]["downstream_stream_idle_timeout_ms"] = idle
    with pytest.raises(ConfigError, match="downstream_stream_idle_timeout_ms"):
        parse_config(doc)


def test_a_stream_idle_bound_of_zero_is_none() -> None:
    doc = _doc()
    doc["gateway"]["downstream_stream_idle_timeout_ms"] = 0
    assert _route_idle_ms(parse_config(doc)) == {0}


def test_every_route_to_a_model_rewrites_host_and_removes_internal_headers() -> None:
    doc = _doc()
    doc["ext_proc"].update(fail_open_model="qwen", failure_mode_allow=True)
    config = parse_config(doc)
    routes = _model_routes(config)
    assert routes
    names = {m.name for m in config.models}
    for rt in routes:
        assert rt.route.host_rewrite_literal in names, rt.name
        assert rt.route.host_rewrite_literal in rt.route.cluster, rt.name
        removed = set(rt.request_headers_to_remove)
        assert {"authorization", *r.STRIPPED_REQUEST_HEADERS} <= removed, rt.name
    fail_open = [rt for rt in routes if rt.name.startswith(r.FAILURE_MODE_ROUTE_PREFIX)]
    assert fail_open and {rt.route.host_rewrite_literal for rt in fail_open} == {"qwen2.5-7b-instruct"}
    by_body = [rt for rt in routes if rt.name.startswith(r.FAIL_OPEN_ROUTE_PREFIX)]
    assert {rt.route.host_rewrite_literal for rt in by_body} == names


def test_hashed_routes_keep_only_the_affinity_digests() -> None:
    doc = _doc()
    doc["models"][1].setdefault("cluster", {})["lb_policy"] = "ring_hash"
    config = parse_config(doc)
    hashed = [rt for rt in _model_routes(config) if rt.route.hash_policy]
    assert hashed
    for rt in hashed:
        kept = set(r.STRIPPED_REQUEST_HEADERS) - set(rt.request_headers_to_remove)
        assert kept == {"x-inferlb-prefix", "x-inferlb-session"}, rt.name


def test_the_router_adds_no_x_envoy_headers() -> None:
    [router] = [f for f in _hcm(parse_config(_doc())).http_filters if f.name == "envoy.filters.http.router"]
    cfg = router_pb2.Router()
    assert router.typed_config.Unpack(cfg)
    assert cfg.suppress_envoy_headers
