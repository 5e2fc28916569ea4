"""Fair queueing under saturation: strict bands, token-fair tenants within a band, bounded waiting."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.policy.fair_queue import BAND_DEFAULT, BAND_HIGH, BAND_LOW, FairQueue, QueueFull


def _serve_backlogged(
    costs: dict[str, int], *, served_tokens_total: int, weights: dict[str, float] | None = None
) -> dict[str, int]:
    """Two or more tenants keep 8 requests each waiting; a server takes one at a time until it has served
    ``served_tokens_total`` tokens. Returns the tokens served per tenant."""
    q = FairQueue(max_queued=1000, max_wait_s=1e9)
    n = 0
    for tenant, cost in costs.items():
        for _ in range(8):
            q.push(
                f"{tenant}-{n}",
                tenant=tenant,
                band=BAND_DEFAULT,
                cost_tokens=cost,
                now=0.0,
                weight=(weights or {}).get(tenant, 1.0),
            )
            n += 1
    served = dict.fromkeys(costs, 0)
    total = 0
    while total < served_tokens_total:
        entry = q.pop()
        assert entry is not None
        served[entry.tenant] += entry.cost_tokens
        total += entry.cost_tokens
        q.push(
            f"{entry.tenant}-{n}",
            tenant=entry.tenant,
            band=BAND_DEFAULT,
            cost_tokens=entry.cost_tokens,
            now=0.0,
            weight=entry.weight,
        )
        n += 1
    return served


def test_a_heavy_and_a_light_tenant_get_equal_token_throughput_when_both_are_backlogged() -> None:
    served = _serve_backlogged({"heavy": 4000, "light": 250}, served_tokens_total=2_000_000)
    assert abs(served["heavy"] - served["light"]) <= 0.1 * min(served.values())


def test_weights_scale_the_share() -> None:
    served = _serve_backlogged(
        {"a": 1000, "b": 1000}, served_tokens_total=900_000, weights={"a": 2.0, "b": 1.0}
    )
    assert served["a"] == pytest.approx(2 * served["b"], rel=0.05)


def test_bands_are_strict_and_fifo_holds_for_one_tenant() -> None:
    q = FairQueue(max_queued=10, max_wait_s=60)
    q.push("low", tenant="t", band=BAND_LOW, cost_tokens=1, now=0)
    q.push("d1", tenant="t", band=BAND_DEFAULT, cost_tokens=5, now=0)
    q.push("d2", tenant="t", band=BAND_DEFAULT, cost_tokens=1, now=0)
    q.push("high", tenant="u", band=BAND_HIGH, cost_tokens=100, now=0)
    assert [q.pop().request_id for _ in range(4)] == ["high", "d1", "d2", "low"]  # type: ignore[union-attr]
    assert q.pop() is None


def test_an_idle_tenant_saves_no_credit() -> None:
    q = FairQueue(max_queued=100, max_wait_s=60)
    for i in range(10):
        q.push(f"a{i}", tenant="a", band=BAND_DEFAULT, cost_tokens=100, now=0)
    for _ in range(5):
        q.pop()
    # "b" joins late: it starts at the band's virtual time, so it alternates with "a" instead of taking
    # five turns in a row for the time it was idle.
    for i in range(5):
        q.push(f"b{i}", tenant="b", band=BAND_DEFAULT, cost_tokens=100, now=1)
    order = [q.pop().tenant for _ in range(6)]  # type: ignore[union-attr]
    assert order.count("a") >= 2 and order.count("b") >= 2


def test_bounds_refuse_and_expire() -> None:
    q = FairQueue(max_queued=2, max_wait_s=5)
    q.push("1", tenant="t", band=BAND_DEFAULT, cost_tokens=1, now=0)
    q.push("2", tenant="t", band=BAND_DEFAULT, cost_tokens=1, now=3)
    with pytest.raises(QueueFull):
        q.push("3", tenant="t", band=BAND_DEFAULT, cost_tokens=1, now=3)
    assert [e.request_id for e in q.expire(5.5)] == ["1"]
    assert q.remove("2") and not q.remove("2")
    assert len(q) == 0 and q.pop() is None
    with pytest.raises(ValueError, match="max_wait_s"):
        FairQueue(max_queued=1, max_wait_s=0)
    with pytest.raises(ValueError, match="cost_tokens"):
        q.push("x", tenant="t", band=BAND_DEFAULT, cost_tokens=0, now=0)


def test_an_id_queued_again_after_removal_is_served_once() -> None:
    q = FairQueue(max_queued=10, max_wait_s=60)
    q.push("r", tenant="t", band=BAND_DEFAULT, cost_tokens=10, now=0)
    q.remove("r")
    q.push("r", tenant="t", band=BAND_DEFAULT, cost_tokens=10, now=0)
    assert q.pop() is not None and q.pop() is None


_op = st.one_of(
    st.tuples(
        st.just("push"),
        st.sampled_from("abc"),
        st.sampled_from([BAND_HIGH, BAND_DEFAULT, BAND_LOW]),
        st.integers(1, 5000),
    ),
    st.tuples(st.just("pop")),
    st.tuples(st.just("expire"), st.floats(0, 10)),
    st.tuples(st.just("remove"), st.integers(0, 40)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=80))
def test_any_sequence_keeps_bands_strict_and_entries_exact(ops: list[tuple[object, ...]]) -> None:
    q = FairQueue(max_queued=30, max_wait_s=3)
    now = 0.0
    live: dict[str, int] = {}
    n = 0
    for op in ops:
        now += 0.25
        if op[0] == "push":
            _, tenant, band, cost = op
            try:
                q.push(str(n), tenant=str(tenant), band=int(band), cost_tokens=int(cost), now=now)  # type: ignore[call-overload]
                live[str(n)] = int(band)  # type: ignore[call-overload]
            except QueueFull:
                assert len(live) == 30
            n += 1
        elif op[0] == "pop":
            entry = q.pop()
            if entry is None:
                assert not live
            else:
                band = live.pop(entry.request_id)
                assert band == entry.band
                assert all(entry.band <= other for other in live.values())
        elif op[0] == "expire":
            for e in q.expire(now + float(op[1])):  # type: ignore[arg-type]
                assert now + float(op[1]) - e.enqueued_at > 3  # type: ignore[arg-type]
                del live[e.request_id]
        else:
            rid = str(op[1])
            assert q.remove(rid) == (rid in live)
            live.pop(rid, None)
        assert len(q) == len(live)


@settings(max_examples=100, deadline=None)
@given(
    heavy=st.lists(st.integers(1, 4000), min_size=1, max_size=6),
    light=st.lists(st.integers(1, 4000), min_size=1, max_size=6),
    pops=st.integers(1, 200),
)
def test_backlogged_tenants_stay_within_the_sfq_bound(heavy: list[int], light: list[int], pops: int) -> None:
    """Goyal et al.'s bound: while both are backlogged, served tokens differ by at most the two largest
    requests (weights 1)."""
    q = FairQueue(max_queued=100, max_wait_s=1e9)
    pattern = {"h": heavy, "l": light}
    sent = {"h": 0, "l": 0}
    served = {"h": 0, "l": 0}

    def send(t: str) -> None:
        cost = pattern[t][sent[t] % len(pattern[t])]
        q.push(f"{t}{sent[t]}", tenant=t, band=BAND_DEFAULT, cost_tokens=cost, now=0)
        sent[t] += 1

    for t in pattern:
        for _ in range(3):
            send(t)
    for _ in range(pops):
        entry = q.pop()
        assert entry is not None
        served[entry.tenant] += entry.cost_tokens
        send(entry.tenant)
        assert abs(served["h"] - served["l"]) <= max(heavy) + max(light)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(_op, max_size=60))
def test_peek_names_what_pop_serves_next_and_leaves_it(ops: list[tuple[object, ...]]) -> None:
    q = FairQueue(max_queued=30, max_wait_s=3)
    now = 0.0
    for n, op in enumerate(ops):
        now += 0.25
        if op[0] == "push":
            _, tenant, band, cost = op
            with contextlib.suppress(QueueFull):
                q.push(str(n), tenant=str(tenant), band=int(band), cost_tokens=int(cost), now=now)  # type: ignore[call-overload]
        elif op[0] == "pop":
            size = len(q)
            head = q.peek()
            assert len(q) == size
            assert q.pop() == head
        elif op[0] == "expire":
            q.expire(now + float(op[1]))  # type: ignore[arg-type]
        else:
            q.remove(str(op[1]))
    assert (q.peek() is None) == (len(q) == 0)
