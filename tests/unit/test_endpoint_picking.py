"""Endpoint picking, pure parts: the config's ``models[].endpoint_picking`` (and the combinations it
refuses, naming the field), the ``override_host`` clusters and listener pieces it turns into, the endpoint
book the request path picks from, and the xDS server's health-probe run."""

from __future__ import annotations

import re
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from hypothesis import example, given
from hypothesis import strategies as st

from ext_proc.picking import picker_weights
from inferlb.config.schema import Config, parse_config
from inferlb.errors import ConfigError
from inferlb.policy.endpoint_book import BookedEndpoint, BookedState, EndpointBook, parse_picking_state
from inferlb.policy.picker import PickerWeights
from inferlb.request import headers as h
from tests.conftest import make_config_doc
from tests.unit.test_xds_resources import _hcm
from xds_server import resources as r
from xds_server.collector import HealthRun
from xds_server.resources.clusters import build_clusters
from xds_server.resources.common import EXT_AUTHZ_FILTER

QWEN = "qwen2.5-7b-instruct"


def _doc(picking: dict[str, Any] | None = None, cluster: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = make_config_doc()
    qwen = next(m for m in doc["models"] if m["name"] == QWEN)
    if picking is not None:
        qwen["endpoint_picking"] = picking
    if cluster is not None:
        qwen["cluster"] = cluster
    return doc


def _refusal(doc: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    return list(err.value.problems)


def _clusters(config: Config) -> dict[str, cluster_pb2.Cluster]:
    return {c.name: c for c in build_clusters(config)}


# -- config ---------------------------------------------------------------------------------------------


def test_picking_is_off_by_default_and_leaves_every_cluster_as_it_was() -> None:
    config = parse_config(make_config_doc())
    assert all(m.endpoint_picking.mode == "off" and not m.endpoint_picking.enabled for m in config.models)
    for c in build_clusters(config):
        assert not c.HasField("load_balancing_policy"), c.name


def test_the_config_weights_are_the_pickers_defaults() -> None:
    config = parse_config(_doc({"mode": "load"}))
    qwen = next(m for m in config.models if m.name == QWEN)
    assert picker_weights(qwen.endpoint_picking) == PickerWeights()
    # every configured weight reaches the picker
    set_ = {"prefix": 3.0, "load": 0.5, "kv": 0.25, "tokens": 10.0, "load_factor": 3.0, "max_hosts": 2}
    config = parse_config(_doc({"mode": "load", "weights": set_}))
    qwen = next(m for m in config.models if m.name == QWEN)
    assert picker_weights(qwen.endpoint_picking) == PickerWeights(**set_)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cluster", "named"),
    [
        ({"lb_policy": "ring_hash"}, "cluster.lb_policy ring_hash"),
        ({"lb_policy": "maglev"}, "cluster.lb_policy maglev"),
        ({"failover": "zone"}, "cluster.failover zone"),
    ],
)
def test_combinations_the_picker_would_fight_are_refused_naming_the_field(
    cluster: dict[str, Any], named: str
) -> None:
    [(field, message)] = _refusal(_doc({"mode": "approximate"}, cluster))
    assert field == "models[1].endpoint_picking.mode"
    assert message.startswith(f"approximate cannot be combined with {named}"), message


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d["xds"].update(api_listen=None), "needs xds.api_listen"),
        (lambda d: d["ext_proc"].update(account_responses=False), "needs ext_proc.account_responses"),
    ],
)
def test_picking_without_its_inputs_is_refused(change: Any, named: str) -> None:
    doc = _doc({"mode": "precise"})
    change(doc)
    [(field, message)] = _refusal(doc)
    assert field == "models[1].endpoint_picking.mode"
    assert named in message


@pytest.mark.parametrize(
    ("weights", "field"),
    [
        ({"load_factor": 1.0}, "models[1].endpoint_picking.weights.load_factor"),
        ({"max_hosts": 0}, "models[1].endpoint_picking.weights.max_hosts"),
        ({"kv": -1}, "models[1].endpoint_picking.weights.kv"),
        ({"tokens": -1}, "models[1].endpoint_picking.weights.tokens"),
    ],
)
def test_bad_picker_weights_are_refused_naming_the_field(weights: dict[str, Any], field: str) -> None:
    [(got, _)] = _refusal(_doc({"mode": "load", "weights": weights}))
    assert got == field


def test_an_unknown_mode_is_refused() -> None:
    [(field, _)] = _refusal(_doc({"mode": "random"}))
    assert field == "models[1].endpoint_picking.mode"


# -- xDS resources --------------------------------------------------------------------------------------


