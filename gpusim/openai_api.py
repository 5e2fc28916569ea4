"""OpenAI wire format of the simulated servers: request parsing and response bodies. Pure: no I/O.

Covers ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI API reference, "Chat" and
"Completions (legacy)"): non-streamed bodies with ``usage``, and server-sent-event streams of
``chat.completion.chunk`` / ``text_completion`` objects ending with ``data: [DONE]``, with a last chunk
carrying ``usage`` (and empty ``choices``) when ``stream_options.include_usage`` is true. Refusals are
:class:`inferlb.errors.RequestError` in OpenAI's error vocabulary; the server maps them to HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from inferlb.errors import RequestError

Kind = Literal["chat", "completion"]

#: OpenAI accepts ``n`` up to 128.
MAX_N = 128

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


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """A parsed chat or text completion request.

    Attributes:
        kind: ``chat`` (``/v1/chat/completions``) or ``completion`` (``/v1/completions``).
        model: the model name the client asked for (a name or an alias).
        prompt_texts: the texts whose tokens are the prompt (message contents, or the prompt string).
        prompt_token_ids: prompt tokens given directly as token ids (completions only), else 0.
        max_tokens: completion tokens requested per choice, or None for the model's default.
        n: choices to generate (1..128).
        stream: answer as a server-sent-event stream.
        include_usage: with ``stream``, end with a usage chunk (``stream_options.include_usage``).
    """

    kind: Kind
    model: str
    prompt_texts: tuple[str, ...]
    prompt_token_ids: int
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool

    def prompt_tokens(self, count_text: Callable[[str], int]) -> int:
        """Prompt tokens: ``count_text`` over :attr:`prompt_texts` plus the token ids given directly."""
        return sum(count_text(t) for t in self.prompt_texts) + self.prompt_token_ids


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> RequestError:
    """A 400 ``invalid_request_error``."""
    return RequestError(400, message, type="invalid_request_error", param=param, code=code)


def parse_generation_request(body: bytes, kind: Kind) -> GenerationRequest:
    """Parse and check a request body.

    Raises:
        RequestError: 400 when the body is not a JSON object, or a field is missing or has the wrong type or
            range (``model``, ``messages``/``prompt``, ``max_tokens``, ``max_completion_tokens``, ``n``,
            ``stream``, ``stream_options``), naming the field in ``param``.
    """
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise bad_request(f"request body must be a JSON object, got {type(doc).__name__}")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", param="model")
    if kind == "chat":
        texts, ids = _chat_prompt(doc.get("messages")), 0
    else:
        texts, ids = _completion_prompt(doc.get("prompt"))
    if kind == "chat" and doc.get("max_completion_tokens") is not None:
        max_tokens = _positive_int(doc, "max_completion_tokens")
    else:
        max_tokens = _positive_int(doc, "max_tokens")
    n = _positive_int(doc, "n")
    if n is None:
        n = 1
    if n > MAX_N:
        raise bad_request(f"'n' must be at most {MAX_N}, got {n}", param="n")
    stream = doc.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    include_usage = False
    options = doc.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        flag = options.get("include_usage", False)
        if not isinstance(flag, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean", param="stream_options")
        include_usage = flag
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt_texts=texts,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        n=n,
        stream=stream,
        include_usage=include_usage,
    )


def _positive_int(doc: Mapping[str, Any], name: str) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'{name}' must be an integer >= 1, got {value!r}", param=name)
    return value


def _chat_prompt(messages: Any) -> tuple[str, ...]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty array", param="messages")
    texts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        content = msg.get("content")
        if content is None:
            continue  # an assistant message with only tool calls
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad_request(
                        f"messages[{i}].content[{j}] must be an object with a 'type'",
                        param=f"messages[{i}].content",
                    )
                if part["type"] == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise bad_request(
                            f"messages[{i}].content[{j}].text must be a string",
                            param=f"messages[{i}].content",
                        )
                    texts.append(text)
                # other parts (images, audio) carry no text tokens
        else:
            raise bad_request(
                f"messages[{i}].content must be a string, an array of parts or null",
                param=f"messages[{i}].content",
            )
    return tuple(texts)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def _completion_prompt(prompt: Any) -> tuple[tuple[str, ...], int]:
    if isinstance(prompt, str):
        return (prompt,), 0
    if _is_token_ids(prompt) and prompt:
        return (), len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        # a batch of one prompt, as a string or as token ids
        (only,) = prompt
        if isinstance(only, str):
            return (only,), 0
        if _is_token_ids(only) and only:
            return (), len(only)
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str) or _is_token_ids(p) for p in prompt)
    ):
        raise bad_request(
            "batched prompts (a list of several prompts) are not supported; send one", param="prompt"
        )
    raise bad_request(
        "'prompt' is required: a string, an array of token ids, or an array holding one of those",
        param="prompt",
    )


# -- responses --------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage``: ``completion_tokens`` counts every choice."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_id(kind: Kind, request_id: str) -> str:
    """``chatcmpl-...`` for chat, ``cmpl-...`` for completions (OpenAI's prefixes)."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def full_response(
    req: GenerationRequest, *, request_id: str, created: int, prompt_tokens: int, tokens_per_choice: int
) -> dict[str, Any]:
    """The non-streamed body: ``n`` choices of ``tokens_per_choice`` tokens each, ``finish_reason`` "length"
    (generation stops at the token limit, like vLLM with ``ignore_eos``), and ``usage``."""
    text = completion_text(tokens_per_choice)
    choices: list[dict[str, Any]]
    if req.kind == "chat":
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
            for i in range(req.n)
        ]
        obj = "chat.completion"
    else:
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": "length"} for i in range(req.n)
        ]
        obj = "text_completion"
    return {
        "id": response_id(req.kind, request_id),
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage(prompt_tokens, tokens_per_choice * req.n),
    }


def _chunk(
    req: GenerationRequest, request_id: str, created: int, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": response_id(req.kind, request_id),
        "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
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
    req: GenerationRequest, *, request_id: str, created: int, start: int, stop: int
) -> Iterable[dict[str, Any]]:
    """Stream chunks for tokens ``start .. stop-1`` of every choice. In chat streams, token 0 of each choice
    carries ``role: assistant`` as OpenAI's first delta does."""
    for t in range(start, stop):
        choices: list[dict[str, Any]] = []
        for i in range(req.n):
            if req.kind == "chat":
                delta: dict[str, Any] = {"content": token_text(t)}
                if t == 0:
                    delta = {"role": "assistant", **delta}
                choices.append({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
            else:
                choices.append({"index": i, "text": token_text(t), "logprobs": None, "finish_reason": None})
        yield _chunk(req, request_id, created, choices)


def final_chunk(req: GenerationRequest, *, request_id: str, created: int) -> dict[str, Any]:
    """The chunk that closes every choice with ``finish_reason`` "length"."""
    choices: list[dict[str, Any]]
    if req.kind == "chat":
        choices = [
            {"index": i, "delta": {}, "logprobs": None, "finish_reason": "length"} for i in range(req.n)
        ]
    else:
        choices = [
            {"index": i, "text": "", "logprobs": None, "finish_reason": "length"} for i in range(req.n)
        ]
    return _chunk(req, request_id, created, choices)


def usage_chunk(
    req: GenerationRequest, *, request_id: str, created: int, prompt_tokens: int, completion_tokens: int
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
