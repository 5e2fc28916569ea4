"""The one rewrite of a request body the gateway makes before forwarding it: the canonical model name in
place of an alias, and ``stream_options.include_usage: true`` on a stream, both in a single pass.

Why the model: a client may name a model by an alias (config ``models[].aliases``); the model server only
knows the name it serves (vLLM answers 404 for ``llama3`` when it serves ``llama-3.1-8b-instruct``), so the
body must carry the canonical name. Why ``include_usage``: see :mod:`inferlb.request.usage` (streams are
billed from the model server's own usage event).

How: the top-level members of the JSON object are scanned once with the standard library's own JSON
scanner (the same parser :func:`json.loads` uses), keeping each value's position; only the values that
change are replaced, so every other byte of the body (whitespace, member order, escapes, number spelling,
the messages) reaches the model server as the client sent it. A missing ``stream_options`` member is spliced
in right after the opening brace. Duplicate top-level keys are legal JSON and Python's parser (vLLM's,
through FastAPI) keeps the last; every duplicate of a rewritten member is replaced, so any parser sees the
new value. A body in UTF-8 keeps its bytes; one in another encoding :func:`json.loads` accepts (a UTF-8
BOM, UTF-16, UTF-32) comes out as UTF-8, the encoding JSON over HTTP must use (RFC 8259 section 8.1).

Each rewrite also comes as byte splices of the client's body (:class:`BodySplice`, offsets in the original
bytes), for a proxy that applies them itself (the ext_authz mode's Envoy Lua filter: ext_authz cannot change
a body); a body that was not UTF-8 has none (its every byte changes).

Pure: bytes in, bytes out.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

_INCLUDE_USAGE_MEMBER: Final = '"stream_options":{"include_usage":true},'
_WHITESPACE: Final = re.compile(r"[ \t\n\r]*")
_DECODER: Final[Any] = json.JSONDecoder()  # Any: typeshed does not declare its scan_once attribute
#: The scanner behind :func:`json.loads` (``scan_once(text, index) -> (value, end)``, the C one when
#: present); it holds the GIL for a whole call and clears its memo after each one, so threads may share it.
_SCAN_ONCE: Final[Callable[[str, int], tuple[Any, int]]] = _DECODER.scan_once


@dataclass(frozen=True, kw_only=True, slots=True)
class BodySplice:
    """Replace ``removed`` bytes at byte ``offset`` of the original body with ``inserted``.

    Attributes:
        offset: byte offset in the client's body (0-based).
        removed: how many bytes to drop from there (0: a pure insertion).
        inserted: the bytes put in their place (UTF-8 JSON text).
    """

    offset: int
    removed: int
    inserted: bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestRewritten:
    """A request body changed for the model server.

    Attributes:
        body: the new body: valid JSON, its length differs from the original, so the caller must set the
            upstream ``content-length`` to ``len(body)``.
        model_renamed: ``model`` was replaced by the canonical name.
        include_usage_added: ``stream_options.include_usage: true`` was set (the client did not ask for the
            usage event, so it must be stripped from the stream it gets back).
        splices: ``body`` as splices of the original body, in increasing offset order, not overlapping
            (applying them to the original gives ``body`` byte for byte); None when the original was not
            UTF-8 (it was re-encoded whole).
    """

    body: bytes
    model_renamed: bool
    include_usage_added: bool
    splices: tuple[BodySplice, ...] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class _Member:
    """One top-level member: its key, its decoded value, and the [start, end) span of the value's text."""

    key: str
    value: Any
    start: int
    end: int


def _skip_ws(text: str, index: int) -> int:
    match = _WHITESPACE.match(text, index)
    return index if match is None else match.end()


