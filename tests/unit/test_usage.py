"""Usage accounting: the include_usage request rewrite, SSE parsing under any chunking, JSON usage, counted
deltas, aborts, the usage-chunk strip, and exactly-once finish."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.request.tokens import default_counter
from inferlb.request.usage import (
    Reservation,
    ResponseMeter,
    SseMeter,
    UsageSource,
    add_include_usage,
    is_usage_only_event,
    without_null_usage,
)

COUNTER = default_counter()
RES = Reservation(prompt_tokens=20, reserved_tokens=20 + 100, stream=True)


def sse(*docs: dict[str, Any] | str, crlf: bool = False) -> bytes:
    nl = "\r\n" if crlf else "\n"
    out = []
    for d in docs:
        data = d if isinstance(d, str) else json.dumps(d, ensure_ascii=False)
        out.append(f"data: {data}{nl}{nl}")
    return "".join(out).encode()


def delta(text: str) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


USAGE_CHUNK = {
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {"prompt_tokens": 17, "completion_tokens": 3, "total_tokens": 20},
}
TEXTS = ["Hello", " wörld", " 你好", " 🙂"]
STREAM = sse(*(delta(t) for t in TEXTS), USAGE_CHUNK, "[DONE]")
STREAM_NO_USAGE = sse(*(delta(t) for t in TEXTS), "[DONE]")


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(data[prev:p])
        prev = p
    out.append(data[prev:])
    return out


def run(meter: ResponseMeter, chunks: list[bytes], *, aborted: bool = False) -> tuple[bytes, Any]:
    meter.on_headers(200, "text/event-stream; charset=utf-8")
    seen = b""
    for i, c in enumerate(chunks):
        seen += meter.on_body(c, end_of_stream=(not aborted and i == len(chunks) - 1))
    return seen, meter.finish(aborted=aborted)


# -- request rewrite ------------------------------------------------------------------------------
def test_include_usage_is_spliced_in_keeping_every_other_byte() -> None:
    body = b'  {"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    out = add_include_usage(body)
    assert out is not None
    assert json.loads(out) == {**json.loads(body), "stream_options": {"include_usage": True}}
    assert out.replace(b'"stream_options":{"include_usage":true},', b"") == body


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "stream": False},
        {"model": "m"},
        {"model": "m", "stream": True, "stream_options": {"include_usage": True}},
    ],
)
def test_no_rewrite_when_not_streaming_or_already_asked(body: dict[str, Any]) -> None:
    assert add_include_usage(json.dumps(body).encode()) is None


@pytest.mark.parametrize("options", [{"include_usage": False}, {"continuous_usage_stats": True}, None])
def test_existing_stream_options_are_kept_and_the_flag_set(options: dict[str, Any] | None) -> None:
    body = {"model": "m", "stream": True, "stream_options": options, "n": 2}
    out = add_include_usage(json.dumps(body).encode())
    assert out is not None
    doc = json.loads(out)
    assert doc["stream_options"]["include_usage"] is True
    for k, v in (options or {}).items():
        if k != "include_usage":
            assert doc["stream_options"][k] == v
    assert doc["n"] == 2


@given(
    st.dictionaries(st.text(min_size=1).filter(lambda k: k not in ("stream", "stream_options")), st.text())
)
def test_rewrite_is_valid_json_with_the_same_members(extra: dict[str, str]) -> None:
    body = json.dumps({**extra, "stream": True}, ensure_ascii=False).encode()
    out = add_include_usage(body)
    assert out is not None
    assert json.loads(out) == {**extra, "stream": True, "stream_options": {"include_usage": True}}


# -- SSE ------------------------------------------------------------------------------------------
def test_reported_usage_wins_and_the_stream_passes_through_untouched() -> None:
    seen, usage = run(ResponseMeter(RES, COUNTER), [STREAM])
    assert seen == STREAM
    assert usage.source is UsageSource.REPORTED
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (17, 3, 20)


def test_counted_deltas_without_a_usage_event() -> None:
    _, usage = run(ResponseMeter(RES, COUNTER), [STREAM_NO_USAGE])
    assert usage.source is UsageSource.COUNTED
    assert usage.prompt_tokens == RES.prompt_tokens
    assert usage.completion_tokens == sum(COUNTER.count(t) for t in TEXTS)


@settings(max_examples=200)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40), st.booleans(), st.booleans())
def test_any_chunking_gives_the_same_usage_and_bytes(cuts: list[int], crlf: bool, strip: bool) -> None:
    stream = sse(*(delta(t) for t in TEXTS), USAGE_CHUNK, "[DONE]", crlf=crlf)
    res = Reservation(prompt_tokens=20, reserved_tokens=120, stream=True, strip_usage_event=strip)
    whole_seen, whole = run(ResponseMeter(res, COUNTER), [stream])
    seen, usage = run(ResponseMeter(res, COUNTER), chunked(stream, cuts))
    assert usage == whole
    assert usage.total_tokens == 20
    assert seen == whole_seen
    if strip:
        assert b'"usage"' not in seen and seen.endswith(b"[DONE]" + (b"\r\n\r\n" if crlf else b"\n\n"))
    else:
        assert seen == stream


@settings(max_examples=100)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40))
def test_counted_deltas_are_chunking_independent(cuts: list[int]) -> None:
    _, whole = run(ResponseMeter(RES, COUNTER), [STREAM_NO_USAGE])
    _, usage = run(ResponseMeter(RES, COUNTER), chunked(STREAM_NO_USAGE, cuts))
    assert usage == whole


def test_strip_removes_only_the_usage_only_chunk() -> None:
    res = Reservation(prompt_tokens=20, reserved_tokens=120, stream=True, strip_usage_event=True)
    seen, usage = run(ResponseMeter(res, COUNTER), [STREAM])
    assert seen == sse(*(delta(t) for t in TEXTS), "[DONE]")
    assert usage.source is UsageSource.REPORTED


def with_null_usage(doc: dict[str, Any], at: int) -> dict[str, Any]:
    """``doc`` with ``"usage": None`` inserted as its ``at``-th member (as include_usage adds it)."""
    items = list(doc.items())
    items.insert(at % (len(items) + 1), ("usage", None))
    return dict(items)


@settings(max_examples=200)
@given(
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=40),
    st.lists(st.integers(0, 5), min_size=len(TEXTS), max_size=len(TEXTS)),
    st.booleans(),
    st.sampled_from([(",", ":"), (", ", ": ")]),
)
def test_a_gateway_added_usage_leaves_the_clients_chunks_as_they_were(
    cuts: list[int], where: list[int], crlf: bool, separators: tuple[str, str]
) -> None:
    """What the client gets is the stream it would have got without include_usage: no usage-only chunk,
    no ``"usage": null`` member, every other byte the model server's, however the body was chunked."""

    def dumps(d: dict[str, Any] | str) -> str:
        return d if isinstance(d, str) else json.dumps(d, ensure_ascii=False, separators=separators)

    def stream(docs: list[dict[str, Any] | str]) -> bytes:
        return sse(*(dumps(d) for d in docs), crlf=crlf)

    plain = [delta(t) for t in TEXTS]
    nulls = [with_null_usage(d, w) for d, w in zip(plain, where, strict=True)]
    served = stream([*nulls, USAGE_CHUNK, "[DONE]"])
    res = Reservation(prompt_tokens=20, reserved_tokens=120, stream=True, strip_usage_event=True)
    seen, usage = run(ResponseMeter(res, COUNTER), chunked(served, cuts))
    assert seen == stream([*plain, "[DONE]"])
    assert usage.source is UsageSource.REPORTED and usage.total_tokens == 20
    # a client that asked for usage gets every byte as served
    res = Reservation(prompt_tokens=20, reserved_tokens=120, stream=True, strip_usage_event=False)
    seen, _ = run(ResponseMeter(res, COUNTER), chunked(served, cuts))
    assert seen == served


