"""Live class sets in the discrete-event fleet (:class:`simulation.fleetsim.balancers.TieredBalancer`,
``Scenario.live_classes``): the same pure rule as the xDS server (:func:`inferlb.policy.length_aware.
live_class_sets`); healthy it never moves the sets, a throttled H100 brings an A100 into the longest class."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.policy.length_aware import class_set_performance
from inferlb.policy.weights import DEFAULT_PARAMS, WeightInputs, WeightParams, target_weight
from simulation.fleetsim.balancers import TieredBalancer
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.results import FleetRunResult
from simulation.fleetsim.scenario import Scenario
from simulation.fleetsim.workload import fleet_capacity_rps, fleet_mix, scale_trace
from simulation.gpusim.engine import TimingModel
from tests.unit.test_fleetsim import config, engine_factory, trace


def _balancer() -> TieredBalancer:
    tb = TieredBalancer(
        6, class_hosts=((0,), (0, 1, 2)), thresholds=(800, 400), saturation_active=[3] * 6,
        rng=random.Random(0), choice_count=2, spill=False,
    )  # fmt: skip
    tb.set_weights([30, 20, 20, 10, 10, 10], [0] * 6)
    return tb


@given(st.lists(st.integers(0, 5), min_size=6, max_size=6))
def test_new_class_sets_take_effect_with_the_last_weights(active: list[int]) -> None:
    tb = _balancer()
    tb.set_class_hosts([(0, 1), (0, 1, 2, 3)], active)
    assert tb.class_hosts == ((0, 1), (0, 1, 2, 3))
    assert {tb.pick_for(active, 900) for _ in range(40)} <= {0, 1}
    assert {tb.pick_for(active, 500) for _ in range(40)} <= {0, 1, 2, 3}


def test_set_class_hosts_refuses_sets_that_are_not_nested_or_empty() -> None:
    tb = _balancer()
    with pytest.raises(ValueError, match="nested"):
        tb.set_class_hosts([(0, 4), (0, 1, 2)], [0] * 6)
    with pytest.raises(ValueError, match="one non-empty"):
        tb.set_class_hosts([(), (0, 1)], [0] * 6)
    with pytest.raises(ValueError, match="one non-empty"):
        tb.set_class_hosts([(0,)], [0] * 6)
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        tb.set_class_hosts([(0,), (0, 9)], [0] * 6)


def test_the_sets_follow_the_clock_not_the_noisy_speed_ratio() -> None:
    slow_tokens = WeightInputs(
        profile_capacity=3.4, max_batch=16, telemetry_age_s=0.1, running_requests=8,
        generation_tokens_per_s=10.0, reference_tokens_per_s=20.0,
    )  # fmt: skip
    b = target_weight(slow_tokens, DEFAULT_PARAMS)
    assert b.performance < 0.2 and class_set_performance(b) == 1.0
    clocked = WeightInputs(profile_capacity=3.4, max_batch=16, telemetry_age_s=0.1, clock_ratio=0.5)
    assert class_set_performance(target_weight(clocked, DEFAULT_PARAMS)) == 0.5
    stale = WeightInputs(profile_capacity=3.4, max_batch=16, telemetry_age_s=60.0, clock_ratio=0.5)
    assert class_set_performance(target_weight(stale, DEFAULT_PARAMS)) is None


def _run(*, live: bool, throttle: bool) -> tuple[FleetRunResult, list[int]]:
    cfg = config()
    fleet = fleet_mix(cfg, 8)
    models = [TimingModel.for_endpoint(cfg, g.endpoint) for g in fleet]
    rate = 0.9 * fleet_capacity_rps(models, trace())
    arrivals = scale_trace(trace(), rate_rps=rate, duration_s=60.0)
    h100 = next(g.index for g in fleet if g.gpu_type == "H100")
    sc = Scenario(
        policy="tiered", duration_s=60.0, warmup_s=10.0, spill=False, live_classes=live,
        throttle_at_s=30.0 if throttle else None, throttle_gpus=(h100,) if throttle else (),
    )  # fmt: skip
    r = simulate(fleet, engine_factory(cfg), arrivals, sc, WeightParams.from_config(cfg.weights))  # type: ignore[arg-type]
    assert r.tier_thresholds is not None
    longest = [i for i, row in enumerate(arrivals[: r.arrivals]) if row.output_tokens > r.tier_thresholds[0]]
    return r, longest


def test_healthy_live_sets_are_the_static_ones_and_never_change() -> None:
    static, _ = _run(live=False, throttle=False)
    live, _ = _run(live=True, throttle=False)
    assert live.live_classes and live.class_set_changes == 0
    assert live.arrival_gpus == static.arrival_gpus  # the very same placement


def test_a_throttled_h100_brings_an_a100_into_the_longest_class() -> None:
    r, longest = _run(live=True, throttle=True)
    fleet = fleet_mix(config(), 8)
    assert r.class_set_changes >= 1
    before = Counter(fleet[r.arrival_gpus[i]].gpu_type for i in longest if r.arrival_times[i] < 30.0)
    after = Counter(fleet[r.arrival_gpus[i]].gpu_type for i in longest if r.arrival_times[i] > 32.0)
    assert set(before) == {"H100"}, before
    assert after["A100"] > 0 and after["V100"] == 0, after
    static, _ = _run(live=False, throttle=True)
    assert static.class_set_changes == 0
    assert {fleet[static.arrival_gpus[i]].gpu_type for i in longest} == {"H100"}
