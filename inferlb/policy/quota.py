"""Per-tenant request and token quotas over a sliding window of whole seconds (pure: the clock is passed in).

Each limited tenant has up to two :class:`SlidingWindow` s, one for requests per minute (a request weighs 1)
and one for tokens per minute (prompt + completion). A window counts the units admitted in each whole
second ``floor(t)`` (sub-windows of 1 s) and keeps at most the last 61 of them. A request of ``w`` units at
time ``t`` is admitted only if the sub-windows that overlap ``[t - 60 s, t]``, seconds
``floor(t) - 60 .. floor(t)``, hold at most ``quota - w``; then ``w`` is added to second ``floor(t)``.

Why it never overshoots: in any real window ``[a, a + 60)`` whose last admission is at ``t``, every earlier
one lies in seconds ``floor(a) >= floor(t) - 60 .. floor(t)``, all summed by that last check, so its total
is <= quota. The price: the oldest second counts whole though it overlaps ``[t - 60, t]`` only in part, so
the limit may refuse up to one second's worth of quota that an exact 60 s window would still admit.

This is the conservative member of the sliding-window-counter family of rate limiters: the common variant
(e.g. Cloudflare's, 2017) pro-rates the oldest sub-window and so can overshoot; a token bucket (Turner,
1986) admits up to ``quota + quota * T / 60`` in ``T`` seconds, 2x the quota in an idle tenant's first
minute. Other consequences worth knowing:

- a request is admitted only if *both* windows have room, and then both are charged together, so a
  refusal by one limit never consumes the other;
- ``retry_after_s`` of a refusal is exact: the time until enough sub-windows have left the window for the
  request to fit (if nothing else is admitted meanwhile), the longest of both limits;
- a request that needs more tokens than the whole per-minute quota can never fit and is refused as such
  (no retry time is given for it);
- a clock that goes backwards is treated as standing still: ``now`` counts as the newest second written.

Admission reserves prompt tokens + the largest completion the request may produce (the largest output cap
the body carries, :attr:`inferlb.request.parsing.InferenceRequest.largest_output_tokens`: for chat the larger
of ``max_completion_tokens`` and ``max_tokens``; else the model's ``default_max_tokens``; x ``n`` x prompts)
in the sub-window of its admission second
(:attr:`Admitted.second`). :meth:`QuotaBook.settle` (through :meth:`QuotaBook.reconcile`) replaces that
reservation with the real usage in the same sub-window while it is still inside the window: unused tokens
are freed, an overrun is a debt that delays later admissions. Once the sub-window has left the window, a
settlement changes nothing there (that second no longer limits anyone).

Two further limits are not rates but counts:

- ``max_concurrent_requests``: every admitted request holds a *lease* (an id) until
  :meth:`QuotaBook.settle` returns it, at the end of its response or when the stream is aborted; settling
  the same lease twice releases it once. A lease also carries a time to live (``lease_ttl_s``, the route
  timeout plus :data:`LEASE_MARGIN_S` by default, :func:`lease_ttl_s`): one never returned (a stream whose
  end went unseen, a replica that died holding it in Redis) stops counting once it expires, so a lost lease
  cannot take a tenant's slot for good. The TTL outlives the longest request, so a live request's lease
  never expires under it.
- ``daily_token_budget``: prompt + completion tokens per UTC calendar day (day = ``floor(wall / 86400)``).
  Admission adds the reservation to the day's total and refuses when it would pass the budget, so the
  admitted total of a day never exceeds it; settling replaces the reservation with the real usage. A
  request admitted before midnight is billed to the day it was admitted on (its settlement after midnight
  does not touch the new day).

Not thread-safe: one asyncio event loop owns a :class:`QuotaBook`. :class:`MemoryQuotaStore` is the async
:class:`QuotaStore` over it; :mod:`inferlb.adapters.quota_redis` is the same contract over Redis, shared by
replicas.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Protocol

import msgspec

from inferlb.config.schema import Config


class Limit(StrEnum):
    """Which limit refused a request (named after the config fields)."""

    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    MAX_CONCURRENT_REQUESTS = "max_concurrent_requests"
    DAILY_TOKEN_BUDGET = "daily_token_budget"
    #: The shared quota state (Redis) could not be reached and the store fails closed (503, not 429).
    QUOTA_BACKEND_UNAVAILABLE = "quota_backend_unavailable"
    #: No connection to the shared quota state freed within the request's budget: the gateway is
    #: overloaded, Redis has not failed (503 whatever ``redis_failure_mode`` says; never admitted unchecked).
    QUOTA_BACKEND_BUSY = "quota_backend_busy"


#: Seconds in a UTC day: the daily budget's day is ``floor(wall_clock_s / SECONDS_PER_DAY)``.
SECONDS_PER_DAY: Final = 86_400
#: ``retry-after`` for a concurrency refusal (s): a slot frees when any in-flight request ends, which
#: cannot be predicted; one second is the smallest whole value a client can be told.
CONCURRENCY_RETRY_AFTER_S: Final = 1.0
#: Length of the per-minute window (s).
WINDOW_S: Final = 60
#: Whole-second sub-windows a check sums: ``floor(t) - 60 .. floor(t)``, all that overlap ``[t - 60, t]``.
SUB_WINDOWS: Final = WINDOW_S + 1
#: ``SlidingWindow.newest`` of a window that holds nothing (below any clock reading).
NO_SECOND: Final = -(1 << 62)
#: A concurrency lease outlives the longest request (Envoy's route timeout) by this much (s), so a lease is
#: only ever dropped by expiry when it was lost (its release never ran), not while its request runs.
LEASE_MARGIN_S: Final = 60.0
#: Lease lifetime when Envoy's route timeout is disabled (``gateway.request_timeout_ms: 0``), in s: one hour,
#: far above any generation the per-try bounds allow (the default route timeout is 0: streams have no length
#: bound; a non-streamed try is bounded by ``gateway.per_try_timeout_ms``, 300 s).
UNBOUNDED_LEASE_S: Final = 3600.0


def lease_ttl_s(config: Config) -> float:
    """Lifetime of a concurrency lease (s): ``ext_proc.lease_ttl_ms`` when set, else the route timeout
    (``gateway.request_timeout_ms``) plus :data:`LEASE_MARGIN_S`, or :data:`UNBOUNDED_LEASE_S` when the route
    timeout is off."""
    if config.ext_proc.lease_ttl_ms is not None:
        return config.ext_proc.lease_ttl_ms / 1000.0
    timeout_ms = config.gateway.request_timeout_ms
    if timeout_ms == 0:
        return UNBOUNDED_LEASE_S
    return timeout_ms / 1000.0 + LEASE_MARGIN_S


def utc_day(wall_s: float) -> int:
    """The UTC calendar day number (days since 1970-01-01) of a wall-clock time in seconds."""
    return int(wall_s // SECONDS_PER_DAY)


def seconds_until(second: int, now: float) -> float:
    """Seconds from ``now`` until the clock reads whole second ``second`` (> 0 when ``second > now``).

    The smallest float ``d`` with ``now + d >= second`` in float arithmetic, so a caller that waits exactly
    ``d`` lands in ``second``, not a rounding error before it.
    """
    wait = second - now
    while now + wait < second:
        wait = math.nextafter(wait, math.inf)
    return wait


@dataclass(frozen=True, kw_only=True, slots=True)
class TenantLimits:
    """A tenant's quotas; ``None`` means unlimited.

    Attributes:
        requests_per_minute: requests admitted in any 60 s (sliding window of whole seconds).
        tokens_per_minute: prompt + completion tokens admitted in any 60 s (same window).
        max_concurrent_requests: requests in flight at once (admission to end of response).
        daily_token_budget: prompt + completion tokens per UTC day.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    daily_token_budget: int | None = None


