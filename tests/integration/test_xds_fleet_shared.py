"""Two xDS servers sharing one Redis fleet store serve the same endpoints: a change through either server's
HTTP API reaches the other's snapshot within about a second, changes made at once through both land, a
server killed with SIGKILL comes back with the shared state, a Redis restart with the append-only file keeps
it, and with Redis down changes answer 503 naming the store while both keep serving, until Redis is back."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from inferlb.ops.redis_server import RedisServer
from tests.conftest import make_config_doc, redis_or_skip, wait_until, write_config
from tests.integration.test_ext_proc_grpc import Process
from tests.integration.test_xds_fleet_durable import AUTH, TOKEN, _eds, _lb, _stable_rows
from xds_server import resources as r
from xds_server import server as server_module
from xds_server.server import XdsServer

QWEN = "qwen2.5-7b-instruct--v1"
LLAMA = "llama-3.1-8b-instruct--v1"
#: a change made on one server must reach the other's snapshot within this (s): pub/sub, else one poll
PROPAGATE_S = 1.5
WAIT_S = 10.0
Call = Callable[..., Any]


def _doc(redis: RedisServer) -> dict[str, Any]:
    doc = make_config_doc()
    doc["xds"].update(
        api_token=TOKEN, push_debounce_ms=10, drain_period_ms=600_000, state_redis_url=redis.url
    )
    doc["xds"].update(state_redis_poll_ms=200, state_redis_timeout_ms=300)
    return doc


def _host(srv: XdsServer, name: str) -> endpoint_pb2.LbEndpoint | None:
    """The endpoint ``name`` as the server's snapshot sends it, in whichever cluster it serves."""
    snap = srv.cache.snapshot()
    assert snap is not None
    for resource in snap.resources[r.ENDPOINT_TYPE].values():
        cla = resource.message
        assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
        for loc in cla.endpoints:
            for lb in loc.lb_endpoints:
                if lb.endpoint.hostname == name:
                    return lb
    return None


def _draining(srv: XdsServer, name: str) -> bool:
    lb = _host(srv, name)
    return lb is not None and lb.health_status == health_check_pb2.HealthStatus.DRAINING


def _weight(srv: XdsServer, name: str) -> int:
    lb = _host(srv, name)
    return 0 if lb is None else lb.load_balancing_weight.value


async def _server(config: Path) -> XdsServer:
    srv = XdsServer(
        config, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), api_token=TOKEN, poll_interval_s=0.05
    )
    await srv.start()
    return srv


class Pair:
    """Two in-process servers on one config file and one Redis, with an API caller each."""

    def __init__(self, redis: RedisServer, config: Path, doc: dict[str, Any]) -> None:
        self.redis, self.config, self.doc = redis, config, doc
        self.servers: list[XdsServer] = []
        # a call that gets no answer fails the test in 15 s, naming it, instead of aiohttp's 5-min default
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))

    def call(self, i: int) -> Call:
        async def call(method: str, path: str, body: Any = None) -> tuple[int, Any, Any]:
            url = f"http://127.0.0.1:{self.servers[i].api_port}{path}"
            async with self.session.request(method, url, json=body, headers=AUTH) as resp:
                return resp.status, await resp.json(), resp.headers

        return call

    def addr(self, name: str) -> str:
        return next(e["address"] for e in self.doc["endpoints"] if e["name"] == name)


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    redis = redis_or_skip(tmp_path, appendonly=True).start()
    doc = _doc(redis)
    config = write_config(tmp_path / "inferlb.yaml", doc)
    p = Pair(redis, config, doc)
    try:
        p.servers = [await _server(config), await _server(config)]
        yield p
    finally:
        for srv in p.servers:
            await srv.stop(0)
        await p.session.close()
        redis.stop()


