"""Concurrency leases over the real grpc ext_proc servicer: a repeated or late request body message is
ignored (never answered 400, never admitted twice), a lease is released on every way a stream ends
(response end, client abort, gRPC cancel while a Redis admission is in flight, an error), and a lease
that is never released expires after its TTL, in the in-process and the Redis store."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from ext_proc.servicer import ExtProcState
from inferlb.adapters.quota_redis import RedisQuotaStore
from inferlb.config.schema import parse_config
from inferlb.errors import ConfigError
from inferlb.policy.quota import MemoryQuotaStore, lease_ttl_s, limits_from_config
from inferlb.request.usage import ResponseMeter
from tests.conftest import redis_or_skip, wait_until
from tests.integration.test_ext_proc_accounting import (
    Harness,
    chat,
    req_body,
    req_headers,
    resp_body,
    resp_headers,
)
from tests.integration.test_ext_proc_accounting import serving as harness_serving

KEY = "sk-narrow-01"
CONFIG: dict[str, Any] = {
    # ext_proc holds leases to its stream's end
    "ext_proc": {"protocol": "ext_proc", "account_responses": True},
    "models": [{"name": "llama", "default_max_tokens": 100}],
    "tenants": [{"name": "narrow", "api_keys": [KEY], "max_concurrent_requests": 2}],
}
JSON_USAGE = b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}'


class Client(Harness):
    """The accounting tests' harness, and the lease counts of tenant ``narrow``."""

    async def in_flight(self) -> int:
        quotas = self.state.quotas
        if isinstance(quotas, MemoryQuotaStore):
            return quotas.book.in_flight("narrow", self.clock[0])
        assert isinstance(quotas, RedisQuotaStore)
        return await quotas.in_flight("narrow")

    async def settled_to(self, expected: int) -> None:
        """Wait (bounded) until the tenant holds ``expected`` leases."""
        for _ in range(250):
            await self.servicer.drain()
            if await self.in_flight() == expected:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"in flight {await self.in_flight()}, expected {expected}")


@contextlib.asynccontextmanager
async def serving(config: dict[str, Any], quotas: Any = None) -> AsyncIterator[Client]:
    async with harness_serving(config, quotas) as hx:
        yield Client(hx.stub, hx.servicer, hx.state, hx.clock)


async def finish_response(c: Client, call: Any) -> None:
    await c.send(call, resp_headers(200, "application/json"))
    await c.send(call, resp_body(JSON_USAGE, eos=True))


@pytest.mark.parametrize("repeat", ["empty", "same"])
async def test_a_repeated_end_of_stream_body_is_ignored_and_never_admitted_twice(
    repeat: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ext_proc")
    async with serving(CONFIG) as c:
        # every request sends its body message twice; with max_concurrent_requests 2 each is admitted
        # (the duplicate used to take a second lease that nothing released, so every second request
        # was refused; an empty duplicate was answered 400 "the request body is empty")
        for _ in range(6):
            call = c.stub.Process()
            await c.send(call, req_headers(KEY))
            first = await c.send(call, req_body(chat()))
            assert first.HasField("request_body"), first
            again = req_body(b"") if repeat == "empty" else req_body(chat())
            for _ in range(2):
                late = await c.send(call, again)
                assert late.HasField("request_body") and not late.HasField("immediate_response"), late
                assert not late.request_body.response.HasField("header_mutation")
            assert await c.in_flight() == 1
            await finish_response(c, call)
            call.cancel()
            await c.settled_to(0)
    late_logs = [r for r in caplog.records if "ignoring a request body message" in r.getMessage()]
    assert len(late_logs) == 6  # once per stream, though each stream sent two late messages


async def test_leases_are_released_on_every_way_a_stream_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(CONFIG) as c:

        async def admitted() -> Any:
            call = c.stub.Process()
            await c.send(call, req_headers(KEY))
            r = await c.send(call, req_body(chat()))
            assert r.HasField("request_body"), r
            return call

        # normal end: the response body's end_of_stream
        call = await admitted()
        await finish_response(c, call)
        assert await c.in_flight() == 0
        call.cancel()
        # the client went away before the response: Envoy resets the ext_proc stream
        call = await admitted()
        call.cancel()
        await c.settled_to(0)
        # Envoy half-closes the stream (EOF) after the request phases
        call = await admitted()
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), timeout=10) is grpc.aio.EOF
        await c.settled_to(0)
        # an error while metering the response: answered 500, the lease released
        call = await admitted()
        await c.send(call, resp_headers(200, "application/json"))

        def broken(self: ResponseMeter, chunk: bytes, *, end_of_stream: bool) -> bytes:
            raise RuntimeError("meter failed")

        monkeypatch.setattr(ResponseMeter, "on_body", broken)
        r = await c.send(call, resp_body(JSON_USAGE, eos=True))
        assert r.immediate_response.status.code == 500
        await c.settled_to(0)
        call.cancel()


async def open_request(c: Client) -> tuple[Any, ep.ProcessingResponse]:
    """A new stream with the request headers and body of one chat for ``KEY``; the body's answer."""
    call = c.stub.Process()
    await c.send(call, req_headers(KEY))
    return call, await c.send(call, req_body(chat()))


