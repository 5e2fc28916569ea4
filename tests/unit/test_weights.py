"""The weight policy (inferlb.policy.weights): bounds, monotonicity, convergence, staleness, slow start,
throttling."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from inferlb.config.schema import WeightsConfig
from inferlb.policy.weights import (
    DEFAULT_PARAMS,
    THROTTLE_HALVING_STEPS,
    WeightInputs,
    WeightParams,
    WeightState,
    fleet_reference_rate,
    profile_weight,
    slow_start_ramp,
    step,
    target_weight,
)

NO_RAMP = dataclasses.replace(DEFAULT_PARAMS, slow_start_s=0.0)

capacities = st.floats(min_value=0.05, max_value=50.0, allow_nan=False)
ages = st.one_of(st.none(), st.floats(min_value=0.0, max_value=100.0, allow_nan=False))
counts = st.integers(min_value=0, max_value=5000)
fractions = st.floats(min_value=0.0, max_value=1.5, allow_nan=False)
clocks = st.one_of(st.none(), st.floats(min_value=0.01, max_value=1.0, allow_nan=False))
rates = st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e5, allow_nan=False))


@st.composite
def inputs(draw: st.DrawFn, *, fresh: bool | None = None) -> WeightInputs:
    age = draw(ages)
    if fresh is True:
        age = draw(st.floats(min_value=0.0, max_value=DEFAULT_PARAMS.stale_after_s))
    elif fresh is False:
        age = draw(
            st.one_of(st.none(), st.floats(min_value=DEFAULT_PARAMS.stale_after_s + 1e-6, max_value=1e6))
        )
    return WeightInputs(
        profile_capacity=draw(capacities),
        max_batch=draw(st.integers(min_value=1, max_value=512)),
        telemetry_age_s=age,
        waiting_requests=draw(counts),
        running_requests=draw(counts),
        kv_cache_usage=draw(fractions),
        thermal_throttled=draw(st.booleans()),
        power_throttled=draw(st.booleans()),
        clock_ratio=draw(clocks),
        error_rate=draw(st.floats(min_value=0.0, max_value=1.0)),
        generation_tokens_per_s=draw(rates),
        reference_tokens_per_s=draw(st.one_of(st.none(), st.floats(min_value=0.1, max_value=1e4))),
    )


@st.composite
def states(draw: st.DrawFn) -> WeightState:
    first = draw(st.floats(min_value=0.0, max_value=1000.0))
    updated = first + draw(st.floats(min_value=0.0, max_value=100.0))
    return WeightState(
        first_seen_at=first,
        updated_at=updated,
        smoothed=draw(st.floats(min_value=0.0, max_value=20_000.0)),
        weight=draw(st.integers(min_value=1, max_value=DEFAULT_PARAMS.max_weight)),
    )


def healthy(capacity: float = 1.7, **overrides: object) -> WeightInputs:
    values: dict[str, object] = {
        "profile_capacity": capacity,
        "max_batch": 16,
        "telemetry_age_s": 0.2,
        "waiting_requests": 0,
        "running_requests": 8,
        "kv_cache_usage": 0.3,
        "generation_tokens_per_s": 8 * capacity * 30.0,
        "reference_tokens_per_s": 30.0,
    }
    values.update(overrides)
    return WeightInputs(**values)  # type: ignore[arg-type]


def run(
    inp: WeightInputs, *, steps: int, dt: float = 0.5, state: WeightState | None = None, t0: float = 0.0,
    params: WeightParams = NO_RAMP,
) -> tuple[WeightState, list[int]]:  # fmt: skip
    weights: list[int] = []
    t = t0 if state is None else state.updated_at
    for _ in range(steps):
        state, w = step(state, inp, t, params)
        weights.append(w)
        t += dt
    assert state is not None
    return state, weights


# -- bounds ----------------------------------------------------------------------------------------------


@given(inputs(), states(), st.floats(min_value=0.0, max_value=200.0))
def test_weight_is_always_an_integer_within_bounds(inp: WeightInputs, state: WeightState, dt: float) -> None:
    new, w = step(state, inp, state.updated_at + dt)
    assert isinstance(w, int)
    assert DEFAULT_PARAMS.max_weight >= w >= 1
    assert new.weight == w
    _, w0 = step(None, inp, 0.0)
    assert DEFAULT_PARAMS.max_weight >= w0 >= 1


@given(inputs(fresh=True))
def test_tiny_capacity_and_worst_telemetry_never_zero_a_gpu(inp: WeightInputs) -> None:
    worst = dataclasses.replace(
        inp,
        profile_capacity=0.001,
        waiting_requests=10**6,
        kv_cache_usage=1.0,
        error_rate=1.0,
        clock_ratio=0.01,
    )
    _, w = run(worst, steps=5)
    assert w[-1] == 1


def test_a_huge_capacity_is_capped_at_max_weight() -> None:
    params = dataclasses.replace(NO_RAMP, max_weight=500)
    _, w = run(healthy(capacity=100.0, running_requests=0), steps=3, params=params)
    assert w == [500, 500, 500]


# -- monotonicity ----------------------------------------------------------------------------------------


@given(inputs(fresh=True), states(), st.integers(min_value=1, max_value=1000))
def test_more_waiting_requests_never_raise_the_weight(
    inp: WeightInputs, state: WeightState, more: int
) -> None:
    busier = dataclasses.replace(inp, waiting_requests=inp.waiting_requests + more)
    assert target_weight(busier, DEFAULT_PARAMS).target <= target_weight(inp, DEFAULT_PARAMS).target
    now = state.updated_at + 0.5
    assert step(state, busier, now)[1] <= step(state, inp, now)[1]


@given(
    inputs(fresh=True),
    states(),
    st.floats(min_value=0.0, max_value=1.0),
    st.floats(min_value=0.0, max_value=1.0),
)
def test_more_kv_usage_never_raises_the_weight(
    inp: WeightInputs, state: WeightState, a: float, b: float
) -> None:
    lo, hi = sorted((a, b))
    low = dataclasses.replace(inp, kv_cache_usage=lo)
    high = dataclasses.replace(inp, kv_cache_usage=hi)
    assert target_weight(high, DEFAULT_PARAMS).target <= target_weight(low, DEFAULT_PARAMS).target
    now = state.updated_at + 0.5
    assert step(state, high, now)[1] <= step(state, low, now)[1]


@given(
    inputs(fresh=True),
    states(),
    st.floats(min_value=0.01, max_value=1.0),
    st.floats(min_value=0.01, max_value=1.0),
)
def test_throttling_never_raises_the_weight(
    inp: WeightInputs, state: WeightState, a: float, b: float
) -> None:
    now = state.updated_at + 0.5
    # a lower clock ratio
    lo, hi = sorted((a, b))
    slow = dataclasses.replace(inp, clock_ratio=lo)
    fast = dataclasses.replace(inp, clock_ratio=hi)
    assert target_weight(slow, DEFAULT_PARAMS).target <= target_weight(fast, DEFAULT_PARAMS).target
    assert step(state, slow, now)[1] <= step(state, fast, now)[1]
    # a throttle reason set
    for flag in ("thermal_throttled", "power_throttled"):
        calm = dataclasses.replace(inp, thermal_throttled=False, power_throttled=False)
        hot = dataclasses.replace(calm, **{flag: True})
        assert target_weight(hot, DEFAULT_PARAMS).target <= target_weight(calm, DEFAULT_PARAMS).target
        assert step(state, hot, now)[1] <= step(state, calm, now)[1]


@given(inputs(fresh=True), st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.0, max_value=1.0))
def test_more_errors_never_raise_the_weight(inp: WeightInputs, a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert (
        target_weight(dataclasses.replace(inp, error_rate=hi), DEFAULT_PARAMS).target
        <= target_weight(dataclasses.replace(inp, error_rate=lo), DEFAULT_PARAMS).target
    )


@given(capacities, capacities)
def test_profile_weight_follows_capacity(a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert profile_weight(lo, DEFAULT_PARAMS) <= profile_weight(hi, DEFAULT_PARAMS)


# -- convergence -----------------------------------------------------------------------------------------


@settings(max_examples=150)
@given(
    inputs(fresh=True),
    st.floats(min_value=0.05, max_value=2.0),
    st.floats(min_value=0.0, max_value=20_000.0),
)
def test_a_steady_input_converges_then_never_changes(inp: WeightInputs, dt: float, start: float) -> None:
    state = WeightState(
        first_seen_at=-1000.0, updated_at=0.0, smoothed=start, weight=max(1, min(10_000, round(start)))
    )
    target = target_weight(inp, NO_RAMP).target
    assume(target >= 1.0)
    # 60 time constants: exp(-60) leaves no visible gap whatever the start
    steps = int(60 * NO_RAMP.smoothing_tau_s / dt) + 2
    state, history = run(inp, steps=steps, dt=dt, state=state, params=NO_RAMP)
    # no oscillation: every change goes the same way
    diffs = [b - a for a, b in itertools.pairwise(history) if b != a]
    assert all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    settled = history[-1]
    _, after = run(inp, steps=200, dt=dt, state=state, params=NO_RAMP)
    assert set(after) == {settled}
    # and it settled within the hysteresis band of the target
    bounded_target = max(1.0, min(NO_RAMP.max_weight, target))
    assert abs(settled - bounded_target) <= NO_RAMP.hysteresis * settled / (1 - NO_RAMP.hysteresis) + 1


def test_smoothing_does_not_depend_on_the_step_rate() -> None:
    state = WeightState(first_seen_at=-100.0, updated_at=0.0, smoothed=170.0, weight=170)
    target = healthy(clock_ratio=0.5)
    coarse, _ = run(target, steps=3, dt=1.0, state=state)  # t = 0, 1, 2
    fine, _ = run(target, steps=21, dt=0.1, state=state)  # t = 0 .. 2.0
    assert coarse.smoothed == pytest.approx(fine.smoothed, rel=1e-6)


# -- staleness -------------------------------------------------------------------------------------------


@given(inputs(fresh=False), states())
def test_stale_or_missing_telemetry_gives_the_profile_weight(inp: WeightInputs, state: WeightState) -> None:
    # past the slow-start window, whatever the smoothing history and pushed weight
    now = state.first_seen_at + DEFAULT_PARAMS.slow_start_s + state.updated_at + 1.0
    _, w = step(state, inp, now)
    assert w == profile_weight(inp.profile_capacity, DEFAULT_PARAMS)
    b = target_weight(inp, DEFAULT_PARAMS)
    assert not b.fresh and b.target == pytest.approx(DEFAULT_PARAMS.scale * inp.profile_capacity)


def test_a_throttled_gpu_whose_telemetry_stops_goes_back_to_its_profile_weight() -> None:
    state, w = run(healthy(clock_ratio=0.25, thermal_throttled=True), steps=40)
    assert w[-1] < 60
    stale = healthy(clock_ratio=0.25, thermal_throttled=True, telemetry_age_s=NO_RAMP.stale_after_s + 0.1)
    _, w2 = step(state, stale, state.updated_at + 0.5, NO_RAMP)
    assert w2 == 170


# -- throttling ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("measured", [True, False])
def test_a_gpu_throttled_to_half_speed_falls_to_about_half_within_the_documented_steps(
    measured: bool,
) -> None:
    before = healthy()
    state, w = run(before, steps=20)
    w_before = w[-1]
    assert w_before == round(target_weight(before, NO_RAMP).target)
    throttled = healthy(
        thermal_throttled=True,
        clock_ratio=0.5,
        generation_tokens_per_s=(before.generation_tokens_per_s or 0) / 2 if measured else None,
    )
    b = target_weight(throttled, NO_RAMP)
    # the throttle and the halved throughput are one cause: counted once
    assert b.performance == pytest.approx(0.5)
    t = state.updated_at + 0.5
    history = []
    for _ in range(THROTTLE_HALVING_STEPS):
        state, wt = step(state, throttled, t, NO_RAMP)
        history.append(wt)
        t += 0.5
    assert history[0] < 0.85 * w_before  # pushed at the first step
    assert 0.45 * w_before <= history[-1] <= 0.6 * w_before
    _, later = run(throttled, steps=100, state=state)
    assert all(0.45 * w_before <= x <= 0.6 * w_before for x in later)
    assert len(set(later)) <= 2  # at most one last push, then steady


def test_throughput_above_the_reference_raises_the_weight_up_to_the_cap() -> None:
    fast = target_weight(healthy(generation_tokens_per_s=8 * 1.7 * 30.0 * 1.3), NO_RAMP)
    assert fast.speed_ratio == pytest.approx(1.3)
    wild = target_weight(healthy(generation_tokens_per_s=1e9), NO_RAMP)
    assert wild.speed_ratio == NO_RAMP.max_speed_ratio


def test_an_idle_gpu_is_not_judged_by_its_zero_throughput() -> None:
    idle = target_weight(healthy(running_requests=0, generation_tokens_per_s=0.0), NO_RAMP)
    assert idle.speed_ratio is None and idle.performance == 1.0
    assert idle.target == pytest.approx(170.0)


def test_factors_at_known_points() -> None:
    b = target_weight(
        healthy(waiting_requests=16, running_requests=16, kv_cache_usage=0.9, error_rate=0.1), NO_RAMP
    )
    assert b.load == pytest.approx(1 / (1 + 1.0 + 0.25))
    assert b.kv == pytest.approx(1 - 0.5 * 0.8)
    assert b.errors == pytest.approx(0.8)
    assert b.target == pytest.approx(170 * b.performance * b.load * b.kv * b.errors)


# -- slow start ------------------------------------------------------------------------------------------


def test_a_new_endpoint_ramps_in_over_the_slow_start_window_and_ends_at_its_target() -> None:
    inp = healthy(running_requests=0)
    _, w = run(inp, steps=30, dt=0.5, params=DEFAULT_PARAMS)  # 15 s, window 10 s
    assert w[0] == 17  # 10% of 170
    assert w == sorted(w)
    assert w[-1] == 170
    assert w[19] < 170 <= w[20]  # the ramp completes at t = 10 s (step 20) and is pushed then


@given(st.floats(min_value=-5.0, max_value=50.0), st.floats(min_value=0.0, max_value=50.0))
def test_slow_start_ramp_is_bounded_and_non_decreasing(a: float, extra: float) -> None:
    r1, r2 = slow_start_ramp(a, DEFAULT_PARAMS), slow_start_ramp(a + extra, DEFAULT_PARAMS)
    assert DEFAULT_PARAMS.slow_start_min_fraction <= r1 <= r2 <= 1.0


# -- parameters, inputs, helpers -------------------------------------------------------------------------


def test_params_from_the_default_config_equal_the_defaults() -> None:
    assert WeightParams.from_config(WeightsConfig()) == DEFAULT_PARAMS


@pytest.mark.parametrize(
    "bad",
    [
        {"scale": 0.0},
        {"max_weight": 0},
        {"smoothing_tau_s": -1.0},
        {"kv_knee": 1.0},
        {"kv_floor": 1.5},
        {"min_speed_ratio": 3.0},
        {"stale_after_s": float("nan")},
    ],
)
def test_bad_params_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        WeightParams(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"profile_capacity": 0.0}, "profile_capacity"),
        ({"max_batch": 0}, "max_batch"),
        ({"waiting_requests": -1}, "request counts"),
        ({"kv_cache_usage": float("nan")}, "kv_cache_usage"),
        ({"telemetry_age_s": -1.0}, "telemetry_age_s"),
        ({"clock_ratio": 0.0}, "clock_ratio"),
        ({"clock_ratio": 1.2}, "clock_ratio"),
    ],
)
def test_bad_inputs_are_refused(bad: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        healthy(**bad)


def test_time_running_backwards_counts_as_no_time() -> None:
    state, _ = run(healthy(), steps=5)
    later, w = step(state, healthy(clock_ratio=0.5), state.updated_at - 10.0, NO_RAMP)
    assert later.updated_at == state.updated_at
    assert later.smoothed == state.smoothed and w == state.weight


def test_fleet_reference_rate_is_the_median_per_capacity_per_sequence_rate() -> None:
    samples = [(1.0, 300.0, 10), (1.7, 1.7 * 30 * 4, 4), (3.4, 3.4 * 15 * 2, 2), (2.0, 0.0, 0)]
    assert fleet_reference_rate(samples) == pytest.approx(30.0)
    assert fleet_reference_rate([(1.0, 0.0, 0)]) is None