def test_a_picking_model_gets_override_host_with_its_least_request_as_fallback() -> None:
    config = parse_config(_doc({"mode": "load"}, {"active_request_bias": 2.0}))
    clusters = _clusters(config)
    qwen = clusters[f"{QWEN}--v1"]
    # the typed policy replaces the legacy enum and its config
    assert qwen.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN  # the enum's default: unset
    assert not qwen.HasField("least_request_lb_config")
    [policy] = qwen.load_balancing_policy.policies
    assert policy.typed_extension_config.name == "envoy.load_balancing_policies.override_host"
    oh = override_host_pb2.OverrideHost()
    assert policy.typed_extension_config.typed_config.Unpack(oh)
    # ext_authz mode (the default) can send the header only
    [source] = oh.override_host_sources
    assert source.header == h.DESTINATION_ENDPOINT and not source.HasField("metadata")
    [fallback] = oh.fallback_policy.policies
    assert fallback.typed_extension_config.name == "envoy.load_balancing_policies.least_request"
    lr = least_request_pb2.LeastRequest()
    assert fallback.typed_extension_config.typed_config.Unpack(lr)
    assert lr.active_request_bias.default_value == 2.0
    assert not lr.HasField("slow_start_config") and not lr.HasField("locality_lb_config")
    # what does not depend on the policy stays: health checks, outlier detection, breakers, panic threshold
    assert qwen.health_checks and qwen.outlier_detection.consecutive_5xx.value == 5
    assert qwen.common_lb_config.healthy_panic_threshold.value == 25.0
    # llama does not pick: its clusters keep the legacy least request
    llama = clusters["llama-3.1-8b-instruct--v1"]
    assert llama.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    assert not llama.HasField("load_balancing_policy")


def test_ext_proc_mode_reads_the_hosts_from_the_envoy_lb_metadata_only() -> None:
    doc = _doc({"mode": "load"})
    doc["ext_proc"]["protocol"] = "ext_proc"
    qwen = _clusters(parse_config(doc))[f"{QWEN}--v1"]
    oh = override_host_pb2.OverrideHost()
    assert qwen.load_balancing_policy.policies[0].typed_extension_config.typed_config.Unpack(oh)
    # one source: Envoy joins the lists of every source it finds, so the same list twice would be walked
    # twice on retries
    [source] = oh.override_host_sources
    assert not source.header
    assert source.metadata.key == "envoy.lb"
    assert [seg.key for seg in source.metadata.path] == [h.DESTINATION_ENDPOINT]


def test_round_robin_slow_start_and_locality_weighting_move_into_the_fallback() -> None:
    cluster = {"lb_policy": "round_robin", "slow_start_window_ms": 30_000, "locality_weighted": True}
    qwen = _clusters(parse_config(_doc({"mode": "load"}, cluster)))[f"{QWEN}--v1"]
    assert not qwen.common_lb_config.HasField("locality_weighted_lb_config")
    assert not qwen.HasField("round_robin_lb_config")
    oh = override_host_pb2.OverrideHost()
    assert qwen.load_balancing_policy.policies[0].typed_extension_config.typed_config.Unpack(oh)
    [fallback] = oh.fallback_policy.policies
    assert fallback.typed_extension_config.name == "envoy.load_balancing_policies.round_robin"
    rr = round_robin_pb2.RoundRobin()
    assert fallback.typed_extension_config.typed_config.Unpack(rr)
    assert rr.slow_start_config.slow_start_window.seconds == 30
    assert rr.locality_lb_config.HasField("locality_weighted_lb_config")


@pytest.mark.parametrize("protocol", ["ext_proc", "ext_authz"])
def test_the_listener_lets_only_the_request_path_name_hosts(protocol: str) -> None:
    doc = _doc({"mode": "load"})
    doc["ext_proc"]["protocol"] = protocol
    hcm = _hcm(r.build_listener(parse_config(doc)))
    by_name = {f.name: f for f in hcm.http_filters}
    if protocol == "ext_proc":
        ext_proc = ext_proc_pb2.ExternalProcessor()
        assert by_name[r.EXT_PROC_FILTER].typed_config.Unpack(ext_proc)
        assert list(ext_proc.metadata_options.receiving_namespaces.untyped) == ["envoy.lb"]
    else:
        authz = ext_authz_pb2.ExtAuthz()
        assert by_name[EXT_AUTHZ_FILTER].typed_config.Unpack(authz)
        allowed = [
            p.exact for p in authz.http_service.authorization_response.allowed_upstream_headers.patterns
        ]
        assert h.DESTINATION_ENDPOINT in allowed


def test_without_picking_ext_proc_receives_no_metadata_namespace() -> None:
    doc = make_config_doc()
    doc["ext_proc"]["protocol"] = "ext_proc"
    hcm = _hcm(r.build_listener(parse_config(doc)))
    ext_proc = ext_proc_pb2.ExternalProcessor()
    assert {f.name: f for f in hcm.http_filters}[r.EXT_PROC_FILTER].typed_config.Unpack(ext_proc)
    assert not ext_proc.HasField("metadata_options")


