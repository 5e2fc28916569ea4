"""The simulated GPU server's ``POST /v1/responses`` over real HTTP on loopback: the ``response`` object and
its typed event stream, exact usage (the gateway's prompt count), errors, the metrics, the ``openai`` SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from simulation.gpusim import replies
from simulation.gpusim.server import SimulatedEndpoint
from tests.integration.test_gpusim_server import (
    ALIAS,
    DEFAULT_MAX_TOKENS,
    MODEL,
    assert_stamped,
    gateway_count,
    make_config,
    metric,
    scrape,
    serving,
)

REQUEST: dict[str, Any] = {
    "model": MODEL,
    "instructions": "Be brief.",
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hi to the GPU."}]}],
}
PROMPT_TOKENS = gateway_count("/v1/responses", REQUEST)


@pytest.fixture
async def v100() -> AsyncIterator[tuple[SimulatedEndpoint, str]]:
    async with serving(make_config(), "v100-test") as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def typed_events(raw: str) -> list[dict[str, Any]]:
    """Parse a typed SSE body (``event:`` then ``data:`` per event); checks the two names agree."""
    assert raw.endswith("\n\n")
    out: list[dict[str, Any]] = []
    for block in raw.split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: "), block
        doc = json.loads(data_line.removeprefix("data: "))
        assert doc["type"] == event_line.removeprefix("event: ")
        out.append(doc)
    return out


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


async def test_a_response_body_has_one_message_and_exact_usage(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    async with http.post(f"{url}/v1/responses", json={**REQUEST, "max_output_tokens": 5}) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        assert_stamped(resp)
        body = await resp.json()
    assert body["object"] == "response" and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["id"].startswith("resp_") and body["model"] == MODEL
    [item] = body["output"]
    assert (item["type"], item["role"]) == ("message", "assistant")
    assert output_text(body) == replies.completion_text(5)
    assert body["usage"]["input_tokens"] == PROMPT_TOKENS
    assert body["usage"]["output_tokens"] == 5
    assert body["usage"]["total_tokens"] == PROMPT_TOKENS + 5


async def test_without_max_output_tokens_the_model_default_is_generated(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    async with http.post(f"{url}/v1/responses", json={"model": ALIAS, "input": "hello"}) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["model"] == ALIAS
    assert body["usage"]["output_tokens"] == DEFAULT_MAX_TOKENS
    assert body["usage"]["input_tokens"] == gateway_count("/v1/responses", {"model": ALIAS, "input": "hello"})


async def test_a_stream_is_typed_events_one_delta_per_token_then_completed_with_usage(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    payload = {**REQUEST, "max_output_tokens": 7, "stream": True}
    async with http.post(f"{url}/v1/responses", json=payload) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        assert_stamped(resp)
        raw = await resp.text()
    assert "[DONE]" not in raw
    events = typed_events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["usage"] is None
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [replies.token_text(i) for i in range(7)]
    assert kinds.index("response.output_text.delta") > kinds.index("response.content_part.added")
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["id"] == events[0]["response"]["id"]
    assert output_text(final) == "".join(deltas)
    assert final["usage"]["input_tokens"] == PROMPT_TOKENS
    assert final["usage"]["output_tokens"] == 7
    assert final["usage"]["total_tokens"] == PROMPT_TOKENS + 7


async def test_errors_name_the_responses_fields(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    async with http.post(f"{url}/v1/responses", json={"model": MODEL}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "input"
    async with http.post(f"{url}/v1/responses", json={**REQUEST, "max_output_tokens": 600}) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", "input")
    async with http.post(f"{url}/v1/responses", json={**REQUEST, "model": "other"}) as resp:
        assert resp.status == 404
        assert_stamped(resp)


async def test_responses_are_timed_and_counted_in_the_same_metrics(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    before = await scrape(http, url)
    async with http.post(f"{url}/v1/responses", json={**REQUEST, "max_output_tokens": 4}) as resp:
        assert resp.status == 200
    async with http.post(
        f"{url}/v1/responses", json={**REQUEST, "max_output_tokens": 3, "stream": True}
    ) as resp:
        assert resp.status == 200
        await resp.read()
    after = await scrape(http, url)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("gpusim:requests_received_total") == 2.0
    assert grew("vllm:request_success_total", finished_reason="length") == 2.0
    assert grew("vllm:prompt_tokens_total") == 2 * PROMPT_TOKENS
    assert grew("vllm:generation_tokens_total") == 7.0
    assert grew("vllm:time_to_first_token_seconds_count") == 2.0
    assert grew("vllm:e2e_request_latency_seconds_sum") > 0.0


async def test_the_openai_sdk_creates_responses_streamed_and_not(v100: tuple[SimulatedEndpoint, str]) -> None:
    _, url = v100
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as client:
        response = await client.responses.create(model=MODEL, input="Hi!", max_output_tokens=4)
        assert response.status == "incomplete"
        assert response.output_text == replies.completion_text(4)
        assert response.usage is not None
        hi = {"model": MODEL, "input": "Hi!"}
        assert (response.usage.input_tokens, response.usage.output_tokens) == (
            gateway_count("/v1/responses", hi),
            4,
        )
        stream = await client.responses.create(model=MODEL, input="Hi!", max_output_tokens=3, stream=True)
        text: list[str] = []
        completed = None
        async for ev in stream:
            if ev.type == "response.output_text.delta":
                text.append(ev.delta)
            elif ev.type == "response.incomplete":
                completed = ev.response
        assert "".join(text) == replies.completion_text(3)
        assert completed is not None and completed.usage is not None
        assert completed.output_text == "".join(text)
        assert (
            completed.usage.input_tokens,
            completed.usage.output_tokens,
            completed.usage.total_tokens,
        ) == (
            gateway_count("/v1/responses", hi),
            3,
            gateway_count("/v1/responses", hi) + 3,
        )