async def test_a_change_on_one_server_reaches_the_others_snapshot(pair: Pair) -> None:
    a, b = pair.servers
    h100 = pair.addr("h100-1")
    t0 = time.monotonic()
    status, body, _ = await pair.call(0)("POST", f"/v1/endpoints/{h100}/drain")
    assert status == 202, body
    await wait_until(lambda: _draining(b, "h100-1"), "server B serving the drain", PROPAGATE_S)
    took = time.monotonic() - t0
    assert _draining(a, "h100-1")
    # the same listing through both servers, naming the shared store and its version
    _, on_a, _ = await pair.call(0)("GET", "/v1/endpoints")
    _, on_b, _ = await pair.call(1)("GET", "/v1/endpoints")
    assert _stable_rows(on_a) == _stable_rows(on_b)
    assert on_b["state_file"] is None
    assert on_b["state_store"] == {"where": f"{pair.redis.url} key inferlb:fleet", "shared": True,
                                   "version": on_a["state_store"]["version"], "reachable": True}  # fmt: skip
    # and back the other way, through B: a registration A had never seen
    new = {"address": "127.0.0.9:9100", "model": "qwen2.5-7b-instruct", "gpu": "A100", "name": "a100-new"}
    assert (await pair.call(1)("POST", "/v1/endpoints", new))[0] == 201
    await wait_until(lambda: "a100-new" in _lb(a, QWEN), "server A serving B's registration", PROPAGATE_S)
    assert took < PROPAGATE_S


async def test_changes_made_at_once_on_both_servers_all_land(pair: Pair) -> None:
    a, b = pair.servers
    names = ["a100-0", "a100-1", "a100-2", "h100-0"]
    start = a.store_version() or 0  # the first server to start wrote the empty state
    # eight pins at once, alternating servers, each on its own endpoint: every one must survive the races
    calls = [
        pair.call(i % 2)("PUT", f"/v1/endpoints/{pair.addr(names[i % 4])}/weight", {"weight": 100 + i})
        for i in range(8)
    ]
    calls += [pair.call(1)("POST", f"/v1/endpoints/{pair.addr('v100-1')}/drain"),
              pair.call(0)("DELETE", f"/v1/endpoints/{pair.addr('v100-2')}")]  # fmt: skip
    answers = await asyncio.gather(*calls)
    assert [s for s, _, _ in answers] == [200] * 8 + [202, 200], answers
    # the last pin of each endpoint wins on both; which one is last is the store's order, the same for both
    await wait_until(
        lambda: a.fleet == b.fleet and a.store_version() == b.store_version() == start + 10,
        "both servers agreeing",
    )
    pins = a.fleet.weight_overrides
    assert {pair.addr(n) for n in names} == set(pins)
    assert all(pins[pair.addr(n)] in (100 + i for i in range(8) if names[i % 4] == n) for n in names)
    assert pair.addr("v100-1") in a.fleet.draining and pair.addr("v100-2") in a.fleet.hidden
    await wait_until(lambda: all(_weight(s, "a100-0") == pins[pair.addr("a100-0")] for s in (a, b)), "EDS")


async def test_redis_down_refuses_changes_with_503_and_both_keep_serving(pair: Pair) -> None:
    a, b = pair.servers
    pin = pair.addr("a100-1")
    assert (await pair.call(0)("PUT", f"/v1/endpoints/{pin}/weight", {"weight": 77}))[0] == 200
    await wait_until(lambda: _weight(b, "a100-1") == 77, "B serving the pin", PROPAGATE_S)
    pair.redis.stop()
    status, body, headers = await pair.call(1)("POST", f"/v1/endpoints/{pair.addr('h100-1')}/drain")
    assert status == 503, body
    err = body["error"]
    assert err["code"] == "fleet_store_unavailable" and err["type"] == "server_error"
    assert f"fleet store {pair.redis.url} key inferlb:fleet unavailable" in err["message"]
    assert "nothing changed" in err["message"] and headers["Retry-After"] == "1"
    assert pair.addr("h100-1") not in b.fleet.draining
    await wait_until(lambda: not a.store_reachable and not b.store_reachable, "both noticing", WAIT_S)
    # both keep serving the last state, over ADS too
    assert _weight(a, "a100-1") == _weight(b, "a100-1") == 77
    assert _lb(b, LLAMA)["a100-1"].load_balancing_weight.value == 77
    assert (await pair.call(0)("GET", "/v1/endpoints"))[1]["state_store"]["reachable"] is False
    # Redis back (its AOF kept the pin): changes work again, on both, without a restart
    pair.redis.start()
    await wait_until(lambda: a.store_reachable and b.store_reachable, "both reconnecting", WAIT_S)
    assert (await pair.call(1)("POST", f"/v1/endpoints/{pair.addr('h100-1')}/drain"))[0] == 202
    await wait_until(lambda: _draining(a, "h100-1"), "A serving B's drain", PROPAGATE_S)
    assert _weight(a, "a100-1") == 77