# -- the endpoint book ----------------------------------------------------------------------------------

GOOD = {
    "clusters": {
        "m--v1": [
            {"address": "10.0.0.1:80", "weight": 34, "prefill_weight": 72.3, "healthy": True, "waiting": 3,
             "kv_usage": 0.5, "telemetry_age_ms": 100},
            {"address": "10.0.0.2:80", "weight": 10, "healthy": False, "waiting": None, "kv_usage": None,
             "telemetry_age_ms": None},
        ],
        "empty--v1": [],
    },
    "stale_after_ms": 1000,
}  # fmt: skip


def test_the_book_joins_the_servers_state_with_its_own_in_flight_counts() -> None:
    book = EndpointBook()
    assert book.states("m--v1", 0.0) is None and book.age_s(0.0) is None
    book.update(parse_picking_state(GOOD), now=10.0)
    book.enter("10.0.0.1:80")
    book.enter("10.0.0.1:80")
    a, b = book.states("m--v1", 10.5) or []
    assert (a.address, a.weight, a.healthy, a.in_flight, a.waiting, a.kv_usage) == (
        "10.0.0.1:80", 34, True, 2, 3, 0.5,
    )  # fmt: skip
    assert (b.healthy, b.in_flight, b.waiting, b.kv_usage) == (False, 0, 0.0, 0.0)
    # the prefill weight, with telemetry or without; a server that sends none: the weight (None)
    assert (a.prefill_weight, b.prefill_weight) == (72.3, None)
    assert book.states("empty--v1", 10.5) == []
    assert book.states("unknown--v1", 10.5) is None
    # telemetry past the bound (100 ms old at the server + 1 s since) is unknown; the list still serves
    [stale, _] = book.states("m--v1", 11.0) or []
    assert (stale.waiting, stale.kv_usage, stale.healthy, stale.prefill_weight) == (0.0, 0.0, True, 72.3)
    assert book.age_s(11.0) == 1.0
    book.leave("10.0.0.1:80")
    book.leave("10.0.0.1:80")
    book.leave("10.0.0.1:80")  # never below 0
    assert book.in_flight() == {}


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({}, "clusters"),
        ({"clusters": {}}, "stale_after_ms"),
        ({"clusters": {"c": {}}, "stale_after_ms": 1}, "clusters.c"),
        ({"clusters": {"c": [{"weight": 1, "healthy": True}]}, "stale_after_ms": 1}, "clusters.c[0].address"),
        ({"clusters": {"c": [{"address": "a:1", "weight": 0, "healthy": True}]}, "stale_after_ms": 1},
         "clusters.c[0].weight"),
        ({"clusters": {"c": [{"address": "a:1", "weight": 1, "healthy": 1}]}, "stale_after_ms": 1},
         "clusters.c[0].healthy"),
        ({"clusters": {"c": [{"address": "a:1", "weight": 1, "healthy": True, "waiting": "x"}]},
          "stale_after_ms": 1}, "clusters.c[0].waiting"),
        ({"clusters": {"c": [{"address": "a:1", "weight": 1, "prefill_weight": 0, "healthy": True}]},
          "stale_after_ms": 1}, "clusters.c[0].prefill_weight"),
        ({"clusters": {"c": [{"address": "a:1", "weight": 1, "prefill_weight": "7", "healthy": True}]},
          "stale_after_ms": 1}, "clusters.c[0].prefill_weight"),
    ],
)  # fmt: skip
def test_a_bad_state_is_refused_naming_the_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: "):
        parse_picking_state(doc)


@given(st.lists(st.sampled_from(["enter", "leave"]), max_size=60))
@example(["leave", "enter"])
def test_in_flight_counts_never_go_negative(ops: list[str]) -> None:
    book = EndpointBook(BookedState(clusters={"c": (BookedEndpoint(address="a:1", weight=1, healthy=True),)},
                                    stale_after_ms=1000))  # fmt: skip
    expected = 0
    for op in ops:
        if op == "enter":
            book.enter("a:1")
            expected += 1
        else:
            book.leave("a:1")
            expected = max(0, expected - 1)
        [state] = book.states("c", 0.0) or []
        assert state.in_flight == expected


# -- the xDS server's health probe ----------------------------------------------------------------------


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 4), st.integers(1, 4))
def test_a_health_run_flips_only_after_its_thresholds(probes: list[bool], up: int, down: int) -> None:
    run = HealthRun()
    healthy = True
    streak_pass = streak_fail = 0
    for passed in probes:
        run = run.after(passed, healthy_threshold=up, unhealthy_threshold=down)
        streak_pass, streak_fail = (streak_pass + 1, 0) if passed else (0, streak_fail + 1)
        if healthy and streak_fail >= down:
            healthy = False
        elif not healthy and streak_pass >= up:
            healthy = True
        assert run.healthy is healthy
