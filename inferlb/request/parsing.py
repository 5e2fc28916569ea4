"""Parse OpenAI-style inference request bodies into frozen values (pure: bytes in, dataclasses out).

Covers the request shapes of OpenAI's API reference (https://platform.openai.com/docs/api-reference):

- ``POST /v1/chat/completions``: ``messages`` whose ``content`` is a string, an array of content parts
  (``text``, ``image_url``, ``input_audio``, ``file``, ``refusal``), or ``null`` on an assistant message that
  carries ``tool_calls``/``function_call``; ``tools``/``functions`` definitions.
- ``POST /v1/completions``: ``prompt`` as a string, a list of strings, a token array, or a list of token
  arrays.
- ``POST /v1/embeddings``: ``input`` as a string, a list of strings, a token array, or a list of token
  arrays.
- ``POST /v1/responses``: ``input`` as a string or a list of input items (messages whose ``content`` is a
  string or ``input_text``/``output_text``/``input_image``/``input_file`` parts, ``function_call`` and
  ``function_call_output`` items), ``instructions`` (counted as a leading system message),
  ``max_output_tokens``, ``tools``; the items become :class:`ChatMessage` values counted like chat.

Unknown content-part and input-item types are never refused: they are counted by the tokens of their
compact JSON (a documented over-estimate for text-like parts: the JSON carries the text plus its keys) and
their types are listed in :attr:`InferenceRequest.unknown_parts` so the caller can log them.

Kept: the model, the texts whose tokens are counted, the prompts in request order (texts and token arrays),
the requested output cap, ``n``, ``stream``, ``stream_options.include_usage``, ``user``, and the embeddings
options ``dimensions`` and ``encoding_format``. The gateway and the simulated model server
(:mod:`simulation.gpusim`) both parse with this module, so the prompt they count is the same. Fields neither
uses are not validated (a real model server does that). Every refusal raises
:class:`inferlb.errors.RequestError` with status 400 and OpenAI's ``invalid_request_error`` type, naming the
parameter at fault; no client input can make this module raise anything else. The values are frozen
keyword-only ``msgspec.Struct`` s (why: :mod:`ext_proc.handlers`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final

import msgspec

from inferlb.errors import RequestError

#: OpenAI caps ``n`` at 128 (chat completions API reference); a larger ``n`` would only inflate the
#: quota reservation, so it is refused here.
MAX_N: Final = 128

_INVALID: Final = "invalid_request_error"

#: Longest client value echoed back in an error message (characters); longer values are cut and end in
#: "...", so a 3 MB model name cannot make a 3 MB error body.
ECHO_MAX_CHARS: Final = 256


def echo(value: object, limit: int = ECHO_MAX_CHARS) -> str:
    """``value`` as text for an error message: ``str()`` for strings, ``repr()`` otherwise, cut to ``limit``
    characters followed by "..." when longer."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


#: One prompt of a completions request or one input of an embeddings request: a text, or token ids.
Prompt = str | tuple[int, ...]


class EndpointKind(StrEnum):
    """The OpenAI inference endpoint a request is for."""

    CHAT_COMPLETIONS = "chat.completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"

    @property
    def is_conversation(self) -> bool:
        """True when the prompt is a list of messages (chat completions, responses), counted as one."""
        return self is EndpointKind.CHAT_COMPLETIONS or self is EndpointKind.RESPONSES

    @property
    def generates_tokens(self) -> bool:
        """True when the endpoint produces completion tokens (embeddings do not)."""
        return self is not EndpointKind.EMBEDDINGS


#: Request path (without query string) -> endpoint kind.
INFERENCE_PATHS: Final[Mapping[str, EndpointKind]] = {
    "/v1/chat/completions": EndpointKind.CHAT_COMPLETIONS,
    "/v1/completions": EndpointKind.COMPLETIONS,
    "/v1/embeddings": EndpointKind.EMBEDDINGS,
    "/v1/responses": EndpointKind.RESPONSES,
}


class EmbeddingEncoding(StrEnum):
    """``encoding_format`` of an embeddings request (OpenAI API reference, "Create embeddings")."""

    #: JSON arrays of numbers (the API's default).
    FLOAT = "float"
    #: base64 of the little-endian float32 array.
    BASE64 = "base64"


