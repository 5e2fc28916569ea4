"""A stream whose client did not ask for usage: the gateway asks the model server for it
(``stream_options.include_usage``), charges it, and the client's bytes are exactly those it would have got
without the gateway's addition, through a real Envoy in both request-path modes (ext_proc's response stream
rewrites them; in ext_authz mode Envoy's Lua filter does).

A model ``scripted`` is served by a small HTTP/1.1 server in this test process that answers every
``stream: true`` chat completion with a fixed SSE stream: with ``include_usage`` each chunk carries
``"usage": null`` and a usage-only chunk comes before ``[DONE]``, as OpenAI sends them. It writes the
stream in pieces chosen by the request's ``user`` field (chunked encoding, a short pause between pieces so
Envoy forwards them as separate body chunks): the usage event cut inside its key, its object and its blank
line, a ``"usage": null`` member cut in two, byte by byte, CRLF line ends, a last event without its blank
line.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from inferlb.ops.stack import Stack
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import RunningStack, http_request, in_mode, stop_stack
from tests.e2e.test_extproc_accounting import charged, wait_charged

pytestmark = pytest.mark.e2e

SCRIPTED = "scripted"
TENANT = "hidden-usage"
KEY = "sk-hidden-usage-key"
#: The usage the scripted server reports (tokens).
PROMPT_TOKENS, COMPLETION_TOKENS = 17, 3
WORDS = ("Hello", " there", ', "usage": null')  # the last delta quotes the member in its text


def stream_events(*, include_usage: bool, newline: bytes = b"\n") -> list[bytes]:
    """The scripted SSE events, each with its blank line: three content chunks, the closing chunk, the
    usage-only chunk (``include_usage`` only) and ``[DONE]``."""

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "id": "chatcmpl-scripted",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": SCRIPTED,
            "choices": choices,
        }
        if include_usage:
            doc["usage"] = None
        return doc

    docs = [
        chunk([{"index": 0, "delta": {"content": w}, "logprobs": None, "finish_reason": None}]) for w in WORDS
    ]
    docs.append(chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]))
    if include_usage:
        usage = chunk([])
        usage["usage"] = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        }
        docs.append(usage)
    end = newline + newline
    return [b"data: " + json.dumps(d, separators=(",", ":")).encode() + end for d in docs] + [
        b"data: [DONE]" + end
    ]


def pieces(events: list[bytes], split: str) -> list[bytes]:
    """``events`` as the writes of split pattern ``split`` (module docstring)."""
    body = b"".join(events)
    if split == "whole":
        return [body]
    if split in ("events", "crlf"):
        return events
    if split == "cuts":
        cuts: list[int] = []
        usage_at = body.find(b'"usage":{')
        if usage_at >= 0:
            obj_end = body.find(b"}", usage_at)
            cuts += [usage_at + 3, usage_at + 12, obj_end + 1, obj_end + 3, obj_end + 4]
        null_at = body.find(b',"usage":null')
        if null_at >= 0:
            cuts += [null_at + 4, null_at + 11]
        cuts.append(len(events[0]) // 2)
        bounds = [0, *sorted(set(cuts)), len(body)]
        return [body[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    if split == "bytes":
        head = len(body) - len(events[-1]) - len(events[-2]) - 10
        return [body[:head], *(body[i : i + 1] for i in range(head, len(body)))]
    if split == "unterminated":
        return [body.removesuffix(b"\n\n")]
    raise ValueError(split)


class _Scripted(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    #: every request's ``stream_options.include_usage`` as the server received it
    asked: ClassVar[list[bool]] = []

    def do_POST(self) -> None:
        doc = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
        include = (doc.get("stream_options") or {}).get("include_usage") is True
        type(self).asked.append(include)
        split = doc.get("user", "whole")
        newline = b"\r\n" if split == "crlf" else b"\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for piece in pieces(stream_events(include_usage=include, newline=newline), split):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
            time.sleep(0.01)  # pacing only: Envoy forwards each piece as its own body chunk
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:  # the stdlib's parameter name
        return


@pytest.fixture(scope="module")
def scripted_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    work = tmp_path_factory.mktemp("hidden-usage")
    doc = in_mode(make_config_doc(), request_path)
    doc["ext_proc"].pop("account_responses", None)  # the default (on) is what is under test
    doc["models"].append({"name": SCRIPTED})
    doc["endpoints"].append(
        {"address": f"127.0.0.1:{server.server_address[1]}", "model": SCRIPTED, "gpu": "A100"}
    )
    doc["tenants"].append({"name": TENANT, "api_keys": [KEY]})
    path = write_config(work / "inferlb.yaml", doc)
    stack = Stack(path, workdir=work, log_level="info")
    try:
        stack.start(timeout_s=60)
        yield RunningStack(stack, stack.config, path, doc)
    finally:
        stop_stack(stack)
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def stream_request(rs: RunningStack, split: str, **extra: Any) -> bytes:
    """The raw body the client gets for a scripted stream sent with pattern ``split``."""
    body = {
        "model": SCRIPTED,
        "messages": [{"role": "user", "content": "say hello"}],
        "max_tokens": 5,
        "stream": True,
        "user": split,
        **extra,
    }
    reply = http_request(rs.gateway, "POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert reply.status == 200, reply.body
    return reply.body


SPLITS = ("whole", "events", "cuts", "bytes", "crlf", "unterminated")


@pytest.mark.parametrize(
    ("split", "client_asks"), [*((s, False) for s in SPLITS), ("whole", True), ("cuts", True)]
)
def test_the_client_gets_the_bytes_it_would_without_the_added_usage(
    scripted_stack: RunningStack, split: str, client_asks: bool
) -> None:
    rs = scripted_stack
    before = charged(rs.config, TENANT, SCRIPTED)
    _Scripted.asked.clear()
    got = stream_request(rs, split, **({"stream_options": {"include_usage": True}} if client_asks else {}))
    assert _Scripted.asked == [True]  # the model server was asked for the usage, by the gateway or client
    newline = b"\r\n" if split == "crlf" else b"\n"
    # a client that asked gets the model server's stream as sent; one that did not, the stream without
    # the usage chunk and the "usage": null members
    want = b"".join(pieces(stream_events(include_usage=client_asks, newline=newline), split))
    assert got == want
    # and is charged what the model server reported in it
    assert wait_charged(rs.config, TENANT, SCRIPTED, before) == (PROMPT_TOKENS, COMPLETION_TOKENS)
