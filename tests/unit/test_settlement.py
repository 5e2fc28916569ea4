"""The settler's exactly-once and lost-entry rules (:mod:`inferlb.policy.settlement`), as properties over any
order of reservations, access-log entries (duplicates, reordered, late, unknown), TTL sweeps and restarts.

The rule under test, for each reserved id: the first entry to arrive before ``reserved_at + ttl`` settles it
at that entry's charge (its usage; zero for a non-2xx answer without usage; else the reservation); with no
such entry it settles at the reservation, once; nothing else ever settles it, and after a restart (a new
ledger) nothing settles the ids the old one held (their admission charged the reservation)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.policy.quota import Admitted
from inferlb.policy.settlement import MeterEntry, Outcome, Reserved, SettlementLedger, entry_charge

TTL = 10.0


@dataclass(frozen=True)
class Reserve:
    tokens: int
    prompt: int


@dataclass(frozen=True)
class Entry:
    which: int  # index into the ids reserved so far (any index: may be a duplicate or a stale one)
    status: int
    usage: tuple[int, int] | None


@dataclass(frozen=True)
class Sweep:
    pass


@dataclass(frozen=True)
class Restart:
    pass


UNKNOWN_ID = -1

events = st.lists(
    st.tuples(
        st.floats(0, 6, allow_nan=False),  # time step (s): several steps may pass a TTL
        st.one_of(
            st.builds(Reserve, tokens=st.integers(1, 10_000), prompt=st.integers(0, 100)),
            st.builds(
                Entry,
                which=st.integers(UNKNOWN_ID, 30),
                status=st.sampled_from([0, 200, 200, 200, 206, 400, 429, 503]),
                usage=st.none() | st.tuples(st.integers(0, 5_000), st.integers(0, 5_000)),
            ),
            st.just(Sweep()),
            st.just(Restart()),
        ),
    ),
    max_size=80,
)


@given(events)
def test_each_reservation_settles_once_at_its_first_timely_entry_or_its_reservation(
    script: list[tuple[float, object]],
) -> None:
    ledger = SettlementLedger(TTL)
    now = 0.0
    generation = 0
    ids: list[tuple[int, str]] = []  # (generation, id) in reservation order
    reserved: dict[str, tuple[int, float, Admitted, int]] = {}  # id -> (generation, at, admitted, prompt)
    first_entry: dict[str, tuple[float, MeterEntry]] = {}  # the first entry each live id got
    settled: dict[str, list[tuple[int, Outcome]]] = {}
    lost: set[str] = set()  # held by a ledger that restarted

    def record(settlements: list[tuple[str, int, Outcome]]) -> None:
        for meter_id, tokens, outcome in settlements:
            settled.setdefault(meter_id, []).append((tokens, outcome))

    for step, ev in script:
        now += step
        if isinstance(ev, Reserve):
            meter_id = f"g{generation}-{len(ids)}"
            admitted = Admitted(tenant="t", tokens=ev.tokens, lease=meter_id)
            ledger.reserve(meter_id, admitted, model="m", prompt_tokens=ev.prompt, now=now)
            ids.append((generation, meter_id))
            reserved[meter_id] = (generation, now, admitted, ev.prompt)
        elif isinstance(ev, Entry):
            meter_id = (
                "never-reserved" if ev.which == UNKNOWN_ID or ev.which >= len(ids) else ids[ev.which][1]
            )
            entry = MeterEntry(meter_id=meter_id, status=ev.status, usage=ev.usage)
            first_entry.setdefault(meter_id, (now, entry))
            outcome, settlement = ledger.entry(entry, now)
            if settlement is not None:
                record([(meter_id, settlement.tokens, settlement.outcome)])
            if meter_id not in reserved or reserved[meter_id][0] != generation:
                assert outcome is Outcome.UNKNOWN and settlement is None
        elif isinstance(ev, Sweep):
            record([(s.reserved.admitted.lease, s.tokens, s.outcome) for s in ledger.expire(now)])
        else:  # a restart: a fresh ledger, the old one's pending ids are lost
            lost |= {m for g, m in ids if g == generation and m not in settled}
            ledger = SettlementLedger(TTL)
            generation += 1
    record([(s.reserved.admitted.lease, s.tokens, s.outcome) for s in ledger.expire(now + TTL)])

    for meter_id, (_, at, admitted, prompt) in reserved.items():
        got = settled.get(meter_id, [])
        if meter_id in lost:
            assert got == []  # never settled by anyone: the admission's reservation stands
            continue
        assert len(got) == 1, (meter_id, got)
        [(tokens, outcome)] = got
        first = first_entry.get(meter_id)
        if first is not None and first[0] < at + TTL:
            # the first timely entry decides
            expected = entry_charge(ledger_reserved(admitted, prompt, at + TTL), first[1])
            assert (tokens, outcome) == (expected.tokens, expected.outcome)
            if first[1].usage is not None:
                assert tokens == sum(first[1].usage)  # real usage, never less
        else:
            assert (tokens, outcome) == (admitted.tokens, Outcome.EXPIRED)


def ledger_reserved(admitted: Admitted, prompt: int, deadline: float) -> Reserved:
    """The :class:`Reserved` the ledger holds for ``admitted``."""
    return Reserved(admitted=admitted, model="m", prompt_tokens=prompt, deadline=deadline)


@given(
    usage=st.none() | st.tuples(st.integers(0, 9_000), st.integers(0, 9_000)),
    status=st.sampled_from([0, 200, 206, 404, 500]),
    tokens=st.integers(1, 9_000),
    prompt=st.integers(0, 9_000),
    produced=st.none() | st.integers(0, 20_000),
)
def test_a_charge_is_the_usage_else_nothing_for_an_error_else_what_was_streamed_else_the_reservation(
    usage: tuple[int, int] | None, status: int, tokens: int, prompt: int, produced: int | None
) -> None:
    reserved = ledger_reserved(Admitted(tenant="t", tokens=tokens), prompt, 1.0)
    s = entry_charge(reserved, MeterEntry(meter_id="x", status=status, usage=usage, produced=produced))
    assert s.prompt_tokens + s.completion_tokens == s.tokens
    if usage is not None:
        assert (s.tokens, s.prompt_tokens, s.completion_tokens, s.outcome) == (
            sum(usage),
            *usage,
            Outcome.METERED,
        )
    elif status in (404, 500):
        assert (s.tokens, s.outcome) == (0, Outcome.NOT_SERVED)
    elif produced is not None and status in (200, 206):
        # the prompt as admitted and the streamed bytes (never fewer than the streamed tokens), capped
        # by the reservation
        assert s.outcome is Outcome.PRODUCED
        assert s.prompt_tokens == min(prompt, tokens)
        assert s.completion_tokens == min(produced, tokens - s.prompt_tokens)
        assert s.tokens <= tokens
    else:
        assert (s.tokens, s.outcome) == (tokens, Outcome.UNMETERED)


def test_duplicates_late_and_unknown_entries_are_told_apart() -> None:
    ledger = SettlementLedger(TTL, remember_s=5.0)
    a, b = Admitted(tenant="t", tokens=100, lease="a"), Admitted(tenant="t", tokens=50, lease="b")
    ledger.reserve("a", a, model="m", prompt_tokens=10, now=0.0)
    ledger.reserve("b", b, model="m", prompt_tokens=10, now=0.0)
    entry = MeterEntry(meter_id="a", status=200, usage=(10, 5))
    assert ledger.entry(entry, 1.0)[0] is Outcome.METERED
    assert ledger.entry(entry, 2.0) == (Outcome.DUPLICATE, None)
    [expired] = ledger.expire(TTL)
    assert (expired.reserved.admitted, expired.tokens, expired.outcome) == (b, 50, Outcome.EXPIRED)
    assert ledger.entry(MeterEntry(meter_id="b", status=200, usage=(1, 1)), TTL + 1) == (Outcome.LATE, None)
    assert ledger.entry(MeterEntry(meter_id="zz", status=200, usage=None), TTL + 1) == (Outcome.UNKNOWN, None)
    ledger.expire(TTL + 100)  # both forgotten after remember_s
    assert ledger.entry(entry, TTL + 101) == (Outcome.UNKNOWN, None)
    assert ledger.pending == 0


def test_an_id_cannot_be_reserved_twice_and_the_ttl_must_be_positive() -> None:
    ledger = SettlementLedger(1.0)
    ledger.reserve("a", Admitted(tenant="t", tokens=1), model="m", prompt_tokens=0, now=0.0)
    with pytest.raises(ValueError, match="reused"):
        ledger.reserve("a", Admitted(tenant="t", tokens=1), model="m", prompt_tokens=0, now=0.5)
    with pytest.raises(ValueError, match="ttl_s"):
        SettlementLedger(0)


def test_the_in_flight_cluster_rides_to_whichever_settlement_comes() -> None:
    ledger = SettlementLedger(TTL)
    for meter_id, cluster in (("a", "m--v1"), ("b", None), ("c", "m--v2")):
        ledger.reserve(
            meter_id, Admitted(tenant="t", tokens=9), model="m", prompt_tokens=1, now=0.0, in_flight=cluster
        )
    _, by_entry = ledger.entry(MeterEntry(meter_id="a", status=200, usage=(1, 1)), 1.0)
    assert by_entry is not None and by_entry.reserved.in_flight == "m--v1"
    assert [s.reserved.in_flight for s in ledger.expire(TTL)] == [None, "m--v2"]
