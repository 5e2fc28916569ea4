"""vLLM's scheduler rules in the simulated engine: chunked prefill under a token budget, KV blocks taken as
tokens are decoded, preemption with recompute when they run out, separate prefill and decode capacities, the
step-time combination (simulation.scheduler, simulation.gpusim.engine)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferlb.config.schema import load_config, parse_config
from inferlb.errors import ConfigError
from simulation.gpusim.engine import (
    BatchEngine,
    EngineEvent,
    FirstTokenEmitted,
    Refused,
    SequenceFinished,
    SequencePreempted,
    TimingModel,
)
from simulation.kvcache import BlockPool, PrefixCache, PromptBlocks, block_hashes
from simulation.scheduler import (
    DecodingSequence,
    blocks_for,
    growth_blocks,
    prefill_chunks,
    step_seconds,
    steps_until_full,
)
from tests.unit.test_gpusim_engine import Arrival as EngineArrival
from tests.unit.test_gpusim_engine import timeline

BS = 16


def model(**kw: object) -> TimingModel:
    values: dict[str, object] = {
        "relative_capacity": 1.0,
        "prefill_tokens_per_s": 1000.0,
        "decode_tokens_per_s": 50.0,
        "max_batch": 4,
        "max_queue": 100,
        "kv_budget_tokens": 10_000,
    }
    values.update(kw)
    return TimingModel(**values)  # type: ignore[arg-type]


# -- the pure rules --------------------------------------------------------------------------------------


def test_prefill_chunks_fill_the_budget_left_by_decodes_in_order() -> None:
    assert prefill_chunks(100, 10, [50, 50, 50]) == [50, 40]
    assert prefill_chunks(100, 100, [5]) == []  # decodes took it all
    assert prefill_chunks(100, 10, [0, 95]) == [0, 90]  # a 0-token prompt still gets its (empty) chunk
    assert prefill_chunks(None, 10_000, [9000, 9000]) == [9000, 9000]  # no budget: whole prompts
    with pytest.raises(ValueError, match="exceed the step budget"):
        prefill_chunks(8, 9, [1])


@given(
    st.integers(1, 10_000) | st.none(),
    st.integers(0, 200),
    st.lists(st.integers(0, 20_000), max_size=20),
)
def test_prefill_chunks_never_exceed_the_budget_nor_a_prompt(
    budget: int | None, decode: int, remaining: list[int]
) -> None:
    if budget is not None and decode > budget:
        decode = budget
    chunks = prefill_chunks(budget, decode, remaining)
    assert len(chunks) <= len(remaining)
    assert all(0 <= c <= r for c, r in zip(chunks, remaining, strict=False))
    if budget is not None:
        assert decode + sum(chunks) <= budget
        # every chunk but the last served is whole: the budget goes to the first in line first
        assert all(c == r for c, r in zip(chunks[:-1], remaining, strict=False))
    else:
        assert chunks == remaining


def test_step_seconds_sum_or_max() -> None:
    assert step_seconds(0.3, 0.1) == pytest.approx(0.4)
    assert step_seconds(0.3, 0.1, "max") == 0.3
    with pytest.raises(ValueError, match="step time"):
        step_seconds(0.3, 0.1, "avg")  # type: ignore[arg-type]


def test_blocks_for_counts_full_prompt_blocks_then_tail_and_decoded_tokens() -> None:
    assert blocks_for(6, 4, 0, BS) == 7
    assert blocks_for(6, 4, 12, BS) == 7
    assert blocks_for(6, 4, 13, BS) == 8
    assert blocks_for(0, 0, 0, BS) == 0


@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, BS - 1), st.integers(1, 50), st.integers(1, 3)),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 40),
    st.integers(1, 200),
)
def test_steps_until_full_is_the_first_step_whose_growth_exceeds_the_free_blocks(
    seqs: list[tuple[int, int, int, int]], free: int, horizon: int
) -> None:
    ds = [
        DecodingSequence(
            full_blocks=f,
            tail_tokens=t,
            emitted=1,
            width=w,
            held=blocks_for(f, t, w, BS),
            last=last + 1,
        )
        for f, t, last, w in seqs
    ]
    k = steps_until_full(ds, free, BS, horizon)
    over = [j for j in range(1, horizon + 1) if growth_blocks(ds, j, BS) > free]
    assert k == (over[0] if over else None)


# -- chunked prefill ----------------------------------------------------------------------------------


def test_a_long_prompt_no_longer_stalls_the_decoding_batch() -> None:
    def worst_gap(budget: int | None) -> float:
        eng = BatchEngine(
            model=model(max_num_batched_tokens=budget, kv_budget_tokens=100_000), trace_steps=True
        )
        eng.submit(0.0, request_id="chat", prompt_tokens=10, completion_tokens=200)
        eng.advance(0.5)
        eng.submit(0.5, request_id="doc", prompt_tokens=20_000, completion_tokens=1)  # 20 s of prefill
        eng.advance(100.0)
        chat_steps = [s for s in eng.steps if s.decode_tokens > 0]
        return max((s.end - s.start) / s.count for s in chat_steps)

    # without a budget the chat's next token waits for the whole 20-s prefill; with 512 tokens a step, the
    # prefill goes in chunks of 511 and each of the chat's steps lasts 0.511 s + 0.02 s
    assert worst_gap(None) == pytest.approx(20.0 + 0.02)
    assert worst_gap(512) == pytest.approx(0.511 + 0.02)


def test_a_chunked_prompt_gets_its_first_token_after_its_last_chunk() -> None:
    eng = BatchEngine(model=model(max_num_batched_tokens=1000))
    eng.submit(0.0, request_id="r", prompt_tokens=2500, completion_tokens=3)
    events = eng.advance(100.0)
    first = next(e for e in events if isinstance(e, FirstTokenEmitted))
    assert first.at == pytest.approx(2.5)  # three chunks (1000, 1000, 500) at 1,000 tokens/s
    done = next(e for e in events if isinstance(e, SequenceFinished))
    assert done.at == pytest.approx(2.5 + 2 * 0.02)
    assert eng.stats().prompt_tokens_total == 2500


def test_the_budget_must_hold_a_full_batch() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        model(max_batch=8, max_num_batched_tokens=4)
    doc = {
        "models": [{"name": "m"}],
        "simulation": {"max_batch": 64, "max_num_batched_tokens": 32},
    }
    with pytest.raises(ConfigError, match=r"simulation\.max_num_batched_tokens: must be >= max_batch \(64\)"):
        parse_config(doc)


# -- capacities and step time -------------------------------------------------------------------------


def test_prefill_and_decode_scale_with_their_own_capacity() -> None:
    m = model(relative_capacity=3.4, prefill_relative_capacity=7.2)
    assert m.prefill_seconds(7200) == pytest.approx(1.0)
    assert m.decode_step_seconds(1) == pytest.approx(1 / (3.4 * 50))
    assert model(relative_capacity=2.0).prefill_capacity == 2.0  # unset: relative_capacity
    d = model(decode_relative_capacity=0.5)
    assert d.decode_step_seconds(1) == pytest.approx(1 / 25) and d.prefill_capacity == 1.0


def test_the_bundled_profiles_split_prefill_from_decode() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "inferlb" / "data" / "local.yaml")
    h100 = next(e for e in cfg.endpoints if e.gpu == "H100")
    t = TimingModel.for_endpoint(cfg, h100)
    assert (t.relative_capacity, t.prefill_capacity, t.decode_capacity) == (3.4, 7.23, 3.4)
    assert t.max_num_batched_tokens == 8192


def test_max_step_time_overlaps_prefill_and_decode() -> None:
    def step_of(mode: str) -> float:
        eng = BatchEngine(model=model(step_time=mode, max_num_batched_tokens=8192), trace_steps=True)
        eng.submit(0.0, request_id="a", prompt_tokens=0, completion_tokens=50)
        eng.advance(0.1)
        eng.submit(0.1, request_id="b", prompt_tokens=100, completion_tokens=1)
        eng.advance(10.0)
        mixed = next(s for s in eng.steps if s.prefill_tokens == 100)
        return mixed.end - mixed.start

    assert step_of("sum") == pytest.approx(0.1 + 0.02)
    assert step_of("max") == pytest.approx(0.1)


# -- KV blocks and preemption -------------------------------------------------------------------------


def test_admission_waits_for_free_blocks() -> None:
    # 20 blocks: a 240-token prompt takes 15, a second one does not fit until the first finishes
    eng = BatchEngine(model=model(kv_budget_tokens=20 * BS, prefill_tokens_per_s=1e6))
    eng.submit(0.0, request_id="a", prompt_tokens=240, completion_tokens=20)
    eng.submit(0.0, request_id="b", prompt_tokens=240, completion_tokens=20)
    assert eng.stats().running_requests == 1 and eng.stats().waiting_requests == 1
    events = eng.advance(100.0)
    fin = {e.request_id: e.at for e in events if isinstance(e, SequenceFinished)}
    first = {e.request_id: e.at for e in events if isinstance(e, FirstTokenEmitted)}
    assert first["b"] >= fin["a"]
    assert eng.stats().num_preemptions_total == 0


def test_running_out_of_blocks_preempts_the_last_admitted_which_recomputes_and_finishes() -> None:
    # 12 blocks: two 64-token prompts (4 blocks each) start together; decoding 100 tokens each needs
    # 4 + ceil(99 / 16) = 11 blocks, so the second (admitted last) is preempted and re-prefilled later
    eng = BatchEngine(model=model(kv_budget_tokens=12 * BS, prefill_tokens_per_s=1000.0), trace_steps=True)
    eng.submit(0.0, request_id="a", prompt_tokens=64, completion_tokens=100)
    eng.submit(0.0, request_id="b", prompt_tokens=64, completion_tokens=100)
    events = eng.advance(1000.0)
    pre = [e for e in events if isinstance(e, SequencePreempted)]
    assert pre and {e.request_id for e in pre} == {"b"}
    fin = {e.request_id: e for e in events if isinstance(e, SequenceFinished)}
    assert fin["a"].completion_tokens == fin["b"].completion_tokens == 100
    assert fin["a"].at < fin["b"].at
    stats = eng.stats()
    assert stats.num_preemptions_total == len(pre)
    assert stats.generation_tokens_total == 200  # tokens emitted before the preemption are not emitted again
    assert stats.prompt_tokens_total == 128  # the recompute is not counted as new prompt tokens
    # the recompute: b's prompt and the tokens it had generated, prefilled again
    recompute = 64 + pre[0].emitted
    assert any(s.prefill_tokens == recompute for s in eng.steps)
    assert max(s.blocks_in_use for s in eng.steps) <= 12
    assert [e.request_id for e in events if isinstance(e, FirstTokenEmitted)] == ["a", "b"]  # once each


def test_a_preempted_request_keeps_its_tokens_and_reuses_its_cached_prompt() -> None:
    # 16 blocks: both reach 4 + 5 blocks at 65 tokens, where b (admitted last) is preempted; a then takes
    # 2 more blocks from the head of the free queue, b's generated-token blocks (freed tail first)
    cache = PrefixCache(num_blocks=16, block_size=BS)
    eng = BatchEngine(model=model(kv_budget_tokens=16 * BS), prefix_cache=cache)
    ids = list(range(64))
    prompts = (PromptBlocks(tokens=64, hashes=block_hashes(ids, block_size=BS)),)
    eng.submit(0.0, request_id="a", prompt_tokens=64, completion_tokens=100)
    eng.submit(0.0, request_id="b", prompt_tokens=64, completion_tokens=100, prompts=prompts)
    events = []
    emitted_before = None
    for _ in range(10_000):
        t = eng.next_step_end()
        if t is None:
            break
        batch = eng.advance(t)
        events += batch
        if any(isinstance(e, SequencePreempted) for e in batch):
            emitted_before = eng.tokens_emitted("b")
    assert emitted_before is not None and emitted_before > 0
    # its prompt's 4 blocks were still cached when it came back: 3 hit (the last token is recomputed)
    assert cache.hits_total == 3 * BS
    assert {e.request_id: e.completion_tokens for e in events if isinstance(e, SequenceFinished)} == {
        "a": 100,
        "b": 100,
    }


def test_a_request_larger_than_the_whole_pool_is_refused() -> None:
    eng = BatchEngine(model=model(kv_budget_tokens=10 * BS))
    out = eng.submit(0.0, request_id="r", prompt_tokens=150, completion_tokens=20)
    assert isinstance(out, Refused) and out.reason == "exceeds_kv_cache"
    assert not eng.holds("r") and eng.stats().requests_refused_total == 1


def test_kv_usage_is_the_pools_with_or_without_prefix_caching() -> None:
    plain = BatchEngine(model=model(kv_budget_tokens=100 * BS))
    cached = BatchEngine(model=model(kv_budget_tokens=100 * BS), prefix_cache=PrefixCache(num_blocks=100))
    assert isinstance(plain.pool, BlockPool) and cached.pool is cached.prefix_cache
    for eng in (plain, cached):
        eng.submit(0.0, request_id="r", prompt_tokens=320, completion_tokens=10)
        assert eng.stats().kv_usage == pytest.approx(20 / 100)


# -- properties over random workloads -------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival(EngineArrival):
    shared: int  # which of a few prompts it starts with (for prefix-cache hits)


arrivals = st.lists(
    st.builds(
        Arrival,
        gap=st.floats(0, 0.3),
        prompt=st.integers(0, 600),
        completion=st.integers(0, 200),
        width=st.integers(1, 2),
        cancel_after=st.none() | st.none() | st.floats(0, 2.0),
        shared=st.integers(0, 2),
    ),
    min_size=1,
    max_size=25,
)


def drive(
    m: TimingModel, workload: list[Arrival], *, fine: bool, cached: bool
) -> tuple[list[EngineEvent], BatchEngine, set[str], set[str]]:
    """Run ``workload`` to the end: advance at every step end (``fine``) or at transitions only; check the
    block and budget bounds at every stop. Returns the events, the engine, the refused and cancelled ids."""
    cache = PrefixCache(num_blocks=m.kv_budget_tokens // BS, block_size=BS) if cached else None
    eng = BatchEngine(model=m, prefix_cache=cache, trace_steps=True)
    events: list[EngineEvent] = []
    refused: set[str] = set()
    cancelled: set[str] = set()
    last_emitted: dict[str, int] = {}

    def check() -> None:
        assert eng.pool.blocks_in_use <= eng.pool.num_blocks
        assert 0.0 <= eng.stats().kv_usage <= 1.0
        for rid in list(last_emitted):
            if eng.holds(rid):
                now = eng.tokens_emitted(rid)
                assert now >= last_emitted[rid]  # never taken back, preempted or not
                last_emitted[rid] = now

    def step_to(at: float) -> None:
        for _ in range(100_000):
            nxt = eng.next_step_end() if fine else eng.next_transition_time()
            if nxt is None or nxt > at:
                return
            events.extend(eng.advance(nxt))
            check()

    for at, kind, rid, item in timeline(workload):
        step_to(at)
        if kind == 0:
            assert item is not None
            a = item
            ids = [a.shared] * min(a.prompt, 200) + list(range(1000 + a.prompt, 1000 + 2 * a.prompt))
            ids = ids[: a.prompt]
            prompts = (PromptBlocks(tokens=a.prompt, hashes=block_hashes(ids, block_size=BS)),)
            out = eng.submit(
                at,
                request_id=rid,
                prompt_tokens=a.prompt,
                completion_tokens=a.completion,
                width=a.width,
                prompts=prompts,
            )
            if isinstance(out, Refused):
                refused.add(rid)
            else:
                last_emitted[rid] = 0
        elif eng.cancel(at, rid):
            cancelled.add(rid)
        check()
    step_to(float("inf"))
    assert eng.next_step_end() is None
    return events, eng, refused, cancelled


budgets = st.sampled_from([None, 8, 64, 256, 8192])
pools = st.integers(8, 48)  # blocks: small enough to preempt often


@settings(max_examples=120, deadline=None)
@given(arrivals, budgets, pools, st.booleans())
@example(
    [Arrival(gap=0.0, prompt=64, completion=100, width=1, cancel_after=None, shared=0)] * 2,
    None,
    12,
    False,
)
def test_blocks_budget_and_token_counts_hold_under_preemption(
    workload: list[Arrival], budget: int | None, blocks: int, cached: bool
) -> None:
    m = model(max_batch=4, max_queue=50, kv_budget_tokens=blocks * BS, max_num_batched_tokens=budget)
    events, eng, refused, cancelled = drive(m, workload, fine=False, cached=cached)
    # KV blocks in use never exceed the pool, and a step's tokens never exceed the budget
    assert all(s.blocks_in_use <= blocks for s in eng.steps)
    if budget is not None:
        assert all(s.prefill_tokens + s.decode_tokens <= budget for s in eng.steps)
    # every request not refused nor cancelled finishes, once, with all its tokens, preempted or not
    by_id = {f"r{i}": a for i, a in enumerate(workload)}
    fin = [e for e in events if isinstance(e, SequenceFinished)]
    assert len({e.request_id for e in fin}) == len(fin)
    assert {e.request_id for e in fin} == set(by_id) - refused - cancelled
    for e in fin:
        assert e.completion_tokens == by_id[e.request_id].completion
    done_tokens = sum(by_id[e.request_id].completion * by_id[e.request_id].width for e in fin)
    assert eng.stats().generation_tokens_total >= done_tokens
    if not cancelled:
        assert eng.stats().generation_tokens_total == done_tokens
    preempted = [e for e in events if isinstance(e, SequencePreempted)]
    assert eng.stats().num_preemptions_total == len(preempted)
    assert eng.pool.blocks_in_use == 0  # all freed at the end


@settings(max_examples=60, deadline=None)
@given(arrivals, budgets, pools, st.booleans())
def test_identical_inputs_give_identical_results_however_driven(
    workload: list[Arrival], budget: int | None, blocks: int, cached: bool
) -> None:
    m = model(max_batch=4, max_queue=50, kv_budget_tokens=blocks * BS, max_num_batched_tokens=budget)
    a, eng_a, ref_a, _ = drive(m, workload, fine=False, cached=cached)
    b, eng_b, ref_b, _ = drive(m, workload, fine=False, cached=cached)
    assert a == b and ref_a == ref_b and eng_a.stats() == eng_b.stats()
    # stepping every token (the real-time server) gives the same events, to the bit, as jumping over runs
    f, eng_f, ref_f, _ = drive(m, workload, fine=True, cached=cached)
    assert [(type(e), e.request_id, e.at) for e in f] == [(type(e), e.request_id, e.at) for e in a]
    assert ref_f == ref_a
    sf, sa = eng_f.stats(), eng_a.stats()
    assert (sf.generation_tokens_total, sf.steps_total, sf.num_preemptions_total) == (
        sa.generation_tokens_total,
        sa.steps_total,
        sa.num_preemptions_total,
    )
    if cached:
        assert (sf.prefix_cache_hits_total, sf.prefix_cache_queries_total) == (
            sa.prefix_cache_hits_total,
            sa.prefix_cache_queries_total,
        )
