"""Unix domain sockets for the gRPC services (``xds.listen_unix``, ``ext_proc.listen_unix``): bind one
readable and writable by its owner only, and tell whether something accepts connections on one.

A co-located Envoy then authenticates by file permissions: only processes of the user that owns the socket
file (the one running the service; Envoy must run as that user) can connect, where a TCP port on loopback
takes any local process. The bind itself is the caller's (a gRPC server's ``add_insecure_port``), passed in
as a callable, so this module needs no gRPC.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from inferlb.errors import InferlbError

#: The socket file's mode: its owner may connect, nobody else.
SOCKET_MODE = 0o600


class UnixSocketError(InferlbError):
    """A Unix socket cannot be listened on.

    Attributes:
        field: the config field that names the path (``ext_proc.listen_unix``).
        path: the socket path.
    """

    def __init__(self, field: str, path: str, message: str) -> None:
        self.field = field
        self.path = path
        super().__init__(f"{field}: {path}: {message}")


def unix_socket_open(path: str, timeout_s: float = 0.2) -> bool:
    """True when ``path`` is a socket file and something accepts connections on it."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path)
            return True
    except OSError:
        return False


def prepare_unix_socket(path: str, field: str) -> None:
    """Make ``path`` ready to bind: its directory must exist, and a stale socket file left there by a
    process that is gone is removed.

    Raises:
        UnixSocketError: the directory is missing or not a directory; something other than a socket is at
            ``path``; a live server already accepts connections on it.
    """
    parent = Path(path).parent
    if not parent.is_dir():
        raise UnixSocketError(field, path, f"directory {parent} does not exist; create it first")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise UnixSocketError(field, path, "exists and is not a socket; remove it or choose another path")
    if unix_socket_open(path):
        raise UnixSocketError(field, path, "another server is listening on it")
    os.unlink(path)  # stale: its server is gone


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def bind_unix_socket(path: str, field: str, bind: Callable[[str], int]) -> None:
    """Listen on the Unix socket ``path``: :func:`prepare_unix_socket`, then ``bind("unix:" + path)`` (e.g.
    a gRPC server's ``add_insecure_port``) under a umask that creates the file with :data:`SOCKET_MODE`, then
    ``chmod`` to :data:`SOCKET_MODE` in any case. ``bind`` returning 0 is a failure (gRPC's way).

    Raises:
        UnixSocketError: as :func:`prepare_unix_socket`, or the bind or chmod failed (``bind``'s
            RuntimeError or OSError, with its message).
    """
    prepare_unix_socket(path, field)
    try:
        with _umask(0o777 & ~SOCKET_MODE):
            if bind(f"unix:{path}") == 0:
                raise RuntimeError("the bind failed")
        os.chmod(path, SOCKET_MODE)
    except (RuntimeError, OSError) as exc:
        raise UnixSocketError(field, path, f"cannot listen: {exc}") from None


def remove_own_socket(path: str, made: os.stat_result) -> bool:
    """Remove the socket file ``path`` at a server's stop if it is still the file the server made
    (``made``: its :func:`os.stat` after the bind; same device and inode), not one another process put
    there since. Returns whether it was removed. asyncio's servers leave the file behind (Python < 3.13,
    uvloop); grpc removes its own."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(now.st_mode) or (now.st_dev, now.st_ino) != (made.st_dev, made.st_ino):
        return False
    os.unlink(path)
    return True
