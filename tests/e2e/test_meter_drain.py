"""ext_authz mode's metering through a real Envoy when Envoy stops: Envoy does not flush its gRPC access-log
buffer when it exits, so the stack drains it first (:meth:`inferlb.ops.stack.Stack.drain_envoy`: listeners
drained, requests in flight ended, one flush interval waited). After a burst and that drain, every
request's entry has reached the settler before Envoy gets SIGTERM: none is lost, none waits for the TTL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, chat_body, in_mode, started_stack
from tests.e2e.test_extproc_accounting import settlements

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
BURST = 60


@pytest.fixture
def metered_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """The default fleet in ext_authz mode with response accounting (the default)."""
    doc = in_mode(make_config_doc(), "ext_authz")
    with started_stack(tmp_path_factory.mktemp("drain"), doc) as rs:
        assert rs.config.ext_proc.meters_access_log()
        yield rs


async def burst(gateway: str, n: int) -> list[int]:
    """``n`` concurrent small chat requests (half streamed with usage asked for); their statuses."""

    async def one(http: aiohttp.ClientSession, i: int) -> int:
        body = chat_body(QWEN, max_tokens=4, stream=i % 2 == 1)
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        async with http.post(
            f"http://{gateway}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-demo-a"}
        ) as resp:
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        return await asyncio.gather(*(one(http, i) for i in range(n)))


def test_a_drained_envoy_stop_loses_no_settlement(metered_stack: RunningStack) -> None:
    rs = metered_stack
    before = sum(settlements(rs.config).values())
    statuses = asyncio.run(burst(rs.gateway, BURST))
    assert statuses == [200] * BURST
    assert rs.stack.drain_envoy()
    rs.stack.child("envoy").stop()  # SIGTERM, as the stack's own stop does after the drain
    got = settlements(rs.config)
    assert sum(got.values()) - before == BURST
    assert got.get("expired", 0) == 0 and got.get("unmetered", 0) == 0  # every one at its usage
