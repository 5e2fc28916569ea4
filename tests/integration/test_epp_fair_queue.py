"""The EPP's fair queue in-process: real grpc aio ext_proc streams against the servicer, the pool scraped
from a real model-server ``/metrics`` (aiohttp on a free loopback port). Two fairness ids of one band, both
backlogged, get within 10% of equal admitted tokens however unequal their requests; a stream cancelled while
it waits leaves the queue; a wait past ``max_wait`` is a 429 with ``retry-after``; a scrape showing room
admits a waiter."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from prometheus_client import generate_latest

from epp.flow import QueueSettings, request_cost
from epp.metrics import EppMetrics
from epp.picking import EndpointPicker
from epp.pool import Pool, PoolEndpoint, Saturation, Scraper
from epp.server import add_to_server, make_server
from inferlb.request.parsing import EndpointKind, parse_request
from tests.conftest import wait_until
from tests.integration.test_epp_grpc import serve_model_metrics


@dataclass
class Running:
    stub: ep_grpc.ExternalProcessorStub
    pool: Pool
    scraper: Scraper
    picker: EndpointPicker
    metrics_text: list[str]
    address: str

    def sample(self, name: str) -> float:
        for line in generate_latest(self.picker.metrics.registry).decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rpartition(" ")[2])
        return 0.0


Start = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """Starts the model server's /metrics and the EPP (one endpoint, a fair queue); ``depth`` is
    ``--queue-depth``, so ``depth`` requests in flight since the last scrape saturate the endpoint."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def _start(*, depth: float, max_wait_s: float, waiting: float = 0.0) -> Running:
        text = [f"vllm:num_requests_waiting {waiting}\nvllm:kv_cache_usage_perc 0.1\n"]
        runner, address = await serve_model_metrics(text)
        pool = Pool([PoolEndpoint(address=address)], stale_after_s=60)
        epp_metrics = EppMetrics(pool.addresses, pool.in_flight)
        picker = EndpointPicker(
            pool,
            epp_metrics,
            saturation=Saturation(queue_depth=depth),
            queue=QueueSettings(max_queued=64, max_wait_s=max_wait_s),
        )
        scraper = Scraper(pool, interval_s=0.05, on_round=picker.dispatch)
        server = make_server()
        add_to_server(server, picker, max_body_bytes=1 << 20, reset_wait_s=0.05)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

        async def stop() -> None:
            await channel.close()
            await server.stop(0)
            await scraper.stop()
            await runner.cleanup()

        cleanups.append(stop)
        await scraper.scrape_once()
        return Running(ep_grpc.ExternalProcessorStub(channel), pool, scraper, picker, text, address)

    yield _start
    for stop in reversed(cleanups):
        await stop()


def chat(max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    ).encode()


def headers_msg(**extra: str) -> ep.ProcessingRequest:
    pairs = [(":path", "/v1/chat/completions"), (":method", "POST"), *extra.items()]
    hs = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))


async def send_request(running: Running, body: bytes, **extra: str) -> grpc.aio.StreamStreamCall:
    call = running.stub.Process()
    await call.write(headers_msg(**extra))
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    return call


async def respond(call: grpc.aio.StreamStreamCall) -> None:
    """Play the gateway after the pick: the body answer, then the whole response; the stream ends."""
    await call.read()  # the streamed body back
    await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
    await call.read()
    await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
    await call.read()
    call.cancel()  # Envoy resets the stream


