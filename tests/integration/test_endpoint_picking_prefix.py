"""Endpoint picking with prefix indexes on the request path, in-process (:mod:`ext_proc.picking`): in mode
``precise`` the picking state subscribes to each healthy endpoint's KV events (a real gpusim publishing over
ZMQ on an ``ipc://`` socket), so the check lists first the endpoint whose cache holds the prompt, even when
load alone would pick another; an endpoint that turns unhealthy or leaves is unsubscribed and dropped from
the index; the subscribers' counters are on the process's metrics; the fleet API registers an endpoint's
``kv_events`` and ``GET /v1/picking`` carries them. In mode ``approximate`` the second turn
of a conversation goes where the first went, learnt from the process's own pick."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import generate_latest

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from ext_proc.picking import picker_weights
from ext_proc.state import ExtProcState
from inferlb.config.schema import parse_config
from inferlb.ops.stack import free_ports
from inferlb.policy.endpoint_book import BookedEndpoint, BookedState
from inferlb.policy.kv_index import PreciseKvIndex
from inferlb.policy.picker import pick
from inferlb.request import headers as h
from simulation.gpusim.kv_events import KvEventsConfig
from simulation.gpusim.server import SimulatedEndpoint
from xds_server.collector import TelemetryCollector
from xds_server.server import XdsServer

KEY = "sk-gold-0001"
TOKEN = "picking-token-0123456789"
MODEL = "llama"
CLUSTER = "llama--v1"
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
#: Bounds of the waits for the KV events to arrive (each poll, and how many polls at most).
POLL_S = 0.05
MAX_POLLS = 100
TEXT = "Tell me about the simulated fleet and its prefix caches, please. " * 12


def _config(mode: str) -> dict[str, Any]:
    return {
        "ext_proc": {"protocol": "ext_authz", "account_responses": True},
        "simulation": {"prefill_tokens_per_s": 1_000_000, "decode_tokens_per_s": 5_000, "max_batch": 4},
        "models": [{"name": MODEL, "default_max_tokens": 1, "endpoint_picking": {"mode": mode}}],
        "endpoints": [{"name": "sim", "address": "127.0.0.1:1", "model": MODEL, "gpu": "H100",
                       "simulated": True}],
        "tenants": [{"name": "gold", "api_keys": [KEY]}],
    }  # fmt: skip


def _messages(*turns: str) -> list[dict[str, str]]:
    out = []
    for i, t in enumerate(turns):
        out.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            out.append({"role": "assistant", "content": f"reply {i}"})
    return out


def _check(service: CheckService, *turns: str) -> list[str]:
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": _messages(*turns)}).encode()
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    out = service.check(CheckRequest(method="POST", path="/v1/chat/completions", headers=headers, body=body))
    assert isinstance(out, CheckAnswer) and out.status == 200, out
    hosts: list[str] = dict(out.headers)[h.DESTINATION_ENDPOINT].split(",")
    return hosts


def _state(busy: str, kv_events: dict[str, str], *, unhealthy: frozenset[str] = frozenset()) -> BookedState:
    """A, B, C of equal weight with 4 requests waiting each, ``busy`` 5 (so load alone places elsewhere, and
    a prompt cached there still outweighs the difference)."""
    return BookedState(
        clusters={
            CLUSTER: tuple(
                BookedEndpoint(
                    address=a, weight=10, healthy=a not in unhealthy, waiting=5 if a == busy else 4,
                    telemetry_age_ms=0, kv_events=kv_events.get(a),
                )
                for a in (A, B, C)
            )
        },
        stale_after_ms=60_000,
    )  # fmt: skip


def _load_alone(state: ExtProcState) -> str:
    states = state.picking.book.states(CLUSTER, time.monotonic())
    assert states is not None
    model = state.gateway.config.models[0]
    return pick(states, prompt_blocks=0, matched_blocks=None, weights=picker_weights(model.endpoint_picking),
                salt=state.picking.salt)[0]  # fmt: skip


async def test_precise_lists_first_the_endpoint_whose_kv_events_hold_the_prompt(tmp_path: Path) -> None:
    config = parse_config(_config("precise"))
    state = ExtProcState(config)
    service = CheckService(state)
    socket = f"ipc://{tmp_path / 'kv.sock'}"
    sim = SimulatedEndpoint(
        config=config,
        endpoint=config.endpoints[0],
        kv_events=KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=socket),
    )
    _, port = await sim.start(host="127.0.0.1", port=0)
    picking = state.picking
    try:
        # B is the one with KV events (the simulated server's), and busy: load alone would not pick it
        picking.book.update(_state(B, {B: socket}), time.monotonic())
        picking.sync(config.models)
        assert _load_alone(state) != B
        index = picking.source(config.models[0]).index
        assert isinstance(index, PreciseKvIndex)
        first = _check(service, TEXT)
        assert first[0] != B, first  # nothing cached yet
        picking.book.leave(first[0])
        # the server computes the prompt (its events reach the index over ZMQ); one more send when the
        # subscriber joined after the first batch (ZMQ's late joiner: a gap, the entries rebuilt after it)
        body = {"model": MODEL, "max_tokens": 1, "messages": _messages(TEXT)}
        async with aiohttp.ClientSession() as http:
            for _ in range(MAX_POLLS):
                if index.held_keys(B):
                    break
                async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                await asyncio.sleep(POLL_S)
        assert index.held_keys(B), "the KV events never reached the index"
        hosts = _check(service, TEXT)
        assert hosts[0] == B, hosts
        picking.book.leave(hosts[0])
        # the next turn of the conversation matches its cached prefix there too
        assert _check(service, TEXT, "and then?")[0] == B
        metrics = generate_latest(_registry_with(state)).decode()
        assert f'inferlb_kv_events_batches_total{{endpoint="{B}"}}' in metrics
        # B fails its health checks: unsubscribed, its entries dropped, picks by load again
        picking.book.update(_state(B, {B: socket}, unhealthy=frozenset({B})), time.monotonic())
        picking.sync(config.models)
        assert B not in index.endpoints and picking.kv_events.subscribers == []
        assert B not in _check(service, TEXT)
        # healthy again: subscribed afresh (entries rebuilt from its next events)
        picking.book.update(_state(B, {B: socket}), time.monotonic())
        picking.sync(config.models)
        assert [s.address for s in picking.kv_events.subscribers] == [B]
        # B leaves the cluster: unsubscribed
        picking.book.update(BookedState(clusters={CLUSTER: ()}, stale_after_ms=60_000), time.monotonic())
        picking.sync(config.models)
        assert picking.kv_events.subscribers == [] and B not in index.endpoints
    finally:
        await picking.aclose()
        await sim.stop()


def _registry_with(state: ExtProcState) -> Any:
    state.metrics.registry.register(state.picking.kv_events)
    return state.metrics.registry


@pytest.mark.parametrize("busy_after", [True, False])
async def test_approximate_sends_the_second_turn_where_the_first_went(busy_after: bool) -> None:
    config = parse_config(_config("approximate"))
    state = ExtProcState(config)
    service = CheckService(state)
    picking = state.picking
    picking.book.update(_state("", {}), time.monotonic())
    picking.sync(config.models)
    conversations = [f"conversation {i}: " + TEXT for i in range(3)]
    firsts = []
    for text in conversations:
        first = _check(service, text)[0]
        picking.book.leave(first)  # the request ended
        firsts.append(first)
        if busy_after:
            # the first turn's endpoint is now busy: load alone would move the next turn
            picking.book.update(_state(first, {}), time.monotonic())
            assert _load_alone(state) != first
        second = _check(service, text, "and then?")
        picking.book.leave(second[0])
        assert second[0] == first, (first, second)
        picking.book.update(_state("", {}), time.monotonic())
    # an endpoint that turns unhealthy is forgotten: it holds nothing when it comes back
    index = picking.source(config.models[0]).index
    gone = firsts[0]
    picking.book.update(_state("", {}, unhealthy=frozenset({gone})), time.monotonic())
    picking.sync(config.models)
    assert index.blocks_of(gone) == 0  # type: ignore[attr-defined]


async def test_the_fleet_api_registers_kv_events_and_the_picking_state_carries_them(tmp_path: Path) -> None:
    ports = free_ports(4)
    doc = {
        "xds": {"listen": f"127.0.0.1:{ports[0]}", "api_listen": f"127.0.0.1:{ports[1]}"},
        "models": [{"name": MODEL, "endpoint_picking": {"mode": "precise"}}, {"name": "other"}],
        "endpoints": [{"name": "a", "address": A, "model": MODEL, "gpu": "H100",
                       "kv_events": "tcp://10.0.0.1:5557"}],
    }  # fmt: skip
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    collector = TelemetryCollector()
    server = XdsServer(path, api_token=TOKEN, api_routes=collector.routes())
    await server.start()
    await collector.start(server)
    api = f"http://127.0.0.1:{ports[1]}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    kv = {"endpoint": "tcp://10.0.0.2:5557", "replay_endpoint": "tcp://10.0.0.2:5558", "topic": ""}
    try:
        async with aiohttp.ClientSession(headers=auth) as http:
            spec = {"name": "b", "address": B, "model": MODEL, "gpu": "H100", "kv_events": kv}
            async with http.post(f"{api}/v1/endpoints", json=spec) as resp:
                assert resp.status == 201, await resp.text()
            # KV events on a model that does not pick precisely: refused, naming the field
            bad = {"name": "c", "address": C, "model": "other", "gpu": "H100", "kv_events": kv["endpoint"]}
            async with http.post(f"{api}/v1/endpoints", json=bad) as resp:
                text = await resp.text()
                assert resp.status == 400 and "kv_events" in text, text
            async with http.get(f"{api}/v1/picking") as resp:
                assert resp.status == 200
                rows = {r["name"]: r for r in (await resp.json())["clusters"][CLUSTER]}
        assert rows["a"]["kv_events"] == {
            "endpoint": "tcp://10.0.0.1:5557",
            "replay_endpoint": None,
            "topic": "",
        }
        assert rows["b"]["kv_events"] == kv
    finally:
        await collector.stop()
        await server.stop(0)