class ImageDetail(StrEnum):
    """``image_url.detail`` of a chat image part; ``auto`` when the client gave none."""

    LOW = "low"
    HIGH = "high"
    AUTO = "auto"


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One chat message reduced to what token counting needs.

    Attributes:
        role: ``system``, ``developer``, ``user``, ``assistant``, ``tool`` or ``function``.
        name: the optional participant ``name`` (counted with the cookbook's per-name overhead).
        texts: every text the message carries, in order: string content, text/refusal parts, tool call
            function names and argument strings, ``tool_call_id``, and the JSON of unknown part types.
        images: the ``detail`` of each image part, in order.
    """

    role: str
    name: str | None = None
    texts: tuple[str, ...] = ()
    images: tuple[ImageDetail, ...] = ()


class InferenceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed OpenAI inference request.

    Attributes:
        kind: which endpoint.
        model: the ``model`` field as sent (name or alias; resolution is :mod:`inferlb.policy.routing`'s job).
        messages: chat messages (chat completions only; empty otherwise).
        texts: prompts/inputs given as text (completions, embeddings), one per prompt.
        token_array_lengths: lengths of prompts/inputs given as token arrays, one per prompt (tokens).
        tools_json: compact JSON of the ``tools``/``functions`` definitions, or None.
        max_output_tokens: the cap the model server applies (tokens, per choice): ``max_completion_tokens``
            if set, else ``max_tokens`` (chat, as OpenAI and vLLM read them), ``max_tokens`` (completions),
            ``max_output_tokens`` (responses), else None. Always None for embeddings.
        largest_output_tokens: the largest of every output cap the body carries for its endpoint (tokens,
            per choice): for chat the larger of ``max_completion_tokens`` and ``max_tokens`` (a server may
            honour either: vLLM takes ``max_completion_tokens``, servers that predate it ``max_tokens``),
            otherwise :attr:`max_output_tokens`. What admission reserves; None when no cap is set. A cap
            field of another endpoint's API is ignored, as the model servers ignore it (OpenAI API
            reference; vLLM's request models).
        n: completions per prompt (``max(n, best_of)`` for legacy completions), >= 1.
        prompt_count: number of prompts the endpoint generates for (a list of prompts in legacy
            completions yields ``n`` choices per prompt), >= 1.
        stream: the ``stream`` flag.
        user: the ``user`` field (end-user id), used for sticky version choice.
        prompts: every prompt (completions) or input (embeddings) in request order, each a text or a tuple of
            token ids; :attr:`texts` and :attr:`token_array_lengths` are the same prompts split by shape.
            Empty for chat.
        include_usage: ``stream_options.include_usage`` (only ever True when :attr:`stream` is).
        dimensions: embeddings only: the ``dimensions`` asked for, or None for the model's own.
        encoding_format: embeddings only: how the vectors are returned.
        unknown_parts: the ``type`` of every content part or input item this module does not know, in
            order (counted by their JSON; for the caller to log).
    """

    kind: EndpointKind
    model: str
    messages: tuple[ChatMessage, ...] = ()
    texts: tuple[str, ...] = ()
    token_array_lengths: tuple[int, ...] = ()
    tools_json: str | None = None
    max_output_tokens: int | None = None
    largest_output_tokens: int | None = None
    n: int = 1
    prompt_count: int = 1
    stream: bool = False
    user: str | None = None
    prompts: tuple[Prompt, ...] = ()
    include_usage: bool = False
    dimensions: int | None = None
    encoding_format: EmbeddingEncoding = EmbeddingEncoding.FLOAT
    unknown_parts: tuple[str, ...] = ()

    def output_token_cap(self, default_max_tokens: int) -> int:
        """Most completion tokens this request may produce: the largest cap x ``n`` x prompts (tokens).

        The cap is :attr:`largest_output_tokens` (the largest output cap the body carries), else
        ``default_max_tokens`` (the model's config value) when the request set none; 0 for embeddings.
        This is what quota admission reserves on top of the prompt.
        """
        if not self.kind.generates_tokens:
            return 0
        cap = self.largest_output_tokens if self.largest_output_tokens is not None else default_max_tokens
        return cap * self.n * self.prompt_count


def _bad(message: str, param: str | None, code: str | None = None) -> RequestError:
    return RequestError(400, message, type=_INVALID, param=param, code=code)


_JSON_TYPE_NAMES: Final[Mapping[type, str]] = {
    type(None): "null",
    dict: "object",
    list: "array",
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
}


def _type_name(value: object) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _is_int(value: object) -> bool:
    # bool is a subclass of int in Python; JSON true is not an integer
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_array(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) and t >= 0 for t in value)


