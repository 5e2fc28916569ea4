"""Immutable versioned snapshots of xDS resources and the cache that publishes them.

Modelled on go-control-plane's ``pkg/cache/v3`` (``snapshot.go``: ``Snapshot`` + ``Consistent()``;
``simple.go``: ``SetSnapshot`` answering the waiting watches), with the pitfalls public control planes
reported in mind:

- each resource is serialized once per snapshot (into a packed ``Any``) and shared by every stream;
- versions are ``<instance-id>-<n>``: the instance id is fresh per cache (per process start), so a version
  string never repeats across restarts, and Envoy never mistakes new resources for ones it already has;
- a type's version changes only when that type's resources changed (byte-wise), so a push resends only
  the types that changed;
- a snapshot is checked for consistency before it is published (every EDS cluster has its assignment,
  the listener's route configuration exists, no endpoint weight below 1); a refused snapshot leaves the
  current one serving.

This module does no network I/O and imports no gRPC: streams (:mod:`xds_server.ads`) read from it.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from inferlb.errors import InferlbError
from xds_server.resources.common import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    PUSH_ORDER,
    ROUTE_TYPE,
    XdsResources,
)

#: The node group every node falls back to when no snapshot was set for its own node cluster.
DEFAULT_GROUP: Final = "*"

_HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)


class SnapshotInconsistentError(InferlbError):
    """A snapshot was refused before publishing.

    Attributes:
        problems: one human-readable line per inconsistency (resource type and name included).
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("inconsistent xDS snapshot: " + "; ".join(problems))


def new_instance_id() -> str:
    """A short id unique per call (per process start when called once at start-up): seconds since the
    epoch in hex plus 24 random bits, so two servers started in the same second still differ."""
    return f"{int(time.time()):x}{secrets.token_hex(3)}"


@dataclass(frozen=True, kw_only=True)
class SnapshotResource:
    """One resource of a snapshot, serialized once.

    Attributes:
        name: the xDS resource name.
        message: the proto (never mutate it: it is shared by every stream).
        packed: ``message`` packed into an ``Any`` (deterministic serialization), ready for a
            ``DiscoveryResponse``.
        digest: sha256 hex of the serialized bytes.
        version: the resource's Delta xDS version: the first :data:`RESOURCE_VERSION_CHARS` hex digits of
            ``digest`` (equal bytes give equal versions, across snapshots and server restarts, so an Envoy
            reconnecting with ``initial_resource_versions`` is not resent what it already has).
        delta: ``packed`` wrapped in a Delta ``Resource`` (name, version), built once and shared.
    """

    name: str
    message: Message
    packed: any_pb2.Any
    digest: str
    version: str
    delta: discovery_pb2.Resource


#: Hex digits of the sha256 digest used as a Delta resource version (64 bits: collisions are negligible
#: for the few thousand versions a resource name goes through).
RESOURCE_VERSION_CHARS: Final = 16


