"""Endpoint picking on the request path, both modes (ext_proc's stream and ext_authz's check): for a
request to a model with ``endpoint_picking``, :func:`choose` orders the model version's endpoints with
:func:`inferlb.policy.picker.pick`, and the adapters hand the list to Envoy as the Gateway API Inference
Extension's endpoint-picker protocol does: header ``x-gateway-destination-endpoint: ip:port[,ip:port...]``
(both modes; in ext_authz mode through ``allowed_upstream_headers``) and, in ext_proc mode, the same value
in dynamic metadata ``envoy.lb`` (ext_authz's filter writes only its own namespace). The model's clusters
run Envoy's ``override_host`` policy (:func:`xds_server.resources.clusters.override_host_policy`), reading
the metadata in ext_proc mode and the header in ext_authz mode (one source: Envoy joins the lists of all
it finds), and the header still reaches the model server in both: the first listed host gets the
request, a retry the next, and with none usable the cluster's own least-request balancing picks. A
client's own header is removed by the gateway's early header mutation before any filter runs, so it never
reaches ``override_host``.

Where the state lives and how it reaches each replica:

- **Fleet state** (which endpoints a cluster has, their served EDS weights, health, queue and KV-cache
  usage): the xDS server, which already builds EDS and scrapes each model server's ``/metrics``; for
  picking models it scrapes whatever ``weights.mode`` and also probes each endpoint's health path with the
  model's health-check thresholds (Envoy's own active checks are per Envoy and not visible to us). It
  serves the join at ``GET /v1/picking`` behind the fleet API's token.
- **Each request-path process** polls that every ``ext_proc.endpoint_state_poll_ms`` (250 ms) in a task of
  its own (:class:`EndpointStatePoller`), never on a request's path, and keeps the last good answer in its
  :class:`~inferlb.policy.endpoint_book.EndpointBook`. A failed poll (the xDS server down, slow, a bad
  answer) keeps the last state serving, logged once per outage and counted.
- **In flight**: each process counts its own picks per endpoint, entered at the pick and left at the
  request's end (ext_proc: the stream's settlement; ext_authz: the access-log settlement, up to
  ``ext_proc.meter_flush_interval_ms`` late, or the lease TTL for an entry that never comes). Only the
  first listed host is counted: a request Envoy moved to a fallback host still counts on the first.

Staleness bounds: an endpoint appears, drains or leaves within one poll period after the xDS server knows
(plus its push debounce); a failing endpoint is out within ``unhealthy_threshold`` probe periods
(``telemetry.scrape_interval_ms``, 500 ms) plus a poll; queue and KV usage lag by up to a scrape period
plus a poll period and are ignored past ``weights.stale_after_ms``. Between those bounds Envoy covers the
gap: a picked host that is gone from EDS is skipped, a dead or 503ing one is retried on the next listed
host (``retry_on`` connect-failure/reset/503; the fallback policy after the list), so a stale pick costs a
retry, not an error. Envoy 1.40's ``override_host`` does not check a listed host's health itself, and its
retries walk the list without the route's ``previous_hosts`` predicate (a list ``A,A,C`` was tried A, A,
C; the fallback policy after the list does honour it), so :func:`~inferlb.policy.picker.pick` lists each
host once.

Herding: several replicas reading the same state would all pick the same least-loaded endpoint. Three
things keep them apart: each process salts the picker's tie-break with random bytes of its own (equal
scores break differently per replica); each counts its own in-flight picks, so its next pick moves on at
once; and the load guard (bounded load, :mod:`inferlb.policy.picker`) lists an endpoint above its share of
the work only after every endpoint within it. What one replica cannot see is the others' picks since the
last scrape: a burst over many replicas can overshoot one endpoint by up to (replicas - 1) x the burst's
share before the queue telemetry shows it.

Before the first state arrives (start-up with the xDS server down), and for a cluster the state does not
list yet, a picking model's request goes without the header: Envoy's fallback balances it
(``inferlb_endpoint_picks_total{outcome="no_state"}``). When the state lists no eligible endpoint (none
healthy), the request is refused 503 ``no_eligible_endpoint`` in OpenAI's JSON (the EPP protocol's answer;
ext_authz sends it as 403 + ``x-inferlb-status: 503``, restored by the local-reply mapper).

Length classes: for a model with ``cluster.length_aware`` a request of a confined class is picked among the
hosts the state lists for that class (:func:`class_hosts`, from each row's ``length_classes``: the xDS
server's live sets, else the GPU profile's), a short one among all. Its clusters carry no subset config
(Envoy refuses one beside ``override_host``), so the fallback balances over every endpoint.

Prefix indexes (:func:`prefix_source` binds each mode to its index; the keys are
:func:`inferlb.request.blocks.prompt_block_keys` with the model's ``block_size``, computed where the body is
parsed, so a big body's keys are made in its worker thread too):

- ``load``: no index, no keys (load and KV usage only).
- ``approximate``: one :class:`~inferlb.policy.prefix_index.ApproximatePrefixIndex` per model per process,
  learnt from this process's own picks (each pick records its keys on its first host). Replicas learn
  separately: each believes only what it sent, so with ``R`` replicas behind a balancer that spreads a
  conversation's turns over them, a turn reaches the replica that placed the one before with probability
  about ``1/R`` and otherwise is placed by load alone (a miss, then learnt there too); and each replica
  holds its own copy of the beliefs (``R`` x the memory). A client that keeps its connection (HTTP/2, or
  keep-alive to one Envoy with one request-path process) keeps its turns on one replica. The index of an
  endpoint that leaves the cluster or turns unhealthy is forgotten.
- ``precise``: one :class:`~inferlb.policy.kv_index.PreciseKvIndex` per model per process, fed by one
  :class:`~inferlb.adapters.kv_events.KvEventSubscriber` per endpoint with ``kv_events`` (the address the
  endpoint publishes on, carried in ``GET /v1/picking``): every replica subscribes to every publisher (ZMQ
  PUB fans out; a replica costs the servers one more connection and the same events again), and each
  holds the whole fleet's cache state (the index's module doc gives ~10 MB per endpoint of 30,000 blocks).
  Subscribers start and stop at each poll: an endpoint that leaves, turns unhealthy or changes its
  ``kv_events`` has its subscriber closed and its entries dropped (a healthy one again starts afresh, its
  first batch read as a gap and replayed or rebuilt); an endpoint without ``kv_events`` matches nothing.
  The subscribers' counters are ``inferlb_kv_events_*_total{endpoint}`` on the process's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import aiohttp
import msgspec

from ext_proc.handlers import ImmediateReply, PreparedRequest, picking_block_keys, refusal
from ext_proc.metrics import ExtProcMetrics
from inferlb.adapters.kv_events import KvEventsCollector, KvEventSubscriber
from inferlb.config.schema import Config, EndpointPicking, ModelConfig, PickingQueue, Priority
from inferlb.errors import RequestError
from inferlb.policy.class_guard import guarded_class, set_loads
from inferlb.policy.columnar import FleetColumns
from inferlb.policy.endpoint_book import BookedEndpoint, EndpointBook, parse_picking_state
from inferlb.policy.fair_queue import BAND_DEFAULT, BAND_HIGH, BAND_LOW
from inferlb.policy.fair_wait import FairWaiters, QueueFull, Waiter
from inferlb.policy.kv_index import PreciseKvIndex
from inferlb.policy.length_aware import SHORT, confined_classes, length_class
from inferlb.policy.picker import (
    EndpointState,
    NoEligibleEndpoint,
    PickerWeights,
    PrefixIndex,
    pick,
)
from inferlb.policy.prefix_index import ApproximatePrefixIndex
from inferlb.policy.prefix_indexes import KEYED_MODES, make_prefix_index
from inferlb.request.parsing import InferenceRequest

log = logging.getLogger("ext_proc.picking")

#: Response code details of a request refused because no endpoint of its cluster is eligible.
NO_ELIGIBLE_DETAILS: Final = "inferlb_no_eligible_endpoint"
#: Longest wait for one ``GET /v1/picking`` (s); a slower answer counts as a failed poll.
POLL_TIMEOUT_S: Final = 2.0
#: Response code details of a request refused after waiting ``queue.max_wait_ms`` / at a full queue.
QUEUE_TIMEOUT_DETAILS: Final = "inferlb_queue_timeout"
QUEUE_FULL_DETAILS: Final = "inferlb_queue_full"
#: ``retry-after`` of the queue's 429s (s): about the time a request in flight needs to free a slot.
QUEUE_RETRY_AFTER_S: Final = 1
#: A tenant's priority -> its band in the model's fair queue (served strictly in this order).
PRIORITY_BANDS: Final = {Priority.HIGH: BAND_HIGH, Priority.DEFAULT: BAND_DEFAULT, Priority.LOW: BAND_LOW}


def no_keys(request: InferenceRequest) -> tuple[int, ...]:
    """No prompt block keys: the picker then scores load and KV usage only."""
    return ()


class PrefixSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a picking model's prefix matches come from: the index and the function giving a request's
    prompt block keys (:class:`~inferlb.policy.picker.PrefixIndex` explains block keys)."""

    index: PrefixIndex
    keys: Callable[[InferenceRequest], tuple[int, ...]]