class Admitted(msgspec.Struct, frozen=True, kw_only=True):
    """The request fits: ``tokens`` (prompt + output cap) and one request were counted in the windows.

    Attributes:
        tenant: the tenant charged.
        tokens: the reservation (tokens), settled later with :meth:`QuotaBook.settle`.
        lease: the id of the concurrency slot / reservation ("" for a tenant with no limits).
        day: the UTC day the reservation counts against (see :func:`utc_day`).
        second: the whole second (of the store's clock) whose sub-window holds the reservation.
        degraded: admitted without checking, because the shared quota state was unreachable and the store
            fails open.
    """

    tenant: str
    tokens: int
    lease: str = ""
    day: int = 0
    second: int = 0
    degraded: bool = False


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    """The request does not fit now (or ever); nothing was taken.

    Attributes:
        limit: the limit that refused it (the one with the longest wait when both per-minute limits do).
        retry_after_s: seconds until it would fit if nothing else were admitted (> 0), or None when it
            can never fit.
        message: an OpenAI-style explanation with the numbers.
    """

    tenant: str
    limit: Limit
    retry_after_s: float | None
    message: str

    @property
    def never_fits(self) -> bool:
        """True when the request asks for more than a whole minute (or day) of quota."""
        return self.retry_after_s is None


# -- refusals, shared with the Redis store so both say the same ----------------------------------
def too_large(tenant: str, tokens: int, limit: Limit, whole: int | None) -> Refused:
    """A request of ``tokens`` above the whole tokens-per-minute quota or daily budget ``whole``."""
    what = "daily token budget" if limit is Limit.DAILY_TOKEN_BUDGET else "tokens-per-minute quota"
    message = (
        f"Request too large for tenant {tenant!r}: it needs {tokens} tokens (prompt + max output), more "
        f"than the whole {what} of {whole}, so it can never be admitted. Shorten the prompt or lower "
        "max_tokens/max_completion_tokens or n."
    )
    return Refused(tenant=tenant, limit=limit, retry_after_s=None, message=message)


