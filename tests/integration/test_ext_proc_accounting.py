"""Usage accounting and quotas over real gRPC: a grpc aio ext_proc server on a free loopback port, driven
by a client that sends what Envoy sends with response headers SEND and response bodies STREAMED: request
headers, the buffered request body, response headers, response body chunks; and aborts (stream reset)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from prometheus_client import generate_latest

from ext_proc.servicer import RESET_WAIT_S, ExternalProcessor, ExtProcState, add_to_server
from inferlb.config.schema import parse_config
from inferlb.policy.quota import MemoryQuotaStore
from inferlb.request.tokens import default_counter
from tests.conftest import wait_until

TPM = 1_000
CONFIG: dict[str, Any] = {
    "ext_proc": {"protocol": "ext_proc", "account_responses": True},  # ext_proc meters on its own stream
    "models": [{"name": "llama", "default_max_tokens": 100}],
    "tenants": [
        {"name": "metered", "api_keys": ["sk-metered-1"], "tokens_per_minute": TPM},
        {"name": "narrow", "api_keys": ["sk-narrow-01"], "max_concurrent_requests": 2},
        {"name": "daily", "api_keys": ["sk-daily-001"], "daily_token_budget": 500},
    ],
}


def hmap(pairs: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )


def req_headers(key: str) -> ep.ProcessingRequest:
    pairs = {":method": "POST", ":path": "/v1/chat/completions", "authorization": f"Bearer {key}"}
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hmap(pairs)))


def req_body(body: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))


def resp_headers(status: int = 200, content_type: str = "text/event-stream") -> ep.ProcessingRequest:
    return ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=hmap({":status": str(status), "content-type": content_type}))
    )


def resp_body(chunk: bytes, eos: bool = False) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=eos))


def chat(stream: bool = False, **extra: Any) -> bytes:
    return json.dumps(
        {"model": "llama", "messages": [{"role": "user", "content": "hello"}], "stream": stream, **extra}
    ).encode()


def sse(*docs: dict[str, Any] | str) -> bytes:
    return b"".join(f"data: {d if isinstance(d, str) else json.dumps(d)}\n\n".encode() for d in docs)


def delta(text: str) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}}


@dataclass
class Harness:
    stub: ep_grpc.ExternalProcessorStub
    servicer: ExternalProcessor
    state: ExtProcState
    #: the in-process store's monotonic clock (s): frozen unless a test moves ``clock[0]``
    clock: list[float]

    @property
    def store(self) -> MemoryQuotaStore:
        assert isinstance(self.state.quotas, MemoryQuotaStore)
        return self.state.quotas

    async def send(self, call: Any, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        await call.write(msg)
        resp = await asyncio.wait_for(call.read(), timeout=10)
        assert resp is not grpc.aio.EOF
        return resp

    def metric(self, name: str, **labels: str) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def serving(
    config: dict[str, Any], quotas: Any = None, *, reset_wait_s: float = RESET_WAIT_S
) -> AsyncIterator[Harness]:
    """The real servicer over ``config`` (and ``quotas``, else the store the config names; waiting
    ``reset_wait_s`` for a reset after a stream's last answer) on a free loopback port, and a client to it.
    The monotonic clock is frozen unless a test moves it: nothing leaves the quota window during a test,
    so the quota bounds are exact. Settlements still running are waited for on exit."""
    clock = [1000.0]
    state = ExtProcState(parse_config(config), clock=lambda: clock[0], quotas=quotas)
    server = grpc.aio.server()
    servicer = add_to_server(server, state, reset_wait_s=reset_wait_s)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Harness(ep_grpc.ExternalProcessorStub(channel), servicer, state, clock)
    finally:
        await server.stop(None)
        await servicer.drain()


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with serving(CONFIG) as hx:
        yield hx


async def admit(hx: Harness, key: str, body: bytes) -> tuple[Any, ep.ProcessingResponse]:
    call = hx.stub.Process()
    await hx.send(call, req_headers(key))
    return call, await hx.send(call, req_body(body))


def tokens_left(hx: Harness, tenant: str = "metered") -> float:
    _, tokens = hx.store.book.available(tenant, 1000.0)
    assert tokens is not None
    return tokens


async def test_stream_gets_include_usage_with_its_content_length(harness: Harness) -> None:
    call, r = await admit(harness, "sk-metered-1", chat(stream=True))
    common = r.request_body.response
    new_body = common.body_mutation.body
    assert json.loads(new_body)["stream_options"] == {"include_usage": True}
    lengths = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
    assert lengths["content-length"] == str(len(new_body))
    call.cancel()


async def test_client_stream_with_include_usage_is_not_rewritten(harness: Harness) -> None:
    call, r = await admit(harness, "sk-metered-1", chat(stream=True, stream_options={"include_usage": True}))
    assert not r.request_body.response.HasField("body_mutation")
    call.cancel()


async def test_stream_settles_with_reported_usage_and_hides_the_added_usage_chunk(harness: Harness) -> None:
    hx = harness
    call, _ = await admit(hx, "sk-metered-1", chat(stream=True))
    reserved = TPM - tokens_left(hx)
    assert reserved > 100  # prompt + 100 default output tokens
    r = await hx.send(call, resp_headers())
    assert "content-length" in r.response_headers.response.header_mutation.remove_headers
    stream = sse(delta("Hi"), delta(" there"), USAGE, "[DONE]")
    split = stream.index(b'"usage"') + 3  # the usage event split across two chunks
    seen = b""
    for chunk, eos in ((stream[:split], False), (stream[split:], True)):
        r = await hx.send(call, resp_body(chunk, eos))
        mutated = r.response_body.response.HasField("body_mutation")
        seen += r.response_body.response.body_mutation.body if mutated else chunk
    call.cancel()
    assert seen == sse(delta("Hi"), delta(" there"), "[DONE]")
    assert tokens_left(hx) == TPM - 18  # the reservation was replaced by the reported 11 + 7
    assert hx.metric("inferlb_prompt_tokens_total", tenant="metered", model="llama") == 11
    assert hx.metric("inferlb_completion_tokens_total", tenant="metered", model="llama") == 7
    assert hx.metric("inferlb_requests_total", tenant="metered", model="llama", status="200") == 1
    assert hx.metric("inferlb_usage_settled_total", source="reported") == 1


async def test_json_response_settles_with_its_usage(harness: Harness) -> None:
    hx = harness
    call, _ = await admit(hx, "sk-metered-1", chat())
    await hx.send(call, resp_headers(content_type="application/json"))
    body = json.dumps({"choices": [{"message": {"content": "ok"}}], "usage": USAGE["usage"]}).encode()
    r1 = await hx.send(call, resp_body(body[:10]))
    r2 = await hx.send(call, resp_body(body[10:], eos=True))
    assert not r1.response_body.response.HasField("body_mutation")
    assert not r2.response_body.response.HasField("body_mutation")
    call.cancel()
    assert tokens_left(hx) == TPM - 18


async def test_abort_mid_stream_charges_what_was_produced_once(harness: Harness) -> None:
    hx = harness
    call, _ = await admit(hx, "sk-metered-1", chat(stream=True))
    await hx.send(call, resp_headers())
    await hx.send(call, resp_body(sse(delta("Hello"), delta(" world"))))
    call.cancel()  # the client went away: Envoy resets the ext_proc stream
    for _ in range(100):
        await hx.servicer.drain()
        if hx.metric("inferlb_requests_total", tenant="metered", model="llama", status="aborted"):
            break
        await asyncio.sleep(0.02)
    prompt = TPM - tokens_left(hx) - default_counter().count("Hello") - default_counter().count(" world")
    assert prompt > 0
    assert hx.metric("inferlb_usage_settled_total", source="counted") == 1
    assert hx.metric("inferlb_requests_total", tenant="metered", model="llama", status="aborted") == 1


async def test_upstream_error_charges_nothing(harness: Harness) -> None:
    hx = harness
    call, _ = await admit(hx, "sk-metered-1", chat())
    await hx.send(call, resp_headers(503, "application/json"))
    await hx.send(call, resp_body(b'{"error": {"message": "overloaded"}}', eos=True))
    call.cancel()
    assert tokens_left(hx) == TPM


async def test_concurrency_slot_is_held_until_the_response_ends(harness: Harness) -> None:
    hx = harness
    open_calls = []
    for _ in range(2):
        call, r = await admit(hx, "sk-narrow-01", chat())
        assert r.HasField("request_body")
        open_calls.append(call)
    third, r = await admit(hx, "sk-narrow-01", chat())
    assert r.immediate_response.status.code == 429
    assert json.loads(r.immediate_response.body)["error"]["code"] == "rate_limit_exceeded"
    assert hx.metric("inferlb_quota_rejections_total", tenant="narrow", limit="max_concurrent_requests") == 1
    third.cancel()
    # one response ends: its slot frees
    await hx.send(open_calls[0], resp_headers(200, "application/json"))
    await hx.send(
        open_calls[0], resp_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}', eos=True)
    )
    fourth, r = await admit(hx, "sk-narrow-01", chat())
    assert r.HasField("request_body")
    for c in (*open_calls, fourth):
        c.cancel()
    for _ in range(100):
        await hx.servicer.drain()
        if hx.store.book.in_flight("narrow") == 0:
            break
        await asyncio.sleep(0.02)
    assert hx.store.book.in_flight("narrow") == 0


async def test_concurrent_burst_never_admits_more_than_the_quota(harness: Harness) -> None:
    hx = harness
    body = chat(max_tokens=90)

    async def one() -> tuple[Any, bool]:
        call, r = await admit(hx, "sk-metered-1", body)
        return call, r.HasField("request_body")

    results = await asyncio.gather(*(one() for _ in range(40)))
    admitted = sum(ok for _, ok in results)
    reserved = TPM - tokens_left(hx)
    per_request = reserved / admitted
    assert admitted == int(TPM // per_request)  # as many as fit, and no more
    assert reserved <= TPM
    for call, _ in results:
        call.cancel()


async def test_reservation_takes_the_largest_output_cap(harness: Harness) -> None:
    hx = harness
    # max_completion_tokens is what vLLM applies, but a server may honour max_tokens: reserve the larger
    call, r = await admit(hx, "sk-metered-1", chat(max_completion_tokens=1, max_tokens=500))
    assert r.HasField("request_body")
    set_headers = r.request_body.response.header_mutation.set_headers
    prompt = int({o.header.key: o.header.raw_value.decode() for o in set_headers}["x-inferlb-prompt-tokens"])
    assert tokens_left(hx) == TPM - prompt - 500
    call.cancel()
    # a cap above the whole tokens-per-minute quota can never fit, whichever cap field carries it
    call, r = await admit(hx, "sk-metered-1", chat(max_completion_tokens=1, max_tokens=10_000))
    assert r.immediate_response.status.code == 429
    assert all(o.header.key != "retry-after" for o in r.immediate_response.headers.set_headers)
    assert "can never be admitted" in json.loads(r.immediate_response.body)["error"]["message"]
    call.cancel()


async def test_daily_budget_refuses_past_the_budget(harness: Harness) -> None:
    hx = harness
    calls = []
    ok = 0
    for _ in range(6):
        call, r = await admit(hx, "sk-daily-001", chat())  # ~108 tokens each of 500
        calls.append(call)
        ok += r.HasField("request_body")
        if r.HasField("immediate_response"):
            assert r.immediate_response.status.code == 429
            assert json.loads(r.immediate_response.body)["error"]["message"].startswith("Daily token budget")
    assert ok == 4
    for c in calls:
        c.cancel()


async def test_metrics_exposition_has_every_family(harness: Harness) -> None:
    text = generate_latest(harness.state.metrics.registry).decode()
    for name in (
        "inferlb_requests_total",
        "inferlb_prompt_tokens_total",
        "inferlb_completion_tokens_total",
        "inferlb_quota_rejections_total",
        "inferlb_ext_proc_processing_seconds_bucket",
    ):
        assert f"# TYPE {name.removesuffix('_total').removesuffix('_bucket')}" in text


async def test_stream_settles_at_done_even_without_an_end_of_stream_message(harness: Harness) -> None:
    # Envoy 1.40 was seen resetting the stream after the [DONE] chunk without a final end_of_stream body
    hx = harness
    call, _ = await admit(hx, "sk-metered-1", chat(stream=True, stream_options={"include_usage": True}))
    await hx.send(call, resp_headers())
    await hx.send(call, resp_body(sse(delta("Hi"), USAGE, "[DONE]")))
    assert tokens_left(hx) == TPM - 18  # settled already, before the reset
    call.cancel()
    await hx.servicer.drain()
    assert hx.metric("inferlb_requests_total", tenant="metered", model="llama", status="200") == 1
    assert hx.metric("inferlb_requests_total", tenant="metered", model="llama", status="aborted") == 0


async def test_without_response_accounting_the_reservation_is_the_charge() -> None:
    cfg = {**CONFIG, "ext_proc": {"protocol": "ext_proc", "account_responses": False}}
    async with serving(cfg) as hx:
        call, r = await admit(hx, "sk-metered-1", chat(stream=True))
        assert not r.request_body.response.HasField("body_mutation")  # no include_usage rewrite
        call.cancel()
        held = TPM - tokens_left(hx)
        assert held > 100  # prompt + 100: kept, not credited back at the stream's end
        # the concurrency slot is released at admission: nothing holds "narrow" slots
        calls = [(await admit(hx, "sk-narrow-01", chat()))[0] for _ in range(3)]
        assert hx.store.book.in_flight("narrow") == 0
        for c in calls:
            c.cancel()


# -- response headers: which body mode ext_proc asks for ------------------------------------------------
def sized_headers(content_type: str, length: str | None) -> ep.ProcessingRequest:
    pairs = {":status": "200", "content-type": content_type}
    if length is not None:
        pairs["content-length"] = length
    return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hmap(pairs)))


@pytest.mark.parametrize(
    ("stream", "content_type", "length", "buffered"),
    [
        (False, "application/json", "120", True),  # fits the buffer: one body message
        (False, "application/json", str(64 * 1024 * 1024), False),  # above the buffer: streamed
        (False, "application/json", None, False),  # unsized: streamed
        (True, "text/event-stream", None, False),  # SSE: streamed, chunk by chunk
    ],
)
async def test_response_headers_pick_the_body_mode(
    harness: Harness, stream: bool, content_type: str, length: str | None, buffered: bool
) -> None:
    hx = harness
    call, _ = await admit(hx, "sk-metered-1", chat(stream=stream))
    r = await hx.send(call, sized_headers(content_type, length))
    assert r.HasField("response_headers")
    mode = r.mode_override
    assert r.HasField("mode_override") is buffered
    if buffered:
        assert mode.response_body_mode == mode.BUFFERED
    body = json.dumps({"choices": [], "usage": USAGE["usage"]}).encode()
    await hx.send(call, resp_body(sse(USAGE, "[DONE]") if stream else body, eos=True))
    call.cancel()
    assert tokens_left(hx) == TPM - 18


@pytest.fixture
def stream_ends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """How each ``Process`` call of a server started after this fixture ended: ``returned`` (grpc then
    sends the final status) or ``cancelled`` (by the client's reset: grpc sends nothing)."""
    ends: list[str] = []
    process = ExternalProcessor.Process

    async def recorded(self: ExternalProcessor, request_iterator: Any, context: Any) -> None:
        try:
            await process(self, request_iterator, context)
        except asyncio.CancelledError:
            ends.append("cancelled")
            raise
        ends.append("returned")

    monkeypatch.setattr(ExternalProcessor, "Process", recorded)
    return ends


async def last_answer(hx: Harness, end: str) -> Any:
    """A stream through to the answer Envoy needs last: the response body's end_of_stream, the response
    trailers, or an immediate response (an unknown API key); the stream stays open on the client side."""
    if end == "refused":
        call = hx.stub.Process()
        r = await hx.send(call, req_headers("sk-unknown-0"))
        assert r.immediate_response.status.code == 401
        return call
    call, _ = await admit(hx, "sk-metered-1", chat(stream=True))
    await hx.send(call, resp_headers())
    await hx.send(call, resp_body(sse(delta("hi"))))  # not the last: the stream stays open
    if end == "body":
        await hx.send(call, resp_body(sse(USAGE, "[DONE]"), eos=True))
    else:
        await hx.send(call, resp_body(sse(USAGE, "[DONE]")))
        await call.write(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))
        assert (await asyncio.wait_for(call.read(), timeout=10)).HasField("response_trailers")
    assert tokens_left(hx) == TPM - 18  # settled with the last answer, not when the stream ends
    return call


@pytest.mark.parametrize("end", ["body", "trailers", "refused"])
async def test_after_its_last_answer_a_stream_waits_for_the_reset_and_sends_no_status(
    stream_ends: list[str], end: str
) -> None:
    """After the answer Envoy needs last the servicer reads no more (a read in flight when Envoy's reset
    lands leaks native memory in grpcio aio) and does not end the stream either: a final status sent
    while Envoy's reset is on its way fails on the reset stream, and grpcio aio leaks that batch. It waits
    for the reset, which cancels it with nothing in flight."""
    async with serving(CONFIG) as hx:
        call = await last_answer(hx, end)
        call.cancel()  # as Envoy does once it has its last answer
        await wait_until(lambda: bool(stream_ends), "the stream to end")
        assert stream_ends == ["cancelled"]
        assert await call.code() == grpc.StatusCode.CANCELLED


@pytest.mark.parametrize("end", ["body", "refused"])
async def test_a_client_that_never_resets_gets_ok_after_the_wait(stream_ends: list[str], end: str) -> None:
    async with serving(CONFIG, reset_wait_s=0.05) as hx:
        call = await last_answer(hx, end)
        # no done_writing, no cancel: the server ends the call once the wait is over
        assert await asyncio.wait_for(call.read(), timeout=10) is grpc.aio.EOF
        assert await asyncio.wait_for(call.code(), timeout=10) == grpc.StatusCode.OK
        assert stream_ends == ["returned"]
