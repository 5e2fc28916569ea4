"""The request body decoder (msgspec, the standard library's ``json`` where msgspec refuses) reads every body
as ``json.loads`` alone did: the same value, of the same types and key order, or the same 400 with the same
message."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferlb.errors import RequestError
from inferlb.request.parsing import EndpointKind, parse_json_body, parse_request

CHAT = EndpointKind.CHAT_COMPLETIONS


def stdlib_parse(body: bytes) -> dict[str, Any]:
    """The decoder as it was before msgspec: ``json.loads`` and its messages."""
    if not body.strip():
        raise RequestError(
            400, "The request body is empty; expected a JSON object.", type="invalid_request_error"
        )
    try:
        data = json.loads(body)
    except RecursionError:
        raise RequestError(
            400, "The request body is nested too deeply to parse.", type="invalid_request_error"
        ) from None
    except ValueError as exc:
        raise RequestError(
            400, f"We could not parse the JSON body of your request: {exc}", type="invalid_request_error"
        ) from None
    if not isinstance(data, dict):
        kind = {type(None): "null", list: "array", str: "string", bool: "boolean", int: "integer"}
        raise RequestError(
            400,
            f"The request body must be a JSON object, got {kind.get(type(data), 'number')}.",
            type="invalid_request_error",
        )
    return data


def typed(value: Any) -> Any:
    """``value`` with every leaf tagged by its type and every object by its key order, so that ``1``,
    ``1.0`` and ``True`` (equal in Python) and two key orders compare unequal; NaN as a tag."""
    if isinstance(value, dict):
        return ("object", [(k, typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("array", [typed(v) for v in value])
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    if isinstance(value, float):
        return ("float", repr(value))
    return (type(value).__name__, value)


def outcome(parse: Any, body: bytes) -> Any:
    try:
        return ("ok", typed(parse(body)))
    except RequestError as err:
        return ("refused", err.status, err.message, err.param, err.type)


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_value = st.recursive(
    json_leaf,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=400)
@given(st.dictionaries(st.text(max_size=8), json_value, max_size=6), st.booleans())
def test_every_json_object_reads_as_the_standard_library_reads_it(
    doc: dict[str, Any], ascii_only: bool
) -> None:
    body = json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert outcome(parse_json_body, body) == outcome(stdlib_parse, body)


@settings(max_examples=400)
@given(st.binary(max_size=120))
@example(b'{"max_tokens": 123456789012345678901234567890}')  # orjson would read a float here
@example(b'{"a": 1e400}')  # msgspec refuses a number beyond a double; json reads inf
@example(b'{"a": NaN, "b": -Infinity}')
@example(b'\xef\xbb\xbf{"a": 1}')  # a UTF-8 BOM: json reads it
@example('{"a": "\u00e9"}'.encode("utf-16"))  # json detects UTF-16
@example(b'{"a": "\\ud800"}')  # a lone surrogate escape
@example(b'{"a": "\xff"}')  # not UTF-8
@example(b'{"a": 1, "a": 2, "b": 3}')  # duplicate keys: the last value, the first place
@example(b'{"a": 1} trailing')
@example(b'{"a": "\x01"}')  # a raw control character
@example(b"[1, 2]")
@example(b"\t\r\n ")
@example(('{"a": ' + "9" * 4301 + "}").encode())  # past the interpreter's int digit limit
@example(b"{" * 100_000)
@example(b"[" * 2000 + b"]" * 2000)
def test_any_bytes_read_or_refused_as_the_standard_library_does(body: bytes) -> None:
    assert outcome(parse_json_body, body) == outcome(stdlib_parse, body)


@pytest.mark.parametrize(
    "text", ['{"a": 0.1}', '{"a": -0.0}', '{"a": 5e-324}', '{"a": 1.7976931348623157e308}']
)
def test_floats_are_the_same_doubles(text: str) -> None:
    assert outcome(parse_json_body, text.encode()) == outcome(stdlib_parse, text.encode())


def deep_body(where: str, depth: int) -> tuple[EndpointKind, bytes]:
    """A body whose tools, unknown content part or unknown input item nests ``depth`` arrays deep."""
    deep = "[" * depth + "]" * depth
    user = '{"role": "user", "content": "x"}'
    if where == "tools":
        return CHAT, f'{{"model": "m", "messages": [{user}], "tools": {deep}}}'.encode()
    if where == "part":
        part = f'{{"type": "input_audio", "x": {deep}}}'
        return CHAT, f'{{"model": "m", "messages": [{{"role": "user", "content": [{part}]}}]}}'.encode()
    item = f'{{"type": "reasoning", "x": {deep}}}'
    return EndpointKind.RESPONSES, f'{{"model": "m", "input": [{item}]}}'.encode()


def read_or_refused(kind: EndpointKind, body: bytes) -> int:
    """200 when the body parses, the status of its RequestError otherwise; anything else propagates."""
    try:
        parse_request(kind, body)
    except RequestError as err:
        return err.status
    return 200


@pytest.mark.parametrize("where", ["tools", "part", "item"])
def test_nesting_near_the_recursion_limit_is_read_or_refused_400(where: str) -> None:
    # the decoder's and the encoder's limits (unknown parts and tools are encoded again to be counted) both
    # come from the interpreter's recursion limit, a few levels apart: every depth across them is read or
    # refused 400, never an error of another kind
    limit = sys.getrecursionlimit()
    statuses = {read_or_refused(*deep_body(where, depth)) for depth in range(limit - 60, limit + 10)}
    assert statuses == {200, 400}
