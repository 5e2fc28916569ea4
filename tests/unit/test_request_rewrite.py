"""The upstream request body rewrite: an alias replaced by the canonical model name and/or
``stream_options.include_usage`` set, in one pass, every other byte kept, valid JSON, None when nothing
changes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.request.rewrite import rewrite_request
from inferlb.request.usage import add_include_usage

CANONICAL = "llama-3.1-8b-instruct"
SPLICE = b'"stream_options":{"include_usage":true},'


def test_alias_is_replaced_and_every_other_byte_kept() -> None:
    body = (
        b' {\n  "messages" : [{"role":"user","content":"caf\\u00e9 \xc3\xa9"}],\t"model": "llama3" , "n":1.0}'
    )
    out = rewrite_request(body, model=CANONICAL)
    assert out is not None
    assert out.model_renamed and not out.include_usage_added
    assert out.body == body.replace(b'"llama3"', f'"{CANONICAL}"'.encode())
    assert json.loads(out.body) == {**json.loads(body), "model": CANONICAL}


def test_canonical_name_is_left_alone() -> None:
    body = json.dumps({"model": CANONICAL, "messages": []}).encode()
    assert rewrite_request(body, model=CANONICAL) is None
    # spelled with an escape it is still the same name to every JSON parser: no rewrite
    escaped = b'{"model":"llama-3.1-8b-instruc\\u0074","messages":[]}'
    assert rewrite_request(escaped, model=CANONICAL) is None


def test_nothing_asked_nothing_changed() -> None:
    body = b'{"model":"llama3","stream":true}'
    assert rewrite_request(body) is None
    assert rewrite_request(body, model=None, include_usage=False) is None


def test_escaped_alias_is_replaced_whole() -> None:
    body = b'{"model":"llama\\u0033","prompt":"x"}'
    out = rewrite_request(body, model=CANONICAL)
    assert out is not None
    assert out.body == f'{{"model":"{CANONICAL}","prompt":"x"}}'.encode()


def test_nested_model_members_and_model_text_in_strings_are_untouched() -> None:
    doc = {
        "messages": [{"role": "user", "content": 'say {"model": "llama3"}'}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"model": "llama3"}}}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"model": "llama3"}},
        },
        "model": "llama3",
    }
    body = json.dumps(doc).encode()
    out = rewrite_request(body, model=CANONICAL)
    assert out is not None
    assert json.loads(out.body) == {**doc, "model": CANONICAL}
    assert out.body == body.removesuffix(b'"llama3"}') + f'"{CANONICAL}"}}'.encode()


def test_every_duplicate_model_member_gets_the_canonical_name() -> None:
    body = b'{"model":"llama3","messages":[],"model":"llama-3.1-8b"}'
    out = rewrite_request(body, model=CANONICAL)
    assert out is not None
    assert out.body == f'{{"model":"{CANONICAL}","messages":[],"model":"{CANONICAL}"}}'.encode()


def test_both_rewrites_in_one_pass() -> None:
    body = b'{"model":"llama3","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    out = rewrite_request(body, model=CANONICAL, include_usage=True)
    assert out is not None
    assert out.model_renamed and out.include_usage_added
    # exactly the include_usage splice plus the model value, nothing else
    assert out.body == b"{" + SPLICE + body[1:].replace(b'"llama3"', f'"{CANONICAL}"'.encode())
    assert json.loads(out.body) == {
        **json.loads(body),
        "model": CANONICAL,
        "stream_options": {"include_usage": True},
    }


def test_include_usage_alone_is_the_same_splice_as_before() -> None:
    body = b'  {"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    out = rewrite_request(body, model="m", include_usage=True)
    assert out is not None
    assert not out.model_renamed and out.include_usage_added
    assert out.body == b"  {" + SPLICE + body[3:]
    assert add_include_usage(body) == out.body


@pytest.mark.parametrize(
    "options", [b"null", b'{"include_usage":false}', b'{ "continuous_usage_stats" : true }']
)
def test_existing_stream_options_value_alone_is_replaced(options: bytes) -> None:
    head, tail = b'{"model" : "llama3", "stream": true, "stream_options": ', b', "n": 2}'
    out = rewrite_request(head + options + tail, model=CANONICAL, include_usage=True)
    assert out is not None
    new_options = {**(json.loads(options) or {}), "include_usage": True}
    expected_head = head.replace(b'"llama3"', f'"{CANONICAL}"'.encode())
    assert out.body == expected_head + json.dumps(new_options, separators=(",", ":")).encode() + tail


def test_only_the_rename_when_the_stream_already_asks_for_usage() -> None:
    body = b'{"model":"llama3","stream":true,"stream_options":{"include_usage":true}}'
    out = rewrite_request(body, model=CANONICAL, include_usage=True)
    assert out is not None
    assert out.model_renamed and not out.include_usage_added
    assert out.body == body.replace(b'"llama3"', f'"{CANONICAL}"'.encode())


@pytest.mark.parametrize("stream", [b"false", b'"true"', None])
def test_include_usage_only_for_streams(stream: bytes | None) -> None:
    body = b'{"model":"m"' + (b',"stream":' + stream if stream is not None else b"") + b"}"
    assert rewrite_request(body, include_usage=True) is None
    out = rewrite_request(body, model="n", include_usage=True)
    assert out is not None
    assert not out.include_usage_added
    assert out.body == body.replace(b'"m"', b'"n"')


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_other_encodings_json_accepts_come_out_as_utf8(encoding: str) -> None:
    doc = {"model": "llama3", "messages": [{"role": "user", "content": "héllo 🙂"}]}
    out = rewrite_request(json.dumps(doc, ensure_ascii=False).encode(encoding), model=CANONICAL)
    assert out is not None
    assert out.body.decode("utf-8") == json.dumps({**doc, "model": CANONICAL}, ensure_ascii=False)


@pytest.mark.parametrize(
    "body",
    [b"[1]", b'"model"', b"{", b'{"model":"x",}', b'{"model" "x"}', b'{"model":"x"} {}', b'{"a":}', b""],
)
def test_not_a_json_object_is_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError, match=r"not a JSON object|Expecting|Extra data"):
        rewrite_request(body, model=CANONICAL, include_usage=True)


_WS = st.sampled_from(["", " ", "\n", "\t", "  \r\n"])
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@given(
    members=st.dictionaries(
        st.text(max_size=8).filter(lambda k: k not in ("model", "stream", "stream_options")),
        _JSON_VALUES,
        max_size=6,
    ),
    alias=st.text(min_size=1, max_size=20).filter(lambda a: a != CANONICAL),
    position=st.integers(min_value=0, max_value=6),
    stream=st.booleans(),
    ws=st.lists(_WS, min_size=4, max_size=4),
    ascii_only=st.booleans(),
)
def test_rewrite_keeps_every_other_byte_for_any_body(
    members: dict[str, Any], alias: str, position: int, stream: bool, ws: list[str], ascii_only: bool
) -> None:
    """Bodies of any members, order and whitespace: the output is the input with the model value (and, for a
    stream, the spliced ``stream_options``) changed and nothing else."""

    def dump(v: Any) -> str:
        return json.dumps(v, ensure_ascii=ascii_only)

    pairs = [f"{dump(k)}{ws[0]}:{ws[1]}{dump(v)}" for k, v in members.items()]
    if stream:
        pairs.append('"stream":true')
    at = min(position, len(pairs))
    before, after = pairs[:at], pairs[at:]

    def body_with(model_json: str, prefix: str = "") -> bytes:
        model_member = f'"model"{ws[0]}:{ws[1]}{model_json}'
        inner = f",{ws[2]}".join([*before, model_member, *after])
        return f"{ws[3]}{{{prefix}{ws[2]}{inner}{ws[3]}}}{ws[3]}".encode()

    body = body_with(dump(alias))
    out = rewrite_request(body, model=CANONICAL, include_usage=True)
    assert out is not None
    assert out.model_renamed
    assert out.include_usage_added is stream
    assert out.body == body_with(json.dumps(CANONICAL, ensure_ascii=False), SPLICE.decode() if stream else "")
    expected = {**members, "model": CANONICAL}
    if stream:
        expected |= {"stream": True, "stream_options": {"include_usage": True}}
    assert json.loads(out.body) == expected
    # and a body that already names the canonical model, not streaming, is left alone
    if not stream:
        assert rewrite_request(body_with(dump(CANONICAL)), model=CANONICAL, include_usage=True) is None
