"""ext_proc limits over real gRPC: bodies up to the configured limit fit the server's message size, and the
per-request processing budget answers before Envoy's message_timeout would."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from ext_proc.servicer import (
    MAX_CONFIGURABLE_BODY_BYTES,
    ExtProcState,
    RateLimitedLog,
    add_to_server,
    make_server,
)
from inferlb.config.schema import parse_config

FOUR_MIB = 4 * 1024 * 1024
CONFIG: dict[str, Any] = {
    "gateway": {"max_request_body_bytes": FOUR_MIB},
    "models": [{"name": "llama", "context_length": 32_768}],
    "tenants": [{"name": "gold", "api_keys": ["sk-gold-0001"]}],
}


def headers_msg(path: str) -> ep.ProcessingRequest:
    pairs = {":method": "POST", ":path": path, "authorization": "Bearer sk-gold-0001"}
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm))


def body_msg(body: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))


@pytest.fixture
async def stub() -> AsyncIterator[ep_grpc.ExternalProcessorStub]:
    server = make_server()
    add_to_server(server, ExtProcState(parse_config(CONFIG)))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    limit = MAX_CONFIGURABLE_BODY_BYTES * 2
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            yield ep_grpc.ExternalProcessorStub(channel)
    finally:
        await server.stop(None)


async def exchange(stub: ep_grpc.ExternalProcessorStub, path: str, body: bytes) -> ep.ProcessingResponse:
    call = stub.Process()
    try:
        await call.write(headers_msg(path))
        first = await asyncio.wait_for(call.read(), timeout=10)
        assert first is not grpc.aio.EOF and first.HasField("request_headers")
        await call.write(body_msg(body))
        resp = await asyncio.wait_for(call.read(), timeout=20)
        assert resp is not grpc.aio.EOF
        return resp  # type: ignore[no-any-return]
    finally:
        call.cancel()


def token_array_body(size: int) -> bytes:
    """A completions body of exactly ``size`` bytes whose prompt is a token array."""
    head = b'{"model":"llama","max_tokens":1,"prompt":[1'
    tail = b"]}"
    ones = (size - len(head) - len(tail)) // 2
    body = head + b",1" * ones + tail
    return body + b" " * (size - len(body))


async def test_a_body_just_under_the_4_mib_limit_reaches_the_handlers(
    stub: ep_grpc.ExternalProcessorStub,
) -> None:
    body = token_array_body(FOUR_MIB - 8)
    assert len(body) == FOUR_MIB - 8
    resp = await exchange(stub, "/v1/completions", body)
    # answered by the handlers (the prompt is ~2 M tokens), not refused by grpc's message size limit
    assert resp.HasField("immediate_response")
    error = json.loads(resp.immediate_response.body)["error"]
    assert resp.immediate_response.status.code == 400
    assert error["code"] == "context_length_exceeded"


async def serve_state(state: ExtProcState) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server = make_server()
    add_to_server(server, state)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    limit = MAX_CONFIGURABLE_BODY_BYTES * 2
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "llama", "messages": [{"role": "user", "content": text}]}).encode()


async def test_counting_over_its_budget_is_answered_413_before_envoys_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # message_timeout 100 ms -> a 60 ms counting budget; a ~3.6 MB prompt of short words takes longer here.
    # Every word differs, so no two 8 KiB segments are equal: equal segments would be counted once and then
    # served from the counter's count cache (inferlb.request.tokens.CountCache), which is not what this test
    # is about
    config = parse_config({**CONFIG, "ext_proc": {"message_timeout_ms": 100}})
    server, channel = await serve_state(ExtProcState(config))
    caplog.set_level(logging.INFO, logger="ext_proc")
    try:
        stub = ep_grpc.ExternalProcessorStub(channel)
        started = time.monotonic()
        prompt = " ".join(f"hi{i}," for i in range(400_000))
        resp = await exchange(stub, "/v1/chat/completions", chat_body(prompt))
        elapsed = time.monotonic() - started
    finally:
        await channel.close()
        await server.stop(None)
    assert resp.immediate_response.status.code == 413
    assert resp.immediate_response.details == "inferlb_counting_budget_exceeded"
    assert "time budget" in json.loads(resp.immediate_response.body)["error"]["message"]
    assert elapsed < 5.0  # bounded by the budget, not by the prompt (loose: 2 noisy cores)
    assert any("token counting exceeded" in r.getMessage() for r in caplog.records)


async def test_a_stream_envoy_gives_up_on_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    server, channel = await serve_state(ExtProcState(parse_config(CONFIG)))
    caplog.set_level(logging.INFO, logger="ext_proc")
    try:
        stub = ep_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await call.write(headers_msg("/v1/chat/completions"))
        assert (await asyncio.wait_for(call.read(), timeout=10)).HasField("request_headers")
        # a big body is counted in a worker thread; reset the stream before the answer, as Envoy does
        # when its message_timeout fires (distinct words: equal 8 KiB segments would be counted once and
        # then served from the count cache, answering before the reset)
        await call.write(body_msg(chat_body(" ".join(f"word{i}" for i in range(300_000)))))
        await asyncio.sleep(0.05)
        call.cancel()
        for _ in range(100):
            if any("ended before admission finished" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
    finally:
        await channel.close()
        await server.stop(None)
    (record,) = [r for r in caplog.records if "ended before admission finished" in r.getMessage()]
    assert record.levelno == logging.INFO
    assert "tenant gold" in record.getMessage() and " ms after its headers" in record.getMessage()


def test_rate_limited_log_holds_back_and_counts() -> None:
    now = [0.0]
    records: list[str] = []

    class _Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test_rate_limited_log")
    logger.addHandler(_Capture())
    logger.setLevel(logging.INFO)
    rl = RateLimitedLog(logger, interval_s=1.0, clock=lambda: now[0])
    assert rl.log(logging.INFO, "gave up %d", 1)
    assert not rl.log(logging.INFO, "gave up %d", 2)
    assert not rl.log(logging.INFO, "gave up %d", 3)
    now[0] = 1.5
    assert rl.log(logging.INFO, "gave up %d", 4)
    assert records == ["gave up 1", "gave up 4 (+2 more like it not logged)"]


async def test_an_allowed_non_inference_path_passes_through_headers_and_body() -> None:
    config = parse_config({**CONFIG, "ext_proc": {"non_inference_paths": "allow"}})
    server, channel = await serve_state(ExtProcState(config))
    try:
        stub = ep_grpc.ExternalProcessorStub(channel)
        resp = await exchange(stub, "/v1/files", b"--boundary\r\nnot json\r\n")
    finally:
        await channel.close()
        await server.stop(None)
    assert resp.HasField("request_body")
    assert not resp.request_body.response.HasField("body_mutation")
