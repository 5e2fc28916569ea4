"""Live length-class sets (:func:`inferlb.policy.length_aware.live_class_sets`, :func:`hold_performance`): the
sets follow the GPUs' performance; healthy, they are the static sets exactly. Also their xDS form (EDS
endpoint metadata through :class:`xds_server.resources.endpoints.EndpointOverride`) and ``inferlb status``'s
classes column."""

from __future__ import annotations

import itertools
import math

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from inferlb.config.schema import Config, LengthAwareRouting, LengthTier, parse_config
from inferlb.ops.status import weight_rows, weights_table
from inferlb.policy.length_aware import (
    ClassSetMember,
    PerformanceHold,
    allowed_classes,
    confined_classes,
    hold_performance,
    lb_metadata_of_classes,
    live_class_sets,
    live_endpoint_classes,
    nominal_class_capacity,
    performance_rank,
)
from xds_server import resources as r
from xds_server.fleet_state import FleetState, effective_overrides

#: the bundled profiles' capacities and a few others, so ties between GPU classes occur
CAPACITIES = (0.5, 1.0, 1.7, 2.0, 3.4)


@st.composite
def fleets(draw: st.DrawFn, *, healthy: bool = False) -> list[ClassSetMember]:
    n = draw(st.integers(min_value=1, max_value=24))
    caps = draw(st.lists(st.sampled_from(CAPACITIES), min_size=n, max_size=n))
    perfs = (
        [1.0] * n
        if healthy
        else draw(st.lists(st.floats(min_value=0.05, max_value=1.0), min_size=n, max_size=n))
    )
    names = draw(st.permutations([f"10.0.0.{i}:8000" for i in range(n)]))
    return [
        ClassSetMember(name=nm, capacity=c, performance=p)
        for nm, c, p in zip(names, caps, perfs, strict=True)
    ]


MIN_CAPS = st.lists(st.sampled_from((0.3, *CAPACITIES, 5.0)), min_size=1, max_size=4).map(
    lambda xs: sorted(xs, reverse=True)
)


def _effective(members: list[ClassSetMember], names: tuple[str, ...]) -> float:
    by = {m.name: m for m in members}
    return math.fsum(by[n].effective_capacity for n in names)


@given(fleets(healthy=True), MIN_CAPS)
def test_healthy_sets_are_the_static_sets(members: list[ClassSetMember], mins: list[float]) -> None:
    sets = live_class_sets(members, mins)
    for min_cap, names in zip(mins, sets, strict=True):
        assert set(names) == {m.name for m in members if m.capacity >= min_cap}


@given(fleets(), MIN_CAPS)
def test_sets_are_nested_prefixes_reaching_the_nominal_capacity(
    members: list[ClassSetMember], mins: list[float]
) -> None:
    ranked = tuple(m.name for m in performance_rank(members))
    sets = live_class_sets(members, mins)
    total = math.fsum(m.effective_capacity for m in members)
    for min_cap, names in zip(mins, sets, strict=True):
        assert names == ranked[: len(names)]
        need = nominal_class_capacity(members, min_cap)
        if total >= need:
            assert _effective(members, names) >= need * (1 - 1e-9)
            # the shortest such prefix
            if names:
                assert _effective(members, names[:-1]) < need * (1 - 1e-9)
        else:
            assert names == ranked
    for a, b in itertools.pairwise(sets):
        assert set(a) <= set(b)


@given(fleets(), MIN_CAPS, st.data())
def test_slowing_a_gpu_never_shrinks_a_set(
    members: list[ClassSetMember], mins: list[float], data: st.DataObject
) -> None:
    i = data.draw(st.integers(min_value=0, max_value=len(members) - 1))
    slower = data.draw(st.floats(min_value=0.05, max_value=1.0)) * members[i].performance
    slowed = list(members)
    slowed[i] = ClassSetMember(
        name=members[i].name, capacity=members[i].capacity, performance=max(slower, 1e-6)
    )
    before, after = live_class_sets(members, mins), live_class_sets(slowed, mins)
    total = math.fsum(m.effective_capacity for m in slowed)
    for min_cap, b, a in zip(mins, before, after, strict=True):
        assert len(a) >= len(b)
        need = nominal_class_capacity(slowed, min_cap)
        if total >= need:
            assert _effective(slowed, a) >= need * (1 - 1e-9)


