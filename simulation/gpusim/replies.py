"""OpenAI response bodies of the simulated servers. Pure: no I/O.

Requests are parsed by :func:`inferlb.request.parsing.parse_request` and their prompts counted by
:mod:`inferlb.request.tokens`, exactly as the gateway does, so the ``usage.prompt_tokens`` a simulated server
reports is the count the gateway reserved quota for. This module builds what goes back (OpenAI API reference,
"Chat", "Completions (legacy)" and "Embeddings"):

* non-streamed ``chat.completion`` / ``text_completion`` bodies with ``usage``, and server-sent-event streams
  of ``chat.completion.chunk`` / ``text_completion`` objects ending with ``data: [DONE]``, with a last chunk
  carrying ``usage`` (and empty ``choices``) when ``stream_options.include_usage`` is true. A completions
  request with several prompts gets ``n`` choices per prompt, indexed prompt by prompt (OpenAI's order).
* ``response`` objects of the Responses API (OpenAI API reference, "Responses" and "Streaming events"): one
  assistant ``message`` output item holding one ``output_text`` part, and ``usage`` in the Responses terms
  (``input_tokens``, ``output_tokens``, ``total_tokens``). Streamed, they are typed server-sent events
  (``event: <type>`` then ``data: <json>``, each JSON carrying its ``type`` and a ``sequence_number``
  counting from 0): ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, one ``response.output_text.delta`` per token, the matching ``.done``
  events, and ``response.incomplete`` carrying the whole response with its ``usage``. There is no
  ``data: [DONE]`` in a Responses stream. The simulated model always stops at its token cap (as vLLM with
  ``ignore_eos``), so, as chat choices end with ``finish_reason`` "length", a response ends "incomplete"
  with ``incomplete_details.reason`` "max_output_tokens" (what OpenAI answers when the cap cuts the output),
  its message item "incomplete" too.
* ``list`` bodies of ``embedding`` objects: deterministic pseudo-embeddings (:func:`pseudo_embedding`) as
  JSON floats or as base64 of little-endian float32 (``encoding_format``), with ``usage`` of prompt tokens.

Refusals are :class:`inferlb.errors.RequestError` in OpenAI's error vocabulary; the server maps them to HTTP.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from inferlb.errors import RequestError
from inferlb.request.parsing import EmbeddingEncoding, EndpointKind, InferenceRequest, Prompt

#: Length of an embedding when the request sets no ``dimensions``: that of OpenAI's text-embedding-3-small
#: and text-embedding-ada-002 (OpenAI embeddings guide).
EMBEDDING_DIMENSIONS: Final = 1536
#: Largest ``dimensions`` served (text-embedding-3-large has 3072): bounds the size of a response.
MAX_EMBEDDING_DIMENSIONS: Final = 8192

#: The simulated completion text: words that are each exactly one cl100k_base token when preceded by a
#: space, so ``completion_tokens`` tokens of text re-tokenize to ``completion_tokens`` tokens.
COMPLETION_WORDS: tuple[str, ...] = tuple(
    " " + w
    for w in (
        *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs", "to"),
        *("GPU", "model", "server", "with", "tokens", "in", "time", "for", "every", "request", "of", "data"),
    )
)


def token_text(index: int) -> str:
    """The text of completion token ``index`` (0-based): one word of :data:`COMPLETION_WORDS`, cycling."""
    return COMPLETION_WORDS[index % len(COMPLETION_WORDS)]


def completion_text(tokens: int) -> str:
    """The text of a completion of ``tokens`` tokens (tokens 0 .. tokens-1 joined)."""
    return "".join(token_text(i) for i in range(tokens))


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> RequestError:
    """A 400 ``invalid_request_error``."""
    return RequestError(400, message, type="invalid_request_error", param=param, code=code)


# -- responses --------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage``: ``completion_tokens`` counts every choice."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_id(kind: EndpointKind, request_id: str) -> str:
    """``chatcmpl-...`` for chat, ``cmpl-...`` for completions (OpenAI's prefixes)."""
    return f"{'chatcmpl' if kind is EndpointKind.CHAT_COMPLETIONS else 'cmpl'}-{request_id}"


def choice_count(req: InferenceRequest) -> int:
    """Choices a generation request gets: ``n`` per prompt (one prompt for chat)."""
    return req.n * req.prompt_count


def full_response(
    req: InferenceRequest, *, request_id: str, created: int, prompt_tokens: int, tokens_per_choice: int
) -> dict[str, Any]:
    """The non-streamed body: :func:`choice_count` choices of ``tokens_per_choice`` tokens each,
    ``finish_reason`` "length" (generation stops at the token limit, like vLLM with ``ignore_eos``), and
    ``usage``."""
    text = completion_text(tokens_per_choice)
    width = choice_count(req)
    choices: list[dict[str, Any]]
    if req.kind is EndpointKind.CHAT_COMPLETIONS:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
            for i in range(width)
        ]
        obj = "chat.completion"
    else:
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": "length"} for i in range(width)
        ]
        obj = "text_completion"
    return {
        "id": response_id(req.kind, request_id),
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage(prompt_tokens, tokens_per_choice * width),
    }


