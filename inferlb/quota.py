"""Per-tenant request and token quotas as token buckets (pure: the clock is passed in).

Each limited tenant has up to two buckets, one for requests per minute and one for tokens per minute
(prompt + completion). A bucket holds at most ``capacity`` = the per-minute quota and refills continuously
at ``quota / 60`` per second: the classic token bucket (Turner, 1986; the same admission rule as the
Generic Cell Rate Algorithm of ITU-T I.371 with burst tolerance = one minute of quota). Consequences worth
knowing:

- the long-run rate never exceeds the quota, and over any window of ``T`` seconds the admitted amount is at
  most ``capacity + capacity * T / 60`` (a full bucket plus its refill), e.g. up to 2x the quota in the
  first minute of an idle tenant;
- a request is admitted only if *both* buckets hold enough, and then both are charged together, so a
  refusal by one limit never consumes the other;
- a request that needs more tokens than the whole per-minute quota can never fit and is refused as such
  (no retry time is given for it).

Admission charges prompt tokens + the largest completion the request may produce (its ``max_tokens`` x
``n``, or the model's ``default_max_tokens``). :meth:`QuotaBook.reconcile` is the seam for settling that
reservation against the real ``usage`` of the response (issue 4): unused tokens are credited back, an
overrun is debited (the bucket may go below zero, delaying later requests).

Two further limits are not rates but counts:

- ``max_concurrent_requests``: every admitted request holds a *lease* (an id) until
  :meth:`QuotaBook.settle` returns it, at the end of its response or when the stream is aborted; settling
  the same lease twice releases it once.
- ``daily_token_budget``: prompt + completion tokens per UTC calendar day (day = ``floor(wall / 86400)``).
  Admission adds the reservation to the day's total and refuses when it would pass the budget, so the
  admitted total of a day never exceeds it; settling replaces the reservation with the real usage. A
  request admitted before midnight is billed to the day it was admitted on (its settlement after midnight
  does not touch the new day).

Not thread-safe: one asyncio event loop owns a :class:`QuotaBook`. :class:`MemoryQuotaStore` is the async
:class:`QuotaStore` over it; :mod:`inferlb.quota_redis` is the same contract over Redis, shared by replicas.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Protocol

from inferlb.config import Config


class Limit(StrEnum):
    """Which per-minute limit refused a request (named after the config fields)."""

    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    MAX_CONCURRENT_REQUESTS = "max_concurrent_requests"
    DAILY_TOKEN_BUDGET = "daily_token_budget"
    #: The shared quota state (Redis) could not be reached and the store fails closed (503, not 429).
    QUOTA_BACKEND_UNAVAILABLE = "quota_backend_unavailable"


#: Seconds in a UTC day: the daily budget's day is ``floor(wall_clock_s / SECONDS_PER_DAY)``.
SECONDS_PER_DAY: Final = 86_400
#: ``retry-after`` for a concurrency refusal (s): a slot frees when any in-flight request ends, which
#: cannot be predicted; one second is the smallest whole value a client can be told.
CONCURRENCY_RETRY_AFTER_S: Final = 1.0


def utc_day(wall_s: float) -> int:
    """The UTC calendar day number (days since 1970-01-01) of a wall-clock time in seconds."""
    return int(wall_s // SECONDS_PER_DAY)


@dataclass(frozen=True, kw_only=True, slots=True)
class TenantLimits:
    """A tenant's quotas; ``None`` means unlimited.

    Attributes:
        requests_per_minute: requests admitted per minute (token bucket).
        tokens_per_minute: prompt + completion tokens per minute (token bucket).
        max_concurrent_requests: requests in flight at once (admission to end of response).
        daily_token_budget: prompt + completion tokens per UTC day.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    daily_token_budget: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Admitted:
    """The request fits: ``tokens`` (prompt + output cap) and one request were taken from the buckets.

    Attributes:
        tenant: the tenant charged.
        tokens: the reservation (tokens), settled later with :meth:`QuotaBook.settle`.
        lease: the id of the concurrency slot / reservation ("" for a tenant with no limits).
        day: the UTC day the reservation counts against (see :func:`utc_day`).
        degraded: admitted without checking, because the shared quota state was unreachable and the store
            fails open.
    """

    tenant: str
    tokens: int
    lease: str = ""
    day: int = 0
    degraded: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Refused:
    """The request does not fit now (or ever); nothing was taken.

    Attributes:
        limit: the limit that refused it (the one with the longest wait when both do).
        retry_after_s: seconds until both buckets would hold enough (> 0), or None when it can never fit.
        message: an OpenAI-style explanation with the numbers.
    """

    tenant: str
    limit: Limit
    retry_after_s: float | None
    message: str

    @property
    def never_fits(self) -> bool:
        """True when the request asks for more than a whole minute of quota."""
        return self.retry_after_s is None


