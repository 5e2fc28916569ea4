"""The gateway names who served each answer, and logs each request as one JSON line, through a real Envoy
in front of plain HTTP model servers that set no ``x-inferlb-*`` header of their own.

Two loopback OpenAI-shaped servers (stdlib ``http.server``: ``/health`` and a chat completion with a fixed
``usage`` naming the port it listens on) serve one model version; ``gateway.access_log`` writes to a file.
Checked: ``x-inferlb-endpoint`` / ``x-inferlb-model-version`` / ``x-inferlb-upstream-host`` name the server
whose body answered (Envoy sets them from the upstream host,
:data:`xds_server.resources.routes.SERVED_BY_HEADERS`),
and each request writes one JSON line with the tenant, model, version, endpoint, status, the answer's usage,
TTFT and duration (:data:`xds_server.resources.listener.ACCESS_LOG_FIELDS`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from inferlb.request import headers
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, http_request, in_mode, started_stack

pytestmark = pytest.mark.e2e

MODEL = "plain-model"
VERSION = "v7"
KEY = "sk-served-by-key"
TENANT = "served-by"
#: The usage every answer reports: the access log must carry these, not the gateway's own count.
PROMPT_TOKENS, COMPLETION_TOKENS = 17, 5
#: Seconds a streamed answer's first event waits after its headers: its TTFT is at least this.
FIRST_EVENT_DELAY_S = 0.3


class _Plain(BaseHTTPRequestHandler):
    """A model server that names itself only in its body (``system_fingerprint``: its port)."""

    protocol_version = "HTTP/1.1"

    def _send(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"status": "ok"})

    def do_POST(self) -> None:
        doc = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
        if doc.get("stream"):
            self._stream()
            return
        self._send(
            200,
            {
                "id": "chatcmpl-plain",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": MODEL,
                "system_fingerprint": f"port-{self.server.server_address[1]}",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": COMPLETION_TOKENS,
                    "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
                },
            },
        )

    def _stream(self) -> None:
        """An SSE answer whose first event comes :data:`FIRST_EVENT_DELAY_S` after its headers (a
        prefill), then a content event and the usage event."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        time.sleep(FIRST_EVENT_DELAY_S)
        base = {"id": "chatcmpl-plain", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
        events = [
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]},
            {
                **base,
                "choices": [],
                "usage": {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": COMPLETION_TOKENS,
                    "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
                },
            },
        ]
        for event in events:
            piece = b"data: " + json.dumps(event).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        piece = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(piece), piece))
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:  # the stdlib's parameter name
        return


@pytest.fixture(scope="module")
def plain_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Plain) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    work = tmp_path_factory.mktemp("served-by")
    doc = in_mode(make_config_doc(), request_path)
    doc["models"] = [{"name": MODEL, "versions": [{"name": VERSION}]}]
    doc["endpoints"] = [
        {
            "name": f"plain-{i}",
            "address": f"127.0.0.1:{s.server_address[1]}",
            "model": MODEL,
            "version": VERSION,
            "gpu": "A100",
        }
        for i, s in enumerate(servers)
    ]
    doc["tenants"] = [{"name": TENANT, "api_keys": [KEY]}]
    doc["gateway"]["access_log"] = {"path": str(work / "access.log"), "format": "json"}
    try:
        with started_stack(work, doc) as rs:
            yield rs
    finally:
        for s, t in zip(servers, threads, strict=True):
            s.shutdown()
            s.server_close()
            t.join(timeout=5)


