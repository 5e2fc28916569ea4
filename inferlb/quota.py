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

Not thread-safe: one asyncio event loop owns a :class:`QuotaBook`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from inferlb.config import Config


class Limit(StrEnum):
    """Which per-minute limit refused a request (named after the config fields)."""

    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"


@dataclass(frozen=True, kw_only=True, slots=True)
class TenantLimits:
    """A tenant's per-minute quotas; ``None`` means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Admitted:
    """The request fits: ``tokens`` (prompt + output cap) and one request were taken from the buckets."""

    tenant: str
    tokens: int


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
    __slots__ = ("limits", "requests", "tokens")

    def __init__(self, limits: TenantLimits, now: float) -> None:
        self.limits = limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = TokenBucket(rpm, now) if rpm is not None else None
        self.tokens = TokenBucket(tpm, now) if tpm is not None else None


def limits_from_config(config: Config) -> dict[str, TenantLimits]:
    """Tenant name -> its per-minute limits, from ``config.tenants``."""
    return {
        t.name: TenantLimits(requests_per_minute=t.requests_per_minute, tokens_per_minute=t.tokens_per_minute)
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
        self.update_limits(limits, now)

    def update_limits(self, limits: Mapping[str, TenantLimits], now: float) -> None:
        """Apply new limits (a config reload).

        Tenants whose limits did not change keep their buckets untouched. A tenant whose limits changed
        keeps its current level, clipped to the new capacity, so a reload neither refills a drained tenant
        nor lets it exceed a lowered quota. New tenants start full; removed tenants are forgotten.
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
            fresh[name] = state
        self._tenants = fresh

    def try_admit(self, tenant: str, tokens: int, now: float) -> Admitted | Refused:
        """Admit one request of ``tokens`` tokens (prompt + output cap) for ``tenant`` at ``now`` (s).

        Takes 1 from the requests bucket and ``tokens`` from the tokens bucket only if both have enough;
        otherwise takes nothing and says which limit refused and after how long both would fit.
        """
        state = self._tenants.get(tenant)
        if state is None:
            return Admitted(tenant=tenant, tokens=tokens)
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
        return Admitted(tenant=tenant, tokens=tokens)

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
