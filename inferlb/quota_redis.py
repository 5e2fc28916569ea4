"""Quota state shared by several ext_proc replicas, in Redis (redis-py asyncio, atomic Lua scripts).

Same contract and numbers as :class:`inferlb.quota.QuotaBook` (token buckets per minute, concurrency
leases, a UTC-day token budget), with every admission and settlement one Lua script, so replicas never
interleave inside a decision: Redis runs a script atomically (https://redis.io/docs/latest/develop/
interact/programmability/eval-intro/, "Script atomicity"). Under any concurrency across replicas the
admitted reservations therefore never exceed a quota.

Keys per tenant (the ``{tenant}`` hash tag keeps both in one Redis Cluster slot):

- ``{prefix}:{tenant}:state``, a hash: ``rl``/``rt`` request bucket level and its time, ``tl``/``tt`` token
  bucket level and time, ``day``/``dt`` the UTC day and the tokens counted on it. It expires after
  :data:`STATE_TTL_S` without use (a full bucket and a past day carry no information).
- ``{prefix}:{tenant}:inflight``, a sorted set of concurrency leases scored by their expiry (epoch s).
  A lease whose replica died is dropped once it expires (``lease_ttl_s``), so a crash cannot leak
  slots forever; settling removes the lease with ``ZREM``, which succeeds once.

Times are wall-clock seconds passed in by the caller (replicas' clocks are assumed NTP-synchronised; a
clock behind the stored time adds no refill, as in :class:`~inferlb.quota.TokenBucket`). Limits are passed
with every call, so a config reload takes effect on the next call; levels above a lowered capacity are
clipped.

When Redis cannot be reached (connection refused, timeout), the ``failure_mode`` decides: ``open`` admits
the request unchecked (``Admitted.degraded``; its settlement is skipped) and ``closed`` refuses it with
:attr:`~inferlb.quota.Limit.QUOTA_BACKEND_UNAVAILABLE` (503). Either way ``on_error`` is called
(``ExtProcMetrics.quota_backend_error``).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from inferlb.quota import (
    CONCURRENCY_RETRY_AFTER_S,
    SECONDS_PER_DAY,
    Admitted,
    Limit,
    Refused,
    TenantLimits,
    utc_day,
)

log = logging.getLogger("inferlb.quota")

#: Seconds an idle tenant's state hash is kept.
STATE_TTL_S: Final = 2 * SECONDS_PER_DAY
#: Retry-after given when failing closed (s).
BACKEND_RETRY_AFTER_S: Final = 1.0

# ARGV: now, tokens, rpm, tpm, max_inflight, budget, day, lease, lease_expiry, state_ttl_ms (-1 = unlimited)
# Returns {admitted (1/0), limit, retry_after, detail} with numbers as strings (Redis truncates Lua numbers).
_ADMIT_LUA: Final = """
local now = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local rpm = tonumber(ARGV[3])
local tpm = tonumber(ARGV[4])
local maxin = tonumber(ARGV[5])
local budget = tonumber(ARGV[6])
local day = tonumber(ARGV[7])
if budget >= 0 and tokens > budget then
  return {0, 'daily_token_budget', '-1', '0'}
end
if maxin >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local inflight = redis.call('ZCARD', KEYS[2])
  if inflight >= maxin then
    return {0, 'max_concurrent_requests', '1', tostring(inflight)}
  end
end
local st = redis.call('HMGET', KEYS[1], 'rl', 'rt', 'tl', 'tt', 'day', 'dt')
local dt = 0
if budget >= 0 then
  if tonumber(st[5]) == day then dt = tonumber(st[6]) or 0 end
  if dt + tokens > budget then
    return {0, 'daily_token_budget', tostring((day + 1) * 86400 - now), tostring(dt)}
  end
end
if tpm >= 0 and tokens > tpm then
  return {0, 'tokens_per_minute', '-1', '0'}
end
local function refill(level, at, cap)
  if level == nil then return cap, now end
  local elapsed = now - at
  if elapsed > 0 then
    level = level + elapsed * cap / 60
    at = now
  end
  if level > cap then level = cap end
  return level, at
end
local rl, rt, tl, tt
local wait_r, wait_t = 0, 0
if rpm >= 0 then
  rl, rt = refill(tonumber(st[1]), tonumber(st[2]), rpm)
  if rl < 1 then wait_r = (1 - rl) / (rpm / 60) end
end
if tpm >= 0 then
  tl, tt = refill(tonumber(st[3]), tonumber(st[4]), tpm)
  if tl < tokens then wait_t = (tokens - tl) / (tpm / 60) end
end
if wait_r > 0 or wait_t > 0 then
  if wait_t >= wait_r and tpm >= 0 then
    return {0, 'tokens_per_minute', tostring(math.max(wait_r, wait_t)), tostring(tl)}
  end
  return {0, 'requests_per_minute', tostring(math.max(wait_r, wait_t)), tostring(rl)}
