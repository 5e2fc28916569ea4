"""The gateway's block keys of a request (inferlb.request.blocks) and the precise index they are matched in
(inferlb.policy.kv_index): CPU per call at 1k, 6k and 32k-token prompts. Not a test: it prints two tables.

**Keys.**
Each prompt is a conversation (a long system prompt, one earlier turn, a new user question); the text ids
are cached (as they are once the gateway has seen a text), so the cells time the layout and the keys:

* ``layout``: the prompt's token ids alone (:func:`inferlb.request.prompt_ids.conversation_ids`);
* ``keys, blake2b``: the layout, then the chained keys with 8-byte BLAKE2b (keyed on the parent) instead of
  XXH3: the alternative in the standard library;
* ``keys, no memo``: the layout, then :func:`inferlb.request.blocks.block_keys_of_tokens` over all of it;
* ``prompt_block_keys, cold``: :func:`~inferlb.request.blocks.prompt_block_keys` with the memo emptied first
  (a conversation never seen);
* ``prompt_block_keys, next turn``: the same after the previous turn (the conversation without its last
  question) was keyed: what a chat client's every turn costs.

**The precise index.**

* ``apply BlockStored + BlockRemoved``: one ``BlockStored`` event of a whole prompt (its keys recomputed from
  its token ids, the maps updated) and the ``BlockRemoved`` of the same blocks, on an endpoint holding 20
  other prompts; per event pair.
* ``match, all N hold it`` / ``match, one of N holds it``: :meth:`PreciseKvIndex.matched_blocks` of the
  prompt's keys over N endpoints (8, 64, 256) when every endpoint holds the whole prompt (the worst case:
  the run never ends early) or one does.

Cells (both tables) are shuffled per round (``--rounds``), each timing ``--calls`` calls; a table gives the
median of the rounds' per-call means (us), the keys' also the ratio to ``keys, no memo``.

Usage: ``.venv/bin/python bench/block_keys.py [--rounds 7] [--calls 40]``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from inferlb.policy.kv_index import BlockRemoved, BlockStored, PreciseKvIndex
from inferlb.request.blocks import _MEMO, block_keys_of_tokens, prompt_block_keys
from inferlb.request.parsing import EndpointKind, InferenceRequest, parse_request
from inferlb.request.prompt_ids import conversation_ids, prompt_token_ids

SIZES = (1_000, 6_000, 32_000)
ENDPOINTS = (8, 64, 256)


def chat(messages: list[dict[str, str]]) -> InferenceRequest:
    body = msgspec.json.encode({"model": "m", "messages": messages})
    return parse_request(EndpointKind.CHAT_COMPLETIONS, body)


def conversation(tokens: int) -> tuple[InferenceRequest, InferenceRequest]:
    """(the previous turn, the next turn) of a conversation whose next turn has about ``tokens`` prompt
    tokens."""
    turn = [
        {"role": "user", "content": "What does the first section say about caching? " * 4},
        {"role": "assistant", "content": "It says that blocks are chained on their parents. " * 4},
    ]
    question = {"role": "user", "content": "And how does eviction pick its victims? " * 4}
    unit = "The fleet's prefix caches hold blocks of sixteen tokens each. "  # 12 tokens
    base = len(prompt_token_ids(chat([{"role": "system", "content": ""}, *turn, question]))[0])
    system = {"role": "system", "content": unit * max(1, (tokens - base) // 12)}
    return chat([system, *turn]), chat([system, *turn, question])


def blake2b_keys(req: InferenceRequest) -> list[bytes]:
    data = memoryview(conversation_ids(req)).cast("B")
    parent = b"\0" * 8
    out = []
    for offset in range(0, len(data) - 63, 64):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(data[offset : offset + 64])
        parent = h.digest()
        out.append(parent)
    return out


def cells(prev: InferenceRequest, nxt: InferenceRequest) -> dict[str, Callable[[], Any]]:
    def cold() -> Any:
        _MEMO.clear()
        return prompt_block_keys(nxt)

    def next_turn() -> float:
        """The seconds of the next turn alone (the previous turn's keying is not timed)."""
        _MEMO.clear()
        prompt_block_keys(prev)
        t0 = time.perf_counter()
        prompt_block_keys(nxt)
        return time.perf_counter() - t0

    return {
        "layout": lambda: conversation_ids(nxt),
        "keys, blake2b": lambda: blake2b_keys(nxt),
        "keys, no memo": lambda: block_keys_of_tokens(conversation_ids(nxt)),
        "prompt_block_keys, cold": cold,
        "prompt_block_keys, next turn": next_turn,
    }


def stored(prompt: int, tokens: int) -> BlockStored:
    """The ``BlockStored`` of the full blocks of a ``tokens``-token prompt."""
    tokens -= tokens % 16
    ids = tuple(range(prompt * 100_000, prompt * 100_000 + tokens))
    hashes = tuple(prompt * 10_000_000 + i for i in range(tokens // 16))
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=ids, block_size=16)


def index_cells(tokens: int) -> dict[str, Callable[[], Any]]:
    event = stored(0, tokens)
    removed = BlockRemoved(block_hashes=event.block_hashes)
    keys = block_keys_of_tokens(event.token_ids)
    busy = PreciseKvIndex()
    busy.apply("a", [stored(p, tokens) for p in range(1, 21)])
    out: dict[str, Callable[[], Any]] = {
        "apply BlockStored + BlockRemoved": lambda: busy.apply("a", [event, removed])
    }
    for n in ENDPOINTS:
        addresses = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(n)]
        every, one = PreciseKvIndex(), PreciseKvIndex()
        for a in addresses:
            every.apply(a, [event])
        one.apply(addresses[0], [event])
        out[f"match, all {n} hold it"] = lambda i=every, a=addresses: i.matched_blocks(keys, a)
        out[f"match, one of {n} holds it"] = lambda i=one, a=addresses: i.matched_blocks(keys, a)
    return out


def timed(
    cells: dict[tuple[int, str], Callable[[], Any]], rounds: int, calls: int, rng: random.Random
) -> dict[tuple[int, str], float]:
    """Each cell run ``calls`` times per round, cells shuffled per round: the median of the rounds' per-call
    means (us). A cell that returns a float has timed itself (seconds)."""
    means: dict[tuple[int, str], list[float]] = {c: [] for c in cells}
    order = list(cells)
    for _ in range(rounds):
        rng.shuffle(order)
        for cell in order:
            fn = cells[cell]
            total = 0.0
            for _ in range(calls):
                t0 = time.perf_counter()
                r = fn()
                total += r if isinstance(r, float) else time.perf_counter() - t0
            means[cell].append(total / calls * 1e6)
    return {c: statistics.median(m) for c, m in means.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    rng = random.Random(1)
    convs = {n: conversation(n) for n in SIZES}
    for prev, nxt in convs.values():  # the keys agree, and the text ids are cached from here on
        assert prompt_block_keys(nxt) == block_keys_of_tokens(prompt_token_ids(nxt)[0])
        prompt_block_keys(prev)
    key_cells = {(n, c): fn for n in SIZES for c, fn in cells(*convs[n]).items()}
    sizes = {n: len(prompt_token_ids(convs[n][1])[0]) for n in SIZES}
    idx_cells = {(n, c): fn for n in SIZES for c, fn in index_cells(sizes[n]).items()}
    med = timed({**key_cells, **idx_cells}, args.rounds, args.calls, rng)
    console = Console(width=160)
    for title, names in (("block keys per request", list(cells(*convs[SIZES[0]]))),
                         ("precise index per call", list(index_cells(16)))):  # fmt: skip
        table = Table(title=f"{title}, us (median of {args.rounds} rounds x {args.calls} calls)")
        table.add_column("cell")
        for n in SIZES:
            table.add_column(f"{sizes[n]:,} tokens ({sizes[n] // 16} blocks)", justify="right")
        for c in names:
            if (SIZES[0], c) in key_cells:
                row = [f"{med[(n, c)]:,.1f} ({med[(n, c)] / med[(n, 'keys, no memo')]:.2f}x)" for n in SIZES]
            else:
                row = [f"{med[(n, c)]:,.1f}" for n in SIZES]
            table.add_row(c, *row)
        console.print(table)


if __name__ == "__main__":
    main()
