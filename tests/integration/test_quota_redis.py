"""RedisQuotaStore against a real redis-server on a free loopback port: the same decisions, retry-after and
sub-windows as the in-process QuotaBook on any sequence (run side by side), exact retry-after, bounded and
expiring window keys, exactly-once leases, and concurrent bursts from two replicas (two stores, two
connection pools) sharing one Redis that admit exactly what fits; fail-open and fail-closed when Redis is
down."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc import handlers
from ext_proc.metrics import ExtProcMetrics
from ext_proc.stores import make_quota_store
from inferlb.adapters.quota_redis import _ADMIT_LUA, _SETTLE_LUA, WINDOW_TTL_S, RedisQuotaStore
from inferlb.config.schema import Config, parse_config
from inferlb.policy.quota import (
    SECONDS_PER_DAY,
    SUB_WINDOWS,
    Admitted,
    Limit,
    QuotaBook,
    Refused,
    TenantLimits,
)
from tests.conftest import redis_or_skip

WALL = 20_000 * SECONDS_PER_DAY + 3600.25  # a fixed wall clock: nothing leaves the window during a test
_ADMIT_SHA, _SETTLE_SHA = (hashlib.sha1(lua.encode()).hexdigest() for lua in (_ADMIT_LUA, _SETTLE_LUA))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_or_skip(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
async def prefix(redis_url: str) -> str:
    # one key namespace per test: tests share the server but never each other's state
    return f"t{time.monotonic_ns()}"


async def make_store(
    url: str, prefix: str, limits: dict[str, TenantLimits], wall: float = WALL, **kw: object
) -> RedisQuotaStore:
    return RedisQuotaStore.from_url(
        url, limits, timeout_s=2.0, key_prefix=prefix, wall_clock=lambda: wall, **kw
    )


@pytest.fixture
async def replicas(redis_url: str, prefix: str) -> AsyncIterator[list[RedisQuotaStore]]:
    limits = {
        "t": TenantLimits(tokens_per_minute=10_000, max_concurrent_requests=25, daily_token_budget=50_000),
        "rate": TenantLimits(requests_per_minute=30, tokens_per_minute=5_000),
        "tokens": TenantLimits(tokens_per_minute=10_000),
    }
    stores = [await make_store(redis_url, prefix, limits) for _ in range(2)]
    yield stores
    for s in stores:
        await s.aclose()


async def test_two_replicas_concurrent_burst_never_over_admit(replicas: list[RedisQuotaStore]) -> None:
    a, b = replicas
    # 200 requests of 300 tokens, alternating replicas, all at once: 10_000 / 300 = 33 fit the window,
    # but only 25 may be in flight
    results = await asyncio.gather(*((a if i % 2 else b).admit("t", 300) for i in range(200)))
    admitted = [r for r in results if isinstance(r, Admitted)]
    assert len(admitted) == 25
    assert {r.limit for r in results if isinstance(r, Refused)} == {Limit.MAX_CONCURRENT_REQUESTS}
    assert await a.in_flight("t") == 25
    # settle them on the other replica, twice each: each lease is released exactly once
    first = await asyncio.gather(*(b.settle(x, 300) for x in admitted))
    second = await asyncio.gather(*(a.settle(x, 300) for x in admitted))
    assert all(first) and not any(second)
    assert await b.in_flight("t") == 0
    # now the tokens window binds: 10_000 - 25 * 300 = 2_500 left, 8 more fit
    results = await asyncio.gather(*((a if i % 2 else b).admit("t", 300) for i in range(100)))
    assert sum(isinstance(r, Admitted) for r in results) == 8
    assert {r.limit for r in results if isinstance(r, Refused)} == {Limit.TOKENS_PER_MINUTE}


async def test_token_burst_of_200_over_two_replicas_admits_exactly_what_fits(
    replicas: list[RedisQuotaStore],
) -> None:
    a, b = replicas
    results = await asyncio.gather(*((a if i % 2 else b).admit("tokens", 300) for i in range(200)))
    assert sum(isinstance(r, Admitted) for r in results) == 10_000 // 300
    refused = [r for r in results if isinstance(r, Refused)]
    # everything was counted in second floor(WALL): it fits again when that second leaves the window
    assert {(r.limit, r.retry_after_s) for r in refused} == {(Limit.TOKENS_PER_MINUTE, SUB_WINDOWS - 0.25)}


async def test_request_rate_burst_across_replicas(replicas: list[RedisQuotaStore]) -> None:
    a, b = replicas
    results = await asyncio.gather(*((a if i % 2 else b).admit("rate", 10) for i in range(100)))
    assert sum(isinstance(r, Admitted) for r in results) == 30
    refused = [r for r in results if isinstance(r, Refused)]
    assert {(r.limit, r.retry_after_s) for r in refused} == {(Limit.REQUESTS_PER_MINUTE, SUB_WINDOWS - 0.25)}


async def test_retry_after_is_exact(redis_url: str, prefix: str) -> None:
    limits = {"t": TenantLimits(tokens_per_minute=1_000)}
    clock = [WALL]
    store = RedisQuotaStore.from_url(
        redis_url, limits, timeout_s=2.0, key_prefix=prefix, wall_clock=lambda: clock[0]
    )
    try:
        for dt, tokens in ((0.0, 400), (7.6, 300), (20.1, 200)):
            clock[0] = WALL + dt
            assert isinstance(await store.admit("t", tokens), Admitted)
        clock[0] = WALL + 33.3
        r = await store.admit("t", 600)  # 900 counted: the 400 of second 0 and the 300 of second 7 must go
        assert isinstance(r, Refused) and r.retry_after_s is not None
        at = WALL + 33.3 + r.retry_after_s
        assert at == int(WALL) + 7 + SUB_WINDOWS
        clock[0] = at - 1e-3
        assert isinstance(await store.admit("t", 600), Refused)
        clock[0] = at
        assert isinstance(await store.admit("t", 600), Admitted)
    finally:
        await store.aclose()


async def test_window_keys_keep_at_most_61_sub_windows_and_expire(redis_url: str, prefix: str) -> None:
    limits = {"t": TenantLimits(requests_per_minute=10_000, tokens_per_minute=10**7)}
    clock = [WALL]
    store = RedisQuotaStore.from_url(
        redis_url, limits, timeout_s=2.0, key_prefix=prefix, wall_clock=lambda: clock[0]
    )
    try:
        _, _, rpm_key, tpm_key = store._keys("t")
        for i in range(150):
            clock[0] = WALL + i * 0.9
            a = await store.admit("t", 5)
            assert isinstance(a, Admitted)
            await store.settle(a, 3)
            for key in (rpm_key, tpm_key):
                assert await store.client.hlen(key) <= SUB_WINDOWS
        ttl_ms = await store.client.pttl(tpm_key)
        assert 0 < ttl_ms <= WINDOW_TTL_S * 1000
        fields = {int(k): int(v) for k, v in (await store.client.hgetall(tpm_key)).items()}
        assert set(fields.values()) == {3} or set(fields.values()) == {3, 6}  # settled usage, not 5
    finally:
        await store.aclose()


async def test_same_decisions_as_the_in_process_book(redis_url: str, prefix: str) -> None:
    limits = {"t": TenantLimits(requests_per_minute=20, tokens_per_minute=1_000, daily_token_budget=1_500)}
    steps = [(0.0, 400, 400), (0.0, 400, 100), (0.0, 400, None), (1.0, 300, 250), (6.0, 300, None)]
    steps += [(30.0, 500, 500), (60.0, 200, None), (61.0, 900, None), (200.0, 1000, None)]
    await _side_by_side(
        redis_url,
        prefix,
        limits,
        [ev for dt, tokens, used in steps for ev in _admit_then_settle(dt, tokens, used)],
    )


def _admit_then_settle(dt: float, tokens: int, used: int | None) -> list[tuple[float, bool, int, float]]:
    events = [(dt, False, tokens, 0.0)]
    if used is not None:
        events.append((0.0, True, 0, used / tokens))
    return events


async def _side_by_side(
    redis_url: str, prefix: str, limits: dict[str, TenantLimits], events: list[tuple[float, bool, int, float]]
) -> None:
    """Run the same admissions and settles (absolute offsets from WALL, settling the oldest held request
    with ``share`` of its reservation) on a RedisQuotaStore and a QuotaBook; every decision, sub-window,
    limit, retry-after and message must be the same."""
    clock = [WALL]
    store = RedisQuotaStore.from_url(
        redis_url, limits, timeout_s=2.0, key_prefix=prefix, wall_clock=lambda: clock[0]
    )
    book = QuotaBook(limits, WALL)
    held: list[tuple[Admitted, Admitted]] = []
    try:
        for dt, is_settle, tokens, share in events:
            now = WALL + dt
            clock[0] = now
            if is_settle:
                if held:
                    r_adm, m_adm = held.pop(0)
                    used = int(m_adm.tokens * share)
                    settled_r = await store.settle(r_adm, used)
                    settled_m = book.settle(m_adm, used, now)
                    # (a tenant with no limit at all never touches Redis, which reports nothing settled)
                    assert settled_r == settled_m or limits["t"] == TenantLimits()
                continue
            r = await store.admit("t", tokens)
            m = book.try_admit("t", tokens, now, wall=now)
            assert type(r) is type(m), (dt, tokens, r, m)
            if isinstance(r, Refused) and isinstance(m, Refused):
                assert (r.limit, r.retry_after_s, r.message) == (m.limit, m.retry_after_s, m.message)
            elif isinstance(r, Admitted) and isinstance(m, Admitted):
                assert (r.second, r.day, r.tokens) == (m.second, m.day, m.tokens)
                held.append((r, m))
        # and the windows hold the same sub-windows
        _, _, rpm_key, tpm_key = store._keys("t")
        state = book._tenants["t"]
        for key, window in ((rpm_key, state.requests), (tpm_key, state.tokens)):
            if window is None:
                continue
            window.advance(window.current_second(clock[0]))
            stored = {int(k): int(v) for k, v in (await store.client.hgetall(key)).items()}
            in_window = {k: v for k, v in stored.items() if k >= window.current_second(clock[0]) - 60}
            assert in_window == window.counts
    finally:
        await store.aclose()


@settings(max_examples=40, deadline=None)
@given(
    rpm=st.one_of(st.none(), st.integers(1, 8)),
    tpm=st.one_of(st.none(), st.integers(100, 2000)),
    concurrent=st.one_of(st.none(), st.integers(1, 6)),
    budget=st.one_of(st.none(), st.integers(500, 6000)),
    events=st.lists(
        st.tuples(
            st.one_of(st.sampled_from([0.0, 0.5, 1.0, 59.0, 60.0, 61.0]), st.floats(0.0, 30.0)),
            st.booleans(),
            st.integers(0, 2500),
            st.floats(0.0, 1.5),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_any_sequence_gets_the_same_answers_from_redis_and_the_book(
    redis_url: str,
    rpm: int | None,
    tpm: int | None,
    concurrent: int | None,
    budget: int | None,
    events: list[tuple[float, bool, int, float]],
) -> None:
    limits = {
        "t": TenantLimits(
            requests_per_minute=rpm,
            tokens_per_minute=tpm,
            max_concurrent_requests=concurrent,
            daily_token_budget=budget,
        )
    }
    offsets = []
    t = 0.0
    for gap, is_settle, tokens, share in events:
        t += gap
        offsets.append((t, is_settle, tokens, share))
    asyncio.run(_side_by_side(redis_url, f"h{time.monotonic_ns()}", limits, offsets))


async def test_daily_budget_and_never_fits(redis_url: str, prefix: str) -> None:
    store = await make_store(redis_url, prefix, {"t": TenantLimits(daily_token_budget=1_000)})
    try:
        r = await store.admit("t", 1_001)
        assert isinstance(r, Refused) and r.never_fits and r.limit is Limit.DAILY_TOKEN_BUDGET
        a = await store.admit("t", 800)
        assert isinstance(a, Admitted)
        r = await store.admit("t", 300)
        assert isinstance(r, Refused) and r.retry_after_s == pytest.approx(SECONDS_PER_DAY - 3600.25)
        assert await store.settle(a, 500)
        assert isinstance(await store.admit("t", 300), Admitted)
        # the next UTC day starts from zero
        tomorrow = await make_store(
            redis_url, prefix, {"t": TenantLimits(daily_token_budget=1_000)}, WALL + SECONDS_PER_DAY
        )
        assert isinstance(await tomorrow.admit("t", 1_000), Admitted)
        await tomorrow.aclose()
    finally:
        await store.aclose()


async def test_expired_lease_of_a_dead_replica_frees_its_slot(redis_url: str, prefix: str) -> None:
    limits = {"t": TenantLimits(max_concurrent_requests=1)}
    dead = await make_store(redis_url, prefix, limits, lease_ttl_s=10.0)
    later = await make_store(redis_url, prefix, limits, WALL + 11.0)
    try:
        assert isinstance(await dead.admit("t", 1), Admitted)
        assert isinstance(await dead.admit("t", 1), Refused)
        assert isinstance(await later.admit("t", 1), Admitted)
    finally:
        await dead.aclose()
        await later.aclose()


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_unreachable_redis_fails_as_configured_and_counts(mode: str) -> None:
    metrics = ExtProcMetrics()
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    store = RedisQuotaStore(
        aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5),
        {"t": TenantLimits(tokens_per_minute=100)},
        failure_mode=mode,  # type: ignore[arg-type]
        wall_clock=lambda: WALL,
        on_error=metrics.quota_backend_error,
    )
    try:
        d = await store.admit("t", 10)
        if mode == "open":
            assert isinstance(d, Admitted) and d.degraded
            assert await store.settle(d, 10) is False
        else:
            assert isinstance(d, Refused) and d.limit is Limit.QUOTA_BACKEND_UNAVAILABLE
            reply = handlers.quota_refusal(d)
            assert reply.status == 503 and ("retry-after", "1") in reply.headers
        errors = metrics.registry.get_sample_value(
            "inferlb_quota_backend_errors_total", {"backend": "redis", "operation": "admit"}
        )
        assert errors == 1
        # an unlimited tenant never needs Redis
        assert isinstance(await store.admit("free", 10**6), Admitted)
    finally:
        await store.aclose()


# -- the gateway's own connection pool is not Redis failing -------------------------------------------
def burst_config(redis_url: str, prefix: str, mode: str) -> Config:
    """One tenant at 50 requests/min on the shared store, every other Redis setting at its default
    (``redis_timeout_ms`` 100, ``redis_connect_timeout_ms`` 1000, ``redis_pool_size`` 16)."""
    return parse_config(
        {
            "models": [{"name": "llama"}],
            "tenants": [{"name": "burst", "api_keys": ["sk-burst-001"], "requests_per_minute": 50}],
            "ext_proc": {
                "quota_backend": "redis",
                "redis_url": redis_url,
                "redis_key_prefix": prefix,
                "redis_failure_mode": mode,
            },
        }
    )


@pytest.mark.parametrize("warm", [False, True], ids=["cold-pool", "warmed-up"])
@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_a_burst_of_300_over_two_replicas_admits_exactly_the_quota(
    redis_url: str, prefix: str, mode: str, warm: bool
) -> None:
    # two replicas' stores as ext_proc builds them; 300 admissions at once, half on each. Cold, the old
    # pool opened a connection per admission: past 100 per process redis-py failed "Too many
    # connections" at once, and connections slower than the 100 ms call timeout failed "Timeout
    # connecting to server"; each failure was admitted unchecked (open) or answered 503 (closed)
    config = burst_config(redis_url, prefix, mode)
    metrics = [ExtProcMetrics(), ExtProcMetrics()]
    stores = [make_quota_store(config, m) for m in metrics]
    try:
        for store in stores:
            assert isinstance(store, RedisQuotaStore)
            kwargs = store.client.connection_pool.connection_kwargs
            assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.1, 1.0)
            if warm:
                await store.start()
        deadline = time.monotonic() + 4.5  # the servicer's budget at the default message_timeout
        results = await asyncio.gather(
            *(stores[i % 2].admit("burst", 20, deadline=deadline) for i in range(300))
        )
    finally:
        for store in stores:
            await store.aclose()
    admitted = [r for r in results if isinstance(r, Admitted)]
    assert len(admitted) == 50 and not any(r.degraded for r in admitted)
    assert {r.limit for r in results if isinstance(r, Refused)} == {Limit.REQUESTS_PER_MINUTE}
    for m in metrics:
        assert m.registry.get_sample_value(
            "inferlb_quota_backend_errors_total", {"backend": "redis", "operation": "admit"}
        ) in (None, 0.0)


async def test_start_opens_the_whole_pool_and_loads_the_scripts(redis_url: str, prefix: str) -> None:
    probe = aioredis.Redis.from_url(redis_url)
    store = make_quota_store(burst_config(redis_url, prefix, "open"), ExtProcMetrics())
    try:
        before = int((await probe.info("clients"))["connected_clients"])
        await store.start()
        assert int((await probe.info("clients"))["connected_clients"]) == before + 16
        assert await probe.script_exists(_ADMIT_SHA, _SETTLE_SHA) == [True, True]
    finally:
        await store.aclose()
        await probe.aclose()


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_no_free_connection_within_the_budget_is_503_busy_not_a_redis_failure(
    redis_url: str, prefix: str, mode: str
) -> None:
    metrics = ExtProcMetrics()
    store = RedisQuotaStore.from_url(
        redis_url,
        {"t": TenantLimits(requests_per_minute=100)},
        timeout_s=2.0,
        pool_size=1,
        key_prefix=prefix,
        failure_mode=mode,  # type: ignore[arg-type]
        on_error=metrics.quota_backend_error,
    )
    await store.start()

    async def hold_the_only_connection() -> None:
        async with store._connection(None):
            await store.client.blpop([f"{prefix}:nothing"], timeout=0.6)

    holder = asyncio.create_task(hold_the_only_connection())
    try:
        await asyncio.sleep(0.05)
        started = time.monotonic()
        r = await store.admit("t", 1, deadline=started + 0.1)
        waited = time.monotonic() - started
        assert isinstance(r, Refused) and r.limit is Limit.QUOTA_BACKEND_BUSY, r
        assert 0.09 <= waited < 0.5
        reply = handlers.quota_refusal(r)
        assert reply.status == 503 and ("retry-after", "1") in reply.headers
        assert json.loads(reply.body)["error"]["code"] == "quota_backend_busy"
        # a wait that fits the budget is just a wait: admitted, checked
        r = await store.admit("t", 1, deadline=time.monotonic() + 5.0)
        assert isinstance(r, Admitted) and not r.degraded
        assert holder.done()
        # the wait was the gateway's, not Redis failing: nothing counted as a backend error
        assert metrics.registry.get_sample_value(
            "inferlb_quota_backend_errors_total", {"backend": "redis", "operation": "admit"}
        ) is None
    finally:
        await holder
        await store.aclose()


# -- persistence: the quota state survives a Redis restart -------------------------------------------
@pytest.mark.parametrize("appendfsync", ["everysec", "always"])
async def test_quota_state_survives_a_redis_restart_with_the_append_only_file(
    tmp_path: Path, appendfsync: str
) -> None:
    server = redis_or_skip(tmp_path, appendonly=True, appendfsync=appendfsync).start()
    metrics = ExtProcMetrics()
    store = RedisQuotaStore.from_url(
        server.url,
        {"t": TenantLimits(requests_per_minute=5)},
        timeout_s=2.0,
        failure_mode="open",
        on_error=metrics.quota_backend_error,
    )
    try:
        await store.start()
        for _ in range(5):
            assert isinstance(await store.admit("t", 1), Admitted)
        assert isinstance(await store.admit("t", 1), Refused)
        await asyncio.to_thread(server.restart)  # SIGTERM, then the same port and directory
        # the same minute: the five admissions came back from the AOF; the pooled connections that
        # the restart broke are reopened, not reported as Redis failing (which would admit unchecked)
        r = await store.admit("t", 1)
        assert isinstance(r, Refused) and r.limit is Limit.REQUESTS_PER_MINUTE, r
        limits = {"t": TenantLimits(requests_per_minute=5)}
        fresh = RedisQuotaStore.from_url(server.url, limits, timeout_s=2.0)
        assert isinstance(await fresh.admit("t", 1), Refused)
        await fresh.aclose()
        assert metrics.registry.get_sample_value(
            "inferlb_quota_backend_errors_total", {"backend": "redis", "operation": "admit"}
        ) is None
    finally:
        await store.aclose()
        server.stop()


async def test_without_the_append_only_file_a_restart_forgets_the_quota(tmp_path: Path) -> None:
    # why production needs appendonly: the same restart on a Redis without persistence
    server = redis_or_skip(tmp_path, appendonly=False).start()
    store = RedisQuotaStore.from_url(server.url, {"t": TenantLimits(requests_per_minute=5)}, timeout_s=2.0)
    try:
        for _ in range(5):
            assert isinstance(await store.admit("t", 1), Admitted)
        await asyncio.to_thread(server.restart)
        r = await store.admit("t", 1)
        assert isinstance(r, Admitted) and not r.degraded  # a fresh minute: the quota was lost
    finally:
        await store.aclose()
        server.stop()


# -- two `python -m ext_proc` replicas sharing one Redis ------------------------------------------
async def _wait_ready(proc: asyncio.subprocess.Process) -> None:
    assert proc.stderr is not None
    lines = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), timeout=30)).decode()
        lines.append(line)
        if not line:
            raise AssertionError("ext_proc exited:\n" + "".join(lines))
        if "ext_proc ready on" in line:
            return


async def test_two_ext_proc_processes_sharing_redis_never_over_admit(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    ports = [free_port() for _ in range(4)]
    cfg = {
        "models": [{"name": "llama", "default_max_tokens": 100}],
        "tenants": [
            {"name": "conc", "api_keys": ["sk-conc-0001"], "max_concurrent_requests": 5},
            {"name": "daily", "api_keys": ["sk-daily-001"], "daily_token_budget": 1000},
        ],
    }
    procs = []
    for i in range(2):
        doc = {
            **cfg,
            "ext_proc": {
                "protocol": "ext_proc",  # ext_authz mode meters in one process
                "listen": f"127.0.0.1:{ports[2 * i]}",
                "metrics_listen": f"127.0.0.1:{ports[2 * i + 1]}",
                "account_responses": True,
                "quota_backend": "redis",
                "redis_url": redis_url,
                "redis_key_prefix": prefix,
                "redis_failure_mode": "closed",
            },
        }
        path = tmp_path / f"replica{i}.yaml"
        path.write_text(yaml.safe_dump(doc))
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "ext_proc",
                "--config",
                str(path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        )
    channels = []
    try:
        for p in procs:
            await _wait_ready(p)
        channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}"),
            grpc.aio.insecure_channel(f"127.0.0.1:{ports[2]}"),
        ]
        stubs = [ep_grpc.ExternalProcessorStub(c) for c in channels]
        body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "hello"}]}).encode()

        async def one(i: int, key: str) -> tuple[Any, ep.ProcessingResponse]:
            call = stubs[i % 2].Process()
            pairs = {":method": "POST", ":path": "/v1/chat/completions", "authorization": f"Bearer {key}"}
            hm = base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            )
            await call.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm)))
            await asyncio.wait_for(call.read(), timeout=10)
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
            return call, await asyncio.wait_for(call.read(), timeout=10)

        for key, fixed in (("sk-conc-0001", 5), ("sk-daily-001", None)):
            results = await asyncio.gather(*(one(i, key) for i in range(40)))
            ok = [r for _, r in results if r.HasField("request_body")]
            refused = [r for _, r in results if r.HasField("immediate_response")]
            assert all(r.immediate_response.status.code == 429 for r in refused)
            expect = fixed
            if expect is None:
                # every admitted request reserves prompt + 100 output tokens of the 1000-token day
                hdrs = {
                    o.header.key: o.header.raw_value.decode()
                    for o in ok[0].request_body.response.header_mutation.set_headers
                }
                expect = 1000 // (int(hdrs["x-inferlb-prompt-tokens"]) + 100)
            assert len(ok) == expect
            for call, _ in results:
                call.cancel()
    finally:
        for c in channels:
            await c.close()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert await asyncio.wait_for(p.wait(), timeout=20) == 0
