"""The token ids of a request's prompts, for prefix caches: deterministic, and as many as the gateway
counts (:func:`inferlb.request.tokens.count_prompt_tokens`, which sets ``usage.prompt_tokens``).

Shared by the simulated GPUs (gpusim's prefix cache hashes these ids into its blocks and publishes them in
its KV events) and the gateway (:mod:`inferlb.request.blocks` cuts them into the block keys the endpoint
picker matches against those events), so both see one layout. A real vLLM renders a chat through the
model's chat template and tokenizes the result; neither side has the template, so the ids are laid out the
way the counting formula adds them up:

* **Text** is tokenized with the counter's encoding (tiktoken ``cl100k_base``, ``encode_ordinary``), in the
  segments :func:`inferlb.request.tokens.text_segments` cuts a long text into, with
  :data:`~inferlb.request.tokens.UNCLEAN_CUT_MARGIN` filler ids after each unclean cut: exactly
  :func:`inferlb.request.tokens.count_text` ids.
* **Chat and responses**: the tool definitions' JSON first (chat templates put the tools in the system
  turn), then per message ``[START] role [SEP] texts... [name NAME] [END]`` (the cookbook's 3 framing tokens
  per message, 1 more per name), the image placeholders of each image part, then the 3 reply-priming ids.
* **Completions and embeddings**: one id sequence per prompt (each prompt is its own sequence in vLLM);
  token-array prompts are their own ids.

So equal leading messages (or equal leading text of a prompt, up to a clean cut) give equal leading ids, and
equal leading full blocks give equal block hashes. What the layout cannot see: the content of an image
(``ChatMessage`` keeps only its detail, and vLLM hashes the image into the block's extra keys), so two
different images at the same place of equal conversations share their blocks here.

The ids of each text are kept in a bounded LRU (:data:`IDS_CACHE_TOKENS` ids in all), as a chat client
resends its conversation every turn.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sized
from typing import Final, Generic, TypeVar

from inferlb.request.parsing import InferenceRequest
from inferlb.request.tokens import (
    REPLY_PRIMING_TOKENS,
    SEGMENT_CHARS,
    UNCLEAN_CUT_MARGIN,
    image_tokens,
    offline_encoding,
    text_segments,
)

#: Ids of the framing tokens: cl100k's ``<|im_start|>`` / ``<|im_end|>`` and its newline, so they never
#: collide with an ordinary text token's meaning (any fixed ids would do).
START_ID: Final = 100264
END_ID: Final = 100265
SEP_ID: Final = 198
#: The id after a message's name (the cookbook's extra token per name).
NAME_ID: Final = 25
#: The placeholder id of every image token, and the filler after an unclean cut.
IMAGE_ID: Final = 100266
FILLER_ID: Final = 100267
#: The reply priming (``<|start|>assistant<|message|>``).
PRIMING_IDS: Final = (START_ID, 78191, SEP_ID)
#: Budget of the per-text ids cache (ids, 4 bytes each: 16 MiB).
IDS_CACHE_TOKENS: Final = 4 * 1024 * 1024
#: Texts of more ids than this are not cached (1/16 of the budget).
IDS_CACHE_MAX_ENTRY: Final = IDS_CACHE_TOKENS // 16

assert len(PRIMING_IDS) == REPLY_PRIMING_TOKENS

K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Sized)


class SizedLru(Generic[K, V]):
    """key -> value, least recently used first out, bounded in the values' total ``len`` (ids, keys);
    thread-safe. A value longer than ``max_entry`` is not kept.

    Args:
        max_total: the bound on the values' lengths together.
        max_entry: the longest value kept.
    """

    def __init__(self, max_total: int, *, max_entry: int) -> None:
        self.max_total = max_total
        self.max_entry = max_entry
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key`` (unless it is longer than ``max_entry`` or ``key`` is held), dropping
        the least recently used values past ``max_total``."""
        if len(value) > self.max_entry:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = value
            self._total += len(value)
            while self._total > self.max_total:
                _, old = self._entries.popitem(last=False)
                self._total -= len(old)

    def clear(self) -> None:
        """Drop every value."""
        with self._lock:
            self._entries.clear()
            self._total = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total(self) -> int:
        """The values' lengths together (<= ``max_total``)."""
        return self._total


#: text -> its ids (an ``array('I')``)
_CACHE: SizedLru[str, array[int]] = SizedLru(IDS_CACHE_TOKENS, max_entry=IDS_CACHE_MAX_ENTRY)


def text_ids(text: str) -> array[int]:
    """The ids of ``text``: ``encode_ordinary`` per segment, :data:`FILLER_ID` per unclean-cut margin token;
    ``len`` equals :func:`inferlb.request.tokens.count_text` with the default counter."""
    hit = _CACHE.get(text)
    if hit is not None:
        return hit
    enc = offline_encoding()
    ids = array("I")
    if len(text) <= SEGMENT_CHARS:
        ids.extend(enc.encode_ordinary(text))
    else:
        for segment, unclean in text_segments(text):
            ids.extend(enc.encode_ordinary(segment))
            ids.extend([FILLER_ID] * (unclean * UNCLEAN_CUT_MARGIN))
    _CACHE.put(text, ids)
    return ids


def prompt_token_ids(request: InferenceRequest) -> tuple[tuple[int, ...], ...]:
    """The token ids of each of the request's prompts (see the module doc): one sequence for chat and
    responses, one per prompt or input for completions and embeddings. Their lengths add up to
    :func:`inferlb.request.tokens.count_prompt_tokens` of the request with the default counter and image
    estimate."""
    if not request.kind.is_conversation:
        return tuple(p if isinstance(p, tuple) else tuple(text_ids(p)) for p in request.prompts)
    return (tuple(conversation_ids(request)),)


def conversation_ids(request: InferenceRequest, *, message_ends: list[int] | None = None) -> array[int]:
    """The token ids of a chat or responses request's one prompt (see the module doc), as a new
    ``array('I')`` (what :func:`prompt_token_ids` gives as a tuple, without the tuple).

    Args:
        request: a chat or responses request (for another kind: the tool definitions and the priming).
        message_ends: when given, the count of ids after each message is appended to it (one per message,
            the last before the reply priming): where a conversation resent with more turns first differs
            from its previous send (:mod:`inferlb.request.blocks` memoizes its keys there).
    """
    ids = array("I")
    if request.tools_json is not None:
        ids.extend(text_ids(request.tools_json))
    for m in request.messages:
        ids.append(START_ID)
        ids.extend(text_ids(m.role))
        ids.append(SEP_ID)
        for t in m.texts:
            ids.extend(text_ids(t))
        if m.name is not None:
            ids.extend(text_ids(m.name))
            ids.append(NAME_ID)
        ids.append(END_ID)
        for detail in m.images:
            ids.extend([IMAGE_ID] * image_tokens(detail))
        if message_ends is not None:
            message_ends.append(len(ids))
    ids.extend(PRIMING_IDS)
    return ids
