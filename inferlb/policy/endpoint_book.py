"""What one request-path process knows of a picking model's endpoints (pure: values in, values out).

The xDS server holds the fleet: which endpoints each cluster has, their EDS weights, whether they drain or
fail its health probes, and the queue and KV-cache usage it scrapes from each model server. It serves that
at ``GET /v1/picking`` (:meth:`xds_server.collector.TelemetryCollector.picking_json`); every request-path
process polls it (:mod:`ext_proc.picking`) and keeps the last good answer here, in an :class:`EndpointBook`,
together with what only the process itself knows: how many of its own picks are still in flight on each
endpoint (entered at the pick, left at the request's end). :meth:`EndpointBook.states` joins the two into
the :class:`~inferlb.policy.picker.EndpointState` values :func:`~inferlb.policy.picker.pick` scores; for a
cluster of :data:`~inferlb.policy.columnar.COLUMNAR_MIN_ENDPOINTS` endpoints or more it also keeps them as
:class:`~inferlb.policy.columnar.FleetColumns` (:meth:`EndpointBook.columns`), built once per received
state and changed in place as requests enter and leave and as telemetry goes stale (the same picks, at
an eighth of the CPU at 1,000 endpoints).

Staleness: the book keeps serving the last state it was given, however old (an xDS server that is down
must not stop picking), but queue and KV usage older than ``stale_after_ms`` (the server's
``weights.stale_after_ms``, its age at the server plus the time since the book received it) are taken as
unknown (0), as the weight policy ignores stale telemetry: a picker scoring minute-old queues would herd
onto whatever was idle then.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from inferlb.policy.columnar import COLUMNAR_MIN_ENDPOINTS, FleetColumns
from inferlb.policy.picker import EndpointState


class BookedEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One endpoint as the xDS server last described it.

    Attributes:
        address: ``ip:port`` as EDS sends it (what Envoy's ``override_host`` matches).
        weight: the served EDS ``load_balancing_weight`` (> 0).
        prefill_weight: the prefill capacity in ``weight``'s unit (> 0; the served weight times the GPU
            profile's ``prefill_relative_capacity / relative_capacity``); None: ``weight`` (a server that
            sends none).
        healthy: not draining and passing the server's health probes.
        waiting: requests in the model server's queue (None: never scraped).
        kv_usage: KV-cache usage 0..1 (None: never scraped, or not exported).
        telemetry_age_ms: age of that scrape when the server answered (ms; None: never scraped).
        kv_events: the ZMQ endpoint its KV events are published on (None: it publishes none).
        kv_events_replay: its replay endpoint (None: no replay).
        kv_events_topic: the topic prefix subscribed to.
        length_classes: for a length-aware model's endpoint, the confined length classes it may serve now
            (the xDS server's live sets, else its GPU profile's; :mod:`inferlb.policy.length_aware`); None
            for other models.
    """

    address: str
    weight: float
    healthy: bool
    waiting: float | None = None
    kv_usage: float | None = None
    telemetry_age_ms: float | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    length_classes: tuple[str, ...] | None = None
    prefill_weight: float | None = None


class BookedState(msgspec.Struct, frozen=True, kw_only=True):
    """One answer of ``GET /v1/picking``, parsed: endpoints per cluster, and the server's staleness bound."""

    clusters: Mapping[str, tuple[BookedEndpoint, ...]]
    stale_after_ms: float


def _number(v: Any, where: str, *, optional: bool = True) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{where}: expected a finite number, got {v!r}")
    return float(v)