def _serialize(name: str, msg: Message) -> SnapshotResource:
    body = msg.SerializeToString(deterministic=True)
    packed = any_pb2.Any(type_url=f"type.googleapis.com/{msg.DESCRIPTOR.full_name}", value=body)
    digest = hashlib.sha256(body).hexdigest()
    version = digest[:RESOURCE_VERSION_CHARS]
    return SnapshotResource(
        name=name,
        message=msg,
        packed=packed,
        digest=digest,
        version=version,
        delta=discovery_pb2.Resource(name=name, version=version, resource=packed),
    )


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """An immutable set of resources per type URL, with one version string per type.

    Build it with :meth:`from_resources`; the cache assigns versions with :meth:`SnapshotCache.set_resources`.

    Attributes:
        versions: ``{type_url: version}`` for every type in :data:`xds_server.resources.common.PUSH_ORDER`.
        resources: ``{type_url: {name: SnapshotResource}}`` (read-only mappings).
    """

    versions: Mapping[str, str]
    resources: Mapping[str, Mapping[str, SnapshotResource]]
    #: ``time.monotonic()`` of the first change this snapshot carries (push latency is measured from it).
    changed_at: float = 0.0
    #: the publish counter ``n`` of the newest version in this snapshot (the ``<n>`` of ``<id>-<n>``).
    serial: int = 0

    @classmethod
    def from_resources(
        cls,
        resources: XdsResources,
        versions: Mapping[str, str],
        previous: Snapshot | None = None,
        *,
        shared: Snapshot | None = None,
    ) -> Snapshot:
        """Serialize every resource once and freeze the result.

        A resource that is the very same proto object as in ``previous`` or ``shared`` (a builder's memo
        returned it unchanged; ``shared`` is another variant of the same publish) reuses its serialization:
        protos are never mutated once built, so equal identity means equal bytes.

        Raises:
            KeyError: ``versions`` lacks a type present in ``resources``.
        """

        def serialized(t: str, n: str, m: Message) -> SnapshotResource:
            for source in (previous, shared):
                old = source.resources.get(t, {}).get(n) if source is not None else None
                if old is not None and old.message is m:
                    return old
            return _serialize(n, m)

        by_type = {
            t: MappingProxyType(
                {n: serialized(t, n, m) for n, m in sorted(resources.by_type.get(t, {}).items())}
            )
            for t in PUSH_ORDER
        }
        return cls(
            versions=MappingProxyType({t: versions[t] for t in PUSH_ORDER}),
            resources=MappingProxyType(by_type),
        )

    def version(self, type_url: str) -> str:
        """The version of one type (``KeyError`` for a type this server does not serve)."""
        return self.versions[type_url]

    def select(self, type_url: str, names: Collection[str] = ()) -> list[SnapshotResource]:
        """The resources of one type, all of them when ``names`` is empty (a wildcard subscription), else
        those named that exist, in name order."""
        table = self.resources.get(type_url, {})
        if not names:
            return list(table.values())
        return [table[n] for n in sorted(set(names)) if n in table]

    def digests(self, type_url: str) -> dict[str, str]:
        """``{name: digest}`` of one type: equal dicts mean byte-identical resources."""
        return {n: r.digest for n, r in self.resources.get(type_url, {}).items()}

    def check_consistent(self, *checked: Snapshot | None) -> None:
        """Refuse a snapshot Envoy would choke on (go-control-plane ``Consistent()``, extended).

        Checks: every EDS cluster has a ClusterLoadAssignment under its service name; every route
        configuration a listener's HTTP connection manager names over RDS exists; every endpoint weight
        (and locality weight, when set) is at least 1 (Envoy NACKs 0). An assignment that is the very
        same resource as in one of the ``checked`` snapshots (already checked, reused unchanged) is not
        walked again: at 10,000 endpoints the walk costs ~7 ms a publish.

        Raises:
            SnapshotInconsistentError: listing every problem found.
        """
        problems: list[str] = []
        assignments = self.resources[ENDPOINT_TYPE]
        for r in self.resources[CLUSTER_TYPE].values():
            c = r.message
            assert isinstance(c, cluster_pb2.Cluster)
            if c.type == cluster_pb2.Cluster.EDS:
                service = c.eds_cluster_config.service_name or c.name
                if service not in assignments:
                    problems.append(f"cluster {c.name!r}: no ClusterLoadAssignment {service!r}")
        routes = self.resources[ROUTE_TYPE]
        for r in self.resources[LISTENER_TYPE].values():
            listener = r.message
            assert isinstance(listener, listener_pb2.Listener)
            for chain in listener.filter_chains:
                for f in chain.filters:
                    if f.typed_config.type_url != _HCM_TYPE:
                        continue
                    hcm = http_connection_manager_pb2.HttpConnectionManager()
                    f.typed_config.Unpack(hcm)
                    if hcm.HasField("rds") and hcm.rds.route_config_name not in routes:
                        problems.append(
                            f"listener {listener.name!r}: no RouteConfiguration {hcm.rds.route_config_name!r}"
                        )
        seen = [c.resources.get(ENDPOINT_TYPE, {}) for c in checked if c is not None]
        for name, r in assignments.items():
            if any(t.get(name) is r for t in seen):
                continue
            cla = r.message
            assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
            for loc in cla.endpoints:
                if loc.HasField("load_balancing_weight") and loc.load_balancing_weight.value < 1:
                    problems.append(
                        f"assignment {cla.cluster_name!r}: locality {loc.locality.zone!r} weight < 1"
                    )
                for lb in loc.lb_endpoints:
                    if lb.HasField("load_balancing_weight") and lb.load_balancing_weight.value < 1:
                        sa = lb.endpoint.address.socket_address
                        problems.append(
                            f"assignment {cla.cluster_name!r}: endpoint {sa.address}:{sa.port_value} weight "
                            f"{lb.load_balancing_weight.value} < 1"
                        )
        if problems:
            raise SnapshotInconsistentError(problems)


#: A cache watcher: called as ``watcher(group, snapshot)`` right after a snapshot is published.
SnapshotWatcher = Callable[[str, Snapshot], None]


