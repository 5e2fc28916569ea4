"""ext_proc's ``mode_override`` answers over real gRPC: a non-2xx response is settled at its headers (charged
nothing, concurrency lease released) and Envoy is told to send no body; a 2xx response carries no override;
a let-through (non-inference) request tells Envoy to send nothing more of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from ext_proc.servicer import ExtProcState
from inferlb.policy.quota import MemoryQuotaStore
from tests.integration.test_ext_proc_accounting import serving

Mode = processing_mode_pb2.ProcessingMode
TPM = 1_000
CONFIG: dict[str, Any] = {
    "ext_proc": {"protocol": "ext_proc", "account_responses": True, "non_inference_paths": "allow"},
    "models": [{"name": "llama", "default_max_tokens": 100}],
    "tenants": [
        {
            "name": "metered",
            "api_keys": ["sk-metered-1"],
            "tokens_per_minute": TPM,
            "max_concurrent_requests": 1,
        }
    ],
}


def hmap(pairs: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )


def req_headers(
    path: str = "/v1/chat/completions", method: str = "POST", eos: bool = False
) -> ep.ProcessingRequest:
    pairs = {":method": method, ":path": path, "authorization": "Bearer sk-metered-1"}
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hmap(pairs), end_of_stream=eos))


def req_body() -> ep.ProcessingRequest:
    body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "hello"}]}).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))


def resp_headers(status: int) -> ep.ProcessingRequest:
    pairs = {":status": str(status), "content-type": "application/json"}
    return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hmap(pairs)))


@pytest.fixture
async def served() -> AsyncIterator[tuple[ep_grpc.ExternalProcessorStub, ExtProcState]]:
    async with serving(CONFIG) as hx:  # the quota clock frozen: nothing leaves the window
        yield hx.stub, hx.state


async def send(call: Any, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
    await call.write(msg)
    resp = await asyncio.wait_for(call.read(), timeout=10)
    assert resp is not grpc.aio.EOF
    return resp


def tokens_left(state: ExtProcState) -> float:
    assert isinstance(state.quotas, MemoryQuotaStore)
    _, tokens = state.quotas.book.available("metered", 1000.0)
    assert tokens is not None
    return tokens


async def test_a_non_2xx_response_is_settled_at_its_headers_and_its_body_is_not_asked_for(
    served: tuple[ep_grpc.ExternalProcessorStub, ExtProcState],
) -> None:
    stub, state = served
    call = stub.Process()
    await send(call, req_headers())
    admitted = await send(call, req_body())
    assert admitted.HasField("request_body")
    assert tokens_left(state) < TPM  # the reservation is held while the request is upstream
    answer = await send(call, resp_headers(503))
    assert answer.HasField("response_headers")
    assert answer.HasField("mode_override")  # NONE is the enum's 0: the field itself must be there
    assert answer.mode_override.response_body_mode == Mode.NONE
    assert answer.mode_override.response_trailer_mode == Mode.SKIP
    # settled before any body message and before the stream ends: nothing charged, lease released
    assert tokens_left(state) == TPM
    second = stub.Process()
    await send(second, req_headers())
    assert (await send(second, req_body())).HasField("request_body")  # max_concurrent_requests 1: admitted
    second.cancel()
    call.cancel()
    sample = state.metrics.registry.get_sample_value(
        "inferlb_requests_total", {"tenant": "metered", "model": "llama", "status": "503"}
    )
    assert sample == 1


async def test_a_2xx_response_carries_no_override(
    served: tuple[ep_grpc.ExternalProcessorStub, ExtProcState],
) -> None:
    stub, _ = served
    call = stub.Process()
    await send(call, req_headers())
    await send(call, req_body())
    answer = await send(call, resp_headers(200))
    assert answer.HasField("response_headers")
    assert not answer.HasField("mode_override")
    call.cancel()


async def test_a_let_through_request_asks_envoy_for_nothing_more(
    served: tuple[ep_grpc.ExternalProcessorStub, ExtProcState],
) -> None:
    stub, _ = served
    call = stub.Process()
    answer = await send(call, req_headers("/health", "GET", eos=True))
    assert answer.HasField("request_headers")
    assert answer.HasField("mode_override")
    mode = answer.mode_override
    assert (mode.request_body_mode, mode.response_header_mode, mode.response_body_mode) == (
        Mode.NONE,
        Mode.SKIP,
        Mode.NONE,
    )
    call.cancel()
