"""Prompt token counting per request, with and without the counter's caches, in-process.

Run: ``.venv/bin/python bench/token_counting.py [--rounds 5] [--conversations 4] [--turns 16]``. Prints a
rich table; not a test.

Three counters over the bundled cl100k_base (:class:`inferlb.request.tokens.TiktokenCounter`), built fresh
for every cell so each starts cold:

- **off**: no cache (``cache_chars=0, prompt_cache_chars=0``): every request tokenizes all its texts;
- **text cache**: the per-text :class:`~inferlb.request.tokens.CountCache` only, as counting was before the
  prompt cache (``prompt_cache_chars=0``);
- **text + prompt cache**: the defaults, with the per-message / long-text
  :class:`~inferlb.request.tokens.PromptCountCache`.

Workloads (bodies serialized up front; each request is parsed again before it is timed, so its strings
are new objects whose hashes are not cached, as in the gateway; only
:func:`inferlb.request.tokens.count_prompt_tokens` is timed):

- **repeated chat**: one chat body (a system prompt and one user message) sent ``--repeats`` times, the
  first (cold) request left out of the mean;
- **unique chats**: ``--repeats`` chat bodies, each with its own texts (nothing can hit);
- **growing conversations**: ``--conversations`` chats of ``--turns`` turns, interleaved turn by turn
  (conversation 1 turn 1, conversation 2 turn 1, ...); turn t resends the system prompt and the t - 1
  earlier user/assistant pairs plus a new user message. Sizes come from the Azure LLM inference trace 2023,
  conversation half (``../shared/traces/azure_llm_2023_conv.csv``, Patel et al., ISCA 2024, CC-BY 4.0): the
  system prompt + first user message take one row's ``ContextTokens`` (capped at 2,048), each assistant
  reply one row's ``GeneratedTokens``; follow-up user messages are 20-200 tokens, uniform (an assumption:
  the trace has no per-turn split). Also shown per turn column: **new turn alone**, counting only the
  texts this request adds (the last assistant reply and the new user message) with the cache off: what
  the request would cost if earlier turns were free;
- **long completions prompt**: one 64 K-character completions prompt (a pasted document, counted in
  8 K segments) sent ``--repeats`` times, the first left out of the mean.

Each round runs every (workload, counter) cell once, in an order shuffled per round; a cell's figure is
the median over rounds of its mean us per request, and the ratios divide two medians of the same run.
Times are this thread's CPU time (``time.thread_time``), not wall time: on a shared, loaded machine wall
time also counts the waits for a core.
The text is English-like (words of a fixed list with punctuation), ASCII.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from inferlb.request.parsing import EndpointKind, parse_request
from inferlb.request.tokens import TiktokenCounter, count_prompt_tokens, offline_encoding

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_conv.csv"

#: the vocabulary of the English-like text (common words, a few of this field)
VOCABULARY = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part model server request token latency cluster gateway prompt reply question answer "
    "please explain why because however therefore example function return value error config deploy python"
)
WORDS = VOCABULARY.split()

CONFIGS: dict[str, Callable[[], TiktokenCounter]] = {
    "off": lambda: TiktokenCounter(cache_chars=0, prompt_cache_chars=0),
    "text cache": lambda: TiktokenCounter(prompt_cache_chars=0),
    "text + prompt cache": TiktokenCounter,
}


def english(rng: random.Random, tokens: int) -> str:
    """English-like text of about ``tokens`` cl100k tokens (one word ~ 1.2 tokens with the punctuation)."""
    words = []
    for i in range(max(1, int(tokens / 1.2))):
        w = rng.choice(WORDS)
        words.append(w.capitalize() if i % 12 == 0 else w)
        if i % 12 == 11:
            words[-1] += rng.choice(".,;?!")
    return " ".join(words)


def trace_rows() -> list[tuple[int, int]]:
    """(ContextTokens, GeneratedTokens) of the trace's rows; synthetic sizes when the trace is missing."""
    if not TRACE.exists():
        rng = random.Random(0)
        return [(rng.randint(200, 2000), rng.randint(50, 500)) for _ in range(1000)]
    with TRACE.open() as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]