def test_a_null_usage_quoted_in_the_text_is_the_models_and_stays() -> None:
    text = 'say ,"usage":null and "usage": null,'
    doc = with_null_usage(delta(text), 1)
    event = sse(doc)
    assert without_null_usage(event, doc) == sse(delta(text))
    assert json.loads(without_null_usage(event, doc)[6:])["choices"][0]["delta"]["content"] == text
    # a member that is not where the patterns look (here: no usage at all) leaves the event as it is
    assert without_null_usage(sse(delta(text)), {**delta(text), "usage": None}) == sse(delta(text))


def test_abort_charges_what_was_produced_and_only_complete_events() -> None:
    cut = STREAM_NO_USAGE.index(b"data:", len(sse(delta(TEXTS[0]), delta(TEXTS[1])))) + 12
    _, usage = run(ResponseMeter(RES, COUNTER), [STREAM_NO_USAGE[:cut]], aborted=True)
    assert usage.aborted
    assert usage.source is UsageSource.COUNTED
    assert usage.completion_tokens == COUNTER.count(TEXTS[0]) + COUNTER.count(TEXTS[1])


def test_finish_yields_usage_exactly_once() -> None:
    meter = ResponseMeter(RES, COUNTER)
    _, first = run(meter, [STREAM])
    assert first is not None
    assert meter.finish(aborted=True) is None
    assert meter.finish(aborted=False) is None


