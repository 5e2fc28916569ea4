"""Concurrency leases and the daily token budget of QuotaBook; MemoryQuotaStore over it."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.policy.quota import (
    SECONDS_PER_DAY,
    Admitted,
    Limit,
    MemoryQuotaStore,
    QuotaBook,
    Refused,
    TenantLimits,
    utc_day,
)

DAY5 = 5 * SECONDS_PER_DAY + 100.0  # wall clock inside UTC day 5


def book(**limits: int) -> QuotaBook:
    return QuotaBook({"t": TenantLimits(**limits)}, 0.0)  # type: ignore[arg-type]


def test_concurrency_lease_is_released_exactly_once() -> None:
    q = book(max_concurrent_requests=2)
    a = q.try_admit("t", 10, 0.0)
    b = q.try_admit("t", 10, 0.0)
    assert isinstance(a, Admitted) and isinstance(b, Admitted) and a.lease != b.lease
    r = q.try_admit("t", 10, 0.0)
    assert isinstance(r, Refused) and r.limit is Limit.MAX_CONCURRENT_REQUESTS and r.retry_after_s == 1.0
    assert q.settle(a, 5, 0.0) is True
    assert q.settle(a, 5, 0.0) is False  # a second settle frees nothing more
    assert q.in_flight("t") == 1
    assert isinstance(q.try_admit("t", 10, 0.0), Admitted)
    assert isinstance(q.try_admit("t", 10, 0.0), Refused)


def test_daily_budget_counts_reservations_then_real_usage() -> None:
    q = book(daily_token_budget=1000)
    a = q.try_admit("t", 600, 0.0, wall=DAY5)
    assert isinstance(a, Admitted) and a.day == 5
    r = q.try_admit("t", 500, 0.0, wall=DAY5)
    assert isinstance(r, Refused) and r.limit is Limit.DAILY_TOKEN_BUDGET
    assert r.retry_after_s == pytest.approx(SECONDS_PER_DAY - 100.0)  # until 00:00 UTC
    q.settle(a, 200, 0.0)  # used less than reserved: 400 back
    assert q.day_tokens("t", DAY5) == 200
    assert isinstance(q.try_admit("t", 500, 0.0, wall=DAY5), Admitted)


def test_daily_budget_resets_at_utc_midnight_and_old_reservations_stay_on_their_day() -> None:
    q = book(daily_token_budget=1000)
    a = q.try_admit("t", 900, 0.0, wall=DAY5)
    assert isinstance(a, Admitted)
    tomorrow = DAY5 + SECONDS_PER_DAY
    b = q.try_admit("t", 900, 0.0, wall=tomorrow)
    assert isinstance(b, Admitted) and b.day == 6
    q.settle(a, 100, 0.0)  # billed to day 5, not to day 6
    assert q.day_tokens("t", tomorrow) == 900


def test_request_over_the_whole_daily_budget_never_fits() -> None:
    r = book(daily_token_budget=100).try_admit("t", 101, 0.0)
    assert isinstance(r, Refused) and r.never_fits


def test_refusal_by_concurrency_takes_nothing_from_the_other_limits() -> None:
    q = book(max_concurrent_requests=1, tokens_per_minute=1000, daily_token_budget=5000)
    a = q.try_admit("t", 100, 0.0, wall=DAY5)
    assert isinstance(a, Admitted)
    for _ in range(5):
        assert isinstance(q.try_admit("t", 100, 0.0, wall=DAY5), Refused)
    assert q.available("t", 0.0)[1] == pytest.approx(900)
    assert q.day_tokens("t", DAY5) == 100


def test_reload_keeps_leases_and_day_totals() -> None:
    q = book(max_concurrent_requests=1, daily_token_budget=1000)
    a = q.try_admit("t", 300, 0.0, wall=DAY5)
    assert isinstance(a, Admitted)
    q.update_limits({"t": TenantLimits(max_concurrent_requests=2, daily_token_budget=1000)}, 0.0)
    assert q.in_flight("t") == 1 and q.day_tokens("t", DAY5) == 300
    assert q.settle(a, 300, 0.0) is True


def test_utc_day() -> None:
    assert utc_day(0.0) == 0
    assert utc_day(SECONDS_PER_DAY - 0.001) == 0
    assert utc_day(SECONDS_PER_DAY) == 1


@settings(max_examples=150)
@given(
    cap=st.integers(min_value=1, max_value=5),
    budget=st.integers(min_value=50, max_value=2000),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(min_value=1, max_value=300), st.floats(0, 1)), max_size=60
    ),
)
def test_any_sequence_keeps_inflight_and_daily_totals_within_limits(
    cap: int, budget: int, ops: list[tuple[bool, int, float]]
) -> None:
    q = book(max_concurrent_requests=cap, daily_token_budget=budget)
    held: list[Admitted] = []
    for is_admit, tokens, used_share in ops:
        if is_admit or not held:
            d = q.try_admit("t", tokens, 0.0, wall=DAY5)
            if isinstance(d, Admitted):
                held.append(d)
        else:
            a = held.pop(0)
            assert q.settle(a, int(a.tokens * used_share), 0.0) is True
            assert q.settle(a, 0, 0.0) is False
        assert q.in_flight("t") == len(held) <= cap
        assert q.day_tokens("t", DAY5) <= budget


async def test_memory_store_burst_admits_at_most_the_quota() -> None:
    store = MemoryQuotaStore(
        {"t": TenantLimits(tokens_per_minute=1000, max_concurrent_requests=7)},
        clock=lambda: 0.0,
        wall_clock=lambda: DAY5,
    )
    results = await asyncio.gather(*(store.admit("t", 100) for _ in range(50)))
    admitted = [r for r in results if isinstance(r, Admitted)]
    assert len(admitted) == 7  # the concurrency cap binds before the 10 that the tokens allow
    await asyncio.gather(*(store.settle(a, 100) for a in admitted))
    assert store.book.in_flight("t") == 0
    more = await asyncio.gather(*(store.admit("t", 100) for _ in range(50)))
    assert sum(isinstance(r, Admitted) for r in more) == 3  # 1000 - 700 spent tokens