def chat(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


@dataclass
class Workload:
    name: str
    kind: EndpointKind
    bodies: list[bytes]
    #: for growing conversations: the turn of each body (1-based) and the body of its new texts alone
    turns: list[int] | None = None
    new_only: list[bytes] | None = None


def workloads(args: argparse.Namespace) -> list[Workload]:
    rng = random.Random(args.seed)
    rows = trace_rows()
    system = english(rng, 400)
    repeated = chat([{"role": "system", "content": system}, {"role": "user", "content": english(rng, 300)}])
    unique = [
        chat(
            [{"role": "system", "content": english(rng, 400)}, {"role": "user", "content": english(rng, 300)}]
        )
        for _ in range(args.repeats)
    ]
    convs: list[list[tuple[bytes, bytes]]] = []
    for _ in range(args.conversations):
        context, _ = rng.choice(rows)
        first = max(20, min(context, 2048) - 400)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": english(rng, first)}]
        turns = [(chat(msgs), chat(msgs[1:]))]
        for _ in range(args.turns - 1):
            _, generated = rng.choice(rows)
            new = [
                {"role": "assistant", "content": english(rng, generated)},
                {"role": "user", "content": english(rng, rng.randint(20, 200))},
            ]
            msgs += new
            turns.append((chat(msgs), chat(new)))
        convs.append(turns)
    growing, alone, turn_of = [], [], []
    for t in range(args.turns):
        for c in convs:
            growing.append(c[t][0])
            alone.append(c[t][1])
            turn_of.append(t + 1)
    doc = english(rng, 16_000)[:65_536]
    long_prompt = json.dumps({"model": "m", "prompt": doc}).encode()
    return [
        Workload("repeated chat", EndpointKind.CHAT_COMPLETIONS, [repeated] * args.repeats),
        Workload("unique chats", EndpointKind.CHAT_COMPLETIONS, unique),
        Workload("growing conversations", EndpointKind.CHAT_COMPLETIONS, growing, turn_of, alone),
        Workload("long completions prompt", EndpointKind.COMPLETIONS, [long_prompt] * args.repeats),
    ]


def run_cell(work: Workload, counter: TiktokenCounter, bodies: list[bytes] | None = None) -> list[float]:
    """CPU seconds (this thread's) of :func:`count_prompt_tokens` per request, in order (each body parsed
    just before)."""
    out = []
    for body in bodies or work.bodies:
        request = parse_request(work.kind, body)
        t0 = time.thread_time()
        count_prompt_tokens(request, counter)
        out.append(time.thread_time() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=50, help="requests per repeated/unique/long cell")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    console = Console(width=150)
    offline_encoding()  # loaded before any timing
    works = workloads(args)
    cells = [(w, name) for w in works for name in CONFIGS] + [(works[2], "new turn alone")]
    # per cell and round: seconds per request, in order
    times: dict[tuple[str, str], list[list[float]]] = {(w.name, n): [] for w, n in cells}
    rng = random.Random(args.seed)
    for _ in range(args.rounds):
        order = cells[:]
        rng.shuffle(order)
        for work, name in order:
            if name == "new turn alone":
                got = run_cell(work, CONFIGS["off"](), work.new_only)
            else:
                got = run_cell(work, CONFIGS[name]())
            times[work.name, name].append(got)

    def us(work: str, name: str, pick: Callable[[int], bool] = lambda _: True) -> float:
        per_round = [statistics.fmean(t for i, t in enumerate(r) if pick(i)) for r in times[work, name]]
        return statistics.median(per_round) * 1e6

    uname = " / ".join(platform_info())
    table = Table(title=f"token counting, CPU us per request (median of {args.rounds} rounds; {uname})")
    for col in (
        "workload",
        "off",
        "text cache",
        "text + prompt cache",
        "new turn alone",
        "off / after",
        "text cache / after",
        "after / new turn",
    ):
        table.add_column(col, justify="left" if col == "workload" else "right")
    rows: list[tuple[str, Callable[[int], bool]]] = []
    for w in works:
        if w.turns is None and len(set(w.bodies)) == 1:
            # the steady state: a hit every time (the first, cold request is in "unique chats")
            rows.append((f"{w.name} (requests 2..)", lambda i: i > 0))
        elif w.turns is None:
            rows.append((w.name, lambda _: True))
        else:
            turns = w.turns
            marks = sorted({1, 2, 4, 8, args.turns} & set(turns))
            rows.append((f"{w.name}: all turns", lambda _: True))
            rows += [(f"{w.name}: turn {t}", lambda i, t=t, turns=turns: turns[i] == t) for t in marks]
    for label, pick in rows:
        work = next(w for w in works if label.startswith(w.name))
        off, before, after = (us(work.name, n, pick) for n in CONFIGS)
        alone = us(work.name, "new turn alone", pick) if work.turns else None
        table.add_row(
            label,
            f"{off:,.0f}",
            f"{before:,.0f}",
            f"{after:,.0f}",
            "" if alone is None else f"{alone:,.0f}",
            f"{off / after:,.1f}x",
            f"{before / after:,.2f}x",
            "" if alone is None else f"{after / alone:,.2f}x",
        )
    console.print(table)
    sizes = {w.name: statistics.fmean(len(b) for b in w.bodies) for w in works}
    console.print(
        "mean body bytes: " + ", ".join(f"{k} {v:,.0f}" for k, v in sizes.items()),
        f"; {args.conversations} conversations x {args.turns} turns, {args.repeats} requests per other cell",
    )
    return 0


def platform_info() -> list[str]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return [f"Python {platform.python_version()}", f"{os.cpu_count()} CPUs", f"load {load:.1f} at the end"]


if __name__ == "__main__":
    raise SystemExit(main())
