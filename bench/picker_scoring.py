"""The endpoint picker's CPU cost per pick (:func:`inferlb.policy.picker.pick`); prints a table.

For fleets of ``--sizes`` endpoints (loads, KV usage and in-flight tokens drawn once per fleet from a seeded
generator; a few endpoints holding part of the prompt), it times ``pick`` on a 32-block prompt with
exact scoring and with sampled candidates (``PickerWeights.candidates = k``: the ``k`` best-matching plus
the ``k`` least loaded of ``2k`` drawn), the cells interleaved round by round so that machine noise lands on
every cell alike, and reports the median microseconds per pick of ``--rounds`` rounds of ``--picks`` picks
(``time.process_time``: CPU, not wall), for a prompt whose prefix four endpoints hold in part and for one
no endpoint holds. It also reports how often each first choice is the exact one, and the mean rank of
the choice in the exact order (a percentile of the eligible endpoints). Further rows per fleet time:
the product's columnar picker (:class:`inferlb.policy.columnar.FleetColumns`, the same picks as exact
``pick``: "same as exact" counts whole host lists); the request path's use of it (an
:class:`~inferlb.policy.endpoint_book.EndpointBook` holding the fleet's telemetry: ``columns()`` and
``FleetColumns.pick``, or below ``COLUMNAR_MIN_ENDPOINTS`` ``states()`` and ``pick``, plus the pick's
``enter`` and ``leave``; compared with ``pick`` over the book's ``states()``); and the earlier bench-only
prototype over numpy columns (:class:`Columns`, first choice only).

Usage: ``.venv/bin/python bench/picker_scoring.py [--sizes 8 100 1000] [--rounds 7] [--picks 300]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import TypedDict

from rich.console import Console
from rich.table import Table

from inferlb.policy.columnar import FleetColumns
from inferlb.policy.endpoint_book import BookedEndpoint, BookedState, EndpointBook
from inferlb.policy.picker import EndpointState, PickerWeights, pick

COLUMNAR = "columnar numpy (prototype)"
PRODUCT = "FleetColumns (product)"
BOOK = "EndpointBook path"


class Args(TypedDict):
    """The request's arguments of every pick here."""

    prompt_blocks: int
    prompt_tokens: int
    block_tokens: int


ARGS: Args = {"prompt_blocks": 32, "prompt_tokens": 16384, "block_tokens": 512}


def fleet(n: int, seed: int) -> list[EndpointState]:
    """``n`` endpoints of mixed capacity and load (seeded)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        w = rng.choice((1.0, 1.7, 3.4))
        in_flight = rng.randrange(0, int(16 * w) + 1)
        out.append(
            EndpointState(
                address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000",
                weight=w,
                in_flight=in_flight,
                waiting=float(rng.randrange(0, 3)),
                kv_usage=rng.random(),
                prefill_tokens=float(rng.randrange(0, 4) * 2000),
                decode_tokens=float(in_flight * rng.randrange(100, 800)),
            )
        )
    return out


class Columns:
    """A fleet's state as numpy columns, as a caller could keep them (updated in place per request): the
    bench-only prototype of a vectorised :func:`pick` (first choice only, ties to the lowest index instead
    of the salted hash; no fallback list)."""

    def __init__(self, eps: list[EndpointState]) -> None:
        import numpy as np  # noqa: PLC0415 - bench-only (matplotlib's dependency)

        self.np = np
        self.addresses = [e.address for e in eps]
        self.index = {a: i for i, a in enumerate(self.addresses)}
        self.ok = np.array([e.healthy and e.weight > 0 for e in eps])
        self.weight = np.array([e.weight for e in eps])
        self.outstanding = np.array([e.in_flight + e.waiting for e in eps], dtype=float)
        self.kv = np.clip(np.array([e.kv_usage for e in eps]), 0.0, 1.0)
        self.prefill = np.array([e.prefill_tokens for e in eps])

    def pick(self, matched: dict[str, int], prompt_blocks: int, prompt_tokens: int, block_tokens: int) -> str:
        """The first choice by :func:`pick`'s rule with the default weights."""
        np, w = self.np, PickerWeights()
        ok, weight, out = self.ok, self.weight, self.outstanding
        total_weight = weight[ok].sum()
        work = out[ok].sum() + 1.0
        within = ok & (out + 1.0 <= np.ceil(w.load_factor * work / total_weight * weight))
        m = np.zeros(len(weight))
        for a, b in matched.items():
            m[self.index[a]] = min(b, prompt_blocks)
        score = (
            w.prefix * m / prompt_blocks
            - w.load * total_weight / work * out / weight
            - w.kv * self.kv
            - w.tokens
            / prompt_tokens
            * (self.prefill + np.maximum(prompt_tokens - block_tokens * m, 0))
            / weight
        )
        score[~within] = -np.inf
        return self.addresses[int(np.argmax(score))]


def book_of(eps: list[EndpointState]) -> EndpointBook:
    """A request path's book of ``eps`` (weights, health, queues and KV usage fresh; in-flight counts are
    the book's own, none yet)."""
    rows = tuple(
        BookedEndpoint(address=e.address, weight=e.weight, healthy=e.healthy, waiting=e.waiting,
                       kv_usage=e.kv_usage, telemetry_age_ms=0.0)
        for e in eps
    )  # fmt: skip
    return EndpointBook(BookedState(clusters={"c": rows}, stale_after_ms=1e12), received_at=0.0)


def book_pick(book: EndpointBook, m: dict[str, int]) -> tuple[str, ...]:
    """One request through the book as ``ext_proc.picking.choose`` takes it: pick, enter, (end) leave."""
    columns = book.columns("c", 1.0)
    if columns is not None:
        hosts = columns.pick(matched_blocks=m, **ARGS)
    else:
        hosts = pick(book.states("c", 1.0) or [], matched_blocks=m, **ARGS)
    book.enter(hosts[0])
    book.leave(hosts[0])
    return hosts


