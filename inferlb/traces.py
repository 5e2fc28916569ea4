"""LLM request traces: the bundled Azure 2023 trace, reading a ``TIMESTAMP,ContextTokens,GeneratedTokens``
CSV, cutting a window of it, and the nearest-rank percentile both the replay and the fleet simulation report.

A trace is a CSV of ``TIMESTAMP,ContextTokens,GeneratedTokens`` (the schema of the Azure LLM inference
trace 2023, Patel et al., "Splitwise", ISCA 2024; CC-BY 4.0). Pure: files in, values out; no network.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from inferlb.errors import InferlbError

#: The trace shipped with inferlb: the conversation half of the Azure LLM inference trace 2023 (CC-BY 4.0).
DEFAULT_TRACE = Path(__file__).parent / "data" / "azure_llm_2023_conv.csv"


class TraceError(InferlbError):
    """A trace file could not be read; names the file and line."""


@dataclass(frozen=True, kw_only=True)
class TraceRow:
    """One trace request: arrival offset from the trace start (s), prompt and output lengths (tokens)."""

    offset_s: float
    prompt_tokens: int
    output_tokens: int


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
    out = [
        TraceRow(
            offset_s=(r.offset_s - start_s) / speedup,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
        )
        for r in rows
        if start_s <= r.offset_s < end
    ]
    return out[:limit] if limit is not None else out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
