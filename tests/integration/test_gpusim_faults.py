"""Simulated GPU faults over real loopback HTTP: the /sim control API, the telemetry that follows, and the
``inferlb sim`` CLI that drives it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from inferlb.config.schema import Config, parse_config
from inferlb.ops import cli
from inferlb.policy.telemetry import (
    REASON_SW_THERMAL,
    GpuTelemetry,
    counter_rate,
    parse_server_metrics,
    weight_inputs,
)
from inferlb.policy.weights import WeightParams, WeightState, step
from simulation.gpusim.faults import THROTTLE_TEMPERATURE_C
from simulation.gpusim.server import SimulatedEndpoint
from tests.conftest import wait_until

MODEL = "sim-model"


def config_doc(port: int = 1) -> dict[str, Any]:
    return {
        "gpu_profiles": {"A100": {"relative_capacity": 1.0, "memory_gb": 80}},
        # 40 tokens at 400 tokens/s per sequence = 0.1 s of decode: long enough to measure, short to run
        "simulation": {"prefill_tokens_per_s": 1_000_000, "decode_tokens_per_s": 400, "max_batch": 4},
        "models": [{"name": MODEL, "default_max_tokens": 40, "context_length": 512}],
        "endpoints": [
            {
                "name": "a100-t",
                "address": f"127.0.0.1:{port}",
                "model": MODEL,
                "gpu": "A100",
                "simulated": True,
            }
        ],
    }


@contextlib.asynccontextmanager
async def running(config: Config) -> AsyncIterator[tuple[SimulatedEndpoint, str]]:
    srv = SimulatedEndpoint(config=config, endpoint=config.endpoints[0])
    host, port = await srv.start(host="127.0.0.1", port=0)
    try:
        yield srv, f"http://{host}:{port}"
    finally:
        await srv.stop()


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[SimulatedEndpoint, str, aiohttp.ClientSession]]:
    async with running(parse_config(config_doc())) as (srv, base), aiohttp.ClientSession() as http:
        yield srv, base, http


Fixture = tuple[SimulatedEndpoint, str, aiohttp.ClientSession]


async def chat(
    http: aiohttp.ClientSession, base: str, max_tokens: int | None = None
) -> tuple[int, dict[str, Any], float]:
    t0 = time.perf_counter()
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    async with http.post(f"{base}/v1/chat/completions", json=body) as r:
        body = await r.json()
        return r.status, body, time.perf_counter() - t0


async def fault(http: aiohttp.ClientSession, base: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{base}/sim/fault", json=body) as r:
        return r.status, await r.json()


async def gpu(http: aiohttp.ClientSession, base: str) -> GpuTelemetry:
    async with http.get(f"{base}/sim/telemetry") as r:
        assert r.status == 200
        return GpuTelemetry.from_json(await r.json())


async def test_throttle_makes_requests_slower_and_the_gpu_hot(endpoint: Fixture) -> None:
    srv, base, http = endpoint
    status, _, healthy_s = await chat(http, base)
    assert status == 200
    cool = await gpu(http, base)
    assert cool.clock_ratio == 1.0 and not cool.thermal_throttled and cool.temperature_c < 80

    status, state = await fault(http, base, {"action": "throttle", "factor": 4})
    assert status == 200 and state == {"mode": "throttled", "factor": 4.0, "slowdown": 4.0}
    status, _, throttled_s = await chat(http, base)
    assert status == 200
    # 40 tokens: ~0.1 s healthy, ~0.4 s at a quarter speed (loose: 2 noisy cores)
    assert throttled_s > 2.0 * healthy_s
    hot = await gpu(http, base)
    assert hot.temperature_c == THROTTLE_TEMPERATURE_C
    assert hot.thermal_throttled and hot.throttle_reasons == REASON_SW_THERMAL
    assert hot.clock_ratio == pytest.approx(0.25)
    async with http.get(f"{base}/metrics") as r:
        assert "gpusim:slowdown_factor" in (text := await r.text())
        assert 'gpusim:slowdown_factor{model_name="sim-model"} 4.0' in text

    status, state = await fault(http, base, {"action": "recover"})
    assert state["mode"] == "healthy" and srv.engine.slowdown == 1.0
    status, _, recovered_s = await chat(http, base)
    assert status == 200 and recovered_s < throttled_s
    assert (await gpu(http, base)).clock_ratio == 1.0


async def test_slow_is_slower_but_invisible_to_nvml(endpoint: Fixture) -> None:
    srv, base, http = endpoint
    _, _, healthy_s = await chat(http, base)
    status, state = await fault(http, base, {"action": "slow", "factor": 4.0})
    assert status == 200 and state["mode"] == "slow"
    _, _, slow_s = await chat(http, base)
    assert slow_s > 2.0 * healthy_s
    t = await gpu(http, base)
    assert t.clock_ratio == 1.0 and not t.thermal_throttled and t.throttle_reasons == 0
    assert srv.fault.mode == "slow"


async def test_fail_answers_503_until_recovered(endpoint: Fixture) -> None:
    _, base, http = endpoint
    status, _ = await fault(http, base, {"action": "fail"})
    assert status == 200
    async with http.get(f"{base}/health") as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "gpu_failed"
    status, body, _ = await chat(http, base)
    assert status == 503 and body["error"]["code"] == "gpu_failed"
    async with http.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": "hi"}) as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "gpu_failed"
    async with http.get(f"{base}/metrics") as r:
        assert (
            'gpusim:requests_refused_total{model_name="sim-model",reason="gpu_failed"} 2.0' in await r.text()
        )
    assert (await gpu(http, base)).utilization_percent == 0.0
    await fault(http, base, {"action": "recover"})
    async with http.get(f"{base}/health") as r:
        assert r.status == 200
    status, _, _ = await chat(http, base)
    assert status == 200


async def test_a_request_in_flight_when_the_gpu_fails_still_finishes(endpoint: Fixture) -> None:
    _, base, http = endpoint
    task = asyncio.create_task(chat(http, base))
    await asyncio.sleep(0.03)
    await fault(http, base, {"action": "fail"})
    status, _, _ = await task
    assert status == 200


async def test_hang_holds_health_requests_and_streams_until_recovered(endpoint: Fixture) -> None:
    srv, base, http = endpoint
    # a stream that is running when the GPU hangs stops between two chunks
    stream_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                   "stream": True}  # fmt: skip
    chunks: list[bytes] = []
    async with http.post(f"{base}/v1/chat/completions", json=stream_body) as streaming:
        assert streaming.status == 200
        chunks.append(await streaming.content.readany())
        status, state = await fault(http, base, {"action": "hang"})
        assert status == 200 and state["mode"] == "hung"
        stalled_at = len(b"".join(chunks))

        async def read_to_end() -> None:
            while chunk := await streaming.content.readany():
                chunks.append(chunk)

        with pytest.raises(TimeoutError):
            # 40 tokens take ~0.1 s: the rest would have arrived
            await asyncio.wait_for(read_to_end(), timeout=0.4)
        assert b"[DONE]" not in b"".join(chunks)
        # /health and a new request are read and then held: no answer, no error, no reset
        health = asyncio.create_task(http.get(f"{base}/health"))
        held = asyncio.create_task(chat(http, base))
        done, _ = await asyncio.wait({health, held}, timeout=0.4)
        assert not done
        # the control API still answers
        async with http.get(f"{base}/sim/fault") as r:
            assert (await r.json())["mode"] == "hung"
        before = srv.engine.stats()
        await fault(http, base, {"action": "recover"})
        status, _, _ = await held
        assert status == 200
        async with await health as r:
            assert r.status == 200
        rest = await streaming.content.read()
        assert b"[DONE]" in rest and len(b"".join(chunks)) >= stalled_at
    assert before.running_requests + before.waiting_requests <= 1


async def test_a_client_that_gives_up_on_a_hung_gpu_frees_its_slot(endpoint: Fixture) -> None:
    srv, base, http = endpoint
    # 400 tokens at 400 tokens/s: still generating when the client gives up
    running = asyncio.create_task(chat(http, base, max_tokens=400))
    await asyncio.sleep(0.05)
    await fault(http, base, {"action": "hang"})
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await running
    await asyncio.sleep(0.1)
    stats = srv.engine.stats()
    assert stats.running_requests + stats.waiting_requests == 0
    await fault(http, base, {"action": "recover"})
    status, _, _ = await chat(http, base)
    assert status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [({"action": "explode"}, "action"), ({"action": "throttle", "factor": 0}, "factor"), (["x"], None)],
)
async def test_bad_fault_bodies_get_openai_400s(endpoint: Fixture, body: Any, param: str | None) -> None:
    srv, base, http = endpoint
    status, answer = await fault(http, base, body)
    assert status == 400
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert srv.fault.mode == "healthy"
    async with http.post(f"{base}/sim/fault", data=b"{not json") as r:
        assert r.status == 400


async def test_utilization_and_memory_follow_the_load(endpoint: Fixture) -> None:
    srv, base, http = endpoint
    await asyncio.sleep(0.25)
    idle = await gpu(http, base)
    assert idle.utilization_percent == 0.0
    # keep the GPU busy for ~0.3 s with 4 concurrent requests, reading telemetry while they run
    tasks = [asyncio.create_task(chat(http, base, max_tokens=120)) for _ in range(4)]
    # wait for them to reach the engine (a fixed sleep loses that race on a loaded machine)
    await wait_until(lambda: srv.engine.stats().kv_usage > 0, "the requests in the engine", poll_s=0.005)
    during = await gpu(http, base)
    assert during.memory_used_bytes > idle.memory_used_bytes
    await asyncio.gather(*tasks)
    busy = await gpu(http, base)
    assert busy.utilization_percent > 50.0
    assert busy.temperature_c > idle.temperature_c
    async with http.get(f"{base}/metrics") as r:
        assert parse_server_metrics(await r.text()).family == "vllm"


async def test_the_sim_cli_drives_a_running_endpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running(parse_config(config_doc())) as (srv, base):
        port = int(base.rsplit(":", 1)[1])
        path = tmp_path / "fleet.yaml"
        path.write_text(yaml.safe_dump(config_doc(port)), encoding="utf-8")

        def sim(*argv: str) -> int:
            return cli.main(["sim", *argv, "--config", str(path)])

        assert await asyncio.to_thread(sim, "throttle", "a100-t", "--factor", "3") == 0
        assert srv.fault.mode == "throttled" and srv.engine.slowdown == 3.0
        assert "a100-t (A100" in capsys.readouterr().out
        assert await asyncio.to_thread(sim, "telemetry", "a100-t") == 0
        shown = capsys.readouterr().out
        assert '"thermal_throttled": true' in shown
        assert await asyncio.to_thread(sim, "fail", "a100-t") == 0
        assert srv.fault.mode == "failed"
        assert await asyncio.to_thread(sim, "hang", "a100-t") == 0
        assert srv.fault.mode == "hung"
        assert await asyncio.to_thread(sim, "recover", "a100-t") == 0
        assert srv.fault.mode == "healthy" and srv.engine.slowdown == 1.0
        # a named endpoint is also found by its address, as the help says
        assert await asyncio.to_thread(sim, "fail", f"127.0.0.1:{port}") == 0
        assert srv.fault.mode == "failed"
        assert await asyncio.to_thread(sim, "recover", f"127.0.0.1:{port}") == 0
        # refused by the endpoint: exit 1, state unchanged
        assert await asyncio.to_thread(sim, "slow", "a100-t", "--factor", "0.5") == cli.EXIT_FAIL
        assert srv.fault.mode == "healthy"
        # unknown name: exit 2
        assert await asyncio.to_thread(sim, "fail", "nope") == cli.EXIT_INPUT
    # the endpoint is gone: exit 1
    assert sim("recover", "a100-t") == cli.EXIT_FAIL


@pytest.mark.parametrize("action", ["throttle", "slow"])
async def test_the_weight_policy_fed_by_live_telemetry_halves_a_gpu_at_half_speed(action: str) -> None:
    """The control loop minus xDS: scrape the endpoint's /metrics and /sim/telemetry under a steady load,
    step the weight policy, then put the GPU at half speed. Throttle shows in NVML (clock ratio) and in the
    throughput; slow only in the throughput; both must halve the weight."""
    config = parse_config(config_doc())
    params = dataclasses.replace(
        WeightParams.from_config(config.weights), slow_start_s=0.0, smoothing_tau_s=0.5
    )
    period = 0.25
    reference = config.simulation.decode_tokens_per_s
    async with running(config) as (srv, base), aiohttp.ClientSession() as http:
        stop = asyncio.Event()

        async def client() -> None:  # closed loop: keeps one request running per client
            while not stop.is_set():
                await chat(http, base, max_tokens=20)

        clients = [asyncio.create_task(client()) for _ in range(srv.timing.max_batch)]
        state: WeightState | None = None
        previous: tuple[float, float | None] | None = None
        weights: list[int] = []
        try:
            for i in range(14):
                if i == 6:
                    status, _ = await fault(http, base, {"action": action, "factor": 2.0})
                    assert status == 200
                await asyncio.sleep(period)
                now = time.monotonic()
                async with http.get(f"{base}/metrics") as r:
                    server = parse_server_metrics(await r.text())
                telemetry = await gpu(http, base)
                rate = None
                if previous is not None:
                    rate = counter_rate(previous[1], previous[0], server.generation_tokens_total, now)
                previous = (now, server.generation_tokens_total)
                inputs = weight_inputs(
                    profile_capacity=1.0, max_batch=srv.timing.max_batch, server=server, server_age_s=0.0,
                    gpu=telemetry, gpu_age_s=0.0, stale_after_s=params.stale_after_s,
                    generation_tokens_per_s=rate, reference_tokens_per_s=reference,
                )  # fmt: skip
                state, w = step(state, inputs, now, params)
                weights.append(w)
        finally:
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
    healthy = max(weights[:6])
    assert 40 <= healthy <= 110, weights  # 100 x capacity 1.0, less the load factor of a full batch
    final = weights[-1]
    assert 0.35 * healthy <= final <= 0.62 * healthy, weights
    # all within 2 s (8 periods) of the fault
    assert min(weights[6:]) <= 0.75 * healthy, weights