def _top_level_members(text: str) -> tuple[int, list[_Member]]:
    """The index just after the object's ``{`` and its members in order.

    Raises:
        ValueError: ``text`` is not one JSON object (:class:`json.JSONDecodeError` is one).
    """
    index = _skip_ws(text, 0)
    if not text.startswith("{", index):
        raise ValueError("the request body is not a JSON object")
    after_brace = index + 1
    members: list[_Member] = []
    index = _skip_ws(text, after_brace)
    if text.startswith("}", index):
        index += 1
    else:
        while True:
            if not text.startswith('"', index):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, index)
            key, index = _SCAN_ONCE(text, index)
            index = _skip_ws(text, index)
            if not text.startswith(":", index):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, index)
            start = _skip_ws(text, index + 1)
            try:
                value, index = _SCAN_ONCE(text, start)
            except StopIteration as exc:
                raise json.JSONDecodeError("Expecting value", text, exc.value) from None
            members.append(_Member(key=key, value=value, start=start, end=index))
            index = _skip_ws(text, index)
            if text.startswith(",", index):
                index = _skip_ws(text, index + 1)
                continue
            if text.startswith("}", index):
                index += 1
                break
            raise json.JSONDecodeError("Expecting ',' delimiter", text, index)
    if _skip_ws(text, index) != len(text):
        raise json.JSONDecodeError("Extra data", text, index)
    return after_brace, members


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def rewrite_request(
    body: bytes, *, model: str | None = None, include_usage: bool = False
) -> RequestRewritten | None:
    """``body`` with ``model`` set to ``model`` and/or ``stream_options.include_usage`` set, in one pass; None
    when nothing changes.

    Args:
        body: the client's request body, a JSON object (already checked by
            :func:`inferlb.request.parsing.parse_request`).
        model: the canonical model name to send upstream, or None to leave ``model`` alone. A body whose
            ``model`` already equals it (or that has no ``model``) is not renamed.
        include_usage: ask a streamed request (``"stream": true``) for its usage event; a request that does
            not stream, or already sets ``stream_options.include_usage: true``, is left alone.

    Raises:
        ValueError: ``body`` is not a JSON object (includes :class:`json.JSONDecodeError` and
            :class:`UnicodeDecodeError`).
    """
    encoding = json.detect_encoding(body)
    # surrogatepass both ways, as json.loads decodes: whatever it accepted round-trips byte for byte
    text = body.decode(encoding, "surrogatepass")
    after_brace, members = _top_level_members(text)
    last = {m.key: m for m in members}  # the last duplicate wins, as in json.loads
    edits: dict[str, str] = {}  # key -> the new value's JSON text, for every member with that key
    splice = ""
    model_member = last.get("model")
    renamed = model is not None and model_member is not None and model_member.value != model
    if renamed:
        edits["model"] = _dump(model)
    usage_added = False
    stream = last.get("stream")
    if include_usage and stream is not None and stream.value is True:
        options_member = last.get("stream_options")
        options = None if options_member is None else options_member.value
        if options_member is None:
            splice = _INCLUDE_USAGE_MEMBER
            usage_added = True
        elif not (isinstance(options, dict) and options.get("include_usage") is True):
            new_options = dict(options) if isinstance(options, dict) else {}
            new_options["include_usage"] = True
            edits["stream_options"] = _dump(new_options)
            usage_added = True
    if not (renamed or usage_added):
        return None
    parts = [text[:after_brace], splice]
    # (start, end, new text) in character offsets, in order
    spans: list[tuple[int, int, str]] = [(after_brace, after_brace, splice)] if splice else []
    cursor = after_brace
    for m in members:
        new = edits.get(m.key)
        if new is not None:
            parts += [text[cursor : m.start], new]
            spans.append((m.start, m.end, new))
            cursor = m.end
    parts.append(text[cursor:])
    out = "".join(parts).encode("utf-8", "surrogatepass")
    splices = _byte_splices(text, spans) if encoding == "utf-8" else None
    return RequestRewritten(body=out, model_renamed=renamed, include_usage_added=usage_added, splices=splices)


def _byte_splices(text: str, spans: list[tuple[int, int, str]]) -> tuple[BodySplice, ...]:
    """``spans`` (character offsets into ``text``, the UTF-8 body decoded) as byte splices of the body."""
    out: list[BodySplice] = []
    byte_at = char_at = 0
    for start, end, new in spans:
        # byte offsets grow by the encoded length of the text between spans (ASCII: one byte a character)
        byte_at += len(text[char_at:start].encode("utf-8", "surrogatepass"))
        removed = len(text[start:end].encode("utf-8", "surrogatepass"))
        out.append(BodySplice(offset=byte_at, removed=removed, inserted=new.encode("utf-8", "surrogatepass")))
        byte_at += removed
        char_at = end
    return tuple(out)


def apply_splices(body: bytes, splices: tuple[BodySplice, ...]) -> bytes:
    """``body`` with ``splices`` (in increasing offset order, not overlapping) applied: what the Envoy Lua
    filter of the ext_authz mode does, in Python for tests and checks."""
    parts: list[bytes] = []
    cursor = 0
    for s in splices:
        parts += [body[cursor : s.offset], s.inserted]
        cursor = s.offset + s.removed
    parts.append(body[cursor:])
    return b"".join(parts)


def encode_splices(length: int, splices: tuple[BodySplice, ...]) -> str:
    """The header value carrying ``splices`` of a ``length``-byte body to Envoy's Lua filter:
    ``LENGTH;OFFSET:REMOVED:INSERTED;...``, decimal numbers, ``INSERTED`` percent-encoded (RFC 3986: every
    byte but ``A-Z a-z 0-9 - . _ ~`` as ``%XX``), so any bytes travel in a header. The filter refuses a body
    whose length is not ``LENGTH`` (it is not the body these offsets were computed on)."""
    fields = [str(length)]
    fields += [f"{s.offset}:{s.removed}:{urllib.parse.quote(s.inserted, safe='')}" for s in splices]
    return ";".join(fields)
