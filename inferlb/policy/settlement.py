"""Settling reservations from access-log entries, exactly once (pure: the clock is passed in).

In ``ext_proc.protocol: ext_authz`` mode the gateway's Python side never sees a response. Admission
reserves prompt + output cap (:mod:`inferlb.policy.quota`) and records the reservation here under a *meter
id* the gateway made (:meth:`SettlementLedger.reserve`); the check's answer hands that id to Envoy, whose
response-body Lua filter reads the model server's ``usage`` and whose batched gRPC access log brings an
entry back with the id, the status and the usage (:class:`MeterEntry`, up to one flush interval late).

The rule, for each reserved id (``t0`` its reservation time, ``ttl`` the ledger's time to live):

- the **first entry for the id that arrives before ``t0 + ttl``** settles it, at the entry's charge
  (:func:`entry_charge`): the reported usage when the entry has one, nothing when the upstream answered
  non-2xx without one (nothing was generated, as ext_proc mode), for a 2xx stream cut before its usage the
  prompt count plus the text bytes it streamed (:data:`PRODUCED_KEY`: never below the tokens it streamed,
  never above the reservation), else the reservation itself (a JSON response cut before its usage, a body
  the scan could not read);
- if no entry arrived by ``t0 + ttl``, :meth:`SettlementLedger.expire` (or an entry arriving later)
  settles it **at the reservation** and counts it as expired;
- every other entry (a duplicate, one after the TTL settled the id, one of an id never reserved here, e.g.
  from before a restart: ids carry a per-process nonce) settles nothing.

So each id is settled exactly once, and never both at its usage and its reservation; the amount depends
only on whether its first entry came before its deadline, not on the order of other events. A request is
never charged below its real usage unless the model server reported less than it used. What a restart
loses (the ledger is in memory) stays charged at the reservation, as the admission counted it, and its
concurrency lease expires in the store by its own TTL (:func:`inferlb.policy.quota.lease_ttl_s`).

Settled ids are remembered for ``remember_s`` after settlement, to tell duplicates and late entries from
unknown ones (both are ignored); memory is bounded by the requests admitted in ``ttl + remember_s``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from inferlb.policy.class_guard import ClassHold
from inferlb.policy.quota import Admitted

#: Dynamic-metadata namespace of the headers Envoy's ext_authz filter copies from the check answer
#: (``dynamic_metadata_from_headers``; Envoy's filter name): the meter id is there.
AUTHZ_NAMESPACE: Final = "envoy.filters.http.ext_authz"
#: Dynamic-metadata namespace and key the gateway's response Lua filter writes the ``usage`` object's JSON
#: text to (:data:`xds_server.resources.listener.METER_LUA`), read back from the access-log entry.
USAGE_NAMESPACE: Final = "inferlb.meter"
USAGE_KEY: Final = "usage"
#: Key (in :data:`USAGE_NAMESPACE`) of an SSE answer's generated-text bytes so far, whole events only (a
#: number the Lua filter updates after each chunk; -1 once an event was too long to count): the raw JSON
#: bytes of the string values of the events' text keys, so never fewer than the UTF-8 bytes of the text
#: streamed, which are never fewer than its tokens (every token of a byte-level BPE, as tiktoken's, is at
#: least one byte).
PRODUCED_KEY: Final = "produced"
#: Keys (in :data:`USAGE_NAMESPACE`) of the answer's reported ``usage.prompt_tokens`` and
#: ``usage.completion_tokens`` as numbers, for the gateway's JSON access log (``gateway.access_log``):
#: written by the Lua filter (ext_authz mode) or by ext_proc's last response answer (ext_proc mode).
PROMPT_TOKENS_KEY: Final = "prompt_tokens"
COMPLETION_TOKENS_KEY: Final = "completion_tokens"


def meter_id_prefix(process: int) -> str:
    """The prefix of every meter id request-path process ``process`` makes (0: the one on
    ``ext_proc.listen``, ``i + 1``: ``extra_listen[i]``), ``p<process>-``: Envoy's access log for that
    process's settler takes the entries whose id starts with it
    (:func:`xds_server.resources.listener.build_meter_access_logs`). The dash ends the number, so no
    process's prefix is a prefix of another's (``p1-`` vs ``p10-``).

    Raises:
        ValueError: ``process`` < 0.
    """
    if process < 0:
        raise ValueError(f"process must be >= 0, not {process}")
    return f"p{process}-"


class Outcome(StrEnum):
    """What happened to one reservation or one entry (metric label values)."""

    #: settled by its entry, at the reported usage
    METERED = "metered"
    #: settled by its entry at the reservation: the entry carried no usage
    UNMETERED = "unmetered"
    #: settled by its entry at the admission's prompt count plus the text bytes a stream cut before its
    #: usage had streamed (at most the reservation): the entry carried no usage but a produced count
    PRODUCED = "produced"
    #: settled by its entry at zero: the upstream answered non-2xx and reported no usage
    NOT_SERVED = "not_served"
    #: no entry before the TTL: settled at the reservation
    EXPIRED = "expired"
    #: an entry for an id already settled by an earlier entry (ignored)
    DUPLICATE = "duplicate"
    #: an entry for an id the TTL had already settled (ignored)
    LATE = "late"
    #: an entry for an id this ledger never reserved or has forgotten (ignored)
    UNKNOWN = "unknown"


@dataclass(frozen=True, kw_only=True, slots=True)
class MeterEntry:
    """What Envoy's access log says about one metered request.

    Attributes:
        meter_id: the id the gateway's check answer gave the request.
        status: the HTTP status sent to the client (0 when none was sent, e.g. the client left first).
        usage: ``(prompt, completion)`` tokens the model server reported, or None when none was read.
        produced: a 2xx SSE answer's generated-text bytes in whole events (:data:`PRODUCED_KEY`), an upper
            bound of its completion tokens; None when not counted (not SSE, not 2xx, an event too long).
    """

    meter_id: str
    status: int
    usage: tuple[int, int] | None
    produced: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Reserved:
    """One reservation waiting for its entry.

    Attributes:
        admitted: the store's admission (tenant, reserved tokens, lease, sub-window).
        model: the canonical model name (metric label).
        prompt_tokens: the prompt tokens counted at admission (tokens).
        deadline: the ledger clock time (s) after which the reservation settles as is.
        in_flight: the cluster whose in-flight count (:class:`inferlb.policy.shedding.InFlight`) holds the
            request until it settles, None when it is not counted (a ``high`` tenant, no shedding).
        picked: the endpoint (``ip:port``) whose in-flight count of endpoint picking
            (:class:`inferlb.policy.endpoint_book.EndpointBook`) holds the request until it settles, None
            when its model does not pick endpoints.
        length: for a length-aware model's request, its class's in-flight hold and the predictor's query
            (:class:`inferlb.policy.class_guard.ClassHold`), released by its settlement; None otherwise.
    """

    admitted: Admitted
    model: str
    prompt_tokens: int
    deadline: float
    in_flight: str | None = None
    picked: str | None = None
    length: ClassHold | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Settlement:
    """Settle ``reserved`` at ``tokens`` (prompt + completion), for the reason ``outcome``.

    Attributes:
        prompt_tokens / completion_tokens: the split of ``tokens`` for the usage metrics (tokens): the
            reported usage, or the admission's prompt count and the rest of the reservation.
    """

    reserved: Reserved
    outcome: Outcome
    tokens: int
    prompt_tokens: int
    completion_tokens: int


def entry_charge(reserved: Reserved, entry: MeterEntry) -> Settlement:
    """What ``entry`` settles ``reserved`` at (see the module docstring)."""
    if entry.usage is not None:
        return _charge(reserved, Outcome.METERED, *entry.usage)
    if entry.status and not 200 <= entry.status < 300:
        return _charge(reserved, Outcome.NOT_SERVED, 0, 0)
    if entry.produced is not None and entry.produced >= 0 and 200 <= entry.status < 300:
        # a stream cut before its usage (client gone, upstream reset): what it streamed, bounded above
        prompt = min(reserved.prompt_tokens, reserved.admitted.tokens)
        return _charge(
            reserved, Outcome.PRODUCED, prompt, min(entry.produced, reserved.admitted.tokens - prompt)
        )
    return _at_reservation(reserved, Outcome.UNMETERED)


def _charge(reserved: Reserved, outcome: Outcome, prompt: int, completion: int) -> Settlement:
    return Settlement(
        reserved=reserved,
        outcome=outcome,
        tokens=prompt + completion,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


def _at_reservation(reserved: Reserved, outcome: Outcome) -> Settlement:
    prompt = min(reserved.prompt_tokens, reserved.admitted.tokens)
    return _charge(reserved, outcome, prompt, reserved.admitted.tokens - prompt)


class SettlementLedger:
    """Reservations waiting for their access-log entry, settled exactly once (module docstring).

    Not thread-safe: one event loop owns it. Times are one monotonic clock's seconds; a clock read that
    goes backwards counts as standing still.

    Args:
        ttl_s: seconds a reservation waits for its entry (> 0).
        remember_s: seconds a settled id is remembered, to classify later entries (>= 0).

    Raises:
        ValueError: ``ttl_s`` <= 0 or ``remember_s`` < 0.
    """

    def __init__(self, ttl_s: float, *, remember_s: float | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, not {ttl_s}")
        remember = ttl_s if remember_s is None else remember_s
        if remember < 0:
            raise ValueError(f"remember_s must be >= 0, not {remember}")
        self.ttl_s = ttl_s
        self.remember_s = remember
        self._now = float("-inf")
        # both in insertion order, which is deadline order (the clock never goes back here)
        self._pending: OrderedDict[str, Reserved] = OrderedDict()
        self._settled: OrderedDict[str, tuple[float, bool]] = OrderedDict()  # id -> (forget at, by TTL)

    def _clock(self, now: float) -> float:
        self._now = max(self._now, now)
        return self._now

    @property
    def pending(self) -> int:
        """Reservations waiting for their entry."""
        return len(self._pending)

    def reserve(
        self,
        meter_id: str,
        admitted: Admitted,
        *,
        model: str,
        prompt_tokens: int,
        now: float,
        in_flight: str | None = None,
        picked: str | None = None,
        length: ClassHold | None = None,
    ) -> None:
        """Record ``admitted`` under ``meter_id`` (unique per reservation: the caller's ids never repeat);
        ``in_flight``, ``picked`` and ``length`` are carried to its :class:`Settlement`
        (:attr:`Reserved.in_flight`, :attr:`Reserved.picked`, :attr:`Reserved.length`).

        Raises:
            ValueError: ``meter_id`` is waiting or was settled and is still remembered.
        """
        if meter_id in self._pending or meter_id in self._settled:
            raise ValueError(f"meter id {meter_id!r} reused")
        t = self._clock(now)
        self._pending[meter_id] = Reserved(
            admitted=admitted,
            model=model,
            prompt_tokens=prompt_tokens,
            deadline=t + self.ttl_s,
            in_flight=in_flight,
            picked=picked,
            length=length,
        )

    def entry(self, entry: MeterEntry, now: float) -> tuple[Outcome, Settlement | None]:
        """Apply one access-log entry at ``now``: its outcome, and the settlement to carry out (None when
        the entry settles nothing). An entry at or after its reservation's deadline is late: the
        reservation then settles at the reservation (outcome :attr:`Outcome.LATE`, settlement
        :attr:`Outcome.EXPIRED`), as :meth:`expire` would have."""
        t = self._clock(now)
        reserved = self._pending.pop(entry.meter_id, None)
        if reserved is None:
            seen = self._settled.get(entry.meter_id)
            if seen is None:
                return Outcome.UNKNOWN, None
            return (Outcome.LATE if seen[1] else Outcome.DUPLICATE), None
        if reserved.deadline <= t:
            self._remember(entry.meter_id, by_ttl=True)
            return Outcome.LATE, _at_reservation(reserved, Outcome.EXPIRED)
        self._remember(entry.meter_id, by_ttl=False)
        settlement = entry_charge(reserved, entry)
        return settlement.outcome, settlement

    def expire(self, now: float) -> list[Settlement]:
        """Settle at the reservation every reservation whose deadline is <= ``now`` (oldest first), and
        forget settled ids older than ``remember_s``."""
        t = self._clock(now)
        out: list[Settlement] = []
        while self._pending:
            meter_id, reserved = next(iter(self._pending.items()))
            if reserved.deadline > t:
                break
            del self._pending[meter_id]
            self._remember(meter_id, by_ttl=True)
            out.append(_at_reservation(reserved, Outcome.EXPIRED))
        while self._settled:
            meter_id, (forget_at, _) = next(iter(self._settled.items()))
            if forget_at > t:
                break
            del self._settled[meter_id]
        return out

    def _remember(self, meter_id: str, *, by_ttl: bool) -> None:
        self._settled[meter_id] = (self._now + self.remember_s, by_ttl)

    def expire_all(self) -> list[Settlement]:
        """Settle every waiting reservation at the reservation now (a shutdown that cannot wait)."""
        out = [_at_reservation(r, Outcome.EXPIRED) for r in self._pending.values()]
        for meter_id in list(self._pending):
            self._remember(meter_id, by_ttl=True)
        self._pending.clear()
        return out
