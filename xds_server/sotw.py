"""State-of-the-world (SotW) xDS protocol state of one ADS stream, with no I/O.

The servicer (:mod:`xds_server.ads`) feeds it the stream's requests and the snapshots the cache publishes,
and writes out the responses it returns; everything protocol-shaped is decided here, in plain methods a
unit test can drive. The rules (envoy/api/xds_protocol, "ACK and NACK semantics", and the pitfalls
public control planes reported, e.g. go-control-plane#962 on NACK loops):

- a request for a type not subscribed yet, or with an empty ``response_nonce``, is a new subscription: it is
  answered at once with the current snapshot, even if its version did not change;
- a request whose ``response_nonce`` is not the latest one sent for its type is stale and ignored;
- a request carrying ``error_detail`` is a NACK of the version last sent: it is reported (node id, detail)
  and NOT answered by resending that version (the go-control-plane#962 loop); the stream waits for the next
  snapshot, and a later snapshot never resends a type whose version is the rejected one;
- any other request with the latest nonce is an ACK; it is answered only when it changes the resource
  names subscribed to (Envoy asks for new clusters' endpoints that way);
- a new snapshot pushes every subscribed type whose version changed, in :data:`PUSH_ORDER` (clusters,
  endpoints, listeners, routes: make before break); endpoints are resent whenever clusters were (a
  changed cluster warms until it gets its assignment, envoy#31535), and routes whenever listeners were;
- removals come after every update, in reverse order (listeners, then clusters): in SotW a wildcard type
  (clusters, listeners) loses a resource by leaving it out of a response, so when a push both changes and
  removes clusters (or listeners), the update goes first with the removed ones still in it (a version
  ``<version>+keep``, their bytes unchanged so Envoy does not touch them), and the response that drops
  them goes last, after the routes that stopped referencing them (go-control-plane and Istio order
  removals the same way); a push that only removes sends that one response, in the removal pass;
- no response is ever larger than :attr:`SotwStream.max_response_bytes` (gRPC clients refuse messages
  over 4 MiB by default and SotW cannot split a type across responses): a push that would need a larger
  one is withheld whole (:class:`OversizedResponseWithheld`, logged and counted), so the client keeps its
  last consistent state, and the next snapshot that fits is pushed; Delta streams split instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from xds_server.cache import Snapshot, SnapshotResource
from xds_server.resources.common import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, PUSH_ORDER, ROUTE_TYPE

#: Types whose SotW subscription names specific resources (the others are wildcard: all resources).
NAMED_TYPES = frozenset({ENDPOINT_TYPE, ROUTE_TYPE})
#: A type that must be resent after the key type was sent in the same push (warming, make-before-break).
_RESEND_AFTER = {ENDPOINT_TYPE: CLUSTER_TYPE, ROUTE_TYPE: LISTENER_TYPE}
#: gRPC's default maximum receive message size is 4 MiB (grpc/include/grpc/impl/channel_arg_names.h,
#: GRPC_DEFAULT_MAX_RECV_MESSAGE_LENGTH); stay under it with room for framing and headers (bytes).
MAX_RESPONSE_BYTES = 4 * 1024 * 1024 - 64 * 1024
#: Suffix of the version of a SotW update that still carries the resources a later response removes.
KEEP_SUFFIX = "+keep"


# -- what happened on a stream (past-tense events, for logs and counters) --------------------------------
@dataclass(frozen=True, kw_only=True)
class SubscriptionOpened:
    """A type was subscribed to (first request for it, or a request with an empty nonce)."""

    type_url: str
    resource_names: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ResponseSent:
    """A DiscoveryResponse was produced for the stream."""

    type_url: str
    version: str
    nonce: str
    resource_count: int
    #: serialized size of the resources carried (bytes): gRPC clients refuse messages over 4 MiB
    byte_size: int = 0


@dataclass(frozen=True, kw_only=True)
class AckReceived:
    """The client accepted a version (its request carried the latest nonce and no error_detail)."""

    type_url: str
    version: str
    nonce: str


@dataclass(frozen=True, kw_only=True)
class NackReceived:
    """The client rejected a version: ``rejected_version`` will not be resent on this stream.

    ``kept_version`` is the version the client still runs (``version_info`` of the NACK)."""

    type_url: str
    rejected_version: str
    kept_version: str
    nonce: str
    node_id: str
    error_code: int
    error_message: str


@dataclass(frozen=True, kw_only=True)
class StaleNonceIgnored:
    """A request answered a response that is no longer the latest for its type; ignored."""

    type_url: str
    nonce: str
    latest_nonce: str


@dataclass(frozen=True, kw_only=True)
class UnknownTypeIgnored:
    """A request for a type this server does not serve; ignored."""

    type_url: str


@dataclass(frozen=True, kw_only=True)
class OversizedResponseWithheld:
    """A response would have exceeded the stream's ``max_response_bytes``: it (and the rest of its push)
    was not sent; the client keeps what it has until a snapshot that fits is published."""

    type_url: str
    version: str
    byte_size: int
    limit: int


StreamEvent = (
    SubscriptionOpened
    | ResponseSent
    | AckReceived
    | NackReceived
    | StaleNonceIgnored
    | UnknownTypeIgnored
    | OversizedResponseWithheld
)


@dataclass(frozen=True, kw_only=True)
class Step:
    """The outcome of one input: responses to write in order, and what happened."""

    responses: tuple[discovery_pb2.DiscoveryResponse, ...] = ()
    events: tuple[StreamEvent, ...] = ()


@dataclass
class TypeState:
    """Per-type state of a stream (mutable, owned by one :class:`SotwStream`).

    Attributes:
        resource_names: names of the latest accepted request (empty = wildcard).
        sent_names: the names the last response was filtered by.
        sent_version / sent_nonce: of the last response (None before the first).
        acked_version: the last version the client ACKed (None before the first ACK).
        nacked_version: the last version the client rejected (never resent), or None.
        sent_resources: ``{name: resource}`` of the last response (what a wildcard client now holds).
    """

    resource_names: frozenset[str] = frozenset()
    sent_names: frozenset[str] = frozenset()
    sent_version: str | None = None
    sent_nonce: str | None = None
    acked_version: str | None = None
    nacked_version: str | None = None
    sent_resources: dict[str, SnapshotResource] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class _Planned:
    """A response built but not yet committed to the stream's state (a push is all or nothing)."""

    type_url: str
    version: str
    names: frozenset[str]
    resources: tuple[SnapshotResource, ...]
    response: discovery_pb2.DiscoveryResponse
    byte_size: int


