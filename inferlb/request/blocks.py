"""The block keys of a request's prompt: what the endpoint picker matches against the prefix caches.

A prompt's token ids (:mod:`inferlb.request.prompt_ids`, the layout gpusim caches) are cut into blocks of
``block_size`` tokens (vLLM's ``--block-size``, 16 by default); only full blocks have a key, as only full
blocks are cached (vLLM's design doc "Automatic Prefix Caching"). The key of a block covers its parent's key
and its own ids, like vLLM's ``hash_block_tokens(parent_block_hash, curr_block_token_ids, extra_keys)``, so
equal keys at position ``i`` mean equal prompts up to the end of block ``i``:

    key[0] = xxh3_64(ids[0:bs], seed=ROOT_KEY)
    key[i] = xxh3_64(ids[i*bs:(i+1)*bs], seed=key[i-1])

with the ids packed as 4-byte little-endian unsigned integers (token ids of real vocabularies fit) and
XXH3's 64-bit hash (xxHash, https://xxhash.com; 2-4x cheaper per block than 8-byte BLAKE2b here,
``bench/block_keys.py``). These keys are the gateway's own: a model server's block hashes (SHA-256 or
CBOR-SHA-256 in vLLM, seeded per process) are never compared with them. The precise index
(:mod:`inferlb.policy.kv_index`) recomputes them from the ``token_ids`` of the servers' ``BlockStored``
events with :func:`block_keys_of_tokens`, as llm-d's KV-cache indexer recomputes its own keys and maps the
engine's hashes to them. Not covered by the keys: what vLLM adds to a block's hash as extra keys (a LoRA
adapter, image contents, ``cache_salt``), so blocks of one token run under two adapters share a key here.
XXH3 is not collision-resistant against a crafted prompt: a collision can only steer a pick, never reuse
another prompt's KV cache (the server's own hashes decide that).

A chat client resends its whole conversation every turn, so the keys of each conversation are memoized at
its last message (an LRU of :data:`MEMO_KEYS` keys in all, keyed by the XXH3-128 digest of the ids up to that
block): the next turn finds its previous turn's blocks by the digest at each of its message ends, and hashes
only the blocks after the longest one found (``bench/block_keys.py`` gives the costs).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Final

import xxhash

from inferlb.request.parsing import InferenceRequest
from inferlb.request.prompt_ids import SizedLru, conversation_ids, text_ids

#: vLLM's default ``--block-size`` (tokens per KV-cache block).
DEFAULT_BLOCK_SIZE: Final = 16
#: The seed of a prompt's first block (the parent key of the root; any fixed value would do).
ROOT_KEY: Final = xxhash.xxh3_64_intdigest(b"inferlb block keys: the root")


def root_key(lora_name: str | None = None) -> int:
    """The parent key of a prompt's first block: :data:`ROOT_KEY` for the base model, a key of its own for
    each LoRA adapter (vLLM puts the adapter in a block's extra keys, so one token run cached under two
    adapters is two blocks)."""
    if lora_name is None:
        return ROOT_KEY
    return xxhash.xxh3_64_intdigest(lora_name.encode(), ROOT_KEY)


#: Keys the per-conversation memo holds at most (Python ints in tuples, ~40 bytes each: ~10 MiB).
MEMO_KEYS: Final = 1 << 18

_hash = xxhash.xxh3_64_intdigest
_LITTLE: Final = sys.byteorder == "little"


def _packed(token_ids: Sequence[int] | array[int]) -> array[int]:
    """``token_ids`` as an ``array('I')`` in little-endian order (the array itself when it is one already and
    the machine is little-endian). Raises OverflowError/TypeError for an id that is not in 0..2**32-1."""
    ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)
    if not _LITTLE:
        ids = array("I", ids)
        ids.byteswap()
    return ids


def _chain(data: memoryview, blocks: range, step: int, parent: int, out: array[int]) -> None:
    """Append the keys of the ``blocks`` of ``data`` (``step`` bytes each) to ``out``, the first chained on
    ``parent``."""
    append = out.append
    for offset in range(blocks.start * step, blocks.stop * step, step):
        parent = _hash(data[offset : offset + step], parent)
        append(parent)


def block_keys_of_tokens(
    token_ids: Sequence[int] | array[int], *, block_size: int = DEFAULT_BLOCK_SIZE, parent: int | None = None
) -> tuple[int, ...]:
    """The chained keys of the full blocks of ``token_ids`` (``len(token_ids) // block_size`` of them; a
    partial last block has none), the first chained on ``parent`` (the key of the block before them) or, when
    None, on :data:`ROOT_KEY` (they start a prompt). See the module doc for the formula.

    So ``block_keys_of_tokens(ids[k * bs:], parent=keys[k - 1]) == keys[k:]`` for
    ``keys = block_keys_of_tokens(ids)``: what the precise index relies on to key a ``BlockStored`` event's
    blocks on its parent's key.

    Raises:
        ValueError: ``block_size < 1``, ``parent`` outside 0..2**64-1, or a token id that is not an integer
            in 0..2**32-1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seed = ROOT_KEY if parent is None else parent
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"parent key must be in 0..2**64-1, got {seed}")
    try:
        ids = _packed(token_ids)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in 0..2**32-1") from None
    out = array("Q")
    _chain(memoryview(ids).cast("B"), range(len(ids) // block_size), 4 * block_size, seed, out)
    return tuple(out)


#: (block size, root key, XXH3-128 digest of a prompt's leading blocks) -> the keys of those blocks
_MEMO: SizedLru[tuple[int, int, bytes], tuple[int, ...]] = SizedLru(MEMO_KEYS, max_entry=MEMO_KEYS // 4)


def _conversation_keys(request: InferenceRequest, block_size: int, root: int) -> tuple[int, ...]:
    ends: list[int] = []
    ids = _packed(conversation_ids(request, message_ends=ends))
    data = memoryview(ids).cast("B")
    step = 4 * block_size
    # the digest of the ids up to the last full block before each message end, streamed in one pass; the
    # longest run of leading blocks memoized is where hashing resumes
    digest = xxhash.xxh3_128()
    hashed = 0
    best: tuple[int, ...] = ()
    last: bytes | None = None
    for end in ends:
        count = end // block_size
        if count == hashed:
            continue
        digest.update(data[hashed * step : count * step])
        hashed = count
        last = digest.digest()
        hit = _MEMO.get((block_size, root, last))
        if hit is not None:
            best = hit
    rest = array("Q")
    _chain(data, range(len(best), len(ids) // block_size), step, best[-1] if best else root, rest)
    # a tuple of the memoized keys and the new ones: the ints of the memoized prefix are shared, not copied
    keys = best + tuple(rest)
    if last is not None and len(best) < hashed:
        _MEMO.put((block_size, root, last), keys[:hashed])
    return keys


def prompt_block_keys(
    request: InferenceRequest, *, block_size: int = DEFAULT_BLOCK_SIZE, lora_name: str | None = None
) -> tuple[int, ...]:
    """The chained keys of the full blocks of the request's first prompt (see the module doc): the one prompt
    of a chat or responses request, the first prompt or input of a completions or embeddings request (each
    prompt is its own sequence in vLLM; the picker places the request by its first). Empty when the prompt
    has no full block, or is a token array with an id outside 0..2**32-1 (no vocabulary has one: the model
    server refuses it, no cache can hold it). ``lora_name``: the LoRA adapter the request runs on (its blocks
    chain on :func:`root_key` of it), None for the base model.

    Cost: one XXH3 call per block (per block not memoized, for a conversation); the figures at 1k, 6k and
    32k-token prompts are in ``bench/block_keys.py``'s table.

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    root = root_key(lora_name)
    if request.kind.is_conversation:
        return _conversation_keys(request, block_size, root)
    if not request.prompts:
        return ()
    first = request.prompts[0]
    if isinstance(first, str):
        return block_keys_of_tokens(text_ids(first), block_size=block_size, parent=root)
    try:
        return block_keys_of_tokens(first, block_size=block_size, parent=root)
    except ValueError:
        return ()
