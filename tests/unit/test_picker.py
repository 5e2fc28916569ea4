"""The endpoint picker's scoring core: eligibility, the load guard, prefix preference, determinism."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.policy.picker import EndpointState, NoEligibleEndpoint, PickerWeights, pick


def _fleet(n: int, **kw: object) -> list[EndpointState]:
    return [EndpointState(address=f"127.0.0.1:{8000 + i}", **kw) for i in range(n)]  # type: ignore[arg-type]


def test_prefers_the_endpoint_holding_the_prefix_when_loads_are_equal() -> None:
    fleet = _fleet(4)
    picked = pick(fleet, prompt_blocks=10, matched_blocks={"127.0.0.1:8002": 9})
    assert picked[0] == "127.0.0.1:8002"


def test_never_picks_unhealthy_or_outside_the_subset() -> None:
    fleet = [*_fleet(2), EndpointState(address="127.0.0.1:9000", healthy=False)]
    picked = pick(
        fleet,
        prompt_blocks=4,
        matched_blocks={"127.0.0.1:9000": 4},
        subset={"127.0.0.1:8001", "127.0.0.1:9000"},
    )
    assert picked == ("127.0.0.1:8001",)
    with pytest.raises(NoEligibleEndpoint):
        pick(fleet, subset={"127.0.0.1:9000"})
    with pytest.raises(NoEligibleEndpoint):
        pick([])


def test_a_hot_prefix_spills_past_the_load_bound() -> None:
    fleet = [EndpointState(address="127.0.0.1:8000", in_flight=10), *_fleet(3)[1:]]
    picked = pick(fleet, prompt_blocks=10, matched_blocks={"127.0.0.1:8000": 10})
    assert picked[0] != "127.0.0.1:8000"


def test_weights_are_checked() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        PickerWeights(load_factor=1.0)
    with pytest.raises(ValueError, match="max_hosts"):
        PickerWeights(max_hosts=0)


_state = st.builds(
    EndpointState,
    address=st.sampled_from([f"127.0.0.1:{p}" for p in range(8000, 8012)]),
    weight=st.sampled_from([0.5, 1.0, 1.7, 3.4]),
    healthy=st.booleans(),
    in_flight=st.integers(0, 50),
    waiting=st.integers(0, 20).map(float),
    kv_usage=st.floats(0, 1),
)


@settings(max_examples=300, deadline=None)
@given(
    fleet=st.lists(_state, min_size=1, max_size=12, unique_by=lambda e: e.address),
    matched=st.dictionaries(
        st.sampled_from([f"127.0.0.1:{p}" for p in range(8000, 8012)]), st.integers(0, 40)
    ),
    salt=st.binary(max_size=8),
)
def test_picks_are_eligible_bounded_and_deterministic(
    fleet: list[EndpointState], matched: dict[str, int], salt: bytes
) -> None:
    weights = PickerWeights()
    try:
        picked = pick(fleet, prompt_blocks=40, matched_blocks=matched, salt=salt, weights=weights)
    except NoEligibleEndpoint:
        assert not any(e.healthy for e in fleet)
        return
    healthy = {e.address: e for e in fleet if e.healthy}
    assert picked and set(picked) <= set(healthy)
    assert len(set(picked)) == len(picked) <= weights.max_hosts
    assert picked == pick(list(reversed(fleet)), prompt_blocks=40, matched_blocks=matched, salt=salt)
    # The first choice never takes an endpoint past the bound while another endpoint is within it.
    work = sum(e.in_flight + e.waiting for e in healthy.values()) + 1
    total = sum(e.weight for e in healthy.values())

    def within(e: EndpointState) -> bool:
        return e.in_flight + e.waiting + 1 <= math.ceil(weights.load_factor * work / total * e.weight)

    if any(within(e) for e in healthy.values()):
        assert within(healthy[picked[0]])
