"""Prompt token counting: the cookbook chat formula, exact token-array counts, images, offline encoding."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import tiktoken.load
import tiktoken.registry
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.request.parsing import EndpointKind, parse_request
from inferlb.request.tokens import (
    IMAGE_TOKENS_DEFAULT,
    IMAGE_TOKENS_LOW,
    LONG_RUN_CHUNK_CHARS,
    OFFLINE_ENCODING,
    REPLY_PRIMING_TOKENS,
    SEGMENT_CHARS,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    CountingBudgetExceededError,
    count_each_prompt,
    count_prompt_tokens,
    count_text,
    default_counter,
    make_counter,
    min_text_tokens,
    offline_encoding,
    text_segments,
)

ENC = offline_encoding()


def chat(messages: list[dict[str, Any]], **extra: Any) -> int:
    return count_prompt_tokens(
        parse_request(
            EndpointKind.CHAT_COMPLETIONS, json.dumps({"model": "m", "messages": messages, **extra}).encode()
        )
    )


def cookbook(messages: list[dict[str, str]]) -> int:
    """num_tokens_from_messages of OpenAI's cookbook ("How to count tokens with tiktoken"), gpt-4-0613."""
    n = 0
    for m in messages:
        n += 3
        for key, value in m.items():
            n += len(ENC.encode(value))
            if key == "name":
                n += 1
    return n + 3


# The cookbook's own example conversation; its notebook prints 129 prompt tokens for gpt-3.5-turbo-0613 and
# gpt-4 (cl100k_base), matching the API's usage.prompt_tokens.
COOKBOOK_EXAMPLE = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate "
        "jargon into plain English.",
    },
    {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch "
        "base on opportunities for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client deliverable.",
    },
]


def test_offline_encoding_is_cl100k_and_cached() -> None:
    assert ENC.name == OFFLINE_ENCODING
    assert offline_encoding() is ENC
    assert default_counter() is default_counter()
    # cl100k_base reference ids for "hello world" (tiktoken README example family)
    assert ENC.encode("hello world") == [15339, 1917]
    assert ENC.n_vocab == 100277


def test_cookbook_example_counts_129() -> None:
    assert chat(COOKBOOK_EXAMPLE) == 129
    assert cookbook(COOKBOOK_EXAMPLE) == 129


def test_single_message_formula_by_hand() -> None:
    # 3 (priming) + 3 (message) + tokens("user") + tokens("hello world")
    assert chat([{"role": "user", "content": "hello world"}]) == 3 + 3 + 1 + 2
    assert REPLY_PRIMING_TOKENS == TOKENS_PER_MESSAGE == 3
    assert TOKENS_PER_NAME == 1


simple_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=60)},
    optional={"name": st.from_regex(r"[A-Za-z0-9_]{1,12}", fullmatch=True)},
)


@given(st.lists(simple_message, min_size=1, max_size=6))
def test_chat_matches_cookbook_formula(messages: list[dict[str, str]]) -> None:
    # the cookbook encodes with tiktoken's default special-token check, which refuses "<|endoftext|>";
    # hypothesis text never contains it at these sizes, and our counter treats it as text anyway
    assert chat(messages) == cookbook(messages)


def test_special_token_text_is_counted_not_refused() -> None:
    n = default_counter().count("<|endoftext|>")
    assert n == len(ENC.encode_ordinary("<|endoftext|>")) > 1


def test_lone_surrogate_is_counted() -> None:
    assert default_counter().count("\ud800abc") >= 1


def test_content_parts_and_images() -> None:
    parts = [
        {"type": "text", "text": "describe"},
        {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "https://x/b.png"}},
        {"type": "image_url", "image_url": {"url": "https://x/c.png", "detail": "high"}},
    ]
    base = chat([{"role": "user", "content": "describe"}])
    assert chat([{"role": "user", "content": parts}]) == base + IMAGE_TOKENS_LOW + 2 * IMAGE_TOKENS_DEFAULT
    assert (IMAGE_TOKENS_LOW, IMAGE_TOKENS_DEFAULT) == (85, 85 + 4 * 170)