#: msgspec's untyped JSON decoder (~2.4x faster than ``json.loads`` on a 3 KB chat body). Where it reads a
#: body at all it reads it as ``json.loads`` does: the same dicts, lists, strings, ints of any size, floats
#: and key order, duplicate keys included (the last wins); a body it refuses (not UTF-8, a BOM, ``NaN``, a
#: lone surrogate escape, a number beyond a double, nesting past the interpreter's recursion limit) goes
#: to ``json.loads``, whose reading and error message stand. orjson was not taken: it reads an integer
#: beyond 64 bits as a float, which turns a ``max_tokens`` error into another.
_decode_json: Final = msgspec.json.Decoder().decode


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object (:data:`_decode_json`, else ``json.loads``).

    Raises:
        RequestError: 400 ``invalid_request_error`` when the body is empty, not UTF-8 JSON, nested too
            deeply for the parser, or not an object.
    """
    if not body.strip():
        raise _bad("The request body is empty; expected a JSON object.", None)
    try:
        data = _decode_json(body)
    except (msgspec.DecodeError, RecursionError):
        # the standard library reads it again: its reading (BOM, NaN...) or its error message stands
        try:
            data = json.loads(body)
        except RecursionError:
            raise _bad("The request body is nested too deeply to parse.", None) from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
            raise _bad(f"We could not parse the JSON body of your request: {exc}", None) from None
    if not isinstance(data, dict):
        raise _bad(f"The request body must be a JSON object, got {_type_name(data)}.", None)
    return data


def parse_request(kind: EndpointKind, body: bytes) -> InferenceRequest:
    """Parse and check the body of one inference request.

    Args:
        kind: the endpoint, from the request path (see :data:`INFERENCE_PATHS`).
        body: the raw HTTP body.

    Raises:
        RequestError: 400 ``invalid_request_error`` naming ``param`` (``model``, ``messages[2].content``,
            ``max_tokens``...) for malformed JSON, a missing or empty model, or a field of the wrong type;
            ``stream_options`` sent without ``stream: true`` (OpenAI and vLLM refuse it too); an
            ``encoding_format`` other than ``float``/``base64`` or a ``dimensions`` below 1 (embeddings).
    """
    data = parse_json_body(body)
    model = data.get("model")
    if model is None or model == "":
        raise _bad("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {_type_name(model)}.", "model")

    stream = _optional_bool(data, "stream")
    include_usage = _include_usage(data, stream)
    user = _optional_str(data, "user")
    n = _optional_int(data, "n", minimum=1, maximum=MAX_N)
    n = 1 if n is None else n

    if kind is EndpointKind.RESPONSES:
        return _parse_responses(data, model, stream=stream, user=user)
    if kind is EndpointKind.CHAT_COMPLETIONS:
        unknown: list[str] = []
        messages = _parse_messages(data.get("messages"), unknown)
        # both are checked (each must be >= 1, as OpenAI and vLLM require); the newer one wins
        max_completion = _optional_int(data, "max_completion_tokens", minimum=1)
        max_tokens = _optional_int(data, "max_tokens", minimum=1)
        caps = [c for c in (max_completion, max_tokens) if c is not None]
        return InferenceRequest(
            kind=kind,
            model=model,
            messages=messages,
            tools_json=_tools_json(data),
            max_output_tokens=max_completion if max_completion is not None else max_tokens,
            largest_output_tokens=max(caps) if caps else None,
            n=n,
            stream=stream,
            include_usage=include_usage,
            user=user,
            unknown_parts=tuple(unknown),
        )

    field = "prompt" if kind is EndpointKind.COMPLETIONS else "input"
    prompts = _parse_prompts(data, field)
    texts = tuple(p for p in prompts if isinstance(p, str))
    arrays = tuple(len(p) for p in prompts if not isinstance(p, str))
    if kind is EndpointKind.COMPLETIONS:
        best_of = _optional_int(data, "best_of", minimum=1, maximum=MAX_N)
        if best_of is not None:
            n = max(n, best_of)
        max_tokens = _optional_int(data, "max_tokens", minimum=1)
        return InferenceRequest(
            kind=kind,
            model=model,
            texts=texts,
            token_array_lengths=arrays,
            prompts=prompts,
            max_output_tokens=max_tokens,
            largest_output_tokens=max_tokens,
            n=n,
            prompt_count=len(prompts),
            stream=stream,
            include_usage=include_usage,
            user=user,
        )
    return InferenceRequest(
        kind=kind,
        model=model,
        texts=texts,
        token_array_lengths=arrays,
        prompts=prompts,
        prompt_count=len(prompts),
        user=user,
        dimensions=_optional_int(data, "dimensions", minimum=1),
        encoding_format=_encoding_format(data),
    )


def _include_usage(data: Mapping[str, Any], stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if not isinstance(options, dict):
        raise _bad(f"'stream_options' must be an object, got {_type_name(options)}.", "stream_options")
    return _optional_bool(options, "include_usage", where="stream_options.")


def _encoding_format(data: Mapping[str, Any]) -> EmbeddingEncoding:
    value = data.get("encoding_format")
    if value is None:
        return EmbeddingEncoding.FLOAT
    try:
        return EmbeddingEncoding(value)
    except ValueError:
        raise _bad(
            f"'encoding_format' must be 'float' or 'base64', got {echo(value)}.",
            "encoding_format",
            "invalid_value",
        ) from None


def _optional_bool(data: Mapping[str, Any], key: str, *, where: str = "") -> bool:
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{where}{key}' must be a boolean, got {_type_name(value)}.", f"{where}{key}")
    return value


def _optional_str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(f"'{key}' must be a string, got {_type_name(value)}.", key)
    return value


def _optional_int(
    data: Mapping[str, Any], key: str, *, minimum: int, maximum: int | None = None
) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    # OpenAI and vLLM refuse 4.0 where an integer is expected; so does the gateway, rather than forward a
    # request the model server refuses after it was charged to the quota
    if not _is_int(value):
        raise _bad(f"'{key}' must be an integer, got {_type_name(value)}.", key)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise _bad(f"'{key}' must be {bound}, got {value}.", key, "invalid_value")
    return int(value)


def _parse_prompts(data: Mapping[str, Any], field: str) -> tuple[Prompt, ...]:
    value = data.get(field)
    if value is None:
        raise _bad(f"you must provide the '{field}' parameter", field)
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        if not value:
            raise _bad(f"'{field}' must not be an empty array.", field)
        if isinstance(value[0], int | float):
            # a token array: name the first element that is not a token id
            return (_token_array(value, field),)
        prompts: list[Prompt] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                prompts.append(item)
            elif isinstance(item, list) and item:
                prompts.append(_token_array(item, f"{field}[{i}]"))
            else:
                raise _bad(
                    f"'{field}[{i}]' must be a string or a non-empty array of token ids, got "
                    f"{_type_name(item)}.",
                    f"{field}[{i}]",
                )
        return tuple(prompts)
    raise _bad(
        f"'{field}' must be a string, an array of strings, or token arrays, got {_type_name(value)}.", field
    )


def _token_array(items: list[Any], where: str) -> tuple[int, ...]:
    # name the first element that is not a token id (its own index, not the prompt's)
    for j, t in enumerate(items):
        if not _is_int(t) or t < 0:
            raise _bad(
                f"'{where}[{j}]' must be a non-negative integer token id, got {_type_name(t)} {echo(t, 32)}.",
                f"{where}[{j}]",
            )
    if not items:
        raise _bad(f"'{where}' must not be an empty array.", where)
    return tuple(items)


def _parse_messages(value: object, unknown: list[str]) -> tuple[ChatMessage, ...]:
    if value is None:
        raise _bad("you must provide the 'messages' parameter", "messages")
    if not isinstance(value, list):
        raise _bad(f"'messages' must be an array, got {_type_name(value)}.", "messages")
    if not value:
        raise _bad("'messages' must contain at least one message.", "messages", "empty_array")
    return tuple(_parse_message(i, m, unknown) for i, m in enumerate(value))


def _parse_message(i: int, msg: object, unknown: list[str]) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _bad(f"'{where}' must be an object, got {_type_name(msg)}.", where)
    role = _message_role(where, msg)
    name = msg.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad(f"'{where}.name' must be a string, got {_type_name(name)}.", f"{where}.name")

    texts: list[str] = []
    images: list[ImageDetail] = []
    content = msg.get("content")
    if not _collect_content(where, content, texts, images, unknown):
        if content is not None:
            raise _bad_content(where, content)
        if role != "assistant":
            raise _bad(
                f"'{where}.content' is required for a {echo(role, 32)!r} message (null is allowed only "
                "for an assistant message with tool_calls).",
                f"{where}.content",
            )

    tool_calls = msg.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise _bad(f"'{where}.tool_calls' must be an array.", f"{where}.tool_calls")
        for j, call in enumerate(tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise _bad(
                    f"'{where}.tool_calls[{j}].function' must be an object.", f"{where}.tool_calls[{j}]"
                )
            _function_texts(f"{where}.tool_calls[{j}].function", fn, texts)
    function_call = msg.get("function_call")
    if function_call is not None:
        if not isinstance(function_call, dict):
            raise _bad(f"'{where}.function_call' must be an object.", f"{where}.function_call")
        _function_texts(f"{where}.function_call", function_call, texts)
    tool_call_id = msg.get("tool_call_id")
    if tool_call_id is not None:
        if not isinstance(tool_call_id, str):
            raise _bad(f"'{where}.tool_call_id' must be a string.", f"{where}.tool_call_id")
        texts.append(tool_call_id)
    return ChatMessage(role=role, name=name, texts=tuple(texts), images=tuple(images))


def _function_texts(where: str, fn: Mapping[str, Any], texts: list[str]) -> None:
    for key in ("name", "arguments"):
        value = fn.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _bad(f"'{where}.{key}' must be a string, got {_type_name(value)}.", f"{where}.{key}")
        texts.append(value)


def _parse_part(
    where: str, part: object, texts: list[str], images: list[ImageDetail], unknown: list[str]
) -> None:
    # OpenAI refuses a bare string inside a content array ("expected an object"); so does the gateway
    if not isinstance(part, dict):
        raise _bad(f"'{where}' must be a content part object, got {_type_name(part)}.", where)
    kind = part.get("type")
    if isinstance(kind, str) and kind in _TEXT_PARTS:
        key = _TEXT_PARTS[kind]
        value = part.get(key)
        if not isinstance(value, str):
            raise _bad(f"'{where}.{key}' must be a string, got {_type_name(value)}.", f"{where}.{key}")
        texts.append(value)
    elif kind in ("image_url", "input_image"):
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if kind == "input_image" and url is None:
            url = part.get("file_id")  # the Responses API takes an uploaded file instead of a URL
        if not isinstance(url, str):
            raise _bad(f"'{where}.image_url.url' must be a string.", f"{where}.image_url")
        detail = image.get("detail") if isinstance(image, dict) else part.get("detail")
        try:
            images.append(ImageDetail(detail) if detail is not None else ImageDetail.AUTO)
        except ValueError:
            raise _bad(
                f"'{where}.image_url.detail' must be one of 'low', 'high', 'auto', got {echo(detail)!r}.",
                f"{where}.image_url.detail",
                "invalid_value",
            ) from None
    elif isinstance(kind, str) and kind:
        # input_audio, file, input_file and future part types: counted by the tokens of their compact JSON
        # (module docstring); reported so the caller can log them
        texts.append(_compact_json(part))
        unknown.append(echo(kind, 64))
    else:
        raise _bad(f"'{where}.type' must be a non-empty string, got {_type_name(kind)}.", f"{where}.type")


#: Content part type -> the key holding its text (chat and Responses API parts).
_TEXT_PARTS: Final[Mapping[str, str]] = {
    "text": "text",
    "refusal": "refusal",
    "input_text": "text",
    "output_text": "text",
}


def _parse_responses(
    data: Mapping[str, Any], model: str, *, stream: bool, user: str | None
) -> InferenceRequest:
    """A ``POST /v1/responses`` body as a conversation (see the module docstring)."""
    unknown: list[str] = []
    messages: list[ChatMessage] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad(f"'instructions' must be a string, got {_type_name(instructions)}.", "instructions")
        messages.append(ChatMessage(role="system", texts=(instructions,)))
    value = data.get("input")
    if value is None:
        raise _bad("you must provide the 'input' parameter", "input")
    if isinstance(value, str):
        messages.append(ChatMessage(role="user", texts=(value,)))
    elif isinstance(value, list):
        if not value:
            raise _bad("'input' must not be an empty array.", "input", "empty_array")
        for i, item in enumerate(value):
            messages.append(_parse_input_item(i, item, unknown))
    else:
        raise _bad(f"'input' must be a string or an array of input items, got {_type_name(value)}.", "input")
    if data.get("stream_options") is not None and not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    max_output = _optional_int(data, "max_output_tokens", minimum=1)
    return InferenceRequest(
        kind=EndpointKind.RESPONSES,
        model=model,
        messages=tuple(messages),
        tools_json=_tools_json(data),
        max_output_tokens=max_output,
        largest_output_tokens=max_output,
        stream=stream,
        user=user,
        unknown_parts=tuple(unknown),
    )


def _parse_input_item(i: int, item: object, unknown: list[str]) -> ChatMessage:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise _bad(f"'{where}' must be an input item object, got {_type_name(item)}.", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return _parse_message_like(where, item, unknown)
    texts: list[str] = []
    if kind == "function_call":
        _function_texts(where, item, texts)
        call_id = item.get("call_id")
        if isinstance(call_id, str):
            texts.append(call_id)
        return ChatMessage(role="assistant", texts=tuple(texts))
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise _bad(f"'{where}.output' must be a string, got {_type_name(output)}.", f"{where}.output")
        return ChatMessage(role="tool", texts=(output,))
    if not isinstance(kind, str) or not kind:
        raise _bad(f"'{where}.type' must be a non-empty string, got {_type_name(kind)}.", f"{where}.type")
    # reasoning, item_reference, built-in tool calls...: counted by their JSON, reported
    unknown.append(echo(kind, 64))
    return ChatMessage(role="assistant", texts=(_compact_json(item),))


def _message_role(where: str, msg: Mapping[str, Any]) -> str:
    """A message's ``role``: a non-empty string, else a 400 naming ``<where>.role``."""
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise _bad(f"'{where}.role' must be a non-empty string, got {_type_name(role)}.", f"{where}.role")
    return role