async def test_a_redis_restart_with_the_append_only_file_keeps_the_state(pair: Pair) -> None:
    a, b = pair.servers
    assert (await pair.call(0)("PUT", f"/v1/endpoints/{pair.addr('a100-2')}/weight", {"weight": 55}))[
        0
    ] == 200
    version = a.store_version()
    pair.redis.restart()  # SIGTERM: Redis fsyncs the AOF and exits; the new process replays it
    await wait_until(lambda: a.store_reachable and b.store_reachable, "both reconnected", WAIT_S)
    assert (await pair.call(1)("POST", f"/v1/endpoints/{pair.addr('v100-0')}/drain"))[0] == 202
    await wait_until(lambda: _draining(a, "v100-0"), "A serving the drain", PROPAGATE_S)
    assert a.store_version() == b.store_version() == (version or 0) + 1  # the same epoch: nothing was lost
    assert a.fleet.weight_overrides[pair.addr("a100-2")] == 55
    # server B restarted now (a rolled replica) serves it all from the store
    await b.stop(0)
    pair.servers[1] = b = await _server(pair.config)
    assert b.fleet == a.fleet
    assert _weight(b, "a100-2") == 55 and _draining(b, "v100-0")


async def test_redis_without_persistence_gets_the_state_back_from_a_running_server(pair: Pair) -> None:
    a, b = pair.servers
    assert (await pair.call(0)("PUT", f"/v1/endpoints/{pair.addr('a100-0')}/weight", {"weight": 33}))[
        0
    ] == 200
    await wait_until(lambda: b.fleet == a.fleet, "B following")
    client = a._store.document.client  # type: ignore[union-attr]
    await client.flushall()  # what a Redis restarted without its AOF holds: nothing
    await wait_until(lambda: b.store_version() == a.store_version() == 1, "the state written back", WAIT_S)
    assert (
        a.fleet.weight_overrides[pair.addr("a100-0")] == 33 == b.fleet.weight_overrides[pair.addr("a100-0")]
    )
    stored = await a._store.document.read()  # type: ignore[union-attr]
    assert stored is not None and stored.document["weight_overrides"] == {pair.addr("a100-0"): 33}


# -- processes: kill -9 of one server ---------------------------------------------------------------
async def _process(config: Path) -> Process:
    return Process(
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "xds_server", "--config", str(config),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    )  # fmt: skip