def prefix_source(picking: EndpointPicking) -> PrefixSource:
    """The prefix index and block-key function of a model's ``endpoint_picking`` mode (the module doc says
    what each costs): :func:`inferlb.policy.prefix_indexes.make_prefix_index` (``off`` and ``load``:
    :class:`~inferlb.policy.picker.NoPrefixIndex` and no keys; ``approximate`` an
    :class:`~inferlb.policy.prefix_index.ApproximatePrefixIndex` of
    :data:`~inferlb.policy.prefix_indexes.APPROXIMATE_CAPACITY_TOKENS` per endpoint; ``precise`` a
    :class:`~inferlb.policy.kv_index.PreciseKvIndex`, empty until the subscribers feed it). Both key a
    request with :func:`inferlb.request.blocks.prompt_block_keys` at ``picking.block_size``
    (:func:`ext_proc.handlers.picking_block_keys`)."""
    index = make_prefix_index(picking.mode, block_size=picking.block_size)
    if picking.mode in KEYED_MODES:
        return PrefixSource(index=index, keys=functools.partial(picking_block_keys, picking))
    return PrefixSource(index=index, keys=no_keys)


def picker_weights(picking: EndpointPicking) -> PickerWeights:
    """The config's picker weights as :class:`~inferlb.policy.picker.PickerWeights` (the config's fields are
    the picker's, of the same names)."""
    return PickerWeights(**picking.weights.model_dump())