def test_tool_calls_and_tools_are_counted() -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    }
    without = chat([{"role": "user", "content": "hi"}])
    with_call = chat([{"role": "user", "content": "hi"}, call])
    assert with_call == without + 3 + len(ENC.encode("assistant")) + len(ENC.encode("get_weather")) + len(
        ENC.encode('{"city":"Paris"}')
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    tools_json = json.dumps(tools, separators=(",", ":"))
    assert chat([{"role": "user", "content": "hi"}], tools=tools) == without + len(ENC.encode(tools_json))


token_array = st.lists(st.integers(min_value=0, max_value=100_000), min_size=1, max_size=50)


@given(st.one_of(token_array, st.lists(token_array, min_size=1, max_size=5)))
def test_token_array_prompts_count_exactly(prompt: list[Any]) -> None:
    for kind, field in ((EndpointKind.COMPLETIONS, "prompt"), (EndpointKind.EMBEDDINGS, "input")):
        r = parse_request(kind, json.dumps({"model": "m", field: prompt}).encode())
        expected = len(prompt) if isinstance(prompt[0], int) else sum(len(p) for p in prompt)
        assert count_prompt_tokens(r) == expected


@given(st.lists(st.text(max_size=80), min_size=1, max_size=4))
def test_text_prompts_count_with_the_encoding(prompts: list[str]) -> None:
    r = parse_request(EndpointKind.COMPLETIONS, json.dumps({"model": "m", "prompt": prompts}).encode())
    assert count_prompt_tokens(r) == sum(len(ENC.encode_ordinary(p)) for p in prompts)


prompt_item = st.one_of(st.text(max_size=40), token_array)


@given(
    st.sampled_from([EndpointKind.COMPLETIONS, EndpointKind.EMBEDDINGS]),
    st.lists(prompt_item, min_size=1, max_size=6),
)
def test_each_prompt_counts_in_order_and_sums_to_the_request_count(
    kind: EndpointKind, prompts: list[Any]
) -> None:
    field = "prompt" if kind is EndpointKind.COMPLETIONS else "input"
    r = parse_request(kind, json.dumps({"model": "m", field: prompts}).encode())
    each = count_each_prompt(r)
    assert each == tuple(len(p) if isinstance(p, list) else len(ENC.encode_ordinary(p)) for p in prompts)
    assert sum(each) == count_prompt_tokens(r)


def test_chat_has_no_separate_prompts() -> None:
    r = parse_request(
        EndpointKind.CHAT_COMPLETIONS, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    )
    assert count_each_prompt(r) == ()


def test_counting_never_downloads(monkeypatch: Any) -> None:
    # tiktoken fetches remote encodings through tiktoken.load.read_file; the offline one must not need it
    calls: list[str] = []

    def no_network(blobpath: str) -> bytes:
        calls.append(blobpath)
        if "://" in blobpath:
            raise AssertionError(f"tried to download {blobpath}")
        with open(blobpath, "rb") as f:
            return f.read()

    # an empty cache dir disables tiktoken's file cache, so the bundled file itself is read
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    enc = tiktoken.get_encoding(OFFLINE_ENCODING)
    assert enc.encode_ordinary("hello world") == [15339, 1917]
    assert len(calls) == 1
    assert calls[0].endswith("cl100k_base.tiktoken")


# -- bounded work per text: segments, long runs, floor, deadline ----------------------------------
_WORD = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Zs", "Cc")), min_size=1, max_size=12
)
# every separator ends in a clean cut (a space or a newline before the next word)
_SEP = st.sampled_from([" ", " ", " ", ", ", ". ", "\n", "  ", "\n\n", "\t ", " - ", ";\n", "\t\n"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_WORD, _SEP), min_size=1, max_size=200), st.integers(min_value=1, max_value=400))
def test_long_texts_with_spaces_count_exactly_like_tiktoken(
    pieces: list[tuple[str, str]], repeat: int
) -> None:
    text = "".join(w + s for w, s in pieces)
    text = text * max(1, (SEGMENT_CHARS * 2) // len(text) + 1) if repeat > 1 else text
    assert count_text(text, default_counter()) == len(ENC.encode_ordinary(text))
    # with tabs alone between words there is no clean cut: never fewer, never exact by construction
    tabbed = text.replace(" ", "\t").replace("\n", "\t")
    assert count_text(tabbed, default_counter()) >= len(ENC.encode_ordinary(tabbed))


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(
        [
            "abcdefghijklmnopqrstuvwxyz",
            "ab",
            "a",
            "ACGT",
            "你好世界中文文本",
            "!@#$%^&*()",
            "é漢字ß",
            "😀🎉",
            'abc\\u00e9\\n"',
        ]
    ),
    st.integers(min_value=SEGMENT_CHARS + 1, max_value=5 * SEGMENT_CHARS),
    st.integers(min_value=0, max_value=2**32),
)
def test_long_runs_never_count_fewer_than_tiktoken(alphabet: str, length: int, seed: int) -> None:
    rnd = random.Random(seed)
    text = "".join(rnd.choice(alphabet) for _ in range(length))
    counted = count_text(text, default_counter())
    assert counted >= len(ENC.encode_ordinary(text))
    assert counted >= min_text_tokens(text, default_counter())


