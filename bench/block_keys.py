"""The gateway's block keys of a request (inferlb.request.blocks): CPU per request at 1k, 6k and 32k-token
chat prompts. Not a test: it prints one table.

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

Cells are shuffled per round (``--rounds``), each timing ``--calls`` calls; the table gives the median of the
rounds' per-call means (us) and the ratio to ``keys, no memo``.

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

from inferlb.request.blocks import _MEMO, block_keys_of_tokens, prompt_block_keys
from inferlb.request.parsing import EndpointKind, InferenceRequest, parse_request
from inferlb.request.prompt_ids import conversation_ids, prompt_token_ids

SIZES = (1_000, 6_000, 32_000)


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

    def next_turn() -> Any:
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
    names = list(cells(*convs[SIZES[0]]))
    means: dict[tuple[int, str], list[float]] = {(n, c): [] for n in SIZES for c in names}
    for _ in range(args.rounds):
        order = [(n, c) for n in SIZES for c in names]
        rng.shuffle(order)
        for n, c in order:
            fn = cells(*convs[n])[c]
            total = 0.0
            for _ in range(args.calls):
                t0 = time.perf_counter()
                r = fn()
                elapsed = time.perf_counter() - t0
                total += r if c == "prompt_block_keys, next turn" else elapsed
            means[(n, c)].append(total / args.calls * 1e6)
    table = Table(title=f"block keys per request, us (median of {args.rounds} rounds x {args.calls} calls)")
    table.add_column("cell")
    for n in SIZES:
        tokens = len(prompt_token_ids(convs[n][1])[0])
        table.add_column(f"{tokens:,} tokens ({tokens // 16} blocks)", justify="right")
    for c in names:
        row = []
        for n in SIZES:
            med = statistics.median(means[(n, c)])
            base = statistics.median(means[(n, "keys, no memo")])
            row.append(f"{med:,.1f} ({med / base:.2f}x)")
        table.add_row(c, *row)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