class Picked(msgspec.Struct, frozen=True, kw_only=True):
    """The hosts picked for one request (first choice first) and the one whose in-flight count it holds
    (the caller leaves it at the request's end)."""

    hosts: tuple[str, ...]
    held: str

    @property
    def header_value(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: ``ip:port[,ip:port...]``."""
        return ",".join(self.hosts)


class _Subscription(msgspec.Struct, kw_only=True):
    """One running KV-event subscriber: what it was started for and its task."""

    source: tuple[str, str | None, str]  # (endpoint, replay_endpoint, topic)
    index: PreciseKvIndex
    subscriber: KvEventSubscriber
    task: asyncio.Task[None]


class PickingState:
    """One process's endpoint picking: the :class:`~inferlb.policy.endpoint_book.EndpointBook` the poller
    fills, the tie-break salt, each model's prefix source (kept while its ``endpoint_picking`` stays), and
    the precise models' KV-event subscribers (:meth:`sync`).

    Args:
        salt: the picker's tie-break salt; default 16 random bytes, so replicas differ.

    Attributes:
        kv_events: the subscribers' counters for the process's ``/metrics`` (register it once).
    """

    def __init__(self, *, salt: bytes | None = None) -> None:
        self.book = EndpointBook()
        self.salt = salt if salt is not None else secrets.token_bytes(16)
        self._sources: dict[str, tuple[EndpointPicking, PrefixSource]] = {}
        #: (model, address) -> its subscriber
        self._subs: dict[tuple[str, str], _Subscription] = {}
        #: model -> the healthy addresses its approximate index last knew
        self._learnt: dict[str, frozenset[str]] = {}
        self.kv_events = KvEventsCollector()
        #: model -> its fair queue and the settings it was built for (:func:`choose`)
        self._queues: dict[str, tuple[PickingQueue, PickQueue]] = {}
        #: queues of settings since replaced, kept until their waiters are answered
        self._retired: list[PickQueue] = []
        #: set by the adapter: where queue outcomes are counted
        self.metrics: ExtProcMetrics | None = None

    def queue(self, model: ModelConfig) -> PickQueue | None:
        """``model``'s fair queue (built once per ``endpoint_picking.queue`` setting; one built for older
        settings keeps its waiters until they are answered), or None when its queue is off."""
        settings = model.endpoint_picking.queue
        held = self._queues.get(model.name)
        if held is not None and held[0] == settings:
            return held[1]
        if held is not None:
            del self._queues[model.name]
            if len(held[1]):
                self._retired.append(held[1])
        if not settings.enabled:
            return None
        queue = PickQueue(self, model.name, settings)
        self._queues[model.name] = (settings, queue)
        return queue

    def leave(self, address: str) -> None:
        """A request picked to ``address`` ended: leave its in-flight count and admit the waiters that now
        have room (:meth:`dispatch`)."""
        self.book.leave(address)
        self.dispatch()

    def dispatch(self, now: float | None = None) -> None:
        """Admit waiting requests of every model's queue while their head has an endpoint with room (after
        a request ends, after each poll, after each enqueue)."""
        if not self._queues and not self._retired:
            return
        at = time.monotonic() if now is None else now
        for _, queue in list(self._queues.values()):
            queue.dispatch(at)
        if self._retired:
            for queue in self._retired:
                queue.dispatch(at)
            self._retired = [q for q in self._retired if len(q)]

    def source(self, model: ModelConfig) -> PrefixSource:
        """``model``'s prefix source, built once per ``endpoint_picking`` setting."""
        held = self._sources.get(model.name)
        if held is None or held[0] != model.endpoint_picking:
            held = (model.endpoint_picking, prefix_source(model.endpoint_picking))
            self._sources[model.name] = held
        return held[1]

    def sync(self, models: Iterable[ModelConfig]) -> None:
        """Bring the prefix indexes in line with the book's state (after each poll; in the event loop):
        start a subscriber for each healthy endpoint with ``kv_events`` of a ``precise`` model, close
        those of endpoints that left, turned unhealthy or changed ``kv_events`` (their entries dropped),
        and forget in an ``approximate`` index the endpoints that left or turned unhealthy."""
        state = self.book.state
        if state is None:
            return
        wanted: dict[tuple[str, str], tuple[BookedEndpoint, PreciseKvIndex]] = {}
        for model in models:
            mode = model.endpoint_picking.mode
            if mode not in ("approximate", "precise"):
                continue
            index = self.source(model).index
            rows = [r for v in model.versions for r in state.clusters.get(model.cluster_name(v.name), ())]
            healthy = frozenset(r.address for r in rows if r.healthy)
            if isinstance(index, ApproximatePrefixIndex):
                for gone in self._learnt.get(model.name, frozenset()) - healthy:
                    index.forget(gone)
                self._learnt[model.name] = healthy
            elif isinstance(index, PreciseKvIndex):
                for r in rows:
                    if r.healthy and r.kv_events is not None:
                        wanted[(model.name, r.address)] = (r, index)
        for key, sub in list(self._subs.items()):
            want = wanted.get(key)
            if want is None or want[1] is not sub.index or _source_of(want[0]) != sub.source:
                self._stop(key)
        for key, (row, index) in wanted.items():
            if key not in self._subs:
                self._start(key, row, index)
        self.kv_events.subscribers = [s.subscriber for s in self._subs.values()]

    def _start(self, key: tuple[str, str], row: BookedEndpoint, index: PreciseKvIndex) -> None:
        assert row.kv_events is not None
        sub = KvEventSubscriber(
            address=row.address,
            endpoint=row.kv_events,
            index=index,
            replay_endpoint=row.kv_events_replay,
            topic=row.kv_events_topic,
        )
        try:
            sub.open()
        except Exception as exc:  # a bad address must not stop the poller; retried at the next poll
            log.warning("kv events of %s from %s: cannot subscribe (%s)", row.address, row.kv_events, exc)
            return
        task = asyncio.create_task(self._run(sub), name=f"kv-events {row.address}")
        self._subs[key] = _Subscription(source=_source_of(row), index=index, subscriber=sub, task=task)
        log.info("kv events of %s: subscribed to %s", row.address, row.kv_events)

    @staticmethod
    async def _run(sub: KvEventSubscriber) -> None:
        try:
            await sub.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # the subscriber survives any message; a socket error ends it, logged
            log.exception("kv events of %s: subscriber stopped; entries dropped", sub.address)
            sub.index.clear(sub.address)

    def _stop(self, key: tuple[str, str]) -> None:
        sub = self._subs.pop(key)
        sub.task.cancel()
        sub.subscriber.close()
        sub.index.remove_endpoint(sub.subscriber.address)
        log.info("kv events of %s: unsubscribed, entries dropped", sub.subscriber.address)

    async def aclose(self) -> None:
        """Stop every subscriber (at shutdown)."""
        tasks = [s.task for s in self._subs.values()]
        for key in list(self._subs):
            self._stop(key)
        await asyncio.gather(*tasks, return_exceptions=True)
        self.kv_events.subscribers = []


