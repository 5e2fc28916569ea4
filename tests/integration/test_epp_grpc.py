"""The EPP's gRPC server in-process against a real model-server ``/metrics`` (aiohttp on a free loopback
port): readiness follows the first scrape, a stream's pick counts in flight until the stream ends however
it ends (response end or a gRPC cancel), and a failed scrape is counted and ages the endpoint out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from epp.metrics import EppMetrics
from epp.picking import EndpointPicker
from epp.pool import Pool, PoolEndpoint, Scraper
from epp.server import Health, add_to_server, make_server
from tests.conftest import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Running:
    channel: grpc.aio.Channel
    pool: Pool
    scraper: Scraper
    checks: Health
    picker: EndpointPicker
    metrics_text: list[str]
    address: str

    async def health(self, service: str) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


async def serve_model_metrics(text: list[str]) -> tuple[web.AppRunner, str]:
    """A model server's ``/metrics`` on a free loopback port, answering ``text[0]`` (500 for ``fail``) as it
    is at each scrape. Returns the runner (``cleanup()`` stops it) and its ``ip:port``."""

    async def metrics(request: web.Request) -> web.Response:
        if text[0] == "fail":
            return web.Response(status=500)
        return web.Response(text=text[0])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    text = ["vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.25\n"]
    runner, address = await serve_model_metrics(text)
    pool = Pool([PoolEndpoint(address=address)], stale_after_s=0.3)
    epp_metrics = EppMetrics(pool.addresses, pool.in_flight)
    picker = EndpointPicker(pool, epp_metrics)
    scraper = Scraper(pool, interval_s=0.05, on_error=lambda a: epp_metrics.scrape_errors.labels(a).inc())
    server = make_server()
    _, checks = add_to_server(server, picker, max_body_bytes=1 << 20, reset_wait_s=0.2)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await checks.alive()
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        yield Running(channel, pool, scraper, checks, picker, text, address)
    finally:
        await channel.close()
        await server.stop(0)
        await scraper.stop()
        await runner.cleanup()


def _headers() -> ep.ProcessingRequest:
    hs = [
        base_pb2.HeaderValue(key=k, raw_value=v.encode())
        for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"))
    ]
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def test_readiness_follows_the_first_scrape(running: Running) -> None:
    assert await running.health("liveness") == SERVING
    assert await running.health("readiness") == NOT_SERVING
    assert await running.health("envoy.service.ext_proc.v3.ExternalProcessor") == NOT_SERVING
    await running.scraper.scrape_once()
    assert running.pool.synced
    await running.checks.ready()
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
        assert await running.health(service) == SERVING, service
    assert running.pool.snapshot()[0].kv_usage == 0.25
    await running.checks.shutting_down()
    assert await running.health("readiness") == NOT_SERVING


async def test_a_pick_counts_in_flight_until_the_stream_is_cancelled(running: Running) -> None:
    await running.scraper.scrape_once()
    stub = ep_grpc.ExternalProcessorStub(running.channel)
    call = stub.Process()
    await call.write(_headers())
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=BODY[:5])))
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=BODY[5:], end_of_stream=True)))
    first = await call.read()
    second = await call.read()
    assert first.request_headers.response.header_mutation.set_headers[0].header.raw_value.decode() == (
        running.address
    )
    assert second.request_body.response.body_mutation.streamed_response.body == BODY
    assert running.pool.in_flight() == {running.address: 1}
    call.cancel()  # Envoy resets the stream (client gone)
    await wait_until(lambda: running.pool.in_flight() == {running.address: 0}, "the in-flight count released")
    text = generate_latest(running.picker.metrics.registry).decode()
    assert f'inferlb_epp_served_total{{endpoint="{running.address}",match="unreported"}} 1.0' in text


async def test_the_response_end_releases_the_count_before_the_reset(running: Running) -> None:
    await running.scraper.scrape_once()
    stub = ep_grpc.ExternalProcessorStub(running.channel)
    call = stub.Process()
    await call.write(_headers())
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=BODY, end_of_stream=True)))
    await call.read()
    await call.read()
    await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
    await call.read()
    await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
    last = await call.read()
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    # counted out as the last answer went, while the stream still waits for Envoy's reset
    assert running.pool.in_flight() == {running.address: 0}
    call.cancel()


async def test_a_failed_scrape_is_counted_and_ages_the_endpoint_out(running: Running) -> None:
    await running.scraper.scrape_once()
    assert running.pool.snapshot()[0].healthy
    running.metrics_text[0] = "fail"
    running.scraper.start()
    await wait_until(lambda: not running.pool.snapshot()[0].healthy, "the endpoint turning unhealthy")
    text = generate_latest(running.picker.metrics.registry).decode()
    assert f'inferlb_epp_scrape_errors_total{{endpoint="{running.address}"}}' in text
    stub = ep_grpc.ExternalProcessorStub(running.channel)
    call = stub.Process()
    await call.write(_headers())
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=BODY, end_of_stream=True)))
    reply = await asyncio.wait_for(call.read(), 5)
    assert reply.immediate_response.status.code == 503
    call.cancel()
