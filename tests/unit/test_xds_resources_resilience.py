"""The resilience defaults in the built protos: active health checks, the update merge window, retries on 503
to another host, per-try bounds (whole answers vs streams), and Envoy's reconnect backoff to the xDS server.

The e2e counterparts (real Envoy, simulated GPUs that hang or fail) are tests/e2e/test_upstream_hang.py,
tests/e2e/test_upstream_fail_retries.py and tests/e2e/test_xds_reconnect.py.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.config.route.v3 import route_components_pb2

# registers the Any types the bootstrap names, so json_format can parse them
from envoy.extensions.access_loggers.file.v3 import file_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format

from ext_proc import handlers
from ext_proc.handlers import BodyExpected, ContinueRequest, Gateway
from inferlb.config.schema import Config, default_config_path, parse_config
from inferlb.errors import ConfigError
from inferlb.policy.quota import QuotaBook, limits_from_config
from inferlb.request import headers
from xds_server import resources as r
from xds_server.bootstrap import ADS_MODES, AdsMode, render_bootstrap
from xds_server.config_source import ConfigSourceRewriter, per_type_source
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, METER_CLUSTER

QWEN = "qwen2.5-7b-instruct--v1"


def _doc(**cluster: Any) -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    if cluster:
        doc["models"][1]["cluster"] = cluster
    return doc


def _cluster(config: Config, name: str = QWEN) -> cluster_pb2.Cluster:
    c = r.build_resources(config).by_type[r.CLUSTER_TYPE][name]
    assert isinstance(c, cluster_pb2.Cluster)
    return c


def _routes(config: Config) -> dict[str, route_components_pb2.Route]:
    [vh] = r.build_route_configuration(config).virtual_hosts
    return {rt.name: rt for rt in vh.routes}


def _matchers(route: route_components_pb2.Route) -> dict[str, str]:
    return {m.name: m.string_match.exact for m in route.match.headers}


# -- health checks and the merge window ----------------------------------------------------------------------


def test_model_clusters_health_check_the_health_path_by_default() -> None:
    config = parse_config(_doc())
    for m in config.models:
        for v in m.versions:
            c = _cluster(config, m.cluster_name(v.name))
            [hc] = c.health_checks
            assert hc.http_health_check.path == "/health"
            # a hung server (every check times out after 1 s, the next starts 1 s later) is out after ~3 s
            assert hc.timeout.ToMilliseconds() == 1_000
            assert hc.interval.ToMilliseconds() == 1_000
            assert hc.interval_jitter.ToMilliseconds() == 100
            assert (hc.unhealthy_threshold.value, hc.healthy_threshold.value) == (2, 2)
            assert hc.no_traffic_interval.ToMilliseconds() == 5_000
            # a deregistered endpoint leaves even while it still passes its checks
            assert c.ignore_health_on_host_removal
            # an ejection or failed check takes effect at once (Envoy's default window is 1 s)
            assert c.common_lb_config.HasField("update_merge_window")
            assert c.common_lb_config.update_merge_window.ToMilliseconds() == 0
    # the request-path service's clusters (by default the ext_authz check and the settler) are not health
    # checked
    clusters = r.build_resources(config).by_type[r.CLUSTER_TYPE]
    for name in (EXT_AUTHZ_CLUSTER, METER_CLUSTER):
        ext = clusters[name]
        assert isinstance(ext, cluster_pb2.Cluster) and list(ext.health_checks) == []


def test_health_checks_can_be_tuned_or_turned_off() -> None:
    tuned = _cluster(parse_config(_doc(health_check={"path": "/ping", "interval_ms": 3000})))
    [hc] = tuned.health_checks
    assert hc.http_health_check.path == "/ping" and hc.interval.ToMilliseconds() == 3000
    assert hc.timeout.ToMilliseconds() == 1_000  # the other fields keep their defaults
    off = _cluster(parse_config(_doc(health_check=None)))
    assert list(off.health_checks) == []
    assert not off.ignore_health_on_host_removal  # Envoy's default again: outlier detection only
    assert off.outlier_detection.consecutive_5xx.value == 5


def test_update_merge_window_is_configurable() -> None:
    c = _cluster(parse_config(_doc(update_merge_window_ms=250)))
    assert c.common_lb_config.update_merge_window.ToMilliseconds() == 250
    with pytest.raises(ConfigError) as err:
        parse_config(_doc(update_merge_window_ms=-1))
    assert err.value.problems[0][0] == "models[1].cluster.update_merge_window_ms"


# -- routes: retries and per-try bounds ---------------------------------------------------------------------


def test_every_model_route_retries_503_and_resets_on_another_host() -> None:
    config = parse_config(_doc())
    model_routes = [rt for rt in _routes(config).values() if rt.HasField("route")]
    assert model_routes
    for rt in model_routes:
        rp = rt.route.retry_policy
        assert set(rp.retry_on.split(",")) == {
            "connect-failure",
            "refused-stream",
            "reset",
            "retriable-status-codes",
        }
        assert list(rp.retriable_status_codes) == [503]
        assert rp.num_retries.value == 2
        assert [p.name for p in rp.retry_host_predicate] == ["envoy.retry_host_predicates.previous_hosts"]
        assert rp.host_selection_retry_max_attempts == r.HOST_SELECTION_RETRY_MAX_ATTEMPTS
        # no bound on the whole answer: a long stream is not cut for its length
        assert rt.route.timeout.ToMilliseconds() == 0


def test_streamed_requests_have_a_twin_route_bounded_by_silence_not_length() -> None:
    config = parse_config(_doc())
    routes = _routes(config)
    names = list(routes)
    for name in (QWEN, f"{QWEN}--high"):
        whole, streamed = routes[name], routes[f"{name}{r.STREAM_ROUTE_SUFFIX}"]
        # the streamed twin comes first and also needs x-inferlb-stream: true
        assert names.index(streamed.name) == names.index(whole.name) - 1
        assert _matchers(streamed) == {**_matchers(whole), headers.STREAM: "true"}
        assert (
            streamed.route.cluster == whole.route.cluster and streamed.route.priority == whole.route.priority
        )
        assert list(streamed.request_headers_to_remove) == list(whole.request_headers_to_remove)
        # non-streamed: the headers come with the whole answer, bounded per attempt, no idle bound
        rp = whole.route.retry_policy
        assert rp.per_try_timeout.ToMilliseconds() == 300_000
        assert not rp.HasField("per_try_idle_timeout")
        # streamed: the silence before the first byte and between chunks, and no per_try_timeout (on
        # Envoy 1.40 one that fires after the stream started stops the idle timer)
        srp = streamed.route.retry_policy
        assert srp.per_try_idle_timeout.ToMilliseconds() == 60_000
        assert not srp.HasField("per_try_timeout")
        assert srp.retry_on == rp.retry_on and srp.num_retries == rp.num_retries


def test_per_try_bounds_and_retried_statuses_are_configurable() -> None:
    doc = _doc()
    doc["gateway"].update(
        per_try_timeout_ms=4_000,
        stream_idle_timeout_ms=1_500,
        request_timeout_ms=600_000,
        retry_status_codes=[502, 503],
    )
    routes = _routes(parse_config(doc))
    assert routes[QWEN].route.retry_policy.per_try_timeout.ToMilliseconds() == 4_000
    assert routes[f"{QWEN}--stream"].route.retry_policy.per_try_idle_timeout.ToMilliseconds() == 1_500
    assert routes[QWEN].route.timeout.ToMilliseconds() == 600_000
    assert list(routes[QWEN].route.retry_policy.retriable_status_codes) == [502, 503]
    # 0 turns a bound off
    doc["gateway"].update(per_try_timeout_ms=0, stream_idle_timeout_ms=0, retry_status_codes=[])
    routes = _routes(parse_config(doc))
    assert not routes[QWEN].route.retry_policy.HasField("per_try_timeout")
    assert not routes[f"{QWEN}--stream"].route.retry_policy.HasField("per_try_idle_timeout")
    assert list(routes[QWEN].route.retry_policy.retriable_status_codes) == []
    doc["gateway"]["retry_status_codes"] = [404]
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert err.value.problems[0][0].startswith("gateway.retry_status_codes")


def test_failed_open_requests_take_the_non_streamed_policy() -> None:
    doc = _doc()
    doc["ext_proc"].update(failure_mode_allow=True, fail_open_model="qwen")
    open_route = _routes(parse_config(doc))["failure_mode:/v1/chat/completions"]
    assert open_route.route.cluster == QWEN  # ext_proc never saw it: whether it streams is unknown
    assert open_route.route.retry_policy.per_try_timeout.ToMilliseconds() == 300_000


def test_length_aware_routes_get_their_streamed_twins_too() -> None:
    routes = _routes(parse_config(_doc(length_aware={})))
    for name in (f"{QWEN}--long-high", f"{QWEN}--long"):
        streamed = routes[f"{name}{r.STREAM_ROUTE_SUFFIX}"]
        assert _matchers(streamed) == {**_matchers(routes[name]), headers.STREAM: "true"}
        assert streamed.route.metadata_match == routes[name].route.metadata_match


# -- ext_proc marks streamed requests ------------------------------------------------------------------------


@pytest.mark.parametrize(("stream", "marked"), [(True, True), (False, False), (None, False)])
def test_ext_proc_marks_streamed_requests_for_their_route(stream: bool | None, marked: bool) -> None:
    config = parse_config(_doc())
    gateway = Gateway.from_config(config)
    quotas = QuotaBook(limits_from_config(config), 0.0)
    hdrs = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "authorization": "Bearer sk-demo-a",
        "content-type": "application/json",
        headers.STREAM: "true",  # a client's own value never counts
    }
    first = handlers.on_request_headers(gateway, hdrs, end_of_stream=False)
    assert isinstance(first, BodyExpected)
    assert headers.STREAM in first.remove_headers
    body: dict[str, Any] = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
    if stream is not None:
        body["stream"] = stream
    out = handlers.on_request_body(
        gateway, quotas, first.pending, json.dumps(body).encode(), now=0.0, rng=random.Random(1),
        end_of_stream=True,
    )  # fmt: skip
    assert isinstance(out, ContinueRequest)
    assert (dict(out.set_headers).get(headers.STREAM) == "true") is marked
    # and Envoy strips a client-sent one before routing, so only ext_proc's reaches the routes
    assert headers.STREAM in r.STRIPPED_REQUEST_HEADERS


# -- the bootstrap: reconnect backoff ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ADS_MODES)
def test_bootstrap_reconnects_to_the_xds_server_within_a_second(mode: AdsMode) -> None:
    config = parse_config(_doc())
    b = json_format.ParseDict(render_bootstrap(config, mode=mode), bootstrap_pb2.Bootstrap())
    dyn = b.dynamic_resources
    sources = (
        [dyn.ads_config]
        if mode != "xds"
        else [dyn.lds_config.api_config_source, dyn.cds_config.api_config_source]
    )
    for source in sources:
        [svc] = source.grpc_services
        back_off = svc.envoy_grpc.retry_policy.retry_back_off
        assert back_off.base_interval.ToMilliseconds() == 250
        assert back_off.max_interval.ToMilliseconds() == 1_000


def test_reconnect_backoff_is_configurable_and_checked() -> None:
    doc = _doc()
    doc["xds"].update(reconnect_base_ms=500, reconnect_max_ms=5_000)
    b = json_format.ParseDict(render_bootstrap(parse_config(doc)), bootstrap_pb2.Bootstrap())
    back_off = b.dynamic_resources.ads_config.grpc_services[0].envoy_grpc.retry_policy.retry_back_off
    assert (back_off.base_interval.ToMilliseconds(), back_off.max_interval.ToMilliseconds()) == (500, 5_000)
    doc["xds"].update(reconnect_base_ms=2_000, reconnect_max_ms=1_000)
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert err.value.problems[0][0] == "xds.reconnect_max_ms"


def test_per_type_eds_and_rds_streams_get_the_same_backoff() -> None:
    source = per_type_source(reconnect_ms=(250, 1_000))
    [svc] = source.api_config_source.grpc_services
    back_off = svc.envoy_grpc.retry_policy.retry_back_off
    assert (back_off.base_interval.ToMilliseconds(), back_off.max_interval.ToMilliseconds()) == (250, 1_000)
    assert not per_type_source().api_config_source.grpc_services[0].envoy_grpc.HasField("retry_policy")
    config = parse_config(_doc())
    rewritten = ConfigSourceRewriter((250, 1_000)).apply(r.build_resources(config))
    c = rewritten.by_type[r.CLUSTER_TYPE][QWEN]
    assert isinstance(c, cluster_pb2.Cluster)
    eds = c.eds_cluster_config.eds_config
    assert eds.api_config_source.api_type == config_source_pb2.ApiConfigSource.GRPC
    assert eds.api_config_source.grpc_services[0].envoy_grpc.retry_policy.retry_back_off == back_off