def _source_of(row: BookedEndpoint) -> tuple[str, str | None, str]:
    assert row.kv_events is not None
    return (row.kv_events, row.kv_events_replay, row.kv_events_topic)


def no_eligible_endpoint(model: str, why: str) -> ImmediateReply:
    """The 503 of a request whose cluster has no endpoint the picker may choose (the EPP protocol's answer
    when nothing is ready)."""
    return refusal(
        RequestError(
            503,
            f"No server of model {model} can take the request now ({why}); retry later.",
            type="server_error",
            code="no_eligible_endpoint",
            retry_after_s=1,
        ),
        NO_ELIGIBLE_DETAILS,
    )


def class_hosts(
    state: PickingState,
    prepared: PreparedRequest,
    cluster: str,
    *,
    now: float | None = None,
    metrics: ExtProcMetrics | None = None,
) -> frozenset[str] | None:
    """The hosts of ``cluster`` that may serve ``prepared``'s length class, for a length-aware model
    (:mod:`inferlb.policy.length_aware`: the class the request path decided,
    :attr:`~ext_proc.handlers.PreparedRequest.length_class`, else the class of its whole output cap, as
    its ``x-inferlb-length-class`` header names it), from the book's ``length_classes``; None (every host)
    for a model that is not length-aware and for a short request. A confined class no host may serve now
    (no fast GPU in the cluster) is None too: Envoy's subsets fall back to every endpoint then
    (``ANY_ENDPOINT``), and so does the pick.

    With ``length_aware.capacity_guard_factor`` and ``now`` (monotonic s) the capacity guard
    (:func:`inferlb.policy.class_guard.guarded_class`) runs over the book's endpoint states (this process's
    in flight plus the servers' queues, capacity = EDS weight): a class whose hosts are loaded past the
    factor over the fleet spills to the next wider class's hosts, or to every host; ``metrics`` counts the
    spill."""
    policy = prepared.model.cluster.length_aware
    if policy is None:
        return None
    name = prepared.length_class
    if name is None:
        name = length_class(prepared.request.output_token_cap(prepared.model.default_max_tokens), policy)
    if name == SHORT:
        return None
    factor = policy.capacity_guard_factor
    if factor is not None and now is not None:
        guarded = guard_class_hosts(
            state, cluster, name, [c.name for c in confined_classes(policy)], factor=factor, now=now
        )
        if guarded != name and metrics is not None:
            metrics.length_class_spills.labels(prepared.model.name, name, guarded).inc()
        if guarded == SHORT:
            return None
        name = guarded
    return state.book.class_hosts(cluster, name) or None