def exact_order(eps: list[EndpointState], matched: dict[str, int]) -> list[str]:
    """Every endpoint in exact pick order (``max_hosts`` = all)."""
    w = PickerWeights(max_hosts=len(eps))
    return list(
        pick(eps, prompt_blocks=32, matched_blocks=matched, prompt_tokens=16384, block_tokens=512, weights=w)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 100, 1000])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--picks", type=int, default=300)
    ap.add_argument("--candidates", type=int, nargs="+", default=[4, 16])
    args = ap.parse_args()
    variants: list[tuple[str, PickerWeights]] = [("exact", PickerWeights())] + [
        (f"sampled k={k}", PickerWeights(candidates=k)) for k in args.candidates
    ]
    rng = random.Random(7)
    fleets = {n: fleet(n, seed=n) for n in args.sizes}
    # two prompts per fleet: one whose prefix 4 endpoints hold (part of it), one new to every endpoint
    prompts = {
        n: {
            "held": {e.address: rng.randrange(1, 33) for e in rng.sample(fleets[n], min(n, 4))},
            "new": {},
        }
        for n in args.sizes
    }
    cells = [(n, p, name, w) for n in args.sizes for p in ("held", "new") for name, w in variants]
    times: dict[tuple[int, str, str], list[float]] = {(n, p, name): [] for n, p, name, _ in cells}
    columns = {n: Columns(fleets[n]) for n in args.sizes}
    product = {n: FleetColumns(fleets[n]) for n in args.sizes}
    books = {n: book_of(fleets[n]) for n in args.sizes}
    for n in args.sizes:
        for p in ("held", "new"):
            times[(n, p, COLUMNAR)] = []
            times[(n, p, PRODUCT)] = []
            times[(n, p, BOOK)] = []
    for r in range(args.rounds):
        for n, p in ((n, p) for n in args.sizes for p in ("held", "new")):
            cols, m = columns[n], prompts[n][p]
            t0 = time.process_time()
            for _ in range(args.picks):
                cols.pick(m, 32, 16384, 512)
            times[(n, p, COLUMNAR)].append((time.process_time() - t0) / args.picks * 1e6)
            fc = product[n]
            t0 = time.process_time()
            for _ in range(args.picks):
                fc.pick(matched_blocks=m, **ARGS)
            times[(n, p, PRODUCT)].append((time.process_time() - t0) / args.picks * 1e6)
            book = books[n]
            t0 = time.process_time()
            for _ in range(args.picks):
                book_pick(book, m)
            times[(n, p, BOOK)].append((time.process_time() - t0) / args.picks * 1e6)
        for n, p, name, w in cells:
            eps, m = fleets[n], prompts[n][p]
            t0 = time.process_time()
            for i in range(args.picks):
                pick(eps, prompt_blocks=32, matched_blocks=m, prompt_tokens=16384, block_tokens=512,
                     weights=w, candidate_seed=r * args.picks + i)  # fmt: skip
            times[(n, p, name)].append((time.process_time() - t0) / args.picks * 1e6)
    t = Table(
        title=f"pick() CPU per call (median of {args.rounds} rounds x {args.picks} picks, cells interleaved)",
        caption="rank: the first choice's position in the exact order, as a percentile of the eligible "
        "endpoints (0% = the exact choice), mean over the picks' seeds",
    )
    for col in ("endpoints", "prompt", "scoring", "us / pick", "min us", "max us", "same as exact", "rank"):
        t.add_column(col, justify="right")
    for n, p, name, w in cells:
        eps, m = fleets[n], prompts[n][p]
        order = exact_order(eps, m)
        pos = {a: i for i, a in enumerate(order)}
        ranks = [pos[pick(eps, prompt_blocks=32, matched_blocks=m, prompt_tokens=16384, block_tokens=512,
                          weights=w, candidate_seed=i)[0]] for i in range(args.picks)]  # fmt: skip
        xs = times[(n, p, name)]
        t.add_row(str(n), p, name, f"{statistics.median(xs):.1f}", f"{min(xs):.1f}", f"{max(xs):.1f}",
                  f"{sum(x == 0 for x in ranks) / len(ranks):.0%}",
                  f"{100 * statistics.mean(ranks) / max(1, len(order) - 1):.1f}%")  # fmt: skip
    for n in args.sizes:
        for p in ("held", "new"):
            eps, m = fleets[n], prompts[n][p]
            order = exact_order(eps, m)
            rank = order.index(columns[n].pick(m, 32, 16384, 512))
            xs = times[(n, p, COLUMNAR)]
            same = "100%" if rank == 0 else "0%"
            t.add_row(str(n), p, COLUMNAR, f"{statistics.median(xs):.1f}", f"{min(xs):.1f}", f"{max(xs):.1f}",
                      same, f"{100 * rank / max(1, len(order) - 1):.1f}%")  # fmt: skip
            # the product rows: whole host lists against pick() over the same state
            exact = pick(eps, matched_blocks=m, **ARGS)
            for name, got, want in (
                (PRODUCT, product[n].pick(matched_blocks=m, **ARGS), exact),
                (
                    BOOK,
                    book_pick(books[n], m),
                    pick(books[n].states("c", 1.0) or [], matched_blocks=m, **ARGS),
                ),
            ):
                xs = times[(n, p, name)]
                t.add_row(str(n), p, name, f"{statistics.median(xs):.1f}", f"{min(xs):.1f}", f"{max(xs):.1f}",
                          "100%" if got == want else "0%", "0.0%" if got == want else "-")  # fmt: skip
    Console(width=140).print(t)


if __name__ == "__main__":
    main()