def test_throttled_h100_brings_the_next_fastest_gpu_into_the_longest_class() -> None:
    members = [
        ClassSetMember(name="h100-0", capacity=3.4, performance=0.5),
        ClassSetMember(name="h100-1", capacity=3.4),
        *(ClassSetMember(name=f"a100-{i}", capacity=1.7) for i in range(3)),
        *(ClassSetMember(name=f"v100-{i}", capacity=1.0) for i in range(3)),
    ]
    long0, long1 = live_class_sets(members, [3.4, 1.7])
    # 3.4 + 1.7 (the throttled H100) + 1.7 (an A100) = 6.8, the two H100s' nominal capacity
    assert long0 == ("h100-1", "h100-0", "a100-0")
    # 11.9 nominal: both H100s (5.1), three A100s (5.1), then two V100s
    assert long1 == ("h100-1", "h100-0", "a100-0", "a100-1", "a100-2", "v100-0", "v100-1")
    classes = confined_classes(
        LengthAwareRouting(
            tiers=(
                LengthTier(above_output_tokens=800, min_relative_capacity=3.4),
                LengthTier(above_output_tokens=300, min_relative_capacity=1.7),
            )
        )
    )
    by = live_endpoint_classes(members, classes)
    assert by["a100-0"] == ("long-0", "long-1") and by["a100-1"] == ("long-1",) and by["v100-2"] == ()


def test_class_set_without_a_fast_enough_gpu_is_empty() -> None:
    members = [ClassSetMember(name="v", capacity=1.0, performance=0.5)]
    assert live_class_sets(members, [3.4, 1.0]) == ((), ("v",))


def test_member_validation_and_unique_names() -> None:
    with pytest.raises(ValueError, match="performance"):
        ClassSetMember(name="a", capacity=1.0, performance=0.0)
    with pytest.raises(ValueError, match="capacity"):
        ClassSetMember(name="a", capacity=-1.0)
    with pytest.raises(ValueError, match="unique"):
        live_class_sets([ClassSetMember(name="a", capacity=1.0)] * 2, [1.0])


def test_lb_metadata_of_classes_both_forms() -> None:
    two = LengthAwareRouting(long_output_tokens=500, fast_min_relative_capacity=3.0)
    assert lb_metadata_of_classes(two, ("long",)) == {"gpu_tier": "fast"}
    assert lb_metadata_of_classes(two, ()) == {"gpu_tier": "standard"}
    tiered = LengthAwareRouting(tiers=(LengthTier(above_output_tokens=800, min_relative_capacity=3.4),))
    assert lb_metadata_of_classes(tiered, ("long-0",)) == {"length_classes": ["long-0"]}


# -- hold_performance ----------------------------------------------------------------------------------------


def _run(
    perf: float | None, steps: list[float], state: PerformanceHold | None = None, t0: float = 0.0
) -> list[PerformanceHold]:
    out = []
    t = t0
    for dt in steps:
        t += dt
        state = hold_performance(state, perf, t, tau_s=1.0, hysteresis=0.1)
        out.append(state)
    return out


@given(
    st.floats(min_value=0.05, max_value=1.5),
    st.floats(min_value=0.05, max_value=1.0),
    st.lists(st.floats(min_value=0.05, max_value=1.0), min_size=60, max_size=120),
)
def test_steady_input_settles_without_flapping(start: float, perf: float, dts: list[float]) -> None:
    (first,) = _run(start, [0.0])
    states = _run(perf, dts + [1.0] * 40, first, t0=0.0)
    held = [first.held, *(s.held for s in states)]
    changes = [b - a for a, b in itertools.pairwise(held) if b != a]
    # every change in one direction, then none: no oscillation
    assert all(c > 0 for c in changes) or all(c < 0 for c in changes)
    assert len({s.held for s in states[-20:]}) == 1
    final = states[-1].held
    # settled within the hysteresis of the input (clamped to 1), and exactly 1.0 in the healthy band
    target = min(1.0, perf)
    if target >= 0.95:
        assert final == 1.0
    elif target < 0.9 - 1e-9:
        assert abs(final - target) <= 0.1 * target / 0.9 + 1e-9
    assert 0 < final <= 1.0


def test_throttle_then_recovery_returns_to_exactly_healthy() -> None:
    healthy = _run(1.0, [0.5] * 4)
    assert {s.held for s in healthy} == {1.0}
    throttled = _run(0.5, [0.5] * 12, healthy[-1], t0=2.0)
    assert throttled[0].held < 1.0  # one 0.5 s step: smoothed 0.80 < 0.9, pushed
    assert throttled[-1].held == pytest.approx(0.5, rel=0.1)
    recovered = _run(1.0, [0.5] * 12, throttled[-1], t0=8.0)
    assert recovered[-1].held == 1.0


def test_noise_around_one_keeps_the_healthy_factor() -> None:
    state = None
    for i in range(200):
        state = hold_performance(state, 0.92 if i % 2 else 1.08, i * 0.5, tau_s=1.0, hysteresis=0.1)
        assert state.held == 1.0


def test_stale_telemetry_is_the_profile_at_once() -> None:
    (low,) = _run(0.3, [0.0])
    assert low.held == pytest.approx(0.3)
    stale = hold_performance(low, None, 1.0, tau_s=1.0, hysteresis=0.1)
    assert stale.held == 1.0 and stale.smoothed == 1.0


