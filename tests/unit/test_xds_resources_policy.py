"""xds_server.resources: priority shedding, local replies, affinity, failure modes, security."""

from __future__ import annotations

import json

from envoy.config.cluster.v3 import cluster_pb2

from inferlb.config.schema import ClusterPolicy, parse_config
from inferlb.request import headers
from tests.unit.test_xds_resources import _default_doc, _hcm
from xds_server import resources as r


def test_default_priority_budget_is_tighter_than_high() -> None:
    policy = ClusterPolicy()
    low, high = policy.circuit_breaker_default, policy.circuit_breaker_high
    for name in ("max_connections", "max_pending_requests", "max_requests", "max_retries"):
        assert getattr(low, name) < getattr(high, name), name


def test_overflow_reply_is_openai_503_with_retry_after() -> None:
    doc = _default_doc()
    doc["gateway"]["overflow_retry_after_s"] = 3
    mappers = list(_hcm(r.build_listener(parse_config(doc))).local_reply_config.mappers)
    # first match wins: the overflow mapper must come before the generic upstream-failure one
    [overflow] = [m for m in mappers if list(m.filter.response_flag_filter.flags) == [r.OVERFLOW_FLAG]]
    generic = next(m for m in mappers if "UH" in m.filter.response_flag_filter.flags)
    assert mappers.index(overflow) < mappers.index(generic)
    assert overflow.status_code.value == 503
    assert {(h.header.key, h.header.value) for h in overflow.headers_to_add} == {("retry-after", "3")}
    err = json.loads(overflow.body.inline_string)["error"]
    assert (err["type"], err["code"]) == ("server_error", "overloaded")
    assert overflow.body_format_override.content_type == "application/json"


def test_hash_lb_models_get_affinity_hash_policy_and_bounded_load() -> None:
    doc = _default_doc()
    qwen = next(m for m in doc["models"] if m["name"].startswith("qwen"))
    qwen["cluster"] = {"lb_policy": "ring_hash", "hash_balance_factor": 125}
    config = parse_config(doc)
    routes = list(r.build_route_configuration(config).virtual_hosts[0].routes)
    for route in routes[:-1]:
        policies = list(route.route.hash_policy)
        if route.route.cluster.startswith("qwen"):
            assert [(p.header.header_name, p.terminal) for p in policies] == [
                (headers.PREFIX_KEY, True),
                (headers.SESSION_KEY, False),
            ]
        else:  # least_request: a hash policy would be ignored, and is not sent
            assert policies == []
    clusters = {c.name: c for c in r.build_clusters(config)}
    hashed = clusters[config.models[1].cluster_name("v1")]
    assert hashed.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value == 125
    plain = clusters[config.models[0].cluster_name("v1")]
    assert not plain.common_lb_config.HasField("consistent_hashing_lb_config")


def test_affinity_headers_are_stripped_from_clients() -> None:
    assert {headers.PREFIX_KEY, headers.SESSION_KEY} <= set(r.STRIPPED_REQUEST_HEADERS)


def test_api_key_is_removed_on_model_routes_and_the_peer_address_is_envoys() -> None:
    config = parse_config(_default_doc())
    routes = list(r.build_route_configuration(config).virtual_hosts[0].routes)
    for route in routes:
        if route.route.cluster:  # model routes and the fail-open route
            removed = set(route.request_headers_to_remove)
            assert "authorization" in removed, route.name
            # every internal header ext_proc sets (those clients may not send) never reaches a model server
            assert set(r.STRIPPED_REQUEST_HEADERS) <= removed, route.name
            assert route.route.host_rewrite_literal in {m.name for m in config.models}, route.name
    hcm = _hcm(r.build_listener(config))
    assert hcm.use_remote_address.value is True
    assert hcm.xff_num_trusted_hops == 0


def test_each_ext_proc_process_is_its_own_endpoint() -> None:
    doc = _default_doc()
    doc["ext_proc"]["protocol"] = "ext_proc"  # ext_authz mode meters in one process
    doc["ext_proc"]["extra_listen"] = ["127.0.0.1:18090", "127.0.0.1:18091"]
    doc["ext_proc"]["quota_backend"] = "redis"  # the processes share the tenants' limits
    cluster = r.build_ext_proc_cluster(parse_config(doc))
    [locality] = cluster.load_assignment.endpoints
    ports = [e.endpoint.address.socket_address.port_value for e in locality.lb_endpoints]
    assert ports == [18080, 18090, 18091]
    assert cluster.type == cluster_pb2.Cluster.STATIC
    doc["ext_proc"].update(listen="ext-proc:18080", extra_listen=["ext-proc-2:18080"])
    assert r.build_ext_proc_cluster(parse_config(doc)).type == cluster_pb2.Cluster.STRICT_DNS
