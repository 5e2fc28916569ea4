"""The endpoint picker's scoring core: eligibility, the load guard, prefix preference, determinism."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferlb.policy.picker import EndpointState, NoEligibleEndpoint, PickerWeights, pick
from inferlb.policy.prefix_index import ApproximatePrefixIndex


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


def test_default_guard_keeps_a_prefix_on_its_holder_at_twice_its_share() -> None:
    # 4 equal endpoints, 4 requests in flight, the holder carrying 2 of them: taking this one it holds 3,
    # 2.4x its share of the 5 (over a 1.25 bound: ceil(1.5625) = 2), within the default 2.0 (ceil(2.5) = 3)
    holder = "127.0.0.1:8000"
    fleet = [
        EndpointState(address=holder, in_flight=2),
        EndpointState(address="127.0.0.1:8001", in_flight=1),
        EndpointState(address="127.0.0.1:8002", in_flight=1),
        EndpointState(address="127.0.0.1:8003"),
    ]
    asked = {"prompt_blocks": 10, "matched_blocks": {holder: 10}, "prompt_tokens": 160}
    assert pick(fleet, **asked)[0] == holder  # type: ignore[arg-type]
    assert pick(fleet, weights=PickerWeights(load_factor=1.25), **asked)[0] != holder  # type: ignore[arg-type]


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


def test_length_class_hosts_confine_the_pick() -> None:
    fleet = _fleet(4)
    fast = {"127.0.0.1:8002", "127.0.0.1:8003"}
    picked = pick(fleet, prompt_blocks=4, matched_blocks={"127.0.0.1:8000": 4}, class_hosts=fast)
    assert set(picked) <= fast
    assert pick(fleet, class_hosts=fast, subset={"127.0.0.1:8003", "127.0.0.1:8000"}) == ("127.0.0.1:8003",)
    with pytest.raises(NoEligibleEndpoint, match="length class"):
        pick(fleet, class_hosts={"127.0.0.1:9999"})
    with pytest.raises(NoEligibleEndpoint, match="subset and length class"):
        pick(fleet, subset={"127.0.0.1:8000"}, class_hosts=fast)


def test_queued_prefill_tokens_weigh_against_an_endpoint() -> None:
    a, b = "127.0.0.1:8000", "127.0.0.1:8001"
    fleet = [EndpointState(address=a, prefill_tokens=40_000.0), EndpointState(address=b)]
    assert pick(fleet, prompt_tokens=4096)[0] == b
    # a full prefix hit outweighs a short queue: the hit saves the whole prompt's prefill
    fleet = [EndpointState(address=a, prefill_tokens=2_000.0), EndpointState(address=b)]
    assert pick(fleet, prompt_blocks=16, matched_blocks={a: 16}, prompt_tokens=8192, block_tokens=512)[0] == a
    # ... a queue many prompts long does not
    fleet = [EndpointState(address=a, prefill_tokens=200_000.0), EndpointState(address=b)]
    assert pick(fleet, prompt_blocks=16, matched_blocks={a: 16}, prompt_tokens=8192, block_tokens=512)[0] == b
    with pytest.raises(ValueError, match="block_tokens"):
        pick(fleet, block_tokens=0)


def test_decode_tokens_weigh_when_weighted() -> None:
    a, b = "127.0.0.1:8000", "127.0.0.1:8001"
    fleet = [
        EndpointState(address=a, decode_tokens=5_000.0, in_flight=1),
        EndpointState(address=b, in_flight=1),
    ]
    w = PickerWeights(decode=1.0)
    assert pick(fleet, weights=w, salt=b"x")[0] == b
    assert pick(list(reversed(fleet)), weights=w, salt=b"y")[0] == b


_weights = st.sampled_from([1.0, 1.7, 3.4])


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(_weights, min_size=1, max_size=10),
    ops=st.lists(st.integers(-1, 30), min_size=1, max_size=120),
    load_factor=st.sampled_from([1.05, 1.25, 1.5, 2.0]),
    candidates=st.sampled_from([0, 1, 2]),
)
@example(weights=[1.0, 1.0], ops=[-1] * 10, load_factor=1.25, candidates=0)
def test_a_hot_prefix_never_drives_a_host_past_the_bound(
    weights: list[float], ops: list[int], load_factor: float, candidates: int
) -> None:
    """Every request carries the same hot prefix, learnt by an approximate index from the picks (so the
    hosts that cached it pull hardest); completions come in between. No pick ever takes its host above
    ``load_factor`` x its weighted share of the fleet's requests + 1."""
    addresses = [f"127.0.0.1:{8000 + i}" for i in range(len(weights))]
    in_flight = dict.fromkeys(addresses, 0)
    index = ApproximatePrefixIndex(capacity_blocks=64)
    hot = list(range(32))
    pw = PickerWeights(load_factor=load_factor, candidates=candidates)
    total_weight = sum(weights)
    for step, op in enumerate(ops):
        if op >= 0:  # a completion on the op-th busy host, if any
            busy = [a for a in addresses if in_flight[a]]
            if busy:
                in_flight[busy[op % len(busy)]] -= 1
            continue
        fleet = [
            EndpointState(address=a, weight=w, in_flight=in_flight[a])
            for a, w in zip(addresses, weights, strict=True)
        ]
        matched = index.matched_blocks(hot, set(addresses))
        chosen = pick(fleet, prompt_blocks=32, matched_blocks=matched, weights=pw, prompt_tokens=16384,
                      block_tokens=512, candidate_seed=step)[0]  # fmt: skip
        index.record_pick(chosen, hot)
        in_flight[chosen] += 1
        total = sum(in_flight.values())
        w = weights[addresses.index(chosen)]
        assert in_flight[chosen] <= load_factor * total * w / total_weight + 1


