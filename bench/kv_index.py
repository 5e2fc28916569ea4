"""The precise prefix index (inferlb.policy.kv_index): what applying KV events and matching a request cost.
Not a test: it prints one table.

* ``apply BlockStored``: one ``BlockStored`` event of a whole prompt (its keys recomputed from its token ids,
  then the maps updated) and the ``BlockRemoved`` of the same blocks, on an endpoint holding 20 other
  prompts; per event pair.
* ``match, all hold it`` / ``match, one holds it``: :meth:`PreciseKvIndex.matched_blocks` of the prompt's
  keys over N endpoints, when every endpoint holds the whole prompt (the worst case: the run never ends
  early) or one of them does.

Cells are shuffled per round (``--rounds``), each timing ``--calls`` calls; the table gives the median of the
rounds' per-call means (us).

Usage: ``.venv/bin/python bench/kv_index.py [--rounds 7] [--calls 20]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from inferlb.policy.kv_index import BlockRemoved, BlockStored, PreciseKvIndex
from inferlb.request.blocks import block_keys_of_tokens

SIZES = (1_024, 6_144, 32_768)
ENDPOINTS = (8, 64, 256)


def stored(prompt: int, tokens: int) -> BlockStored:
    ids = tuple(range(prompt * 100_000, prompt * 100_000 + tokens))
    hashes = tuple(prompt * 10_000_000 + i for i in range(tokens // 16))
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=ids, block_size=16)


def cells(tokens: int) -> dict[str, Callable[[], object]]:
    event = stored(0, tokens)
    removed = BlockRemoved(block_hashes=event.block_hashes)
    keys = block_keys_of_tokens(event.token_ids)
    out: dict[str, Callable[[], object]] = {}
    busy = PreciseKvIndex()
    busy.apply("a", [stored(p, tokens) for p in range(1, 21)])
    out["apply BlockStored + BlockRemoved"] = lambda: busy.apply("a", [event, removed])
    for n in ENDPOINTS:
        addresses = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(n)]
        every, one = PreciseKvIndex(), PreciseKvIndex()
        for a in addresses:
            every.apply(a, [event])
        one.apply(addresses[0], [event])
        out[f"match, all {n} hold it"] = lambda i=every, a=addresses: i.matched_blocks(keys, a)
        out[f"match, one of {n} holds it"] = lambda i=one, a=addresses: i.matched_blocks(keys, a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    rng = random.Random(1)
    table_cells = {n: cells(n) for n in SIZES}
    names = list(table_cells[SIZES[0]])
    means: dict[tuple[int, str], list[float]] = {(n, c): [] for n in SIZES for c in names}
    for _ in range(args.rounds):
        order = list(means)
        rng.shuffle(order)
        for n, c in order:
            fn = table_cells[n][c]
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            means[(n, c)].append((time.perf_counter() - t0) / args.calls * 1e6)
    table = Table(title=f"precise index, us per call (median of {args.rounds} rounds x {args.calls} calls)")
    table.add_column("cell")
    for n in SIZES:
        table.add_column(f"{n:,} tokens ({n // 16} blocks)", justify="right")
    for c in names:
        table.add_row(c, *(f"{statistics.median(means[(n, c)]):,.1f}" for n in SIZES))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