@dataclass
class SotwStream:
    """The SotW protocol state of one ADS stream. Not thread-safe; one per stream.

    Args:
        control_plane_id: sent as ``control_plane.identifier`` in every response (the cache's instance id).
    """

    control_plane_id: str = ""
    #: serve this type only (a per-type discovery service); requests for others are ignored
    only_type: str | None = None
    #: never send a response whose serialized size is over this (bytes); see the module docstring
    max_response_bytes: int = MAX_RESPONSE_BYTES
    node: base_pb2.Node | None = None
    types: dict[str, TypeState] = field(default_factory=dict)
    #: nonces sent so far (a plain counter: a stream's state is copied, and itertools objects lose copy
    #: support in Python 3.14)
    _nonces_sent: int = 0

    @property
    def node_id(self) -> str:
        """The node id from the stream's first request ("" until known)."""
        return self.node.id if self.node is not None else ""

    @property
    def node_cluster(self) -> str:
        """The node cluster from the stream's first request ("" until known): picks the snapshot group."""
        return self.node.cluster if self.node is not None else ""

    def handle_request(self, request: discovery_pb2.DiscoveryRequest, snapshot: Snapshot | None) -> Step:
        """Apply one DiscoveryRequest; ``snapshot`` is the current one for this node (None if none yet).

        Returns:
            the responses to send (zero or one) and the events (see the module docstring for the rules).
        """
        if self.node is None and request.HasField("node"):
            self.node = request.node
        t = request.type_url
        if t not in PUSH_ORDER or (self.only_type is not None and t != self.only_type):
            return Step(events=(UnknownTypeIgnored(type_url=t),))
        names = frozenset(request.resource_names)
        state = self.types.get(t)
        if state is None or not request.response_nonce:
            state = state or TypeState()
            self.types[t] = state
            state.resource_names = names
            opened = SubscriptionOpened(type_url=t, resource_names=tuple(sorted(names)))
            if snapshot is None:
                return Step(events=(opened,))
            return self._respond(t, state, snapshot, (opened,))
        if request.response_nonce != state.sent_nonce:
            return Step(
                events=(
                    StaleNonceIgnored(
                        type_url=t, nonce=request.response_nonce, latest_nonce=state.sent_nonce or ""
                    ),
                )
            )
        state.resource_names = names
        if request.HasField("error_detail"):
            rejected = state.sent_version or ""
            state.nacked_version = rejected
            nack = NackReceived(
                type_url=t,
                rejected_version=rejected,
                kept_version=request.version_info,
                nonce=request.response_nonce,
                node_id=self.node_id,
                error_code=request.error_detail.code,
                error_message=request.error_detail.message,
            )
            return Step(events=(nack,))
        state.acked_version = request.version_info
        ack = AckReceived(type_url=t, version=request.version_info, nonce=request.response_nonce)
        if (
            snapshot is not None
            and t in NAMED_TYPES
            and names != state.sent_names
            and snapshot.version(t) != state.nacked_version
        ):
            return self._respond(t, state, snapshot, (ack,))
        return Step(events=(ack,))

    def handle_snapshot(self, snapshot: Snapshot) -> Step:
        """Push a newly published snapshot: every subscribed type whose version changed (and is not the
        one the client rejected), in :data:`PUSH_ORDER`, endpoints after any cluster push and routes after
        any listener push; then the responses that remove clusters or listeners, listeners first. The push
        is withheld whole when one of its responses would be over :attr:`max_response_bytes`."""
        planned: list[_Planned] = []
        removals: list[str] = []
        pushed: set[str] = set()
        for t in PUSH_ORDER:
            state = self.types.get(t)
            if state is None:
                continue
            version = snapshot.version(t)
            if version == state.nacked_version:
                continue
            forced = _RESEND_AFTER.get(t) in pushed
            if not (state.sent_version is None or version != state.sent_version or forced):
                continue
            table = snapshot.resources.get(t, {})
            gone = [r for n, r in state.sent_resources.items() if n not in table]
            if t in NAMED_TYPES or not gone:
                planned.append(self._plan(t, state, snapshot))
                pushed.add(t)
                continue
            removals.append(t)
            held = state.sent_resources
            if forced or any(held.get(n) is None or held[n].digest != r.digest for n, r in table.items()):
                # make before break: the update first, still holding what the removal pass drops
                keep = tuple(sorted((*table.values(), *gone), key=lambda r: r.name))
                planned.append(self._plan(t, state, snapshot, resources=keep, version=version + KEEP_SUFFIX))
                pushed.add(t)
        for t in reversed(PUSH_ORDER):
            if t in removals:
                planned.append(self._plan(t, self.types[t], snapshot))
        too_big = next((p for p in planned if p.byte_size > self.max_response_bytes), None)
        if too_big is not None:
            return Step(events=(self._withheld(too_big),))
        return self._commit(planned, ())

    def _respond(self, t: str, state: TypeState, snapshot: Snapshot, events: Sequence[StreamEvent]) -> Step:
        plan = self._plan(t, state, snapshot)
        if plan.byte_size > self.max_response_bytes:
            return Step(events=(*events, self._withheld(plan)))
        return self._commit([plan], events)

    def _plan(
        self,
        t: str,
        state: TypeState,
        snapshot: Snapshot,
        *,
        resources: tuple[SnapshotResource, ...] | None = None,
        version: str | None = None,
    ) -> _Planned:
        names = state.resource_names if t in NAMED_TYPES else frozenset()
        selected = tuple(snapshot.select(t, names)) if resources is None else resources
        version = snapshot.version(t) if version is None else version
        self._nonces_sent += 1
        response = discovery_pb2.DiscoveryResponse(
            version_info=version,
            type_url=t,
            nonce=str(self._nonces_sent),
            resources=[r.packed for r in selected],
            control_plane=base_pb2.ControlPlane(identifier=self.control_plane_id),
        )
        return _Planned(
            type_url=t,
            version=version,
            names=names,
            resources=selected,
            response=response,
            byte_size=response.ByteSize(),
        )

    def _commit(self, planned: Sequence[_Planned], events: Sequence[StreamEvent]) -> Step:
        out: list[StreamEvent] = list(events)
        for p in planned:
            state = self.types[p.type_url]
            state.sent_version, state.sent_nonce, state.sent_names = p.version, p.response.nonce, p.names
            state.sent_resources = {r.name: r for r in p.resources}
            out.append(
                ResponseSent(
                    type_url=p.type_url,
                    version=p.version,
                    nonce=p.response.nonce,
                    resource_count=len(p.resources),
                    byte_size=p.byte_size,
                )
            )
        return Step(responses=tuple(p.response for p in planned), events=tuple(out))

    def _withheld(self, plan: _Planned) -> OversizedResponseWithheld:
        return OversizedResponseWithheld(
            type_url=plan.type_url,
            version=plan.version,
            byte_size=plan.byte_size,
            limit=self.max_response_bytes,
        )