# -- the xDS resources: live classes as EDS endpoint metadata ---------------------------------------------


def _tiered_config() -> Config:
    return parse_config(
        {
            "models": [
                {
                    "name": "llama",
                    "cluster": {
                        "length_aware": {
                            "tiers": [
                                {"above_output_tokens": 800, "min_relative_capacity": 3.4},
                                {"above_output_tokens": 300, "min_relative_capacity": 1.7},
                            ]
                        }
                    },
                }
            ],
            "endpoints": [
                {"name": n, "address": f"127.0.0.1:{8001 + i}", "model": "llama", "gpu": g}
                for i, (n, g) in enumerate(
                    [("h0", "H100"), ("h1", "H100"), ("a0", "A100"), ("a1", "A100"), ("v0", "V100")]
                )
            ],
        }
    )


def _classes_by_name(cla: endpoint_pb2.ClusterLoadAssignment) -> dict[str, list[str]]:
    return {
        lb.endpoint.hostname: [str(v) for v in lb.metadata.filter_metadata["envoy.lb"]["length_classes"]]
        for loc in cla.endpoints
        for lb in loc.lb_endpoints
    }


def test_healthy_live_classes_of_a_config_are_its_profile_classes() -> None:
    config = _tiered_config()
    policy = config.models[0].cluster.length_aware
    assert policy is not None
    members = [
        ClassSetMember(name=r.endpoint_key(e), capacity=config.gpu_profiles[e.gpu].relative_capacity)
        for e in config.endpoints
    ]
    live = live_endpoint_classes(members, confined_classes(policy))
    for e in config.endpoints:
        assert live[r.endpoint_key(e)] == allowed_classes(config, e.gpu, policy)


def test_a_class_override_goes_out_as_endpoint_metadata_and_rebuilds_the_cached_assignment() -> None:
    config = _tiered_config()
    memo = r.LbEndpointCache()
    (plain,) = r.build_load_assignments(config, lb_cache=memo)
    assert _classes_by_name(plain) == {
        "h0": ["long-0", "long-1"], "h1": ["long-0", "long-1"], "a0": ["long-1"], "a1": ["long-1"], "v0": [],
    }  # fmt: skip
    overrides = {
        "127.0.0.1:8003": r.EndpointOverride(length_classes=("long-0", "long-1")),
        "127.0.0.1:8005": r.EndpointOverride(weight=40, length_classes=("long-1",)),
    }
    (live,) = r.build_load_assignments(config, overrides=overrides, lb_cache=memo)
    assert live is not plain
    got = _classes_by_name(live)
    assert got["a0"] == ["long-0", "long-1"] and got["v0"] == ["long-1"] and got["a1"] == ["long-1"]
    assert [lb.load_balancing_weight.value for lb in live.endpoints[0].lb_endpoints][-1] == 40
    # the same inputs again: the very same object (the snapshot cache does not re-serialize it)
    (again,) = r.build_load_assignments(config, overrides=dict(overrides), lb_cache=memo)
    assert again is live
    # back to the profile's classes: the profile's metadata again, byte for byte
    (back,) = r.build_load_assignments(config, lb_cache=memo)
    assert back.SerializeToString(deterministic=True) == plain.SerializeToString(deterministic=True)


def test_effective_overrides_carry_the_live_classes_next_to_pins_and_drains() -> None:
    state = FleetState(draining={"b:1": 0.0}, weight_overrides={"a:1": 7})
    out = effective_overrides(state, {"a:1": 50, "c:1": 60}, {"b:1": ("long-0",), "d:1": ()})
    assert out["a:1"] == r.EndpointOverride(weight=7)
    assert out["b:1"] == r.EndpointOverride(draining=True, length_classes=("long-0",))
    assert out["c:1"] == r.EndpointOverride(weight=60)
    assert out["d:1"] == r.EndpointOverride(length_classes=())


def test_status_marks_live_classes_that_differ_from_the_profile() -> None:
    body = {
        "endpoints": [
            {
                "key": f"127.0.0.1:{p}", "name": n, "gpu": "A100", "served_weight": 170,
                "weight_source": "telemetry", "profile_weight": 170, "cluster": "llama",
                "length_classes": live, "profile_classes": prof,
            }
            for p, n, live, prof in (
                (1, "a0", ["long-0", "long-1"], ["long-1"]), (2, "a1", ["long-1"], ["long-1"]),
                (3, "v0", [], []), (4, "q", None, None),
            )
        ]
    }  # fmt: skip
    rows = weight_rows(body, [])
    console = Console(width=400, record=True)
    console.print(weights_table(rows, "telemetry"))
    text = console.export_text()
    assert "long-0,long-1*" in text and "long-1 " in text
    assert rows[0].length_classes == ("long-0", "long-1") and rows[3].length_classes is None