def parse_picking_state(doc: Any) -> BookedState:
    """Parse the JSON body of ``GET /v1/picking`` (shape: :meth:`xds_server.collector.TelemetryCollector
    .picking_json`).

    Raises:
        ValueError: the document is not of that shape (naming the field); the caller keeps its last state.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("clusters"), dict):
        raise ValueError("clusters: expected an object of cluster name -> endpoint list")
    stale = _number(doc.get("stale_after_ms"), "stale_after_ms", optional=False)
    assert stale is not None
    clusters: dict[str, tuple[BookedEndpoint, ...]] = {}
    for name, rows in doc["clusters"].items():
        if not isinstance(rows, list):
            raise ValueError(f"clusters.{name}: expected a list of endpoints")
        out = []
        for i, row in enumerate(rows):
            where = f"clusters.{name}[{i}]"
            if not isinstance(row, dict) or not isinstance(row.get("address"), str):
                raise ValueError(f"{where}.address: expected an ip:port string")
            weight = _number(row.get("weight"), f"{where}.weight", optional=False)
            assert weight is not None
            if weight <= 0:
                raise ValueError(f"{where}.weight: expected > 0, got {weight:g}")
            prefill = _number(row.get("prefill_weight"), f"{where}.prefill_weight")
            if prefill is not None and prefill <= 0:
                raise ValueError(f"{where}.prefill_weight: expected > 0, got {prefill:g}")
            if not isinstance(row.get("healthy"), bool):
                raise ValueError(f"{where}.healthy: expected true or false")
            kv = row.get("kv_events")
            if kv is not None and not (
                isinstance(kv, dict)
                and isinstance(kv.get("endpoint"), str)
                and isinstance(kv.get("replay_endpoint"), str | None)
                and isinstance(kv.get("topic", ""), str)
            ):
                raise ValueError(f"{where}.kv_events: expected null or {{endpoint, replay_endpoint, topic}}")
            classes = row.get("length_classes")
            if classes is not None and not (
                isinstance(classes, list) and all(isinstance(c, str) for c in classes)
            ):
                raise ValueError(f"{where}.length_classes: expected null or a list of class names")
            out.append(
                BookedEndpoint(
                    address=row["address"],
                    weight=weight,
                    prefill_weight=prefill,
                    healthy=row["healthy"],
                    waiting=_number(row.get("waiting"), f"{where}.waiting"),
                    kv_usage=_number(row.get("kv_usage"), f"{where}.kv_usage"),
                    telemetry_age_ms=_number(row.get("telemetry_age_ms"), f"{where}.telemetry_age_ms"),
                    kv_events=None if kv is None else kv["endpoint"],
                    kv_events_replay=None if kv is None else kv.get("replay_endpoint"),
                    kv_events_topic="" if kv is None else kv.get("topic", ""),
                    length_classes=None if classes is None else tuple(classes),
                )
            )
        clusters[str(name)] = tuple(out)
    return BookedState(clusters=clusters, stale_after_ms=stale)


class _Row(msgspec.Struct, frozen=True):
    """One endpoint prepared at :meth:`EndpointBook.update`: its state with telemetry and without, and the
    monotonic time (s) until which the telemetry counts."""

    fresh: EndpointState
    stale: EndpointState
    fresh_until: float


class _ClusterColumns:
    """One large cluster's rows as :class:`~inferlb.policy.columnar.FleetColumns`, with the telemetry each
    row serves until its ``fresh_until`` (monotonic s), as :meth:`EndpointBook.states` would give it."""

    __slots__ = ("columns", "fresh", "fresh_kv", "fresh_until", "fresh_waiting", "synced_at", "turns_at")

    def __init__(self, rows: tuple[_Row, ...], counts: dict[str, int], now: float) -> None:
        self.columns = FleetColumns(
            [msgspec.structs.replace(r.stale, in_flight=counts.get(r.stale.address, 0)) for r in rows]
        )
        self.fresh_until: npt.NDArray[np.float64] = np.array([r.fresh_until for r in rows], dtype=np.float64)
        self.fresh_waiting: npt.NDArray[np.float64] = np.array(
            [r.fresh.waiting for r in rows], dtype=np.float64
        )
        self.fresh_kv: npt.NDArray[np.float64] = np.array([r.fresh.kv_usage for r in rows], dtype=np.float64)
        self.fresh: npt.NDArray[np.bool_] = np.zeros(len(rows), dtype=np.bool_)  # rows serving telemetry now
        self.synced_at = math.inf  # the first sync sets every row
        self.turns_at = -math.inf
        self.sync(now)

    def sync(self, now: float) -> FleetColumns:
        """The columns as of monotonic ``now``: rows whose telemetry went stale since the last sync get
        waiting and KV usage 0 (rows are only touched when one turns; ``now`` before the last sync
        recomputes every row)."""
        if self.synced_at <= now <= self.turns_at:
            return self.columns
        fresh = now <= self.fresh_until
        turned = np.flatnonzero(fresh != self.fresh)
        if len(turned):
            keep = fresh[turned]
            self.columns.set_telemetry(
                turned,
                np.where(keep, self.fresh_waiting[turned], 0.0),
                np.where(keep, self.fresh_kv[turned], 0.0),
            )
            self.fresh = fresh
        self.synced_at = now
        self.turns_at = float(self.fresh_until[fresh].min()) if fresh.any() else math.inf
        return self.columns


class EndpointBook:
    """The last endpoint state a process received, and its own in-flight count per endpoint (not
    thread-safe: the service's event loop owns it).

    Each endpoint's :class:`~inferlb.policy.picker.EndpointState` is built once per received state, with
    and without its telemetry; a pick only chooses between the two and adds this process's in-flight
    count where it has one. A cluster of :data:`~inferlb.policy.columnar.COLUMNAR_MIN_ENDPOINTS` or more
    endpoints is also kept as columns (:meth:`columns`), their in-flight counts changed in place by
    :meth:`enter` and :meth:`leave`.

    Args:
        state: a state to start from (tests), else none: :meth:`states` answers None until :meth:`update`.
        received_at: the monotonic time (s) ``state`` counts as received.

    Attributes:
        received_at: the monotonic time (s) the current state arrived, None before any.
        state: the state served now, None before any (its endpoints' ``kv_events`` are what the precise
            index subscribes to).
    """

    __slots__ = ("_classes", "_columns", "_holders", "_in_flight", "_rows", "received_at", "state")

    def __init__(self, state: BookedState | None = None, *, received_at: float = 0.0) -> None:
        self._rows: dict[str, tuple[_Row, ...]] | None = None
        #: (cluster, length class) -> the addresses that may serve it
        self._classes: dict[tuple[str, str], frozenset[str]] = {}
        self.received_at: float | None = None
        self.state: BookedState | None = None
        self._in_flight: dict[str, int] = {}
        self._columns: dict[str, _ClusterColumns] = {}
        self._holders: dict[str, list[FleetColumns]] = {}  # address -> the columns with a row for it
        if state is not None:
            self.update(state, received_at)

    def update(self, state: BookedState, now: float) -> None:
        """Serve ``state``, received at monotonic ``now`` (s), from now on; in-flight counts are kept."""
        rows: dict[str, tuple[_Row, ...]] = {}
        classes: dict[tuple[str, str], set[str]] = {}
        for cluster, endpoints in state.clusters.items():
            out = []
            for r in endpoints:
                for c in r.length_classes or ():
                    classes.setdefault((cluster, c), set()).add(r.address)
                stale = EndpointState(
                    address=r.address, weight=r.weight, healthy=r.healthy, prefill_weight=r.prefill_weight
                )
                if r.telemetry_age_ms is None:
                    out.append(_Row(stale, stale, -math.inf))
                    continue
                fresh = EndpointState(
                    address=r.address,
                    weight=r.weight,
                    prefill_weight=r.prefill_weight,
                    healthy=r.healthy,
                    waiting=r.waiting or 0.0,
                    kv_usage=r.kv_usage or 0.0,
                )
                out.append(_Row(fresh, stale, now + (state.stale_after_ms - r.telemetry_age_ms) / 1000))
            rows[cluster] = tuple(out)
        self._rows = rows
        self._classes = {k: frozenset(v) for k, v in classes.items()}
        self._columns = {
            c: _ClusterColumns(r, self._in_flight, now)
            for c, r in rows.items()
            # addresses unique, as pick() takes them (a list naming one twice is left to states())
            if len(r) >= COLUMNAR_MIN_ENDPOINTS and len({x.fresh.address for x in r}) == len(r)
        }
        self._holders = {}
        for cc in self._columns.values():
            for address in cc.columns.addresses:
                self._holders.setdefault(address, []).append(cc.columns)
        self.received_at = now
        self.state = state

    def class_hosts(self, cluster: str, length_class: str) -> frozenset[str]:
        """The addresses of ``cluster`` that may serve requests of the confined ``length_class`` (empty
        when none may, or the state names no such class)."""
        return self._classes.get((cluster, length_class), frozenset())

    def age_s(self, now: float) -> float | None:
        """Seconds since the current state arrived (None before any)."""
        return None if self.received_at is None else max(0.0, now - self.received_at)

    def states(self, cluster: str, now: float) -> list[EndpointState] | None:
        """The :class:`~inferlb.policy.picker.EndpointState` of every endpoint of ``cluster``, with this
        process's in-flight counts; None when the book has no state for it (none received yet, or a cluster
        the last state did not list: a model whose picking was just turned on). Telemetry older than the
        state's ``stale_after_ms`` (its age at the server plus the time since it arrived) is dropped
        (waiting and KV usage 0)."""
        if self._rows is None:
            return None
        rows = self._rows.get(cluster)
        if rows is None:
            return None
        counts = self._in_flight
        out = []
        for r in rows:
            e = r.fresh if now <= r.fresh_until else r.stale
            n = counts.get(e.address) if counts else None
            out.append(msgspec.structs.replace(e, in_flight=n) if n else e)
        return out

    def columns(self, cluster: str, now: float) -> FleetColumns | None:
        """``cluster``'s endpoints as columns, as :meth:`states` would give them at monotonic ``now``
        (:func:`~inferlb.policy.picker.pick`'s answers from :meth:`FleetColumns.pick
        <inferlb.policy.columnar.FleetColumns.pick>`); None when the cluster has fewer than
        :data:`~inferlb.policy.columnar.COLUMNAR_MIN_ENDPOINTS` endpoints or no state (:meth:`states`
        serves it). The columns stay the book's: valid until the next :meth:`update`, :meth:`enter`,
        :meth:`leave` or call."""
        cc = self._columns.get(cluster)
        return None if cc is None else cc.sync(now)

    def enter(self, address: str) -> None:
        """One more of this process's requests in flight on ``address``."""
        self._in_flight[address] = self._in_flight.get(address, 0) + 1
        for columns in self._holders.get(address, ()):
            columns.add_in_flight(address, 1)

    def leave(self, address: str) -> None:
        """One of them ended (a count never goes below 0; an address back at 0 is forgotten)."""
        n = self._in_flight.get(address, 0) - 1
        if n > 0:
            self._in_flight[address] = n
        elif self._in_flight.pop(address, None) is None:
            return
        for columns in self._holders.get(address, ()):
            columns.add_in_flight(address, -1)

    def in_flight(self) -> dict[str, int]:
        """``{address: requests in flight}`` of the addresses with any."""
        return dict(self._in_flight)
