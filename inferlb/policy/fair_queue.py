"""Fair queueing under saturation (pure): which waiting request a model serves next when a slot frees.

When every eligible endpoint of a model is saturated, the request path holds new requests in a per-model
:class:`FairQueue` instead of refusing them at once. The queue serves **priority bands** strictly (every
waiting ``high`` request before any ``default`` one, ``default`` before ``low``) and **tenants within a
band fairly by tokens**, by start-time fair queueing (SFQ: P. Goyal, H. M. Vin, H. Cheng, "Start-time Fair
Queueing: A Scheduling Algorithm for Integrated Services Packet Switching Networks", SIGCOMM 1996):

* each request costs its tokens (prompt tokens plus its completion budget: what it will occupy a GPU for);
* a tenant's request gets a start tag ``S = max(V, F_tenant)`` and a finish tag ``F = S + cost / weight``,
  where ``F_tenant`` is the finish tag of that tenant's previous request in the band and ``V`` the band's
  virtual time, the start tag of the request served last;
* the band serves the waiting request of least start tag (ties: arrival order).

So two backlogged tenants of one band get equal token throughput whatever their request sizes (a tenant
sending 4,000-token requests gets a quarter as many served as one sending 1,000-token requests), a tenant
that was idle re-enters at the band's virtual time (no credit saved up while idle, no starvation of the
others), and ``weight`` scales a tenant's share. SFQ's fairness bound: over any interval in which two
tenants are both backlogged, their normalised served tokens differ by at most ``c1/w1 + c2/w2`` for
their largest requests ``c1``, ``c2`` (Goyal et al., Theorem 1).

Waiting is bounded: an entry past ``max_wait_s`` leaves the queue through :meth:`FairQueue.expire`, and a
queue at ``max_queued`` entries refuses new ones (:class:`QueueFull`); the request path answers both with
429 and ``retry-after``. No I/O and no clock of its own: the caller passes ``now`` (monotonic seconds).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Final

from inferlb.errors import InferlbError

#: Bands in serving order: a lower number is served first (``high`` 0, ``default`` 1, ``low`` 2).
BAND_HIGH: Final = 0
BAND_DEFAULT: Final = 1
BAND_LOW: Final = 2


class QueueFull(InferlbError):
    """The queue holds ``max_queued`` entries: the request is refused (429 with ``retry-after``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuedRequest:
    """One waiting request.

    Attributes:
        request_id: the caller's id (unique among waiting entries).
        tenant: the tenant's name (the unit of fairness within a band).
        band: priority band, :data:`BAND_HIGH` .. :data:`BAND_LOW` (any int: lower is served first).
        cost_tokens: tokens the request will occupy (prompt + completion budget), >= 1.
        weight: the tenant's share weight (> 0; 1 for equal shares).
        enqueued_at: monotonic seconds when it joined.
        start_tag: its SFQ start tag (token units over weight).
    """

    request_id: str
    tenant: str
    band: int
    cost_tokens: int
    weight: float
    enqueued_at: float
    start_tag: float


@dataclass(slots=True)
class _Band:
    virtual_time: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    heap: list[tuple[float, int, str]] = field(default_factory=list)


class FairQueue:
    """Waiting requests of one model: strict priority bands, start-time fair queueing by tokens within one.

    Args:
        max_queued: entries held at most (>= 0; 0 refuses every push).
        max_wait_s: seconds an entry may wait before :meth:`expire` removes it (> 0).

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, *, max_queued: int, max_wait_s: float) -> None:
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self._bands: dict[int, _Band] = {}
        self._entries: dict[str, QueuedRequest] = {}
        self._orders: dict[str, int] = {}
        self._order = itertools.count()
        self._by_age: list[tuple[float, int, str]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def push(
        self, request_id: str, *, tenant: str, band: int, cost_tokens: int, now: float, weight: float = 1.0
    ) -> QueuedRequest:
        """Queue a request; returns its entry.

        Raises:
            QueueFull: ``max_queued`` entries are waiting.
            ValueError: ``request_id`` already waits, ``cost_tokens`` < 1 or ``weight`` <= 0.
        """
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already queued")
        if cost_tokens < 1:
            raise ValueError(f"cost_tokens must be >= 1, got {cost_tokens}")
        if weight <= 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        if len(self._entries) >= self.max_queued:
            raise QueueFull(f"{len(self._entries)} requests already wait for this model")
        b = self._bands.setdefault(band, _Band())
        start = max(b.virtual_time, b.finish.get(tenant, 0.0))
        b.finish[tenant] = start + cost_tokens / weight
        entry = QueuedRequest(
            request_id=request_id,
            tenant=tenant,
            band=band,
            cost_tokens=cost_tokens,
            weight=weight,
            enqueued_at=now,
            start_tag=start,
        )
        order = next(self._order)
        self._entries[request_id] = entry
        self._orders[request_id] = order
        heapq.heappush(b.heap, (start, order, request_id))
        heapq.heappush(self._by_age, (now, order, request_id))
        return entry

    def pop(self) -> QueuedRequest | None:
        """The entry to serve next (removed from the queue), or None when nothing waits."""
        for band in sorted(self._bands):
            b = self._bands[band]
            while b.heap:
                start, order, request_id = heapq.heappop(b.heap)
                if self._orders.get(request_id) != order:
                    continue  # removed or expired earlier (maybe queued again since): a stale slot
                entry = self._take(request_id)
                b.virtual_time = max(b.virtual_time, start)
                self._forget_idle(b)
                return entry
        return None

    def peek(self) -> QueuedRequest | None:
        """The entry :meth:`pop` would return next, left waiting (None when nothing waits)."""
        for band in sorted(self._bands):
            heap = self._bands[band].heap
            while heap:
                _, order, request_id = heap[0]
                if self._orders.get(request_id) == order:
                    return self._entries[request_id]
                heapq.heappop(heap)  # a stale slot (see pop)
        return None

    def remove(self, request_id: str) -> bool:
        """Take a waiting entry out (its client went away); False if it was not waiting.

        Its tenant keeps the finish tag it was given, as SFQ does for a packet dropped after tagging: the
        tenant is not credited for work it gave up.
        """
        if request_id not in self._entries:
            return False
        self._take(request_id)
        return True

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return the entries waiting more than ``max_wait_s`` by ``now``, oldest first."""
        out: list[QueuedRequest] = []
        while self._by_age and now - self._by_age[0][0] > self.max_wait_s:
            _, order, request_id = heapq.heappop(self._by_age)
            if self._orders.get(request_id) == order:
                out.append(self._take(request_id))
        if len(self._by_age) > 2 * len(self._entries) + 64:
            self._by_age = [t for t in self._by_age if self._orders.get(t[2]) == t[1]]
            heapq.heapify(self._by_age)
        if sum(len(b.heap) for b in self._bands.values()) > 2 * len(self._entries) + 64:
            for b in self._bands.values():
                b.heap = [t for t in b.heap if self._orders.get(t[2]) == t[1]]
                heapq.heapify(b.heap)
        return out

    def waiting(self, band: int | None = None) -> int:
        """Entries waiting (in ``band`` only, when given)."""
        if band is None:
            return len(self._entries)
        return sum(1 for e in self._entries.values() if e.band == band)

    def _take(self, request_id: str) -> QueuedRequest:
        self._orders.pop(request_id, None)
        return self._entries.pop(request_id)

    def _forget_idle(self, b: _Band) -> None:
        # A tenant whose finish tag is behind the virtual time would start at V anyway: drop its tag, so
        # the map holds only tenants that may still be ahead (bounded by the tenants with waiting entries
        # plus those served within the last request's span).
        if len(b.finish) > 2 * max(1, len(b.heap)) + 64:
            b.finish = {t: f for t, f in b.finish.items() if f > b.virtual_time}
