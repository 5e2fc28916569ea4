"""Usage of Responses API answers (``POST /v1/responses``): ``usage.input_tokens`` / ``output_tokens`` of a
JSON ``response`` body and of a stream's ``response.completed`` event, under any chunking; the counted
fallback from output items and text deltas; and chat/completions shapes left as they were."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.request.parsing import EndpointKind, parse_request
from inferlb.request.tokens import default_counter
from inferlb.request.usage import Reservation, ResponseMeter, Usage, UsageSource
from simulation.gpusim.replies import ResponseBuilder, typed_sse
from tests.unit.test_usage import chunked

COUNTER = default_counter()
STREAM_RES = Reservation(prompt_tokens=20, reserved_tokens=20 + 100, stream=True)
JSON_RES = Reservation(prompt_tokens=20, reserved_tokens=20 + 100, stream=False)
TEXTS = ["Hello", " wörld", " 你好", " 🙂"]


def event(kind: str, seq: int, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "sequence_number": seq, **fields}


def typed(*docs: dict[str, Any], crlf: bool = False) -> bytes:
    """Typed SSE as OpenAI sends it: an ``event:`` line, a ``data:`` line, a blank line."""
    nl = "\r\n" if crlf else "\n"
    return "".join(
        f"event: {d['type']}{nl}data: {json.dumps(d, ensure_ascii=False)}{nl}{nl}" for d in docs
    ).encode()


def response_obj(status: str, usage: dict[str, Any] | None, text: str = "") -> dict[str, Any]:
    output = (
        [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
        if text
        else []
    )
    return {"id": "resp_1", "object": "response", "status": status, "output": output, "usage": usage}


USAGE = {"input_tokens": 17, "output_tokens": 4, "total_tokens": 21}
OPENING = [
    event("response.created", 0, response=response_obj("in_progress", None)),
    event("response.in_progress", 1, response=response_obj("in_progress", None)),
]
DELTAS = [
    event("response.output_text.delta", 2 + i, item_id="msg_1", output_index=0, content_index=0, delta=t)
    for i, t in enumerate(TEXTS)
]
COMPLETED = event("response.completed", 6, response=response_obj("completed", USAGE, "".join(TEXTS)))
STREAM = typed(*OPENING, *DELTAS, COMPLETED)
STREAM_CUT = typed(*OPENING, *DELTAS)


def run_sse(chunks: list[bytes], *, aborted: bool = False) -> tuple[bytes, Usage | None, bool]:
    meter = ResponseMeter(STREAM_RES, COUNTER)
    meter.on_headers(200, "text/event-stream")
    seen = b""
    for i, c in enumerate(chunks):
        seen += meter.on_body(c, end_of_stream=(not aborted and i == len(chunks) - 1))
    complete = meter.complete
    return seen, meter.finish(aborted=aborted), complete


def run_json(body: bytes) -> Usage | None:
    meter = ResponseMeter(JSON_RES, COUNTER)
    meter.on_headers(200, "application/json")
    meter.on_body(body, end_of_stream=True)
    return meter.finish(aborted=False)


def test_the_completed_event_usage_is_reported_and_ends_the_stream() -> None:
    seen, usage, complete = run_sse([STREAM])
    assert seen == STREAM  # passed through untouched
    assert complete  # response.completed is the terminator: there is no [DONE]
    assert usage == Usage(prompt_tokens=17, completion_tokens=4, source=UsageSource.REPORTED)


@settings(max_examples=200)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40), st.booleans())
def test_any_chunking_gives_the_same_responses_usage_and_bytes(cuts: list[int], crlf: bool) -> None:
    stream = typed(*OPENING, *DELTAS, COMPLETED, crlf=crlf)
    whole_seen, whole, _ = run_sse([stream])
    seen, usage, complete = run_sse(chunked(stream, cuts))
    assert usage == whole
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (17, 4)
    assert seen == whole_seen == stream
    assert complete


@settings(max_examples=100)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40))
def test_a_cut_stream_counts_its_text_deltas_under_any_chunking(cuts: list[int]) -> None:
    _, whole, _ = run_sse([STREAM_CUT], aborted=True)
    _, usage, complete = run_sse(chunked(STREAM_CUT, cuts), aborted=True)
    assert not complete
    assert usage == whole
    assert usage is not None
    assert usage.source is UsageSource.COUNTED and usage.aborted
    assert usage.prompt_tokens == STREAM_RES.prompt_tokens
    assert usage.completion_tokens == sum(COUNTER.count(t) for t in TEXTS)


def test_incomplete_and_failed_terminal_events_report_their_usage() -> None:
    incomplete = event("response.incomplete", 6, response=response_obj("incomplete", USAGE))
    _, usage, complete = run_sse([typed(*OPENING, *DELTAS, incomplete)])
    assert complete and usage is not None and usage.source is UsageSource.REPORTED
    assert (usage.prompt_tokens, usage.completion_tokens) == (17, 4)
    failed = event("response.failed", 3, response=response_obj("failed", None))
    _, usage, complete = run_sse([typed(*OPENING, DELTAS[0], failed)])
    assert complete and usage is not None and usage.source is UsageSource.COUNTED
    assert usage.completion_tokens == COUNTER.count(TEXTS[0])


def test_tool_argument_and_reasoning_deltas_count_but_other_events_do_not() -> None:
    events = [
        *OPENING,
        event("response.function_call_arguments.delta", 2, item_id="fc_1", output_index=0, delta='{"a": 1}'),
        event("response.reasoning_text.delta", 3, item_id="rs_1", output_index=1, delta="thinking"),
        # the full text again in a .done event must not be counted twice
        event("response.output_text.done", 4, item_id="msg_1", output_index=2, text="not again"),
        event("response.audio.delta", 5, delta="QUJDRA=="),  # base64 audio is not text
    ]
    _, usage, _ = run_sse([typed(*events)], aborted=True)
    assert usage is not None
    assert usage.completion_tokens == COUNTER.count('{"a": 1}') + COUNTER.count("thinking")


def test_a_json_response_body_reports_input_and_output_tokens() -> None:
    body = json.dumps(response_obj("completed", USAGE, "".join(TEXTS))).encode()
    assert run_json(body) == Usage(prompt_tokens=17, completion_tokens=4, source=UsageSource.REPORTED)


def test_a_json_response_body_without_usage_counts_its_output_items() -> None:
    doc = response_obj("completed", None, "".join(TEXTS))
    doc["output"].append({"type": "function_call", "name": "f", "arguments": '{"x": 2}'})
    usage = run_json(json.dumps(doc).encode())
    assert usage is not None and usage.source is UsageSource.COUNTED
    assert usage.prompt_tokens == JSON_RES.prompt_tokens
    assert usage.completion_tokens == COUNTER.count("".join(TEXTS)) + COUNTER.count('{"x": 2}')


def test_invalid_responses_usage_is_not_reported() -> None:
    for bad in ({"input_tokens": -1, "output_tokens": 2}, {"input_tokens": 3}, {"input_tokens": True}):
        usage = run_json(json.dumps(response_obj("completed", bad, "hi")).encode())
        assert usage is not None and usage.source is UsageSource.COUNTED


def test_chat_usage_keeps_its_meaning_when_both_vocabularies_appear() -> None:
    # prompt_tokens present: the chat/completions reading wins, as before this change
    doc = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6, "input_tokens": 99}}
    usage = run_json(json.dumps(doc).encode())
    assert usage == Usage(prompt_tokens=5, completion_tokens=6, source=UsageSource.REPORTED)


def test_the_simulators_stream_is_metered_to_its_usage() -> None:
    req = parse_request(EndpointKind.RESPONSES, b'{"model": "m", "input": "hi", "max_output_tokens": 7}')
    builder = ResponseBuilder(req, request_id="abc", created_at=0)
    events = [
        *builder.opening_events(),
        *builder.delta_events(0, 3),
        *builder.delta_events(3, 7),
        *builder.closing_events(input_tokens=12, output_tokens=7),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    stream = b"".join(typed_sse(e) for e in events)
    _, usage, complete = run_sse([stream])
    assert complete
    assert usage == Usage(prompt_tokens=12, completion_tokens=7, source=UsageSource.REPORTED)
    # cut before response.completed, the text deltas still count to the same 7 tokens
    cut = b"".join(typed_sse(e) for e in events[:-1])
    _, counted, _ = run_sse([cut], aborted=True)
    assert counted is not None and (counted.source, counted.completion_tokens) == (UsageSource.COUNTED, 7)
