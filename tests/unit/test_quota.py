"""Sliding-window quotas: no 60 s window ever admits more than the quota, exact retry-after, atomic admission
over two limits, reservations settled in their own sub-window, reloads."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.config.schema import parse_config
from inferlb.policy.quota import (
    SUB_WINDOWS,
    Admitted,
    Limit,
    QuotaBook,
    Refused,
    SlidingWindow,
    TenantLimits,
    limits_from_config,
    seconds_until,
)


def book(rpm: int | None = None, tpm: int | None = None) -> QuotaBook:
    return QuotaBook({"t": TenantLimits(requests_per_minute=rpm, tokens_per_minute=tpm)}, 0.0)


def test_unknown_and_unlimited_tenants_are_admitted() -> None:
    q = book()
    assert isinstance(q.try_admit("t", 10**9, 0.0), Admitted)
    assert isinstance(q.try_admit("nobody", 10**9, 0.0), Admitted)


def test_token_limit_refuses_until_the_sub_window_leaves_the_window() -> None:
    q = book(tpm=600)
    a = q.try_admit("t", 500, 0.3)
    assert isinstance(a, Admitted) and a.second == 0
    r = q.try_admit("t", 200, 10.5)
    assert isinstance(r, Refused)
    assert r.limit is Limit.TOKENS_PER_MINUTE
    # second 0 is summed by every check up to second 60 and leaves the window at 61
    assert r.retry_after_s == 61 - 10.5
    assert "tokens per minute" in r.message and "used 500" in r.message
    # a little before the retry time it still does not fit, at the retry time it does
    assert isinstance(q.try_admit("t", 200, 60.999), Refused)
    assert isinstance(q.try_admit("t", 200, 61.0), Admitted)


def test_a_rested_tenant_gets_one_quota_per_minute_not_two() -> None:
    # a token bucket would hand out its full 1000 at t=59.9 and refill ~1000 more by t=119.8
    q = book(tpm=1000)
    assert isinstance(q.try_admit("t", 1000, 59.9), Admitted)
    for t in (60.0, 90.0, 119.0, 119.99):
        r = q.try_admit("t", 1, t)
        assert isinstance(r, Refused) and r.retry_after_s == seconds_until(120, t)
    assert isinstance(q.try_admit("t", 1000, 120.0), Admitted)


def test_request_limit_refuses_with_retry_after() -> None:
    q = book(rpm=2)
    assert isinstance(q.try_admit("t", 1, 0.0), Admitted)
    assert isinstance(q.try_admit("t", 1, 30.2), Admitted)
    r = q.try_admit("t", 1, 45.0)
    assert isinstance(r, Refused)
    assert r.limit is Limit.REQUESTS_PER_MINUTE
    assert r.retry_after_s == 61 - 45.0  # the request of second 0 leaves first
    assert isinstance(q.try_admit("t", 1, 61.0), Admitted)
    r = q.try_admit("t", 1, 61.0)
    assert isinstance(r, Refused) and r.retry_after_s == 91 - 61.0  # then the one of second 30


def test_retry_after_waits_for_as_many_sub_windows_as_needed() -> None:
    q = book(tpm=100)
    for t, w in ((0.0, 30), (5.0, 30), (9.0, 30)):
        assert isinstance(q.try_admit("t", w, t), Admitted)
    r = q.try_admit("t", 70, 20.7)  # 90 counted: 60 of them must leave, i.e. seconds 0 and 5
    assert isinstance(r, Refused) and r.retry_after_s == 66 - 20.7
    assert isinstance(q.try_admit("t", 70, 65.99), Refused)
    assert isinstance(q.try_admit("t", 70, 66.0), Admitted)


def test_refusal_by_one_limit_takes_nothing_from_the_other() -> None:
    q = book(rpm=10, tpm=100)
    assert isinstance(q.try_admit("t", 100, 0.0), Admitted)  # tokens spent, 9 requests left
    for _ in range(5):
        assert isinstance(q.try_admit("t", 50, 0.0), Refused)
    assert q.available("t", 0.0) == (9, 0)
    # and the other way round: requests spent, tokens untouched by refusals
    q = book(rpm=1, tpm=1000)
    assert isinstance(q.try_admit("t", 10, 0.0), Admitted)
    r = q.try_admit("t", 10, 0.0)
    assert isinstance(r, Refused)
    assert r.limit is Limit.REQUESTS_PER_MINUTE
    assert q.available("t", 0.0) == (0, 990)


def test_retry_after_is_the_longest_wait_of_both_limits() -> None:
    q = book(rpm=2, tpm=100)
    assert isinstance(q.try_admit("t", 10, 0.0), Admitted)
    assert isinstance(q.try_admit("t", 90, 20.0), Admitted)
    r = q.try_admit("t", 50, 30.0)  # requests fit again at 61, tokens only at 81
    assert isinstance(r, Refused)
    assert r.limit is Limit.TOKENS_PER_MINUTE and r.retry_after_s == 51.0
    # a request weighs 1, so the request limit waits for one sub-window at most: it is the longer wait
    # only when the tokens fit sooner, here now
    q = book(rpm=2, tpm=100)
    assert isinstance(q.try_admit("t", 90, 0.0), Admitted)
    assert isinstance(q.try_admit("t", 1, 20.0), Admitted)
    r = q.try_admit("t", 5, 30.0)
    assert isinstance(r, Refused)
    assert r.limit is Limit.REQUESTS_PER_MINUTE and r.retry_after_s == 31.0


def test_request_larger_than_the_quota_never_fits() -> None:
    q = book(tpm=2000)
    r = q.try_admit("t", 2001, 0.0)
    assert isinstance(r, Refused)
    assert r.never_fits
    assert r.retry_after_s is None
    assert "never" in r.message
    assert "2000" in r.message
    assert q.available("t", 0.0)[1] == 2000  # and it took nothing


def test_settle_replaces_the_reservation_in_its_own_sub_window() -> None:
    q = book(tpm=1000)
    a = q.try_admit("t", 800, 3.5)
    assert isinstance(a, Admitted)
    q.settle(a, 300, 10.0)  # 500 freed in second 3
    assert q.available("t", 10.0)[1] == 700
    b = q.try_admit("t", 700, 10.0)
    assert isinstance(b, Admitted)
    q.settle(b, 900, 20.0)  # 200 over the reservation: a debt in second 10
    assert q.available("t", 20.0)[1] == -200
    r = q.try_admit("t", 1, 20.0)
    assert isinstance(r, Refused)
    assert r.retry_after_s == 64 - 20.0  # second 3 (300) must leave before 1 more fits
    assert q.available("t", 64.0)[1] == 100
    assert isinstance(q.try_admit("t", 100, 64.0), Admitted)


def test_a_settle_after_the_sub_window_left_changes_nothing() -> None:
    q = book(tpm=1000)
    a = q.try_admit("t", 600, 0.0)
    b = q.try_admit("t", 300, 50.0)
    assert isinstance(a, Admitted) and isinstance(b, Admitted)
    q.settle(a, 10_000, 61.0)  # second 0 left the window at 61: no debt, no credit
    assert q.available("t", 61.0)[1] == 700
    q.settle(b, 0, 110.0)  # second 50 is still summed at 110
    assert q.available("t", 110.0)[1] == 1000


def test_reload_keeps_the_window_and_checks_it_against_the_new_quota() -> None:
    q = QuotaBook(
        {
            "a": TenantLimits(tokens_per_minute=1000),
            "b": TenantLimits(tokens_per_minute=1000),
            "gone": TenantLimits(tokens_per_minute=5),
        },
        0.0,
    )
    assert isinstance(q.try_admit("a", 900, 0.0), Admitted)
    assert isinstance(q.try_admit("b", 600, 0.0), Admitted)
    q.update_limits(
        {
            "a": TenantLimits(tokens_per_minute=1000),
            "b": TenantLimits(tokens_per_minute=500),
            "new": TenantLimits(tokens_per_minute=50),
        },
        0.0,
    )
    assert q.available("a", 0.0)[1] == 100  # unchanged
    assert q.available("b", 0.0)[1] == -100  # 600 counted against the lowered 500
    assert isinstance(q.try_admit("b", 1, 30.0), Refused)
    assert q.available("new", 0.0)[1] == 50
    assert q.available("gone", 0.0) == (None, None)
    # raising a quota counts what the last minute admitted against it, without forgetting it
    q.update_limits({"a": TenantLimits(tokens_per_minute=2000)}, 0.0)
    assert q.available("a", 0.0)[1] == 1100


def test_limits_from_config() -> None:
    cfg = parse_config(
        {
            "models": [{"name": "m"}],
            "tenants": [
                {"name": "a", "api_keys": ["sk-aaaaaaaa"], "requests_per_minute": 5, "tokens_per_minute": 70},
                {"name": "b", "api_keys": ["sk-bbbbbbbb"]},
            ],
        }
    )
    assert limits_from_config(cfg) == {
        "a": TenantLimits(requests_per_minute=5, tokens_per_minute=70),
        "b": TenantLimits(),
    }


def test_a_window_keeps_at_most_61_sub_windows() -> None:
    q = book(rpm=10**6, tpm=10**9)
    for i in range(500):
        assert isinstance(q.try_admit("t", 1, i * 0.7), Admitted)
        for w in (q._tenants["t"].requests, q._tenants["t"].tokens):
            assert w is not None and len(w.counts) <= SUB_WINDOWS
            assert w.total == sum(w.counts.values())


def test_a_clock_going_backwards_stands_still() -> None:
    q = book(tpm=100)
    a = q.try_admit("t", 60, 100.5)
    b = q.try_admit("t", 30, 40.0)  # counted in second 100, the newest, not in the past
    assert isinstance(a, Admitted) and isinstance(b, Admitted) and b.second == 100
    r = q.try_admit("t", 20, 40.0)
    assert isinstance(r, Refused) and r.retry_after_s == 161 - 40.0


@pytest.mark.parametrize("now", [0.1, 0.3, 1e9 + 0.7, 1728003600.123456, 59.999999999999])
def test_seconds_until_lands_in_the_second(now: float) -> None:
    target = math.floor(now) + 61
    wait = seconds_until(target, now)
    assert now + wait >= target
    assert now + math.nextafter(wait, -math.inf) < target or wait == target - now


# -- the guarantee, over arbitrary sequences --------------------------------------------------------
GAPS = st.one_of(st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 59.0, 60.0, 61.0]), st.floats(0.0, 20.0))


@settings(max_examples=300, deadline=None)
@given(
    rpm=st.one_of(st.none(), st.integers(1, 12)),
    tpm=st.integers(50, 3000),
    events=st.lists(
        st.tuples(GAPS, st.booleans(), st.integers(0, 1500), st.floats(0.0, 1.6)), min_size=1, max_size=120
    ),
)
def test_no_60_second_window_ever_admits_more_than_the_quota(
    rpm: int | None, tpm: int, events: list[tuple[float, bool, int, float]]
) -> None:
    """Admissions and settles at non-decreasing times. For every 60 s window [s, s + 60] (closed, s at
    every event time): admitted requests <= rpm, and the tokens charged (reservations, replaced by the
    real usage when settled while their sub-window was in the window) <= tpm plus the overruns settled
    after the window's last admission (usage above a reservation cannot be refused). Retry-after is exact:
    at it the request fits, a millisecond before it does not."""
    q = book(rpm=rpm, tpm=tpm)
    now = 0.0
    # per admission: time, event index, reservation, charge, overrun settled later (event index, tokens)
    admitted: list[dict[str, float]] = []
    held: list[int] = []
    times = []
    for i, (gap, is_settle, tokens, share) in enumerate(events):
        now += gap
        times.append(now)
        if is_settle and held:
            k = held.pop(0)
            a = admitted[k]
            used = int(a["reserved"] * share)
            adm = Admitted(tenant="t", tokens=int(a["reserved"]), second=math.floor(a["t"]))
            q.settle(adm, used, now)
            if math.floor(a["t"]) >= math.floor(now) - 60:
                a["charge"] = used
                a["overrun_at"], a["overrun"] = i, max(0, used - a["reserved"])
            continue
        r = q.try_admit("t", tokens, now)
        if isinstance(r, Admitted):
            assert r.second == math.floor(now)
            admitted.append(
                {"t": now, "i": i, "reserved": tokens, "charge": tokens, "overrun_at": -1, "overrun": 0}
            )
            held.append(len(admitted) - 1)
            continue
        assert r.never_fits == (tokens > tpm)
        if r.retry_after_s is None:
            continue
        assert r.retry_after_s > 0
        at = now + r.retry_after_s
        assert math.floor(at) == at  # it fits exactly when a sub-window leaves
        assert isinstance(copy.deepcopy(q).try_admit("t", tokens, at), Admitted)
        if at - 1e-3 >= now:
            assert isinstance(copy.deepcopy(q).try_admit("t", tokens, at - 1e-3), Refused)
    for s in times:
        members = [a for a in admitted if s <= a["t"] <= s + 60]
        if not members:
            continue
        last = max(a["i"] for a in members)
        if rpm is not None:
            assert len(members) <= rpm
        charged = sum(a["charge"] for a in members)
        late_overruns = sum(a["overrun"] for a in members if a["overrun_at"] > last)
        assert charged <= tpm + late_overruns, (s, members)


@settings(max_examples=200, deadline=None)
@given(
    quota=st.integers(1, 400),
    units=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 100)), min_size=1, max_size=150),
)
def test_window_counts_stay_summed_and_bounded(quota: int, units: list[tuple[int, int]]) -> None:
    w = SlidingWindow(quota)
    second = 0
    for step, n in units:
        second += step
        w.advance(second)
        fit = w.fit_second(min(n, quota), second)
        assert second <= fit <= second + SUB_WINDOWS
        if fit == second:
            w.add(second, min(n, quota))
        assert w.total == sum(w.counts.values()) <= quota
        assert all(second - 60 <= s <= second for s in w.counts)