def too_many_in_flight(tenant: str, limit: int | None, in_flight: int | str) -> Refused:
    """A request over ``max_concurrent_requests`` (``limit``) with ``in_flight`` requests held."""
    message = (
        f"Too many concurrent requests for tenant {tenant!r}: limit {limit}, in flight {in_flight}. "
        "Please try again when one of them has finished."
    )
    return Refused(
        tenant=tenant,
        limit=Limit.MAX_CONCURRENT_REQUESTS,
        retry_after_s=CONCURRENCY_RETRY_AFTER_S,
        message=message,
    )


def over_daily_budget(tenant: str, tokens: int, budget: int | None, used: int | str, wall: float) -> Refused:
    """A request of ``tokens`` that would pass today's ``budget`` (``used`` so far); retry at 00:00 UTC."""
    wait = (utc_day(wall) + 1) * SECONDS_PER_DAY - wall
    message = (
        f"Daily token budget reached for tenant {tenant!r}: budget {budget}, used {used} today (UTC), "
        f"requested {tokens}. The budget resets at 00:00 UTC."
    )
    return Refused(
        tenant=tenant, limit=Limit.DAILY_TOKEN_BUDGET, retry_after_s=max(wait, 1.0), message=message
    )


def over_rate(
    tenant: str, limit: Limit, *, quota: int | None, counted: int, requested: int, retry_after_s: float
) -> Refused:
    """A request refused by a per-minute window holding ``counted`` of ``quota`` units."""
    unit = "tokens" if limit is Limit.TOKENS_PER_MINUTE else "requests"
    message = (
        f"Rate limit reached for tenant {tenant!r} on {unit} per minute: limit {quota}, used {counted} in "
        f"the last 60 s, requested {requested}. Please try again in {retry_after_s:.2f}s."
    )
    return Refused(tenant=tenant, limit=limit, retry_after_s=retry_after_s, message=message)


