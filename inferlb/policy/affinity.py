"""Affinity keys (pure): which requests should land on the same GPU.

Two keys, sent by ext_proc as request headers and hashed by Envoy on models whose cluster balances with
``ring_hash`` or ``maglev`` (routes carry a ``hash_policy`` on them, the cluster a bounded load,
``cluster.hash_balance_factor``):

- **prefix key** (:data:`inferlb.request.headers.PREFIX_KEY`): identifies the *opening* of a conversation, so
  every turn of one conversation maps to one GPU, whose KV cache (vLLM automatic prefix caching) holds the
  conversation so far. Exactly:

  * chat completions and responses: the messages from the first up to and including the **first** message
    with role ``user`` (system and developer prompts before it included). Turn 1
    ``[system, user1]`` and turn 5 ``[system, user1, assistant1, ..., user5]`` share the key, because a
    growing conversation only appends. A key over "every turn but the last user message" would change
    at every turn (turn 1's prefix is ``[system]``, turn 2's ``[system, user1, assistant1]``), and with
    it the GPU, which is what affinity is meant to avoid. Two conversations with the same system prompt
    but different first questions get different keys, so conversations spread over the pool.
    No user message at all: no key.
  * legacy completions: the first :data:`COMPLETION_PREFIX_CHARS` characters of the first text prompt, or
    the first :data:`COMPLETION_PREFIX_TOKENS` ids of the first token-array prompt (a client continuing a
    document appends to it).
  * embeddings: no key (nothing is cached across requests).

  Each message contributes its role, its ``name`` and every text and image detail it carries
  (:class:`inferlb.request.parsing.ChatMessage`), length-prefixed, so no two different openings encode alike.

- **session key** (:data:`inferlb.request.headers.SESSION_KEY`): the value of the configured session header
  (``ext_proc.session_header``) when the client sent it, else the request's OpenAI ``user`` field. Envoy
  uses it when there is no prefix key (the prefix hash policy is terminal).

Both are SHA-256 digests cut to :data:`KEY_HEX_CHARS` hex characters: header-safe whatever the client sent
(a ``user`` may hold CR/LF or non-ASCII), and the raw prompt or user id never reaches a model server in a
header.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from inferlb.request.parsing import ChatMessage, EndpointKind, InferenceRequest

#: Hex characters kept of each SHA-256 key (128 bits: collisions are not a concern at any fleet size).
KEY_HEX_CHARS: Final = 32
#: Characters of a legacy completion's first text prompt that make its prefix key.
COMPLETION_PREFIX_CHARS: Final = 1024
#: Token ids of a legacy completion's first token-array prompt that make its prefix key.
COMPLETION_PREFIX_TOKENS: Final = 256
#: ``cluster.lb_policy`` values whose routes hash on the affinity headers (xds_server.resources gives only
#: those routes a ``hash_policy``, from this same set); the keys of a request to any other model are never
#: read, so they need not be computed.
HASH_LB_POLICIES: Final = frozenset({"ring_hash", "maglev"})


@dataclass(frozen=True, kw_only=True, slots=True)
class AffinityKeys:
    """The affinity keys of one request (hex strings of :data:`KEY_HEX_CHARS`), each None when absent."""

    session: str | None
    prefix: str | None


#: The keys of a request whose model does not balance by hash.
NO_KEYS: Final = AffinityKeys(session=None, prefix=None)


def _digest(tag: bytes, parts: Sequence[str]) -> str:
    h = hashlib.sha256(tag)
    for p in parts:
        data = p.encode("utf-8", "surrogatepass")
        # length-prefixed: ("ab", "c") and ("a", "bc") must not collide
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:KEY_HEX_CHARS]


def conversation_opening(messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """The messages up to and including the first ``user`` message; empty when there is none."""
    for i, m in enumerate(messages):
        if m.role == "user":
            return tuple(messages[: i + 1])
    return ()


def prefix_key(request: InferenceRequest) -> str | None:
    """The prefix key of ``request`` (see the module docstring for exactly what it covers), or None."""
    if request.kind is EndpointKind.EMBEDDINGS:
        return None
    if request.messages:
        opening = conversation_opening(request.messages)
        if not opening:
            return None
        parts: list[str] = []
        for m in opening:
            parts += [m.role, m.name or "", str(len(m.texts)), *m.texts, str(len(m.images))]
            parts += [str(d) for d in m.images]
        return _digest(b"inferlb-chat\x00", parts)
    if request.prompts:
        first = request.prompts[0]
        if isinstance(first, str):
            return _digest(b"inferlb-text\x00", [first[:COMPLETION_PREFIX_CHARS]])
        ids = first[:COMPLETION_PREFIX_TOKENS]
        return _digest(b"inferlb-ids\x00", [",".join(str(t) for t in ids)])
    return None


def session_key(user: str | None, session_header_value: str | None) -> str | None:
    """The session key: a digest of the session header's value when given (non-empty), else of ``user``,
    else None."""
    value = session_header_value or user
    if not value:
        return None
    return _digest(b"inferlb-session\x00", [value])


def affinity_keys(request: InferenceRequest, session_header_value: str | None = None) -> AffinityKeys:
    """Both keys of ``request``; ``session_header_value`` is the configured session header as sent."""
    return AffinityKeys(session=session_key(request.user, session_header_value), prefix=prefix_key(request))
