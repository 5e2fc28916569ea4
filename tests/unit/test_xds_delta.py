"""xds_server.delta: the incremental (Delta) protocol rules of one ADS stream, without gRPC."""

from __future__ import annotations

from typing import Any

import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from inferlb.config.schema import default_config_path, parse_config
from xds_server import resources as r
from xds_server.cache import Snapshot, SnapshotCache
from xds_server.delta import DeltaStream, SharedDeltaResponses, held_versions
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, METER_CLUSTER
from xds_server.sotw import AckReceived, NackReceived, StaleNonceIgnored, SubscriptionOpened

CLUSTERS = ["llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1"]
#: The default config's request-path clusters (``ext_proc.protocol: ext_authz`` metering responses): the
#: check service and the settler.
REQUEST_PATH_CLUSTERS = [EXT_AUTHZ_CLUSTER, METER_CLUSTER]
ALL_CLUSTERS = sorted([*CLUSTERS, *REQUEST_PATH_CLUSTERS])
NODE = base_pb2.Node(id="envoy-delta-1", cluster="inferlb-gateway")


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _snapshot(cache: SnapshotCache, doc: dict[str, Any] | None = None) -> Snapshot:
    return cache.set_resources(r.build_resources(parse_config(doc or _doc())))


def _req(
    type_url: str,
    *,
    subscribe: list[str] | None = None,
    unsubscribe: list[str] | None = None,
    nonce: str = "",
    initial: dict[str, str] | None = None,
    error: str | None = None,
) -> discovery_pb2.DeltaDiscoveryRequest:
    req = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url,
        resource_names_subscribe=subscribe or [],
        resource_names_unsubscribe=unsubscribe or [],
        response_nonce=nonce,
        initial_resource_versions=initial or {},
        node=NODE,
    )
    if error is not None:
        req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return req


def _names(resp: discovery_pb2.DeltaDiscoveryResponse) -> list[str]:
    return sorted(res.name for res in resp.resources)


def _subscribed(cache: SnapshotCache, snap: Snapshot) -> DeltaStream:
    """A stream holding (and having ACKed) every cluster and every endpoint assignment."""
    stream = DeltaStream(control_plane_id=cache.instance_id)
    cds = stream.handle_request(_req(r.CLUSTER_TYPE), snap).responses[0]
    stream.handle_request(_req(r.CLUSTER_TYPE, nonce=cds.nonce), snap)
    eds = stream.handle_request(_req(r.ENDPOINT_TYPE, subscribe=CLUSTERS), snap).responses[0]
    stream.handle_request(_req(r.ENDPOINT_TYPE, nonce=eds.nonce), snap)
    return stream


def test_wildcard_subscription_gets_every_resource_with_its_digest_version() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    stream = DeltaStream(control_plane_id=cache.instance_id)
    step = stream.handle_request(_req(r.CLUSTER_TYPE), snap)
    assert stream.node_id == "envoy-delta-1"
    assert isinstance(step.events[0], SubscriptionOpened)
    (resp,) = step.responses
    assert _names(resp) == ALL_CLUSTERS
    assert resp.system_version_info == snap.version(r.CLUSTER_TYPE)
    assert resp.control_plane.identifier == cache.instance_id
    for res in resp.resources:
        assert res.version == snap.resources[r.CLUSTER_TYPE][res.name].version
    ack = stream.handle_request(_req(r.CLUSTER_TYPE, nonce=resp.nonce), snap)
    assert ack.responses == ()
    assert isinstance(ack.events[0], AckReceived)
    assert stream.types[r.CLUSTER_TYPE].acked_version == snap.version(r.CLUSTER_TYPE)


def test_initial_resource_versions_are_honoured_and_gone_ones_removed() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    held = {n: snap.resources[r.CLUSTER_TYPE][n].version for n in CLUSTERS[:2]}
    held["old-cluster--v0"] = "0123456789abcdef"
    held[CLUSTERS[2]] = "ffffffffffffffff"  # an older version of a cluster that still exists
    stream = DeltaStream()
    (resp,) = stream.handle_request(_req(r.CLUSTER_TYPE, initial=held), snap).responses
    # only what the reconnecting client lacks or holds in another version; the vanished one is removed
    assert _names(resp) == sorted([CLUSTERS[2], *REQUEST_PATH_CLUSTERS])
    assert list(resp.removed_resources) == ["old-cluster--v0"]


def test_new_subscription_is_answered_even_when_the_client_is_up_to_date() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    held = {n: res.version for n, res in snap.resources[r.CLUSTER_TYPE].items()}
    (resp,) = DeltaStream().handle_request(_req(r.CLUSTER_TYPE, initial=held), snap).responses
    assert list(resp.resources) == []
    assert list(resp.removed_resources) == []
    assert resp.system_version_info == snap.version(r.CLUSTER_TYPE)


