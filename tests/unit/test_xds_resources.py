"""xds_server.resources: the Envoy protos built from a config."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.config.schema import Config, cluster_name, default_config_path, load_config, parse_config
from inferlb.errors import ConfigError
from inferlb.request import headers
from xds_server import resources as r
from xds_server.cache import SnapshotCache
from xds_server.resources.common import (
    EXT_AUTHZ_CLUSTER,
    EXT_AUTHZ_FILTER,
    EXT_PROC_FILTER,
    LUA_FILTER,
    METER_CLUSTER,
    METER_LUA_FILTER,
)


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(default_config_path())


def _default_doc() -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _in_protocol(protocol: str) -> Config:
    """The default config with ``ext_proc.protocol`` set to ``protocol``."""
    doc = _default_doc()
    doc["ext_proc"]["protocol"] = protocol
    return parse_config(doc)


#: Each request-path protocol's own clusters and the HTTP filters it puts before the fail-open ones.
REQUEST_PATH = {
    "ext_proc": ({r.EXT_PROC_CLUSTER}, [EXT_PROC_FILTER]),
    "ext_authz": ({EXT_AUTHZ_CLUSTER, METER_CLUSTER}, [EXT_AUTHZ_FILTER, LUA_FILTER, METER_LUA_FILTER]),
}


def _hcm(listener: listener_pb2.Listener) -> http_connection_manager_pb2.HttpConnectionManager:
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


@pytest.mark.parametrize("protocol", sorted(REQUEST_PATH))
def test_one_eds_cluster_per_model_version_plus_the_request_paths(protocol: str) -> None:
    config = _in_protocol(protocol)
    clusters = {c.name: c for c in r.build_clusters(config)}
    expected = {m.cluster_name(v.name) for m in config.models for v in m.versions}
    assert expected == {"llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1"}
    assert set(clusters) == expected | REQUEST_PATH[protocol][0]
    for name in expected:
        c = clusters[name]
        assert c.type == cluster_pb2.Cluster.EDS
        assert c.eds_cluster_config.eds_config.HasField("ads")
        assert c.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST


def test_model_cluster_sets_every_resilience_knob_from_config(config: Config) -> None:
    model = config.models[0]
    policy = model.cluster
    c = next(c for c in r.build_clusters(config) if c.name == model.cluster_name("v1"))
    od = policy.outlier_detection
    assert c.connect_timeout.ToMilliseconds() == policy.connect_timeout_ms
    assert c.common_lb_config.healthy_panic_threshold.value == policy.healthy_panic_threshold == 25
    assert c.least_request_lb_config.active_request_bias.default_value == policy.active_request_bias
    assert c.outlier_detection.consecutive_5xx.value == od.consecutive_5xx
    assert c.outlier_detection.consecutive_gateway_failure.value == od.consecutive_gateway_failure
    assert (
        c.outlier_detection.enforcing_consecutive_gateway_failure.value
        == od.enforcing_consecutive_gateway_failure
    )
    assert c.outlier_detection.interval.ToMilliseconds() == od.interval_ms
    assert c.outlier_detection.base_ejection_time.ToMilliseconds() == od.base_ejection_time_ms
    assert c.outlier_detection.max_ejection_percent.value == od.max_ejection_percent
    by_priority = {t.priority: t for t in c.circuit_breakers.thresholds}
    assert set(by_priority) == {base_pb2.RoutingPriority.DEFAULT, base_pb2.RoutingPriority.HIGH}
    for prio, cb in (
        (base_pb2.RoutingPriority.DEFAULT, policy.circuit_breaker_default),
        (base_pb2.RoutingPriority.HIGH, policy.circuit_breaker_high),
    ):
        t = by_priority[prio]
        assert (
            t.max_connections.value,
            t.max_pending_requests.value,
            t.max_requests.value,
            t.max_retries.value,
        ) == (
            cb.max_connections,
            cb.max_pending_requests,
            cb.max_requests,
            cb.max_retries,
        )


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("least_request", cluster_pb2.Cluster.LEAST_REQUEST),
        ("round_robin", cluster_pb2.Cluster.ROUND_ROBIN),
        ("ring_hash", cluster_pb2.Cluster.RING_HASH),
        ("maglev", cluster_pb2.Cluster.MAGLEV),
    ],
)
def test_lb_policy_from_config(policy: str, expected: int) -> None:
    doc = _default_doc()
    doc["models"][1]["cluster"] = {"lb_policy": policy, "active_request_bias": 1.5}
    cfg = parse_config(doc)
    c = next(c for c in r.build_clusters(cfg) if c.name == "qwen2.5-7b-instruct--v1")
    assert c.lb_policy == expected
    # the least-request knob only exists (and is only sent) for least request
    assert c.HasField("least_request_lb_config") == (policy == "least_request")
    if policy == "least_request":
        assert c.least_request_lb_config.active_request_bias.default_value == 1.5


def test_ext_proc_cluster_is_static_http2() -> None:
    config = _in_protocol("ext_proc")
    c = next(c for c in r.build_clusters(config) if c.name == r.EXT_PROC_CLUSTER)
    assert c.type == cluster_pb2.Cluster.STATIC
    opts = http_protocol_options_pb2.HttpProtocolOptions()
    assert c.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].Unpack(opts)
    assert opts.explicit_http_config.HasField("http2_protocol_options")
    sa = c.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (sa.address, sa.port_value) == (config.ext_proc.listen.host, config.ext_proc.listen.port)


def _weights_by_name(cla: endpoint_pb2.ClusterLoadAssignment) -> dict[str, tuple[str, int]]:
    out = {}
    for loc in cla.endpoints:
        for lb in loc.lb_endpoints:
            meta = lb.metadata.filter_metadata[r.METADATA_NAMESPACE]
            out[meta["name"]] = (meta["gpu"], lb.load_balancing_weight.value)
    return out


def test_endpoint_weights_follow_gpu_capacity(config: Config) -> None:
    clas = {a.cluster_name: a for a in r.build_load_assignments(config)}
    assert _weights_by_name(clas["llama-3.1-8b-instruct--v1"]) == {
        "h100-0": ("H100", 34),
        "a100-0": ("A100", 17),
        "a100-1": ("A100", 17),
        "v100-0": ("V100", 10),
    }
    assert _weights_by_name(clas["llama-3.1-8b-instruct--v2"]) == {"a100-2": ("A100", 17)}
    assert _weights_by_name(clas["qwen2.5-7b-instruct--v1"]) == {
        "h100-1": ("H100", 34),
        "v100-1": ("V100", 10),
        "v100-2": ("V100", 10),
    }


def test_endpoints_grouped_by_region_and_zone(config: Config) -> None:
    cla = next(a for a in r.build_load_assignments(config) if a.cluster_name == "llama-3.1-8b-instruct--v1")
    groups = {
        (loc.locality.region, loc.locality.zone): sorted(lb.endpoint.hostname for lb in loc.lb_endpoints)
        for loc in cla.endpoints
    }
    assert groups == {("local", "a"): ["a100-0", "h100-0"], ("local", "b"): ["a100-1", "v100-0"]}


def test_empty_pool_yields_an_empty_assignment() -> None:
    doc = _default_doc()
    doc["endpoints"] = [e for e in doc["endpoints"] if e["model"] != "qwen2.5-7b-instruct"]
    res = r.build_resources(parse_config(doc))
    cla = res.by_type[r.ENDPOINT_TYPE]["qwen2.5-7b-instruct--v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    assert cla.cluster_name == "qwen2.5-7b-instruct--v1"
    assert len(cla.endpoints) == 0
    # and the snapshot holding it passes the consistency check
    SnapshotCache().set_resources(res)


@pytest.mark.parametrize("protocol", sorted(REQUEST_PATH))
def test_listener_buffer_limit_and_filter_chain(protocol: str) -> None:
    config = _in_protocol(protocol)
    listener = r.build_listener(config)
    assert listener.name == r.LISTENER_NAME
    sa = listener.address.socket_address
    assert (sa.address, sa.port_value) == (config.gateway.listen.host, config.gateway.listen.port)
    assert listener.per_connection_buffer_limit_bytes.value == config.gateway.max_request_body_bytes
    hcm = _hcm(listener)
    assert hcm.stat_prefix == r.LISTENER_NAME
    assert hcm.rds.route_config_name == r.ROUTE_CONFIG_NAME
    assert hcm.rds.config_source.HasField("ads")
    assert [f.name for f in hcm.http_filters] == [
        *REQUEST_PATH[protocol][1],
        r.BODY_MODEL_FILTER,
        r.CANONICAL_MODEL_FILTER,
        r.API_KEY_FILTER,
        "envoy.filters.http.router",
    ]
    # client-sent routing headers are removed before routing
    [early] = hcm.early_header_mutation_extensions
    assert early.name == r.EARLY_HEADER_MUTATION
    mutation = header_mutation_pb2.HeaderMutation()
    assert early.typed_config.Unpack(mutation)
    # every x-inferlb-* and every client-sent x-envoy-* name, by prefix
    matched = [m.remove_on_match for m in mutation.mutations if m.HasField("remove_on_match")]
    by_prefix = [m.key_matcher.prefix for m in matched]
    assert by_prefix == [headers.PREFIX, "x-envoy-"]
    assert {m.remove for m in mutation.mutations if m.remove} == {
        "x-forwarded-for",  # Envoy's own (use_remote_address) replaces it
        headers.DESTINATION_ENDPOINT,  # only the request path picks endpoints
    }
    removed = {
        headers.MODEL,
        headers.VERSION,
        headers.TENANT,
        headers.PRIORITY,
        headers.PROMPT_TOKENS,
        headers.SESSION_KEY,
        headers.PREFIX_KEY,
        headers.LENGTH_CLASS,
        headers.STREAM,
        headers.BODY_MODEL,  # set by Envoy itself on the fail-open path only
        *r.ENVOY_CONTROL_HEADERS,  # a local (internal) client would set its own timeout and retries
    }
    assert all(name.startswith(tuple(by_prefix)) for name in removed), removed
    assert {"x-envoy-upstream-rq-timeout-ms", "x-envoy-max-retries", "x-envoy-retry-on"} <= set(
        r.ENVOY_CONTROL_HEADERS
    )


def test_ext_proc_filter_settings() -> None:
    doc = _default_doc()
    doc["ext_proc"] = {
        "protocol": "ext_proc",
        "listen": "127.0.0.1:18080",
        "message_timeout_ms": 7000,
        "failure_mode_allow": True,
        "account_responses": False,
    }
    hcm = _hcm(r.build_listener(parse_config(doc)))
    ep = ext_proc_pb2.ExternalProcessor()
    assert hcm.http_filters[0].typed_config.Unpack(ep)
    assert ep.grpc_service.envoy_grpc.cluster_name == r.EXT_PROC_CLUSTER
    pm = ep.processing_mode
    mode = processing_mode_pb2.ProcessingMode
    assert (pm.request_header_mode, pm.request_body_mode) == (mode.SEND, mode.BUFFERED)
    assert (pm.response_header_mode, pm.response_body_mode) == (mode.SKIP, mode.NONE)
    assert list(ep.response_attributes) == []
    assert ep.message_timeout.ToMilliseconds() == 7000
    assert ep.failure_mode_allow is True
    # ext_proc's mode_override answers (fewer messages for let-through requests, non-2xx and small JSON
    # responses)
    assert ep.allow_mode_override is True
    # ext_proc meters responses (quota settled with the real usage), the default: Envoy sends it the
    # response headers (an empty-bodied error would otherwise never be seen) and streams it the body
    del doc["ext_proc"]["account_responses"]
    metered = ext_proc_pb2.ExternalProcessor()
    assert _hcm(r.build_listener(parse_config(doc))).http_filters[0].typed_config.Unpack(metered)
    pm = metered.processing_mode
    assert (pm.response_header_mode, pm.response_body_mode) == (mode.SEND, mode.STREAMED)
    assert list(metered.response_attributes) == []


def test_routes_per_version_with_high_priority_variant_first(config: Config) -> None:
    rc = r.build_route_configuration(config)
    assert rc.name == r.ROUTE_CONFIG_NAME
    [vh] = rc.virtual_hosts
    assert list(vh.domains) == ["*"]
    routes = list(vh.routes)
    model_routes = [rt for rt in routes if rt.route.cluster and not rt.name.startswith("failure_mode:")]
    assert routes[: len(model_routes)] == model_routes  # model routes come first
    assert len(model_routes) == 2 * 2 * 3  # (streamed, non-streamed) x (high, default) x 3 versions
    # each route's streamed twin comes first (tests/unit/test_xds_resources_resilience.py checks them)
    streamed, whole = model_routes[::2], model_routes[1::2]
    assert [rt.name for rt in streamed] == [f"{rt.name}{r.STREAM_ROUTE_SUFFIX}" for rt in whole]
    for high, default in zip(whole[::2], whole[1::2], strict=True):
        assert high.route.cluster == default.route.cluster
        assert high.route.priority == base_pb2.RoutingPriority.HIGH
        assert default.route.priority == base_pb2.RoutingPriority.DEFAULT
        hm = {h.name: h.string_match.exact for h in high.match.headers}
        dm = {h.name: h.string_match.exact for h in default.match.headers}
        assert hm == {**dm, headers.PRIORITY: "high"}
        assert high.route.cluster == cluster_name(dm[headers.MODEL], dm[headers.VERSION])
        for route in (high, default):
            assert route.match.prefix == "/"
            assert route.route.timeout.ToMilliseconds() == config.gateway.request_timeout_ms
            rp = route.route.retry_policy
            assert rp.retry_on == "connect-failure,refused-stream,reset,retriable-status-codes"
            assert list(rp.retriable_status_codes) == [503]
            assert rp.num_retries.value == config.gateway.num_retries
            assert [p.name for p in rp.retry_host_predicate] == ["envoy.retry_host_predicates.previous_hosts"]
            assert rp.host_selection_retry_max_attempts == 3


def test_catch_all_route_answers_openai_404(config: Config) -> None:
    last = r.build_route_configuration(config).virtual_hosts[0].routes[-1]
    assert last.match.prefix == "/"
    assert len(last.match.headers) == 0
    assert last.direct_response.status == 404
    body = json.loads(last.direct_response.body.inline_string)
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "no_route"
    assert body["error"]["param"] is None
    assert body["error"]["message"]
    assert {(h.header.key, h.header.value) for h in last.response_headers_to_add} == {
        ("content-type", "application/json")
    }


def test_endpoint_host_name_is_refused_with_the_field_named() -> None:
    doc = _default_doc()
    doc["endpoints"][2]["address"] = "gpu-box.internal:8003"
    with pytest.raises(ConfigError) as err:
        r.build_resources(parse_config(doc), "fleet.yaml")
    assert err.value.source == "fleet.yaml"
    assert [f for f, _ in err.value.problems] == ["endpoints[2].address"]


def test_endpoint_host_name_resolved_at_the_edge_is_sent_as_its_ip() -> None:
    doc = _default_doc()
    doc["endpoints"][2]["address"] = "gpusim:8003"
    res = r.build_resources(parse_config(doc), "fleet.yaml", resolved_hosts={"gpusim": "10.1.2.3"})
    cla = res.by_type[r.ENDPOINT_TYPE]["llama-3.1-8b-instruct--v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    by_name = {lb.endpoint.hostname: lb for loc in cla.endpoints for lb in loc.lb_endpoints}
    sa = by_name["a100-1"].endpoint.address.socket_address
    assert (sa.address, sa.port_value) == ("10.1.2.3", 8003)
    # a map that lacks the name is refused the same way as no map
    with pytest.raises(ConfigError) as err:
        r.build_resources(parse_config(doc), "fleet.yaml", resolved_hosts={"other": "10.0.0.1"})
    assert [f for f, _ in err.value.problems] == ["endpoints[2].address"]


def test_endpoint_overrides_set_weight_and_draining(config: Config) -> None:
    key = r.endpoint_key(config.endpoints[0])
    res = r.build_resources(config, overrides={key: r.EndpointOverride(weight=77, draining=True)})
    cla = res.by_type[r.ENDPOINT_TYPE]["llama-3.1-8b-instruct--v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    by_name = {lb.endpoint.hostname: lb for loc in cla.endpoints for lb in loc.lb_endpoints}
    assert by_name["h100-0"].load_balancing_weight.value == 77
    assert by_name["h100-0"].health_status == health_check_pb2.HealthStatus.DRAINING
    assert by_name["a100-0"].load_balancing_weight.value == 17
    assert by_name["a100-0"].health_status == health_check_pb2.HealthStatus.UNKNOWN


def test_same_config_gives_byte_identical_resources(config: Config) -> None:
    a, b = r.build_resources(config), r.build_resources(config)
    for t in r.PUSH_ORDER:
        assert {n: m.SerializeToString(deterministic=True) for n, m in a.by_type[t].items()} == {
            n: m.SerializeToString(deterministic=True) for n, m in b.by_type[t].items()
        }


@settings(max_examples=40, deadline=None)
@given(capacities=st.lists(st.floats(min_value=0.001, max_value=100.0), min_size=3, max_size=3))
def test_any_capacity_gives_weights_of_at_least_one(capacities: list[float]) -> None:
    doc = _default_doc()
    doc["gpu_profiles"] = {
        gpu: {"relative_capacity": cap} for gpu, cap in zip(("V100", "A100", "H100"), capacities, strict=True)
    }
    res = r.build_resources(parse_config(doc))
    weights = [
        lb.load_balancing_weight.value
        for cla in res.by_type[r.ENDPOINT_TYPE].values()
        for loc in cla.endpoints  # type: ignore[attr-defined]
        for lb in loc.lb_endpoints
    ]
    assert len(weights) == 8
    assert min(weights) >= 1
    SnapshotCache().set_resources(res)  # passes the consistency check


def test_resources_by_type_cover_the_push_order(config: Config) -> None:
    res = r.build_resources(config)
    assert list(res.by_type) == list(r.PUSH_ORDER)
    assert list(res.by_type[r.LISTENER_TYPE]) == [r.LISTENER_NAME]
    assert list(res.by_type[r.ROUTE_TYPE]) == [r.ROUTE_CONFIG_NAME]
    assert isinstance(res.by_type[r.ROUTE_TYPE][r.ROUTE_CONFIG_NAME], route_pb2.RouteConfiguration)


def _fleet_doc(**cluster: Any) -> dict[str, Any]:
    doc = _default_doc()
    doc["gateway"].update(region="eu", zone="a")
    doc["models"][1]["cluster"] = cluster
    qwen = [e for e in doc["endpoints"] if e["model"] == "qwen2.5-7b-instruct"]
    for e, (region, zone) in zip(qwen, [("eu", "a"), ("eu", "b"), ("us", "a")], strict=True):
        e.update(region=region, zone=zone)
    return doc


def _qwen(doc: dict[str, Any]) -> tuple[cluster_pb2.Cluster, endpoint_pb2.ClusterLoadAssignment]:
    res = r.build_resources(parse_config(doc))
    c, cla = (
        res.by_type[r.CLUSTER_TYPE]["qwen2.5-7b-instruct--v1"],
        res.by_type[r.ENDPOINT_TYPE]["qwen2.5-7b-instruct--v1"],
    )
    assert isinstance(c, cluster_pb2.Cluster) and isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    return c, cla


def test_zone_failover_priorities_and_locality_weights() -> None:
    doc = _fleet_doc(
        failover="zone", locality_weighted=True, locality_weights={"eu/b": 7}, overprovisioning_factor=120
    )
    cluster, cla = _qwen(doc)
    assert cluster.common_lb_config.HasField("locality_weighted_lb_config")
    got = {
        (loc.locality.region, loc.locality.zone): (loc.priority, loc.load_balancing_weight.value)
        for loc in cla.endpoints
    }
    # own zone first (H100: 34), the region's other zone next (pinned to 7), then the other region
    assert got == {("eu", "a"): (0, 34), ("eu", "b"): (1, 7), ("us", "a"): (2, 10)}
    assert cla.policy.overprovisioning_factor.value == 120
    # region failover: both eu zones are priority 0
    _, by_region = _qwen(_fleet_doc(failover="region"))
    assert sorted((loc.locality.region, loc.priority) for loc in by_region.endpoints) == [
        ("eu", 0),
        ("eu", 0),
        ("us", 1),
    ]
    assert all(not loc.HasField("load_balancing_weight") for loc in by_region.endpoints)


def test_priorities_stay_contiguous_when_the_own_zone_has_no_gpus() -> None:
    doc = _fleet_doc(failover="zone")
    doc["gateway"].update(region="eu", zone="c")  # no qwen GPU in eu/c
    _, cla = _qwen(doc)
    assert sorted(loc.priority for loc in cla.endpoints) == [0, 0, 1]


def test_health_check_slow_start_and_failure_percentage() -> None:
    doc = _fleet_doc(
        health_check={"path": "/health", "interval_ms": 2000, "unhealthy_threshold": 3},
        slow_start_window_ms=30_000,
        slow_start_aggression=2.0,
        outlier_detection={"enforcing_failure_percentage": 100, "failure_percentage_threshold": 60},
    )
    cluster, _ = _qwen(doc)
    (hc,) = cluster.health_checks
    assert hc.http_health_check.path == "/health"
    assert hc.interval.ToMilliseconds() == 2000 and hc.unhealthy_threshold.value == 3
    slow = cluster.least_request_lb_config.slow_start_config
    assert slow.slow_start_window.ToMilliseconds() == 30_000 and slow.aggression.default_value == 2.0
    assert cluster.outlier_detection.enforcing_failure_percentage.value == 100
    assert cluster.outlier_detection.failure_percentage_threshold.value == 60
    # the defaults: no slow start, failure percentage not enforced (but sent); health checks are on
    # (tests/unit/test_xds_resources_resilience.py)
    default, _ = _qwen(_fleet_doc())
    assert not default.least_request_lb_config.HasField("slow_start_config")
    assert default.outlier_detection.HasField("enforcing_failure_percentage")
    # slow start with a hashing policy is refused, field named
    bad = _fleet_doc(lb_policy="ring_hash", slow_start_window_ms=1000)
    with pytest.raises(ConfigError) as err:
        parse_config(bad)
    assert [f for f, _ in err.value.problems] == ["models[1].cluster.slow_start_window_ms"]


def test_memo_rebuilds_only_changed_assignments_and_the_cache_reuses_their_bytes(config: Config) -> None:
    memo = r.LbEndpointCache()
    first = r.build_resources(config, lb_cache=memo)
    cache = SnapshotCache()
    snap1 = cache.set_resources(first)
    key = r.endpoint_key(config.endpoints[0])  # h100-0, llama v1
    second = r.build_resources(config, overrides={key: r.EndpointOverride(weight=55)}, lb_cache=memo)
    eds1, eds2 = first.by_type[r.ENDPOINT_TYPE], second.by_type[r.ENDPOINT_TYPE]
    assert eds2["qwen2.5-7b-instruct--v1"] is eds1["qwen2.5-7b-instruct--v1"]
    assert eds2["llama-3.1-8b-instruct--v1"] is not eds1["llama-3.1-8b-instruct--v1"]
    # the memo's answer equals a fresh build, byte for byte
    fresh = r.build_resources(config, overrides={key: r.EndpointOverride(weight=55)})
    for name, cla in eds2.items():
        assert cla.SerializeToString(deterministic=True) == fresh.by_type[r.ENDPOINT_TYPE][
            name
        ].SerializeToString(deterministic=True)
    snap2 = cache.set_resources(second)
    q = "qwen2.5-7b-instruct--v1"
    assert snap2.resources[r.ENDPOINT_TYPE][q] is snap1.resources[r.ENDPOINT_TYPE][q]
    assert snap2.version(r.ENDPOINT_TYPE) != snap1.version(r.ENDPOINT_TYPE)
    assert snap2.version(r.CLUSTER_TYPE) == snap1.version(r.CLUSTER_TYPE)
