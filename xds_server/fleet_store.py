"""The fleet API's changes, stored: one JSON file for one server, or one Redis document shared by replicas.

Two stores, one seam (:class:`FleetStore`): the server hands each change to the store as a function from
the stored state to the new one (:data:`FleetChange`), the store runs it on what it holds and keeps the
result, so a change is applied to the state it was made on.

**The file** (``xds.state_file``, or ``python -m xds_server --state-file``; :class:`FleetStateFile`,
:class:`FileFleetStore`): not a database. The fleet API's state is small (endpoints registered, drained,
deregistered and pinned by operators and autoscalers) and changes at human or autoscaler speed, so
rewriting it whole is cheap and leaves nothing to reconcile.

- **Atomic**: :meth:`FleetStateFile.save` writes a temporary file in the same directory, ``fsync``\\ s it,
  ``os.replace``\\ s it over the state file and ``fsync``\\ s the directory. A crash (``kill -9``, power loss)
  leaves the old file or the new one, never a mix, and a change the API answered 2xx for is on disk.
- **One writer**: the xDS server holds an exclusive ``flock`` on ``<state file>.lock`` while it runs. A
  second server started on the same file is refused at start (two writers would each overwrite the other's
  changes). The kernel drops the lock when the process dies, however it dies. Replicas share Redis instead.
- **Refused, never dropped**: a state file that cannot be read or parsed at start stops the server with an
  error naming the file (:class:`StateFileError`); fix it or move it away to start without the fleet
  API's changes. A missing file is a first start (no changes yet). Since every write is a rename of a
  complete file, a corrupt file was not written by this server (a disk fault, a hand edit).

**Redis** (``xds.state_redis_url``, or ``--state-redis-url``; :class:`RedisFleetStore` over
:class:`inferlb.adapters.state_redis.RedisDocument`): several xDS servers share one document.

- **No lost change**: a change reads the stored state and its ``(epoch, version)``, applies itself to it
  and writes by compare-and-set; when another server wrote in between, it reads again and applies itself to
  the newer state (at most :data:`MAX_ATTEMPTS` times, then 503 ``fleet_store_busy``). Two changes made at
  once on two servers therefore both land, in some order, whatever they touch.
- **Everyone follows**: every write is published; each server also reads the version every
  ``xds.state_redis_poll_ms`` (pub/sub misses what is published while it reconnects) and adopts a newer
  state as its own fleet view, which pushes to its Envoys like any change.
- **Redis down**: a change is refused with 503 ``fleet_store_unavailable`` naming the store, and nothing
  changes (a write that timed out after it was sent may have landed: the answer says so, and the servers
  adopt it once Redis answers); the last state each server adopted keeps serving; each server keeps trying
  every poll and logs when it is back. A server does not start without its store (exit 1, the store named).
- **Redis lost the document** (restarted without persistence, flushed): a server that had adopted a state
  writes it back (logged as an error), so the fleet keeps its changes while any server runs; run Redis with
  the append-only file so this never happens.
- **Refused, never dropped**: a document this code did not write stops the start naming the store; at run
  time it is logged and the last good state keeps serving.

The document is :func:`xds_server.fleet_state.to_document`'s, with ``saved_at`` (Unix s) added.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Final, Protocol

from inferlb.adapters.state_redis import ABSENT, RedisDocument, Stamp
from inferlb.errors import InferlbError
from xds_server.fleet_state import FleetState, from_document, to_document

log = logging.getLogger("xds_server")

#: A fleet change as the stores run it: the stored state in, the new state out (the same object: no
#: change). It may raise to refuse the change (nothing is stored then); with Redis it may run more than once
#: (once per attempt), each time on the newest stored state.
FleetChange = Callable[[FleetState], Awaitable[FleetState]]

#: Compare-and-set attempts of one change before it is refused (503 ``fleet_store_busy``): each lost attempt
#: means another server's change landed meanwhile, so only a storm of changes on other servers exhausts it.
MAX_ATTEMPTS: Final = 16


class FleetStoreError(InferlbError):
    """The fleet store cannot be used (the HTTP API answers 500 ``fleet_state_not_stored``).

    Attributes:
        where: the store (a file path, or ``redis://host:port/db key K``).
        reason: what is wrong.
    """

    def __init__(self, where: str, reason: str, *, message: str | None = None) -> None:
        self.where = where
        self.reason = reason
        super().__init__(message or f"fleet store {where}: {reason}")


class StateFileError(FleetStoreError):
    """The fleet state file cannot be used.

    Attributes:
        path: the state file.
        reason: what is wrong with it.
    """

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        super().__init__(str(path), reason, message=f"fleet state file {path}: {reason}")


class FleetStoreBusyError(FleetStoreError):
    """A change lost :data:`MAX_ATTEMPTS` compare-and-set races in a row (other servers kept writing); it
    was not stored (the HTTP API answers 503 ``fleet_store_busy``: try again)."""


class FleetStateFile:
    """The fleet state file at ``path`` (see the module docstring). Not thread-safe: the server calls
    :meth:`save` from one worker thread at a time (its fleet lock)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock: IO[bytes] | None = None

    def lock(self) -> None:
        """Take the exclusive lock on ``<path>.lock`` (created if missing) for the life of this process.

        Raises:
            StateFileError: another process holds it, or the lock file cannot be created.
        """
        if self._lock is not None:
            return
        try:
            handle = self.lock_path.open("ab")
        except OSError as exc:
            raise StateFileError(self.path, f"cannot create the lock {self.lock_path}: {exc}") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise StateFileError(
                self.path,
                f"in use by another xds_server process (it holds {self.lock_path}); give each server its "
                "own state file",
            ) from None
        self._lock = handle

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def load(self) -> FleetState | None:
        """Read the state file.

        Returns:
            the stored state, or None when there is no file yet (a first start).

        Raises:
            StateFileError: unreadable, empty, not JSON, or not a fleet state document (the reason says
                which field).
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateFileError(self.path, f"cannot read: {exc.strerror or exc}") from None
        if not raw.strip():
            raise StateFileError(self.path, "empty (this server never writes an empty file); move it away")
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StateFileError(self.path, f"not JSON ({exc}); fix it or move it away") from None
        try:
            return from_document(doc)
        except ValueError as exc:
            raise StateFileError(self.path, f"not a fleet state document: {exc}") from None

    def save(self, state: FleetState, now: float | None = None) -> None:
        """Replace the file with ``state`` atomically and durably (temporary file, fsync, rename, fsync of
        the directory). ``now``: the ``saved_at`` stamp (Unix s; ``time.time()`` by default).

        Raises:
            StateFileError: the file cannot be written (nothing replaced; the temporary file removed).
        """
        doc = {**to_document(state), "saved_at": time.time() if now is None else now}
        body = (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with tmp.open("wb") as out:
                out.write(body)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StateFileError(self.path, f"cannot write: {exc.strerror or exc}") from None


class FleetStore(Protocol):
    """Where the server keeps the fleet API's changes (:class:`FileFleetStore`, :class:`RedisFleetStore`).

    Attributes:
        where: how logs, errors and ``GET /v1/endpoints`` name it.
        shared: True when other servers write it too (the server then follows it).
    """

    where: str
    shared: bool

    async def open(self) -> FleetState | None:
        """Take the store (lock, connect) and read it: None when nothing is stored yet.

        Raises:
            FleetStoreError: unusable (in use, unreadable, not a fleet state document).
            SharedStateUnavailableError: a shared store cannot be reached.
        """
        ...

    async def update(self, change: FleetChange, local: FleetState, *, always: bool = False) -> FleetState:
        """Run ``change`` on the stored state (``local``, this server's view, for a store only this server
        writes) and store the result; returns it. ``always``: store even when ``change`` changed nothing.

        Raises:
            whatever ``change`` raises (nothing stored); FleetStoreError: it cannot be stored;
            SharedStateUnavailableError: a shared store cannot be reached (nothing stored unless its
            ``maybe_applied``).
        """
        ...

    async def close(self) -> None:
        """Let go of the store (idempotent)."""
        ...


class FileFleetStore:
    """:class:`FleetStore` over one :class:`FleetStateFile` (this server alone writes it: the lock)."""

    shared = False

    def __init__(self, path: str | Path) -> None:
        self.file = FleetStateFile(path)
        self.where = str(self.file.path)

    async def open(self) -> FleetState | None:
        """Lock and read the file (see :meth:`FleetStateFile.lock` and :meth:`FleetStateFile.load`)."""
        self.file.lock()
        return await asyncio.to_thread(self.file.load)

    async def update(self, change: FleetChange, local: FleetState, *, always: bool = False) -> FleetState:
        """``change(local)`` written to the file (``local`` is what the file holds: this server alone writes
        it); not written when ``change`` returned ``local`` itself, unless ``always``."""
        fleet = await change(local)
        if fleet is not local or always:
            await asyncio.to_thread(self.file.save, fleet)
        return fleet

    async def close(self) -> None:
        """Release the lock."""
        self.file.close()


class RedisFleetStore:
    """:class:`FleetStore` in one Redis document shared by several xDS servers (the module docstring).

    Args:
        document: the shared document (:meth:`inferlb.adapters.state_redis.RedisDocument.from_url`).

    Attributes:
        seen: the stamp of the last state this server read or wrote (:data:`ABSENT` before).
    """

    shared = True

    def __init__(self, document: RedisDocument) -> None:
        self.document = document
        self.where = document.where
        self.seen: Stamp = ABSENT
        self._bad: Stamp | None = None

    def _parse(self, stamp: Stamp, doc: object) -> FleetState:
        try:
            return from_document(doc)
        except ValueError as exc:
            raise FleetStoreError(
                self.where, f"version {stamp.version} is not a fleet state document: {exc}"
            ) from None

    async def _read(self) -> tuple[Stamp, FleetState | None]:
        try:
            stored = await self.document.read()
        except ValueError as exc:
            raise FleetStoreError(self.where, str(exc)) from None
        if stored is None:
            return ABSENT, None
        return stored.stamp, self._parse(stored.stamp, stored.document)

    async def open(self) -> FleetState | None:
        """Read the document (None: nothing stored yet); :meth:`wait_for_change` subscribes."""
        stamp, state = await self._read()
        self.seen = stamp
        return state

    async def update(self, change: FleetChange, local: FleetState, *, always: bool = False) -> FleetState:
        """Read, ``change``, compare-and-set; again on the newer state when another server wrote first.

        Raises:
            FleetStoreBusyError: :data:`MAX_ATTEMPTS` races lost in a row.
        """
        for _ in range(MAX_ATTEMPTS):
            stamp, stored = await self._read()
            base = FleetState() if stored is None else stored
            fleet = await change(base)
            if stored is not None and fleet == base and not always:
                self.seen = stamp
                return fleet
            doc = {**to_document(fleet), "saved_at": time.time()}
            written = await self.document.write_if(stamp, doc)
            if written is not None:
                self.seen = written
                return fleet
        raise FleetStoreBusyError(
            self.where,
            f"the change lost {MAX_ATTEMPTS} write races in a row to other servers' changes; try again",
        )

    async def changed(self, local: FleetState) -> FleetState | None:
        """The stored state when it is not the one this server last saw (one ``HMGET`` otherwise), else None.

        A document that vanished (Redis lost its data) is written back from ``local`` once this server has
        seen one (logged as an error). A document that is not a fleet state is logged once and skipped.

        Raises:
            SharedStateUnavailableError: Redis did not answer.
        """
        stamp = await self.document.stamp()
        if stamp in (self.seen, self._bad):
            return None
        if stamp.absent:
            log.error(
                "fleet store %s: the document is gone (Redis lost its data: run it with appendonly yes); "
                "writing back this server's last state (version %d)", self.where, self.seen.version,
            )  # fmt: skip
            written = await self.document.write_if(ABSENT, {**to_document(local), "saved_at": time.time()})
            if written is not None:
                self.seen = written
                return None
            # another server wrote it back first: adopt that
        try:
            stamp, state = await self._read()
        except FleetStoreError as exc:
            log.error("%s; the last good fleet state keeps serving", exc)
            self._bad = stamp
            return None
        self.seen = stamp
        return state

    async def wait_for_change(self, timeout_s: float) -> None:
        """Until another server's write is announced, or ``timeout_s`` (see
        :meth:`inferlb.adapters.state_redis.RedisDocument.wait_for_change`)."""
        await self.document.wait_for_change(timeout_s)

    async def resubscribe(self) -> None:
        """Drop the subscription (after a failure): the next :meth:`wait_for_change` makes a new one."""
        await self.document.drop_subscription()

    async def close(self) -> None:
        """Close the subscription and the pool."""
        await self.document.aclose()
