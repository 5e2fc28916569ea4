"""xds_server.sotw: the state-of-the-world protocol rules of one ADS stream, without gRPC."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from inferlb.config.schema import default_config_path, parse_config
from xds_server import resources as r
from xds_server.cache import Snapshot, SnapshotCache
from xds_server.sotw import (
    AckReceived,
    NackReceived,
    OversizedResponseWithheld,
    ResponseSent,
    SotwStream,
    StaleNonceIgnored,
    SubscriptionOpened,
    UnknownTypeIgnored,
)

CLUSTERS = ["llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1"]
NODE = base_pb2.Node(id="envoy-7", cluster="inferlb-gateway")


def _snapshot(cache: SnapshotCache, **changes: Any) -> Snapshot:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    for gpu, cap in changes.get("capacity", {}).items():
        doc["gpu_profiles"][gpu]["relative_capacity"] = cap
    if "panic" in changes:
        doc["models"][1]["cluster"] = {"healthy_panic_threshold": changes["panic"]}
    if "retries" in changes:
        doc["gateway"]["num_retries"] = changes["retries"]
    return cache.set_resources(r.build_resources(parse_config(doc)))


def _req(
    type_url: str,
    *,
    nonce: str = "",
    version: str = "",
    names: list[str] | None = None,
    error: str | None = None,
    node: base_pb2.Node | None = None,
) -> discovery_pb2.DiscoveryRequest:
    req = discovery_pb2.DiscoveryRequest(
        type_url=type_url, response_nonce=nonce, version_info=version, resource_names=names or []
    )
    if error is not None:
        req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    if node is not None:
        req.node.CopyFrom(node)
    return req


def _subscribed(
    cache: SnapshotCache,
) -> tuple[SotwStream, Snapshot, dict[str, discovery_pb2.DiscoveryResponse]]:
    """A stream subscribed to all four types, every first response ACKed."""
    snap = _snapshot(cache)
    stream = SotwStream(control_plane_id=cache.instance_id)
    last: dict[str, discovery_pb2.DiscoveryResponse] = {}
    for t, names in (
        (r.CLUSTER_TYPE, None),
        (r.ENDPOINT_TYPE, CLUSTERS),
        (r.LISTENER_TYPE, None),
        (r.ROUTE_TYPE, [r.ROUTE_CONFIG_NAME]),
    ):
        step = stream.handle_request(_req(t, names=names, node=NODE), snap)
        [resp] = step.responses
        stream.handle_request(_req(t, nonce=resp.nonce, version=resp.version_info, names=names), snap)
        last[t] = resp
    return stream, snap, last


def test_first_request_is_answered_with_the_current_snapshot() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    stream = SotwStream(control_plane_id=cache.instance_id)
    step = stream.handle_request(_req(r.CLUSTER_TYPE, node=NODE), snap)
    [resp] = step.responses
    assert resp.type_url == r.CLUSTER_TYPE
    assert resp.version_info == snap.version(r.CLUSTER_TYPE)
    # every cluster: the models' and the default request path's two (ext_authz, the settler)
    assert len(resp.resources) == len(snap.resources[r.CLUSTER_TYPE]) == len(CLUSTERS) + 2
    assert resp.nonce
    assert resp.control_plane.identifier == cache.instance_id
    assert step.events[0] == SubscriptionOpened(type_url=r.CLUSTER_TYPE, resource_names=())
    assert isinstance(step.events[1], ResponseSent)
    assert stream.node_id == "envoy-7"
    assert stream.node_cluster == "inferlb-gateway"


def test_request_before_any_snapshot_is_answered_by_the_first_snapshot() -> None:
    cache = SnapshotCache()
    stream = SotwStream()
    step = stream.handle_request(_req(r.LISTENER_TYPE), None)
    assert step.responses == ()
    pushed = stream.handle_snapshot(_snapshot(cache))
    assert [p.type_url for p in pushed.responses] == [r.LISTENER_TYPE]


def test_eds_response_holds_only_the_named_assignments() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    stream = SotwStream()
    [resp] = stream.handle_request(_req(r.ENDPOINT_TYPE, names=["qwen2.5-7b-instruct--v1"]), snap).responses
    assert len(resp.resources) == 1
    [all_of_them] = SotwStream().handle_request(_req(r.ENDPOINT_TYPE), snap).responses
    assert len(all_of_them.resources) == 3


def test_ack_records_the_version_and_sends_nothing() -> None:
    stream, snap, last = _subscribed(SnapshotCache())
    for t in r.PUSH_ORDER:
        assert stream.types[t].acked_version == snap.version(t)
    resp = last[r.CLUSTER_TYPE]
    step = stream.handle_request(_req(r.CLUSTER_TYPE, nonce=resp.nonce, version=resp.version_info), snap)
    assert step.responses == ()
    assert step.events == (AckReceived(type_url=r.CLUSTER_TYPE, version=resp.version_info, nonce=resp.nonce),)


def test_nack_is_reported_and_the_rejected_version_never_resent() -> None:
    cache = SnapshotCache()
    stream, _, _ = _subscribed(cache)
    bad = _snapshot(cache, capacity={"V100": 1.5})
    [pushed] = stream.handle_snapshot(bad).responses
    assert pushed.type_url == r.ENDPOINT_TYPE
    nack = _req(
        r.ENDPOINT_TYPE, nonce=pushed.nonce, version="kept-1", names=CLUSTERS, error="weight out of range"
    )
    step = stream.handle_request(nack, bad)
    assert step.responses == ()
    assert step.events == (
        NackReceived(
            type_url=r.ENDPOINT_TYPE,
            rejected_version=pushed.version_info,
            kept_version="kept-1",
            nonce=pushed.nonce,
            node_id="envoy-7",
            error_code=3,
            error_message="weight out of range",
        ),
    )
    # a later snapshot in which only another type changed does not resend the rejected endpoints
    other = _snapshot(cache, capacity={"V100": 1.5}, retries=5)
    assert other.version(r.ENDPOINT_TYPE) == bad.version(r.ENDPOINT_TYPE)
    assert [p.type_url for p in stream.handle_snapshot(other).responses] == [r.ROUTE_TYPE]
    # the next good endpoints are delivered
    fixed = _snapshot(cache, capacity={"V100": 1.2}, retries=5)
    [again] = stream.handle_snapshot(fixed).responses
    assert again.type_url == r.ENDPOINT_TYPE
    assert again.version_info == fixed.version(r.ENDPOINT_TYPE) != bad.version(r.ENDPOINT_TYPE)


def test_stale_nonce_is_ignored() -> None:
    cache = SnapshotCache()
    stream, _, last = _subscribed(cache)
    old = last[r.ENDPOINT_TYPE]
    newer = _snapshot(cache, capacity={"A100": 1.9})
    [pushed] = stream.handle_snapshot(newer).responses
    # an answer to the old response, even one asking for other names or carrying an error, is ignored
    for req in (
        _req(r.ENDPOINT_TYPE, nonce=old.nonce, version=old.version_info, names=CLUSTERS[:1]),
        _req(r.ENDPOINT_TYPE, nonce=old.nonce, version=old.version_info, names=CLUSTERS, error="late"),
    ):
        step = stream.handle_request(req, newer)
        assert step.responses == ()
        assert step.events == (
            StaleNonceIgnored(type_url=r.ENDPOINT_TYPE, nonce=old.nonce, latest_nonce=pushed.nonce),
        )
    assert stream.types[r.ENDPOINT_TYPE].nacked_version is None
    assert stream.types[r.ENDPOINT_TYPE].resource_names == frozenset(CLUSTERS)


def test_new_snapshot_pushes_only_changed_types() -> None:
    cache = SnapshotCache()
    stream, _, _ = _subscribed(cache)
    newer = _snapshot(cache, retries=3)
    [resp] = stream.handle_snapshot(newer).responses
    assert resp.type_url == r.ROUTE_TYPE
    assert stream.handle_snapshot(newer).responses == ()


def test_cluster_change_pushes_clusters_then_endpoints() -> None:
    cache = SnapshotCache()
    stream, snap, _ = _subscribed(cache)
    # only a cluster setting changes: endpoints are resent anyway (same version) so the cluster can warm
    newer = _snapshot(cache, panic=10)
    assert newer.version(r.ENDPOINT_TYPE) == snap.version(r.ENDPOINT_TYPE)
    responses = stream.handle_snapshot(newer).responses
    assert [p.type_url for p in responses] == [r.CLUSTER_TYPE, r.ENDPOINT_TYPE]
    assert len(responses[1].resources) == 3
    assert responses[0].nonce != responses[1].nonce


def test_full_change_is_pushed_in_make_before_break_order() -> None:
    cache = SnapshotCache()
    stream, _, _ = _subscribed(cache)
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["gateway"]["listen"] = "127.0.0.1:10001"
    doc["gateway"]["num_retries"] = 1
    doc["models"][0]["cluster"]["healthy_panic_threshold"] = 30
    doc["gpu_profiles"]["H100"]["relative_capacity"] = 4.0
    newer = cache.set_resources(r.build_resources(parse_config(doc)))
    types = [p.type_url for p in stream.handle_snapshot(newer).responses]
    assert types == [r.CLUSTER_TYPE, r.ENDPOINT_TYPE, r.LISTENER_TYPE, r.ROUTE_TYPE]


def test_ack_with_new_names_is_answered() -> None:
    stream, snap, last = _subscribed(SnapshotCache())
    resp = last[r.ENDPOINT_TYPE]
    step = stream.handle_request(
        _req(r.ENDPOINT_TYPE, nonce=resp.nonce, version=resp.version_info, names=CLUSTERS[:2]), snap
    )
    [answer] = step.responses
    assert answer.version_info == resp.version_info
    assert len(answer.resources) == 2


def test_resubscription_with_empty_nonce_is_answered_even_if_nothing_changed() -> None:
    stream, snap, last = _subscribed(SnapshotCache())
    step = stream.handle_request(_req(r.CLUSTER_TYPE), snap)
    [resp] = step.responses
    assert resp.version_info == last[r.CLUSTER_TYPE].version_info
    assert resp.nonce != last[r.CLUSTER_TYPE].nonce


def test_unknown_type_is_ignored() -> None:
    stream = SotwStream()
    t = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
    step = stream.handle_request(_req(t), None)
    assert step == type(step)(events=(UnknownTypeIgnored(type_url=t),))
    assert stream.types == {}


def test_nonces_are_unique_per_stream() -> None:
    cache = SnapshotCache()
    stream, _, last = _subscribed(cache)
    nonces = [p.nonce for p in last.values()]
    for capacity in (1.1, 1.2, 1.3):
        nonces += [
            p.nonce for p in stream.handle_snapshot(_snapshot(cache, capacity={"V100": capacity})).responses
        ]
    assert len(nonces) == len(set(nonces)) == 7


def _without_canary(cache: SnapshotCache, *, panic: int | None = None) -> Snapshot:
    """The default config with llama's v2 canary gone (its cluster, assignment and route split removed)."""
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["models"][0]["versions"] = [{"name": "v1", "traffic_percent": 100}]
    doc["endpoints"] = [e for e in doc["endpoints"] if e.get("version") != "v2"]
    if panic is not None:
        doc["models"][1]["cluster"] = {"healthy_panic_threshold": panic}
    return cache.set_resources(r.build_resources(parse_config(doc)))