end
if rpm >= 0 then redis.call('HSET', KEYS[1], 'rl', tostring(rl - 1), 'rt', tostring(rt)) end
if tpm >= 0 then redis.call('HSET', KEYS[1], 'tl', tostring(tl - tokens), 'tt', tostring(tt)) end
if budget >= 0 then redis.call('HSET', KEYS[1], 'day', tostring(day), 'dt', tostring(dt + tokens)) end
if rpm >= 0 or tpm >= 0 or budget >= 0 then redis.call('PEXPIRE', KEYS[1], ARGV[10]) end
if maxin >= 0 then
  redis.call('ZADD', KEYS[2], ARGV[9], ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[10])
end
return {1, '', '0', '0'}
"""

# ARGV: now, reserved, used, tpm, budget, day, lease, has_maxin (1/0). Returns 1 when settled now, 0 when
# the lease was already settled (or expired).
_SETTLE_LUA: Final = """
local now = tonumber(ARGV[1])
local reserved = tonumber(ARGV[2])
local used = tonumber(ARGV[3])
local tpm = tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
local day = tonumber(ARGV[6])
if ARGV[8] == '1' then
  if redis.call('ZREM', KEYS[2], ARGV[7]) == 0 then return 0 end
end
local st = redis.call('HMGET', KEYS[1], 'tl', 'tt', 'day', 'dt')
if tpm >= 0 and st[1] then
  local level = tonumber(st[1])
  local at = tonumber(st[2])
  local elapsed = now - at
  if elapsed > 0 then
    level = level + elapsed * tpm / 60
    at = now
  end
  level = math.min(tpm, level + reserved - used)
  redis.call('HSET', KEYS[1], 'tl', tostring(level), 'tt', tostring(at))
end
if budget >= 0 and tonumber(st[3]) == day then
  redis.call('HSET', KEYS[1], 'dt', tostring(math.max(0, tonumber(st[4]) + used - reserved)))