class SnapshotCache:
    """The current snapshot per node group, and the watchers to tell when one changes.

    By default one group (:data:`DEFAULT_GROUP`) serves every node; a node whose cluster has a group of its
    own gets that one (:meth:`snapshot_for`). Each group has a second variant for the per-type discovery
    services (CDS, EDS, LDS, RDS streams): the same resources, except that clusters and listeners tell
    Envoy to fetch endpoints and routes over those services instead of ADS
    (:mod:`xds_server.config_source`); both variants share versions and are published together.
    Not thread-safe: call it from the event loop thread only.
    Watchers run synchronously inside :meth:`set_resources` and must not block (streams enqueue a wake-up).

    Args:
        instance_id: version prefix; a fresh :func:`new_instance_id` by default.
    """

    def __init__(self, *, instance_id: str | None = None) -> None:
        self.instance_id = instance_id or new_instance_id()
        self._counter = itertools.count(1)
        self._snapshots: dict[str, Snapshot] = {}
        self._per_type: dict[str, Snapshot] = {}
        self._watchers: dict[int, SnapshotWatcher] = {}
        self._watcher_ids = itertools.count()

    def snapshot(self, group: str = DEFAULT_GROUP) -> Snapshot | None:
        """The snapshot published for exactly this group, or None."""
        return self._snapshots.get(group)

    def snapshot_for(self, node_cluster: str, *, per_type: bool = False) -> Snapshot | None:
        """The snapshot a node of this Envoy node cluster gets: its own group's, else the default group's,
        else None (nothing published yet). ``per_type``: the variant for the per-type services."""
        table = self._per_type if per_type else self._snapshots
        return table.get(node_cluster) or table.get(DEFAULT_GROUP)

    def set_resources(
        self,
        resources: XdsResources,
        *,
        group: str = DEFAULT_GROUP,
        changed_at: float | None = None,
        per_type: XdsResources | None = None,
    ) -> Snapshot:
        """Version, check and publish the resources of one group, then notify every watcher.

        ``per_type`` is the group's variant for the per-type discovery services (None: the same
        resources as ADS); it is checked, versioned and published with ``resources``, and its unchanged
        protos share their serialization with them.

        ``changed_at`` is the monotonic time of the change that led to this publish (now by default).
        Each type keeps its previous version when its resources are byte-identical to the group's current
        snapshot, and otherwise gets ``<instance_id>-<n>`` with ``n`` a counter shared by the cache's
        publishes (so versions never repeat within a cache either).

        Returns:
            the published snapshot (the current one, unchanged, when nothing at all changed: no
            watcher is then notified).

        Raises:
            SnapshotInconsistentError: the snapshot fails :meth:`Snapshot.check_consistent`; nothing is
                published and the current snapshot keeps serving.
        """
        previous = self._snapshots.get(group)
        draft = Snapshot.from_resources(resources, dict.fromkeys(PUSH_ORDER, ""), previous)
        previous_pt = self._per_type.get(group)
        draft_pt = draft
        if per_type is not None:
            draft_pt = Snapshot.from_resources(
                per_type, dict.fromkeys(PUSH_ORDER, ""), previous_pt, shared=draft
            )
        changed = [
            t
            for t in PUSH_ORDER
            if previous is None
            or previous_pt is None
            or previous.digests(t) != draft.digests(t)
            or previous_pt.digests(t) != draft_pt.digests(t)
        ]
        draft.check_consistent(previous)
        if draft_pt is not draft:
            draft_pt.check_consistent(draft)
        if previous is not None and not changed:
            return previous
        serial = next(self._counter)
        fresh = f"{self.instance_id}-{serial}"
        versions = {t: fresh if previous is None or t in changed else previous.version(t) for t in PUSH_ORDER}
        stamp = time.monotonic() if changed_at is None else changed_at
        frozen = MappingProxyType(versions)
        snapshot = Snapshot(versions=frozen, resources=draft.resources, changed_at=stamp, serial=serial)
        self._snapshots[group] = snapshot
        self._per_type[group] = (
            snapshot
            if draft_pt is draft
            else Snapshot(versions=frozen, resources=draft_pt.resources, changed_at=stamp, serial=serial)
        )
        for watcher in list(self._watchers.values()):
            watcher(group, snapshot)
        return snapshot

    def groups(self) -> list[str]:
        """The groups that have a snapshot."""
        return list(self._snapshots)

    def drop(self, group: str) -> None:
        """Forget a group's snapshot (its nodes fall back to the default group's) and wake every watcher
        with the default snapshot, so streams of that group move over at once. The default group cannot be
        dropped (ValueError)."""
        if group == DEFAULT_GROUP:
            raise ValueError("the default snapshot group cannot be dropped")
        self._per_type.pop(group, None)
        if self._snapshots.pop(group, None) is None:
            return
        default = self._snapshots.get(DEFAULT_GROUP)
        if default is not None:
            for watcher in list(self._watchers.values()):
                watcher(DEFAULT_GROUP, default)

    def subscribe(self, watcher: SnapshotWatcher) -> Callable[[], None]:
        """Register a watcher; returns the function that unregisters it (idempotent)."""
        key = next(self._watcher_ids)
        self._watchers[key] = watcher

        def unsubscribe() -> None:
            self._watchers.pop(key, None)

        return unsubscribe

    @property
    def watcher_count(self) -> int:
        """How many watchers are registered (one per open ADS stream)."""
        return len(self._watchers)