def guard_class_hosts(
    state: PickingState, cluster: str, name: str, classes: list[str], *, factor: float, now: float
) -> str:
    """The class (of ``classes``, longest first, or :data:`SHORT`) a request of class ``name`` is picked
    in under the capacity guard, from the book's endpoint states of ``cluster`` at ``now``; ``name`` when
    the book has no state for the cluster or the class is not among ``classes``."""
    if name not in classes:
        return name
    hosts = [state.book.class_hosts(cluster, c) for c in classes]
    columns = state.book.columns(cluster, now)
    if columns is not None:  # a large cluster: summed over its columns, not its endpoint states
        sets, fleet = [columns.set_load(h) for h in hosts], columns.set_load(None)
    else:
        states = state.book.states(cluster, now)
        if states is None:
            return name
        sets, fleet = set_loads(states, hosts)
    k = guarded_class(sets, fleet, classes.index(name), factor)
    return classes[k] if k < len(classes) else SHORT


def saturated(endpoint: EndpointState, settings: PickingQueue) -> bool:
    """True when this process's requests in flight on ``endpoint`` reached ``settings.max_in_flight``
    (the endpoint takes no more picks while others wait)."""
    return endpoint.in_flight >= settings.max_in_flight


def queue_timeout(model: str, waited_ms: int) -> ImmediateReply:
    """The 429 of a request that waited ``waited_ms`` in ``model``'s queue with no endpoint freeing up."""
    return refusal(
        RequestError(
            429,
            f"Every server of model {model} is saturated and the request waited {waited_ms} ms for one "
            "to free up; retry later.",
            type="rate_limit_error",
            code="queue_timeout",
            retry_after_s=QUEUE_RETRY_AFTER_S,
        ),
        QUEUE_TIMEOUT_DETAILS,
    )


