"""The NVML agent over real loopback HTTP: reports POSTed to a receiver, /metrics scraped, failures counted,
a throttling GPU seen in the next report. NVML is the fake at the pynvml boundary (no GPU here)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from inferlb.adapters import nvml as nv
from inferlb.ops import agent as ag
from inferlb.policy.telemetry import REASON_SW_THERMAL, GpuReport, parse_dcgm_metrics, parse_gpu_report
from tests.unit.test_agent import FakeGpu, FakePynvml


class Receiver:
    """A control plane's telemetry endpoint: records each POST /v1/telemetry/gpu, answers ``status``."""

    def __init__(self) -> None:
        self.reports: list[GpuReport] = []
        self.authorizations: list[str | None] = []
        self.status = 204
        self.got = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/json"
        self.reports.append(parse_gpu_report(await request.json()))
        self.authorizations.append(request.headers.get("Authorization"))
        self.got.set()
        return web.Response(status=self.status, text="" if self.status < 300 else "busy")


@contextlib.asynccontextmanager
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    rx = Receiver()
    app = web.Application()
    app.router.add_post(ag.REPORT_PATH, rx.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield rx, f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def counter(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name}{labels} not in metrics")


def make_agent(fake: FakePynvml, url: str | None, **settings: Any) -> ag.Agent:
    count = nv.open_nvml(fake)
    values: dict[str, Any] = {"node": "node-a", "url": url, "metrics_port": 0, "interval_s": 0.05}
    values.update(settings)
    return ag.Agent(fake, count, ag.AgentSettings(**values))


async def test_reports_reach_the_receiver_and_follow_the_gpu() -> None:
    fake = FakePynvml([FakeGpu(), FakeGpu(uuid="GPU-2", util=40)])
    async with receiver() as (rx, url):
        agent = make_agent(fake, url)
        bound = await agent.start_metrics()
        assert bound is not None
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await asyncio.wait_for(rx.got.wait(), 5)
            first = rx.reports[0]
            assert first.node == "node-a"
            assert [g.uuid for g in first.gpus] == ["GPU-11111111-2222-3333-4444-555555555555", "GPU-2"]
            assert not first.gpus[1].thermal_throttled
            # the second GPU overheats: the next reports carry it
            fake.gpus[1].reasons = REASON_SW_THERMAL
            fake.gpus[1].sm_mhz = 990
            seen = len(rx.reports)
            for _ in range(100):
                if len(rx.reports) > seen + 1:
                    break
                await asyncio.sleep(0.05)
            last = rx.reports[-1]
            assert last.gpus[1].thermal_throttled and last.gpus[1].clock_ratio == 0.5
            assert last.sent_at >= first.sent_at
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://{bound[0]}:{bound[1]}/metrics") as r,
            ):
                text = await r.text()
            gpus = parse_dcgm_metrics(text)
            assert gpus[1].thermal_throttled and gpus[1].uuid == "GPU-2"
            assert counter(text, "inferlb_agent_reports_total", outcome="ok") >= 2
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
            await agent.close()
    assert fake.shutdowns == 1


async def test_refused_reports_are_counted_and_the_agent_keeps_going() -> None:
    fake = FakePynvml([FakeGpu()])
    async with receiver() as (rx, url):
        rx.status = 503
        agent = make_agent(fake, url, metrics_host=None)
        await agent.run(asyncio.Event(), iterations=3)
        assert len(rx.reports) == 3
        text = agent.metrics.exposition().decode()
        assert counter(text, "inferlb_agent_reports_total", outcome="error") == 3
        assert counter(text, "inferlb_agent_reports_total", outcome="ok") == 0
        await agent.close()


async def test_an_unreachable_control_plane_is_counted_not_fatal() -> None:
    async with receiver() as (_rx, url):
        pass  # the receiver is gone: its port refuses connections
    agent = make_agent(FakePynvml([FakeGpu()]), url, metrics_host=None, post_timeout_s=1.0)
    await agent.run(asyncio.Event(), iterations=2)
    text = agent.metrics.exposition().decode()
    assert counter(text, "inferlb_agent_reports_total", outcome="error") == 2
    assert agent.last_report is not None and len(agent.last_report.gpus) == 1
    await agent.close()


async def test_a_gpu_lost_mid_run_is_dropped_from_reports_and_counted() -> None:
    fake = FakePynvml([FakeGpu(), FakeGpu(uuid="GPU-2")])
    async with receiver() as (rx, url):
        agent = make_agent(fake, url, metrics_host=None)
        await agent.run(asyncio.Event(), iterations=1)
        fake.gpus[1].broken.add("util")
        await agent.run(asyncio.Event(), iterations=1)
        assert [len(r.gpus) for r in rx.reports] == [2, 1]
        text = agent.metrics.exposition().decode()
        assert counter(text, "inferlb_agent_nvml_errors_total") == 1
        await agent.close()


async def test_stop_ends_the_loop_between_readings() -> None:
    agent = make_agent(FakePynvml([FakeGpu()]), None, metrics_host=None, interval_s=30.0)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.sleep(0.1)
    assert agent.last_report is not None
    stop.set()
    await asyncio.wait_for(task, 2)  # did not wait for the 30 s period
    await agent.close()


async def test_reports_carry_the_intake_token_when_one_is_set() -> None:
    for token, expected in (("s3cret-token-of-the-fleet", "Bearer s3cret-token-of-the-fleet"), (None, None)):
        async with receiver() as (rx, url):
            agent = make_agent(FakePynvml([FakeGpu()]), url, token=token, metrics_host=None)
            try:
                await asyncio.wait_for(agent.run(asyncio.Event(), iterations=1), 5)
            finally:
                await agent.close()
            assert rx.authorizations == [expected]
