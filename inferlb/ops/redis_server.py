"""A local ``redis-server`` on a loopback port, for the shared quota store in tests and benchmarks.

:class:`RedisServer` starts ``redis-server`` (from ``PATH``) bound to 127.0.0.1 on a free port, with its
working directory, and so its append-only file, in a directory of the caller's choosing, and stops it with
SIGTERM (Redis's clean shutdown: it fsyncs the AOF before exiting). ``restart()`` starts it again on the
same port and directory, so a test can check that quota state survives a restart.

Persistence is the caller's choice: ``appendonly=False`` (nothing written: a throwaway store) or
``appendonly=True`` with ``appendfsync`` ``everysec`` (Redis's default: at most about 1 s of writes lost on
an OS crash or power loss, nothing on a process crash or restart) or ``always`` (fsync before each reply:
nothing acknowledged is lost); see :mod:`inferlb.adapters.quota_redis` for what the quota store needs.
RDB snapshots are always off (``--save ""``), so only the AOF can bring state back.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Literal

from inferlb.ops.stack import free_ports

#: Seconds to wait for redis-server to answer PING after it starts, and to exit after SIGTERM.
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def find_redis_server() -> str | None:
    """Path of ``redis-server`` on ``PATH`` (or Debian's ``/usr/bin/redis-server``), None when absent."""
    found = shutil.which("redis-server")
    if found is None and Path("/usr/bin/redis-server").exists():
        found = "/usr/bin/redis-server"
    return found


def ping(port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis on ``127.0.0.1:port`` answers ``PING`` with ``+PONG`` (inline command)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port`` with its files in ``directory``.

    Args:
        directory: Redis's working directory (the AOF lives under it); must exist.
        appendonly: write the append-only file.
        appendfsync: the AOF fsync policy (``everysec`` or ``always``).
        port: the TCP port; a free one when None.
        binary: the ``redis-server`` executable (default: :func:`find_redis_server`).

    Raises:
        FileNotFoundError: no ``redis-server`` is installed.
    """

    def __init__(
        self,
        directory: Path,
        *,
        appendonly: bool = False,
        appendfsync: Literal["everysec", "always"] = "everysec",
        port: int | None = None,
        binary: str | None = None,
    ) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.binary = found
        self.directory = directory
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.port = port if port is not None else free_ports(1)[0]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The redis-py URL of database 0."""
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The ``redis-server`` command line."""
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
        ]

    def start(self) -> RedisServer:
        """Start it and wait until it answers PING.

        Raises:
            RuntimeError: it exited, or did not answer within :data:`START_TIMEOUT_S`.
        """
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ping(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT_S} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """SIGTERM (Redis shuts down cleanly, fsyncing the AOF) and wait for it to exit (SIGKILL after
        :data:`STOP_TIMEOUT_S`)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> RedisServer:
        """:meth:`stop`, then :meth:`start` on the same port and directory."""
        self.stop()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
