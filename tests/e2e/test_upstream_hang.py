"""A hung model server (accepts the connection, reads the request, never answers; ``/health`` hangs too)
among healthy ones, under load, through the real Envoy: no client error for non-streamed requests, no
request held past the per-try bounds, the host out of balancing after a few seconds.

What does it (xds_server/resources): the active health check times out on ``/health`` and takes the host
out (no new requests); the requests already on it are reset by the per-try timeout (non-streamed: until
the response headers) or the per-try idle timeout (streamed: silence before the first byte and between
chunks) and retried on another GPU while nothing of the response reached the client. A stream that the
server stops mid-way cannot be retried (Envoy never retries once the response started): it is cut after
the idle timeout instead of being held.

Timeouts here are short (a few seconds) so the test runs fast; the defaults are in the README.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.conftest import make_config_doc, wait_until
from tests.e2e.conftest import (
    RunningStack,
    chat_body,
    closed_loop,
    failed_hosts,
    in_mode,
    sim_fault,
    started_stack,
)

pytestmark = pytest.mark.e2e

QWEN_CLUSTER = "qwen2.5-7b-instruct--v1"
HUNG = "v100-1"  # one of qwen's three GPUs
PER_TRY_S = 3.0
STREAM_IDLE_S = 2.0
#: Scheduling noise on two shared cores, plus one retry's own time.
MARGIN_S = 2.5


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(make_config_doc(), request_path)
    doc["gateway"].update(
        per_try_timeout_ms=int(PER_TRY_S * 1000), stream_idle_timeout_ms=int(STREAM_IDLE_S * 1000)
    )
    with started_stack(tmp_path_factory.mktemp("hang"), doc) as rs:
        yield rs


def _address(rs: RunningStack, name: str) -> str:
    return str(next(e.address for e in rs.config.endpoints if e.display_name == name))


async def _recover(rs: RunningStack) -> None:
    sim_fault(rs.config, HUNG, "recover")
    hung = _address(rs, HUNG)
    await wait_until(lambda: hung not in failed_hosts(rs.config, QWEN_CLUSTER), "the GPU back", 15, 0.2)


async def test_a_hung_gpu_under_load_costs_no_error_and_holds_no_request_past_the_per_try_timeout(
    stack: RunningStack,
) -> None:
    hung = _address(stack, HUNG)
    assert not failed_hosts(stack.config, QWEN_CLUSTER)

    async def hang_later() -> float:
        await asyncio.sleep(1.0)
        assert sim_fault(stack.config, HUNG, "hang")["mode"] == "hung"
        at = time.monotonic()
        # the health check (1 s timeout, 2 failures) takes it out within a few seconds
        await wait_until(lambda: hung in failed_hosts(stack.config, QWEN_CLUSTER), "ejection", 8, 0.1)
        return time.monotonic() - at

    try:
        load = asyncio.create_task(
            closed_loop(stack.gateway, chat_body("qwen"), clients=16, duration_s=9.0, client_timeout_s=20)
        )
        out_after_s = await hang_later()
        outcomes = await load
    finally:
        await _recover(stack)
    statuses = Counter(o.status for o in outcomes)
    assert statuses == {200: len(outcomes)}, statuses
    slowest = max(o.seconds for o in outcomes)
    # the requests caught on the hung GPU waited one per-try timeout, then went elsewhere
    assert slowest <= PER_TRY_S + MARGIN_S, slowest
    assert slowest >= PER_TRY_S * 0.9, "no request was caught on the hung GPU: the test proves nothing"
    assert out_after_s <= 5.0, out_after_s
    # and the clients kept being served: the hung GPU did not capture them for the per-try timeout
    late = [o for o in outcomes if o.started > outcomes[0].started + 6.0]
    assert len(late) > 50 and all(o.endpoint != HUNG for o in late)


async def test_streams_are_retried_before_their_first_byte_and_cut_after_it(stack: RunningStack) -> None:
    hung = _address(stack, HUNG)
    # 1500 tokens at 5,000 tokens/s x capacity 1: a V100 stream lasts ~0.3 s, so the hang catches some
    body = chat_body("qwen", max_tokens=1500, stream=True)
    try:
        load = asyncio.create_task(
            closed_loop(stack.gateway, body, clients=16, duration_s=8.0, client_timeout_s=20)
        )
        await asyncio.sleep(1.0)
        sim_fault(stack.config, HUNG, "hang")
        hung_at = time.monotonic()
        await wait_until(lambda: hung in failed_hosts(stack.config, QWEN_CLUSTER), "ejection", 8, 0.1)
        out_at = time.monotonic()
        outcomes = await load
    finally:
        await _recover(stack)
    # nothing is held past the idle timeout: a stream stopped mid-way is cut (the client sees it end
    # without [DONE]; Envoy cannot retry once the response started) at most the idle timeout after the
    # hang; one that had no byte yet waits at most one per-try timeout more than a healthy stream of the
    # same run (the streams sent after the ejection: their own length varies with the shared machine's
    # load) and is retried; the others are served
    failed = [o for o in outcomes if not o.ok]
    assert all(o.endpoint == HUNG and o.status != 200 for o in failed), failed
    cut_late = [o for o in failed if o.started + o.seconds > hung_at + STREAM_IDLE_S + MARGIN_S]
    assert not cut_late, cut_late
    healthy = max((o.seconds for o in outcomes if o.started > out_at), default=0.0)
    slowest = max(o.seconds for o in outcomes)
    assert slowest <= healthy + PER_TRY_S + MARGIN_S, (slowest, healthy)
    # only streams that had started on the hung GPU before the hang fail; every stream sent after the
    # health check took it out is served whole
    assert all(o.started < hung_at for o in failed), failed
    after = [o for o in outcomes if o.started > out_at]
    assert len(after) > 20 and all(o.ok for o in after), Counter(o.status for o in after)
    # streams sent between the hang and the ejection that landed on the hung GPU got no byte: retried
    between = [o for o in outcomes if hung_at < o.started < out_at]
    assert between and all(o.ok for o in between), Counter(o.status for o in between)
