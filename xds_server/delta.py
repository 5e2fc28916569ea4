"""Delta (incremental) xDS protocol state of one ADS stream, with no I/O.

The twin of :mod:`xds_server.sotw` for ``DeltaAggregatedResources`` (envoy/api/xds_protocol,
"Incremental xDS"). Each resource carries its own version (:attr:`SnapshotResource.version`, a digest of its
bytes), so a push sends only the resources whose bytes changed and names the ones that went away. Rules:

- the first request of a type opens its subscription: ``initial_resource_versions`` says what the client
  already holds (a reconnecting Envoy), an empty ``resource_names_subscribe`` on a cluster or listener
  subscription (or ``"*"``) means wildcard, names subscribe to those resources; it is answered at once,
  with an empty response when the client is already up to date (new subscriptions are always answered);
- a later request may subscribe (answered with what the client lacks) and unsubscribe (the client forgets
  those resources; a later subscribe resends them);
- ``response_nonce`` names the response being ACKed or NACKed; each response is its own unit in Delta, so
  any nonce still pending counts, and an unknown one is stale and ignored;
- a NACK (``error_detail``) is reported and not answered: the rejected versions count as sent, so they are
  never resent; the next change to those resources is;
- responses stay under gRPC's 4 MB default: a bigger push is split into several responses
  (:attr:`DeltaStream.max_response_bytes`);
- a snapshot push sends, per subscribed type in :data:`PUSH_ORDER`, the resources whose version differs
  from what the client holds, resending a cluster's assignment whenever the cluster itself was sent
  (warming, envoy#31535) and the routes whenever a listener was; removals go in a second pass, in reverse
  order (routes, listeners, endpoints, clusters), after every update (make before break).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from xds_server.cache import Snapshot, SnapshotResource
from xds_server.resources.common import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, PUSH_ORDER, ROUTE_TYPE
from xds_server.sotw import (
    MAX_RESPONSE_BYTES,
    AckReceived,
    NackReceived,
    ResponseSent,
    StaleNonceIgnored,
    StreamEvent,
    SubscriptionOpened,
    UnknownTypeIgnored,
)

#: Types a subscription with no names subscribes to in full (legacy wildcard, xds_protocol).
WILDCARD_TYPES = frozenset({CLUSTER_TYPE, LISTENER_TYPE})
WILDCARD = "*"
#: Per-resource framing estimate in a response (Resource tags, version, Any type URL) (bytes).
RESOURCE_OVERHEAD_BYTES = 128
#: The type whose resources are resent (by the same name) after the key type's were in one push.
_RESEND_AFTER = {ENDPOINT_TYPE: CLUSTER_TYPE, ROUTE_TYPE: LISTENER_TYPE}


@dataclass(frozen=True, kw_only=True)
class DeltaStep:
    """The outcome of one input: Delta responses to write in order, and what happened."""

    responses: tuple[discovery_pb2.DeltaDiscoveryResponse, ...] = ()
    events: tuple[StreamEvent, ...] = ()


@dataclass
class DeltaTypeState:
    """Per-type state of a Delta stream (mutable, owned by one :class:`DeltaStream`).

    Attributes:
        wildcard: subscribed to every resource of the type.
        names: resources subscribed to by name.
        client_versions: ``{name: version}`` the client holds (or was last sent, ACKed or not).
        pending: ``{nonce: (system_version, {name: version or None for a removal})}`` not yet answered.
        sent_version / acked_version: ``system_version_info`` of the last response sent / ACKed.
        nacked_version: ``system_version_info`` of the last NACKed response, or None.
    """

    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    client_versions: dict[str, str] = field(default_factory=dict)
    pending: dict[str, tuple[str, dict[str, str | None]]] = field(default_factory=dict)
    sent_version: str | None = None
    acked_version: str | None = None
    nacked_version: str | None = None

    def wants(self, name: str) -> bool:
        """True when the client subscribed to this resource (by name or wildcard)."""
        return self.wildcard or name in self.names


class SharedDeltaResponses:
    """Delta responses built once per content and shared by every stream that sends the same thing.

    A snapshot push usually sends every Delta client the same changed resources (a 1% weight change on a
    10,000-endpoint fleet: ~60 assignments, ~0.6 MB); building that response per stream costs ~0.7 ms of
    copying and serializing it again ~0.8 ms, 150 ms per push over 100 streams. Here each distinct
    response (type, system version, each resource's name and version, the removed names) is built once,
    with a nonce from one counter shared by every stream (so nonces stay unique on each stream), and
    serialized at most once (:meth:`serialized`, for the ADS servicer's pass-through serializer).

    Args:
        control_plane_id: ``control_plane.identifier`` of every response.
        max_entries, max_bytes: the memo is emptied when it holds more responses, or more serialized
            bytes, than this (pushes keep adding new contents).
    """

    def __init__(
        self, control_plane_id: str = "", *, max_entries: int = 512, max_bytes: int = 64 * 1024 * 1024
    ) -> None:
        self.control_plane_id = control_plane_id
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._bytes_total = 0
        self.nonces = itertools.count(1)
        self._by_content: dict[tuple[object, ...], discovery_pb2.DeltaDiscoveryResponse] = {}
        self._bytes: dict[int, tuple[discovery_pb2.DeltaDiscoveryResponse, bytes]] = {}
        #: responses served from the memo / built
        self.hits = 0
        self.misses = 0

    def response(
        self, type_url: str, version: str, resources: Sequence[SnapshotResource], removed: Sequence[str]
    ) -> discovery_pb2.DeltaDiscoveryResponse:
        """The shared response carrying exactly these resources and removals (never mutate it)."""
        key = (type_url, version, tuple((r.name, r.version) for r in resources), tuple(removed))
        hit = self._by_content.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        if len(self._by_content) >= self.max_entries or self._bytes_total >= self.max_bytes:
            self._by_content.clear()
            self._bytes.clear()
            self._bytes_total = 0
        response = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=version,
            type_url=type_url,
            nonce=str(next(self.nonces)),
            resources=[r.delta for r in resources],
            removed_resources=removed,
            control_plane=base_pb2.ControlPlane(identifier=self.control_plane_id),
        )
        self._by_content[key] = response
        return response

    def serialized(self, response: discovery_pb2.DeltaDiscoveryResponse) -> bytes | None:
        """The wire bytes of a response this memo built (serialized on first use), else None."""
        entry = self._bytes.get(id(response))
        if entry is not None and entry[0] is response:
            return entry[1]
        built = self._by_content.get(self._key_of(response))
        if built is None or built is not response:
            return None
        data: bytes = built.SerializeToString()
        self._bytes[id(response)] = (response, data)
        self._bytes_total += len(data)
        return data

    @staticmethod
    def _key_of(response: discovery_pb2.DeltaDiscoveryResponse) -> tuple[object, ...]:
        return (
            response.type_url,
            response.system_version_info,
            tuple((r.name, r.version) for r in response.resources),
            tuple(response.removed_resources),
        )


@dataclass
class DeltaStream:
    """The Delta protocol state of one ADS stream. Not thread-safe; one per stream.

    Args:
        control_plane_id: sent as ``control_plane.identifier`` in every response.
    """

    control_plane_id: str = ""
    #: serve this type only (a per-type discovery service); requests for others are ignored
    only_type: str | None = None
    #: split a push whose resources add up to more than this into several responses (gRPC clients
    #: refuse messages over 4 MB by default; a single larger resource still goes alone)
    max_response_bytes: int = MAX_RESPONSE_BYTES
    #: responses shared with other streams (None: this stream builds its own)
    shared: SharedDeltaResponses | None = None
    node: base_pb2.Node | None = None
    types: dict[str, DeltaTypeState] = field(default_factory=dict)
    _nonces: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    #: nonces of shared responses this stream sent (one content twice on a stream gets a fresh nonce)
    _shared_sent: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.shared is not None:
            # one nonce counter for shared and own responses: unique on this stream either way
            self._nonces = self.shared.nonces

    @property
    def node_id(self) -> str:
        """The node id from the stream's first request ("" until known)."""
        return self.node.id if self.node is not None else ""

    @property
    def node_cluster(self) -> str:
        """The node cluster from the stream's first request: picks the snapshot group."""
        return self.node.cluster if self.node is not None else ""

    def handle_request(
        self, request: discovery_pb2.DeltaDiscoveryRequest, snapshot: Snapshot | None
    ) -> DeltaStep:
        """Apply one DeltaDiscoveryRequest; ``snapshot`` is the current one for this node (None if none yet).

        Returns:
            the responses to send (zero or one) and the events (module docstring for the rules).
        """
        if self.node is None and request.HasField("node"):
            self.node = request.node
        t = request.type_url
        if t not in PUSH_ORDER or (self.only_type is not None and t != self.only_type):
            return DeltaStep(events=(UnknownTypeIgnored(type_url=t),))
        events: list[StreamEvent] = []
        state = self.types.get(t)
        opened = state is None
        if state is None:
            state = DeltaTypeState(client_versions=dict(request.initial_resource_versions))
            self.types[t] = state
            if not request.resource_names_subscribe and t in WILDCARD_TYPES:
                state.wildcard = True
        if request.response_nonce:
            events.append(self._ack_or_nack(t, state, request))
        for name in request.resource_names_unsubscribe:
            if name == WILDCARD:
                state.wildcard = False
            else:
                state.names.discard(name)
            if not state.wants(name):
                state.client_versions.pop(name, None)
        added = False
        for name in request.resource_names_subscribe:
            if name == WILDCARD:
                added = added or not state.wildcard
                state.wildcard = True
            elif name not in state.names:
                state.names.add(name)
                added = True
        if opened:
            names = (WILDCARD,) if state.wildcard else tuple(sorted(state.names))
            events.append(SubscriptionOpened(type_url=t, resource_names=names))
        if snapshot is None or not (opened or added):
            return DeltaStep(events=tuple(events))
        responses = self._diff(t, state, snapshot, updates=True, removals=True, answer_empty=opened)
        return DeltaStep(responses=tuple(responses), events=(*events, *(self._sent(x) for x in responses)))

    def _ack_or_nack(
        self, t: str, state: DeltaTypeState, request: discovery_pb2.DeltaDiscoveryRequest
    ) -> StreamEvent:
        nonce = request.response_nonce
        sent = state.pending.pop(nonce, None)
        if sent is None:
            latest = max(state.pending, key=int, default="")
            return StaleNonceIgnored(type_url=t, nonce=nonce, latest_nonce=latest)
        version, _resources = sent
        if request.HasField("error_detail"):
            state.nacked_version = version
            return NackReceived(
                type_url=t,
                rejected_version=version,
                kept_version=state.acked_version or "",
                nonce=nonce,
                node_id=self.node_id,
                error_code=request.error_detail.code,
                error_message=request.error_detail.message,
            )
        state.acked_version = version
        return AckReceived(type_url=t, version=version, nonce=nonce)

    def handle_snapshot(self, snapshot: Snapshot) -> DeltaStep:
        """Push a newly published snapshot: updates per type in :data:`PUSH_ORDER` (a cluster's assignment
        after the cluster, routes after a listener), then removals in reverse order."""
        responses: list[discovery_pb2.DeltaDiscoveryResponse] = []
        sent_names: dict[str, set[str]] = {}
        for t in PUSH_ORDER:
            state = self.types.get(t)
            if state is None:
                continue
            key = _RESEND_AFTER.get(t)
            force: Collection[str] = ()
            if key == CLUSTER_TYPE:
                force = sent_names.get(CLUSTER_TYPE, set())
            elif key == LISTENER_TYPE and sent_names.get(LISTENER_TYPE):
                force = snapshot.resources.get(t, {}).keys()
            chunks = self._diff(t, state, snapshot, updates=True, removals=False, force=force)
            responses.extend(chunks)
            if chunks:
                sent_names[t] = {r.name for x in chunks for r in x.resources}
        for t in reversed(PUSH_ORDER):
            state = self.types.get(t)
            if state is None:
                continue
            responses.extend(self._diff(t, state, snapshot, updates=False, removals=True))
        return DeltaStep(responses=tuple(responses), events=tuple(self._sent(r) for r in responses))

    def _diff(
        self,
        t: str,
        state: DeltaTypeState,
        snapshot: Snapshot,
        *,
        updates: bool,
        removals: bool,
        force: Collection[str] = (),
        answer_empty: bool = False,
    ) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        """The responses that bring the client up to date for one type: none when it is, else one, or
        several when the resources add up to more than :attr:`max_response_bytes` (each chunk is a
        complete Delta response with its own nonce; removals ride the last one)."""
        table = snapshot.resources.get(t, {})
        changed: list[SnapshotResource] = []
        if updates:
            names: Collection[str] = table.keys() if state.wildcard else sorted(state.names)
            held = state.client_versions
            for name in names:
                r = table.get(name)
                if r is not None and (held.get(name) != r.version or name in force):
                    changed.append(r)
        removed: list[str] = []
        if removals:
            removed = sorted(n for n in state.client_versions if n not in table)
        if not changed and not removed and not answer_empty:
            return []
        chunks: list[list[SnapshotResource]] = [[]]
        size = 0
        for r in changed:
            cost = len(r.packed.value) + len(r.name) + RESOURCE_OVERHEAD_BYTES
            if chunks[-1] and size + cost > self.max_response_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(r)
            size += cost
        version = snapshot.version(t)
        out = []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            gone = removed if last else []
            response = self._response(t, version, chunk, gone)
            record: dict[str, str | None] = {r.name: r.version for r in chunk}
            for r in chunk:
                state.client_versions[r.name] = r.version
            for name in gone:
                state.client_versions.pop(name, None)
                record[name] = None
            state.pending[response.nonce] = (version, record)
            out.append(response)
        state.sent_version = version
        return out

    def _response(
        self, t: str, version: str, chunk: Sequence[SnapshotResource], removed: Sequence[str]
    ) -> discovery_pb2.DeltaDiscoveryResponse:
        if self.shared is not None:
            response = self.shared.response(t, version, chunk, removed)
            if response.nonce not in self._shared_sent:
                if len(self._shared_sent) >= 4 * self.shared.max_entries:
                    self._shared_sent.clear()  # older shared nonces are out of the memo by now
                self._shared_sent.add(response.nonce)
                return response
        return discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=version,
            type_url=t,
            nonce=str(next(self._nonces)),
            resources=[r.delta for r in chunk],
            removed_resources=removed,
            control_plane=base_pb2.ControlPlane(identifier=self.control_plane_id),
        )

    @staticmethod
    def _sent(response: discovery_pb2.DeltaDiscoveryResponse) -> ResponseSent:
        return ResponseSent(
            type_url=response.type_url,
            version=response.system_version_info,
            nonce=response.nonce,
            resource_count=len(response.resources),
            byte_size=sum(len(r.resource.value) for r in response.resources),
        )


def held_versions(stream: DeltaStream) -> Mapping[str, Mapping[str, str]]:
    """``{type_url: {name: version}}`` the client holds per the stream's records (for tests and tools)."""
    return {t: dict(s.client_versions) for t, s in stream.types.items()}