class SlidingWindow:
    """Units admitted per whole second over the last 61 seconds, for one tenant and one limit.

    Attributes:
        quota: units allowed in any 60 s.
        counts: second -> units counted there (reservations, replaced by real usage when settled); at most
            61 entries after :meth:`advance`, older seconds dropped.
        total: the sum of ``counts``.
        newest: the latest second in ``counts`` (:data:`NO_SECOND` when empty).
    """

    __slots__ = ("counts", "newest", "oldest", "quota", "total")

    def __init__(self, quota: int) -> None:
        self.quota = quota
        self.counts: dict[int, int] = {}
        self.total = 0
        self.newest = NO_SECOND
        self.oldest = NO_SECOND  # only read when counts is not empty

    def current_second(self, now: float) -> int:
        """The sub-window ``now`` (s) falls in: ``floor(now)``, or the newest second written when the clock
        reads earlier than that (a clock going backwards stands still)."""
        return max(math.floor(now), self.newest)

    def advance(self, second: int) -> int:
        """Drop the sub-windows before ``second - 60``; return the units left in ``second - 60 .. second``
        (and any later second, which a clock behind another replica's may see)."""
        first = second - WINDOW_S
        if self.counts and self.oldest < first:
            self.counts = {s: n for s, n in self.counts.items() if s >= first}
            self.total = sum(self.counts.values())
            self.oldest = min(self.counts, default=NO_SECOND)
            self.newest = max(self.counts, default=NO_SECOND)
        return self.total

    def fit_second(self, units: int, second: int) -> int:
        """The first second ``>= second`` at which ``units`` fit if nothing else is admitted: ``second``
        itself, or the one at which enough sub-windows have left the window. Call :meth:`advance` with
        ``second`` first; ``units <= quota``."""
        left = self.total
        if left + units <= self.quota:
            return second
        for s in sorted(self.counts):
            left -= self.counts[s]
            if left + units <= self.quota:
                # sub-window s is summed by checks up to second s + 60 and is out of the window at s + 61
                return s + SUB_WINDOWS
        return second + SUB_WINDOWS  # every sub-window gone: reached only when units > quota

    def add(self, second: int, units: int) -> None:
        """Count ``units`` (negative to give back, never below 0 in one sub-window) in ``second``."""
        counts = self.counts
        before = counts.get(second)
        if before is None:
            if not counts:
                self.oldest = self.newest = second
            elif second > self.newest:
                self.newest = second
            elif second < self.oldest:
                self.oldest = second
            before = 0
        after = max(before + units, 0)
        counts[second] = after
        self.total += after - before