class TokenBucket:
    """A continuously refilled bucket: ``capacity`` units, ``refill_per_s`` units per second.

    ``level`` may be negative after a debit from :meth:`QuotaBook.reconcile` (usage above the reservation).
    """

    __slots__ = ("capacity", "level", "refill_per_s", "updated_at")

    def __init__(self, capacity: float, now: float, level: float | None = None) -> None:
        self.capacity = float(capacity)
        self.refill_per_s = self.capacity / 60.0
        self.level = self.capacity if level is None else min(level, self.capacity)
        self.updated_at = now

    def refill(self, now: float) -> float:
        """Bring ``level`` up to ``now`` (seconds, monotonic) and return it. A clock going backwards is
        treated as no time passing."""
        elapsed = now - self.updated_at
        if elapsed > 0:
            self.level = min(self.capacity, self.level + elapsed * self.refill_per_s)
            self.updated_at = now
        return self.level

    def wait_for(self, amount: float) -> float:
        """Seconds until ``level`` reaches ``amount`` at the refill rate (0 if it already has; call
        :meth:`refill` first)."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.refill_per_s


class _TenantState:
    __slots__ = ("day", "day_tokens", "inflight", "limits", "requests", "tokens")

    def __init__(self, limits: TenantLimits, now: float) -> None:
        self.limits = limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = TokenBucket(rpm, now) if rpm is not None else None
        self.tokens = TokenBucket(tpm, now) if tpm is not None else None
        self.inflight: set[str] = set()
        self.day = -1
        self.day_tokens = 0  # tokens admitted (reservations, then real usage once settled) on ``day``


def limits_from_config(config: Config) -> dict[str, TenantLimits]:
    """Tenant name -> its per-minute limits, from ``config.tenants``."""
    return {
        t.name: TenantLimits(
            requests_per_minute=t.requests_per_minute,
            tokens_per_minute=t.tokens_per_minute,
            max_concurrent_requests=t.max_concurrent_requests,
            daily_token_budget=t.daily_token_budget,
        )
        for t in config.tenants
    }


class QuotaBook:
    """The buckets of every tenant. Tenants not in the limits map are unlimited.

    Args:
        limits: tenant name -> :class:`TenantLimits`.
        now: the current time (seconds, any monotonic origin); new buckets start full.
    """

    def __init__(self, limits: Mapping[str, TenantLimits], now: float) -> None:
        self._tenants: dict[str, _TenantState] = {}
        self._lease_ids = itertools.count(1)
        self.update_limits(limits, now)

    def update_limits(self, limits: Mapping[str, TenantLimits], now: float) -> None:
        """Apply new limits (a config reload).

        Tenants whose limits did not change keep their buckets untouched. A tenant whose limits changed
        keeps its current level, clipped to the new capacity, so a reload neither refills a drained tenant
        nor lets it exceed a lowered quota; its in-flight leases and today's token total carry over. New
        tenants start full; removed tenants are forgotten.
        """
        old = self._tenants
        fresh: dict[str, _TenantState] = {}
        for name, lim in limits.items():
            prev = old.get(name)
            if prev is not None and prev.limits == lim:
                fresh[name] = prev
                continue
            state = _TenantState(lim, now)
            if prev is not None:
                for new_b, old_b in ((state.requests, prev.requests), (state.tokens, prev.tokens)):
                    if new_b is not None and old_b is not None:
                        new_b.level = min(new_b.capacity, old_b.refill(now))
                state.inflight = prev.inflight
                state.day, state.day_tokens = prev.day, prev.day_tokens
            fresh[name] = state
        self._tenants = fresh

    def try_admit(
        self, tenant: str, tokens: int, now: float, *, wall: float = 0.0, lease: str | None = None
    ) -> Admitted | Refused:
        """Admit one request of ``tokens`` tokens (prompt + output cap) for ``tenant`` at ``now`` (s).

        Takes 1 from the requests bucket, ``tokens`` from the tokens bucket and from today's budget, and a
        concurrency slot, only if all of them have room; otherwise takes nothing and says which limit
        refused and after how long it would fit.

        Args:
            now: monotonic seconds, for the per-minute buckets.
            wall: wall-clock seconds since the epoch, for the UTC day of the daily budget.
            lease: the id to hold the concurrency slot under (a fresh one when None).
        """
        state = self._tenants.get(tenant)
        day = utc_day(wall)
        if state is None:
            return Admitted(tenant=tenant, tokens=tokens, day=day)
        lim = state.limits
        budget = lim.daily_token_budget
        if budget is not None and tokens > budget:
            return Refused(
                tenant=tenant,
                limit=Limit.DAILY_TOKEN_BUDGET,
                retry_after_s=None,
                message=(
                    f"Request too large for tenant {tenant!r}: it needs {tokens} tokens (prompt + max "
                    f"output), more than the whole daily token budget of {budget}, so it can never be "
                    "admitted. Shorten the prompt or lower max_tokens/max_completion_tokens or n."
                ),
            )
        max_inflight = lim.max_concurrent_requests
        if max_inflight is not None and len(state.inflight) >= max_inflight:
            return Refused(
                tenant=tenant,
                limit=Limit.MAX_CONCURRENT_REQUESTS,
                retry_after_s=CONCURRENCY_RETRY_AFTER_S,
                message=(
                    f"Too many concurrent requests for tenant {tenant!r}: limit {max_inflight}, in flight "
                    f"{len(state.inflight)}. Please try again when one of them has finished."
                ),
            )
        if budget is not None:
            if state.day != day:
                state.day, state.day_tokens = day, 0
            if state.day_tokens + tokens > budget:
                wait = (day + 1) * SECONDS_PER_DAY - wall
                return Refused(
                    tenant=tenant,
                    limit=Limit.DAILY_TOKEN_BUDGET,
                    retry_after_s=max(wait, 1.0),
                    message=(
                        f"Daily token budget reached for tenant {tenant!r}: budget {budget}, used "
                        f"{state.day_tokens} today (UTC), requested {tokens}. The budget resets at 00:00 UTC."
                    ),
                )
        req_b, tok_b = state.requests, state.tokens
        if tok_b is not None and tokens > tok_b.capacity:
            return Refused(
                tenant=tenant,
                limit=Limit.TOKENS_PER_MINUTE,
                retry_after_s=None,
                message=(
                    f"Request too large for tenant {tenant!r}: it needs {tokens} tokens "
                    "(prompt + max output), "
                    f"more than the whole tokens-per-minute quota of {int(tok_b.capacity)}, so it can never "
                    "be admitted. Shorten the prompt or lower max_tokens/max_completion_tokens or n."
                ),
            )
        wait_req = 0.0
        wait_tok = 0.0
        if req_b is not None:
            req_b.refill(now)
            wait_req = req_b.wait_for(1)
        if tok_b is not None:
            tok_b.refill(now)
            wait_tok = tok_b.wait_for(tokens)
        if wait_req > 0 or wait_tok > 0:
            if wait_tok >= wait_req and tok_b is not None:
                limit, cap, have, need = Limit.TOKENS_PER_MINUTE, tok_b.capacity, tok_b.level, tokens
                unit = "tokens"
            else:
                assert req_b is not None
                limit, cap, have, need = Limit.REQUESTS_PER_MINUTE, req_b.capacity, req_b.level, 1
                unit = "requests"
            wait = max(wait_req, wait_tok)
            return Refused(
                tenant=tenant,
                limit=limit,
                retry_after_s=wait,
                message=(
                    f"Rate limit reached for tenant {tenant!r} on {unit} per minute: limit {int(cap)}, "
                    f"available {max(0, math.floor(have))}, requested {need}. "
                    f"Please try again in {wait:.2f}s."
                ),
            )
        if req_b is not None:
            req_b.level -= 1
        if tok_b is not None:
            tok_b.level -= tokens
        if budget is not None:
            state.day_tokens += tokens
        lease_id = lease if lease is not None else f"l{next(self._lease_ids)}"
        if max_inflight is not None:
            state.inflight.add(lease_id)
        return Admitted(tenant=tenant, tokens=tokens, lease=lease_id, day=day)

    def settle(self, admitted: Admitted, used: int, now: float) -> bool:
        """End one admitted request: release its concurrency slot and replace its reservation with the
        ``used`` tokens (prompt + completion) in the tokens bucket and the daily total.

        Returns:
            True when this call settled it; False when the lease was already settled (a second call
            changes nothing), or the tenant no longer exists. Leases of tenants without a concurrency
            limit are not tracked, so the caller must call this once (``ResponseMeter.finish`` does that).
        """
        state = self._tenants.get(admitted.tenant)
        if state is None:
            return False
        if state.limits.max_concurrent_requests is not None:
            if admitted.lease not in state.inflight:
                return False
            state.inflight.discard(admitted.lease)
        self.reconcile(admitted.tenant, admitted.tokens, used, now)
        if state.limits.daily_token_budget is not None and state.day == admitted.day:
            state.day_tokens = max(0, state.day_tokens + used - admitted.tokens)
        return True

    def in_flight(self, tenant: str) -> int:
        """Requests of ``tenant`` holding a concurrency slot now (0 when it has no concurrency limit)."""
        state = self._tenants.get(tenant)
        return 0 if state is None else len(state.inflight)

    def day_tokens(self, tenant: str, wall: float) -> int:
        """Tokens counted against ``tenant``'s daily budget on the UTC day of ``wall`` (0 when none)."""
        state = self._tenants.get(tenant)
        if state is None or state.day != utc_day(wall):
            return 0
        return state.day_tokens

    def reconcile(self, tenant: str, reserved: int, used: int, now: float) -> None:
        """Settle a reservation against real usage (tokens): credit ``reserved - used`` back to the tokens
        bucket (never above its capacity), or debit the overrun when ``used > reserved``.

        Call it exactly once per :class:`Admitted` request. Unknown or unlimited tenants are ignored.
        """
        state = self._tenants.get(tenant)
        if state is None or state.tokens is None:
            return
        bucket = state.tokens
        bucket.refill(now)
        bucket.level = min(bucket.capacity, bucket.level + (reserved - used))

    def available(self, tenant: str, now: float) -> tuple[float | None, float | None]:
        """``(requests, tokens)`` a tenant could spend right now; ``None`` for an unlimited dimension."""
        state = self._tenants.get(tenant)
        if state is None:
            return None, None
        return (
            state.requests.refill(now) if state.requests is not None else None,
            state.tokens.refill(now) if state.tokens is not None else None,
        )