def _names(resp: discovery_pb2.DiscoveryResponse) -> set[str]:
    out = set()
    for a in resp.resources:
        c = cluster_pb2.Cluster() if resp.type_url == r.CLUSTER_TYPE else None
        assert c is not None
        a.Unpack(c)
        out.add(c.name)
    return out


def test_cluster_removed_with_other_updates_is_dropped_after_the_route_change() -> None:
    cache = SnapshotCache()
    stream, snap, _ = _subscribed(cache)
    newer = _without_canary(cache, panic=10)
    responses = stream.handle_snapshot(newer).responses
    types = [p.type_url for p in responses]
    # make before break: the changed clusters (still holding v2), their endpoints, the routes that stop
    # sending to v2, and only then the clusters without v2
    assert types == [r.CLUSTER_TYPE, r.ENDPOINT_TYPE, r.ROUTE_TYPE, r.CLUSTER_TYPE]
    keep, final = responses[0], responses[-1]
    assert set(CLUSTERS) <= _names(keep)
    assert _names(keep) - _names(final) == {"llama-3.1-8b-instruct--v2"}
    assert keep.version_info == newer.version(r.CLUSTER_TYPE) + "+keep"
    assert final.version_info == newer.version(r.CLUSTER_TYPE)
    # the removed cluster goes out byte-identical in the first response (Envoy leaves it alone)
    old_v2 = snap.resources[r.CLUSTER_TYPE]["llama-3.1-8b-instruct--v2"].packed
    assert old_v2 in list(keep.resources)
    # the client ACKs the last response; the earlier nonce is stale by then
    step = stream.handle_request(_req(r.CLUSTER_TYPE, nonce=keep.nonce, version=keep.version_info), newer)
    assert isinstance(step.events[0], StaleNonceIgnored)
    step = stream.handle_request(_req(r.CLUSTER_TYPE, nonce=final.nonce, version=final.version_info), newer)
    assert step.events == (
        AckReceived(type_url=r.CLUSTER_TYPE, version=final.version_info, nonce=final.nonce),
    )
    assert stream.handle_snapshot(newer).responses == ()


