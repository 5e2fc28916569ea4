"""The columnar picker (:class:`inferlb.policy.columnar.FleetColumns`) against
:func:`inferlb.policy.picker.pick`: the same picks, errors included, over random fleets, arguments and
in-place row changes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.policy.columnar import COLUMNAR_MIN_ENDPOINTS, FleetColumns
from inferlb.policy.endpoint_book import BookedEndpoint, BookedState, EndpointBook
from inferlb.policy.picker import EndpointState, NoEligibleEndpoint, PickerWeights, pick

# few distinct values, so that equal scores (the salted tie order) and loads at the guard's bound are common
_WEIGHTS = st.sampled_from([1.0, 1.0, 1.7, 3.4, 0.5, 0.0, -1.0])
_LOADS = st.sampled_from([0.0, 0.0, 1.0, 2.0, 2.5, 7.0])
_KV = st.one_of(st.sampled_from([0.0, 0.5, 1.0, -0.25, 1.5]), st.floats(-0.5, 1.5))
_TOKENS = st.sampled_from([0.0, 0.0, 512.0, 2000.0, 6000.0])
# the prefill capacity: none (the weight), equal to a weight, or a profile's prefill over decode ratio away
_PREFILL_WEIGHTS = st.sampled_from([None, None, 1.0, 1.1, 2.13, 7.23, 0.5])


@st.composite
def _endpoint(draw: st.DrawFn, i: int) -> EndpointState:
    return EndpointState(
        address=f"127.0.0.{1 + i % 200}:{8000 + i}",
        weight=draw(_WEIGHTS),
        healthy=draw(st.sampled_from([True, True, True, False])),
        in_flight=draw(st.integers(0, 12)),
        waiting=draw(_LOADS),
        kv_usage=draw(_KV),
        prefill_tokens=draw(_TOKENS),
        decode_tokens=draw(_TOKENS),
        prefill_weight=draw(_PREFILL_WEIGHTS),
    )


@st.composite
def _fleet(draw: st.DrawFn, max_size: int = 48) -> list[EndpointState]:
    n = draw(st.integers(0, max_size))
    if draw(st.booleans()):  # identical endpoints: every score ties
        same = draw(_endpoint(0))
        return [EndpointState(**{**_fields(same), "address": f"127.0.0.1:{8000 + i}"}) for i in range(n)]
    return [draw(_endpoint(i)) for i in range(n)]


def _fields(e: EndpointState) -> dict[str, Any]:
    return {f: getattr(e, f) for f in e.__struct_fields__}


_PICKER_WEIGHTS = st.builds(
    PickerWeights,
    prefix=st.sampled_from([0.0, 2.0, 5.0]),
    load=st.sampled_from([0.0, 1.0, 0.3]),
    kv=st.sampled_from([0.0, 0.5]),
    tokens=st.sampled_from([0.0, 1.0, 0.7]),
    decode=st.sampled_from([0.0, 0.0, 1.0]),
    load_factor=st.sampled_from([1.01, 1.25, 1.5, 3.0]),
    max_hosts=st.integers(1, 5),
    candidates=st.sampled_from([0, 0, 1, 2, 4]),
)


@st.composite
def _request(draw: st.DrawFn, addresses: list[str]) -> dict[str, Any]:
    pool = [*addresses, "127.0.0.9:1"]  # one address no endpoint has
    prompt_blocks = draw(st.integers(0, 10))
    some = st.lists(st.sampled_from(pool), unique=True) if pool else st.just([])
    matched = {a: draw(st.integers(-1, 12)) for a in draw(some)}
    return {
        "prompt_blocks": prompt_blocks,
        "matched_blocks": draw(st.sampled_from([matched, None, {}])),
        "subset": draw(st.none() | some.map(set)),
        "class_hosts": draw(st.none() | some.map(frozenset)),
        "weights": draw(_PICKER_WEIGHTS),
        "salt": draw(st.sampled_from([b"", b"replica-1", bytes(70)])),
        "prompt_tokens": draw(st.sampled_from([0, -5, 100, 2048, 16384])),
        "block_tokens": draw(st.sampled_from([1, 16, 512])),
        "candidate_seed": draw(st.integers(0, 2**32)),
    }


def _outcome(f: Any, *args: Any, **kw: Any) -> tuple[str, ...] | str:
    try:
        return tuple(f(*args, **kw))
    except (NoEligibleEndpoint, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_columns_pick_exactly_what_pick_picks(data: st.DataObject) -> None:
    fleet = data.draw(_fleet())
    kw = data.draw(_request([e.address for e in fleet]))
    assert _outcome(FleetColumns(fleet).pick, **kw) == _outcome(pick, fleet, **kw)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_rows_changed_in_place_pick_as_a_rebuilt_fleet(data: st.DataObject) -> None:
    fleet = data.draw(_fleet())
    columns = FleetColumns(fleet)
    for _ in range(data.draw(st.integers(0, 12))):
        if not fleet:
            break
        i = data.draw(st.integers(0, len(fleet) - 1))
        e = fleet[i]
        change = data.draw(st.sampled_from(["enter", "leave", "set", "row"]))
        if change in ("enter", "leave"):
            delta = 1 if change == "enter" else -min(1, e.in_flight)
            columns.add_in_flight(e.address, delta)
            fleet[i] = EndpointState(**{**_fields(e), "in_flight": e.in_flight + delta})
        elif change == "set":
            n = data.draw(st.integers(0, 20))
            columns.set_in_flight(e.address, n)
            fleet[i] = EndpointState(**{**_fields(e), "in_flight": n})
        else:
            new = data.draw(_endpoint(i))
            fleet[i] = EndpointState(**{**_fields(new), "address": e.address})
            columns.set_row(fleet[i])
        kw = data.draw(_request([e.address for e in fleet]))
        assert _outcome(columns.pick, **kw) == _outcome(pick, fleet, **kw)


def test_the_columns_keep_pick_errors() -> None:
    fleet = [EndpointState(address="127.0.0.1:1", healthy=False), EndpointState(address="127.0.0.1:2")]
    columns = FleetColumns(fleet)
    with pytest.raises(NoEligibleEndpoint, match="in the request's subset and length class"):
        columns.pick(subset={"127.0.0.1:1"}, class_hosts={"127.0.0.1:1", "127.0.0.1:2"})
    with pytest.raises(ValueError, match="block_tokens"):
        columns.pick(block_tokens=0)
    with pytest.raises(ValueError, match="appears twice"):
        FleetColumns([*fleet, fleet[0]])


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_books_columns_pick_as_its_states(data: st.DataObject) -> None:
    n = data.draw(st.integers(COLUMNAR_MIN_ENDPOINTS, COLUMNAR_MIN_ENDPOINTS + 30))
    ages = st.none() | st.sampled_from([0.0, 50.0, 400.0, 900.0])
    state = BookedState(
        clusters={
            "c": tuple(
                BookedEndpoint(
                    address=f"127.0.0.1:{8000 + i}",
                    weight=data.draw(st.sampled_from([1.0, 1.7, 3.4])),
                    healthy=data.draw(st.sampled_from([True, True, False])),
                    waiting=data.draw(st.none() | _LOADS),
                    kv_usage=data.draw(st.none() | _KV),
                    telemetry_age_ms=data.draw(ages),
                    prefill_weight=data.draw(_PREFILL_WEIGHTS),
                )
                for i in range(n)
            ),
            "small": (BookedEndpoint(address="127.0.0.1:8000", weight=1.0, healthy=True),),
        },
        stale_after_ms=1000.0,
    )
    book = EndpointBook()
    addresses = [f"127.0.0.1:{8000 + i}" for i in range(n)]
    now = 100.0
    for _ in range(data.draw(st.integers(1, 3))):
        for a in data.draw(st.lists(st.sampled_from(addresses), max_size=20)):
            book.enter(a)  # before the state too: counts carry over
        book.update(state, now)
        assert book.columns("small", now) is None and book.columns("other", now) is None
        for _ in range(data.draw(st.integers(1, 6))):
            now += data.draw(st.sampled_from([0.0, 0.1, 0.3, 0.7, -0.5]))  # telemetry turns stale (or back)
            op = data.draw(st.sampled_from(["enter", "leave", "none"]))
            if op != "none":
                held = sorted(book.in_flight())
                a = data.draw(st.sampled_from(held if op == "leave" and held else addresses))
                book.enter(a) if op == "enter" else book.leave(a)
            kw = data.draw(_request(addresses))
            columns, states = book.columns("c", now), book.states("c", now)
            assert columns is not None and states is not None
            assert [columns.in_flight(s.address) for s in states] == [s.in_flight for s in states]
            assert _outcome(columns.pick, **kw) == _outcome(pick, states, **kw)
