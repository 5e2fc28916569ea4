"""Waiting in a :class:`~inferlb.policy.fair_queue.FairQueue` on an event loop: the part of fair queueing
under saturation that both the EPP (:mod:`epp.flow`) and inferlb's own request path
(:mod:`ext_proc.queueing`, ext_authz and ext_proc modes) share.

A :class:`Waiter` is one request waiting for room; its :attr:`Waiter.outcome` future resolves to the
decision the owner makes when the waiter reaches the head of the queue and a slot is free
(:meth:`FairWaiters.take_head`), or to the owner's timeout answer once it waited ``max_wait_s``
(:meth:`FairWaiters.expire_due`, armed as an event-loop timer per waiter). A waiter whose client went away
leaves through :meth:`FairWaiters.abandon` (or is dropped on the way when its future was cancelled).
What "a slot is free" means, and what a decision is, stay with the owner: this module only keeps the
order (strict bands, tenants fair by tokens within a band: the queue's module doc), the bounds and the
timers. One owner, the event loop: no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from inferlb.policy.fair_queue import FairQueue, QueueFull

__all__ = ["FairWaiters", "QueueFull", "Waiter"]

D = TypeVar("D")
W = TypeVar("W", bound="Waiter[Any]")


@dataclass(eq=False, slots=True, kw_only=True)
class Waiter(Generic[D]):
    """One waiting request (subclass it to carry what the owner needs at admission).

    Attributes:
        request_id: the queue's id for it (:meth:`FairWaiters.new_id`).
        tenant: the unit of fairness within a band.
        band: the priority band (lower is served first).
        cost_tokens: what it will occupy (tokens, >= 1).
        enqueued_at: monotonic seconds when it joined.
        outcome: resolves to its decision; cancelled when its client goes away first.
        timer: its expiry timer while it waits.
    """

    request_id: str
    tenant: str
    band: int
    cost_tokens: int
    enqueued_at: float
    outcome: asyncio.Future[D]
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class FairWaiters(Generic[W, D]):
    """The waiters of one queue (one EPP pool, one model of the request path).

    Args:
        max_queued: waiters at most (>= 1); one more raises :class:`QueueFull`.
        max_wait_s: seconds a waiter may wait (> 0) before ``on_expired`` answers it.
        on_expired: the decision of a waiter that waited ``max_wait_s`` (a 429 with ``retry-after``).
        on_left: called as each waiter leaves, with the outcome (``admitted``, ``unavailable``,
            ``expired``, ``cancelled`` or the owner's word given to :meth:`take_head`) and the seconds it
            waited: where the owner counts waits.
        clock: monotonic seconds (the event loop's timers run on :func:`time.monotonic` too).

    Raises:
        ValueError: a bound out of range.

    Must be used from the event loop that awaits the outcomes (timers, futures).
    """

    def __init__(
        self,
        *,
        max_queued: int,
        max_wait_s: float,
        on_expired: Callable[[W], D],
        on_left: Callable[[W, str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.queue = FairQueue(max_queued=max_queued, max_wait_s=max_wait_s)
        self.max_wait_s = max_wait_s
        self.on_expired = on_expired
        self.on_left = on_left
        self.clock = clock
        self._waiters: dict[str, W] = {}
        self._per_band: Counter[int] = Counter()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def new_id(self) -> str:
        """A fresh request id for a :class:`Waiter`."""
        return str(next(self._ids))

    def enqueue(self, waiter: W) -> W:
        """Queue ``waiter`` (its ``request_id`` from :meth:`new_id`, ``enqueued_at`` from the clock); it
        expires after ``max_wait_s``.

        Raises:
            QueueFull: ``max_queued`` waiters wait already.
        """
        self.queue.push(
            waiter.request_id,
            tenant=waiter.tenant,
            band=waiter.band,
            cost_tokens=waiter.cost_tokens,
            now=waiter.enqueued_at,
        )
        waiter.timer = asyncio.get_running_loop().call_later(self.max_wait_s, self.expire_due, waiter)
        self._waiters[waiter.request_id] = waiter
        self._per_band[waiter.band] += 1
        return waiter

    def head(self) -> W | None:
        """The waiter served next (bands strictly, then fair within the band), left waiting; waiters whose
        client went away in the meantime (a cancelled outcome) are dropped on the way."""
        while (entry := self.queue.peek()) is not None:
            waiter = self._waiters[entry.request_id]
            if not waiter.outcome.cancelled():
                return waiter
            self.queue.remove(entry.request_id)
            self._leave(waiter, "cancelled")
        return None

    def take_head(self, decision: D, outcome: str) -> W:
        """Answer the :meth:`head` waiter with ``decision``; ``outcome`` is what :attr:`on_left` is told.

        Raises:
            LookupError: nothing waits.
        """
        entry = self.queue.pop()
        if entry is None:
            raise LookupError("no request waits")
        waiter = self._waiters[entry.request_id]
        self._leave(waiter, outcome)
        waiter.outcome.set_result(decision)
        return waiter

    def abandon(self, waiter: W) -> D | None:
        """``waiter``'s client went away: out of the queue if it still waits (its outcome cancelled).
        Returns the decision when one was made before (the caller releases what it holds), else None."""
        if self._waiters.get(waiter.request_id) is waiter:
            self.queue.remove(waiter.request_id)
            self._leave(waiter, "cancelled")
            waiter.outcome.cancel()
            return None
        if waiter.outcome.done() and not waiter.outcome.cancelled():
            decision: D = waiter.outcome.result()
            return decision
        return None

    def expire_due(self, waiter: W | None = None) -> list[W]:
        """Answer every waiter past ``max_wait_s`` with :attr:`on_expired`; returns them (``waiter``'s timer
        calls this; it is armed again when the clock has not quite reached its deadline yet)."""
        out: list[W] = []
        for entry in self.queue.expire(self.clock()):
            expired = self._waiters[entry.request_id]
            self._leave(expired, "expired")
            if not expired.outcome.done():
                expired.outcome.set_result(self.on_expired(expired))
                out.append(expired)
        if waiter is not None and self._waiters.get(waiter.request_id) is waiter:
            left = waiter.enqueued_at + self.max_wait_s - self.clock()
            waiter.timer = asyncio.get_running_loop().call_later(
                max(left, 0.0) + 0.001, self.expire_due, waiter
            )
        return out

    def waiting(self) -> dict[int, int]:
        """Band -> waiters (bands with none left out)."""
        return dict(self._per_band)

    def _leave(self, waiter: W, outcome: str) -> None:
        del self._waiters[waiter.request_id]
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        self._per_band[waiter.band] -= 1
        if not self._per_band[waiter.band]:
            del self._per_band[waiter.band]
        if self.on_left is not None:
            self.on_left(waiter, outcome, max(0.0, self.clock() - waiter.enqueued_at))