async def test_a_heavy_and_a_light_tenant_get_equal_token_throughput_when_both_are_backlogged(
    start: Start,
) -> None:
    running = await start(depth=2, max_wait_s=60)
    sizes = {"heavy": 1200, "light": 150}
    costs = {
        t: request_cost(parse_request(EndpointKind.CHAT_COMPLETIONS, chat(n)), default_max_tokens=256)
        for t, n in sizes.items()
    }
    admitted = dict.fromkeys(sizes, 0)
    target = 40_000  # tokens admitted over both; SFQ's bound is one request of each
    deadline = time.monotonic() + 60
    streams = 12
    flow = running.picker.flow
    assert flow is not None
    backlogged = asyncio.Event()

    async def client(tenant: str) -> None:
        while sum(admitted.values()) < target:
            assert time.monotonic() < deadline, f"the run took over 60 s ({admitted})"
            call = await send_request(
                running, chat(sizes[tenant]), **{"x-gateway-inference-fairness-id": tenant}
            )
            first = await asyncio.wait_for(call.read(), 30)
            assert first.WhichOneof("response") == "request_headers", first
            if backlogged.is_set() and sum(admitted.values()) < target:
                # counted while both are backlogged: not the drain after the target, when the streams
                # stop sending and one tenant's last waiters are admitted alone
                admitted[tenant] += costs[tenant]
            await backlogged.wait()
            await respond(call)

    # twelve streams per tenant, two admitted at a time: while some of a tenant's streams are served or
    # on their way back into the queue, the others wait (both stay backlogged). Counting starts once every
    # stream has sent its first request (the two admitted first hold their slots until then, uncounted):
    # SFQ credits no tenant for the time before it had requests waiting.
    clients = [asyncio.create_task(client(t)) for t in sizes for _ in range(streams)]
    await wait_until(lambda: len(flow) == 2 * streams - 2, "every stream's first request sent", 20)
    backlogged.set()
    await asyncio.gather(*clients)
    heavy, light = admitted["heavy"], admitted["light"]
    assert abs(heavy - light) <= 0.1 * min(heavy, light), admitted
    await wait_until(lambda: running.pool.in_flight() == {running.address: 0}, "every pick released")
    assert len(running.picker.flow or ()) == 0
    assert running.sample('inferlb_epp_queue_wait_seconds_count{outcome="admitted"}') > 0


async def test_a_stream_cancelled_while_waiting_leaves_the_queue(start: Start) -> None:
    running = await start(depth=1, max_wait_s=60)
    busy = await send_request(running, chat(5))
    assert (await asyncio.wait_for(busy.read(), 5)).WhichOneof("response") == "request_headers"
    waiter = await send_request(running, chat(5))
    flow = running.picker.flow
    assert flow is not None
    await wait_until(lambda: len(flow) == 1, "the second request waiting")
    assert (
        'inferlb_epp_queue_length{priority="0"} 1.0'
        in generate_latest(running.picker.metrics.registry).decode()
    )
    waiter.cancel()
    await wait_until(lambda: len(flow) == 0, "the cancelled waiter leaving the queue")
    assert running.sample('inferlb_epp_queue_wait_seconds_count{outcome="cancelled"}') == 1
    await respond(busy)
    await wait_until(lambda: running.pool.in_flight() == {running.address: 0}, "the pick released")
    # nothing was admitted for the cancelled stream, and the endpoint takes the next request at once
    assert running.sample('inferlb_epp_queue_wait_seconds_count{outcome="admitted"}') == 0
    again = await send_request(running, chat(5))
    assert (await asyncio.wait_for(again.read(), 5)).WhichOneof("response") == "request_headers"
    await respond(again)


async def test_a_wait_past_max_wait_is_a_429_with_retry_after(start: Start) -> None:
    running = await start(depth=1, max_wait_s=0.3)
    busy = await send_request(running, chat(5))
    await asyncio.wait_for(busy.read(), 5)
    waiter = await send_request(running, chat(5))
    reply = (await asyncio.wait_for(waiter.read(), 5)).immediate_response
    assert reply.status.code == 429
    assert json.loads(reply.body)["error"]["code"] == "queue_timeout"
    headers = {h.header.key: h.header.raw_value.decode() for h in reply.headers.set_headers}
    assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"
    assert running.sample("inferlb_epp_queue_expired_total") == 1
    waiter.cancel()
    await respond(busy)


async def test_a_scrape_showing_room_admits_a_waiter(start: Start) -> None:
    running = await start(depth=5, max_wait_s=60, waiting=9)
    waiter = await send_request(running, chat(5))
    flow = running.picker.flow
    assert flow is not None
    await wait_until(lambda: len(flow) == 1, "the request waiting on a saturated pool")
    running.metrics_text[0] = "vllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.1\n"
    running.scraper.start()
    first = await asyncio.wait_for(waiter.read(), 5)
    assert first.WhichOneof("response") == "request_headers"
    assert (
        first.request_headers.response.header_mutation.set_headers[0].header.raw_value.decode()
        == running.address
    )
    await respond(waiter)
