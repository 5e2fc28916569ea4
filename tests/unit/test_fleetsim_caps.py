"""Real clients' output caps in the fleet simulation: the cap habits of :func:`inferlb.traces.client_caps`,
thresholds fitted on the caps the gateway sees, classing by predicted lengths, the per-length-class
latencies, and a fleet of one GPU class (no confined class, no error)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import inferlb
from inferlb.config.schema import Config, load_config
from inferlb.policy.weights import WeightParams
from inferlb.traces import (
    CAP_MODES,
    DEFAULT_TRACE,
    MIX_TENANTS,
    ROUNDED_CAPS,
    CapMode,
    TraceRow,
    client_caps,
    read_trace,
)
from simulation.fleetsim.balancers import TieredBalancer
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.results import FleetRunResult
from simulation.fleetsim.scenario import Scenario
from simulation.fleetsim.workload import (
    FleetGpu,
    fleet_capacity_rps,
    fleet_mix,
    predicted_caps,
    scale_trace,
    tiered_thresholds,
)
from simulation.gpusim.engine import BatchEngine, TimingModel

LOCAL = Path(inferlb.__file__).parent / "data" / "local.yaml"


@cache
def config() -> Config:
    return load_config(LOCAL)


@cache
def trace() -> tuple[TraceRow, ...]:
    return tuple(read_trace(DEFAULT_TRACE))


def make_engine(g: FleetGpu) -> BatchEngine:
    return BatchEngine(model=TimingModel.for_endpoint(config(), g.endpoint))


rows_st = st.lists(
    st.builds(
        TraceRow,
        offset_s=st.floats(0, 100),
        prompt_tokens=st.integers(1, 4000),
        output_tokens=st.integers(0, 9000),
    ),
    max_size=40,
)


@given(rows=rows_st, mode=st.sampled_from(CAP_MODES), seed=st.integers(0, 2**16))
def test_client_caps_change_only_the_cap_and_each_habit_keeps_its_rule(
    rows: list[TraceRow], mode: str, seed: int
) -> None:
    out = client_caps(rows, mode, seed=seed, fixed_cap=1024, default_cap=256)  # type: ignore[arg-type]
    assert out == client_caps(rows, mode, seed=seed, fixed_cap=1024, default_cap=256)  # type: ignore[arg-type]
    assert [dataclasses.replace(r, max_tokens=None, cap_sent=True, tenant="") for r in out] == rows
    for r in out:
        true = max(1, r.output_tokens)
        habit = r.tenant
        assert habit == mode or (mode == "mix" and habit in {name for name, _ in MIX_TENANTS})
        if habit == "exact":
            assert r.output_cap == true
        elif habit == "fixed":
            assert r.output_cap == 1024 and r.cap_sent
        elif habit == "none":
            assert r.output_cap == 256 and not r.cap_sent
        elif habit == "rounded":
            assert r.output_cap >= true
            assert r.output_cap in ROUNDED_CAPS or r.output_cap % ROUNDED_CAPS[-1] == 0
        else:  # noise: an upper bound of the completion
            assert r.output_cap >= true


def test_rounded_caps_take_the_first_rung_at_or_above_the_completion() -> None:
    rows = [TraceRow(offset_s=0.0, prompt_tokens=1, output_tokens=n) for n in (1, 256, 257, 4096, 4097)]
    assert [r.output_cap for r in client_caps(rows, "rounded")] == [256, 256, 512, 4096, 8192]


def test_the_mix_draws_its_tenants_by_their_shares() -> None:
    rows = [TraceRow(offset_s=0.0, prompt_tokens=1, output_tokens=100)] * 5000
    counts = Counter(r.tenant for r in client_caps(rows, "mix", seed=3))
    for name, share in MIX_TENANTS:
        assert abs(counts[name] / 5000 - share) < 0.03


def test_client_caps_refuse_an_unknown_mode_and_bad_caps() -> None:
    row = [TraceRow(offset_s=0.0, prompt_tokens=1, output_tokens=1)]
    with pytest.raises(ValueError, match="cap mode"):
        client_caps(row, "loose")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fixed_cap"):
        client_caps(row, "fixed", fixed_cap=0)
    with pytest.raises(ValueError, match="noise_sigma"):
        client_caps(row, "noise", noise_sigma=-1.0)


def test_thresholds_fitted_on_one_default_cap_confine_nothing() -> None:
    fleet = fleet_mix(config(), 16)
    model = TimingModel.for_endpoint(config(), fleet[0].endpoint)
    rows = list(trace()[:2000])
    fixed = client_caps(rows, "fixed", fixed_cap=1024)
    assert tiered_thresholds(fleet, model, fixed) == (1024, 1024)
    # the same rows' true completions give real classes: the old way, which a default cap turns into
    # "every request is long"
    assert all(t < 1024 for t in tiered_thresholds(fleet, model, rows))


def test_predicted_caps_replace_a_default_cap_by_the_learnt_length() -> None:
    rows = client_caps(list(trace()[:500]), "fixed", fixed_cap=1024)
    out = predicted_caps(rows, 256)
    # cold: the first requests class by their cap; once the tenant has answers, by the prediction
    assert out[0].output_cap == 1024
    assert sum(r.output_cap < 1024 for r in out) > 400
    assert [r.output_tokens for r in out] == [r.output_tokens for r in rows]


# -- runs ----------------------------------------------------------------------------------------------------


def arrivals(fleet: tuple[FleetGpu, ...], *, load: float, duration: float) -> list[TraceRow]:
    models = [TimingModel.for_endpoint(config(), g.endpoint) for g in fleet]
    rate = load * fleet_capacity_rps(models, trace())
    return scale_trace(trace()[len(trace()) // 2 :], rate_rps=rate, duration_s=duration)


def run(
    fleet: tuple[FleetGpu, ...], rows: list[TraceRow], policy: str, *, duration: float, seed: int = 1,
    **kw: object,
) -> FleetRunResult:  # fmt: skip
    sc = Scenario(
        policy=policy,  # type: ignore[arg-type]
        duration_s=duration,
        warmup_s=duration / 4,
        seed=seed,
        **kw,  # type: ignore[arg-type]
    )
    return simulate(fleet, make_engine, rows, sc, WeightParams.from_config(config().weights))


def test_a_run_reports_latency_per_true_length_class() -> None:
    fleet = fleet_mix(config(), 8)
    rows = arrivals(fleet, load=0.7, duration=12.0)
    r = run(fleet, rows, "telemetry_weights", duration=12.0)
    short, long_ = r.length_class("short"), r.length_class("long")
    assert short is not None and long_ is not None and short.split_tokens == long_.split_tokens
    finished = sum(1 for x in rows if 3.0 <= x.offset_s < 12.0) - r.refused
    assert short.requests + long_.requests == finished
    assert long_.requests < short.requests
    assert long_.e2e_p50_s > short.e2e_p50_s


def test_a_run_with_predicted_lengths_classes_default_caps_by_prediction() -> None:
    fleet = fleet_mix(config(), 8)
    rows = client_caps(arrivals(fleet, load=0.7, duration=12.0), "fixed", fixed_cap=1024)
    plain = run(fleet, rows, "tiered", duration=12.0, tier_thresholds=(400, 250))
    pred = run(fleet, rows, "tiered", duration=12.0, tier_thresholds=(400, 250), predict_lengths=True)
    assert plain.predicted_requests == 0
    assert plain.class_requests[0] == len(rows)  # every default cap is above both thresholds
    assert pred.predicted_requests > len(rows) // 2
    assert pred.class_requests[0] < len(rows) // 2
    assert pred.finished + pred.refused + pred.unfinished == len(rows)


# -- a fleet of one GPU class ------------------------------------------------------------------------------


def one_class_fleet(gpu: str, n: int = 6) -> tuple[FleetGpu, ...]:
    fleet = [g for g in fleet_mix(config(), 3 * n) if g.gpu_type == gpu][:n]
    return tuple(dataclasses.replace(g, index=i) for i, g in enumerate(fleet))


def test_a_tiered_balancer_without_a_confined_class_balances_over_every_host() -> None:
    tb = TieredBalancer(
        4, class_hosts=(), thresholds=(), saturation_active=[1] * 4, rng=random.Random(0)
    )  # fmt: skip
    picks = Counter(tb.pick_for([0] * 4, 10_000) for _ in range(400))
    assert set(picks) == {0, 1, 2, 3}
    assert tb.class_picks == [400] and tb.confined_picks == 0


@pytest.mark.parametrize("gpu", ["A100", "V100"])
@pytest.mark.parametrize("policy", ["tiered", "length_aware", "tiered_live"])
def test_one_gpu_class_degrades_to_the_plain_weighted_policy(gpu: str, policy: str) -> None:
    fleet = one_class_fleet(gpu)
    rows = client_caps(arrivals(fleet, load=0.8, duration=10.0), "exact")
    ref = run(fleet, rows, "telemetry_weights", duration=10.0)
    model = TimingModel.for_endpoint(config(), fleet[0].endpoint)
    assert tiered_thresholds(fleet, model, rows) == ()
    got = run(
        fleet,
        rows,
        "tiered" if policy == "tiered_live" else policy,
        duration=10.0,
        live_classes=policy == "tiered_live",
        tier_thresholds=(),
        long_output_tokens=300,
        long_min_relative_capacity=2.0,  # no GPU of the fleet reaches it: no fast set
    )
    assert got.long_requests == 0 and got.class_requests == (len(rows),)
    assert got.arrival_gpus == ref.arrival_gpus
    assert got.e2e_p99_s == ref.e2e_p99_s


# -- the property: thresholds fitted on the caps seen, with spill, never cost much -------------------------

#: The bound: tiered p99 <= P99_FACTOR x telemetry weights' p99 + P99_SLACK_S, and nothing refused or left
#: unfinished beyond what the plain policy refused. Why it holds by design: thresholds fitted on the caps the
#: gateway sees put at most ``fraction`` (0.75) of a tier set's capacity on its confined requests
#: (:func:`inferlb.policy.length_aware.tier_thresholds`); an uninformative cap (one default, none) confines
#: nothing, and then the run makes the plain policy's very picks (the class sets draw from their own random
#: stream); a saturated set spills to the next wider one. What is left is the seed's noise on a 16-GPU p99
#: where some requests are confined: measured 0.83-1.02x over the 12 cells of every cap mode x seeds 1, 2
#: (40 s, 90%; fixed and none exactly 1.00x), while thresholds fitted on the true completions without spill
#: give 1.40-1.45x when every client sends 1,024.
P99_FACTOR = 1.1
P99_SLACK_S = 1.0
PROP_GPUS, PROP_DURATION_S, PROP_LOAD = 16, 40.0, 0.9


@cache
def prop_fleet() -> tuple[FleetGpu, ...]:
    return fleet_mix(config(), PROP_GPUS)


@cache
def prop_arrivals() -> tuple[TraceRow, ...]:
    return tuple(arrivals(prop_fleet(), load=PROP_LOAD, duration=PROP_DURATION_S))


@cache
def plain(seed: int) -> FleetRunResult:
    return run(prop_fleet(), list(prop_arrivals()), "telemetry_weights", duration=PROP_DURATION_S, seed=seed)


def within_bound(mode: CapMode, fixed_cap: int, seed: int, *, fit_on_caps: bool, spill: bool) -> bool:
    fleet = prop_fleet()
    rows = client_caps(list(prop_arrivals()), mode, seed=seed, fixed_cap=fixed_cap)
    half = len(trace()) // 2
    train_true = list(trace()[:half])
    train = (
        client_caps(train_true, mode, seed=seed + 1000, fixed_cap=fixed_cap) if fit_on_caps else train_true
    )
    model = TimingModel.for_endpoint(config(), fleet[0].endpoint)
    thresholds = tiered_thresholds(fleet, model, train)
    got = run(
        fleet, rows, "tiered", duration=PROP_DURATION_S, seed=seed, tier_thresholds=thresholds, spill=spill
    )
    ref = plain(seed)
    lost = got.refused + got.unfinished - ref.refused - ref.unfinished
    return lost <= 0 and got.e2e_p99_s <= P99_FACTOR * ref.e2e_p99_s + P99_SLACK_S


@settings(max_examples=3, derandomize=True, deadline=None)
@given(
    mode=st.sampled_from(CAP_MODES),
    fixed_cap=st.sampled_from([512, 1024, 2048]),
    seed=st.integers(1, 2),
)
def test_tiered_fitted_on_the_caps_seen_with_spill_stays_within_the_bound_of_the_plain_policy(
    mode: CapMode, fixed_cap: int, seed: int
) -> None:
    assert within_bound(mode, fixed_cap, seed, fit_on_caps=True, spill=True)


def test_the_bound_fails_for_thresholds_fitted_on_true_lengths_without_spill() -> None:
    # every client sends 1,024 while the thresholds came from the true completions: every request is of the
    # longest class, and without spill (Envoy's subsets) the H100s take the whole load
    assert not within_bound("fixed", 1024, 1, fit_on_caps=False, spill=False)
    assert within_bound("fixed", 1024, 1, fit_on_caps=True, spill=False)
    assert not math.isnan(plain(1).e2e_p99_s)


# -- thresholds learnt online ------------------------------------------------------------------------------


def test_learnt_thresholds_confine_nothing_under_one_default_cap_and_separate_exact_caps() -> None:
    # 16 GPUs at 80% bring the learner its 256 first requests well before its second derivation (10 s)
    fleet = fleet_mix(config(), 16)
    rows = arrivals(fleet, load=0.8, duration=15.0)
    fixed = run(fleet, client_caps(rows, "fixed"), "tiered", duration=15.0, learn_thresholds=True)
    assert fixed.threshold_changes >= 1
    assert fixed.tier_thresholds == (1024, 1024) and fixed.long_requests == 0
    exact = run(fleet, client_caps(rows, "exact"), "tiered", duration=15.0, learn_thresholds=True)
    assert exact.threshold_changes >= 1 and exact.tier_thresholds is not None
    assert 0 < exact.long_requests < len(rows) // 2
    assert max(exact.tier_thresholds) < max(r.output_tokens for r in rows)


def test_learnt_thresholds_on_one_gpu_class_confine_nothing() -> None:
    fleet = one_class_fleet("A100")
    rows = client_caps(arrivals(fleet, load=0.8, duration=10.0), "exact")
    got = run(fleet, rows, "tiered", duration=10.0, learn_thresholds=True)
    assert got.tier_thresholds == () and got.threshold_changes == 0 and got.long_requests == 0


def test_a_tiered_run_that_confines_nothing_makes_the_plain_policys_picks() -> None:
    fleet = fleet_mix(config(), 12)
    rows = client_caps(arrivals(fleet, load=0.9, duration=10.0), "fixed", fixed_cap=1024)
    ref = run(fleet, rows, "telemetry_weights", duration=10.0)
    got = run(fleet, rows, "tiered", duration=10.0, tier_thresholds=(1024, 1024))
    assert got.long_requests == 0
    assert got.arrival_gpus == ref.arrival_gpus and got.e2e_p99_s == ref.e2e_p99_s
