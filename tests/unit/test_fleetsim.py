"""simulation.fleetsim: Envoy's balancers as defined, the trace scaling and capacity, and small fleet runs
(deterministic, conserving requests, and the telemetry weights beating round robin where the model says
they must)."""

from __future__ import annotations

import random
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import inferlb
from inferlb.config.schema import Config, load_config, parse_config
from inferlb.policy.weights import WeightParams
from inferlb.traces import DEFAULT_TRACE, TraceRow, read_trace
from simulation.fleetsim.balancers import (
    EdfScheduler,
    LeastRequestBalancer,
    LengthAwareBalancer,
    RoundRobinBalancer,
    TieredBalancer,
)
from simulation.fleetsim.loop import simulate
from simulation.fleetsim.results import FleetRunResult, share_series, traffic_shift
from simulation.fleetsim.scenario import Scenario
from simulation.fleetsim.workload import (
    FleetGpu,
    fleet_capacity_rps,
    fleet_mix,
    long_output_threshold,
    request_service_seconds,
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


def engine_factory(cfg: Config, *, max_queue: int | None = None) -> object:
    def make(g: FleetGpu) -> BatchEngine:
        model = TimingModel.for_endpoint(cfg, g.endpoint)
        if max_queue is not None:
            model = TimingModel(
                relative_capacity=model.relative_capacity,
                prefill_tokens_per_s=model.prefill_tokens_per_s,
                decode_tokens_per_s=model.decode_tokens_per_s,
                max_batch=model.max_batch,
                max_queue=max_queue,
                kv_budget_tokens=model.kv_budget_tokens,
            )
        return BatchEngine(model=model)

    return make


def run(
    policy: str, *, gpus: int = 8, load: float = 0.9, duration: float = 90.0, max_queue: int | None = None,
    seed: int = 1, throttle: bool = False,
) -> FleetRunResult:  # fmt: skip
    cfg = config()
    fleet = fleet_mix(cfg, gpus)
    models = [TimingModel.for_endpoint(cfg, g.endpoint) for g in fleet]
    rate = load * fleet_capacity_rps(models, trace())
    arrivals = scale_trace(trace(), rate_rps=rate, duration_s=duration)
    h100 = next(g.index for g in fleet if g.gpu_type == "H100")
    sc = Scenario(
        policy=policy,  # type: ignore[arg-type]
        duration_s=duration,
        warmup_s=duration / 6,
        seed=seed,
        throttle_at_s=duration / 2 if throttle else None,
        throttle_gpus=(h100,) if throttle else (),
    )
    make = engine_factory(cfg, max_queue=max_queue)
    return simulate(fleet, make, arrivals, sc, WeightParams.from_config(cfg.weights))  # type: ignore[arg-type]


# -- the balancers ------------------------------------------------------------------------------------------


@given(n=st.integers(1, 50), seed=st.integers(0, 2**32))
def test_round_robin_cycles_through_every_host_in_order(n: int, seed: int) -> None:
    rr = RoundRobinBalancer(n, rng=random.Random(seed))
    picks = [rr.pick([0] * n) for _ in range(3 * n)]
    assert all(picks[i + 1] == (picks[i] + 1) % n for i in range(len(picks) - 1))
    assert Counter(picks) == dict.fromkeys(range(n), 3)


@given(active=st.lists(st.integers(0, 5), min_size=1, max_size=30), seed=st.integers(0, 2**32))
def test_p2c_never_picks_the_busier_of_its_two(active: list[int], seed: int) -> None:
    n = len(active)
    lr = LeastRequestBalancer(n, rng=random.Random(seed))
    mirror = random.Random(seed)
    for _ in range(20):
        a, b = mirror.randrange(n), mirror.randrange(n)
        picked = lr.pick(active)
        assert picked in (a, b)
        assert active[picked] == min(active[a], active[b])
        assert picked == (b if active[b] < active[a] else a)  # a tie keeps the first draw, as Envoy does


@settings(max_examples=60)
@given(
    weights=st.lists(st.integers(1, 20), min_size=2, max_size=8), laps=st.integers(1, 20), seed=st.integers()
)
def test_weighted_least_request_on_idle_hosts_sends_shares_proportional_to_weights(
    weights: list[int], laps: int, seed: int
) -> None:
    assume(len(set(weights)) > 1)  # equal weights are P2C, not EDF
    n = len(weights)
    lr = LeastRequestBalancer(n, rng=random.Random(seed))
    idle = [0] * n
    lr.set_weights(weights, idle)
    counts = Counter(lr.pick(idle) for _ in range(laps * sum(weights)))
    for h, w in enumerate(weights):
        # EDF picks host h once per 1/w of scheduler time: after `laps` units, laps * w picks, +-1 for phase
        assert abs(counts[h] - laps * w) <= 1


def test_weighted_least_request_steers_away_from_active_requests() -> None:
    # Equal-looking capacity (weights 10 and 11, so EDF applies), host 0 with 9 requests in flight: its
    # effective weight is 10 / 10 = 1 against 11 / 1 = 11, so it gets about 1 pick in 12.
    lr = LeastRequestBalancer(2, rng=random.Random(3))
    active = [9, 0]
    lr.set_weights([10, 11], active)
    counts = Counter(lr.pick(active) for _ in range(1200))
    assert 60 <= counts[0] <= 140


def test_equal_weights_fall_back_to_p2c_and_unequal_to_edf() -> None:
    lr = LeastRequestBalancer(4, rng=random.Random(0))
    lr.set_weights([5, 5, 5, 5], [0, 0, 0, 3])
    assert lr._edf is None
    lr.set_weights([5, 5, 5, 6], [0, 0, 0, 3])
    assert isinstance(lr._edf, EdfScheduler)


def test_weights_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        LeastRequestBalancer(2, rng=random.Random(0)).set_weights([0, 3], [0, 0])


# -- length-aware placement ---------------------------------------------------------------------------------


def length_aware(n: int = 6, fast: tuple[int, ...] = (1, 4), *, seed: int = 0) -> LengthAwareBalancer:
    la = LengthAwareBalancer(
        n, fast_hosts=fast, long_output_threshold=500, saturation_active=[3] * n, rng=random.Random(seed)
    )
    la.set_weights([10 + h for h in range(n)], [0] * n)  # unequal: weighted least request (EDF)
    return la


@given(
    active=st.lists(st.integers(0, 2), min_size=6, max_size=6),
    tokens=st.integers(501, 5000),
    seed=st.integers(0, 2**32),
)
def test_a_long_request_goes_to_the_fast_set_while_it_has_room(
    active: list[int], tokens: int, seed: int
) -> None:
    # Every host below the bound of 3: a long request must land on a fast host (1 or 4), never elsewhere.
    la = length_aware(seed=seed)
    for _ in range(20):
        assert la.pick_for(active, tokens) in (1, 4)
    assert (la.long_picks, la.fallbacks) == (20, 0)


def test_short_requests_use_the_whole_fleet_and_the_threshold_is_exclusive() -> None:
    la = length_aware()
    idle = [0] * 6
    picks = Counter(la.pick_for(idle, 500) for _ in range(600))  # 500 is not above the threshold
    assert set(picks) == set(range(6))
    assert la.long_picks == 0
    assert la.is_long(501) and not la.is_long(500)


def test_a_long_request_falls_back_to_the_fleet_only_when_every_fast_host_is_saturated() -> None:
    la = length_aware()
    one_fast_free = [0, 3, 0, 0, 2, 0]  # host 4 is below the bound of 3
    assert not la.fast_set_saturated(one_fast_free)
    assert {la.pick_for(one_fast_free, 1000) for _ in range(50)} <= {1, 4}
    assert la.fallbacks == 0
    saturated = [0, 3, 0, 0, 7, 0]
    assert la.fast_set_saturated(saturated)
    picks = Counter(la.pick_for(saturated, 1000) for _ in range(300))
    assert la.fallbacks == 300 and la.long_picks == 350
    # the fallback is the fleet's weighted least request: the idle slow hosts get the traffic
    assert sum(picks[h] for h in (0, 2, 3, 5)) > 0.8 * 300


def test_within_the_fast_set_weighted_least_request_steers_by_active_requests() -> None:
    la = length_aware(fast=(1, 4))
    active = [0, 2, 0, 0, 0, 0]  # weights 11 and 14: effective 11 / 3 against 14 / 1
    picks = Counter(la.pick_for(active, 1000) for _ in range(1000))
    assert picks[4] > 3 * picks[1] > 0


def test_length_aware_refuses_an_empty_fast_set_and_bad_bounds() -> None:
    with pytest.raises(ValueError, match="fast set is empty"):
        LengthAwareBalancer(3, fast_hosts=(), long_output_threshold=1, saturation_active=[1] * 3,
                            rng=random.Random(0))  # fmt: skip
    with pytest.raises(ValueError, match="saturation bounds"):
        LengthAwareBalancer(3, fast_hosts=(0,), long_output_threshold=1, saturation_active=[1],
                            rng=random.Random(0))  # fmt: skip
    with pytest.raises(ValueError, match="fast_hosts"):
        LengthAwareBalancer(3, fast_hosts=(3,), long_output_threshold=1, saturation_active=[1] * 3,
                            rng=random.Random(0))  # fmt: skip


def test_long_output_threshold_is_a_nearest_rank_percentile_of_completion_tokens() -> None:
    rows = [TraceRow(offset_s=float(i), prompt_tokens=10, output_tokens=i + 1) for i in range(100)]
    assert long_output_threshold(rows, 90) == 90
    assert long_output_threshold(rows, 100) == 100
    with pytest.raises(ValueError, match="percentile_rank"):
        long_output_threshold(rows, 101)
    with pytest.raises(ValueError, match="no rows"):
        long_output_threshold([], 50)


def test_a_length_aware_run_places_long_outputs_on_the_fast_gpus_and_conserves_requests() -> None:
    r = run("length_aware", duration=60.0)
    fleet = fleet_mix(config(), 8)
    assert r.long_output_threshold is not None
    assert r.finished + r.refused + r.unfinished == r.arrivals
    assert r.long_requests > 0
    models = [TimingModel.for_endpoint(config(), g.endpoint) for g in fleet]
    rows = scale_trace(trace(), rate_rps=0.9 * fleet_capacity_rps(models, trace()), duration_s=60.0)
    long_ = [i for i, row in enumerate(rows) if row.output_tokens > r.long_output_threshold]
    assert len(long_) == r.long_requests
    fast = sum(fleet[r.arrival_gpus[i]].relative_capacity >= 1.5 for i in long_)
    # every long request not counted as a fallback went to the fast set (A100s and H100s, capacity >= 1.5)
    assert fast >= r.long_requests - r.long_fallbacks
    assert r.long_fallbacks < r.long_requests
    short_gpus = {fleet[r.arrival_gpus[i]].gpu_type for i, row in enumerate(rows) if i not in set(long_)}
    assert short_gpus == {"H100", "A100", "V100"}


# -- tiered placement ---------------------------------------------------------------------------------------


def tiered(n: int = 6, *, seed: int = 0, bound: int = 3) -> TieredBalancer:
    # hosts 0 (fastest tier), 0-2 (two fastest tiers), all 6 for the rest; thresholds 800 and 400 tokens
    tb = TieredBalancer(
        n, class_hosts=((0,), (0, 1, 2)), thresholds=(800, 400), saturation_active=[bound] * n,
        rng=random.Random(seed),
    )  # fmt: skip
    tb.set_weights([30, 20, 20, 10, 10, 10][:n], [0] * n)
    return tb


#: (a completion cap, the index of its class, the hosts it may use) for :func:`tiered`'s thresholds 800/400
CLASSES = ((801, 0, {0}), (401, 1, {0, 1, 2}), (0, 2, set(range(6))))


@given(
    st.lists(st.integers(0, 2), min_size=6, max_size=6),
    st.sampled_from(CLASSES),
    st.integers(0, 399),
    st.integers(0, 2**32),
)
def test_each_length_class_lands_only_on_its_tier_set_while_it_has_room(
    active: list[int], cls: tuple[int, int, set[int]], extra: int, seed: int
) -> None:
    # every host below its bound of 3: no fallback, each class stays on its set
    least_cap, k, allowed = cls
    tb = tiered(seed=seed)
    picks = [tb.pick_for(active, least_cap + extra) for _ in range(10)]
    assert set(picks) <= allowed
    assert tb.class_picks[k] == 10 and sum(tb.class_picks) == 10
    assert tb.fallbacks == 0
    assert tb.confined_picks == (10 if k < 2 else 0)


def test_a_saturated_tier_set_falls_back_to_the_next_wider_set_then_the_fleet() -> None:
    tb = tiered()
    fastest_full = [
        3,
        0,
        0,
        0,
        0,
        0,
    ]  # host 0 at its bound: the longest class spills to the two fastest tiers
    picks = Counter(tb.pick_for(fastest_full, 900) for _ in range(60))
    assert set(picks) <= {0, 1, 2} and picks[1] + picks[2] > picks[0]
    assert tb.fallbacks == 60
    both_full = [3, 3, 3, 0, 0, 0]  # hosts 0-2 at their bound: both confined classes spill to the fleet
    picks = Counter(tb.pick_for(both_full, n) for n in (900, 500) * 60)
    assert picks[3] + picks[4] + picks[5] > 0.5 * 120  # weighted least request prefers the idle hosts
    assert tb.fallbacks == 180
    assert tb.class_picks == [120, 60, 0]


def test_without_spill_a_saturated_set_keeps_its_requests_as_envoy_subsets_do() -> None:
    tb = tiered()
    tb.spill = False
    full = [9, 9, 9, 0, 0, 0]
    assert {tb.pick_for(full, 900) for _ in range(30)} == {0}
    assert {tb.pick_for(full, 500) for _ in range(60)} <= {0, 1, 2}
    assert tb.fallbacks == 0


def test_tiered_balancer_refuses_sets_that_are_not_nested_and_thresholds_that_increase() -> None:
    rng = random.Random(0)
    with pytest.raises(ValueError, match="nested"):
        TieredBalancer(
            4, class_hosts=((0,), (1, 2)), thresholds=(800, 400), saturation_active=[1] * 4, rng=rng
        )
    with pytest.raises(ValueError, match="must not increase"):
        TieredBalancer(
            4, class_hosts=((0,), (0, 1)), thresholds=(400, 800), saturation_active=[1] * 4, rng=rng
        )
    with pytest.raises(ValueError, match="one threshold per"):
        TieredBalancer(4, class_hosts=((0,), (0, 1)), thresholds=(400,), saturation_active=[1] * 4, rng=rng)


def test_a_tiered_run_keeps_each_class_on_its_tiers_and_conserves_requests() -> None:
    r = run("tiered", duration=60.0)
    fleet = fleet_mix(config(), 8)
    models = [TimingModel.for_endpoint(config(), g.endpoint) for g in fleet]
    rows = scale_trace(trace(), rate_rps=0.9 * fleet_capacity_rps(models, trace()), duration_s=60.0)
    # in-sample thresholds, by the work rule over the fleet's three tiers (two confined classes)
    assert r.tier_thresholds == tiered_thresholds(fleet, models[0], rows)
    t1, t2 = r.tier_thresholds
    assert t1 >= t2
    assert r.finished + r.refused + r.unfinished == r.arrivals
    assert r.long_requests == sum(r.class_requests[:2]) > 0
    longest = [i for i, row in enumerate(rows) if row.output_tokens > t1]
    middle = [i for i, row in enumerate(rows) if t2 < row.output_tokens <= t1]
    assert (len(longest), len(middle)) == r.class_requests[:2]
    on = Counter(fleet[r.arrival_gpus[i]].gpu_type for i in longest)
    # every confined request not counted as a fallback stayed on its tiers
    assert on["H100"] >= len(longest) - r.long_fallbacks
    assert sum(fleet[r.arrival_gpus[i]].gpu_type != "V100" for i in middle) >= len(middle) - r.long_fallbacks


# -- fleet, trace, capacity ---------------------------------------------------------------------------------


def test_fleet_mix_follows_the_config_proportions_and_capacity_weights() -> None:
    fleet = fleet_mix(config(), 1000)
    assert Counter(g.gpu_type for g in fleet) == {"H100": 250, "A100": 375, "V100": 375}
    assert {g.gpu_type: g.static_weight for g in fleet} == {"H100": 34, "A100": 17, "V100": 10}
    assert [g.index for g in fleet] == list(range(1000))
    small = fleet_mix(config(), 7)
    assert len(small) == 7 and len({g.gpu_type for g in small}) == 3


def test_scale_trace_hits_the_target_rate_and_keeps_token_counts() -> None:
    rows = trace()
    out = scale_trace(rows, rate_rps=500.0, duration_s=100.0)
    assert 0.97 * 50_000 <= len(out) <= 1.03 * 50_000
    assert all(out[i].offset_s <= out[i + 1].offset_s for i in range(len(out) - 1))
    assert out[-1].offset_s < 100.0
    # rate x duration = the trace's length: one copy, every request once, tokens unchanged
    one = scale_trace(rows, rate_rps=len(rows) / 128.0, duration_s=128.0)
    assert Counter((r.prompt_tokens, r.output_tokens) for r in one) == Counter(
        (r.prompt_tokens, r.output_tokens) for r in rows
    )


def test_fleet_capacity_is_the_sum_over_gpus_of_one_over_the_mean_request_cost() -> None:
    cfg = config()
    fleet = fleet_mix(cfg, 8)
    models = [TimingModel.for_endpoint(cfg, g.endpoint) for g in fleet]
    rows = trace()[:500]

    def mean_cost(m: TimingModel) -> float:
        return sum(request_service_seconds(m, r.prompt_tokens, r.output_tokens) for r in rows) / len(rows)

    assert fleet_capacity_rps(models, rows) == pytest.approx(sum(1 / mean_cost(m) for m in models), rel=1e-9)
    # when prefill and decode scale alike (no prefill_relative_capacity), a GPU's capacity is its
    # relative capacity over a V100's mean cost; the bundled profiles prefill faster than that on H100/A100
    doc = cfg.model_dump(mode="json", exclude_defaults=True)
    for profile in doc["gpu_profiles"].values():
        profile.pop("prefill_relative_capacity", None)
    alike = parse_config(doc)
    same = [TimingModel.for_endpoint(alike, g.endpoint) for g in fleet]
    v100 = next(m for m in same if m.relative_capacity == 1.0)
    total_capacity = sum(g.relative_capacity for g in fleet)
    assert fleet_capacity_rps(same, rows) == pytest.approx(total_capacity / mean_cost(v100), rel=1e-9)
    assert fleet_capacity_rps(models, rows) > fleet_capacity_rps(same, rows)


def test_a_saturated_engine_delivers_the_capacity_the_model_predicts() -> None:
    # The load figures rest on this: a V100 engine with a queue that never empties finishes requests at
    # 1 / mean(request_service_seconds), within 2% (prefill and decode interleave slightly differently).
    cfg = config()
    model = TimingModel.for_endpoint(cfg, next(g for g in fleet_mix(cfg, 8) if g.gpu_type == "V100").endpoint)
    model = TimingModel(
        relative_capacity=1.0, prefill_tokens_per_s=model.prefill_tokens_per_s,
        decode_tokens_per_s=model.decode_tokens_per_s, max_batch=model.max_batch, max_queue=10_000,
        kv_budget_tokens=model.kv_budget_tokens,
    )  # fmt: skip
    rows = trace()[:800]
    eng = BatchEngine(model=model)
    for i, r in enumerate(rows):
        eng.submit(0.0, request_id=str(i), prompt_tokens=r.prompt_tokens, completion_tokens=r.output_tokens)
    last = 0.0
    while (t := eng.next_transition_time()) is not None:
        eng.advance(t)
        last = t
    predicted = fleet_capacity_rps([model], rows)
    assert len(rows) / last == pytest.approx(predicted, rel=0.02)


# -- whole runs on tiny fleets ------------------------------------------------------------------------------


def test_simulation_is_deterministic_for_a_seed() -> None:
    a = run("least_request", duration=30.0, seed=7)
    b = run("least_request", duration=30.0, seed=7)
    c = run("least_request", duration=30.0, seed=8)
    assert a.arrival_gpus == b.arrival_gpus
    assert (a.e2e_p99_s, a.ttft_p99_s, a.work_percent) == (b.e2e_p99_s, b.ttft_p99_s, b.work_percent)
    assert a.arrival_gpus != c.arrival_gpus


@pytest.mark.parametrize(
    "policy",
    ["round_robin", "least_request", "static_weights", "telemetry_weights", "length_aware", "tiered"],
)
def test_every_arrival_finishes_or_is_refused(policy: str) -> None:
    r = run(policy, duration=40.0, load=1.3, max_queue=2)
    assert r.arrivals > 0
    assert r.finished + r.refused + r.unfinished == r.arrivals
    assert r.unfinished == 0  # the drain bound (600 s) is far beyond any queue of 2
    assert r.refused > 0  # 130% of capacity with queues of 2 must refuse some
    assert sum(r.refused_by_type.values()) == r.refused


def test_telemetry_weights_beat_round_robin_on_a_heterogeneous_fleet_at_high_load() -> None:
    # Round robin gives each of the 8 GPUs 1/8 of 90% of a fleet capacity of 14.9 V100s, i.e. 1.68 V100s
    # of work: a V100 is offered 168% of its capacity, so its queue grows for the whole run, and the
    # latency of a third of the requests grows with it. Weighted least request keeps every GPU under 100%.
    rr = run("round_robin")
    tw = run("telemetry_weights")
    assert tw.e2e_p99_s < 0.8 * rr.e2e_p99_s
    assert tw.ttft_p99_s < 0.5 * rr.ttft_p99_s
    assert rr.work_by_type["V100"] > 95.0  # saturated
    assert rr.work_by_type["H100"] < 70.0  # 1.68 / 3.4 of its capacity, plus noise
    assert tw.work_spread_pts < rr.work_spread_pts


def test_a_throttled_gpu_loses_weight_and_traffic_under_telemetry_weights() -> None:
    r = run("telemetry_weights", duration=60.0, throttle=True)
    assert r.shift is not None
    # The EWMA (tau 1 s) brings the weight from W to 0.6 W of a half-speed GPU in 4 telemetry steps (2 s),
    # then one push delay and at most one more step of hysteresis.
    assert r.weight_shift_s is not None and r.weight_shift_s <= 3.5
    assert r.shift.post_share < 0.75 * r.shift.pre_share
    rr = run("round_robin", duration=60.0, throttle=True)
    assert rr.weight_shift_s is None
    assert rr.shift is not None and rr.shift.seconds is None  # round robin never moves traffic


# -- the share measurements ---------------------------------------------------------------------------------


def test_traffic_shift_finds_when_the_share_halves() -> None:
    times = [i * 0.01 for i in range(2000)]  # 100 req/s for 20 s
    # GPU 0 gets every 10th request until 10 s, then every 20th
    gpus = [0 if (i % 10 == 0 if t < 10.0 else i % 20 == 0) else 1 for i, t in enumerate(times)]
    s = traffic_shift(times, gpus, frozenset({0}), fault_at=10.0, end=20.0)
    assert s.pre_share == pytest.approx(0.1, abs=0.005)
    assert s.seconds is not None and s.seconds <= s.window_s
    assert s.post_share == pytest.approx(0.05, abs=0.005)
    same = traffic_shift(
        times, [0 if i % 10 == 0 else 1 for i in range(2000)], frozenset({0}), fault_at=10.0, end=20.0
    )
    assert same.seconds is None


def test_share_series_bins() -> None:
    times = [0.1, 0.2, 0.6, 0.7, 0.8, 1.5]
    gpus = [1, 0, 1, 1, 0, 1]
    assert share_series(times, gpus, frozenset({1}), start=0.0, end=2.0, bin_s=0.5) == [
        (0.25, 0.5),
        (0.75, 2 / 3),
        (1.75, 1.0),
    ]
