"""LLM request traces: the bundled Azure 2023 trace, reading a ``TIMESTAMP,ContextTokens,GeneratedTokens``
CSV or a Mooncake JSONL trace, cutting a window of it, and the nearest-rank percentile both the replay and the
fleet simulation report.

A trace is a CSV of ``TIMESTAMP,ContextTokens,GeneratedTokens`` (the schema of the Azure LLM inference
trace 2023, Patel et al., "Splitwise", ISCA 2024; CC-BY 4.0), or a Mooncake trace (Qin et al., "Mooncake: A
KVCache-centric Architecture for Serving LLM Chatbot", USENIX FAST 2025; kvcache-ai/Mooncake
``FAST25-release/traces``): one JSON object per line, ``timestamp`` (ms), ``input_length``,
``output_length`` (tokens) and ``hash_ids``, the ids of the prompt's blocks of
:data:`MOONCAKE_BLOCK_TOKENS` tokens, remapped so that equal ids are equal prefixes (reusable KV blocks).
The output cap a client sends (``max_tokens``) is an upper bound of its completion, often one default:
:func:`client_caps` gives a trace's rows the caps of a client habit (:data:`CAP_MODES`), keeping their
completions. Pure: files in, values out; no network.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Final, Literal, get_args

from inferlb.errors import InferlbError

#: The trace shipped with inferlb: the conversation half of the Azure LLM inference trace 2023 (CC-BY 4.0).
DEFAULT_TRACE = Path(__file__).parent / "data" / "azure_llm_2023_conv.csv"


class TraceError(InferlbError):
    """A trace file could not be read; names the file and line."""


@dataclass(frozen=True, kw_only=True)
class TraceRow:
    """One trace request: arrival offset from the trace start (s), prompt and output lengths (tokens), and
    the ids of its prompt's full blocks when the trace gives them (a Mooncake trace's ``hash_ids`` of
    :data:`MOONCAKE_BLOCK_TOKENS`-token blocks; empty for a trace without them: no known reuse)."""

    offset_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()
    #: the output cap the client sends (``max_tokens``, tokens); None: the completion length itself (a
    #: client whose cap is tight, :data:`CAP_MODES` ``exact``). Set by :func:`client_caps`.
    max_tokens: int | None = None
    #: False: the client sends no cap and ``max_tokens`` is the model's default, which applies instead.
    cap_sent: bool = True
    #: who sends it (:func:`client_caps`'s tenants; empty: one anonymous client).
    tenant: str = ""

    @property
    def output_cap(self) -> int:
        """The output cap the gateway sees (tokens): ``max_tokens``, else the completion length."""
        return self.output_tokens if self.max_tokens is None else self.max_tokens


#: Tokens per block of a Mooncake trace's ``hash_ids`` (its README: "block size 512 tokens").
MOONCAKE_BLOCK_TOKENS = 512


def _parse_ts(text: str) -> float:
    # The Azure trace has 7 fractional digits, more than datetime.fromisoformat takes before 3.11's
    # relaxed parser handles; cut to microseconds.
    head, _, frac = text.strip().partition(".")
    dt = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)
    return dt.timestamp()


def read_trace(path: str | Path) -> list[TraceRow]:
    """Read a ``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV into rows sorted by arrival.

    Raises:
        TraceError: the file is unreadable, lacks a column, or a row is malformed (line named).
    """
    p = Path(path)
    try:
        fh = p.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: cannot read: {exc.strerror or exc}") from None
    rows: list[tuple[float, int, int]] = []
    with fh:
        reader = csv.DictReader(fh)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise TraceError(f"{p}: missing column(s) {sorted(missing)}")
        for line_no, rec in enumerate(reader, start=2):
            try:
                ts = _parse_ts(rec["TIMESTAMP"])
                ctx, gen = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{p}:{line_no}: malformed row: {exc}") from None
            if ctx < 1 or gen < 0:
                raise TraceError(
                    f"{p}:{line_no}: token counts must be ContextTokens >= 1, GeneratedTokens >= 0"
                )
            rows.append((ts, ctx, gen))
    if not rows:
        raise TraceError(f"{p}: no rows")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceRow(offset_s=ts - t0, prompt_tokens=c, output_tokens=g) for ts, c, g in rows]


def read_mooncake_trace(path: str | Path) -> list[TraceRow]:
    """Read a Mooncake JSONL trace (see the module doc) into rows sorted by arrival, offsets from the first.

    Each row keeps the ids of its prompt's *full* blocks (``input_length // 512`` of them): the last,
    partial block can be neither reused nor cached (vLLM caches only full blocks).

    Raises:
        TraceError: the file is unreadable or empty, a line is not such an object, or its ``hash_ids`` do
            not cover its ``input_length`` (line named).
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{p}: cannot read: {exc}") from None
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ts, ctx, gen = float(rec["timestamp"]) / 1000.0, rec["input_length"], rec["output_length"]
            ids = rec["hash_ids"]
            if not (isinstance(ctx, int) and isinstance(gen, int) and isinstance(ids, list)):
                raise TypeError("input_length and output_length must be integers, hash_ids a list")
            if not all(isinstance(i, int) for i in ids):
                raise TypeError("hash_ids must be integers")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{p}:{line_no}: malformed row: {exc}") from None
        if ctx < 1 or gen < 0 or len(ids) < ctx // MOONCAKE_BLOCK_TOKENS:
            raise TraceError(
                f"{p}:{line_no}: need input_length >= 1, output_length >= 0 and a hash id per full "
                f"{MOONCAKE_BLOCK_TOKENS}-token block"
            )
        rows.append((ts, ctx, gen, tuple(ids[: ctx // MOONCAKE_BLOCK_TOKENS])))
    if not rows:
        raise TraceError(f"{p}: no rows")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [
        TraceRow(offset_s=ts - t0, prompt_tokens=c, output_tokens=g, block_hashes=h) for ts, c, g, h in rows
    ]


def window(
    rows: Sequence[TraceRow],
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    speedup: float = 1.0,
    limit: int | None = None,
) -> list[TraceRow]:
    """Rows with trace offset in ``[start_s, start_s + duration_s)``, re-timed to start at 0 and divided by
    ``speedup`` (2.0 = twice as fast), at most ``limit`` of them.

    Raises:
        ValueError: ``speedup`` <= 0 or a negative window.
    """
    if speedup <= 0 or start_s < 0 or (duration_s is not None and duration_s <= 0):
        raise ValueError("speedup and duration must be > 0 and start >= 0")
    end = math.inf if duration_s is None else start_s + duration_s
    out = [replace(r, offset_s=(r.offset_s - start_s) / speedup) for r in rows if start_s <= r.offset_s < end]
    return out[:limit] if limit is not None else out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


CapMode = Literal["exact", "fixed", "none", "rounded", "noise", "mix"]
#: How clients set ``max_tokens`` (:func:`client_caps`).
CAP_MODES: Final[tuple[CapMode, ...]] = get_args(CapMode)
#: The cap ladder of ``rounded`` (tokens): the completion rounded up to the first of these.
ROUNDED_CAPS: Final = (256, 512, 1024, 2048, 4096)
#: The tenants of ``mix`` and their shares: one sets a noisy cap per request, one a fixed default, one none.
MIX_TENANTS: Final = (("noise", 0.4), ("fixed", 0.4), ("none", 0.2))


def _rounded_cap(tokens: int) -> int:
    return next((c for c in ROUNDED_CAPS if c >= tokens), -(-tokens // ROUNDED_CAPS[-1]) * ROUNDED_CAPS[-1])


def client_caps(
    rows: Sequence[TraceRow],
    mode: CapMode,
    *,
    seed: int = 1,
    fixed_cap: int = 1024,
    default_cap: int = 256,
    noise_sigma: float = 0.5,
) -> list[TraceRow]:
    """The rows with the output cap (``max_tokens``) that clients of habit ``mode`` send; each row's
    completion (``output_tokens``: what the model server writes, stopping at its end of sequence) is kept,
    only the cap the gateway sees changes.

    Modes: ``exact``: the completion length (a tight cap; what the replay sent before); ``fixed``: every
    request ``fixed_cap``; ``none``: no cap (``cap_sent`` False; ``max_tokens`` is ``default_cap``, the
    model's ``default_max_tokens``, which applies instead); ``rounded``: the completion rounded up to the
    first of :data:`ROUNDED_CAPS` (beyond the last: to a multiple of it); ``noise``: ``ceil(completion x
    exp(N(0, noise_sigma)))`` but at least the completion (a cap is an upper bound: a real answer never
    exceeds its cap, so a draw below the completion is raised to it; about half the caps are then exact);
    ``mix``: each request from one of :data:`MIX_TENANTS` (drawn by their shares), which sends caps of its
    habit (``noise``, ``fixed``, ``none``); ``tenant`` names it. Other modes set ``tenant`` to the mode.
    Deterministic: ``random.Random(seed)`` draws the noise and the tenants, one row after another.

    Raises:
        ValueError: an unknown mode, ``fixed_cap`` or ``default_cap`` below 1, or a negative sigma.
    """
    if mode not in CAP_MODES:
        raise ValueError(f"cap mode must be one of {CAP_MODES}, got {mode!r}")
    if fixed_cap < 1 or default_cap < 1:
        raise ValueError(f"fixed_cap and default_cap must be >= 1, got {fixed_cap}, {default_cap}")
    if not noise_sigma >= 0:
        raise ValueError(f"noise_sigma must be >= 0, got {noise_sigma}")
    rng = random.Random(seed)
    names = [name for name, _ in MIX_TENANTS]
    shares = [share for _, share in MIX_TENANTS]
    out: list[TraceRow] = []
    for r in rows:
        habit = rng.choices(names, shares)[0] if mode == "mix" else mode
        true = max(1, r.output_tokens)
        if habit == "exact":
            out.append(replace(r, max_tokens=true, cap_sent=True, tenant=habit))
        elif habit == "fixed":
            out.append(replace(r, max_tokens=fixed_cap, cap_sent=True, tenant=habit))
        elif habit == "none":
            out.append(replace(r, max_tokens=default_cap, cap_sent=False, tenant=habit))
        elif habit == "rounded":
            out.append(replace(r, max_tokens=_rounded_cap(true), cap_sent=True, tenant=habit))
        else:  # noise
            cap = max(true, math.ceil(true * math.exp(rng.gauss(0.0, noise_sigma))))
            out.append(replace(r, max_tokens=cap, cap_sent=True, tenant=habit))
    return out
