"""One JSON document shared by several processes in Redis: versioned, written by compare-and-set, announced.

The xDS server's replicas keep the fleet API's changes here (:mod:`xds_server.fleet_store` gives the
document its meaning; this module knows only a JSON object and its version). One Redis hash per document,
at ``key``:

- ``epoch``: a random id set when the hash is created. A Redis that lost its data (no persistence, a
  flushed database) starts a new epoch, so a reader never mistakes a new document's version 3 for the old
  one's.
- ``version``: 1 for the first write, +1 on each write.
- ``doc``: the document (JSON text); ``writer``: who wrote it (an instance id); ``updated_at``: Unix s.

Every write is one Lua script (:data:`_WRITE_LUA`), so it is atomic
(https://redis.io/docs/latest/develop/interact/programmability/eval-intro/, "Script atomicity"): it
writes only when the stored ``(epoch, version)`` is still the one the writer read
(:meth:`RedisDocument.write_if`), bumps the version and ``PUBLISH``\\ es the new version on
``{key}:changed``. A writer that lost the race gets ``None`` back, reads again and re-applies its change
on the newer document: two writers never overwrite each other's change.

Readers learn of a write from the channel (:meth:`RedisDocument.wait_for_change`) and, since pub/sub
drops messages while a subscriber reconnects, by reading the version every poll anyway
(:meth:`RedisDocument.stamp`, one ``HMGET``).

Connections follow :mod:`inferlb.adapters.quota_redis`: a small bounded blocking pool, a timeout on
opening a connection and one on each command, redis-py's retries off (a write that timed out may have run;
running it again is the caller's choice, after reading), maintenance notifications off (so a connection
a Redis restart closed is reopened on its next use). Every Redis failure (refused, timed out, broken)
raises :class:`SharedStateUnavailableError` naming the store (URL without credentials) and the operation;
nothing is retried here.

Persistence is the Redis operator's: the document must survive a Redis restart, so run Redis with the
append-only file (``appendonly yes``; see :mod:`inferlb.adapters.quota_redis` for ``appendfsync``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from inferlb.errors import InferlbError

#: Connections per process: one held by the subscription, the rest for reads and writes (a process's
#: writes are serialized by its caller, so two are plenty).
POOL_SIZE: Final = 4

# KEYS: the hash. ARGV: expected epoch ('' = absent), expected version, document, writer, Unix s, channel,
# a new epoch (used when the hash is created). Returns {1, epoch, version} when written, {0, epoch,
# version} (what is stored) otherwise; epoch '' and version 0 mean absent.
_WRITE_LUA: Final = """
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'version')
local epoch = cur[1] or ''
local version = tonumber(cur[2] or '0')
if epoch ~= ARGV[1] or version ~= tonumber(ARGV[2]) then
  return {0, epoch, version}
end
if epoch == '' then epoch = ARGV[7] end
version = version + 1
redis.call('HSET', KEYS[1], 'epoch', epoch, 'version', version, 'doc', ARGV[3], 'writer', ARGV[4],
  'updated_at', ARGV[5])
