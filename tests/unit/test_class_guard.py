"""The live capacity guard of length classes (:mod:`inferlb.policy.class_guard`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.policy.class_guard import SetLoad, guarded_class, nested_class_loads, set_loads, within_bound
from inferlb.policy.columnar import FleetColumns
from inferlb.policy.picker import EndpointState

FLEET_CAPACITY = 10.0


def test_an_idle_fleet_places_a_request_in_its_class_whatever_the_share() -> None:
    tiny = SetLoad(load=0, capacity=0.1)
    assert within_bound(tiny, SetLoad(load=0, capacity=FLEET_CAPACITY), 1.5)
    assert guarded_class([tiny], SetLoad(load=0, capacity=FLEET_CAPACITY), 0, 1.5) == 0


def test_a_set_loaded_past_the_factor_spills_to_the_next_wider_set() -> None:
    fast = SetLoad(load=6, capacity=3.4)  # 6 of 8 requests on a third of the capacity
    wider = SetLoad(load=7, capacity=5.1)
    fleet = SetLoad(load=8, capacity=FLEET_CAPACITY)
    # fast may hold ceil(1.5 x 9 x 0.34) = 5: full; wider ceil(1.5 x 9 x 0.51) = 7: full too
    assert guarded_class([fast, wider], fleet, 0, 1.5) == 2
    assert guarded_class([fast, SetLoad(load=5, capacity=5.1)], fleet, 0, 1.5) == 1
    assert guarded_class([fast, wider], fleet, 0, 3.0) == 0


def test_an_empty_set_never_takes_the_request() -> None:
    assert guarded_class([SetLoad(load=0, capacity=0)], SetLoad(load=0, capacity=1), 0, 2) == 1
    assert guarded_class([], SetLoad(load=0, capacity=1), 0, 2) == 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="factor"):
        guarded_class([], SetLoad(load=0, capacity=1), 0, 1.0)
    with pytest.raises(ValueError, match="start"):
        guarded_class([], SetLoad(load=0, capacity=1), 1, 2)
    with pytest.raises(ValueError, match="one entry per"):
        nested_class_loads([1], 0, [], 1.0)


def test_set_loads_count_the_usable_endpoints_in_flight_and_waiting() -> None:
    states = [
        EndpointState(address="h100", weight=34, in_flight=3, waiting=2),
        EndpointState(address="a100", weight=17, in_flight=1),
        EndpointState(address="v100", weight=10, in_flight=4),
        EndpointState(address="gone", weight=34, healthy=False, in_flight=9),
    ]
    sets, fleet = set_loads(states, [{"h100", "gone"}, {"h100", "a100"}])
    assert sets == [SetLoad(load=5, capacity=34), SetLoad(load=6, capacity=51)]
    assert fleet == SetLoad(load=10, capacity=61)


def test_nested_class_loads_add_the_longer_classes() -> None:
    sets, fleet = nested_class_loads([2, 3], 4, [3.4, 5.1], 6.1)
    assert sets == [SetLoad(load=2, capacity=3.4), SetLoad(load=5, capacity=5.1)]
    assert fleet == SetLoad(load=9, capacity=6.1)


_sets = st.lists(
    st.builds(SetLoad, load=st.integers(0, 50).map(float), capacity=st.floats(0, 10)), min_size=1, max_size=5
)


@settings(max_examples=80, deadline=None)
@given(_sets, st.integers(0, 200), st.floats(1.01, 5), st.data())
def test_the_chosen_set_is_within_bound_or_the_request_is_short(
    sets: list[SetLoad], extra: int, factor: float, data: st.DataObject
) -> None:
    fleet = SetLoad(load=sum(s.load for s in sets) + extra, capacity=sum(s.capacity for s in sets) + 1)
    start = data.draw(st.integers(0, len(sets)))
    k = guarded_class(sets, fleet, start, factor)
    assert start <= k <= len(sets)
    assert k == len(sets) or within_bound(sets[k], fleet, factor)
    assert all(not within_bound(s, fleet, factor) for s in sets[start:k])
    # more load on the chosen set never moves the request to a narrower one
    if k < len(sets):
        heavier = [*sets]
        heavier[k] = SetLoad(load=sets[k].load + 1, capacity=sets[k].capacity)
        assert guarded_class(heavier, fleet, start, factor) >= k


_endpoints = st.lists(
    st.builds(
        EndpointState,
        address=st.sampled_from([f"10.0.0.{i}:80" for i in range(12)]),
        weight=st.sampled_from([0.0, 1.0, 10.0, 34.0]),
        healthy=st.booleans(),
        in_flight=st.integers(0, 40),
        waiting=st.floats(0, 20),
    ),
    min_size=1,
    max_size=12,
    unique_by=lambda e: e.address,
)


@settings(max_examples=60, deadline=None)
@given(_endpoints, st.sets(st.sampled_from([f"10.0.0.{i}:80" for i in range(14)])))
def test_the_columns_sum_a_set_as_the_endpoint_states_do(
    endpoints: list[EndpointState], hosts: set[str]
) -> None:
    columns = FleetColumns(endpoints)
    (by_states,), fleet = set_loads(endpoints, [hosts])
    for got, want in ((columns.set_load(hosts), by_states), (columns.set_load(None), fleet)):
        assert (got.load, got.capacity) == pytest.approx((want.load, want.capacity))
