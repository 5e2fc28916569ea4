"""The settler of ``ext_proc.protocol: ext_authz`` with ``ext_proc.account_responses``: reservations made
by checks wait in a :class:`~inferlb.policy.settlement.SettlementLedger` for the access-log entry Envoy sends
at each request's end (:mod:`ext_proc.access_log` receives them), and are settled in the quota store once,
with the real usage or, when no entry arrives within the lease TTL, at the reservation
(:mod:`inferlb.policy.settlement` states the rule).

Why in the ext_authz process and not a process of its own: the ledger and, with ``quota_backend: memory``,
the quota book itself live in this process; a separate settler would need both shared (Redis only) and one
more hop per batch. The receiver's gRPC cost is paid once per batch (Envoy sends ~30 entries per message at
16 KiB), not per request, and the check path stays HTTP.

The settlement is also where the in-flight count of low-priority shedding (:mod:`inferlb.policy.shedding`)
learns that a request ended: a check that counted its request on a cluster (``state.in_flight``) passes the
cluster to :meth:`Meter.reserve`, and the settlement leaves it, so the count is "admitted minus settled":
late by the entry's trip (up to ``ext_proc.meter_flush_interval_ms``), and an entry that never comes holds
its request in the count until the TTL settles it.

Meter ids are ``p<process>-<nonce>-<n>``: the process's index
(:func:`~inferlb.policy.settlement.meter_id_prefix`), a random nonce per process start and a counter, so an
entry of a request admitted before a restart never matches a reservation made after it (it is unknown, and
ignored).

**Several processes** (``ext_proc.extra_listen``, with ``quota_backend: redis`` whenever a tenant has a
limit): every request-path process is its own settler, process ``i`` on
``ext_proc.meter_addresses()[i]`` (``meter_listen``, then ``extra_meter_listen``), and settles only the
reservations it made. Envoy routes each entry to its owner: the gateway's connection manager has one gRPC
access logger per process (:func:`xds_server.resources.listener.build_meter_access_logs`), each with an
access-log ``metadata_filter`` that takes only the entries whose meter id (the ext_authz dynamic metadata)
starts with that process's prefix, sending to that process's own cluster (``inferlb_meter``,
``inferlb_meter_1``, ...). A request's entry thus reaches the settler that holds its reservation and no
other, so the exactly-once rule of :mod:`inferlb.policy.settlement` holds per process as with one, and the
quota store (Redis, shared) is settled by whichever process admitted. What a process holds is its own:
``kill -9`` of one loses only its unsettled ids (they stay charged at their reservation in the shared store
and their concurrency leases expire by their TTL), while Envoy's loggers to the other processes go on; a
drained Envoy stop (:meth:`inferlb.ops.stack.Stack.drain_envoy`) flushes every logger alike.

Why not reservations in Redis, any settler settling any id: it would cost each metered request two more
Redis round trips (writing the reservation on the check's path, an atomic take when its entry comes) and a
shared deadline index swept under a lock for the lost-entry rule, where Envoy's routing costs one prefix
comparison per logger per request and nothing in Redis; it would buy settling a crashed process's
requests at their usage instead of at their reservation (an overcharge for those, never an undercharge). Envoy
opens one access-log stream per logger per worker, so N processes mean N streams per worker, each with its
own batches (at most one flush interval late each, as with one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Final

from ext_proc.state import ExtProcState
from inferlb.policy.class_guard import ClassHold
from inferlb.policy.quota import Admitted, MemoryQuotaStore, lease_ttl_s
from inferlb.policy.settlement import (
    MeterEntry,
    Outcome,
    Settlement,
    SettlementLedger,
    meter_id_prefix,
)

log = logging.getLogger("ext_authz")

#: The ledger's TTL is the lease TTL less this (s, at most half of it), so a reservation settles while
#: its store lease (taken a moment before, at admission) still stands.
TTL_GUARD_S: Final = 1.0
#: Seconds between sweeps for reservations past their TTL.
SWEEP_INTERVAL_S: Final = 1.0
#: ``inferlb_usage_settled_total{source}`` of each outcome (ext_proc mode's sources).
_SOURCE: Final = {
    Outcome.METERED: "reported",
    Outcome.UNMETERED: "reserved",
    Outcome.PRODUCED: "counted",
    Outcome.EXPIRED: "reserved",
    Outcome.NOT_SERVED: "none",
}


def ledger_ttl_s(lease_s: float) -> float:
    """The ledger's TTL for a lease TTL of ``lease_s`` seconds (see :data:`TTL_GUARD_S`)."""
    return lease_s - min(TTL_GUARD_S, lease_s / 2)