class _TenantState:
    __slots__ = ("day", "day_tokens", "inflight", "limits", "next_expiry", "requests", "tokens")

    def __init__(self, limits: TenantLimits) -> None:
        self.limits = limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = SlidingWindow(rpm) if rpm is not None else None
        self.tokens = SlidingWindow(tpm) if tpm is not None else None
        self.inflight: dict[str, float] = {}  # lease id -> its expiry (monotonic s)
        self.next_expiry = math.inf  # the earliest expiry in ``inflight`` (inf when empty)
        self.day = -1
        self.day_tokens = 0  # tokens admitted (reservations, then real usage once settled) on ``day``

    def expire_leases(self, now: float) -> None:
        """Drop the leases whose expiry is at or before ``now`` (as Redis's ``ZREMRANGEBYSCORE -inf now``);
        O(1) until the earliest one is due."""
        if now < self.next_expiry:
            return
        self.inflight = {lease: exp for lease, exp in self.inflight.items() if exp > now}
        self.next_expiry = min(self.inflight.values(), default=math.inf)


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
    """The windows, leases and day totals of every tenant. Tenants not in the limits map are unlimited.

    Args:
        limits: tenant name -> :class:`TenantLimits`.
        now: the current time (seconds, any monotonic origin); unused, kept for the callers' signature
            (windows start empty whenever they start).
        lease_ttl_s: how long a concurrency lease counts when it is never settled (s, on the clock of
            ``now``); :data:`UNBOUNDED_LEASE_S` by default. The services pass :func:`lease_ttl_s`.
    """

    def __init__(
        self, limits: Mapping[str, TenantLimits], now: float, *, lease_ttl_s: float = UNBOUNDED_LEASE_S
    ) -> None:
        self._tenants: dict[str, _TenantState] = {}
        # a plain counter, not itertools.count: a book is copied in tests (itertools objects lose copy
        # support in Python 3.14 and warn from 3.12)
        self._leases_issued = 0
        self.lease_ttl_s = lease_ttl_s
        self.update_limits(limits, now)

    def update_limits(self, limits: Mapping[str, TenantLimits], now: float) -> None:
        """Apply new limits (a config reload; ``now`` is unused).

        Tenants whose limits did not change keep their state untouched. A tenant whose limits changed keeps
        the sub-windows of every per-minute limit it still has, checked against the new quota from the
        next admission on, so a reload neither forgets what was admitted in the last minute nor lets a
        lowered quota be passed; its in-flight leases and today's token total carry over. New tenants (and
        newly limited dimensions) start empty; removed tenants are forgotten.
        """
        old = self._tenants
        fresh: dict[str, _TenantState] = {}
        for name, lim in limits.items():
            prev = old.get(name)
            if prev is not None and prev.limits == lim:
                fresh[name] = prev
                continue
            state = _TenantState(lim)
            if prev is not None:
                if state.requests is not None and prev.requests is not None:
                    prev.requests.quota = state.requests.quota
                    state.requests = prev.requests
                if state.tokens is not None and prev.tokens is not None:
                    prev.tokens.quota = state.tokens.quota
                    state.tokens = prev.tokens
                state.inflight, state.next_expiry = prev.inflight, prev.next_expiry
                state.day, state.day_tokens = prev.day, prev.day_tokens
            fresh[name] = state
        self._tenants = fresh

    def try_admit(
        self, tenant: str, tokens: int, now: float, *, wall: float = 0.0, lease: str | None = None
    ) -> Admitted | Refused:
        """Admit one request of ``tokens`` tokens (prompt + output cap) for ``tenant`` at ``now`` (s).

        Counts 1 in the requests window, ``tokens`` in the tokens window and today's budget, and takes a
        concurrency slot, only if all of them have room; otherwise takes nothing and says which limit
        refused and after how long it would fit.

        Args:
            now: monotonic seconds, for the per-minute windows.
            wall: wall-clock seconds since the epoch, for the UTC day of the daily budget.
            lease: the id to hold the concurrency slot under (a fresh one when None); it expires
                ``lease_ttl_s`` after ``now`` unless settled first.
        """
        state = self._tenants.get(tenant)
        day = utc_day(wall)
        if state is None:
            return Admitted(tenant=tenant, tokens=tokens, day=day, second=math.floor(now))
        lim = state.limits
        budget = lim.daily_token_budget
        if budget is not None and tokens > budget:
            return too_large(tenant, tokens, Limit.DAILY_TOKEN_BUDGET, budget)
        max_inflight = lim.max_concurrent_requests
        if max_inflight is not None:
            state.expire_leases(now)
            if len(state.inflight) >= max_inflight:
                return too_many_in_flight(tenant, max_inflight, len(state.inflight))
        if budget is not None:
            if state.day != day:
                state.day, state.day_tokens = day, 0
            if state.day_tokens + tokens > budget:
                return over_daily_budget(tenant, tokens, budget, state.day_tokens, wall)
        req_w, tok_w = state.requests, state.tokens
        if tok_w is not None and tokens > tok_w.quota:
            return too_large(tenant, tokens, Limit.TOKENS_PER_MINUTE, tok_w.quota)
        second = math.floor(now)
        if req_w is not None and req_w.newest > second:
            second = req_w.newest
        if tok_w is not None and tok_w.newest > second:
            second = tok_w.newest
        fit_req = fit_tok = second
        # the common case (it fits) costs one sum lookup per window; fit_second only on a refusal
        if req_w is not None and req_w.advance(second) + 1 > req_w.quota:
            fit_req = req_w.fit_second(1, second)
        if tok_w is not None and tok_w.advance(second) + tokens > tok_w.quota:
            fit_tok = tok_w.fit_second(tokens, second)
        if fit_req > second or fit_tok > second:
            wait = seconds_until(max(fit_req, fit_tok), now)
            if fit_tok >= fit_req and tok_w is not None:
                return over_rate(
                    tenant,
                    Limit.TOKENS_PER_MINUTE,
                    quota=tok_w.quota,
                    counted=tok_w.total,
                    requested=tokens,
                    retry_after_s=wait,
                )
            assert req_w is not None
            return over_rate(
                tenant,
                Limit.REQUESTS_PER_MINUTE,
                quota=req_w.quota,
                counted=req_w.total,
                requested=1,
                retry_after_s=wait,
            )
        if req_w is not None:
            req_w.add(second, 1)
        if tok_w is not None:
            tok_w.add(second, tokens)
        if budget is not None:
            state.day_tokens += tokens
        if lease is None:
            self._leases_issued += 1
        lease_id = lease if lease is not None else f"l{self._leases_issued}"
        if max_inflight is not None:
            expiry = now + self.lease_ttl_s
            state.inflight[lease_id] = expiry
            state.next_expiry = min(state.next_expiry, expiry)
        return Admitted(tenant=tenant, tokens=tokens, lease=lease_id, day=day, second=second)

    def settle(self, admitted: Admitted, used: int, now: float) -> bool:
        """End one admitted request: release its concurrency slot and replace its reservation with the
        ``used`` tokens (prompt + completion) in its tokens sub-window (see :meth:`reconcile`) and in the
        daily total.

        Returns:
            True when this call settled it; False when the lease was already settled or has expired (a
            second call changes nothing), or the tenant no longer exists. Leases of tenants without a
            concurrency limit are not tracked, so the caller must call this once (``ResponseMeter.finish``
            does that).
        """
        state = self._tenants.get(admitted.tenant)
        if state is None:
            return False
        tracked = state.limits.max_concurrent_requests is not None
        if tracked and state.inflight.pop(admitted.lease, None) is None:
            return False
        self.reconcile(admitted.tenant, admitted.tokens, used, now, second=admitted.second)
        if state.limits.daily_token_budget is not None and state.day == admitted.day:
            state.day_tokens = max(0, state.day_tokens + used - admitted.tokens)
        return True

    def in_flight(self, tenant: str, now: float | None = None) -> int:
        """Requests of ``tenant`` holding a concurrency slot (0 when it has no concurrency limit); with
        ``now``, the leases expired by then are dropped first."""
        state = self._tenants.get(tenant)
        if state is None:
            return 0
        if now is not None:
            state.expire_leases(now)
        return len(state.inflight)

    def day_tokens(self, tenant: str, wall: float) -> int:
        """Tokens counted against ``tenant``'s daily budget on the UTC day of ``wall`` (0 when none)."""
        state = self._tenants.get(tenant)
        if state is None or state.day != utc_day(wall):
            return 0
        return state.day_tokens

    def reconcile(self, tenant: str, reserved: int, used: int, now: float, *, second: int) -> None:
        """Settle a reservation of ``reserved`` tokens made in sub-window ``second`` (``Admitted.second``)
        against the ``used`` tokens: that sub-window gets ``used - reserved`` added (freed tokens or a debt)
        if it is still inside the window at ``now``; once it has left, nothing changes.

        Call it exactly once per :class:`Admitted` request. Unknown tenants and tenants without a tokens
        limit are ignored.
        """
        state = self._tenants.get(tenant)
        if state is None or state.tokens is None:
            return
        window = state.tokens
        current = window.current_second(now)
        window.advance(current)
        if second >= current - WINDOW_S:
            window.add(second, used - reserved)

    def available(self, tenant: str, now: float) -> tuple[int | None, int | None]:
        """``(requests, tokens)`` of quota not counted in the window at ``now``: what a tenant could spend
        right now (negative after a debt); ``None`` for an unlimited dimension."""
        state = self._tenants.get(tenant)
        if state is None:
            return None, None
        return _unspent(state.requests, now), _unspent(state.tokens, now)