def queue_full(model: str, max_queued: int) -> ImmediateReply:
    """The 429 of a request that finds ``max_queued`` requests waiting for ``model`` already."""
    return refusal(
        RequestError(
            429,
            f"Every server of model {model} is saturated and {max_queued} requests already wait; "
            "retry later.",
            type="rate_limit_error",
            code="queue_full",
            retry_after_s=QUEUE_RETRY_AFTER_S,
        ),
        QUEUE_FULL_DETAILS,
    )


PickDecision = Picked | ImmediateReply | None


@dataclass(eq=False, slots=True, kw_only=True)
class PickWaiter(Waiter[PickDecision]):
    """A request waiting in its model's queue for an endpoint with room; :attr:`outcome` resolves to what
    :func:`choose` would have returned (await it with :func:`wait_for_pick`).

    Attributes:
        prepared: the request, for the pick.
        cluster: its model version's cluster.
        queue: the queue it waits in.
    """

    prepared: PreparedRequest
    cluster: str
    queue: PickQueue


class PickQueue:
    """One model's waiters (:class:`~inferlb.policy.fair_wait.FairWaiters`: bands by tenant priority, tenants
    fair by reserved tokens), admitted by :meth:`dispatch` when their cluster has an endpoint with room.

    The head is served first: a head whose cluster (its model version's) has no room holds back waiters of
    the model's other versions until it is admitted or expires.
    """

    def __init__(self, state: PickingState, model: str, settings: PickingQueue) -> None:
        self.state = state
        self.model = model
        self.settings = settings
        self.waiters: FairWaiters[PickWaiter, PickDecision] = FairWaiters(
            max_queued=settings.max_queued,
            max_wait_s=settings.max_wait_ms / 1000,
            on_expired=self._expired,
            on_left=self._left,
        )

    def __len__(self) -> int:
        return len(self.waiters)

    def enqueue(self, prepared: PreparedRequest, cluster: str) -> PickWaiter:
        """Queue ``prepared`` (band of its tenant's priority, cost its reserved tokens).

        Raises:
            QueueFull: ``max_queued`` requests wait already.
        """
        tenant = prepared.pending.tenant
        waiter = PickWaiter(
            request_id=self.waiters.new_id(),
            tenant=tenant.name,
            band=PRIORITY_BANDS[tenant.priority],
            cost_tokens=max(1, prepared.reserved_tokens),
            enqueued_at=self.waiters.clock(),
            outcome=asyncio.get_running_loop().create_future(),
            prepared=prepared,
            cluster=cluster,
            queue=self,
        )
        return self.waiters.enqueue(waiter)

    def dispatch(self, now: float) -> None:
        """Admit waiters in the queue's order while the head's cluster has an endpoint with room; a head
        whose cluster lost its state (None: Envoy's fallback balances it) or every healthy endpoint (503)
        is answered so too."""
        while (head := self.waiters.head()) is not None:
            states = self.state.book.states(head.cluster, now)
            if states is None:
                self.waiters.take_head(None, "no_state")
                continue
            # room within the head's length class: room elsewhere could not take it
            allowed = class_hosts(self.state, head.prepared, head.cluster, now=now)
            healthy = [s for s in states if s.healthy and (allowed is None or s.address in allowed)]
            room = [s for s in healthy if not saturated(s, self.settings)]
            if healthy and not room:
                return
            self.waiters.take_head(
                _pick(self.state, head.prepared, head.cluster, room or states, now=now), "admitted"
            )

    def _expired(self, waiter: PickWaiter) -> PickDecision:
        return queue_timeout(self.model, self.settings.max_wait_ms)

    def _left(self, waiter: PickWaiter, outcome: str, waited_s: float) -> None:
        metrics = self.state.metrics
        if metrics is not None:
            metrics.endpoint_queue_waits.labels(self.model, outcome).observe(waited_s)


