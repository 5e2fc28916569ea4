"""Exact token usage of one inference response, and the request rewrite that makes streams report it.

Pure: bytes in, values out; no clock, no I/O. The ext_proc servicer feeds each response chunk Envoy sends
(``STREAMED`` response bodies) into a :class:`ResponseMeter` and calls :meth:`ResponseMeter.finish` once, at
the end of the body, at the response trailers, or when the stream ends early (client abort, upstream reset).

Where the numbers come from, best first (:class:`UsageSource`):

1. ``REPORTED``: the model server's OpenAI ``usage`` object: the top-level ``usage`` of a JSON body, or the
   last non-null ``usage`` of an SSE stream (OpenAI sends it in a final chunk with empty ``choices`` when
   ``stream_options.include_usage`` is true; vLLM's ``continuous_usage_stats`` puts a running total on every
   chunk, so the last one wins). Responses API answers (``POST /v1/responses``) report ``usage`` as
   ``input_tokens`` / ``output_tokens`` (read as prompt / completion): at the top of a JSON ``response``
   body, and in a stream in the ``response`` object of its terminal event (``response.completed``, or
   ``response.incomplete`` / ``response.failed``); that event also ends the stream (Responses streams have
   no ``data: [DONE]``).
2. ``COUNTED``: no usage was reported (the stream was cut before its usage event, or the server does not
   report it): prompt tokens as counted at admission, completion tokens counted from what was produced:
   the text of each choice delta (``content``, ``reasoning_content``, ``refusal``, tool call names and
   arguments) of every complete SSE event, or the choices of a JSON body; for the Responses API the
   ``delta`` of its text, refusal, reasoning and tool-argument delta events, or the text of a JSON body's
   output items. Each event is counted on its own
   (vLLM sends about one token per event), so the count is the same however the bytes were chunked.
3. ``RESERVED``: a JSON body too large to keep (over ``max_json_bytes``) or not parseable: the admission
   reservation is charged as is (never less than the request could have used).
4. ``NONE``: the upstream answered with a non-2xx status: nothing was generated, nothing is charged.

SSE parsing follows the WHATWG server-sent events rules for the parts OpenAI-compatible servers use:
lines end in ``\\n`` or ``\\r\\n``, ``data:`` lines of one event are joined, a blank line ends the event,
``data: [DONE]`` is the terminator. Bytes are buffered until a line is complete, so a ``data:`` line
split across any chunk boundary (even inside a multi-byte UTF-8 character) parses the same.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import msgspec

from inferlb.request.rewrite import rewrite_request
from inferlb.request.tokens import TextTokenCounter

#: JSON bodies up to this size are kept to read their ``usage`` (bytes); larger ones charge the reservation.
MAX_JSON_BYTES: Final = 8 * 1024 * 1024
#: A single SSE line longer than this is not an OpenAI event; it is skipped, not buffered (bytes).
MAX_SSE_LINE_BYTES: Final = 4 * 1024 * 1024


class UsageSource(StrEnum):
    """Where a :class:`Usage` came from (see the module docstring)."""

    REPORTED = "reported"
    COUNTED = "counted"
    RESERVED = "reserved"
    NONE = "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class Usage:
    """Tokens one request used (OpenAI ``usage`` terms).

    Attributes:
        prompt_tokens: input tokens (tokens).
        completion_tokens: generated tokens over every choice (tokens).
        source: where the numbers came from.
        aborted: True when the response ended before its end of stream (client abort, upstream reset).
    """

    prompt_tokens: int
    completion_tokens: int
    source: UsageSource
    aborted: bool = False

    @property
    def total_tokens(self) -> int:
        """``prompt_tokens + completion_tokens`` (tokens): what the token quotas are charged."""
        return self.prompt_tokens + self.completion_tokens


# -- the request side -----------------------------------------------------------------------------
def add_include_usage(body: bytes) -> bytes | None:
    """The request body with ``stream_options.include_usage: true``, or None when it already asks for it or
    does not stream: :func:`inferlb.request.rewrite.rewrite_request` with only that change (ext_proc calls
    that function directly, so a model rename and this flag are one rewrite).

    A body without a ``stream_options`` member gets one spliced in right after its opening brace; a body
    with one has only that member's value replaced; every other byte is kept as the client sent it. The
    result is valid JSON; its length differs from the original, so the caller must set the upstream
    ``content-length`` to ``len(result)``.

    Raises:
        ValueError: ``body`` is not a JSON object (parse it with :func:`inferlb.request.parsing.parse_request`
            first: this function assumes a valid request).
    """
    rewritten = rewrite_request(body, include_usage=True)
    return None if rewritten is None else rewritten.body


# -- SSE ------------------------------------------------------------------------------------------
def _event_json(data: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _choice_texts(choice: Any) -> list[str]:
    """Generated text of one choice (a stream delta, a chat message, or a legacy completion choice)."""
    out: list[str] = []
    if not isinstance(choice, dict):
        return out
    text = choice.get("text")
    if isinstance(text, str):
        out.append(text)
    for key in ("delta", "message"):
        part = choice.get(key)
        if not isinstance(part, dict):
            continue
        for field in ("content", "reasoning_content", "refusal"):
            value = part.get(field)
            if isinstance(value, str):
                out.append(value)
        calls = part.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    out.extend(v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str))
        fn_call = part.get("function_call")
        if isinstance(fn_call, dict):
            out.extend(v for v in (fn_call.get("name"), fn_call.get("arguments")) if isinstance(v, str))
    return out


#: Responses API stream events whose ``delta`` is generated text (OpenAI API reference, "Streaming events").
_RESPONSES_TEXT_DELTAS: Final = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
    }
)
#: Responses API stream events that end a response; their ``response`` carries the final ``usage``.
_RESPONSES_TERMINAL: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _output_item_texts(item: Any) -> list[str]:
    """Generated text of one Responses API output item: message text and refusals, reasoning text, tool
    call arguments."""
    out: list[str] = []
    if not isinstance(item, dict):
        return out
    for key in ("arguments", "input"):  # function_call, custom_tool_call
        value = item.get(key)
        if isinstance(value, str):
            out.append(value)
    for key in ("content", "summary"):  # message and reasoning parts
        parts = item.get(key)
        if isinstance(parts, list):
            for part in parts:
                if isinstance(part, dict):
                    for field in ("text", "refusal"):
                        value = part.get(field)
                        if isinstance(value, str):
                            out.append(value)
    return out


def _reported(doc: dict[str, Any]) -> tuple[int, int] | None:
    """``(prompt, completion)`` of a ``usage`` member in chat/completions terms, or in Responses API terms
    (``input_tokens``, ``output_tokens``) when it has no ``prompt_tokens``; None when absent or invalid."""
    return usage_counts(doc.get("usage"))


def usage_counts(usage: object) -> tuple[int, int] | None:
    """``(prompt, completion)`` tokens of one OpenAI ``usage`` object: ``prompt_tokens`` /
    ``completion_tokens`` (0 when absent: embeddings), or the Responses API's ``input_tokens`` /
    ``output_tokens`` when it has no ``prompt_tokens``; None when ``usage`` is not such an object (not a
    dict, a count missing, negative or not an integer)."""
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" not in usage and "input_tokens" in usage:
        prompt = usage.get("input_tokens")
        completion = usage.get("output_tokens")
    else:
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens", 0)  # embeddings report prompt and total only
    if (
        isinstance(prompt, int)
        and isinstance(completion, int)
        and not isinstance(prompt, bool)
        and not isinstance(completion, bool)
        and prompt >= 0
        and completion >= 0
    ):
        return prompt, completion
    return None


#: The top-level ``"usage": null`` member every chunk carries once ``include_usage`` is on ("All other chunks
#: will also include a usage field, but with a null value", OpenAI API reference, ``stream_options``), with
#: the comma that joins it to its neighbour. An unescaped ``"`` only occurs in JSON's structure, never
#: inside a string, so these match the member itself, not text that quotes it.
_NULL_USAGE_AFTER: Final = re.compile(rb',[ \t]*"usage"[ \t]*:[ \t]*null(?=[ \t]*[,}])')
_NULL_USAGE_BEFORE: Final = re.compile(rb'"usage"[ \t]*:[ \t]*null[ \t]*,[ \t]*')


def without_null_usage(event: bytes, doc: dict[str, Any]) -> bytes:
    """The raw SSE ``event`` (its lines and the blank line that ends it) without the top-level
    ``"usage": null`` member of its JSON ``doc``, every other byte unchanged; ``event`` itself when the
    member cannot be cut out exactly (the result is parsed back and must equal ``doc`` without ``usage``)."""
    cut, n = _NULL_USAGE_AFTER.subn(b"", event, count=1)
    if n == 0:
        cut, n = _NULL_USAGE_BEFORE.subn(b"", event, count=1)
    if n == 0:
        return event
    data = [
        line[5:].removeprefix(b" ")
        for line in cut.replace(b"\r\n", b"\n").split(b"\n")
        if line.startswith(b"data:")
    ]
    try:
        back = json.loads(b"\n".join(data))
    except ValueError:
        return event
    return cut if back == {k: v for k, v in doc.items() if k != "usage"} else event


def is_usage_only_event(doc: dict[str, Any]) -> bool:
    """True for the extra final chunk ``include_usage`` adds: a non-null ``usage`` and empty ``choices``."""
    return isinstance(doc.get("usage"), dict) and doc.get("choices") == []


class SseMeter:
    """Incremental SSE reader: counts completion tokens of every complete event and keeps the last
    reported usage. With ``strip_usage_event`` it also returns the bytes to pass to the client: every
    complete event except the usage-only chunk, and without the ``"usage": null`` member ``include_usage``
    puts on every other chunk (:func:`without_null_usage`), so the client gets the chunks it asked for
    (held back until the blank line that ends an event, so an event is never cut in the middle).

    Args:
        counter: completion text token counter.
        strip_usage_event: remove the usage-only chunk and every chunk's ``"usage": null`` from the
            client's stream (set when the gateway, not the client, asked for them).
    """

    __slots__ = (
        "_counter",
        "_data",
        "_event_raw",
        "_line",
        "_null_usage",
        "_skipping_line",
        "completion_tokens",
        "done",
        "reported",
        "strip_usage_event",
    )

    def __init__(self, counter: TextTokenCounter, *, strip_usage_event: bool = False) -> None:
        self._counter = counter
        self.strip_usage_event = strip_usage_event
        self._line = bytearray()  # the incomplete line so far
        self._skipping_line = False  # inside an over-long line that is being dropped
        self._data: list[bytes] = []  # data: values of the current event
        self._event_raw = bytearray()  # raw bytes of the current event (strip mode)
        self._null_usage: dict[str, Any] | None = None  # the event's doc when its usage is null (strip mode)
        self.completion_tokens = 0
        self.reported: tuple[int, int] | None = None
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        """Consume one body chunk; returns what the client should receive for it (``chunk`` itself unless
        ``strip_usage_event``)."""
        out = bytearray()
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                rest = chunk[start:]
                if self._skipping_line:
                    pass
                elif len(self._line) + len(rest) > MAX_SSE_LINE_BYTES:
                    self._skipping_line = True
                    self._line.clear()
                else:
                    self._line += rest
                if self.strip_usage_event:
                    self._event_raw += rest
                break
            piece = chunk[start : nl + 1]
            if self.strip_usage_event:
                self._event_raw += piece
            if self._skipping_line:
                self._skipping_line = False
                line = b"<skipped>"
            else:
                self._line += chunk[start:nl]
                line = bytes(self._line)
                self._line.clear()
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if line:
                self._on_line(line)
                continue
            keep = self._end_event()
            if self.strip_usage_event:
                if keep:
                    out += self._client_event()
                self._event_raw.clear()
        return bytes(out) if self.strip_usage_event else chunk

    def _client_event(self) -> bytes:
        """The current event as the client gets it (strip mode): without a null ``usage`` member."""
        doc, self._null_usage = self._null_usage, None
        raw = bytes(self._event_raw)
        return raw if doc is None else without_null_usage(raw, doc)

    def flush(self) -> bytes:
        """End of body: process an event left without its blank line; returns the bytes still held back."""
        if self._line and not self._skipping_line:
            line = bytes(self._line).removesuffix(b"\r")
            if line:
                self._on_line(line)
        self._line.clear()
        keep = self._end_event()
        held = self._client_event() if keep else b""
        self._event_raw.clear()
        return held if self.strip_usage_event else b""

    def _on_line(self, line: bytes) -> None:
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        # comments (":"), event:, id:, retry: lines carry nothing for accounting

    def _end_event(self) -> bool:
        """Account one complete event; True to pass it to the client."""
        if not self._data:
            return True
        data = b"\n".join(self._data).decode("utf-8", "replace")
        self._data.clear()
        if data.strip() == "[DONE]":
            self.done = True
            return True
        doc = _event_json(data)
        if doc is None:
            return True
        kind = doc.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            return self._end_responses_event(kind, doc)
        reported = _reported(doc)
        if reported is not None:
            self.reported = reported
        choices = doc.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                for text in _choice_texts(choice):
                    self.completion_tokens += self._counter.count(text)
        if self.strip_usage_event and "usage" in doc and doc["usage"] is None:
            self._null_usage = doc
        return not (self.strip_usage_event and is_usage_only_event(doc))

    def _end_responses_event(self, kind: str, doc: dict[str, Any]) -> bool:
        """Account one Responses API event (its ``type`` is ``response.*``); always passed to the client."""
        if kind in _RESPONSES_TEXT_DELTAS:
            delta = doc.get("delta")
            if isinstance(delta, str):
                self.completion_tokens += self._counter.count(delta)
        elif kind in _RESPONSES_TERMINAL:
            response = doc.get("response")
            if isinstance(response, dict):
                reported = _reported(response)
                if reported is not None:
                    self.reported = reported
            self.done = True
        return True


# -- one response ---------------------------------------------------------------------------------
class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """What admission knew about a request, for settling its usage.

    Attributes:
        prompt_tokens: prompt tokens counted by the gateway (tokens).
        reserved_tokens: prompt + largest output cap x n, taken from the quotas at admission (tokens).
        stream: the request asked for an SSE stream.
        strip_usage_event: the gateway added ``include_usage``; hide the extra usage chunk from the client.
    """

    prompt_tokens: int
    reserved_tokens: int
    stream: bool
    strip_usage_event: bool = False


class ResponseMeter:
    """Follows one response through its headers and body chunks and yields its :class:`Usage` once.

    Usage: :meth:`on_headers` (status, content type), :meth:`on_body` per chunk (returns the bytes to
    send the client), then :meth:`finish` (``aborted=True`` when the body did not reach its end). Only the
    first :meth:`finish` computes a usage; later calls return None, which is how the caller settles a
    reservation exactly once.
    """

    __slots__ = ("_body", "_counter", "_finished", "_json_overflow", "_sse", "reservation", "status")

    def __init__(
        self, reservation: Reservation, counter: TextTokenCounter, *, max_json_bytes: int = MAX_JSON_BYTES
    ) -> None:
        self.reservation = reservation
        self._counter = counter
        self.status: int | None = None
        self._sse: SseMeter | None = None
        self._body = bytearray()
        self._json_overflow = max_json_bytes
        self._finished = False

    @property
    def streaming(self) -> bool:
        """True once the response headers said ``text/event-stream``."""
        return self._sse is not None

    @property
    def complete(self) -> bool:
        """True once an SSE stream's ``data: [DONE]`` terminator (or a Responses API stream's terminal
        ``response.completed`` / ``.incomplete`` / ``.failed`` event) was read: nothing more will be
        generated, so the request can be settled without waiting for the end of the body (Envoy does not
        always deliver an end-of-stream body message before it resets the stream)."""
        return self._sse is not None and self._sse.done

    @property
    def rewrites_body(self) -> bool:
        """True when :meth:`on_body` may return bytes different from its input (the usage chunk is
        stripped), so the response's ``content-length`` must go."""
        return self._sse is not None and self._sse.strip_usage_event

    def on_headers(self, status: int, content_type: str) -> None:
        """The response headers: HTTP ``status`` and the ``content-type`` value."""
        self.status = status
        if content_type.split(";", 1)[0].strip().lower() == "text/event-stream":
            strip = self.reservation.strip_usage_event and 200 <= status < 300
            self._sse = SseMeter(self._counter, strip_usage_event=strip)

    def on_body(self, chunk: bytes, *, end_of_stream: bool) -> bytes:
        """One response body chunk; returns the bytes the client should get in its place."""
        if self._sse is not None:
            out = self._sse.feed(chunk)
            if end_of_stream:
                out += self._sse.flush()
            return out
        if len(self._body) + len(chunk) <= self._json_overflow:
            self._body += chunk
        else:
            self._json_overflow = -1  # marks "too large": charged the reservation
            self._body.clear()
        return chunk

    def finish(self, *, aborted: bool) -> Usage | None:
        """The usage of this response, the first time it is called; None afterwards.

        Args:
            aborted: the body did not reach its end (client gone, upstream reset, timeout). Ignored for
                an SSE stream that reached ``[DONE]``.
        """
        if self._finished:
            return None
        self._finished = True
        if self.complete:
            aborted = False  # the stream reached [DONE]; only its transport was cut
        res = self.reservation
        if self.status is None:
            if not res.stream and aborted:
                # the client left before a non-streamed answer began: its generation runs before the first
                # byte, so any part of it, up to the whole cap, may have been produced and cannot be seen;
                # charge the reservation (charging the prompt alone let a client abort to use GPU time
                # for free: found by an adversarial test, 255 tokens generated, 8 charged)
                return Usage(
                    prompt_tokens=res.prompt_tokens,
                    completion_tokens=res.reserved_tokens - res.prompt_tokens,
                    source=UsageSource.RESERVED,
                    aborted=True,
                )
            # no response yet on a stream: the prompt went upstream and may have been prefilled; nothing
            # was streamed, so nothing generated is charged
            return Usage(
                prompt_tokens=res.prompt_tokens,
                completion_tokens=0,
                source=UsageSource.COUNTED,
                aborted=aborted,
            )
        if not 200 <= self.status < 300:
            return Usage(prompt_tokens=0, completion_tokens=0, source=UsageSource.NONE, aborted=aborted)
        if self._sse is not None:
            if aborted:
                self._sse.flush()
            if self._sse.reported is not None:
                prompt, completion = self._sse.reported
                return Usage(
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    source=UsageSource.REPORTED,
                    aborted=aborted,
                )
            return Usage(
                prompt_tokens=res.prompt_tokens,
                completion_tokens=self._sse.completion_tokens,
                source=UsageSource.COUNTED,
                aborted=aborted,
            )
        if self._json_overflow < 0:
            return Usage(
                prompt_tokens=res.prompt_tokens,
                completion_tokens=res.reserved_tokens - res.prompt_tokens,
                source=UsageSource.RESERVED,
                aborted=aborted,
            )
        doc = _event_json(self._body.decode("utf-8", "replace")) if self._body else None
        self._body.clear()
        if doc is not None:
            reported = _reported(doc)
            if reported is not None:
                return Usage(
                    prompt_tokens=reported[0],
                    completion_tokens=reported[1],
                    source=UsageSource.REPORTED,
                    aborted=aborted,
                )
            choices = doc.get("choices")
            output = doc.get("output")
            completion = 0
            if isinstance(choices, list):
                completion = sum(self._counter.count(t) for c in choices for t in _choice_texts(c))
            elif isinstance(output, list):  # a Responses API body without usage
                completion = sum(self._counter.count(t) for i in output for t in _output_item_texts(i))
            return Usage(
                prompt_tokens=res.prompt_tokens,
                completion_tokens=completion,
                source=UsageSource.COUNTED,
                aborted=aborted,
            )
        # an unparseable or cut-short JSON body: a non-streamed answer is sent after the whole generation,
        # so charge the reservation rather than guess low
        return Usage(
            prompt_tokens=res.prompt_tokens,
            completion_tokens=res.reserved_tokens - res.prompt_tokens,
            source=UsageSource.RESERVED,
            aborted=aborted,
        )
