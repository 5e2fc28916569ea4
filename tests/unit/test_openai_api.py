"""OpenAI request body parsing: every documented shape parses, every malformed body is a 400 RequestError."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.errors import RequestError
from inferlb.request.parsing import (
    MAX_N,
    EmbeddingEncoding,
    EndpointKind,
    ImageDetail,
    parse_request,
)

CHAT = EndpointKind.CHAT_COMPLETIONS
COMPLETIONS = EndpointKind.COMPLETIONS
EMBEDDINGS = EndpointKind.EMBEDDINGS


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def refused(kind: EndpointKind, raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(kind, raw)
    return info.value


# -- chat -----------------------------------------------------------------------------------------
def test_chat_string_content() -> None:
    r = parse_request(
        CHAT,
        body(
            {
                "model": "llama3",
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_tokens": 64,
                "n": 2,
                "stream": True,
                "user": "u-1",
            }
        ),
    )
    assert r.kind is CHAT
    assert r.model == "llama3"
    assert [m.role for m in r.messages] == ["system", "user"]
    assert r.messages[1].texts == ("hi",)
    assert (r.max_output_tokens, r.n, r.stream, r.user) == (64, 2, True, "u-1")
    assert r.output_token_cap(default_max_tokens=999) == 128


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    r = parse_request(
        CHAT,
        body(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 10,
                "max_completion_tokens": 20,
            }
        ),
    )
    assert r.max_output_tokens == 20


def test_chat_default_output_cap_from_model() -> None:
    r = parse_request(CHAT, body({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}))
    assert r.max_output_tokens is None
    assert r.output_token_cap(default_max_tokens=256) == 768


def test_chat_content_parts_images_and_unknown_parts() -> None:
    r = parse_request(
        CHAT,
        body(
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                            {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
                        ],
                    }
                ],
            }
        ),
    )
    (m,) = r.messages
    assert m.texts[0] == "what is this?"
    assert m.images == (ImageDetail.LOW, ImageDetail.AUTO)
    # the unknown part is kept as its JSON so it is counted, never dropped
    assert "input_audio" in m.texts[1]


def test_chat_tool_calls_with_null_content_and_tool_messages() -> None:
    r = parse_request(
        CHAT,
        body(
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "weather in Paris?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]},
                ],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "parameters": {"type": "object"}},
                    }
                ],
            }
        ),
    )
    assert r.messages[1].texts == ("get_weather", '{"city":"Paris"}')
    assert r.messages[2].texts == ("18C", "call_1")
    assert r.tools_json is not None
    assert "get_weather" in r.tools_json


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
        ),
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "x"}}],
                    }
                ],
            },
            "messages[0].content[0].image_url.detail",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]},
            "messages[0].tool_calls[0]",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": MAX_N + 1}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "user": 5}, "user"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
    ],
)
def test_chat_wrong_fields_name_the_param(payload: dict[str, Any], param: str) -> None:
    err = refused(CHAT, body(payload))
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.param == param


@pytest.mark.parametrize(
    "raw", [b"", b"   ", b"{", b"[1, 2]", b'"model"', b"null", b"\xff\xfe\x00garbage", b"{" * 100_000]
)
def test_malformed_or_non_object_bodies_are_400(raw: bytes) -> None:
    err = refused(CHAT, raw)
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.param is None


MSG = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("kind", "payload", "param"),
    [
        # OpenAI and vLLM need at least one output token
        (CHAT, {"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"model": "m", "messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"model": "m", "messages": MSG, "max_completion_tokens": 5, "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        # OpenAI refuses a number that is not an integer, 4.0 included
        (CHAT, {"model": "m", "messages": MSG, "max_tokens": 4.0}, "max_tokens"),
        (CHAT, {"model": "m", "messages": MSG, "n": 2.0}, "n"),
        (COMPLETIONS, {"model": "m", "prompt": "x", "best_of": 2.0}, "best_of"),
        (EMBEDDINGS, {"model": "m", "input": "x", "dimensions": 8.0}, "dimensions"),
        # a content part must be an object, not a bare string
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
        # the bad element of a token array is named by its own index
        (COMPLETIONS, {"model": "m", "prompt": [1, 2.5]}, "prompt[1]"),
        (COMPLETIONS, {"model": "m", "prompt": [1, 2, -3]}, "prompt[2]"),
        (COMPLETIONS, {"model": "m", "prompt": ["ok", [1, "x"]]}, "prompt[1][1]"),
        (COMPLETIONS, {"model": "m", "prompt": ["ok", []]}, "prompt[1]"),
        (EMBEDDINGS, {"model": "m", "input": [[5, 6], [7, True]]}, "input[1][1]"),
    ],
)
def test_model_server_refusals_are_refused_here(
    kind: EndpointKind, payload: dict[str, Any], param: str
) -> None:
    err = refused(kind, body(payload))
    assert err.status == 400
    assert err.param == param
    assert f"'{param}'" in err.message


def test_echoed_values_are_cut() -> None:
    err = refused(EMBEDDINGS, body({"model": "m", "input": "x", "encoding_format": "z" * 100_000}))
    assert len(err.message) < 400
    assert err.message.count("z") == 256
    assert "..." in err.message


# -- completions and embeddings -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "texts", "arrays"),
    [
        ("hello", ("hello",), ()),
        (["a", "b"], ("a", "b"), ()),
        ([1, 2, 3], (), (3,)),
        ([[1, 2], [3, 4, 5]], (), (2, 3)),
        (["a", [1, 2]], ("a",), (2,)),
    ],
)
def test_completion_prompt_shapes(prompt: Any, texts: tuple[str, ...], arrays: tuple[int, ...]) -> None:
    r = parse_request(COMPLETIONS, body({"model": "m", "prompt": prompt, "max_tokens": 5, "n": 2}))
    assert r.texts == texts
    assert r.token_array_lengths == arrays
    assert r.prompt_count == len(texts) + len(arrays)
    # n choices per prompt: the output cap covers every prompt of the batch
    assert r.output_token_cap(default_max_tokens=1) == 5 * 2 * r.prompt_count


def test_completion_best_of_raises_the_choice_count() -> None:
    r = parse_request(COMPLETIONS, body({"model": "m", "prompt": "x", "max_tokens": 4, "best_of": 3}))
    assert r.n == 3


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": 5}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt[1]"),
        ({"model": "m", "prompt": ["a", 3.5]}, "prompt[1]"),
        ({"model": "m", "prompt": ["a", []]}, "prompt[1]"),
    ],
)
def test_completion_wrong_prompts(payload: dict[str, Any], param: str) -> None:
    err = refused(COMPLETIONS, body(payload))
    assert (err.status, err.param) == (400, param)


@pytest.mark.parametrize(
    ("inp", "texts", "arrays"),
    [("x", ("x",), ()), (["x", "y"], ("x", "y"), ()), ([5, 6], (), (2,)), ([[5], [6, 7]], (), (1, 2))],
)
def test_embedding_input_shapes(inp: Any, texts: tuple[str, ...], arrays: tuple[int, ...]) -> None:
    r = parse_request(EMBEDDINGS, body({"model": "m", "input": inp, "max_tokens": 50}))
    assert (r.texts, r.token_array_lengths) == (texts, arrays)
    # embeddings generate nothing: no output reservation whatever the body says
    assert r.output_token_cap(default_max_tokens=256) == 0


def test_embedding_missing_input() -> None:
    assert refused(EMBEDDINGS, body({"model": "m"})).param == "input"


@pytest.mark.parametrize(
    ("field", "value", "prompts"),
    [
        ("prompt", "hi", ("hi",)),
        ("prompt", [4, 5], ((4, 5),)),
        ("prompt", ["a", [1, 2], "b"], ("a", (1, 2), "b")),
        ("input", [[7], [8, 9]], ((7,), (8, 9))),
    ],
)
def test_prompts_keep_request_order_and_token_ids(field: str, value: Any, prompts: tuple[Any, ...]) -> None:
    kind = COMPLETIONS if field == "prompt" else EMBEDDINGS
    r = parse_request(kind, body({"model": "m", field: value}))
    assert r.prompts == prompts
    assert r.prompt_count == len(prompts)
    assert r.texts == tuple(p for p in prompts if isinstance(p, str))
    assert r.token_array_lengths == tuple(len(p) for p in prompts if isinstance(p, tuple))


def test_chat_has_no_prompts() -> None:
    r = parse_request(CHAT, body({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    assert r.prompts == ()


@pytest.mark.parametrize("kind", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("extra", "include_usage"),
    [
        ({}, False),
        ({"stream": True}, False),
        ({"stream": True, "stream_options": None}, False),
        ({"stream": True, "stream_options": {}}, False),
        ({"stream": True, "stream_options": {"include_usage": False}}, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True),
        ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, True),
    ],
)
def test_include_usage_from_stream_options(
    kind: EndpointKind, extra: dict[str, Any], include_usage: bool
) -> None:
    payload: dict[str, Any] = {"model": "m", **extra}
    payload["messages" if kind is CHAT else "prompt"] = (
        [{"role": "user", "content": "x"}] if kind is CHAT else "x"
    )
    assert parse_request(kind, body(payload)).include_usage is include_usage


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"stream": True, "stream_options": "yes"}, "stream_options"),
        ({"stream": True, "stream_options": [True]}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ],
)
def test_bad_stream_options(extra: dict[str, Any], param: str) -> None:
    err = refused(CHAT, body({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)


def test_embedding_options() -> None:
    plain = parse_request(EMBEDDINGS, body({"model": "m", "input": "x"}))
    assert (plain.dimensions, plain.encoding_format) == (None, EmbeddingEncoding.FLOAT)
    r = parse_request(
        EMBEDDINGS, body({"model": "m", "input": "x", "dimensions": 256, "encoding_format": "base64"})
    )
    assert (r.dimensions, r.encoding_format) == (256, EmbeddingEncoding.BASE64)
    r = parse_request(EMBEDDINGS, body({"model": "m", "input": "x", "encoding_format": "float"}))
    assert r.encoding_format is EmbeddingEncoding.FLOAT


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": "256"}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"encoding_format": "int8"}, "encoding_format"),
        ({"encoding_format": 1}, "encoding_format"),
        ({"encoding_format": ["float"]}, "encoding_format"),
    ],
)
def test_bad_embedding_options(extra: dict[str, Any], param: str) -> None:
    err = refused(EMBEDDINGS, body({"model": "m", "input": "x", **extra}))
    assert (err.status, err.param) == (400, param)


# -- properties -----------------------------------------------------------------------------------
text = st.text(max_size=40)
token_array = st.lists(st.integers(min_value=0, max_value=100_255), min_size=1, max_size=20)
part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.builds(
        lambda d: {"type": "image_url", "image_url": {"url": "https://example.com/i.png", **d}},
        st.sampled_from([{}, {"detail": "low"}, {"detail": "high"}, {"detail": "auto"}]),
    ),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer"]),
        "content": st.one_of(text, st.lists(part, max_size=4)),
    },
    optional={"name": st.from_regex(r"[a-z_]{1,10}", fullmatch=True)},
)
optional_common = {
    "max_tokens": st.one_of(st.none(), st.integers(1, 100_000)),
    "n": st.integers(1, MAX_N),
    "stream": st.booleans(),
    "user": st.one_of(st.none(), text),
}
chat_body = st.fixed_dictionaries(
    {"model": st.text(min_size=1, max_size=20), "messages": st.lists(message, min_size=1, max_size=6)},
    optional={**optional_common, "max_completion_tokens": st.integers(1, 100_000)},
)
prompt = st.one_of(
    text, st.lists(text, min_size=1, max_size=4), token_array, st.lists(token_array, min_size=1, max_size=4)
)
completion_body = st.fixed_dictionaries(
    {"model": st.text(min_size=1, max_size=20), "prompt": prompt}, optional=optional_common
)


@given(chat_body)
def test_random_valid_chat_bodies_parse(payload: dict[str, Any]) -> None:
    r = parse_request(CHAT, body(payload))
    assert r.model == payload["model"]
    assert len(r.messages) == len(payload["messages"])
    expected_cap = payload.get("max_completion_tokens", payload.get("max_tokens"))
    assert r.max_output_tokens == expected_cap
    for m, src in zip(r.messages, payload["messages"], strict=True):
        content = src["content"]
        n_images = 0 if isinstance(content, str) else sum(p["type"] == "image_url" for p in content)
        assert len(m.images) == n_images
        assert m.name == src.get("name")


@given(completion_body)
def test_random_valid_completion_bodies_parse(payload: dict[str, Any]) -> None:
    r = parse_request(COMPLETIONS, body(payload))
    p = payload["prompt"]
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        assert r.token_array_lengths == (len(p),)
    elif isinstance(p, list):
        assert r.prompt_count == len(p)
        assert sum(r.token_array_lengths) == sum(len(x) for x in p if isinstance(x, list))


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=25,
)
# garbage shaped like a request: the right keys with values of any type, nested anywhere
request_like = st.dictionaries(
    st.sampled_from(
        [
            "model",
            "messages",
            "prompt",
            "input",
            "max_tokens",
            "max_completion_tokens",
            "n",
            "best_of",
            "stream",
            "user",
            "tools",
            "functions",
            "stream_options",
            "dimensions",
            "encoding_format",
        ]
    ),
    json_value,
)
message_like = st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls", "function_call", "tool_call_id"]), json_value
)


def _outcome(kind: EndpointKind, raw: bytes) -> RequestError | None:
    """None when the body parses, the RequestError when it is refused; anything else propagates."""
    try:
        parse_request(kind, raw)
    except RequestError as err:
        return err
    return None


@settings(max_examples=300)
@given(st.sampled_from(list(EndpointKind)), st.binary(max_size=200))
def test_random_bytes_raise_only_request_error(kind: EndpointKind, raw: bytes) -> None:
    err = _outcome(kind, raw)
    if err is not None:
        assert err.status == 400


@settings(max_examples=300)
@given(st.sampled_from(list(EndpointKind)), request_like, st.lists(message_like, max_size=3))
def test_random_request_shaped_json_raises_only_request_error(
    kind: EndpointKind, payload: dict[str, Any], messages: list[dict[str, Any]]
) -> None:
    if messages and kind is CHAT:
        payload = {**payload, "messages": messages}
    err = _outcome(kind, body(payload))
    if err is not None:
        assert err.status == 400
        assert err.type == "invalid_request_error"


# -- responses ------------------------------------------------------------------------------------
RESPONSES = EndpointKind.RESPONSES


def test_responses_string_input_with_instructions() -> None:
    r = parse_request(
        RESPONSES,
        body({"model": "m", "input": "Hi there", "instructions": "Be brief.", "max_output_tokens": 64}),
    )
    assert r.kind is RESPONSES and r.kind.is_conversation and r.kind.generates_tokens
    assert [(m.role, m.texts) for m in r.messages] == [("system", ("Be brief.",)), ("user", ("Hi there",))]
    assert r.max_output_tokens == 64
    assert r.output_token_cap(256) == 64


def test_responses_input_items() -> None:
    r = parse_request(
        RESPONSES,
        body(
            {
                "model": "m",
                "input": [
                    {"role": "user", "content": "plain"},
                    {
                        "type": "message",
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "look"},
                            {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"},
                            {"type": "input_audio_v9", "data": "AAAA"},
                        ],
                    },
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                    {"type": "reasoning", "summary": []},
                ],
                "tools": [{"type": "function", "name": "get_weather"}],
            }
        ),
    )
    assert [m.role for m in r.messages] == ["user", "user", "assistant", "tool", "assistant"]
    assert r.messages[1].texts[0] == "look" and r.messages[1].images == (ImageDetail.LOW,)
    assert r.messages[2].texts == ("get_weather", "{}", "c1")
    assert r.messages[3].texts == ("sunny",)
    assert r.unknown_parts == ("input_audio_v9", "reasoning")
    assert r.tools_json is not None and "get_weather" in r.tools_json
    assert r.max_output_tokens is None


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": 3}, "input"),
        ({"model": "m", "input": ["hi"]}, "input[0]"),
        ({"model": "m", "input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"model": "m", "input": [{"type": "function_call_output", "output": 1}]}, "input[0].output"),
        ({"model": "m", "input": "x", "instructions": 1}, "instructions"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "x", "max_output_tokens": 8.0}, "max_output_tokens"),
    ],
)
def test_responses_refusals(payload: dict[str, Any], param: str) -> None:
    assert refused(RESPONSES, body(payload)).param == param


def test_unknown_chat_part_types_are_counted_and_reported() -> None:
    part = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    r = parse_request(CHAT, body({"model": "m", "messages": [{"role": "user", "content": [part]}]}))
    assert r.unknown_parts == ("input_audio",)
    assert r.messages[0].texts == (json.dumps(part, separators=(",", ":")),)
