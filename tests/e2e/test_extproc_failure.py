"""Request-path service failures through real Envoy, in both request-path modes: a processor (ext_proc, or
the ext_authz service) that is down or slow never makes a request hang; fail-closed paths get a prompt
OpenAI JSON 5xx (ext_proc: 500, or 504 after ``message_timeout_ms``; ext_authz: 503 either way, README's
``ext_proc.failure_mode_allow`` row), fail-open paths (``path_failure_modes``, ext_proc mode only: ext_authz
mode refuses it) go to the body's model with the API key checked by Envoy
(tests/e2e/test_extproc_fail_open.py has the rest); Envoy's codec errors reach clients as JSON while the
service's own JSON replies pass unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc

from inferlb.ops.stack import port_open
from tests.conftest import make_config_doc
from tests.e2e.conftest import Reply, RunningStack, http_request, in_mode, started_stack

pytestmark = pytest.mark.e2e

#: Short, so the slow-processor case answers quickly; still far above what ext_proc needs for a chat.
MESSAGE_TIMEOUT_MS = 1_000
#: Every request is bounded by this client timeout; answers must come well under it.
CLIENT_TIMEOUT_S = 15.0
FAIL_OPEN_MODEL = "qwen2.5-7b-instruct"


#: What a client gets when the request-path service fails closed, by mode: (status, code) when it is down,
#: and when it answers slower than ``message_timeout_ms``. Envoy's ext_authz filter gives both failures the
#: same code details (``ext_authz_error``), so ext_authz mode cannot tell a timeout apart.
FAIL_CLOSED: dict[str, tuple[tuple[int, str], tuple[int, str]]] = {
    "ext_proc": ((500, "gateway_processor_unavailable"), (504, "gateway_processor_timeout")),
    "ext_authz": ((503, "gateway_processor_unavailable"), (503, "gateway_processor_unavailable")),
}


@pytest.fixture(scope="module")
def failure_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    """Chat completions fail closed (the default); in ext_proc mode embeddings fail open to qwen
    (``path_failure_modes``, which ext_authz mode refuses)."""
    work = tmp_path_factory.mktemp("failure")
    doc = in_mode(make_config_doc(), request_path)
    doc["ext_proc"].update(
        message_timeout_ms=MESSAGE_TIMEOUT_MS, failure_mode_allow=False, fail_open_model=FAIL_OPEN_MODEL
    )
    if request_path == "ext_proc":
        doc["ext_proc"]["path_failure_modes"] = {"/v1/embeddings": "open"}
    with started_stack(work, doc) as rs:
        yield rs


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Reply, float]:
    t0 = time.monotonic()
    reply = fn(*args, **kwargs)
    return reply, time.monotonic() - t0


def _chat(rs: RunningStack, path: str = "/v1/chat/completions") -> tuple[Reply, float]:
    body = {"model": "llama3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return _timed(
        http_request,
        rs.gateway,
        "POST",
        path,
        body,
        {"Authorization": "Bearer sk-demo-a"},
        timeout_s=CLIENT_TIMEOUT_S,
    )


def _embed(rs: RunningStack, key: str = "sk-demo-a") -> tuple[Reply, float]:
    # not the fail-open model: a failed-open request goes to the model its body names
    body = {"model": "llama3", "input": "hello"}
    return _timed(
        http_request,
        rs.gateway,
        "POST",
        "/v1/embeddings",
        body,
        {"Authorization": f"Bearer {key}"},
        timeout_s=CLIENT_TIMEOUT_S,
    )


def _json_error(reply: Reply) -> dict[str, Any]:
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    err = reply.json()["error"]
    assert isinstance(err, dict)
    return err


def _raw(addr: str, data: bytes) -> bytes:
    """Send raw bytes to ``addr`` and read until Envoy closes the connection (bounded)."""
    host, port = addr.rsplit(":", 1)
    out = b""
    with socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT_S) as s:
        s.sendall(data)
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return out


def _status_and_json(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), hdrs, body


def test_codec_errors_come_back_as_openai_json(failure_stack: RunningStack) -> None:
    gw = failure_stack.gateway
    huge = (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 64_000
    )  # Envoy's default limit is 60 KiB; more unread bytes make the close a reset + b"\r\n\r\n"
    status, hdrs, body = _status_and_json(_raw(gw, huge))
    assert status == 431
    assert hdrs["content-type"] == "application/json"
    err = Reply(status, hdrs, body).json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "http1.headers_too_large")
    assert "param" in err and err["param"] is None  # OpenAI's whole shape
    status, hdrs, body = _status_and_json(_raw(gw, b"NOT A REQUEST LINE\r\n\r\n"))
    assert status == 400
    assert hdrs["content-type"] == "application/json"
    err = Reply(status, hdrs, body).json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "http1.codec_error")
    # HTTP/1.0 is refused with 426 (Envoy's accept_http_10 is off)
    status, hdrs, body = _status_and_json(_raw(gw, b"GET /v1/models HTTP/1.0\r\n\r\n"))
    assert status == 426
    assert hdrs["content-type"] == "application/json"
    assert Reply(status, hdrs, body).json()["error"]["type"] == "invalid_request_error"


def test_ext_procs_own_json_replies_pass_unchanged(failure_stack: RunningStack) -> None:
    r = failure_stack.chat("llama3", key="sk-not-a-key")
    assert r.status == 401
    err = _json_error(r)
    # ext_proc's own error, not a local-reply mapper's rewrite (those carry Envoy's code details)
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key"), err
    assert err["message"].startswith("Incorrect API key provided")
    r = failure_stack.chat("no-such-model")
    assert r.status == 404 and _json_error(r)["code"] == "model_not_found"


class SlowProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):
    """An ext_proc that reads each message and never answers within ``message_timeout``."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.streams = 0

    async def Process(
        self,
        request_iterator: AsyncIterator[external_processor_pb2.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[external_processor_pb2.ProcessingResponse]:
        self.streams += 1
        async for _request in request_iterator:
            await asyncio.sleep(self.delay_s)
        # an async generator that never yields in time: Envoy's message_timeout fires first
        if False:  # pragma: no cover - makes this an async generator
            yield external_processor_pb2.ProcessingResponse()


class SlowAuthz:
    """An ext_authz HTTP service that reads each check and never answers within ``message_timeout``
    (Envoy's HTTP-service ``timeout``)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.checks = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while await reader.read(65536):
                self.checks += 1
                await asyncio.sleep(self.delay_s)
        writer.close()


@contextlib.asynccontextmanager
async def slow_processor(rs: RunningStack, delay_s: float) -> AsyncIterator[Callable[[], int]]:
    """A processor of the stack's protocol on its ``ext_proc.listen`` that answers slower than
    ``delay_s``; yields how many streams (checks) it has been sent."""
    listen = rs.config.ext_proc.listen
    if rs.config.ext_proc.protocol == "ext_proc":
        server = grpc.aio.server()
        slow = SlowProcessor(delay_s)
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(slow, server)
        assert server.add_insecure_port(str(listen)) == listen.port
        await server.start()
        try:
            yield lambda: slow.streams
        finally:
            await server.stop(0)
        return
    authz = SlowAuthz(delay_s)
    http = await asyncio.start_server(authz.handle, str(listen.host), listen.port)
    try:
        yield lambda: authz.checks
    finally:
        http.close()
        await http.wait_closed()


async def test_a_dead_then_a_slow_processor_never_hangs_a_request(
    failure_stack: RunningStack, request_path: str
) -> None:
    rs = failure_stack
    down, slow_answer = FAIL_CLOSED[request_path]
    # path_failure_modes is ext_proc mode's only (ext_authz mode refuses it)
    paths_fail_open = request_path == "ext_proc"
    ok, _ = await asyncio.to_thread(_chat, rs)
    assert ok.status == 200, ok.body

    # (a) the request-path process is killed outright
    proc = rs.stack.child(request_path).proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    for path in ("/v1/chat/completions", "/v1/chat/completions?api-version=1"):
        for _ in range(3):
            r, elapsed = await asyncio.to_thread(_chat, rs, path)
            assert r.status == down[0], r.body
            err = _json_error(r)
            assert (err["type"], err["code"]) == ("server_error", down[1])
            assert elapsed < 3.0, elapsed  # prompt: connection refused, not a timeout
    if paths_fail_open:
        for _ in range(3):
            r, elapsed = await asyncio.to_thread(_embed, rs)
            assert r.status == 200, r.body  # fail open: served by the body's model, key checked by Envoy
            assert r.headers["x-inferlb-failed-open"] == "true"
            assert r.json()["model"] == "llama-3.1-8b-instruct"
            assert elapsed < 3.0, elapsed
        r, _ = await asyncio.to_thread(_embed, rs, "sk-not-a-key")
        assert r.status == 401, r.body
        assert _json_error(r)["code"] == "invalid_api_key"
        # a body naming no model goes to the fail-open model (key still checked)
        r = await asyncio.to_thread(
            http_request,
            rs.gateway,
            "POST",
            "/v1/embeddings",
            {"input": "hello"},
            {"Authorization": "Bearer sk-demo-a"},
            timeout_s=CLIENT_TIMEOUT_S,
        )
        assert r.status == 200, r.body
        assert r.headers["x-inferlb-failed-open"] == "true"
        assert r.json()["model"] == FAIL_OPEN_MODEL
    else:
        r, elapsed = await asyncio.to_thread(_embed, rs)
        assert r.status == down[0] and _json_error(r)["code"] == down[1], r.body
        assert elapsed < 3.0, elapsed

    # (b) a processor on the same address that answers slower than message_timeout
    async with slow_processor(rs, delay_s=4 * MESSAGE_TIMEOUT_MS / 1000) as streams:
        assert port_open(rs.config.ext_proc.listen)
        timeout_s = MESSAGE_TIMEOUT_MS / 1000
        for _ in range(2):
            r, elapsed = await asyncio.to_thread(_chat, rs)
            assert r.status == slow_answer[0], r.body
            err = _json_error(r)
            assert (err["type"], err["code"]) == ("server_error", slow_answer[1])
            if request_path == "ext_proc":
                assert f"{MESSAGE_TIMEOUT_MS} ms" in err["message"]
            assert timeout_s * 0.8 <= elapsed < timeout_s + 2.0, elapsed
        if paths_fail_open:
            r, elapsed = await asyncio.to_thread(_embed, rs)
            assert r.status == 200, r.body
            assert r.headers["x-inferlb-failed-open"] == "true"
            assert r.json()["model"] == "llama-3.1-8b-instruct"
            assert elapsed < timeout_s + 2.0, elapsed
            r, _ = await asyncio.to_thread(_embed, rs, "sk-not-a-key")
            assert r.status == 401, r.body
        assert streams() >= (3 if paths_fail_open else 2)  # Envoy did reach the slow processor