async def wait_for_pick(waiter: PickWaiter) -> PickDecision:
    """``waiter``'s decision once its queue makes it. Cancelled (the client went away): it leaves the queue,
    or, when its pick was made already, the pick's in-flight count is left."""
    try:
        return await asyncio.shield(waiter.outcome)
    except asyncio.CancelledError:
        decision = waiter.queue.waiters.abandon(waiter)
        if isinstance(decision, Picked):
            waiter.queue.state.leave(decision.held)
        raise


def choose(
    state: PickingState, prepared: PreparedRequest, cluster: str, metrics: ExtProcMetrics, *, now: float
) -> Picked | ImmediateReply | PickWaiter | None:
    """Pick the endpoints of one admitted-to-be request to ``cluster`` (its model version's) and enter the
    first in this process's in-flight count.

    With the model's ``endpoint_picking.queue`` on, a request whose healthy endpoints are all
    :func:`saturated`, or that finds others of its model waiting (no overtaking), waits in the model's
    :class:`PickQueue` instead.

    Returns:
        :class:`Picked` (the caller sets the header and leaves ``held`` at the request's end, through
        :meth:`PickingState.leave`); None when the model does not pick or there is no state for ``cluster``
        yet (Envoy's fallback balances it); the 503 :func:`no_eligible_endpoint` when no endpoint is
        healthy; a :class:`PickWaiter` whose outcome is one of those (or the 429 :func:`queue_timeout`),
        or the 429 :func:`queue_full` when the queue is full.
    """
    model = prepared.model
    picking = model.endpoint_picking
    if not picking.enabled:
        return None
    # a large cluster is scored over the book's columns (pick()'s picks, an eighth of its CPU at 1,000)
    columns = state.book.columns(cluster, now)
    queue = state.queue(model)
    if columns is not None and queue is None:
        return _pick(state, prepared, cluster, columns, metrics, now=now)
    states = state.book.states(cluster, now)
    if states is None:
        metrics.endpoint_picks.labels(model.name, "no_state").inc()
        return None
    queue = state.queue(model)
    if queue is not None:
        # room within the request's length class: room elsewhere could not take it
        allowed = class_hosts(state, prepared, cluster, now=now)
        healthy = [s for s in states if s.healthy and (allowed is None or s.address in allowed)]
        room = [s for s in healthy if not saturated(s, queue.settings)]
        if healthy and (not room or len(queue)):
            try:
                waiter = queue.enqueue(prepared, cluster)
            except QueueFull:
                metrics.endpoint_picks.labels(model.name, "queue_full").inc()
                return queue_full(model.name, queue.settings.max_queued)
            metrics.endpoint_picks.labels(model.name, "queued").inc()
            state.dispatch(now)
            return waiter
        if room:
            if columns is not None:  # the same eligible endpoints, over the columns
                subset = {s.address for s in room}
                return _pick(state, prepared, cluster, columns, metrics, subset=subset, now=now)
            states = room
    return _pick(state, prepared, cluster, columns if columns is not None else states, metrics, now=now)