def test_named_subscribe_and_unsubscribe() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    stream = DeltaStream()
    (first,) = stream.handle_request(_req(r.ENDPOINT_TYPE, subscribe=CLUSTERS[:1]), snap).responses
    assert _names(first) == CLUSTERS[:1]
    # an empty pool is a resource too: an assignment with no endpoints, sent at once
    (more,) = stream.handle_request(_req(r.ENDPOINT_TYPE, subscribe=CLUSTERS[1:]), snap).responses
    assert _names(more) == CLUSTERS[1:]
    # unsubscribing forgets it; subscribing again resends it
    assert stream.handle_request(_req(r.ENDPOINT_TYPE, unsubscribe=[CLUSTERS[0]]), snap).responses == ()
    assert CLUSTERS[0] not in held_versions(stream)[r.ENDPOINT_TYPE]
    (again,) = stream.handle_request(_req(r.ENDPOINT_TYPE, subscribe=[CLUSTERS[0]]), snap).responses
    assert _names(again) == CLUSTERS[:1]


def test_a_weight_change_sends_only_the_changed_assignment() -> None:
    cache = SnapshotCache()
    stream = _subscribed(cache, _snapshot(cache))
    doc = _doc()
    doc["gpu_profiles"]["V100"] = {"relative_capacity": 1.5}  # v100 endpoints: llama v1 and qwen
    step = stream.handle_snapshot(_snapshot(cache, doc))
    (resp,) = step.responses
    assert resp.type_url == r.ENDPOINT_TYPE
    assert _names(resp) == ["llama-3.1-8b-instruct--v1", "qwen2.5-7b-instruct--v1"]
    assert list(resp.removed_resources) == []


def test_a_cluster_change_resends_its_assignment_after_it() -> None:
    cache = SnapshotCache()
    stream = _subscribed(cache, _snapshot(cache))
    doc = _doc()
    doc["models"][1]["cluster"] = {"healthy_panic_threshold": 10}
    step = stream.handle_snapshot(_snapshot(cache, doc))
    assert [(x.type_url, _names(x)) for x in step.responses] == [
        (r.CLUSTER_TYPE, ["qwen2.5-7b-instruct--v1"]),
        (r.ENDPOINT_TYPE, ["qwen2.5-7b-instruct--v1"]),  # unchanged bytes, resent: the cluster warms
    ]


def test_removals_come_after_every_update() -> None:
    cache = SnapshotCache()
    stream = _subscribed(cache, _snapshot(cache))
    doc = _doc()
    # drop the v2 canary (its cluster and assignment go) and change a weight (an update)
    doc["models"][0]["versions"] = [{"name": "v1", "traffic_percent": 100}]
    doc["endpoints"] = [e for e in doc["endpoints"] if e.get("version") != "v2"]
    doc["gpu_profiles"]["H100"] = {"relative_capacity": 4.0}
    step = stream.handle_snapshot(_snapshot(cache, doc))
    kinds = [(x.type_url, bool(x.resources), list(x.removed_resources)) for x in step.responses]
    updates = [k for k in kinds if k[1]]
    removals = [k for k in kinds if k[2]]
    assert kinds.index(removals[0]) > kinds.index(updates[-1])
    assert [k[0] for k in removals] == [r.ENDPOINT_TYPE, r.CLUSTER_TYPE]
    assert all(k[2] == ["llama-3.1-8b-instruct--v2"] for k in removals)


def test_nack_is_reported_and_the_rejected_versions_are_not_resent() -> None:
    cache = SnapshotCache()
    stream = _subscribed(cache, _snapshot(cache))
    doc = _doc()
    doc["gpu_profiles"]["A100"] = {"relative_capacity": 2.0}
    bad = _snapshot(cache, doc)
    (push,) = stream.handle_snapshot(bad).responses
    step = stream.handle_request(_req(r.ENDPOINT_TYPE, nonce=push.nonce, error="bad weight"), bad)
    assert step.responses == ()
    (nack,) = step.events
    assert isinstance(nack, NackReceived)
    assert nack.rejected_version == bad.version(r.ENDPOINT_TYPE)
    assert nack.node_id == "envoy-delta-1" and nack.error_message == "bad weight"
    # the same snapshot again (a wake-up) does not resend what was rejected
    assert stream.handle_snapshot(bad).responses == ()
    # the next change is delivered
    doc["gpu_profiles"]["A100"] = {"relative_capacity": 2.5}
    (good,) = stream.handle_snapshot(_snapshot(cache, doc)).responses
    assert good.type_url == r.ENDPOINT_TYPE and good.resources


