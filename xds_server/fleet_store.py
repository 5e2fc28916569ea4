"""The fleet API's changes on disk: one JSON file, replaced atomically on every change, read at start-up.

The store is a file (``xds.state_file``, or ``python -m xds_server --state-file``), not a database: the
fleet API's state is small (endpoints registered, drained, deregistered and pinned by operators and
autoscalers) and changes at human or autoscaler speed, so rewriting it whole is cheap and leaves nothing
to reconcile.

- **Atomic**: :meth:`FleetStateFile.save` writes a temporary file in the same directory, ``fsync``\\ s it,
  ``os.replace``\\ s it over the state file and ``fsync``\\ s the directory. A crash (``kill -9``, power loss)
  leaves the old file or the new one, never a mix, and a change the API answered 2xx for is on disk.
- **One writer**: the xDS server holds an exclusive ``flock`` on ``<state file>.lock`` while it runs. A
  second server started on the same file is refused at start (two writers would each overwrite the other's
  changes). The kernel drops the lock when the process dies, however it dies. Several xDS servers (one per
  Envoy group, or replicas) each need their own state file, and a fleet change must be sent to each: the
  file is not a shared store.
- **Refused, never dropped**: a state file that cannot be read or parsed at start stops the server with an
  error naming the file (:class:`StateFileError`); fix it or move it away to start without the fleet
  API's changes. A missing file is a first start (no changes yet). Since every write is a rename of a
  complete file, a corrupt file was not written by this server (a disk fault, a hand edit).

The document is :func:`xds_server.fleet_state.to_document`'s, with ``saved_at`` (Unix s) added.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import IO

from inferlb.errors import InferlbError
from xds_server.fleet_state import FleetState, from_document, to_document


class StateFileError(InferlbError):
    """The fleet state file cannot be used.

    Attributes:
        path: the state file.
        reason: what is wrong with it.
    """

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"fleet state file {path}: {reason}")


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