def _unspent(window: SlidingWindow | None, now: float) -> int | None:
    return None if window is None else window.quota - window.advance(window.current_second(now))


# -- the async seam shared with the Redis store ---------------------------------------------------
class QuotaStore(Protocol):
    """Where quota state lives: in this process (:class:`MemoryQuotaStore`) or shared by several ext_proc
    replicas (:class:`inferlb.adapters.quota_redis.RedisQuotaStore`). Same semantics as :class:`QuotaBook`."""

    #: True when :meth:`admit` never suspends (in-process), so a cancelled caller cannot be cut off between
    #: the store taking a lease and the caller receiving it; False when it awaits I/O (Redis), where the
    #: caller must see such a call through (``ext_proc.servicer`` does).
    cancel_safe: bool

    async def start(self) -> None:
        """Get ready to serve before the first request: open connections (nothing in-process)."""
        ...

    async def admit(self, tenant: str, tokens: int, *, deadline: float | None = None) -> Admitted | Refused:
        """Admit one request reserving ``tokens`` (see :meth:`QuotaBook.try_admit`); ``deadline``
        (``time.monotonic()`` seconds) bounds how long it may wait for the store's own resources (a free
        connection), None: no bound of its own."""
        ...

    async def settle(self, admitted: Admitted, used: int) -> bool:
        """Release the lease; settle the reservation with ``used`` tokens (see :meth:`QuotaBook.settle`)."""
        ...

    def update_limits(self, limits: Mapping[str, TenantLimits], *, lease_ttl_s: float | None = None) -> None:
        """Apply the limits (and, when given, the lease lifetime in s) of a new config."""
        ...

    async def aclose(self) -> None:
        """Release connections (nothing for the in-process store)."""
        ...