def test_unknown_nonce_is_stale_and_ignored() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    stream = _subscribed(cache, snap)
    step = stream.handle_request(_req(r.CLUSTER_TYPE, nonce="999"), snap)
    assert step.responses == ()
    assert isinstance(step.events[0], StaleNonceIgnored)


def test_a_push_larger_than_the_response_limit_is_split_into_chunks() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    sizes = {n: len(res.packed.value) for n, res in snap.resources[r.ENDPOINT_TYPE].items()}
    limit = max(sizes.values()) + 200  # room for about one assignment per response
    stream = DeltaStream(max_response_bytes=limit)
    step = stream.handle_request(_req(r.ENDPOINT_TYPE, subscribe=CLUSTERS), snap)
    assert len(step.responses) >= 2
    got = [res.name for resp in step.responses for res in resp.resources]
    assert sorted(got) == CLUSTERS  # every assignment once, across the chunks
    assert len({resp.nonce for resp in step.responses}) == len(step.responses)
    for resp in step.responses:
        assert sum(len(res.resource.value) for res in resp.resources) <= limit
    # each chunk is ACKed on its own nonce
    for resp in step.responses:
        ack = stream.handle_request(_req(r.ENDPOINT_TYPE, nonce=resp.nonce), snap)
        assert isinstance(ack.events[0], AckReceived)


def _shared_subscribed(cache: SnapshotCache, snap: Snapshot, shared: SharedDeltaResponses) -> DeltaStream:
    stream = DeltaStream(control_plane_id=cache.instance_id, shared=shared)
    for t, names in ((r.CLUSTER_TYPE, None), (r.ENDPOINT_TYPE, CLUSTERS)):
        [resp] = stream.handle_request(_req(t, subscribe=names), snap).responses
        assert stream.handle_request(_req(t, nonce=resp.nonce), snap).responses == ()
    return stream


def test_streams_sending_the_same_push_share_one_response_and_its_bytes() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    shared = SharedDeltaResponses(cache.instance_id)
    streams = [_shared_subscribed(cache, snap, shared) for _ in range(3)]
    doc = _doc()
    doc["gpu_profiles"]["V100"]["relative_capacity"] = 1.5
    newer = _snapshot(cache, doc)
    pushes = [s.handle_snapshot(newer).responses for s in streams]
    [first] = pushes[0]
    assert all(p == (first,) and p[0] is first for p in pushes)  # one object for all three
    assert first.type_url == r.ENDPOINT_TYPE
    data = shared.serialized(first)
    assert data == first.SerializeToString()
    assert shared.serialized(first) is data  # serialized once
    # each stream ACKs the shared nonce and is up to date
    for s in streams:
        step = s.handle_request(_req(r.ENDPOINT_TYPE, nonce=first.nonce), newer)
        assert isinstance(step.events[0], AckReceived)
        assert s.handle_snapshot(newer).responses == ()
    # an own (unshared) response is never served as shared bytes
    lone = DeltaStream()
    [own] = lone.handle_request(_req(r.CLUSTER_TYPE), newer).responses
    assert shared.serialized(own) is None


def test_the_same_content_twice_on_one_stream_gets_a_fresh_nonce() -> None:
    cache = SnapshotCache()
    snap = _snapshot(cache)
    shared = SharedDeltaResponses(cache.instance_id)
    stream = _shared_subscribed(cache, snap, shared)
    other = _shared_subscribed(cache, snap, shared)
    # the client drops an assignment and asks for it again: the same content as a moment ago
    stream.handle_request(_req(r.ENDPOINT_TYPE, unsubscribe=[CLUSTERS[0]]), snap)
    [again] = stream.handle_request(_req(r.ENDPOINT_TYPE, subscribe=[CLUSTERS[0]]), snap).responses
    stream.handle_request(_req(r.ENDPOINT_TYPE, unsubscribe=[CLUSTERS[0]]), snap)
    [twice] = stream.handle_request(_req(r.ENDPOINT_TYPE, subscribe=[CLUSTERS[0]]), snap).responses
    assert _names(again) == _names(twice) == [CLUSTERS[0]]
    assert again.nonce != twice.nonce
    # the other stream may still get the shared one
    other.handle_request(_req(r.ENDPOINT_TYPE, unsubscribe=[CLUSTERS[0]]), snap)
    [its] = other.handle_request(_req(r.ENDPOINT_TYPE, subscribe=[CLUSTERS[0]]), snap).responses
    assert its is again
