"""xds_server.cache: snapshot versions, consistency check and watchers."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from google.protobuf.message import Message

from inferlb.config.schema import Config, default_config_path, parse_config
from xds_server import resources as r
from xds_server.cache import DEFAULT_GROUP, Snapshot, SnapshotCache, SnapshotInconsistentError
from xds_server.config_source import ConfigSourceRewriter


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _config(**gpu_capacity: float) -> Config:
    doc = _doc()
    for gpu, cap in gpu_capacity.items():
        doc["gpu_profiles"][gpu]["relative_capacity"] = cap
    return parse_config(doc)


def _with(res: r.XdsResources, type_url: str, table: dict[str, Message]) -> r.XdsResources:
    return r.XdsResources(by_type={**res.by_type, type_url: table})


def test_versions_are_prefixed_by_a_per_cache_instance_id() -> None:
    res = r.build_resources(_config())
    a, b = SnapshotCache(), SnapshotCache()
    sa, sb = a.set_resources(res), b.set_resources(res)
    assert a.instance_id != b.instance_id
    for t in r.PUSH_ORDER:
        assert sa.version(t) == f"{a.instance_id}-1"
        assert sb.version(t) == f"{b.instance_id}-1"
        assert sa.version(t) != sb.version(t)


def test_only_changed_types_get_a_new_version() -> None:
    cache = SnapshotCache(instance_id="test")
    first = cache.set_resources(r.build_resources(_config()))
    second = cache.set_resources(r.build_resources(_config(V100=1.5)))
    assert second.version(r.ENDPOINT_TYPE) == "test-2"
    for t in (r.CLUSTER_TYPE, r.LISTENER_TYPE, r.ROUTE_TYPE):
        assert second.version(t) == first.version(t) == "test-1"
    doc = _doc()
    doc["gateway"]["num_retries"] = 4
    doc["gpu_profiles"]["V100"]["relative_capacity"] = 1.5  # endpoints as in `second`
    third = cache.set_resources(r.build_resources(parse_config(doc)))
    assert third.version(r.ROUTE_TYPE) == "test-3"
    assert third.version(r.ENDPOINT_TYPE) == "test-2"
    assert third.version(r.CLUSTER_TYPE) == "test-1"


def test_republishing_identical_resources_changes_nothing_and_notifies_nobody() -> None:
    cache = SnapshotCache()
    seen: list[tuple[str, Snapshot]] = []
    unsubscribe = cache.subscribe(lambda g, s: seen.append((g, s)))
    first = cache.set_resources(r.build_resources(_config()))
    again = cache.set_resources(r.build_resources(_config()))
    assert again is first
    assert seen == [(DEFAULT_GROUP, first)]
    unsubscribe()
    unsubscribe()  # idempotent
    cache.set_resources(r.build_resources(_config(A100=2.0)))
    assert len(seen) == 1
    assert cache.watcher_count == 0


def test_snapshot_for_falls_back_to_the_default_group() -> None:
    cache = SnapshotCache()
    assert cache.snapshot_for("inferlb-gateway") is None
    default = cache.set_resources(r.build_resources(_config()))
    assert cache.snapshot_for("inferlb-gateway") is default
    own = cache.set_resources(r.build_resources(_config(H100=5.0)), group="canary-gateways")
    assert cache.snapshot_for("canary-gateways") is own
    assert cache.snapshot_for("inferlb-gateway") is default
    assert own.version(r.ENDPOINT_TYPE) != default.version(r.ENDPOINT_TYPE)


def test_missing_assignment_is_refused_and_the_last_snapshot_keeps_serving() -> None:
    cache = SnapshotCache()
    good = cache.set_resources(r.build_resources(_config()))
    res = r.build_resources(_config(V100=2.0))
    clas = dict(res.by_type[r.ENDPOINT_TYPE])
    del clas["qwen2.5-7b-instruct--v1"]
    with pytest.raises(SnapshotInconsistentError) as err:
        cache.set_resources(_with(res, r.ENDPOINT_TYPE, clas))
    assert err.value.problems == [
        "cluster 'qwen2.5-7b-instruct--v1': no ClusterLoadAssignment 'qwen2.5-7b-instruct--v1'"
    ]
    assert cache.snapshot() is good


def test_missing_route_configuration_is_refused() -> None:
    res = r.build_resources(_config())
    with pytest.raises(SnapshotInconsistentError) as err:
        SnapshotCache().set_resources(_with(res, r.ROUTE_TYPE, {}))
    assert err.value.problems == ["listener 'inferlb_gateway': no RouteConfiguration 'inferlb_routes'"]


def test_zero_weight_is_refused() -> None:
    res = r.build_resources(_config())
    clas = dict(res.by_type[r.ENDPOINT_TYPE])
    broken = endpoint_pb2.ClusterLoadAssignment()
    broken.CopyFrom(clas["llama-3.1-8b-instruct--v2"])
    broken.endpoints[0].lb_endpoints[0].load_balancing_weight.value = 0
    clas["llama-3.1-8b-instruct--v2"] = broken
    with pytest.raises(SnapshotInconsistentError) as err:
        SnapshotCache().set_resources(_with(res, r.ENDPOINT_TYPE, clas))
    assert len(err.value.problems) == 1
    assert "weight 0 < 1" in err.value.problems[0]


def test_eds_service_name_is_what_must_exist() -> None:
    res = r.build_resources(_config())
    clusters = dict(res.by_type[r.CLUSTER_TYPE])
    renamed = cluster_pb2.Cluster()
    renamed.CopyFrom(clusters["llama-3.1-8b-instruct--v1"])
    renamed.eds_cluster_config.service_name = "elsewhere"
    clusters["llama-3.1-8b-instruct--v1"] = renamed
    with pytest.raises(SnapshotInconsistentError, match="no ClusterLoadAssignment 'elsewhere'"):
        SnapshotCache().set_resources(_with(res, r.CLUSTER_TYPE, clusters))


def test_resources_are_serialized_once_and_selected_by_name() -> None:
    snap = SnapshotCache().set_resources(r.build_resources(_config()))
    everything = snap.select(r.ENDPOINT_TYPE)
    assert [x.name for x in everything] == sorted(x.name for x in everything)
    [one] = snap.select(r.ENDPOINT_TYPE, ["qwen2.5-7b-instruct--v1", "no-such-cluster"])
    assert one.packed is snap.resources[r.ENDPOINT_TYPE]["qwen2.5-7b-instruct--v1"].packed
    assert one.packed.type_url == r.ENDPOINT_TYPE
    decoded = endpoint_pb2.ClusterLoadAssignment()
    assert one.packed.Unpack(decoded)
    assert decoded == one.message
    assert len(one.digest) == 64


def _hcm_rds_source(listener: Message) -> Any:
    assert isinstance(listener, listener_pb2.Listener)
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    [f] = [f for c in listener.filter_chains for f in c.filters if f.typed_config.Is(hcm.DESCRIPTOR)]
    f.typed_config.Unpack(hcm)
    return hcm.rds.config_source


def test_per_type_variant_points_eds_and_rds_at_the_per_type_services() -> None:
    cache = SnapshotCache()
    rewriter = ConfigSourceRewriter()
    res = r.build_resources(_config())
    snap = cache.set_resources(res, per_type=rewriter.apply(res))
    pt = cache.snapshot_for("any-node", per_type=True)
    assert pt is not None and pt is not snap
    assert dict(pt.versions) == dict(snap.versions)
    for name, sr in pt.resources[r.CLUSTER_TYPE].items():
        c = sr.message
        assert isinstance(c, cluster_pb2.Cluster)
        ads = snap.resources[r.CLUSTER_TYPE][name].message
        assert isinstance(ads, cluster_pb2.Cluster)
        if c.type == cluster_pb2.Cluster.EDS:
            assert c.eds_cluster_config.eds_config.api_config_source.grpc_services[
                0
            ].envoy_grpc.cluster_name == ("inferlb_xds")
            assert ads.eds_cluster_config.eds_config.HasField("ads")
    [listener] = pt.resources[r.LISTENER_TYPE].values()
    assert _hcm_rds_source(listener.message).HasField("api_config_source")
    [ads_listener] = snap.resources[r.LISTENER_TYPE].values()
    assert _hcm_rds_source(ads_listener.message).HasField("ads")
    # endpoints and routes are the same in both variants: serialized once, shared
    for t in (r.ENDPOINT_TYPE, r.ROUTE_TYPE):
        for name, sr in pt.resources[t].items():
            assert sr is snap.resources[t][name]
    # the next publish of the same inputs changes nothing in either variant
    assert cache.set_resources(res, per_type=rewriter.apply(res)) is snap


def test_per_type_variant_defaults_to_the_ads_snapshot() -> None:
    cache = SnapshotCache()
    snap = cache.set_resources(r.build_resources(_config()))
    assert cache.snapshot_for("x", per_type=True) is snap


def test_memoized_assignments_rebuild_only_clusters_whose_inputs_changed() -> None:
    config = _config()
    memo = r.LbEndpointCache()
    first = r.build_resources(config, lb_cache=memo).by_type[r.ENDPOINT_TYPE]
    qwen_key = next(r.endpoint_key(e) for e in config.endpoints if e.model == "qwen2.5-7b-instruct")
    qwen = "qwen2.5-7b-instruct--v1"
    # (overrides, whether the qwen assignment changes)
    steps: list[tuple[dict[str, r.EndpointOverride], bool]] = [
        ({qwen_key: r.EndpointOverride(weight=7)}, True),
        ({qwen_key: r.EndpointOverride(weight=7, draining=True)}, True),
        ({qwen_key: r.EndpointOverride(weight=7, draining=True)}, False),  # an equal, new override
        ({}, True),  # the override is cleared
    ]
    previous = first
    for overrides, qwen_changes in steps:
        table = r.build_resources(config, overrides=overrides, lb_cache=memo).by_type[r.ENDPOINT_TYPE]
        # the memo's answer is exactly what a build without it gives
        plain = r.build_resources(config, overrides=overrides).by_type[r.ENDPOINT_TYPE]
        assert {n: m.SerializeToString(deterministic=True) for n, m in table.items()} == {
            n: m.SerializeToString(deterministic=True) for n, m in plain.items()
        }
        for name, cla in table.items():
            # unchanged inputs: the very same object (its serialization is reused by the snapshot)
            assert (cla is previous[name]) == (name != qwen or not qwen_changes), name
        previous = table
    # a new config object (a reload) is grouped again: nothing stale is served
    doc = _doc()
    doc["gpu_profiles"]["V100"]["relative_capacity"] = 2.0
    reloaded = parse_config(doc)
    table = r.build_resources(reloaded, lb_cache=r.LbEndpointCache()).by_type[r.ENDPOINT_TYPE]
    again = r.build_resources(reloaded, lb_cache=memo).by_type[r.ENDPOINT_TYPE]
    assert {n: m.SerializeToString(deterministic=True) for n, m in again.items()} == {
        n: m.SerializeToString(deterministic=True) for n, m in table.items()
    }