class MemoryQuotaStore:
    """:class:`QuotaStore` over one in-process :class:`QuotaBook` (the default, one ext_proc replica).

    Args:
        limits: tenant name -> limits.
        clock: monotonic seconds, for the per-minute windows and the lease expiry.
        wall_clock: epoch seconds, for the UTC day of the daily budget.
        lease_ttl_s: lifetime of a concurrency lease never settled (s; see :func:`lease_ttl_s`).
    """

    def __init__(
        self,
        limits: Mapping[str, TenantLimits],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        lease_ttl_s: float = UNBOUNDED_LEASE_S,
    ) -> None:
        self.clock = clock
        self.wall_clock = wall_clock
        self.book = QuotaBook(limits, clock(), lease_ttl_s=lease_ttl_s)
        self.cancel_safe = True  # admit has no await inside

    async def start(self) -> None:
        """Nothing to open."""

    async def admit(self, tenant: str, tokens: int, *, deadline: float | None = None) -> Admitted | Refused:
        """See :meth:`QuotaBook.try_admit` (atomic: no await inside, so nothing to wait for and
        ``deadline`` is unused)."""
        return self.admit_now(tenant, tokens)

    def admit_now(self, tenant: str, tokens: int) -> Admitted | Refused:
        """:meth:`admit` without a coroutine, for a caller on the event loop that answers synchronously
        (the ext_authz HTTP protocol skips a task per request this way)."""
        return self.book.try_admit(tenant, tokens, self.clock(), wall=self.wall_clock())

    async def settle(self, admitted: Admitted, used: int) -> bool:
        """See :meth:`QuotaBook.settle`."""
        return self.settle_now(admitted, used)

    def settle_now(self, admitted: Admitted, used: int) -> bool:
        """:meth:`settle` without a coroutine (see :meth:`admit_now`)."""
        return self.book.settle(admitted, used, self.clock())

    def update_limits(self, limits: Mapping[str, TenantLimits], *, lease_ttl_s: float | None = None) -> None:
        """See :meth:`QuotaBook.update_limits`; a new ``lease_ttl_s`` applies to leases taken from now on."""
        if lease_ttl_s is not None:
            self.book.lease_ttl_s = lease_ttl_s
        self.book.update_limits(limits, self.clock())

    async def aclose(self) -> None:
        """Nothing to release."""