redis.call('PUBLISH', ARGV[6], epoch .. ':' .. version)
return {1, epoch, version}
"""


class SharedStateUnavailableError(InferlbError):
    """The shared store could not be reached or did not answer in time.

    Attributes:
        where: the store (``redis://host:port/db key K``, no credentials).
        operation: what was being done (``read``, ``write``, ``subscribe``, ...).
        reason: redis-py's or the OS's message.
        maybe_applied: True for a write that timed out after it was sent: Redis may have run it (a reader
            sees it once Redis answers again); False when it certainly did not run.
    """

    def __init__(self, where: str, operation: str, reason: str, *, maybe_applied: bool = False) -> None:
        self.where = where
        self.operation = operation
        self.reason = reason
        self.maybe_applied = maybe_applied
        super().__init__(f"shared state store {where} unavailable ({operation}): {reason}")


@dataclass(frozen=True, kw_only=True)
class Stamp:
    """Which write of a document a reader saw: ``epoch`` ('' when absent) and ``version`` (0 when absent)."""

    epoch: str
    version: int

    @property
    def absent(self) -> bool:
        """True when there is no document (never written, or Redis lost it)."""
        return self.version == 0


#: The stamp of a document that does not exist.
ABSENT: Final = Stamp(epoch="", version=0)


@dataclass(frozen=True, kw_only=True)
class StoredDocument:
    """A document as read: its stamp, the parsed JSON, who wrote it and when (Unix s)."""

    stamp: Stamp
    document: Any
    writer: str
    updated_at: float


def redacted(url: str) -> str:
    """``url`` without user name or password (``redis://127.0.0.1:6379/0``), for logs and errors."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return f"{parts.scheme}://{netloc}{parts.path}"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisDocument:
    """One shared JSON document at ``key`` (see the module docstring).

    Args:
        client: a ``redis.asyncio.Redis`` with socket timeouts set (:meth:`from_url` builds one).
        key: the hash's key; the channel is ``{key}:changed``.
        where: how errors and logs name the store.
        writer: this process's id, stored with each write (a random one by default).
    """

    def __init__(self, client: aioredis.Redis, key: str, *, where: str, writer: str | None = None) -> None:
        self.client = client
        self.key = key
        self.channel = f"{key}:changed"
        self.where = where
        self.writer = writer or uuid.uuid4().hex[:12]
        self._write = client.register_script(_WRITE_LUA)
        self._pubsub: PubSub | None = None

    @classmethod
    def from_url(
        cls, url: str, key: str, *, timeout_s: float, connect_timeout_s: float, writer: str | None = None
    ) -> RedisDocument:
        """A document over a new bounded pool (:data:`POOL_SIZE`) to ``url``: ``timeout_s`` per command
        (and for a free connection), ``connect_timeout_s`` per connect, no redis-py retries.

        Raises:
            ValueError: ``url`` is not a Redis URL redis-py accepts.
        """
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_SIZE,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        where = f"{redacted(url)} key {key}"
        return cls(aioredis.Redis.from_pool(pool), key, where=where, writer=writer)

    def _unavailable(
        self, operation: str, exc: BaseException, *, sent: bool = False
    ) -> SharedStateUnavailableError:
        timed_out = isinstance(exc, RedisTimeoutError | TimeoutError)
        reason = str(exc) or type(exc).__name__
        return SharedStateUnavailableError(self.where, operation, reason, maybe_applied=sent and timed_out)

    async def _hmget(self, operation: str, fields: list[str]) -> list[Any]:
        """``HMGET`` of this hash's ``fields``. A read is idempotent, so a broken connection is retried once
        on a fresh one: after a Redis restart every pooled connection is closed, and the first use of one
        must not count as Redis being down. A timeout is not retried (Redis is slow or gone)."""
        for attempt in range(2):
            try:
                return list(await self.client.hmget(self.key, fields))
            except RedisConnectionError as exc:
                if attempt == 1:
                    raise self._unavailable(operation, exc) from None
            except (RedisError, OSError, TimeoutError) as exc:
                raise self._unavailable(operation, exc) from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def stamp(self) -> Stamp:
        """The stored document's epoch and version (one ``HMGET``; :data:`ABSENT` when there is none).

        Raises:
            SharedStateUnavailableError: Redis did not answer.
        """
        epoch, version = await self._hmget("read version", ["epoch", "version"])
        if version is None:
            return ABSENT
        return Stamp(epoch=_text(epoch or b""), version=int(version))

    async def read(self) -> StoredDocument | None:
        """The stored document, or None when there is none.

        Raises:
            SharedStateUnavailableError: Redis did not answer.
            ValueError: the hash holds something this module did not write (the field named).
        """
        fields = ["epoch", "version", "doc", "writer", "updated_at"]
        epoch, version, doc, writer, updated_at = await self._hmget("read", fields)
        if version is None:
            return None
        try:
            stamp = Stamp(epoch=_text(epoch or b""), version=int(version))
        except ValueError:
            raise ValueError(f"{self.where}: field version is not an integer: {version!r}") from None
        if doc is None:
            raise ValueError(f"{self.where}: field doc is missing")
        try:
            document = json.loads(doc)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.where}: field doc is not JSON ({exc})") from None
        try:
            at = float(updated_at) if updated_at is not None else 0.0
        except ValueError:
            at = 0.0
        return StoredDocument(stamp=stamp, document=document, writer=_text(writer or b"-"), updated_at=at)

    async def write_if(self, expected: Stamp, document: Any) -> Stamp | None:
        """Store ``document`` (JSON-ready) when the stored stamp is still ``expected`` (:data:`ABSENT`:
        only when there is no document), in one atomic script that bumps the version and publishes it.

        Returns:
            the new stamp, or None when another writer got there first (nothing written: read again).

        Raises:
            SharedStateUnavailableError: Redis did not answer (``maybe_applied`` when the script was sent
                and timed out).
            ValueError: ``document`` is not JSON-serialisable (NaN, a non-str key, ...).
        """
        body = json.dumps(document, allow_nan=False, separators=(",", ":"))
        now = repr(time.time())
        args: list[str | int] = [
            expected.epoch, expected.version, body, self.writer, now, self.channel, uuid.uuid4().hex
        ]  # fmt: skip
        try:
            ok, epoch, version = await self._write(keys=[self.key], args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._unavailable("write", exc, sent=True) from None
        if int(ok) != 1:
            return None
        return Stamp(epoch=_text(epoch), version=int(version))

    async def wait_for_change(self, timeout_s: float) -> None:
        """Return when a write is announced on the channel, or after ``timeout_s`` seconds, whichever comes
        first; right after (re)subscribing it returns at once (a write may have been missed meanwhile).
        Callers read :meth:`stamp` after each return. A broken subscription is dropped (and remade on
        the next call) and the call returns, so the caller's read finds out whether Redis is there.

        Raises:
            SharedStateUnavailableError: the subscription cannot be made.
        """
        if self._pubsub is None:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
            except (RedisError, OSError, TimeoutError) as exc:
                await _close_quietly(pubsub)
                raise self._unavailable("subscribe", exc) from None
            self._pubsub = pubsub
            return
        deadline = time.monotonic() + timeout_s
        try:
            # bounded: each round returns a message, or waits out what is left of the timeout
            for _ in range(64):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
                if message is not None and message.get("type") == "message":
                    return
        except (RedisError, OSError, TimeoutError, asyncio.IncompleteReadError):
            await self.drop_subscription()

    async def drop_subscription(self) -> None:
        """Close the subscription, if any; the next :meth:`wait_for_change` subscribes again."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            await _close_quietly(pubsub)

    async def aclose(self) -> None:
        """Drop the subscription and close the pool."""
        await self.drop_subscription()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.client.aclose()


async def _close_quietly(pubsub: PubSub) -> None:
    """Close ``pubsub``, swallowing the connection errors a dead server gives. redis-py types
    ``PubSub.aclose`` only from 8.2 on: the cast keeps one line that type-checks against either."""
    close = cast("Callable[[], Awaitable[None]]", pubsub.aclose)
    with contextlib.suppress(RedisError, OSError, TimeoutError):
        await close()