def _bad_content(where: str, content: object) -> RequestError:
    return _bad(
        f"'{where}.content' must be a string or an array of content parts, got {_type_name(content)}.",
        f"{where}.content",
    )


def _collect_content(
    where: str, content: object, texts: list[str], images: list[ImageDetail], unknown: list[str]
) -> bool:
    """Add a message's content (a string, or an array of content parts) to ``texts``/``images``; False when
    the content is neither (the caller decides whether null is allowed)."""
    if isinstance(content, str):
        texts.append(content)
        return True
    if isinstance(content, list):
        for j, part in enumerate(content):
            _parse_part(f"{where}.content[{j}]", part, texts, images, unknown)
        return True
    return False


def _parse_message_like(where: str, msg: Mapping[str, Any], unknown: list[str]) -> ChatMessage:
    role = _message_role(where, msg)
    texts: list[str] = []
    images: list[ImageDetail] = []
    content = msg.get("content")
    if not _collect_content(where, content, texts, images, unknown):
        raise _bad_content(where, content)
    return ChatMessage(role=role, texts=tuple(texts), images=tuple(images))


def _tools_json(data: Mapping[str, Any]) -> str | None:
    defs: list[Any] = []
    for key in ("tools", "functions"):
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            raise _bad(f"'{key}' must be an array, got {_type_name(value)}.", key)
        defs.extend(value)
    if not defs:
        return None
    # OpenAI renders definitions into the prompt in an internal format; their compact JSON is a
    # documented stand-in of similar size
    return _compact_json(defs)


def _compact_json(value: object) -> str:
    """``value``'s compact JSON (what unknown parts and tool definitions are counted by).

    Raises:
        RequestError: 400 when it nests too deeply to encode (the decoder's limit and the encoder's both
            come from the interpreter's recursion limit, reached a few levels apart).
    """
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise _bad("The request body is nested too deeply to parse.", None) from None
