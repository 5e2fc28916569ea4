"""Quota state shared by several ext_proc replicas, in Redis (redis-py asyncio, atomic Lua scripts).

Same contract and numbers as :class:`inferlb.policy.quota.QuotaBook` (per-minute sliding windows of
whole-second sub-windows, concurrency leases, a UTC-day token budget), with every admission and settlement one
Lua script, so replicas never interleave inside a decision: Redis runs a script atomically
(https://redis.io/docs/latest/develop/interact/programmability/eval-intro/, "Script atomicity"). Under
any concurrency across replicas no 60 s window therefore admits more than a quota (the proof is in
:mod:`inferlb.policy.quota`).

Keys per tenant (the ``{tenant}`` hash tag keeps them in one Redis Cluster slot):

- ``{prefix}:{tenant}:rpm`` and ``{prefix}:{tenant}:tpm``, hashes: whole second (epoch s, decimal) ->
  requests or tokens counted in it. Each admission and settlement drops the fields older than the window
  (at most 61 remain) and the key expires :data:`WINDOW_TTL_S` after its last write.
- ``{prefix}:{tenant}:state``, a hash: ``day``/``dt`` the UTC day and the tokens counted on it. It expires
  after :data:`STATE_TTL_S` without use (a past day carries no information).
- ``{prefix}:{tenant}:inflight``, a sorted set of concurrency leases scored by their expiry (epoch s).
  A lease whose replica died is dropped once it expires (``lease_ttl_s``), so a crash cannot leak
  slots forever; settling removes the lease with ``ZREM``, which succeeds once.

Times are wall-clock seconds passed in by the caller (replicas' clocks are assumed NTP-synchronised; a
clock behind the newest second stored counts as that second, as in
:meth:`~inferlb.policy.quota.SlidingWindow.current_second`). The script returns the second at which a refused
request fits and Python turns it into ``retry_after_s`` with :func:`~inferlb.policy.quota.seconds_until`, so
both stores give the same float. Limits are passed with every call, so a config reload takes effect on the
next call; the sub-windows are kept and checked against the new quota.

Connections: each process holds a bounded pool of ``pool_size`` connections
(``redis.asyncio.BlockingConnectionPool``), all opened by :meth:`RedisQuotaStore.start` before the server
takes streams (warm-up, with the scripts loaded), and a gate (an ``asyncio.Semaphore`` of the same size) in
front of it, so at most ``pool_size`` calls hold a connection and the others queue for one in FIFO order.
The gateway's own limits are never mistaken for Redis failing, which a cold burst used to do: 300
concurrent admissions over two replicas opened a connection each, the 101st of a process failed at once
with redis-py's ``Too many connections`` (its asyncio ``ConnectionPool`` caps at 100), new connections
slower than the 100 ms call timeout failed with ``Timeout connecting to server``, and every such failure
was admitted unchecked (258 admitted at 50 requests/min) or refused 503 with Redis up. Now:

- waiting for a free connection is not a failure. It counts in the request's budget: an admission that
  has no connection by its ``deadline`` (the servicer passes the body's arrival + 90% of Envoy's
  ``message_timeout``) is refused 503 :attr:`~inferlb.policy.quota.Limit.QUOTA_BACKEND_BUSY` with
  ``retry-after``, never admitted unchecked, whatever the ``failure_mode``;
- opening a connection has its own timeout (``connect_timeout_s``, ``ext_proc.redis_connect_timeout_ms``,
  1000 ms), apart from the timeout of one command on an open connection (``timeout_s``,
  ``ext_proc.redis_timeout_ms``, 100 ms), so connection set-up under load is not cut at the command's
  budget; connections normally open once, at start-up;
- redis-py's own retries are off (``Retry(NoBackoff(), 0)``; its default of 10 retries with backoff up to
  1 s kept an admission waiting seconds on a Redis that was down): a timed-out admission script may still
  have run, and running it again would count the request twice. A pooled connection that went stale (a
  Redis restart) is reopened when it is taken from the pool (redis-py checks it for a pending EOF; its
  maintenance notifications are off, which would skip that check), not reported as a failure.

When Redis itself fails (connection refused, a connect slower than ``connect_timeout_s``, a command slower
than ``timeout_s``, a broken connection), the ``failure_mode`` decides: ``open`` admits the request
unchecked (``Admitted.degraded``; its settlement is skipped) and ``closed`` refuses it with
:attr:`~inferlb.policy.quota.Limit.QUOTA_BACKEND_UNAVAILABLE` (503). Either way ``on_error`` is called
(``ExtProcMetrics.quota_backend_error``).

Persistence: the quota state must survive a Redis restart, or a restart hands every tenant a fresh minute
and day. Run Redis with the append-only file (``appendonly yes``): with ``appendfsync everysec`` (Redis's
default fsync policy) a Redis process crash or restart loses nothing (each write reaches the kernel
before its reply is sent, and a SIGTERM shutdown fsyncs the file), an OS crash or power loss up to about
1 s of admissions, which are then admitted again (an overshoot bounded by one second's admissions);
``appendfsync always`` fsyncs before each reply and loses nothing acknowledged, at the cost of a disk sync
per admission. RDB snapshots alone (``save``) lose everything since the last snapshot, minutes by default.
(https://redis.io/docs/latest/operate/oss_and_stack/management/persistence/). Lua scripts are not
persisted; a restarted Redis gets them again on the first ``NOSCRIPT`` answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final, Literal

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig

from inferlb.policy.quota import (
    SECONDS_PER_DAY,
    SUB_WINDOWS,
    WINDOW_S,
    Admitted,
    Limit,
    Refused,
    TenantLimits,
    over_daily_budget,
    over_rate,
    seconds_until,
    too_large,
    too_many_in_flight,
    utc_day,
)

log = logging.getLogger("inferlb.policy.quota")

#: Seconds an idle tenant's day-total hash is kept.
STATE_TTL_S: Final = 2 * SECONDS_PER_DAY
#: Seconds a window hash is kept after its last write: its sub-windows matter for 61 s; twice the window
#: leaves room for replicas' clocks running ahead of Redis's.
WINDOW_TTL_S: Final = 2 * WINDOW_S
#: Retry-after given when failing closed or when no connection freed in time (s).
BACKEND_RETRY_AFTER_S: Final = 1.0
#: Connections per process (``ext_proc.redis_pool_size``). By Little's law the connections busy are admissions
#: per second x round trip: one ext_proc process spends 0.65-1.7 ms of CPU per request
#: (bench/results/2026-11-29/extproc_overhead.txt), so it admits at most ~1,500 requests/s, and at a 1 ms LAN
#: round trip about 2 connections are busy; 16 stay enough up to a ~10 ms round trip, and 16 per replica stays
#: far below Redis's default ``maxclients`` of 10000.
DEFAULT_POOL_SIZE: Final = 16
#: Time to open one connection, TCP connect and handshake (s; ``ext_proc.redis_connect_timeout_ms``): far
#: above a healthy loopback or LAN connect (well under 10 ms) even on a loaded host, so only a Redis that is
#: really unreachable reaches it.
DEFAULT_CONNECT_TIMEOUT_S: Final = 1.0

# Shared by both scripts: read one window hash and drop its sub-windows older than the window.
_WINDOW_LUA: Final = f"""
local function load(key)
  -- {{second, units, field}} of every sub-window, and the newest second (nil when empty)
  local flat = redis.call('HGETALL', key)
  local subs, newest = {{}}, nil
  for i = 1, #flat, 2 do
    local s = tonumber(flat[i])
    subs[#subs + 1] = {{s, tonumber(flat[i + 1]), flat[i]}}
    if newest == nil or s > newest then newest = s end
  end
  return subs, newest
end
local function prune(key, subs, second)
  -- keep the sub-windows from second - {WINDOW_S} on; return them and their sum
  local kept, total, old = {{}}, 0, {{}}
  for _, e in ipairs(subs) do
    if e[1] < second - {WINDOW_S} then
      old[#old + 1] = e[3]
    else
      kept[#kept + 1] = e
      total = total + e[2]
    end
  end
  if #old > 0 then redis.call('HDEL', key, unpack(old)) end
  return kept, total
end
"""

# KEYS: state, inflight, rpm window, tpm window.
# ARGV: now, tokens, rpm, tpm, max_inflight, budget, day, lease, lease_expiry, state_ttl_ms, window_ttl_ms
# (-1 = unlimited). Returns {admitted (1/0), limit, second, detail} as strings (Redis truncates Lua
# numbers): second = the admission's sub-window, or for a rate refusal the second at which it fits
# (-1 otherwise); detail = 'never' for a request above a whole quota, else the units counted (rate), the
# leases held (concurrency) or today's tokens (budget).
_ADMIT_LUA: Final = (
    _WINDOW_LUA
    + f"""
local now = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local rpm = tonumber(ARGV[3])
local tpm = tonumber(ARGV[4])
local maxin = tonumber(ARGV[5])
local budget = tonumber(ARGV[6])
local day = tonumber(ARGV[7])
if budget >= 0 and tokens > budget then
  return {{0, 'daily_token_budget', '-1', 'never'}}
end
if maxin >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local inflight = redis.call('ZCARD', KEYS[2])
  if inflight >= maxin then
    return {{0, 'max_concurrent_requests', '-1', tostring(inflight)}}
  end
end
local dt = 0
if budget >= 0 then
  local st = redis.call('HMGET', KEYS[1], 'day', 'dt')
  if tonumber(st[1]) == day then dt = tonumber(st[2]) or 0 end
  if dt + tokens > budget then
    return {{0, 'daily_token_budget', '-1', tostring(dt)}}
  end
end
if tpm >= 0 and tokens > tpm then
  return {{0, 'tokens_per_minute', '-1', 'never'}}
end
local second = math.floor(now)
local rsubs, tsubs, newest
if rpm >= 0 then
  rsubs, newest = load(KEYS[3])
  if newest ~= nil and newest > second then second = newest end
end
if tpm >= 0 then
  tsubs, newest = load(KEYS[4])
  if newest ~= nil and newest > second then second = newest end
end
local function fit(subs, total, units, quota)
  -- the first second >= second at which units fit if nothing else is admitted
  if total + units <= quota then return second end
  table.sort(subs, function(a, b) return a[1] < b[1] end)
  for _, e in ipairs(subs) do
    total = total - e[2]
    if total + units <= quota then return e[1] + {SUB_WINDOWS} end
  end
  return second + {SUB_WINDOWS}
end
local fit_r, fit_t, used_r, used_t = second, second, 0, 0
if rpm >= 0 then
  rsubs, used_r = prune(KEYS[3], rsubs, second)
  fit_r = fit(rsubs, used_r, 1, rpm)
end
if tpm >= 0 then
  tsubs, used_t = prune(KEYS[4], tsubs, second)
  fit_t = fit(tsubs, used_t, tokens, tpm)
end
if fit_r > second or fit_t > second then
  local at = tostring(math.max(fit_r, fit_t))
  if fit_t >= fit_r and tpm >= 0 then
    return {{0, 'tokens_per_minute', at, tostring(used_t)}}
  end
  return {{0, 'requests_per_minute', at, tostring(used_r)}}
end
local field = tostring(second)
if rpm >= 0 then
  redis.call('HINCRBY', KEYS[3], field, 1)
  redis.call('PEXPIRE', KEYS[3], ARGV[11])
end
if tpm >= 0 then
  redis.call('HINCRBY', KEYS[4], field, tokens)
  redis.call('PEXPIRE', KEYS[4], ARGV[11])
end
if budget >= 0 then
  redis.call('HSET', KEYS[1], 'day', tostring(day), 'dt', tostring(dt + tokens))
  redis.call('PEXPIRE', KEYS[1], ARGV[10])
end
if maxin >= 0 then
  redis.call('ZADD', KEYS[2], ARGV[9], ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[10])
end
return {{1, '', field, '0'}}
"""
)

# KEYS: state, inflight, tpm window.
# ARGV: now, reserved, used, tpm, budget, day, lease, has_maxin (1/0), second, window_ttl_ms.
# Returns 1 when settled now, 0 when the lease was already settled (or expired).
_SETTLE_LUA: Final = (
    _WINDOW_LUA
    + f"""
local now = tonumber(ARGV[1])
local reserved = tonumber(ARGV[2])
local used = tonumber(ARGV[3])
local tpm = tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
local day = tonumber(ARGV[6])
local second = tonumber(ARGV[9])
if ARGV[8] == '1' then
  if redis.call('ZREM', KEYS[2], ARGV[7]) == 0 then return 0 end
end
if tpm >= 0 then
  local subs, newest = load(KEYS[3])
  local current = math.floor(now)
  if newest ~= nil and newest > current then current = newest end
  prune(KEYS[3], subs, current)
  -- a sub-window that has left the window limits nobody any more: leave it alone
  if second >= current - {WINDOW_S} then
    local units = tonumber(redis.call('HGET', KEYS[3], ARGV[9])) or 0
    redis.call('HSET', KEYS[3], ARGV[9], tostring(math.max(0, units + used - reserved)))
    redis.call('PEXPIRE', KEYS[3], ARGV[10])
  end
end
if budget >= 0 then
  local st = redis.call('HMGET', KEYS[1], 'day', 'dt')
  if tonumber(st[1]) == day then
    redis.call('HSET', KEYS[1], 'dt', tostring(math.max(0, tonumber(st[2]) + used - reserved)))
  end
end
return 1
"""
)


def _lim(value: int | None) -> int:
    return -1 if value is None else value


class _NoConnectionInTime(Exception):
    """Every pooled connection stayed busy until the caller's deadline (the gateway is overloaded; Redis
    has not failed)."""


class RedisQuotaStore:
    """:class:`inferlb.policy.quota.QuotaStore` in Redis, shared by every replica pointing at the same keys.

    Args:
        client: a ``redis.asyncio.Redis`` (give it ``socket_timeout``/``socket_connect_timeout``: a call
            slower than that counts as Redis being unreachable); :meth:`from_url` builds the bounded,
            blocking pool the services use.
        limits: tenant name -> limits (tenants not in it are unlimited and never touch Redis).
        key_prefix: prefix of every key.
        failure_mode: ``open`` (admit unchecked) or ``closed`` (refuse, 503) when Redis is unreachable.
        lease_ttl_s: how long a concurrency lease lives without being settled (s); longer than the
            longest request (Envoy's route timeout).
        wall_clock: epoch seconds (injected in tests).
        on_error: called with ``(backend, operation)`` for every failed call (a metric).
        pool_size: calls that may hold a connection at once (the gate); default the client pool's
            ``max_connections``, so the pool itself never runs out.
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
        pool_size: int | None = None,
    ) -> None:
        self.client = client
        self.limits: Mapping[str, TenantLimits] = dict(limits)
        self.key_prefix = key_prefix
        self.failure_mode = failure_mode
        self.lease_ttl_s = lease_ttl_s
        self.wall_clock = wall_clock
        self.on_error = on_error
        self.pool_size = pool_size if pool_size is not None else int(client.connection_pool.max_connections)
        self.cancel_safe = False  # admit awaits Redis: a cancelled caller may lose a lease Redis took
        self._gate = asyncio.Semaphore(self.pool_size)
        self._admit = client.register_script(_ADMIT_LUA)
        self._settle = client.register_script(_SETTLE_LUA)

    @classmethod
    def from_url(
        cls,
        url: str,
        limits: Mapping[str, TenantLimits],
        *,
        timeout_s: float,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        pool_size: int = DEFAULT_POOL_SIZE,
        **kwargs: Any,
    ) -> RedisQuotaStore:
        """A store over a new bounded blocking pool of ``pool_size`` connections to ``url``: ``timeout_s``
        for one command on an open connection, ``connect_timeout_s`` for opening one, no redis-py retries
        (see the module docstring). Connections open in :meth:`start`, or on first use without it."""
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=pool_size,
            timeout=None,  # the gate bounds the wait, by the caller's deadline
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            # off: with it on ("auto", redis-py 8's default for RESP3) the pool skips its check of a
            # pooled connection for a pending EOF, so every connection a Redis restart closed failed
            # its next command ("Connection closed by server") instead of being reopened; and each
            # connect spent a round trip on CLIENT MAINT_NOTIFICATIONS, which open-source Redis lacks
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        return cls(aioredis.Redis.from_pool(pool), limits, pool_size=pool_size, **kwargs)

    async def start(self) -> None:
        """Warm up: open all ``pool_size`` connections and load both scripts, so the first burst finds
        them ready. A Redis that cannot be reached now is logged and counted (``on_error``, operation
        ``start``); the connections then open on first use, where ``failure_mode`` applies."""
        pool = self.client.connection_pool
        opened = await asyncio.gather(
            # redis-py's get_connection is untyped (a deprecation decorator wraps it)
            *(pool.get_connection() for _ in range(self.pool_size)),  # type: ignore[no-untyped-call]
            return_exceptions=True,
        )
        failures = [c for c in opened if isinstance(c, Exception)]
        for c in opened:
            if not isinstance(c, BaseException):
                await pool.release(c)
        try:
            if failures:
                raise failures[0]
            async with self._gate:
                await self.client.script_load(_ADMIT_LUA)
                await self.client.script_load(_SETTLE_LUA)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("start", exc)
            return
        log.info("quota backend redis: %d connections open, scripts loaded", self.pool_size)

    @contextlib.asynccontextmanager
    async def _connection(self, deadline: float | None) -> AsyncIterator[None]:
        """Hold one of the ``pool_size`` connection slots; wait for one at most until ``deadline``
        (``time.monotonic()`` s; None: as long as it takes).

        Raises:
            _NoConnectionInTime: none freed by the deadline.
        """
        gate = self._gate
        if deadline is None:
            await gate.acquire()
        elif gate.locked():
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await gate.acquire()
            except TimeoutError:
                raise _NoConnectionInTime from None
        else:
            await gate.acquire()  # free now: returns without waiting
        try:
            yield
        finally:
            gate.release()

    def _keys(self, tenant: str) -> list[str]:
        """The tenant's state, inflight, rpm and tpm keys."""
        base = f"{self.key_prefix}:{{{tenant}}}"
        return [f"{base}:state", f"{base}:inflight", f"{base}:rpm", f"{base}:tpm"]

    def update_limits(self, limits: Mapping[str, TenantLimits], *, lease_ttl_s: float | None = None) -> None:
        """Use ``limits`` (and ``lease_ttl_s`` when given) from the next call on (state in Redis is kept and
        checked against new quotas)."""
        self.limits = dict(limits)
        if lease_ttl_s is not None:
            self.lease_ttl_s = lease_ttl_s

    def _failed(self, operation: str, exc: BaseException) -> None:
        log.warning("quota backend redis: %s failed: %s", operation, exc)
        if self.on_error is not None:
            self.on_error("redis", operation)

    async def admit(self, tenant: str, tokens: int, *, deadline: float | None = None) -> Admitted | Refused:
        """Admit one request of ``tokens`` (see :meth:`inferlb.policy.quota.QuotaBook.try_admit`).

        Args:
            deadline: ``time.monotonic()`` seconds by which a connection must be free; past it the
                request is refused 503 :attr:`~inferlb.policy.quota.Limit.QUOTA_BACKEND_BUSY` (not a Redis
                failure). None: wait as long as it takes.
        """
        now = self.wall_clock()
        day = utc_day(now)
        lim = self.limits.get(tenant)
        if lim is None or lim == TenantLimits():
            return Admitted(tenant=tenant, tokens=tokens, day=day, second=math.floor(now))
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
            int(WINDOW_TTL_S * 1000),
        ]
        try:
            async with self._connection(deadline):
                ok, limit_raw, second_raw, detail_raw = await self._admit(keys=self._keys(tenant), args=args)
        except _NoConnectionInTime:
            # the gateway's own pool was busy the whole budget: not a Redis failure, so never admit unchecked
            return Refused(
                tenant=tenant,
                limit=Limit.QUOTA_BACKEND_BUSY,
                retry_after_s=BACKEND_RETRY_AFTER_S,
                message="The gateway is too busy to check your quota right now (every connection to its "
                "quota store stayed in use). Please try again shortly.",
            )
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("admit", exc)
            if self.failure_mode == "open":
                return Admitted(tenant=tenant, tokens=tokens, day=day, second=math.floor(now), degraded=True)
            return Refused(
                tenant=tenant,
                limit=Limit.QUOTA_BACKEND_UNAVAILABLE,
                retry_after_s=BACKEND_RETRY_AFTER_S,
                message="The gateway cannot check your quota right now (its quota store is unreachable). "
                "Please try again shortly.",
            )
        second = int(_text(second_raw))
        if int(ok) == 1:
            return Admitted(tenant=tenant, tokens=tokens, lease=lease, day=day, second=second)
        return _refusal(
            tenant,
            tokens,
            lim,
            limit=Limit(_text(limit_raw)),
            fit_second=second,
            detail=_text(detail_raw),
            now=now,
        )

    async def settle(self, admitted: Admitted, used: int) -> bool:
        """Release the lease and replace the reservation with ``used`` tokens, once (see
        :meth:`inferlb.policy.quota.QuotaBook.settle`). Degraded (fail-open) admissions reserved nothing and
        are skipped. A failed call is logged and counted; the lease then expires on its own."""
        lim = self.limits.get(admitted.tenant)
        if admitted.degraded or lim is None or lim == TenantLimits():
            return False
        state, inflight, _, tpm = self._keys(admitted.tenant)
        args: list[str | int] = [
            repr(self.wall_clock()),
            admitted.tokens,
            used,
            _lim(lim.tokens_per_minute),
            _lim(lim.daily_token_budget),
            admitted.day,
            admitted.lease,
            1 if lim.max_concurrent_requests is not None else 0,
            str(admitted.second),
            int(WINDOW_TTL_S * 1000),
        ]
        try:
            async with self._connection(None):  # a settlement waits its turn: it must not be dropped
                return int(await self._settle(keys=[state, inflight, tpm], args=args)) == 1
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("settle", exc)
            return False

    async def in_flight(self, tenant: str) -> int:
        """Unexpired concurrency leases of ``tenant`` (for tests and status)."""
        async with self._connection(None):
            return int(await self.client.zcount(self._keys(tenant)[1], self.wall_clock(), "+inf"))

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _refusal(
    tenant: str, tokens: int, lim: TenantLimits, *, limit: Limit, fit_second: int, detail: str, now: float
) -> Refused:
    """The :class:`Refused` the in-process book gives for the same state, from the script's answer."""
    if detail == "never":
        whole = lim.daily_token_budget if limit is Limit.DAILY_TOKEN_BUDGET else lim.tokens_per_minute
        return too_large(tenant, tokens, limit, whole)
    if limit is Limit.MAX_CONCURRENT_REQUESTS:
        return too_many_in_flight(tenant, lim.max_concurrent_requests, detail)
    if limit is Limit.DAILY_TOKEN_BUDGET:
        return over_daily_budget(tenant, tokens, lim.daily_token_budget, detail, now)
    tokens_limit = limit is Limit.TOKENS_PER_MINUTE
    return over_rate(
        tenant,
        limit,
        quota=lim.tokens_per_minute if tokens_limit else lim.requests_per_minute,
        counted=int(detail),
        requested=tokens if tokens_limit else 1,
        retry_after_s=seconds_until(fit_second, now),
    )
