"""The output-length predictor (:mod:`inferlb.policy.output_predictor`): sketches, the uninformative-cap
rule, conversations, bounded memory, determinism and cold start."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.policy.output_predictor import (
    PROMPT_BUCKETS,
    SKETCH_BINS,
    DecayedSketch,
    LengthQuery,
    OutputPredictor,
    PredictionKey,
    PredictorParams,
    bin_of,
    bin_upper,
    prompt_bucket,
)

KEY = PredictionKey(tenant="acme", model="llama", kind="chat.completions")
DEFAULT = 2048


def query(
    *,
    cap: int | None = 1024,
    prompt: int = 100,
    conversation: str | None = None,
    width: int = 1,
    key: PredictionKey = KEY,
) -> LengthQuery:
    return LengthQuery(
        key=key, prompt_tokens=prompt, conversation=conversation, cap=cap, default_cap=DEFAULT, width=width
    )


def test_bins_cover_every_length_in_order() -> None:
    for tokens in range(3000):
        i = bin_of(tokens)
        assert bin_upper(i) >= tokens
        assert i == 0 or bin_upper(i - 1) < tokens
    assert bin_of(10**9) == SKETCH_BINS - 1


def test_prompt_buckets_are_powers_of_four() -> None:
    got = [prompt_bucket(t) for t in (0, 1, 3, 4, 15, 16, 63, 64, 1023, 1024, 4095, 4096, 10**7)]
    assert got == [0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 6, 7, 7]
    assert max(got) == PROMPT_BUCKETS - 1


def test_sketch_quantiles_read_the_bin_upper_edge() -> None:
    s = DecayedSketch(half_life=1e9)
    assert s.quantile(0.5) is None
    for t in [10] * 9 + [500]:
        s.add(t)
    assert s.quantile(0.5) == 10
    assert s.quantile(0.85) == 10
    assert s.quantile(1.0) == bin_upper(bin_of(500))


def test_decay_follows_a_change_of_traffic() -> None:
    s = DecayedSketch(half_life=10)
    for _ in range(100):
        s.add(800)
    for _ in range(60):  # six half-lives: the old answers weigh 1/64 of the new
        s.add(20)
    assert s.quantile(0.75) == 20


def test_decay_renormalises_without_losing_the_shape() -> None:
    s = DecayedSketch(half_life=1)  # the weights double every observation: renormalised every ~660
    for i in range(5000):
        s.add(30 if i % 4 else 300)
    assert s.quantile(0.5) in (bin_upper(bin_of(30)), bin_upper(bin_of(300)))
    assert s.total > 0


def test_cold_start_classes_by_the_cap() -> None:
    p = OutputPredictor()
    est = p.estimate(query(cap=None))
    assert est.output_tokens == DEFAULT
    assert not est.predicted


def test_a_missing_or_default_cap_is_uninformative_a_varied_one_is_not() -> None:
    p = OutputPredictor(PredictorParams(min_samples=4))
    assert p.cap_uninformative(query(cap=None))
    assert p.cap_uninformative(query(cap=DEFAULT))
    for cap in (50, 400, 90, 1000, 60, 700):
        p.note_cap(query(cap=cap))
        p.observe(query(cap=cap), cap // 2)
    assert not p.cap_uninformative(query(cap=400))


def test_a_fixed_cap_with_varied_answers_is_uninformative() -> None:
    p = OutputPredictor(PredictorParams(min_samples=4))
    q = query(cap=1024)
    for t in (10, 12, 300, 9, 15, 11):
        assert p.estimate(q).output_tokens == 1024 or p.cap_uninformative(q)
        p.observe(q, t)
    assert p.cap_uninformative(q)
    est = p.estimate(q)
    assert est.predicted
    assert est.output_tokens <= 20  # the 0.75 quantile of mostly short answers


def test_a_fixed_cap_the_answers_fill_stays_informative() -> None:
    p = OutputPredictor(PredictorParams(min_samples=4))
    q = query(cap=100)
    for _ in range(10):
        p.note_cap(q)
        p.observe(q, 100)
    assert not p.cap_uninformative(q)
    assert p.estimate(q) == p.estimate(q)
    assert not p.estimate(q).predicted


def test_the_conversation_predicts_before_the_key() -> None:
    p = OutputPredictor(PredictorParams(min_samples=2))
    for _ in range(10):
        p.observe(query(cap=None, conversation="other"), 10)
    p.observe(query(cap=None, conversation="coder"), 900)
    # the conversation's own answers, exact (not binned)
    assert p.estimate(query(cap=None, conversation="coder")).output_tokens == 900
    assert p.estimate(query(cap=None, conversation="new")).output_tokens == 10


def test_the_prompt_bucket_predicts_before_the_whole_key() -> None:
    p = OutputPredictor(PredictorParams(min_samples=3))
    for _ in range(5):
        p.observe(query(cap=None, prompt=5000), 700)  # long documents: long summaries
        p.observe(query(cap=None, prompt=20), 8)
    assert p.estimate(query(cap=None, prompt=6000)).output_tokens == bin_upper(bin_of(700))
    assert p.estimate(query(cap=None, prompt=30)).output_tokens == 8
    # a bucket seen too little falls back to the key's whole sketch
    assert p.estimate(query(cap=None, prompt=300)).predicted


def test_the_prediction_is_clamped_to_the_cap_and_scaled_by_the_choices() -> None:
    p = OutputPredictor(PredictorParams(min_samples=1))
    p.observe(query(cap=None, width=2), 2 * 3000)  # 3,000 per choice
    assert p.estimate(query(cap=None, width=2)).output_tokens == 2 * DEFAULT
    p = OutputPredictor(PredictorParams(min_samples=1))
    p.observe(query(cap=None, width=4), 4 * 10)
    assert p.estimate(query(cap=None, width=3)).output_tokens == 3 * 10


def test_tenants_and_models_learn_apart() -> None:
    p = OutputPredictor(PredictorParams(min_samples=1))
    other = PredictionKey(tenant="beta", model="llama", kind="chat.completions")
    p.observe(query(cap=None), 5)
    assert p.estimate(query(cap=None)).predicted
    assert not p.estimate(query(cap=None, key=other)).predicted


def test_params_are_checked() -> None:
    with pytest.raises(ValueError, match="quantile"):
        PredictorParams(quantile=0)
    with pytest.raises(ValueError, match="max_keys"):
        PredictorParams(max_keys=0)
    with pytest.raises(ValueError, match="half_life"):
        DecayedSketch(0)


_answers = st.lists(st.integers(0, 5000), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(_answers, st.data())
def test_the_quantile_is_monotone_in_the_data(answers: list[int], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(answers) - 1))
    larger = [*answers]
    larger[i] += data.draw(st.integers(0, 5000))
    for q in (0.1, 0.5, 0.75, 1.0):
        a, b = DecayedSketch(50), DecayedSketch(50)
        for x, y in zip(answers, larger, strict=True):
            a.add(x)
            b.add(y)
        qa, qb = a.quantile(q), b.quantile(q)
        assert qa is not None and qb is not None
        assert qb >= qa


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.integers(0, 40), st.integers(0, 3000), st.integers(0, 9000)),
        max_size=200,
    )
)
def test_memory_stays_bounded_and_predictions_are_deterministic(
    events: list[tuple[int, int, int, int]],
) -> None:
    params = PredictorParams(max_keys=8, max_conversations=16, min_samples=2, conversation_memory=3)

    def run() -> tuple[OutputPredictor, list[tuple[int, bool]]]:
        p = OutputPredictor(params)
        out = []
        for tenant, conv, tokens, prompt in events:
            q = query(
                cap=None if tenant % 3 == 0 else 1024,
                prompt=prompt,
                conversation=f"c{conv}",
                key=PredictionKey(tenant=f"t{tenant}", model="m", kind="chat.completions"),
            )
            est = p.estimate(q)
            out.append((est.output_tokens, est.predicted))
            p.observe(q, tokens)
            assert len(p) <= params.max_keys
            assert p.conversations <= params.max_conversations
        return p, out

    (_, first), (_, second) = run(), run()
    assert first == second


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 100_000), st.integers(1, 8), st.integers(0, 100_000))
def test_cold_start_is_the_cap_based_estimate(cap: int, width: int, prompt: int) -> None:
    for c in (cap, None):
        est = OutputPredictor().estimate(query(cap=c, width=width, prompt=prompt))
        assert est == est.__class__(output_tokens=(DEFAULT if c is None else c) * width, predicted=False)