def test_removal_only_push_sends_the_removal_after_the_routes() -> None:
    cache = SnapshotCache()
    stream, _, _ = _subscribed(cache)
    newer = _without_canary(cache)
    responses = stream.handle_snapshot(newer).responses
    # the clusters that stay are unchanged, so no update carries them: only the removal, after the routes
    assert [p.type_url for p in responses] == [r.ENDPOINT_TYPE, r.ROUTE_TYPE, r.CLUSTER_TYPE]
    assert "+keep" not in responses[-1].version_info
    assert "llama-3.1-8b-instruct--v2" not in _names(responses[-1])
    assert set(CLUSTERS) - {"llama-3.1-8b-instruct--v2"} <= _names(responses[-1])


def test_push_over_the_size_limit_is_withheld_whole_and_the_next_one_that_fits_is_sent() -> None:
    cache = SnapshotCache()
    stream, snap, _ = _subscribed(cache)
    bigger = _snapshot(cache, panic=10)
    # the push's real responses, planned on a copy of the stream
    sizes = [(p.ByteSize(), p.type_url) for p in copy.deepcopy(stream).handle_snapshot(bigger).responses]
    # a limit one response of the push fits under and the other does not: neither is sent
    small, large = sorted(sizes)
    assert small[0] < large[0] - 1
    stream.max_response_bytes = large[0] - 1
    step = stream.handle_snapshot(bigger)
    assert step.responses == ()
    [withheld] = step.events
    assert isinstance(withheld, OversizedResponseWithheld)
    assert withheld.type_url == large[1] and withheld.limit == large[0] - 1
    assert withheld.byte_size > withheld.limit
    # nothing was committed: the client still holds the first snapshot's clusters
    assert stream.types[r.CLUSTER_TYPE].sent_version == snap.version(r.CLUSTER_TYPE)
    stream.max_response_bytes = 4 * 1024 * 1024
    sent = stream.handle_snapshot(bigger).responses
    assert [p.type_url for p in sent] == [r.CLUSTER_TYPE, r.ENDPOINT_TYPE]
    for p in sent:
        assert p.ByteSize() <= stream.max_response_bytes


def test_new_subscription_over_the_size_limit_is_not_answered() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    stream = SotwStream(max_response_bytes=100)
    step = stream.handle_request(_req(r.CLUSTER_TYPE, node=NODE), snap)
    assert step.responses == ()
    assert isinstance(step.events[-1], OversizedResponseWithheld)
    assert stream.types[r.CLUSTER_TYPE].sent_version is None