def test_continuous_usage_stats_last_running_total_wins() -> None:
    docs = [
        {**delta("a"), "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
        {**delta("b"), "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
    ]
    _, usage = run(ResponseMeter(RES, COUNTER), [sse(*docs)])
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 2)


def test_tool_call_and_reasoning_deltas_are_counted() -> None:
    doc = {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "content": None,
                    "reasoning_content": "think",
                    "tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": '{"c":'}}],
                },
            }
        ]
    }
    _, usage = run(ResponseMeter(RES, COUNTER), [sse(doc)])
    assert usage.completion_tokens == sum(COUNTER.count(t) for t in ("think", "get_weather", '{"c":'))


def test_comments_event_fields_multiline_data_and_garbage_do_not_break_counting() -> None:
    stream = (
        b": keep-alive\n\nevent: message\nid: 1\ndata: "
        + json.dumps(delta("x")).encode()
        + b"\n\ndata: {not json\n\ndata: [1,2]\n\n"
    )
    _, usage = run(ResponseMeter(RES, COUNTER), [stream])
    assert usage.completion_tokens == COUNTER.count("x")


def test_event_without_final_blank_line_is_counted_at_end_of_stream() -> None:
    stream = sse(delta("hello"))[:-1]
    meter = SseMeter(COUNTER)
    meter.feed(stream)
    meter.flush()
    assert meter.completion_tokens == COUNTER.count("hello")


def test_usage_only_event_shape() -> None:
    assert is_usage_only_event(USAGE_CHUNK)
    assert not is_usage_only_event({**delta("a"), "usage": None})
    assert not is_usage_only_event({"choices": [], "usage": None})


# -- JSON and statuses ----------------------------------------------------------------------------
def json_meter(body: bytes, chunks: int = 3, status: int = 200, **kw: Any) -> Any:
    meter = ResponseMeter(Reservation(prompt_tokens=20, reserved_tokens=120, stream=False), COUNTER, **kw)
    meter.on_headers(status, "application/json")
    step = max(1, len(body) // chunks)
    parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
    for i, p in enumerate(parts):
        assert meter.on_body(p, end_of_stream=i == len(parts) - 1) == p
    return meter.finish(aborted=False)


def test_json_usage_is_reported() -> None:
    body = json.dumps(
        {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    )
    usage = json_meter(body.encode())
    assert (usage.prompt_tokens, usage.completion_tokens, usage.source) == (9, 4, UsageSource.REPORTED)


def test_embeddings_usage_without_completion_tokens() -> None:
    usage = json_meter(json.dumps({"data": [], "usage": {"prompt_tokens": 7, "total_tokens": 7}}).encode())
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 0)


def test_json_without_usage_counts_the_choices() -> None:
    usage = json_meter(
        json.dumps({"choices": [{"message": {"content": "hello world"}}, {"text": "abc"}]}).encode()
    )
    assert usage.source is UsageSource.COUNTED
    assert usage.completion_tokens == COUNTER.count("hello world") + COUNTER.count("abc")


def test_json_too_large_or_broken_charges_the_reservation() -> None:
    big = json_meter(
        json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode(), max_json_bytes=10
    )
    assert (big.source, big.total_tokens) == (UsageSource.RESERVED, 120)
    broken = json_meter(b'{"choices": [')
    assert (broken.source, broken.total_tokens) == (UsageSource.RESERVED, 120)


@pytest.mark.parametrize("status", [400, 429, 500, 503])
def test_error_status_charges_nothing(status: int) -> None:
    usage = json_meter(b'{"error": {"message": "no"}}', status=status)
    assert (usage.source, usage.total_tokens) == (UsageSource.NONE, 0)


def test_abort_before_response_headers_charges_the_prompt() -> None:
    usage = ResponseMeter(RES, COUNTER).finish(aborted=True)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.aborted) == (20, 0, True)


def test_abort_before_a_non_streamed_answer_charges_the_reservation() -> None:
    # its generation runs before the first byte: what was produced cannot be seen, up to the whole cap
    res = Reservation(prompt_tokens=20, reserved_tokens=120, stream=False)
    usage = ResponseMeter(res, COUNTER).finish(aborted=True)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.source) == (20, 100, UsageSource.RESERVED)
    # a stream with no response that was not aborted (Envoy ended it cleanly) keeps the prompt-only charge
    clean = ResponseMeter(res, COUNTER).finish(aborted=False)
    assert clean is not None and (clean.prompt_tokens, clean.completion_tokens) == (20, 0)


def test_a_stream_cut_after_done_is_complete_not_aborted() -> None:
    meter = ResponseMeter(RES, COUNTER)
    meter.on_headers(200, "text/event-stream")
    meter.on_body(STREAM, end_of_stream=False)
    assert meter.complete
    usage = meter.finish(aborted=True)
    assert usage is not None and not usage.aborted and usage.total_tokens == 20