@settings(max_examples=200, deadline=None)
@given(
    fleet=st.lists(_state, min_size=1, max_size=12, unique_by=lambda e: e.address), salt=st.binary(max_size=8)
)
def test_a_new_prefix_goes_to_the_least_loaded(fleet: list[EndpointState], salt: bytes) -> None:
    """No endpoint holds the prompt and only request load is weighed: the first choice is a least-loaded
    endpoint within the bound (per unit of capacity)."""
    weights = PickerWeights(kv=0.0, tokens=0.0)
    try:
        first = pick(fleet, prompt_blocks=8, matched_blocks={}, weights=weights, salt=salt)[0]
    except NoEligibleEndpoint:
        return
    healthy = [e for e in fleet if e.healthy]
    work = sum(e.in_flight + e.waiting for e in healthy) + 1
    total = sum(e.weight for e in healthy)
    within = [
        e
        for e in healthy
        if e.in_flight + e.waiting + 1 <= math.ceil(weights.load_factor * work / total * e.weight)
    ]
    chosen = next(e for e in healthy if e.address == first)
    assert (chosen.in_flight + chosen.waiting) / chosen.weight == min(
        (e.in_flight + e.waiting) / e.weight for e in within
    )


def test_sampled_candidates_keep_the_holders_and_are_deterministic() -> None:
    fleet = [EndpointState(address=f"10.0.{i // 256}.{i % 256}:8000", in_flight=i % 3) for i in range(300)]
    holder = fleet[123].address
    w = PickerWeights(candidates=4)
    picked = pick(fleet, prompt_blocks=10, matched_blocks={holder: 10}, weights=w, candidate_seed=5)
    assert picked[0] == holder
    assert len(picked) == 3
    assert pick(fleet, prompt_blocks=10, weights=w, candidate_seed=9) == pick(
        list(fleet), prompt_blocks=10, weights=w, candidate_seed=9
    )
    with pytest.raises(ValueError, match="candidates"):
        PickerWeights(candidates=-1)


# -- the prefill load per unit of prefill capacity --------------------------------------------------------

# the embedded config's GPUs (inferlb/data/local.yaml) as EDS weights: (weight, prefill weight)
H100, A100, V100 = (34.0, 34.0 * 7.23 / 3.4), (17.0, 17.0 * 1.87 / 1.7), (10.0, 10.0)


def test_a_cold_prompt_goes_to_the_endpoint_that_prefills_it_soonest() -> None:
    """Two idle endpoints, no prefix held: decode capacity alone ranks ``a`` first (1 / 2 of a cold prompt
    per unit against 1 / 1.5), the prefill capacity ``b`` (its prompt done in 1 / 6 of a unit's time)."""
    a, b = "127.0.0.1:8000", "127.0.0.1:8001"
    by_decode = [EndpointState(address=a, weight=2.0), EndpointState(address=b, weight=1.5)]
    assert pick(by_decode, prompt_blocks=450, prompt_tokens=7200)[0] == a
    by_prefill = [
        EndpointState(address=a, weight=2.0),
        EndpointState(address=b, weight=1.5, prefill_weight=6.0),
    ]
    assert pick(by_prefill, prompt_blocks=450, prompt_tokens=7200)[0] == b
    # only the miss is prefilled: a holder of the whole prompt stays first, however slow its prefill
    held = {a: 450}
    assert pick(by_prefill, prompt_blocks=450, matched_blocks=held, prompt_tokens=7200)[0] == a
    # request load is still per unit of decode capacity: b's prefill weight does not make room for requests
    busy = [
        EndpointState(address=a, weight=2.0),
        EndpointState(address=b, weight=1.5, prefill_weight=6.0, in_flight=1),
    ]
    assert pick(busy, prompt_blocks=450, prompt_tokens=7200)[0] == a


