"""Request-path failure behaviour through real Envoy, in both modes (ext_proc, and ext_authz with its two
check filters, one per failure mode): a processor that is down or slow never makes a request hang;
fail-closed paths get a prompt OpenAI JSON 5xx, fail-open paths (``ext_proc.path_failure_modes``) go to the
body's model with the API key checked by Envoy (tests/e2e/test_extproc_fail_open.py has the rest); each
request is checked exactly once, by its path's filter; Envoy's codec errors reach clients as JSON while the
service's own JSON replies pass unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc

from inferlb.ops.stack import port_open
from tests.conftest import make_config_doc
from tests.e2e.conftest import Reply, RunningStack, http_request, in_mode, skip_in, started_stack
from tests.e2e.test_extproc_accounting import process_samples
from tests.e2e.test_extproc_fail_open import _stat
from xds_server.resources.common import FAILED_OPEN_HEADER

pytestmark = pytest.mark.e2e

#: Short, so the slow-processor case answers quickly; still far above what ext_proc needs for a chat.
MESSAGE_TIMEOUT_MS = 1_000
#: Every request is bounded by this client timeout; answers must come well under it.
CLIENT_TIMEOUT_S = 15.0
FAIL_OPEN_MODEL = "qwen2.5-7b-instruct"


@pytest.fixture(scope="module")
def failure_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    """Chat completions fail closed (the default), embeddings fail open to qwen; in each request-path
    mode."""
    work = tmp_path_factory.mktemp("failure")
    doc = in_mode(make_config_doc(), request_path)
    doc["ext_proc"].update(
        message_timeout_ms=MESSAGE_TIMEOUT_MS,
        failure_mode_allow=False,
        path_failure_modes={"/v1/embeddings": "open"},
        fail_open_model=FAIL_OPEN_MODEL,
    )
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
        self.counter: list[int] = []  # one entry per stream

    async def Process(
        self,
        request_iterator: AsyncIterator[external_processor_pb2.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[external_processor_pb2.ProcessingResponse]:
        self.counter.append(1)
        async for _request in request_iterator:
            await asyncio.sleep(self.delay_s)
        # an async generator that never yields in time: Envoy's message_timeout fires first
        if False:  # pragma: no cover - makes this an async generator
            yield external_processor_pb2.ProcessingResponse()


#: Envoy's counters of the two ext_authz filters (ext_authz mode): checks answered 200, checks that failed,
#: failed checks let through.
FIRST, OTHER = "http.inferlb_gateway.ext_authz.", "http.inferlb_gateway.ext_authz.other_failure_mode."
FIRST_OK, OTHER_OK = f"{FIRST}ok", f"{OTHER}ok"
FIRST_ERROR, OTHER_ALLOWED = f"{FIRST}error", f"{OTHER}failure_mode_allowed"


def _settled_metered(rs: RunningStack) -> float:
    """``inferlb_meter_settlements_total{outcome="metered"}`` of the ext_authz process."""
    samples = process_samples(rs.config.ext_proc.metrics_listen, "inferlb_meter_settlements_total")
    return samples.get("metered", 0.0)


def test_each_request_is_checked_once_by_the_filter_of_its_paths_mode(
    failure_stack: RunningStack, request_path: str
) -> None:
    skip_in("ext_proc", request_path, "one ext_proc filter, whose per-route config sets the mode")
    rs = failure_stack
    ok, other, metered = _stat(rs, FIRST_OK), _stat(rs, OTHER_OK), _settled_metered(rs)
    chat, _ = _chat(rs)
    assert chat.status == 200, chat.body
    assert (_stat(rs, FIRST_OK), _stat(rs, OTHER_OK)) == (ok + 1, other)  # fail-closed path: the first
    emb, _ = _embed(rs)
    assert emb.status == 200, emb.body
    assert FAILED_OPEN_HEADER not in emb.headers  # checked and routed by the service, not failed open
    assert (_stat(rs, FIRST_OK), _stat(rs, OTHER_OK)) == (ok + 1, other + 1)  # fail-open path: the second
    # both are metered: the meter id the second filter's answer carried reaches the settler too
    deadline = time.monotonic() + 10
    while _settled_metered(rs) < metered + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _settled_metered(rs) == metered + 2


async def _hold_unanswered(delay_s: float, counter: list[int], reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:  # fmt: skip
    """An HTTP connection that is read and never answered within ``delay_s``."""
    counter.append(1)
    with contextlib.suppress(TimeoutError, ConnectionError):
        await asyncio.wait_for(reader.read(1 << 20), delay_s)
        await asyncio.sleep(delay_s)
    writer.close()


async def _slow_service(rs: RunningStack, delay_s: float) -> tuple[Any, list[int]]:
    """A service on the request path's address that answers slower than ``message_timeout``: a gRPC
    ext_proc, or an HTTP server that never answers a check; returns it and its count of streams or
    connections."""
    listen = rs.config.ext_proc.listen
    if rs.config.ext_proc.protocol == "ext_authz":
        counter: list[int] = []
        http = await asyncio.start_server(
            lambda r, w: _hold_unanswered(delay_s, counter, r, w), listen.host, listen.port
        )
        return http, counter
    server = grpc.aio.server()
    slow = SlowProcessor(delay_s=delay_s)
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(slow, server)
    assert server.add_insecure_port(str(listen)) == listen.port
    await server.start()
    return server, slow.counter


async def test_a_dead_then_a_slow_ext_proc_never_hangs_a_request(failure_stack: RunningStack) -> None:
    rs = failure_stack
    mode = rs.config.ext_proc.protocol
    ok, _ = await asyncio.to_thread(_chat, rs)
    assert ok.status == 200, ok.body

    # (a) the request-path process is killed outright
    proc = rs.stack.child(mode).proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    # a failed ext_proc stream is Envoy's 500, a failed check its status_on_error 503
    closed_status = 500 if mode == "ext_proc" else 503
    for path in ("/v1/chat/completions", "/v1/chat/completions?api-version=1"):
        for _ in range(3):
            r, elapsed = await asyncio.to_thread(_chat, rs, path)
            assert r.status == closed_status, r.body
            err = _json_error(r)
            assert (err["type"], err["code"]) == ("server_error", "gateway_processor_unavailable")
            assert elapsed < 3.0, elapsed  # prompt: connection refused, not a timeout
    for _ in range(3):
        r, elapsed = await asyncio.to_thread(_embed, rs)
        assert r.status == 200, r.body  # fail open: served by the body's model, key checked by Envoy
        assert r.headers["x-inferlb-failed-open"] == "true"
        assert r.json()["model"] == "llama-3.1-8b-instruct"
        assert elapsed < 3.0, elapsed
    if mode == "ext_authz":
        # each path's own filter failed: the first (closed) on chats, the second (open) on embeddings
        assert await asyncio.to_thread(_stat, rs, FIRST_ERROR) >= 6
        assert await asyncio.to_thread(_stat, rs, OTHER_ALLOWED) >= 3
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

    # (b) a service on the same address that answers slower than message_timeout
    server, reached = await _slow_service(rs, 4 * MESSAGE_TIMEOUT_MS / 1000)
    try:
        assert port_open(rs.config.ext_proc.listen)
        timeout_s = MESSAGE_TIMEOUT_MS / 1000
        for _ in range(2):
            r, elapsed = await asyncio.to_thread(_chat, rs)
            err = _json_error(r)
            if mode == "ext_proc":
                assert r.status == 504, r.body
                assert (err["type"], err["code"]) == ("server_error", "gateway_processor_timeout")
                assert f"{MESSAGE_TIMEOUT_MS} ms" in err["message"]
            else:  # a check's timeout is a failed check like any other
                assert r.status == 503, r.body
                assert (err["type"], err["code"]) == ("server_error", "gateway_processor_unavailable")
            assert timeout_s * 0.8 <= elapsed < timeout_s + 2.0, elapsed
        r, elapsed = await asyncio.to_thread(_embed, rs)
        assert r.status == 200, r.body
        assert r.headers["x-inferlb-failed-open"] == "true"
        assert r.json()["model"] == "llama-3.1-8b-instruct"
        assert elapsed < timeout_s + 2.0, elapsed
        r, _ = await asyncio.to_thread(_embed, rs, "sk-not-a-key")
        assert r.status == 401, r.body
        assert len(reached) >= 3  # Envoy did reach the slow service
    finally:
        if isinstance(server, asyncio.Server):
            server.close()
        else:
            await server.stop(0)