# -- the async seam shared with the Redis store ---------------------------------------------------
class QuotaStore(Protocol):
    """Where quota state lives: in this process (:class:`MemoryQuotaStore`) or shared by several ext_proc
    replicas (:class:`inferlb.quota_redis.RedisQuotaStore`). Same semantics as :class:`QuotaBook`."""

    async def admit(self, tenant: str, tokens: int) -> Admitted | Refused:
        """Admit one request reserving ``tokens`` (see :meth:`QuotaBook.try_admit`)."""
        ...

    async def settle(self, admitted: Admitted, used: int) -> bool:
        """Release the lease; settle the reservation with ``used`` tokens (see :meth:`QuotaBook.settle`)."""
        ...

    def update_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """Apply the limits of a new config."""
        ...

    async def aclose(self) -> None:
        """Release connections (nothing for the in-process store)."""
        ...


class MemoryQuotaStore:
    """:class:`QuotaStore` over one in-process :class:`QuotaBook` (the default, one ext_proc replica).

    Args:
        limits: tenant name -> limits.
        clock: monotonic seconds, for the per-minute buckets.
        wall_clock: epoch seconds, for the UTC day of the daily budget.
    """

    def __init__(
        self,
        limits: Mapping[str, TenantLimits],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.wall_clock = wall_clock
        self.book = QuotaBook(limits, clock())

    async def admit(self, tenant: str, tokens: int) -> Admitted | Refused:
        """See :meth:`QuotaBook.try_admit` (atomic: no await inside)."""
        return self.book.try_admit(tenant, tokens, self.clock(), wall=self.wall_clock())

    async def settle(self, admitted: Admitted, used: int) -> bool:
        """See :meth:`QuotaBook.settle`."""
        return self.book.settle(admitted, used, self.clock())

    def update_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """See :meth:`QuotaBook.update_limits`."""
        self.book.update_limits(limits, self.clock())

    async def aclose(self) -> None:
        """Nothing to release."""
