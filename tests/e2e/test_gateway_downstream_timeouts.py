"""Through real Envoy: the gateway's client-side bounds close slow-loris connections
(``gateway.request_headers_timeout_ms``, ``gateway.downstream_idle_timeout_ms``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, in_mode, started_stack

pytestmark = pytest.mark.e2e

HEADERS_TIMEOUT_MS = 1_000
IDLE_TIMEOUT_MS = 1_500
#: how long a test waits for Envoy to close a connection before it fails (bounded: never hangs)
WAIT_S = 8.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(make_config_doc(), request_path)
    doc["gateway"].update(
        request_headers_timeout_ms=HEADERS_TIMEOUT_MS, downstream_idle_timeout_ms=IDLE_TIMEOUT_MS
    )
    with started_stack(Path(tmp_path_factory.mktemp("timeouts")), doc) as rs:
        yield rs


def _until_closed(sock: socket.socket) -> tuple[float, bytes]:
    """Read ``sock`` until the peer closes it (or :data:`WAIT_S` passes): the seconds it took and what
    came before the close."""
    started = time.monotonic()
    got = b""
    sock.settimeout(0.2)
    while time.monotonic() - started < WAIT_S:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    else:
        raise AssertionError(f"Envoy kept the connection open for {WAIT_S} s (received {got[:200]!r})")
    return time.monotonic() - started, got


def test_a_client_that_stops_within_its_headers_is_answered_408_and_disconnected(stack: RunningStack) -> None:
    host, port = stack.gateway.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        # part of the request headers, then nothing (slow loris)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: appl")
        seconds, got = _until_closed(sock)
    assert seconds < HEADERS_TIMEOUT_MS / 1000 + 2.0
    assert got.startswith(b"HTTP/1.1 408"), got[:200]


def test_a_slow_loris_trickling_header_bytes_is_still_cut_at_the_headers_timeout(stack: RunningStack) -> None:
    host, port = stack.gateway.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n")
        started = time.monotonic()
        closed = False
        for i in range(40):  # one header byte every 0.1 s: the connection is never idle
            try:
                sock.sendall(b"x-slow-%d: y\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
        if not closed:
            _until_closed(sock)
    assert time.monotonic() - started < HEADERS_TIMEOUT_MS / 1000 + 2.0


def test_a_connection_that_sends_nothing_is_closed_at_the_idle_timeout(stack: RunningStack) -> None:
    host, port = stack.gateway.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        seconds, got = _until_closed(sock)
    assert got == b""
    assert IDLE_TIMEOUT_MS / 1000 - 0.5 < seconds < IDLE_TIMEOUT_MS / 1000 + 2.0


def test_requests_still_work(stack: RunningStack) -> None:
    assert stack.chat("llama3").status == 200