def test_a_4_million_letter_word_is_counted_in_bounded_chunks() -> None:
    word = "a" * 4_190_000
    segments = list(text_segments(word))
    assert "".join(s for s, _ in segments) == word
    assert max(len(s) for s, _ in segments[:-1]) <= LONG_RUN_CHUNK_CHARS
    assert len(segments[-1][0]) <= SEGMENT_CHARS
    # a floor of 1 token per 128 characters, and at least that many counted
    assert count_text(word, default_counter()) >= min_text_tokens(word, default_counter()) == 32_735


def test_cl100k_longest_token_is_128_bytes() -> None:
    assert default_counter().max_token_bytes == 128


@given(st.text(max_size=3000))
def test_the_floor_never_exceeds_the_count(text: str) -> None:
    assert min_text_tokens(text, default_counter()) <= count_text(text, default_counter())


def test_counting_stops_at_its_deadline() -> None:
    text = "word " * (SEGMENT_CHARS * 3 // 5)
    with pytest.raises(CountingBudgetExceededError) as info:
        count_text("short", default_counter(), deadline=-1.0)
    assert info.value.counted_chars == 0
    ticks = iter(range(100))
    with pytest.raises(CountingBudgetExceededError) as info:
        # the clock passes the deadline after the first segment
        count_text(text, default_counter(), deadline=1.5, clock=lambda: float(next(ticks)))
    assert 0 < info.value.counted_chars < len(text)
    assert count_text(text, default_counter(), deadline=1e18) == len(ENC.encode_ordinary(text))


# -- tokenizers per model -------------------------------------------------------------------------
_ENGLISH = st.text(alphabet=st.characters(codec="ascii", categories=("L", "Zs", "P")), max_size=400)
_CODE = st.text(alphabet="abcdefXYZ_0123456789(){}[]<>=+-*/;:.,'\"\n\t    #!&|", max_size=400)
_CJK = st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), max_size=200)
_EMOJI = st.text(alphabet=st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), max_size=100)


@settings(max_examples=200)
@given(st.lists(st.one_of(_ENGLISH, _CODE, _CJK, _EMOJI, st.text(max_size=200)), max_size=6))
def test_the_estimate_never_counts_fewer_than_cl100k(parts: list[str]) -> None:
    estimate = make_counter("estimate")
    text = "".join(parts)
    # also as a JSON string literal: emoji and CJK as \\uXXXX escapes, quotes and newlines escaped
    for t in (text, json.dumps(text), json.dumps(text, ensure_ascii=False)):
        assert count_text(t, estimate) >= len(ENC.encode_ordinary(t))
        assert min_text_tokens(t, estimate) <= count_text(t, estimate)


def test_make_counter_specs() -> None:
    assert make_counter("tiktoken:cl100k_base") is default_counter()
    assert make_counter("estimate").count("héllo 😀") == len("héllo 😀".encode())
    for bad in ("tiktoken:o200k_base", "tiktoken:nope", "sentencepiece:x", "hf:"):
        with pytest.raises(ValueError, match="tokenizer"):
            make_counter(bad)


def test_hf_tokenizer_json_is_counted_by_tokenizers(tmp_path: Any) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    counter = make_counter(f"hf:{path}")
    assert counter.count("hello world hello zzz") == 4
    assert counter.max_token_bytes == 5


def test_hf_tokenizer_missing_file_is_a_clear_error(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        make_counter(f"hf:{tmp_path / 'missing.json'}")


def test_configured_image_tokens() -> None:
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "low"}}]}
    ]
    request = parse_request(
        EndpointKind.CHAT_COMPLETIONS, json.dumps({"model": "m", "messages": messages}).encode()
    )
    base = count_prompt_tokens(request)
    assert count_prompt_tokens(request, per_image=1000) == base - IMAGE_TOKENS_LOW + 1000