end
return 1
"""


def _lim(value: int | None) -> int:
    return -1 if value is None else value


class RedisQuotaStore:
    """:class:`inferlb.quota.QuotaStore` in Redis, shared by every replica pointing at the same keys.

    Args:
        client: a ``redis.asyncio.Redis`` (give it ``socket_timeout``/``socket_connect_timeout``: a call
            slower than that counts as Redis being unreachable).
        limits: tenant name -> limits (tenants not in it are unlimited and never touch Redis).
        key_prefix: prefix of every key.
        failure_mode: ``open`` (admit unchecked) or ``closed`` (refuse, 503) when Redis is unreachable.
        lease_ttl_s: how long a concurrency lease lives without being settled (s); longer than the
            longest request (Envoy's route timeout).
        wall_clock: epoch seconds (injected in tests).
        on_error: called with ``(backend, operation)`` for every failed call (a metric).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        limits: Mapping[str, TenantLimits],
        *,
        key_prefix: str = "inferlb:quota",
        failure_mode: Literal["open", "closed"] = "open",
        lease_ttl_s: float = 3600.0,
        wall_clock: Callable[[], float] = time.time,
        on_error: Callable[[str, str], None] | None = None,
    ) -> None:
        self.client = client
        self.limits: Mapping[str, TenantLimits] = dict(limits)
        self.key_prefix = key_prefix
        self.failure_mode = failure_mode
        self.lease_ttl_s = lease_ttl_s
        self.wall_clock = wall_clock
        self.on_error = on_error
        self._admit = client.register_script(_ADMIT_LUA)
        self._settle = client.register_script(_SETTLE_LUA)

    @classmethod
    def from_url(
        cls, url: str, limits: Mapping[str, TenantLimits], *, timeout_s: float, **kwargs: Any
    ) -> RedisQuotaStore:
        """A store over a new connection pool to ``url`` with ``timeout_s`` for connecting and each call
        (no connection is made until the first call)."""
        client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, limits, **kwargs)

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self.key_prefix}:{{{tenant}}}"
        return [f"{base}:state", f"{base}:inflight"]

    def update_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """Use ``limits`` from the next call on (state in Redis is kept; levels are clipped to new caps)."""
        self.limits = dict(limits)

    def _failed(self, operation: str, exc: BaseException) -> None:
        log.warning("quota backend redis: %s failed: %s", operation, exc)
        if self.on_error is not None:
            self.on_error("redis", operation)

    async def admit(self, tenant: str, tokens: int) -> Admitted | Refused:
        """Admit one request of ``tokens`` (see :meth:`inferlb.quota.QuotaBook.try_admit`)."""
        now = self.wall_clock()
        day = utc_day(now)
        lim = self.limits.get(tenant)
        if lim is None or lim == TenantLimits():
            return Admitted(tenant=tenant, tokens=tokens, day=day)
        lease = uuid.uuid4().hex
        args: list[str | int] = [
            repr(now),
            tokens,
            _lim(lim.requests_per_minute),
            _lim(lim.tokens_per_minute),
            _lim(lim.max_concurrent_requests),
            _lim(lim.daily_token_budget),
            day,
            lease,
            repr(now + self.lease_ttl_s),
            int(STATE_TTL_S * 1000),
        ]
        try:
            ok, limit_raw, retry_raw, detail_raw = await self._admit(keys=self._keys(tenant), args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("admit", exc)
            if self.failure_mode == "open":
                return Admitted(tenant=tenant, tokens=tokens, day=day, degraded=True)
            return Refused(
                tenant=tenant,
                limit=Limit.QUOTA_BACKEND_UNAVAILABLE,
                retry_after_s=BACKEND_RETRY_AFTER_S,
                message="The gateway cannot check your quota right now (its quota store is unreachable). "
                "Please try again shortly.",
            )
        if int(ok) == 1:
            return Admitted(tenant=tenant, tokens=tokens, lease=lease, day=day)
        return _refusal(
            tenant,
            tokens,
            lim,
            limit=Limit(_text(limit_raw)),
            retry_after=float(_text(retry_raw)),
            detail=_text(detail_raw),
        )

    async def settle(self, admitted: Admitted, used: int) -> bool:
        """Release the lease and replace the reservation with ``used`` tokens, once (see
        :meth:`inferlb.quota.QuotaBook.settle`). Degraded (fail-open) admissions reserved nothing and are
        skipped. A failed call is logged and counted; the lease then expires on its own."""
        lim = self.limits.get(admitted.tenant)
        if admitted.degraded or lim is None or lim == TenantLimits():
            return False
        args: list[str | int] = [
            repr(self.wall_clock()),
            admitted.tokens,
            used,
            _lim(lim.tokens_per_minute),
            _lim(lim.daily_token_budget),
            admitted.day,
            admitted.lease,
            1 if lim.max_concurrent_requests is not None else 0,
        ]
        try:
            return int(await self._settle(keys=self._keys(admitted.tenant), args=args)) == 1
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("settle", exc)
            return False

    async def in_flight(self, tenant: str) -> int:
        """Unexpired concurrency leases of ``tenant`` (for tests and status)."""
        return int(await self.client.zcount(self._keys(tenant)[1], self.wall_clock(), "+inf"))

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _refusal(
    tenant: str, tokens: int, lim: TenantLimits, *, limit: Limit, retry_after: float, detail: str
) -> Refused:
    """A :class:`Refused` with the same messages as the in-process book (``retry_after`` < 0: never fits)."""
    if retry_after < 0:
        whole = lim.daily_token_budget if limit is Limit.DAILY_TOKEN_BUDGET else lim.tokens_per_minute
        what = "daily token budget" if limit is Limit.DAILY_TOKEN_BUDGET else "tokens-per-minute quota"
        return Refused(
            tenant=tenant,
            limit=limit,
            retry_after_s=None,
            message=(
                f"Request too large for tenant {tenant!r}: it needs {tokens} tokens (prompt + max output), "
                f"more than the whole {what} of {whole}, so it can never be admitted. Shorten the prompt "
                "or lower max_tokens/max_completion_tokens or n."
            ),
        )
    if limit is Limit.MAX_CONCURRENT_REQUESTS:
        return Refused(
            tenant=tenant,
            limit=limit,
            retry_after_s=CONCURRENCY_RETRY_AFTER_S,
            message=(
                f"Too many concurrent requests for tenant {tenant!r}: limit {lim.max_concurrent_requests}, "
                f"in flight {detail}. Please try again when one of them has finished."
            ),
        )
    if limit is Limit.DAILY_TOKEN_BUDGET:
        return Refused(
            tenant=tenant,
            limit=limit,
            retry_after_s=max(retry_after, 1.0),
            message=(
                f"Daily token budget reached for tenant {tenant!r}: budget {lim.daily_token_budget}, used "
                f"{detail} today (UTC), requested {tokens}. The budget resets at 00:00 UTC."
            ),
        )
    cap = lim.tokens_per_minute if limit is Limit.TOKENS_PER_MINUTE else lim.requests_per_minute
    unit = "tokens" if limit is Limit.TOKENS_PER_MINUTE else "requests"
    need = tokens if limit is Limit.TOKENS_PER_MINUTE else 1
    have = max(0, math.floor(float(detail)))
    return Refused(
        tenant=tenant,
        limit=limit,
        retry_after_s=retry_after,
        message=(
            f"Rate limit reached for tenant {tenant!r} on {unit} per minute: limit {cap}, available {have}, "
            f"requested {need}. Please try again in {retry_after:.2f}s."
        ),
    )
