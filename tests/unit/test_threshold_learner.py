"""The online threshold learner (:mod:`inferlb.policy.threshold_learner`): one fixed cap confines nothing,
thresholds fall, each set's confined work stays within its budget, memory is bounded by the window, the
hysteresis holds thresholds under small drift and follows a large shift, nothing before ``min_samples``,
derivations at most every ``rederive_every_s``, bad parameters refused by name."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from inferlb.policy.length_aware import tier_thresholds
from inferlb.policy.threshold_learner import ThresholdLearner, request_work

caps = st.integers(0, 20_000)
works = st.floats(0.0, 1e4, allow_nan=False)
share_lists = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4).map(sorted)


def learner(shares: list[float], **kw: float) -> ThresholdLearner:
    params: dict[str, float] = {"window": 64, "min_samples": 1, "rederive_every_s": 0.0, "hysteresis": 0.0}
    params.update(kw)
    return ThresholdLearner(
        shares,
        fraction=params.pop("fraction", 0.75),
        window=int(params["window"]),
        min_samples=int(params["min_samples"]),
        rederive_every_s=params["rederive_every_s"],
        hysteresis=params["hysteresis"],
    )


def window_of(samples: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    return samples[-window:]


@given(cap=caps, ws=st.lists(works, min_size=1, max_size=100), shares=share_lists)
@example(cap=1024, ws=[1.0], shares=[0.5])
@example(cap=0, ws=[0.0, 0.0], shares=[0.0, 1.0])
def test_one_fixed_cap_confines_nothing(cap: int, ws: list[float], shares: list[float]) -> None:
    lr = learner(shares)
    for i, w in enumerate(ws):
        lr.observe(cap, w, float(i))
    out = lr.thresholds(float(len(ws)))
    if sum(ws) > 0:
        assert out is not None
        assert all(cap <= t for t in out)  # no request is above its threshold
    else:
        assert out is None  # no work: nothing to derive from


@given(
    samples=st.lists(st.tuples(caps, works), min_size=1, max_size=200),
    shares=share_lists,
    fraction=st.floats(0.05, 1.0),
    window=st.integers(1, 80),
)
@example(
    samples=[(100, 1.0)] * 10 + [(500, 4.0)] * 5 + [(1000, 10.0)], shares=[0.5, 0.8], fraction=0.5, window=64
)
def test_fresh_thresholds_fall_and_keep_each_set_within_its_budget(
    samples: list[tuple[int, float]], shares: list[float], fraction: float, window: int
) -> None:
    lr = learner(shares, window=window, fraction=fraction)
    for i, (c, w) in enumerate(samples):
        lr.observe(c, w, float(i))
    seen = window_of(samples, window)
    total = sum(w for _, w in seen)
    out = lr.thresholds(float(len(samples)))
    if not total > 0:  # nothing to derive from: the last thresholds stay (None if there never was work)
        assert (out is None) == (sum(w for _, w in samples) == 0)
        return
    assert out is not None
    assert len(out) == len(shares)
    assert list(out) == sorted(out, reverse=True)  # T_1 >= T_2 >= ...
    confined = lr.confined_shares(out)
    assert confined is not None
    for t, share, got in zip(out, shares, confined, strict=True):
        above = sum(w for c, w in seen if c > t)
        assert got == pytest.approx(above / total, abs=1e-9)
        assert above <= fraction * share * total * (1 + 1e-9) + 1e-9
        assert t in {c for c, _ in seen}
    # the rule is tier_thresholds' over the window (the classes of positive share)
    positive = sorted({s for s in shares if s > 0})
    if positive:
        rule = dict(zip(positive, tier_thresholds(positive, seen, fraction=fraction), strict=True))
        assert [t for t, s in zip(out, shares, strict=True) if s > 0] == [rule[s] for s in shares if s > 0]


@given(
    samples=st.lists(st.tuples(caps, works), min_size=1, max_size=300),
    shares=share_lists,
    hysteresis=st.floats(0.0, 0.5),
    window=st.integers(1, 50),
)
def test_held_thresholds_stay_within_the_budget_plus_the_hysteresis(
    samples: list[tuple[int, float]], shares: list[float], hysteresis: float, window: int
) -> None:
    lr = learner(shares, window=window, hysteresis=hysteresis)
    for i, (c, w) in enumerate(samples):
        lr.observe(c, w, float(i))
        # bounded memory, whatever the traffic
        assert lr.samples <= window and lr.distinct_caps <= window
    out = lr.thresholds(float(len(samples)))
    if out is None:
        return
    assert list(out) == sorted(out, reverse=True)
    confined = lr.confined_shares(out)
    if confined is None:
        return
    for share, got in zip(shares, confined, strict=True):
        assert got <= 0.75 * share + hysteresis + 1e-9


def test_none_before_min_samples() -> None:
    lr = learner([0.6], min_samples=10)
    for i in range(9):
        lr.observe(100 * (i + 1), 1.0, float(i))
        assert lr.thresholds(float(i)) is None
    lr.observe(5000, 1.0, 9.0)
    assert lr.thresholds(9.0) is not None


def test_derives_at_most_every_interval() -> None:
    lr = learner([0.5], rederive_every_s=10.0)
    for _ in range(10):
        lr.observe(100, 1.0, 0.0)
    assert lr.thresholds(0.0) == (100,)  # one cap: confines nothing
    for _ in range(90):
        lr.observe(1000, 1.0, 5.0)  # the mix changes, but the last derivation is 5 s old
    assert lr.thresholds(9.9) == (100,)
    assert lr.thresholds(10.0) == (1000,)  # one cap again (the window holds 64 of 1,000)


def uniform_window(scale: float) -> list[int]:
    """2,000 caps: 10..4,000 in steps of 10, five of each, times ``scale`` (work = cap)."""
    return [round(10 * k * scale) for k in range(1, 401)] * 5


def test_hysteresis_holds_under_small_drift_and_follows_a_large_shift() -> None:
    # the fast set (share 0.4) may take 0.3 of the work: T_1 = 3,350 of the uniform window
    lr = learner([0.4], window=2000, min_samples=2000, rederive_every_s=1.0, hysteresis=0.05)
    for c in uniform_window(1.0):
        lr.observe(c, float(c), 0.0)
    first = lr.thresholds(1.0)
    assert first == (3350,)
    # every cap 3% longer: the rule's threshold moves (to 3,450), the share above 3,350 only to 0.34
    drifted = learner([0.4], window=2000, min_samples=2000, rederive_every_s=1.0, hysteresis=0.0)
    for c in uniform_window(1.03):
        lr.observe(c, float(c), 1.0)
        drifted.observe(c, float(c), 1.0)
    assert drifted.thresholds(2.0) == (3450,)
    assert lr.thresholds(2.0) == first
    # every cap twice as long: the share above 3,350 is 0.83; the thresholds follow
    for c in uniform_window(2.0):
        lr.observe(c, float(c), 2.0)
    assert lr.thresholds(3.0) == (6700,)


def test_hysteresis_absorbs_the_sampling_noise_of_a_stationary_mix() -> None:
    changes = {}
    for hysteresis in (0.0, 0.05):
        rng = random.Random(7)
        lr = learner([0.4], window=2000, min_samples=2000, rederive_every_s=1.0, hysteresis=hysteresis)
        last, n = None, 0
        for t in range(24):  # 2,000 requests, then 20 derivations, each after 500 more of the same mix
            for _ in range(2000 if t == 0 else 500):
                c = 10 * rng.randint(1, 400)
                lr.observe(c, float(c), float(t))
            now = lr.thresholds(float(t) + 1)
            n += last is not None and now != last
            last = now
        changes[hysteresis] = n
    # the bare rule moves with the noise (+-0.02 of share at 2,000 requests); the hysteresis holds
    assert changes[0.0] >= 10
    assert changes[0.05] <= 2


def test_a_shift_to_one_default_cap_releases_every_request() -> None:
    lr = learner([0.5], window=100, min_samples=50)
    # 95 requests capped at 200, 5 at 2,000: the long ones carry 10,000 of 29,000 (0.34 <= 0.75 x 0.5)
    for i, c in enumerate([200] * 95 + [2000] * 5):
        lr.observe(c, float(c), float(i))
    assert lr.thresholds(100.0) == (200,)  # the 2,000-token caps are confined
    for i in range(100):
        lr.observe(1024, 1024.0, 200.0 + i)
    assert lr.thresholds(300.0) == (1024,)


def test_sets_of_zero_share_confine_nothing_and_equal_sets_get_equal_thresholds() -> None:
    lr = learner([0.0, 0.5, 0.5])
    # work above 100: 2,000 of 6,000 (0.33 <= 0.75 x 0.5)
    for i, c in enumerate([100] * 40 + [1000] * 2):
        lr.observe(c, float(c), float(i))
    assert lr.thresholds(50.0) == (1000, 100, 100)


def test_request_work_prices_prompt_tokens_at_a_fraction_of_a_generated_token() -> None:
    assert request_work(1000, 100, prompt_token_work=0.1) == 200.0
    assert request_work(-5, -1) == 0.0


@pytest.mark.parametrize(
    ("shares", "kw", "field"),
    [
        ([], {}, "set_shares"),
        ([1.2], {}, "set_shares"),
        ([0.8, 0.5], {}, "set_shares"),
        ([0.5], {"fraction": 0.0}, "fraction"),
        ([0.5], {"window": 0}, "window"),
        ([0.5], {"min_samples": 65}, "min_samples"),
        ([0.5], {"rederive_every_s": -1.0}, "rederive_every_s"),
        ([0.5], {"hysteresis": 1.0}, "hysteresis"),
    ],
)
def test_bad_parameters_are_refused_by_name(shares: list[float], kw: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        learner(shares, **kw)


@pytest.mark.parametrize(("cap", "work", "field"), [(-1, 1.0, "cap_tokens"), (1, -1.0, "work")])
def test_bad_observations_are_refused(cap: int, work: float, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        learner([0.5]).observe(cap, work, 0.0)