async def test_a_server_killed_with_sigkill_comes_back_with_the_shared_state(tmp_path: Path) -> None:
    """Two ``python -m xds_server`` processes on one Redis (each its own ports); the first killed with
    SIGKILL right after a change, a change made on the second while it is down, the first started again:
    it serves both, over ADS byte for byte what the second serves."""
    with redis_or_skip(tmp_path, appendonly=True) as redis:
        doc_a = _doc(redis)
        doc_b = make_config_doc()  # other free ports, the same fleet and store
        doc_b["endpoints"] = doc_a["endpoints"]
        doc_b["xds"].update({k: v for k, v in doc_a["xds"].items() if k not in ("listen", "api_listen")})
        conf_a = write_config(tmp_path / "a.yaml", doc_a)
        conf_b = write_config(tmp_path / "b.yaml", doc_b)
        api_a, api_b = (f"http://{d['xds']['api_listen']}/v1/endpoints" for d in (doc_a, doc_b))
        port_a, port_b = (int(d["xds"]["listen"].rsplit(":", 1)[1]) for d in (doc_a, doc_b))
        ep = {e["name"]: e["address"] for e in doc_a["endpoints"]}
        a, b = await _process(conf_a), await _process(conf_b)
        try:
            await a.wait_for_line("xds_server ready on")
            await b.wait_for_line("xds_server ready on")
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.put(f"{api_a}/{ep['a100-0']}/weight", json={"weight": 250}) as resp:
                    assert resp.status == 200
                a.proc.kill()  # SIGKILL, right after the answer: nothing flushed on the way out
                await a.stop()
                async with s.post(f"{api_b}/{ep['h100-1']}/drain", json={"drain_ms": 600_000}) as resp:
                    assert resp.status == 202
                await b.wait_for_line("what=drain endpoint=")
                a = await _process(conf_a)
                await a.wait_for_line("xds_server ready on")
                line = await a.wait_for_line("fleet state restored from")
                assert "1 draining, 0 deregistered, 1 weight pins" in line
                async with s.get(api_a) as ra, s.get(api_b) as rb:
                    listing_a, listing_b = await ra.json(), await rb.json()
            assert _stable_rows(listing_a) == _stable_rows(listing_b)
            versions = (listing_a["state_store"]["version"], listing_b["state_store"]["version"])
            assert versions == (3, 3)  # the empty state, the pin, the drain
            eds_a, eds_b = await _eds(port_a), await _eds(port_b)
            assert eds_a == eds_b
            qwen = endpoint_pb2.ClusterLoadAssignment.FromString(eds_a[QWEN])
            health = {
                lb.endpoint.hostname: lb.health_status for loc in qwen.endpoints for lb in loc.lb_endpoints
            }
            assert health["h100-1"] == health_check_pb2.HealthStatus.DRAINING
        finally:
            await a.stop()
            await b.stop()


async def test_a_server_does_not_start_without_its_store(tmp_path: Path) -> None:
    with redis_or_skip(tmp_path) as redis:
        doc = _doc(redis)
    # stopped: nothing listens on its port now
    proc = await _process(write_config(tmp_path / "inferlb.yaml", doc))
    assert await asyncio.wait_for(proc.proc.wait(), WAIT_S) == 1
    await proc.stop()
    line = next(ln for ln in proc.lines if "cannot start" in ln)
    assert f"shared state store {redis.url} key inferlb:fleet unavailable (read)" in line


def test_state_file_and_state_redis_url_together_are_refused() -> None:
    from inferlb.config.schema import parse_config  # noqa: PLC0415

    doc = make_config_doc()
    doc["xds"].update(state_file="fleet.json", state_redis_url="redis://127.0.0.1:6379/0")
    with pytest.raises(Exception, match="state_file and state_redis_url are both set"):
        parse_config(doc, "<test>")
    doc["xds"].update(state_file=None, state_redis_url="http://127.0.0.1:6379")
    with pytest.raises(Exception, match=r"xds.state_redis_url.*expected a redis://"):
        parse_config(doc, "<test>")


async def test_a_stop_ends_in_bounded_time_when_a_step_hangs(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection a dead peer left half-open must not hold the server's stop: each step is bounded."""
    a = pair.servers[0]
    assert a._store is not None
    hung = asyncio.Event()

    async def close_that_hangs() -> None:
        await hung.wait()  # never set: the close of a connection whose peer is gone

    monkeypatch.setattr(a._store, "close", close_that_hangs)
    monkeypatch.setattr(server_module, "STOP_STEP_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    await a.stop(0)
    assert time.monotonic() - t0 < 5.0
    assert a._store is None and a._server is None