def _chat(
    rs: RunningStack, agent: str = "served-by-test", **extra: Any
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A chat request with User-Agent ``agent``: status, headers and the JSON answer (a stream's usage
    event's JSON)."""
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}
    sent = {"Authorization": f"Bearer {KEY}", "User-Agent": agent}
    reply = http_request(rs.gateway, "POST", "/v1/chat/completions", body, sent)
    if not extra.get("stream"):
        return reply.status, reply.headers, reply.json()
    events = [e.removeprefix("data: ") for e in reply.body.decode().split("\n\n") if e.startswith("data: {")]
    return reply.status, reply.headers, json.loads(events[-1])


def _log_lines_of(path: Path, agent: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The access log's JSON lines of requests sent with User-Agent ``agent``, once there is one (Envoy
    flushes its file every second), and after one more second (so a second line would be there too)."""
    deadline = time.monotonic() + timeout_s
    found = False
    while True:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        lines = [json.loads(line) for line in text.splitlines()]  # every line must be JSON
        mine = [e for e in lines if e["user_agent"] == agent]
        if found or time.monotonic() > deadline:
            return mine
        if mine:
            found = True
            time.sleep(1.2)
        else:
            time.sleep(0.1)


def test_the_gateway_names_the_endpoint_that_served(plain_stack: RunningStack) -> None:
    by_port = {e.address.port: e for e in plain_stack.config.endpoints}
    seen = set()
    for _ in range(12):
        status, hdrs, doc = _chat(plain_stack)
        assert status == 200, doc
        port = int(doc["system_fingerprint"].removeprefix("port-"))
        served = by_port[port]
        assert hdrs[headers.ENDPOINT] == served.display_name
        assert hdrs[headers.MODEL_VERSION] == VERSION
        assert hdrs[headers.UPSTREAM_HOST] == f"127.0.0.1:{port}"
        seen.add(served.display_name)
    assert seen == {"plain-0", "plain-1"}  # both served, each named


def test_a_refused_request_names_no_endpoint(plain_stack: RunningStack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    sent = {"Authorization": "Bearer sk-unknown-key"}
    reply = http_request(plain_stack.gateway, "POST", "/v1/chat/completions", body, sent)
    assert reply.status == 401
    assert headers.ENDPOINT not in reply.headers and headers.UPSTREAM_HOST not in reply.headers


def test_each_request_writes_one_json_access_log_line(plain_stack: RunningStack) -> None:
    log = Path(plain_stack.doc["gateway"]["access_log"]["path"])
    agent = f"access-log-test-{time.monotonic_ns()}"
    status, hdrs, doc = _chat(plain_stack, agent)
    assert status == 200
    lines = _log_lines_of(log, agent)
    assert len(lines) == 1, lines
    entry = lines[0]
    assert entry["tenant"] == TENANT and entry["model"] == MODEL and entry["version"] == VERSION
    assert entry["endpoint"] == hdrs[headers.ENDPOINT] and entry["endpoint_version"] == VERSION
    assert entry["upstream_host"] == hdrs[headers.UPSTREAM_HOST]
    assert entry["status"] == 200 and entry["response_flags"] == "-"
    assert entry["path"] == "/v1/chat/completions" and entry["method"] == "POST"
    assert entry["prompt_tokens"] == doc["usage"]["prompt_tokens"] == PROMPT_TOKENS
    assert entry["completion_tokens"] == doc["usage"]["completion_tokens"] == COMPLETION_TOKENS
    assert isinstance(entry["counted_prompt_tokens"], int | float) and entry["counted_prompt_tokens"] > 0
    assert isinstance(entry["ttft_ms"], int) and isinstance(entry["duration_ms"], int)
    assert 0 <= entry["ttft_ms"] <= entry["duration_ms"]


def test_a_stream_logs_its_usage_and_time_to_first_token(plain_stack: RunningStack) -> None:
    log = Path(plain_stack.doc["gateway"]["access_log"]["path"])
    agent = f"access-log-stream-{time.monotonic_ns()}"
    status, hdrs, last = _chat(plain_stack, agent, stream=True, stream_options={"include_usage": True})
    assert status == 200 and last["usage"]["completion_tokens"] == COMPLETION_TOKENS
    [entry] = _log_lines_of(log, agent)
    assert entry["endpoint"] == hdrs[headers.ENDPOINT]
    assert entry["prompt_tokens"] == PROMPT_TOKENS and entry["completion_tokens"] == COMPLETION_TOKENS
    # headers at once, the first event after the simulated prefill: TTFT counts to the first body byte
    assert entry["ttft_ms"] >= FIRST_EVENT_DELAY_S * 1000 > entry["upstream_first_byte_ms"]
    assert entry["ttft_ms"] <= entry["duration_ms"]