class Meter:
    """Reservations awaiting their access-log entry, settled in ``state.quotas`` (module docstring).

    Args:
        state: the quota store, metrics and current config (its lease TTL sets the ledger's).
        process: this request-path process's index (0: ``ext_proc.listen``, ``i + 1``:
            ``extra_listen[i]``), which starts every meter id it makes.
        clock: monotonic seconds (tests inject one).

    Raises:
        ValueError: ``process`` < 0.
    """

    def __init__(
        self, state: ExtProcState, *, process: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.state = state
        self.clock = clock
        self.process = process
        self.ledger = SettlementLedger(ledger_ttl_s(lease_ttl_s(state.gateway.config)))
        self._nonce = meter_id_prefix(process) + secrets.token_hex(6)
        self._next = 0
        self._sweeper: asyncio.Task[None] | None = None

    def reserve(
        self,
        admitted: Admitted,
        *,
        model: str,
        prompt_tokens: int,
        in_flight: str | None = None,
        picked: str | None = None,
        length: ClassHold | None = None,
    ) -> str:
        """Record an admitted request; returns its meter id (for the check answer's
        :data:`~inferlb.request.headers.METER` header). ``in_flight``: the cluster whose count in
        ``state.in_flight`` the request already holds (low-priority shedding); ``picked``: the endpoint
        whose count in ``state.picking.book`` it holds (endpoint picking); ``length``: its length class's
        hold (:mod:`ext_proc.length_state`); its settlement, whatever settles it, leaves every count, and a
        metered usage teaches the output predictor."""
        self._next += 1
        meter_id = f"{self._nonce}-{self._next}"
        self.ledger.ttl_s = ledger_ttl_s(lease_ttl_s(self.state.gateway.config))
        self.ledger.reserve(
            meter_id,
            admitted,
            model=model,
            prompt_tokens=prompt_tokens,
            now=self.clock(),
            in_flight=in_flight,
            picked=picked,
            length=length,
        )
        return meter_id

    async def on_entries(self, entries: list[MeterEntry]) -> None:
        """Settle what one batch of access-log entries settles (the receiver's sink)."""
        metrics = self.state.metrics
        for entry in entries:
            outcome, settlement = self.ledger.entry(entry, self.clock())
            if settlement is not None:
                await self._apply(settlement)
            if outcome in (Outcome.DUPLICATE, Outcome.LATE, Outcome.UNKNOWN):
                metrics.meter_entries_ignored.labels(outcome.value).inc()

    async def sweep(self) -> int:
        """Settle the reservations past their TTL at the reservation; returns how many."""
        expired = self.ledger.expire(self.clock())
        for settlement in expired:
            await self._apply(settlement)
        return len(expired)

    async def _apply(self, s: Settlement) -> None:
        if s.reserved.in_flight is not None:
            # the request's end (its entry, or the TTL standing for a lost one) leaves the in-flight count
            self.state.in_flight.leave(s.reserved.in_flight)
        if s.reserved.picked is not None:
            self.state.picking.leave(s.reserved.picked)
        if s.reserved.length is not None:
            # only a reported usage teaches the output predictor: a count or the reservation is not the
            # answer's length
            completion = s.completion_tokens if s.outcome is Outcome.METERED else None
            self.state.length.release(s.reserved.length, completion)
        metrics = self.state.metrics
        admitted = s.reserved.admitted
        metrics.meter_settlements.labels(s.outcome.value).inc()
        metrics.usage_settled.labels(_SOURCE[s.outcome]).inc()
        metrics.tokens_charged(admitted.tenant, s.reserved.model, s.prompt_tokens, s.completion_tokens)
        quotas = self.state.quotas
        try:
            if isinstance(quotas, MemoryQuotaStore):
                quotas.settle_now(admitted, s.tokens)
            else:
                await quotas.settle(admitted, s.tokens)
        except Exception:
            log.exception("settling the quota of tenant %r failed", admitted.tenant)

    def start(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Sweep every ``interval_s`` seconds in a background task until :meth:`aclose`."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.sweep()
                except Exception:
                    log.exception("sweeping expired reservations failed")

        self._sweeper = asyncio.ensure_future(loop())

    async def aclose(self) -> None:
        """Stop sweeping. Reservations still waiting stay charged at their reservation (the admission
        counted it) and their leases expire in the store by their TTL."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self.ledger.pending:
            log.info("stopping with %d reservations awaiting their access-log entry", self.ledger.pending)