def _documented_score(
    e: EndpointState, eligible: list[EndpointState], w: PickerWeights, m: int, blocks: int, prompt: int
) -> float:
    """The module doc's score of an endpoint within the bound, term by term in real units."""
    total = sum(x.weight for x in eligible)
    lbar = (sum(x.in_flight + x.waiting for x in eligible) + 1) / total
    dbar = (sum(x.decode_tokens for x in eligible) + 1) / total
    q = (e.prefill_tokens + max(prompt - 16 * m, 0)) / (e.prefill_weight or e.weight)
    return (
        w.prefix * m / blocks
        - w.load * (e.in_flight + e.waiting) / e.weight / lbar
        - w.tokens * q / prompt
        - w.decode * e.decode_tokens / e.weight / dbar
        - w.kv * e.kv_usage
    )


_prefill_state = st.builds(
    EndpointState,
    address=st.sampled_from([f"127.0.0.1:{p}" for p in range(8000, 8012)]),
    weight=st.sampled_from([H100[0], A100[0], V100[0], 1.0, 3.4]),
    prefill_weight=st.sampled_from([None, H100[1], A100[1], 10.0, 2.13, 7.23]),
    in_flight=st.integers(0, 6),
    waiting=st.integers(0, 3).map(float),
    kv_usage=st.floats(0, 1),
    prefill_tokens=st.sampled_from([0.0, 0.0, 1200.0, 7200.0]),
    decode_tokens=st.sampled_from([0.0, 32.0, 500.0]),
)
_fleets = st.lists(_prefill_state, min_size=1, max_size=10, unique_by=lambda e: e.address)
_matches = st.dictionaries(
    st.sampled_from([f"127.0.0.1:{p}" for p in range(8000, 8012)]), st.integers(0, 450)
)


@settings(max_examples=300, deadline=None)
@given(
    fleet=_fleets,
    matched=_matches,
    prompt=st.sampled_from([1200, 7200, 16_000]),
    tokens=st.sampled_from([1.0, 5.0, 20.0]),
    decode=st.sampled_from([0.0, 1.0]),
)
def test_the_first_choice_has_the_documented_best_score(
    fleet: list[EndpointState], matched: dict[str, int], prompt: int, tokens: float, decode: float
) -> None:
    """With the load guard out of the way, the first choice maximises the module doc's score (``Q_e`` per
    unit of prefill capacity), up to rounding."""
    w = PickerWeights(tokens=tokens, decode=decode, load_factor=100.0)
    blocks = 450
    first = pick(fleet, prompt_blocks=blocks, matched_blocks=matched, prompt_tokens=prompt, weights=w)[0]
    scores = {
        e.address: _documented_score(e, fleet, w, min(matched.get(e.address, 0), blocks), blocks, prompt)
        for e in fleet
    }
    assert scores[first] >= max(scores.values()) - 1e-9


@settings(max_examples=300, deadline=None)
@given(fleet=_fleets, matched=_matches, prompt=st.sampled_from([0, 1200, 7200]), salt=st.binary(max_size=4))
def test_without_prefill_capacities_the_picks_are_the_decode_weighted_ones(
    fleet: list[EndpointState], matched: dict[str, int], prompt: int, salt: bytes
) -> None:
    """A prefill weight equal to the weight (what the xDS server and the EPP send for a GPU profile with no
    ``prefill_relative_capacity``) picks exactly as none: every term bit for bit as before."""
    kw: dict[str, object] = {
        "prompt_blocks": 450,
        "matched_blocks": matched,
        "prompt_tokens": prompt,
        "salt": salt,
    }
    none = [msgspec.structs.replace(e, prefill_weight=None) for e in fleet]
    same = [msgspec.structs.replace(e, prefill_weight=e.weight * 1.0) for e in fleet]
    assert pick(same, **kw) == pick(none, **kw)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    fleet=_fleets,
    matched=_matches,
    prompt=st.sampled_from([0, 1200, 7200]),
    faster=st.sampled_from([1.5, 2.13, 10.0]),
    salt=st.binary(max_size=4),
)
def test_a_faster_prefill_never_loses_an_endpoint_its_first_place(
    fleet: list[EndpointState], matched: dict[str, int], prompt: int, faster: float, salt: bytes
) -> None:
    """Raising the first choice's prefill capacity lowers only its own prefill load (the means do not
    depend on it): it stays first."""
    kw: dict[str, object] = {
        "prompt_blocks": 450,
        "matched_blocks": matched,
        "prompt_tokens": prompt,
        "salt": salt,
    }
    first = pick(fleet, **kw)[0]  # type: ignore[arg-type]
    boosted = [
        msgspec.structs.replace(e, prefill_weight=(e.prefill_weight or e.weight) * faster)
        if e.address == first
        else e
        for e in fleet
    ]
    assert pick(boosted, **kw)[0] == first  # type: ignore[arg-type]
