"""The ext_authz HTTP/1.1 server: an asyncio protocol over httptools (llhttp, the parser of Node.js and
uvicorn) in front of :class:`ext_authz.check.CheckService`.

- **Keep-alive and pipelining**: each connection parses what arrives into whole requests and answers them
  strictly in order; a check that must await (Redis, a big body in a worker thread) holds the answers
  behind it, and reading pauses once :data:`MAX_PIPELINED` requests wait, so a fast writer cannot grow the
  queue without bound. ``Connection: close`` (or HTTP/1.0 without keep-alive) closes after the answer.
- **Bounds**: the request line and headers together at most :data:`MAX_HEADER_BYTES` (431), the body at
  most the current config's ``gateway.max_request_body_bytes`` (413; Envoy's ``max_request_bytes`` is the
  same, so only a client that is not Envoy meets it); malformed HTTP answers 400. Each ends the
  connection, with an OpenAI JSON body.
- **Shutdown**: :meth:`CheckServer.close` stops accepting, closes idle connections at once and the others
  after their last answer, aborts what is left after the grace period, then waits for checks still running.

httptools rather than h11: both are maintained, and on the same checks h11 costs more. Measured with
``bench/authz_parser.py`` (an h11 protocol of the same behaviour in the script; wrk direct on loopback, the
same config and tenant, cells shuffled over 3 rounds, shared 2-core machine, 2026-12-01): CPU per check
httptools 57-79 us vs h11 137-140 us with repeated prompts (1.8-2.4x), 180-190 vs 259-294 us with unique
prompts (1.4-1.6x: tiktoken's share is the same for both), and h11 answered 0.48-0.52x the checks/s (0.81x in
one cell), at 1, 16 and 64 connections.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http
import json
import logging
import os
import socket
import ssl
from typing import Final, cast

import httptools

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from inferlb.adapters.unix_socket import bind_unix_socket, remove_own_socket
from inferlb.errors import RequestError

log = logging.getLogger("ext_authz")

#: Most bytes of a request's URL and headers (Envoy's own default ``max_request_headers_kb`` is 60 KiB, and
#: the check carries a subset of the client's headers).
MAX_HEADER_BYTES: Final = 64 * 1024
#: Requests parsed and not yet answered on one connection before it stops reading.
MAX_PIPELINED: Final = 32
#: Seconds :meth:`CheckServer.close` waits for connections to finish their answers.
SHUTDOWN_GRACE_S: Final = 2.0


#: The status line of every status Python names, built once (any other status reads "Unknown").
_STATUS_LINES: Final = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in http.HTTPStatus}


def encode_answer(answer: CheckAnswer, *, keep_alive: bool) -> bytes:
    """``answer`` as HTTP/1.1 response bytes, with ``content-length`` (and ``connection: close`` when the
    connection ends after it).

    Raises:
        UnicodeEncodeError: a header value is not Latin-1 (the handlers only produce ASCII values).
    """
    # one str encoded once: about a third of the time of encoding each header apart (every check pays it)
    parts = [_STATUS_LINES.get(answer.status) or f"HTTP/1.1 {answer.status} Unknown\r\n"]
    parts += [f"{k}: {v}\r\n" for k, v in answer.headers]
    parts.append(f"content-length: {len(answer.body)}\r\n")
    if not keep_alive:
        parts.append("connection: close\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1") + answer.body


#: The answer most checks get, encoded once.
_ALLOWED_BYTES: Final = encode_answer(CheckAnswer(status=200), keep_alive=True)


def protocol_error(status: int, message: str, code: str) -> bytes:
    """The response ending a connection whose request broke HTTP or a bound: an OpenAI JSON error."""
    err = RequestError(status, message, type="invalid_request_error", code=code)
    body = json.dumps(err.to_openai_json()).encode()
    return encode_answer(
        CheckAnswer(status=status, headers=(("content-type", "application/json"),), body=body),
        keep_alive=False,
    )


class _LimitError(Exception):
    """A request broke one of the server's bounds (raised from a parser callback)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class CheckProtocol(asyncio.Protocol):
    """One connection from Envoy (see the module docstring)."""

    def __init__(self, service: CheckService, server: CheckServer) -> None:
        self._service = service
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._queue: collections.deque[tuple[CheckRequest, bool]] = collections.deque()
        self._waiting: asyncio.Future[CheckAnswer] | None = None
        self._waiting_keep_alive = True
        self._closing = False
        self._error: bytes | None = None
        self._paused = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._header_bytes = 0
        self._body_bytes = 0
        self._body_limit = 0

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP transport (uvloop's does not subclass asyncio.Transport, so no isinstance check)
        self._transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._queue.clear()
        self._server.forget(self)

    def data_received(self, data: bytes) -> None:
        if self._error is not None:
            return  # the connection ends after the error answer
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _LimitError):
                self._fail(protocol_error(cause.status, cause.message, cause.code))
            else:
                log.exception("ext_authz parser callback failed")
                self._fail(protocol_error(400, "The request could not be read.", "invalid_http"))
        except httptools.HttpParserUpgrade:
            self._fail(protocol_error(400, "Protocol upgrades are not supported.", "invalid_http"))
        except httptools.HttpParserError as exc:
            self._fail(protocol_error(400, f"Malformed HTTP request: {exc}", "invalid_http"))
        else:
            self._run()

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._header_bytes = 0
        self._body_bytes = 0
        self._body_limit = self._service.state.gateway.max_body_bytes

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        # as on the wire: "name: value\r\n" (the ": " and CRLF too, or empty headers carry 4x the bound)
        self._count_header_bytes(len(name) + len(value) + 4)
        # the last of a repeated name wins, as ext_proc's header map (only single-valued headers are read)
        self._headers[name.decode("latin-1").lower()] = value.decode("utf-8", "replace")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._body_limit:
            raise _LimitError(
                413,
                f"The request body is larger than the gateway accepts: limit {self._body_limit} bytes.",
                "request_too_large",
            )
        self._body.append(body)

    def on_message_complete(self) -> None:
        request = CheckRequest(
            method=self._parser.get_method().decode("latin-1"),
            path=self._url.decode("utf-8", "replace"),
            headers=self._headers,
            body=b"".join(self._body),
        )
        self._queue.append((request, self._parser.should_keep_alive()))
        if len(self._queue) >= MAX_PIPELINED and self._transport is not None and not self._paused:
            self._paused = True
            self._transport.pause_reading()

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _LimitError(
                431, f"The request headers are larger than {MAX_HEADER_BYTES} bytes.", "headers_too_large"
            )

    # -- answering ---------------------------------------------------------------------------------
    def _run(self) -> None:
        """Answer the queued requests in order until one must wait."""
        while self._queue and self._waiting is None and self._transport is not None:
            request, keep_alive = self._queue.popleft()
            out = self._service.check(request)
            if isinstance(out, CheckAnswer):
                self._write(out, keep_alive)
                continue
            self._waiting, self._waiting_keep_alive = out, keep_alive
            out.add_done_callback(self._finish)
        if self._paused and self._error is None and len(self._queue) < MAX_PIPELINED and self._transport:
            self._paused = False
            self._transport.resume_reading()
        if not self._queue and self._waiting is None and self._transport is not None:
            if self._error is not None:
                self._transport.write(self._error)
                self._transport.close()
            elif self._closing:
                self._transport.close()

    def _finish(self, done: asyncio.Future[CheckAnswer]) -> None:
        self._waiting = None
        if self._transport is None:
            return
        if done.cancelled():  # the loop is stopping
            self._transport.abort()
            return
        self._write(done.result(), self._waiting_keep_alive)
        self._run()

    def _write(self, answer: CheckAnswer, keep_alive: bool) -> None:
        transport = self._transport
        assert transport is not None
        if answer.status == 200 and not answer.headers and keep_alive:
            transport.write(_ALLOWED_BYTES)
            return
        try:
            data = encode_answer(answer, keep_alive=keep_alive)
        except UnicodeEncodeError:
            log.exception("ext_authz answer header not Latin-1; answering 500")
            data = protocol_error(400, "The gateway could not encode its answer.", "internal_error")
            keep_alive = False
        transport.write(data)
        if not keep_alive:
            self._queue.clear()
            transport.close()

    def _fail(self, data: bytes) -> None:
        """Answer the requests parsed before the bad one, then ``data``, and close."""
        self._error = data
        if self._transport is not None:
            self._transport.pause_reading()
        self._run()

    def shutdown(self) -> None:
        """Close once the answers owed are written (at once when idle)."""
        self._closing = True
        if not self._queue and self._waiting is None and self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now."""
        if self._transport is not None:
            self._transport.abort()


class CheckServer:
    """The listening socket and its connections.

    Args:
        service: answers each check.
    """

    def __init__(self, service: CheckService) -> None:
        self.service = service
        self.connections: set[CheckProtocol] = set()
        self._server: asyncio.Server | None = None
        self._none_left = asyncio.Event()
        self._unix: tuple[str, os.stat_result] | None = None  # the socket file made by start_unix

    def forget(self, conn: CheckProtocol) -> None:
        """``conn`` has closed."""
        self.connections.discard(conn)
        if not self.connections:
            self._none_left.set()

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (0: a free port), over TLS with ``tls`` (``ext_proc.tls``:
        :func:`inferlb.adapters.tls.ssl_server_context`, a client certificate required), and return the
        bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: CheckProtocol(self.service, self), host, port, ssl=tls
        )
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def start_unix(self, path: str, field: str = "ext_proc.listen_unix") -> None:
        """Listen on the Unix domain socket ``path`` with the same rules as the gRPC services
        (:func:`inferlb.adapters.unix_socket.bind_unix_socket`: mode 0600, the directory must exist, a
        stale socket file is replaced); :meth:`close` removes the file.

        Raises:
            inferlb.adapters.unix_socket.UnixSocketError: ``path`` cannot be listened on (``field`` named).
        """
        held: list[socket.socket] = []

        def bind(address: str) -> int:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(address.removeprefix("unix:"))
            except OSError:
                sock.close()
                raise
            held.append(sock)
            return 1

        try:
            bind_unix_socket(path, field, bind)
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(
                lambda: CheckProtocol(self.service, self), sock=held[0]
            )
        except BaseException:
            for sock in held:
                sock.close()
                with contextlib.suppress(OSError):
                    os.unlink(path)  # the file this bind made (a chmod or the server failed after it)
            raise
        self._unix = (path, os.stat(path))

    async def close(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop accepting, let connections write what they owe (at most ``grace_s`` seconds), abort the
        rest, then wait for checks still running (their reservations get settled)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.shutdown()
        if self.connections:
            self._none_left.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none_left.wait(), grace_s)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
        if self._unix is not None:
            remove_own_socket(*self._unix)
            self._unix = None
        await self.service.drain()