def _pick(
    state: PickingState,
    prepared: PreparedRequest,
    cluster: str,
    fleet: list[EndpointState] | FleetColumns,
    metrics: ExtProcMetrics | None = None,
    *,
    subset: set[str] | None = None,
    now: float | None = None,
) -> Picked | ImmediateReply:
    model = prepared.model
    picking = model.endpoint_picking
    metrics = metrics if metrics is not None else state.metrics
    score: Callable[..., tuple[str, ...]]
    addresses: Sequence[str]
    if isinstance(fleet, FleetColumns):
        addresses, score = fleet.addresses, functools.partial(fleet.pick, subset=subset)
    else:
        addresses, score = [s.address for s in fleet], functools.partial(pick, fleet, subset=subset)
    source = state.source(model)
    keys = prepared.block_keys
    matched = source.index.matched_blocks(keys, addresses) if keys else None
    hosts_of_class = class_hosts(state, prepared, cluster, now=now, metrics=metrics)
    try:
        hosts = score(
            prompt_blocks=len(keys),
            matched_blocks=matched,
            weights=picker_weights(picking),
            salt=state.salt,
            # with a prefix index, a miss is priced in prompt tokens to prefill (the picker's token term)
            prompt_tokens=prepared.prompt_tokens if keys else 0,
            block_tokens=picking.block_size,
            class_hosts=hosts_of_class,
        )
    except NoEligibleEndpoint as exc:
        if metrics is not None:
            metrics.endpoint_picks.labels(model.name, "no_eligible").inc()
        why = str(exc) if addresses else "no endpoint is registered"
        return no_eligible_endpoint(model.name, why)
    if keys:
        source.index.record_pick(hosts[0], keys)
    state.book.enter(hosts[0])
    if metrics is not None:
        metrics.endpoint_picks.labels(model.name, "picked").inc()
    return Picked(hosts=hosts, held=hosts[0])


class EndpointStatePoller:
    """Reads ``GET /v1/picking`` from the xDS server every ``ext_proc.endpoint_state_poll_ms`` into a
    :class:`PickingState`'s book, while some model picks endpoints (the config is read anew each period,
    so a reload takes effect at the next). Never raises: a failed read keeps the last state.

    Args:
        state: the picking state to fill.
        config: returns the current config.
        metrics: where polls and the state's age are counted.
        token: the xDS server's API token (``INFERLB_XDS_API_TOKEN``, else ``xds.api_token``).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        state: PickingState,
        config: Callable[[], Config],
        metrics: ExtProcMetrics,
        *,
        token: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self._config = config
        self._metrics = metrics
        self._token = token
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        """Start polling in a background task (until :meth:`stop`)."""
        self._task = asyncio.create_task(self._loop(), name="endpoint-state")

    async def stop(self) -> None:
        """Stop polling (and the KV-event subscribers)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.state.aclose()

    async def _loop(self) -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                cfg = self._config()
                try:
                    if any(m.endpoint_picking.enabled for m in cfg.models):
                        await self.poll_once(http, cfg)
                    else:
                        self.state.sync(cfg.models)  # picking turned off: close any subscriber
                    age = self.state.book.age_s(self._clock())
                    self._metrics.endpoint_state_age.set(-1 if age is None else age)
                except Exception:  # the loop must outlive anything one period throws
                    log.exception("endpoint state poll failed; polling again next period")
                await asyncio.sleep(cfg.ext_proc.endpoint_state_poll_ms / 1000)

    async def poll_once(self, http: aiohttp.ClientSession, cfg: Config) -> bool:
        """One read; True when the book took a new state."""
        api = cfg.xds.api_dial_address()
        token = self._token or cfg.xds.api_token
        if api is None:
            return False
        host = f"[{api.host}]" if ":" in api.host else api.host
        url = f"http://{host}:{api.port}/v1/picking"
        try:
            async with http.get(
                url,
                headers={"Authorization": f"Bearer {token or ''}"},
                timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S),
            ) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {body[:200].decode(errors='replace')}")
            parsed = parse_picking_state(json.loads(body))
        except Exception as exc:  # any failure keeps the last state
            self._metrics.endpoint_state_polls.labels("failed").inc()
            if not self._failing:
                log.warning("endpoint state from %s failed (%s); picking from the last state", url, exc)
                self._failing = True
            return False
        self.state.book.update(parsed, self._clock())
        self.state.sync(cfg.models)
        self.state.dispatch()  # endpoints may have come, or turned healthy
        self._metrics.endpoint_state_polls.labels("ok").inc()
        if self._failing:
            log.info("endpoint state from %s is back", url)
            self._failing = False
        return True