def _chunk(
    req: InferenceRequest, request_id: str, created: int, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": response_id(req.kind, request_id),
        "object": "chat.completion.chunk" if req.kind is EndpointKind.CHAT_COMPLETIONS else "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
    }
    if req.include_usage:
        chunk["usage"] = (
            None  # OpenAI sends usage: null on every chunk but the last when include_usage is set
        )
    return chunk


def token_chunks(
    req: InferenceRequest, *, request_id: str, created: int, start: int, stop: int
) -> Iterable[dict[str, Any]]:
    """Stream chunks for tokens ``start .. stop-1`` of every choice. In chat streams, token 0 of each choice
    carries ``role: assistant`` as OpenAI's first delta does."""
    width = choice_count(req)
    for t in range(start, stop):
        choices: list[dict[str, Any]] = []
        for i in range(width):
            if req.kind is EndpointKind.CHAT_COMPLETIONS:
                delta: dict[str, Any] = {"content": token_text(t)}
                if t == 0:
                    delta = {"role": "assistant", **delta}
                choices.append({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
            else:
                choices.append({"index": i, "text": token_text(t), "logprobs": None, "finish_reason": None})
        yield _chunk(req, request_id, created, choices)


def final_chunk(req: InferenceRequest, *, request_id: str, created: int) -> dict[str, Any]:
    """The chunk that closes every choice with ``finish_reason`` "length"."""
    width = choice_count(req)
    choices: list[dict[str, Any]]
    if req.kind is EndpointKind.CHAT_COMPLETIONS:
        choices = [
            {"index": i, "delta": {}, "logprobs": None, "finish_reason": "length"} for i in range(width)
        ]
    else:
        choices = [
            {"index": i, "text": "", "logprobs": None, "finish_reason": "length"} for i in range(width)
        ]
    return _chunk(req, request_id, created, choices)


def usage_chunk(
    req: InferenceRequest, *, request_id: str, created: int, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: empty ``choices`` and the request's ``usage``."""
    chunk = _chunk(req, request_id, created, [])
    chunk["usage"] = usage(prompt_tokens, completion_tokens)
    return chunk


def sse(event: Mapping[str, Any]) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


#: The stream terminator OpenAI sends.
SSE_DONE = b"data: [DONE]\n\n"


# -- responses (the Responses API) ----------------------------------------------------------------------


def responses_usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The Responses API ``usage`` object (tokens); no cached or reasoning tokens in the simulation."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


#: The status of a finished response: the simulated model always stops at its token cap (module docstring).
CAPPED: Final = "incomplete"


class ResponseBuilder:
    """Builds the ``response`` object and the stream events of one ``POST /v1/responses`` request.

    Args:
        req: the parsed request (kind :attr:`EndpointKind.RESPONSES`).
        request_id: the server's id of the request (hex); the response id is ``resp_<request_id>``, the
            message item's ``msg_<request_id>`` (OpenAI's prefixes).
        created_at: Unix time of creation (s).

    Streamed events are numbered by :attr:`sequence_number` in the order the methods return them; call
    :meth:`opening_events`, then :meth:`delta_events` as tokens come, then :meth:`closing_events` once.
    """

    __slots__ = ("created_at", "item_id", "req", "response_id", "sequence_number")

    def __init__(self, req: InferenceRequest, *, request_id: str, created_at: int) -> None:
        self.req = req
        self.response_id = f"resp_{request_id}"
        self.item_id = f"msg_{request_id}"
        self.created_at = created_at
        self.sequence_number = 0

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [self._part(text)],
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def response(
        self, *, status: str, output_tokens: int | None = None, input_tokens: int | None = None
    ) -> dict[str, Any]:
        """The ``response`` object: with ``output_tokens`` tokens of text in one message and ``usage`` when
        both counts are given, else with no output and ``usage: null`` (the state in ``response.created``).
        """
        output: list[dict[str, Any]] = []
        usage_doc: dict[str, Any] | None = None
        if output_tokens is not None and input_tokens is not None:
            output = [self._message(completion_text(output_tokens), status)]
            usage_doc = responses_usage(input_tokens, output_tokens)
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == CAPPED else None,
            "instructions": None,
            "max_output_tokens": self.req.max_output_tokens,
            "model": self.req.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage_doc,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def opening_events(self) -> list[dict[str, Any]]:
        """``response.created``, ``response.in_progress``, then the message item and its text part added."""
        return [
            self._event("response.created", response=self.response(status="in_progress")),
            self._event("response.in_progress", response=self.response(status="in_progress")),
            self._event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
            self._event(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                part=self._part(""),
            ),
        ]

    def delta_events(self, start: int, stop: int) -> list[dict[str, Any]]:
        """One ``response.output_text.delta`` per token ``start .. stop-1``."""
        return [
            self._event(
                "response.output_text.delta",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                delta=token_text(t),
                logprobs=[],
            )
            for t in range(start, stop)
        ]

    def closing_events(self, *, input_tokens: int, output_tokens: int) -> list[dict[str, Any]]:
        """The ``.done`` events of the text, part and item, then ``response.incomplete`` (the output reached
        its token cap, module docstring) with ``usage``."""
        text = completion_text(output_tokens)
        return [
            self._event(
                "response.output_text.done",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                part=self._part(text),
            ),
            self._event("response.output_item.done", output_index=0, item=self._message(text, CAPPED)),
            self._event(
                f"response.{CAPPED}",
                response=self.response(status=CAPPED, input_tokens=input_tokens, output_tokens=output_tokens),
            ),
        ]


def typed_sse(event: Mapping[str, Any]) -> bytes:
    """One typed server-sent event as the Responses API sends it: ``event: <type>\\ndata: <json>\\n\\n``."""
    return (
        b"event: "
        + str(event["type"]).encode()
        + b"\ndata: "
        + json.dumps(event, separators=(",", ":")).encode()
        + b"\n\n"
    )


# -- embeddings -------------------------------------------------------------------------------------------


def pseudo_embedding(model: str, prompt: Prompt, dimensions: int) -> tuple[float, ...]:
    """A deterministic unit vector of ``dimensions`` float32 values standing for ``prompt``'s embedding.

    Component ``i`` comes from bytes ``4i .. 4i+3`` of SHAKE-256 over the model name and the prompt (its
    UTF-8 text, or its token ids), read as a little-endian uint32 and mapped to (-1, 1); the vector is then
    scaled to length 1 and rounded to float32 (the precision of OpenAI's base64 format, so both formats
    carry the same numbers). So the same model and prompt always give the same vector, different prompts
    give nearly orthogonal ones, and a shorter ``dimensions`` is the longer vector's prefix re-normalised,
    as OpenAI's shortened text-embedding-3 embeddings are.

    Raises:
        ValueError: ``dimensions < 1``.
    """
    if dimensions < 1:
        raise ValueError(f"dimensions must be >= 1, got {dimensions}")
    seed = hashlib.shake_256(model.encode() + b"\0")
    if isinstance(prompt, str):
        seed.update(b"text\0" + prompt.encode("utf-8", "surrogatepass"))
    else:
        seed.update(b"ids\0" + b",".join(str(t).encode() for t in prompt))
    raw = struct.unpack(f"<{dimensions}I", seed.digest(4 * dimensions))
    values = [(x + 0.5) / 2**31 - 1.0 for x in raw]
    norm = math.sqrt(math.fsum(v * v for v in values))
    return _float32([v / norm for v in values])


def _float32(values: Sequence[float]) -> tuple[float, ...]:
    return struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values))


def encode_embedding(vector: Sequence[float], encoding: EmbeddingEncoding) -> list[float] | str:
    """``vector`` as the ``embedding`` field: a JSON array, or base64 of little-endian float32 (what the
    OpenAI SDKs decode when they ask for ``encoding_format: base64``)."""
    if encoding is EmbeddingEncoding.BASE64:
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


def embedding_response(
    req: InferenceRequest, *, vectors: Sequence[Sequence[float]], prompt_tokens: int
) -> dict[str, Any]:
    """The embeddings body: one ``embedding`` object per input, in input order, and ``usage`` (prompt tokens
    only: ``total_tokens`` equals ``prompt_tokens``)."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_embedding(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": req.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
