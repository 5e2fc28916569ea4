"""ext_authz over real HTTP in-process: the check -> decision -> HTTP answer mapping (200 with routing headers
and body splices, refusals with their status and OpenAI JSON, 5xx as 403 + x-inferlb-status), keep-alive
and pipelined requests answered in order, and the bounds (body, headers, malformed HTTP)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import stat
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ext_authz.check import CheckRequest, CheckService, refused
from ext_authz.server import MAX_HEADER_BYTES, CheckServer
from ext_proc import handlers
from ext_proc.state import ExtProcState
from inferlb.adapters.unix_socket import UnixSocketError, unix_socket_open
from inferlb.config.schema import parse_config
from inferlb.errors import RequestError
from inferlb.request import headers as h
from inferlb.request.rewrite import BodySplice, apply_splices

CONFIG: dict[str, Any] = {
    "gateway": {"max_request_body_bytes": 4096},
    "ext_proc": {"protocol": "ext_authz", "account_responses": False},
    "models": [{"name": "llama-3.1-8b-instruct", "aliases": ["llama3"]}],
    "tenants": [
        {"name": "gold", "api_keys": ["sk-gold-0001"]},
        {"name": "tiny", "api_keys": ["sk-tiny-0001"], "requests_per_minute": 1},
    ],
}


def chat(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


def request(body: bytes, key: str = "sk-gold-0001", path: str = "/v1/chat/completions") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: authz\r\nauthorization: Bearer {key}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@pytest.fixture
async def server() -> AsyncIterator[tuple[CheckServer, int]]:
    srv = CheckServer(CheckService(ExtProcState(parse_config(CONFIG))))
    port = await srv.start("127.0.0.1", 0)
    yield srv, port
    await srv.close()


async def read_answers(reader: asyncio.StreamReader, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    out = []
    for _ in range(n):
        status_line = await asyncio.wait_for(reader.readline(), 5)
        status = int(status_line.split()[1])
        hdrs: dict[str, str] = {}
        while (line := await asyncio.wait_for(reader.readline(), 5)) != b"\r\n":
            k, _, v = line.decode().partition(":")
            hdrs[k.strip().lower()] = v.strip()
        body = await asyncio.wait_for(reader.readexactly(int(hdrs["content-length"])), 5)
        out.append((status, hdrs, body))
    return out


async def test_pipelined_checks_are_answered_in_order_on_one_connection(
    server: tuple[CheckServer, int],
) -> None:
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        request(chat("llama3")) + request(chat("nope")) + request(chat("llama3"), key="bad-key-0001")
    )
    await writer.drain()
    (ok, okh, _), (missing, _, missing_body), (bad, _, bad_body) = await read_answers(reader, 3)
    assert ok == 200
    assert okh[h.MODEL] == "llama-3.1-8b-instruct"
    assert okh[h.TENANT] == "gold"
    assert "content-length" in okh  # the answer's own, not the upstream's
    # the alias is renamed by splices Envoy's Lua filter applies to the client's body
    length, *fields = okh[h.BODY_SPLICE].split(";")
    assert int(length) == len(chat("llama3"))
    splices = tuple(
        BodySplice(offset=int(o), removed=int(r), inserted=urllib.parse.unquote_to_bytes(i))
        for o, r, i in (f.split(":") for f in fields)
    )
    assert json.loads(apply_splices(chat("llama3"), splices))["model"] == "llama-3.1-8b-instruct"
    assert missing == 404
    assert json.loads(missing_body)["error"]["code"] == "model_not_found"
    assert bad == 401
    assert json.loads(bad_body)["error"]["code"] == "invalid_api_key"
    writer.close()


async def test_a_quota_refusal_carries_retry_after(server: tuple[CheckServer, int]) -> None:
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request(chat("llama3"), key="sk-tiny-0001") * 2)
    await writer.drain()
    (first, _, _), (second, hdrs, body) = await read_answers(reader, 2)
    assert (first, second) == (200, 429)
    assert int(hdrs["retry-after"]) >= 1
    assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    writer.close()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (request(b"x" * 5000), 413),  # over gateway.max_request_body_bytes
        (b"POST /v1/chat/completions HTTP/1.1\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
    ],
)
async def test_bounds_and_malformed_http_answer_json_and_close(
    server: tuple[CheckServer, int], raw: bytes, status: int
) -> None:
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    [(got, hdrs, body)] = await read_answers(reader, 1)
    assert got == status
    assert hdrs["connection"] == "close"
    assert "error" in json.loads(body)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
    writer.close()


def test_a_5xx_refusal_is_sent_as_403_with_its_status_in_a_header() -> None:
    reply = handlers.refusal(
        RequestError(503, "busy", type="server_error", code="quota_backend_busy"), "inferlb_busy"
    )
    answer = refused(reply)
    assert answer.status == 403
    assert dict(answer.headers)[h.STATUS] == "503"
    assert answer.body == reply.body


def test_models_answers_let_the_request_through_to_the_routes() -> None:
    service = CheckService(ExtProcState(parse_config(CONFIG)))
    out = service.check(
        CheckRequest(
            method="GET", path="/v1/models", headers={"authorization": "Bearer sk-gold-0001"}, body=b""
        )
    )
    assert not isinstance(out, asyncio.Future)
    assert (out.status, out.headers, out.body) == (200, (), b"")


async def test_the_unix_socket_serves_checks_owner_only_and_is_removed_at_close(tmp_path: Path) -> None:
    path = str(tmp_path / "authz.sock")
    srv = CheckServer(CheckService(ExtProcState(parse_config(CONFIG))))
    await srv.start_unix(path)
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(request(chat("llama3")) + request(chat("nope")))
        await writer.drain()
        (ok, okh, _), (missing, _, _) = await read_answers(reader, 2)
        assert (ok, okh[h.MODEL], missing) == (200, "llama-3.1-8b-instruct", 404)
        writer.close()
        # a second server on the same live socket is refused, naming the field
        with pytest.raises(UnixSocketError, match=r"^ext_proc.listen_unix: .*another server is listening"):
            await CheckServer(srv.service).start_unix(path)
    finally:
        await srv.close()
    assert not unix_socket_open(path)
    with pytest.raises(FileNotFoundError):
        os.lstat(path)


async def test_a_stale_socket_file_is_replaced_and_a_missing_directory_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "authz.sock")
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(path)
    old.close()  # its file stays, nobody listens
    srv = CheckServer(CheckService(ExtProcState(parse_config(CONFIG))))
    await srv.start_unix(path)
    assert unix_socket_open(path)
    await srv.close()
    with pytest.raises(UnixSocketError, match="does not exist"):
        await CheckServer(srv.service).start_unix(str(tmp_path / "nowhere" / "s.sock"))


async def test_keys_known_by_digest_or_file_are_checked_over_http(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("sk-from-a-secret-01\n")
    doc = {
        **CONFIG,
        "tenants": [
            {"name": "hashed", "api_key_sha256": hashlib.sha256(b"sk-hashed-only-01").hexdigest()},
            {"name": "mounted", "api_key_file": str(tmp_path / "key")},
        ],
    }
    srv = CheckServer(CheckService(ExtProcState(parse_config(doc))))
    port = await srv.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            request(chat("llama3"), key="sk-hashed-only-01")
            + request(chat("llama3"), key="sk-from-a-secret-01")
            + request(chat("llama3"), key="sk-hashed-only-02")
        )
        await writer.drain()
        (a, ah, _), (b, bh, _), (bad, _, bad_body) = await read_answers(reader, 3)
        assert (a, ah[h.TENANT]) == (200, "hashed")
        assert (b, bh[h.TENANT]) == (200, "mounted")
        assert bad == 401
        assert json.loads(bad_body)["error"]["code"] == "invalid_api_key"
        writer.close()
    finally:
        await srv.close()


async def test_many_small_headers_count_their_wire_size(server: tuple[CheckServer, int]) -> None:
    """The 64 KiB bound is on the request line and headers as sent: each header's ``: `` and CRLF count
    too. Only names and values were counted, so ~16,500 one-letter headers (66 KB on the wire) passed as
    16.5 KB, and empty ones could carry 4x the bound."""
    _, port = server
    count = MAX_HEADER_BYTES // 4 + 100
    raw = b"POST /v1/chat/completions HTTP/1.1\r\n" + b"a:\r\n" * count + b"\r\n"
    assert len(raw) > MAX_HEADER_BYTES
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    [(got, _, body)] = await read_answers(reader, 1)
    assert got == 431, body
    writer.close()
