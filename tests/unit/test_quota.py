"""Token-bucket quotas: refill, atomic admission over two limits, retry-after, reloads, reconciliation."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.config import parse_config
from inferlb.quota import Admitted, Limit, QuotaBook, Refused, TenantLimits, TokenBucket, limits_from_config


def book(rpm: int | None = None, tpm: int | None = None, now: float = 0.0) -> QuotaBook:
    return QuotaBook({"t": TenantLimits(requests_per_minute=rpm, tokens_per_minute=tpm)}, now)


def test_bucket_starts_full_and_refills_at_quota_per_60s() -> None:
    b = TokenBucket(600, now=0.0)
    assert b.refill(0.0) == 600
    b.level = 0
    assert b.refill(1.0) == pytest.approx(10.0)  # 600/min = 10/s
    assert b.refill(30.0) == pytest.approx(300.0)
    assert b.refill(1000.0) == 600  # never above capacity
    assert b.refill(500.0) == 600  # a clock going backwards adds nothing


def test_unknown_and_unlimited_tenants_are_admitted() -> None:
    q = book()
    assert isinstance(q.try_admit("t", 10**9, 0.0), Admitted)
    assert isinstance(q.try_admit("nobody", 10**9, 0.0), Admitted)


def test_token_limit_refuses_with_retry_after() -> None:
    q = book(tpm=600)  # 10 tokens/s
    assert isinstance(q.try_admit("t", 500, 0.0), Admitted)
    r = q.try_admit("t", 200, 0.0)
    assert isinstance(r, Refused)
    assert r.limit is Limit.TOKENS_PER_MINUTE
    assert r.retry_after_s == pytest.approx(10.0)  # 100 missing at 10/s
    assert "tokens per minute" in r.message
    # just before the retry time it still does not fit, at the retry time it does
    assert isinstance(q.try_admit("t", 200, 9.9), Refused)
    assert isinstance(q.try_admit("t", 200, 10.0 + 1e-9), Admitted)


def test_request_limit_refuses_with_retry_after() -> None:
    q = book(rpm=2)  # one request per 30 s
    assert isinstance(q.try_admit("t", 1, 0.0), Admitted)
    assert isinstance(q.try_admit("t", 1, 0.0), Admitted)
    r = q.try_admit("t", 1, 0.0)
    assert isinstance(r, Refused)
    assert r.limit is Limit.REQUESTS_PER_MINUTE
    assert r.retry_after_s == pytest.approx(30.0)


def test_refusal_by_one_limit_takes_nothing_from_the_other() -> None:
    q = book(rpm=10, tpm=100)
    assert isinstance(q.try_admit("t", 100, 0.0), Admitted)  # tokens drained, 9 requests left
    for _ in range(5):
        assert isinstance(q.try_admit("t", 50, 0.0), Refused)
    assert q.available("t", 0.0) == (pytest.approx(9.0), pytest.approx(0.0))
    # and the other way round: requests drained, tokens untouched by refusals
    q = book(rpm=1, tpm=1000)
    assert isinstance(q.try_admit("t", 10, 0.0), Admitted)
    r = q.try_admit("t", 10, 0.0)
    assert isinstance(r, Refused)
    assert r.limit is Limit.REQUESTS_PER_MINUTE
    assert q.available("t", 0.0) == (pytest.approx(0.0), pytest.approx(990.0))


def test_retry_after_is_the_longest_wait_of_both_limits() -> None:
    q = book(rpm=60, tpm=60)  # 1 request/s and 1 token/s
    assert isinstance(q.try_admit("t", 60, 0.0), Admitted)
    r = q.try_admit("t", 30, 0.0)
    assert isinstance(r, Refused)
    assert r.limit is Limit.TOKENS_PER_MINUTE
    assert r.retry_after_s == pytest.approx(30.0)


def test_request_larger_than_the_quota_never_fits() -> None:
    q = book(tpm=2000)
    r = q.try_admit("t", 2001, 0.0)
    assert isinstance(r, Refused)
    assert r.never_fits
    assert r.retry_after_s is None
    assert "never" in r.message
    assert "2000" in r.message
    # and it took nothing
    assert q.available("t", 0.0)[1] == 2000


def test_reconcile_credits_unused_and_debits_overrun() -> None:
    q = book(tpm=1000)
    assert isinstance(q.try_admit("t", 800, 0.0), Admitted)
    q.reconcile("t", reserved=800, used=300, now=0.0)
    assert q.available("t", 0.0)[1] == pytest.approx(700.0)
    q.reconcile("t", reserved=100, used=900, now=0.0)  # 800 more than reserved
    assert q.available("t", 0.0)[1] == pytest.approx(-100.0)
    r = q.try_admit("t", 1, 0.0)
    assert isinstance(r, Refused)
    assert r.retry_after_s == pytest.approx(101 / (1000 / 60))
    # credit never exceeds capacity
    q.reconcile("t", reserved=10_000, used=0, now=0.0)
    assert q.available("t", 0.0)[1] == 1000


def test_reload_keeps_unchanged_tenants_and_clips_changed_ones() -> None:
    q = QuotaBook(
        {
            "a": TenantLimits(tokens_per_minute=1000),
            "b": TenantLimits(tokens_per_minute=1000),
            "gone": TenantLimits(tokens_per_minute=5),
        },
        0.0,
    )
    assert isinstance(q.try_admit("a", 900, 0.0), Admitted)
    assert isinstance(q.try_admit("b", 100, 0.0), Admitted)
    q.update_limits(
        {
            "a": TenantLimits(tokens_per_minute=1000),
            "b": TenantLimits(tokens_per_minute=500),
            "new": TenantLimits(tokens_per_minute=50),
        },
        0.0,
    )
    assert q.available("a", 0.0)[1] == pytest.approx(100.0)  # unchanged: state kept, no free refill
    assert q.available("b", 0.0)[1] == pytest.approx(500.0)  # 900 left, clipped to the new capacity
    assert q.available("new", 0.0)[1] == 50
    assert q.available("gone", 0.0) == (None, None)
    # raising a drained tenant's quota does not hand it a fresh bucket
    q.update_limits({"a": TenantLimits(tokens_per_minute=100_000)}, 0.0)
    assert q.available("a", 0.0)[1] == pytest.approx(100.0)


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


@settings(max_examples=200, deadline=None)
@given(
    rpm=st.integers(1, 50),
    tpm=st.integers(100, 5000),
    requests=st.lists(
        st.tuples(st.floats(0.0, 5.0, allow_nan=False), st.integers(0, 1200)), min_size=1, max_size=200
    ),
    reconcile_every=st.integers(0, 5),
)
def test_never_admits_more_than_the_bucket_allows(
    rpm: int, tpm: int, requests: list[tuple[float, int]], reconcile_every: int
) -> None:
    """Over any window [t0, t1], admitted <= quota + quota * (t1 - t0) / 60, for both limits; so over
    the whole run the long-run rate is at most the per-minute quota."""
    q = book(rpm=rpm, tpm=tpm)
    now = 0.0
    admitted: list[tuple[float, int]] = []
    for i, (gap, tokens) in enumerate(requests):
        now += gap
        r = q.try_admit("t", tokens, now)
        if isinstance(r, Admitted):
            admitted.append((now, tokens))
            # reconcile exactly what was reserved: a no-op for the invariant, but it exercises the path
            if reconcile_every and i % reconcile_every == 0:
                q.reconcile("t", reserved=tokens, used=tokens, now=now)
        else:
            assert r.never_fits == (tokens > tpm)
            if r.retry_after_s is not None:
                assert r.retry_after_s > 0
                # retrying at the advertised time succeeds (nothing else happened in between)
                probe = copy.deepcopy(q)
                later = probe.try_admit("t", tokens, now + r.retry_after_s + 1e-6)
                assert isinstance(later, Admitted)
    eps = 1e-6
    for i, (t0, _) in enumerate(admitted):
        tokens_in_window = 0
        for j in range(i, len(admitted)):
            t1, tok = admitted[j]
            tokens_in_window += tok
            assert j - i + 1 <= rpm + rpm * (t1 - t0) / 60 + eps
            assert tokens_in_window <= tpm + tpm * (t1 - t0) / 60 + eps
    total_time = now
    assert sum(t for _, t in admitted) <= tpm * (1 + total_time / 60) + eps


@settings(max_examples=100, deadline=None)
@given(tpm=st.integers(60, 10_000), sizes=st.lists(st.integers(1, 500), min_size=1, max_size=300))
def test_each_simulated_minute_admits_at_most_quota_plus_unspent(tpm: int, sizes: list[int]) -> None:
    """Each minute admits at most one quota of refill plus what the bucket held when the minute began
    (a token bucket lets unspent quota carry over, up to one minute's worth)."""
    q = book(tpm=tpm)
    assert isinstance(q.try_admit("t", tpm, 0.0), Admitted)  # spend the initial burst
    step = 60.0 / len(sizes)
    for minute in range(3):
        start = minute * 60.0
        held = q.available("t", start)[1]
        assert held is not None
        got = 0
        for k, size in enumerate(sizes):
            if isinstance(q.try_admit("t", size, start + (k + 1) * step), Admitted):
                got += size
        assert got <= held + tpm + 1e-6
        assert got <= 2 * tpm
        # conservation: what is left is what was held plus refill minus what was admitted
        left = q.available("t", start + 60.0)[1]
        assert left is not None
        assert left <= held + tpm - got + 1e-6