async def hold_two(c: Client) -> list[Any]:
    """Two admitted streams left open and silent (their ends never seen): ``KEY``'s two slots."""
    held = []
    for _ in range(2):
        call, answer = await open_request(c)
        assert answer.HasField("request_body")
        held.append(call)
    return held


async def refused_for_concurrency(c: Client) -> bool:
    """Whether the next request is refused (429) while the slots are held."""
    call, answer = await open_request(c)
    call.cancel()
    return bool(answer.immediate_response.status.code == 429)


async def test_a_lease_never_released_expires_after_its_ttl() -> None:
    cfg = {**CONFIG, "gateway": {"request_timeout_ms": 10_000}}  # lease TTL 10 s + 60 s margin
    async with serving(cfg) as c:
        assert isinstance(c.state.quotas, MemoryQuotaStore)
        assert c.state.quotas.book.lease_ttl_s == 70.0
        held = await hold_two(c)
        # both streams stay open and silent: the third is refused...
        assert await refused_for_concurrency(c)
        c.clock[0] += 69.0
        assert await refused_for_concurrency(c)
        # ...until their leases expire
        c.clock[0] += 1.0
        call, answer = await open_request(c)
        assert answer.HasField("request_body")
        assert await c.in_flight() == 1
        for h in (*held, call):
            h.cancel()


def test_lease_ttl_is_configurable_and_outlives_the_route_timeout() -> None:
    # no route timeout by default (streams are bounded per try and between chunks, not in length)
    assert lease_ttl_s(parse_config(CONFIG)) == 3600
    timed = {**CONFIG, "gateway": {"request_timeout_ms": 300_000}}
    assert lease_ttl_s(parse_config(timed)) == 300 + 60  # the route timeout + the margin
    assert lease_ttl_s(parse_config({**timed, "ext_proc": {"lease_ttl_ms": 400_000}})) == 400
    with pytest.raises(ConfigError, match="lease_ttl_ms"):
        parse_config({**timed, "ext_proc": {"lease_ttl_ms": 200_000}})  # below the 300 s route timeout
    # without a route timeout the lease must outlive a non-streamed request's tries: 300 s x 3
    with pytest.raises(ConfigError, match="per_try_timeout_ms"):
        parse_config({**CONFIG, "ext_proc": {"lease_ttl_ms": 900_000}})
    state = ExtProcState(parse_config(CONFIG))
    state.apply_config(parse_config({**CONFIG, "ext_proc": {"lease_ttl_ms": 1_000_000}}))
    assert isinstance(state.quotas, MemoryQuotaStore) and state.quotas.book.lease_ttl_s == 1000


# -- the Redis store ------------------------------------------------------------------------------
@pytest.fixture
async def redis_url(tmp_path: Path) -> AsyncIterator[str]:
    with redis_or_skip(tmp_path) as server:
        yield server.url


async def test_a_stream_cancelled_while_redis_admits_does_not_leak_its_lease(redis_url: str) -> None:
    config = parse_config(CONFIG)
    store = RedisQuotaStore.from_url(redis_url, limits_from_config(config), timeout_s=5.0, key_prefix="cut")
    await store.start()
    blocker = aioredis.Redis.from_url(redis_url)
    async with serving(CONFIG, quotas=store) as c:
        call = c.stub.Process()
        await c.send(call, req_headers(KEY))
        # Redis runs one script at a time: a 0.5 s busy script holds our admission's script back...
        busy = asyncio.create_task(
            blocker.eval(
                "local t = redis.call('TIME'); local stop = t[1] * 1e6 + t[2] + 500000 "
                "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] >= stop return 1",
                0,
            )
        )
        await asyncio.sleep(0.1)
        await call.write(req_body(chat()))
        await asyncio.sleep(0.15)
        # ...and Envoy gives up on the stream meanwhile (client gone, message_timeout). Redis still runs
        # the admission once the busy script ends and takes the lease; its answer finds no stream
        call.cancel()
        assert await busy == 1
        await wait_until(lambda: not c.servicer._settling, "the cut admission to be seen through")
        await c.settled_to(0)
        # and the tenant still gets both of its slots
        calls = []
        for _ in range(2):
            call = c.stub.Process()
            await c.send(call, req_headers(KEY))
            assert (await c.send(call, req_body(chat()))).HasField("request_body")
            calls.append(call)
        for h in calls:
            h.cancel()
        await c.settled_to(0)
    await blocker.aclose()
    await store.aclose()


async def test_a_redis_lease_never_released_expires_after_its_ttl(redis_url: str) -> None:
    wall = [1_000_000.0]
    config = parse_config(CONFIG)
    store = RedisQuotaStore.from_url(
        redis_url, limits_from_config(config), timeout_s=2.0, lease_ttl_s=70.0, wall_clock=lambda: wall[0]
    )
    async with serving(CONFIG, quotas=store) as c:
        held = await hold_two(c)
        assert await refused_for_concurrency(c)
        wall[0] += 70.0
        call, answer = await open_request(c)
        assert answer.HasField("request_body")
        for h in (*held, call):
            h.cancel()
    await store.aclose()
