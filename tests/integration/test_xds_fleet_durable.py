"""Fleet API changes survive a restart: ``python -m xds_server --state-file`` killed with SIGKILL and started
again serves the same ``GET /v1/endpoints`` and the same EDS; a bad or busy state file stops the start with
the file named; in process, drains keep their wall-clock end across a restart, undrain, and a change that
cannot be stored changes nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from inferlb.config.schema import EndpointConfig
from inferlb.errors import ConfigError
from tests.conftest import make_config_doc, wait_until, write_config
from tests.integration.test_ads_stream import AdsClient
from tests.integration.test_ext_proc_grpc import Process
from xds_server import resources as r
from xds_server.fleet_state import FleetState
from xds_server.fleet_store import FleetStateFile
from xds_server.server import XdsServer

TOKEN = "durable-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLUSTERS = ["llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1"]
WAIT_S = 10.0
#: (config file, state file, config document)
Files = tuple[Path, Path, dict[str, Any]]


def _config(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    doc = make_config_doc()
    doc["xds"].update(api_token=TOKEN, push_debounce_ms=10, drain_period_ms=600_000)
    return write_config(tmp_path / "inferlb.yaml", doc), doc


async def _start(config: Path, state: Path, *extra: str) -> Process:
    return Process(
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "xds_server", "--config", str(config), "--state-file", str(state), *extra,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    )  # fmt: skip


async def _eds(port: int) -> dict[str, bytes]:
    """Every model cluster's ClusterLoadAssignment as the server sends it (deterministic bytes)."""
    client = AdsClient(port)
    try:
        await client.send(r.ENDPOINT_TYPE, names=CLUSTERS, node=True)
        resp = await client.recv(WAIT_S)
    finally:
        await client.close()
    out = {}
    for any_ in resp.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert any_.Unpack(cla)
        out[cla.cluster_name] = cla.SerializeToString(deterministic=True)
    return out


def _hosts(cla_bytes: bytes) -> dict[str, endpoint_pb2.LbEndpoint]:
    cla = endpoint_pb2.ClusterLoadAssignment.FromString(cla_bytes)
    return {lb.endpoint.hostname: lb for loc in cla.endpoints for lb in loc.lb_endpoints}


async def _api(session: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with session.request(method, url, json=body, headers=AUTH) as resp:
        return resp.status, await resp.json()


def _stable_rows(listing: dict[str, Any]) -> list[dict[str, Any]]:
    """The listing without the one field that moves with the clock (``drain_ends_at`` stays)."""
    return [{k: v for k, v in row.items() if k != "removed_in_ms"} for row in listing["endpoints"]]


async def test_fleet_changes_survive_kill_9(tmp_path: Path) -> None:
    config, doc = _config(tmp_path)
    state = tmp_path / "fleet.json"
    api = f"http://{doc['xds']['api_listen']}/v1/endpoints"
    xds_port = int(doc["xds"]["listen"].rsplit(":", 1)[1])
    ep = [e["address"] for e in doc["endpoints"]]
    # another loopback address: no port of the config's can collide with it
    new = {"address": "127.0.0.9:9100", "model": "qwen2.5-7b-instruct", "gpu": "A100", "name": "a100-new"}
    first = await _start(config, state)
    try:
        await first.wait_for_line("xds_server ready on")
        async with aiohttp.ClientSession() as s:
            assert (await _api(s, "POST", api, new))[0] == 201
            assert (await _api(s, "PUT", f"{api}/{ep[1]}/weight", {"weight": 250}))[0] == 200
            status, drained = await _api(s, "POST", f"{api}/{ep[5]}/drain", {"drain_ms": 600_000})
            assert status == 202
            assert (await _api(s, "DELETE", f"{api}/{ep[7]}"))[0] == 200
            _, before = await _api(s, "GET", api)
        assert before["state_file"] == str(state)
        assert before["deregistered"] == [ep[7]]
        # each change is one INFO line: who, what, which endpoint
        for what in (f"register endpoint={new['address']}", f"weight endpoint={ep[1]} weight=250",
                     f"drain endpoint={ep[5]} drain_ms=600000", f"deregister endpoint={ep[7]}"):  # fmt: skip
            line = await first.wait_for_line(f"what={what}")
            assert "INFO" in line and "fleet api: who=127.0.0.1 agent=" in line and "stored" in line
        await asyncio.sleep(0.2)  # past the push debounce: what EDS serves now is every change
        eds_before = await _eds(xds_port)
        qwen = _hosts(eds_before["qwen2.5-7b-instruct--v1"])
        assert "a100-new" in qwen and "v100-2" not in qwen
        assert qwen["h100-1"].health_status == health_check_pb2.HealthStatus.DRAINING
        assert _hosts(eds_before["llama-3.1-8b-instruct--v1"])["a100-0"].load_balancing_weight.value == 250

        # a second server on the same state file is refused: it would overwrite the first one's changes
        second = await _start(config, state)
        assert await asyncio.wait_for(second.proc.wait(), WAIT_S) == 1
        await second.stop()
        assert any(f"fleet state file {state}: in use by another xds_server" in ln for ln in second.lines)
    finally:
        first.proc.kill()  # SIGKILL: no clean shutdown, nothing flushed on the way out
        await first.stop()

    again = await _start(config, state)
    try:
        await again.wait_for_line("xds_server ready on")
        line = await again.wait_for_line("fleet state restored")
        assert "1 registered, 1 draining, 1 deregistered, 1 weight pins" in line
        async with aiohttp.ClientSession() as s:
            _, after = await _api(s, "GET", api)
        assert _stable_rows(after) == _stable_rows(before)
        assert after["deregistered"] == before["deregistered"]
        row = next(e for e in after["endpoints"] if e["key"] == ep[5])
        assert row["drain_ends_at"] == drained["drain_ends_at"]  # the wall-clock end, not restarted
        assert 0 < row["removed_in_ms"] <= drained["removed_in_ms"]
        assert await _eds(xds_port) == eds_before
    finally:
        await again.stop()


async def test_a_corrupt_state_file_stops_the_start_naming_it(tmp_path: Path) -> None:
    config, _ = _config(tmp_path)
    state = tmp_path / "fleet.json"
    state.write_text('{"inferlb_fleet_state": 1, "registered": [')  # not a file this server wrote
    proc = await _start(config, state)
    assert await asyncio.wait_for(proc.proc.wait(), WAIT_S) == 1
    await proc.stop()
    line = next(ln for ln in proc.lines if "cannot start" in ln)
    assert f"fleet state file {state}: not JSON" in line
    assert state.read_text() == '{"inferlb_fleet_state": 1, "registered": ['  # left for the operator


# -- in process ---------------------------------------------------------------------------------------
async def _server(config: Path, state: Path) -> XdsServer:
    srv = XdsServer(config, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), api_token=TOKEN,
                    poll_interval_s=0.05, state_file=state)  # fmt: skip
    await srv.start()
    return srv


@pytest.fixture
def files(tmp_path: Path) -> Files:
    config, doc = _config(tmp_path)
    return config, tmp_path / "fleet.json", doc


@pytest.fixture
async def http(files: Files) -> AsyncIterator[tuple[XdsServer, Callable[..., Any]]]:
    srv = await _server(files[0], files[1])
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{srv.api_port}") as session:

            async def call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
                return await _api(session, method, path, body)

            yield srv, call
    finally:
        await srv.stop(0)


def _lb(srv: XdsServer, cluster: str) -> dict[str, endpoint_pb2.LbEndpoint]:
    snap = srv.cache.snapshot()
    assert snap is not None
    cla = snap.resources[r.ENDPOINT_TYPE][cluster].message
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    return {lb.endpoint.hostname: lb for loc in cla.endpoints for lb in loc.lb_endpoints}


async def test_a_drain_that_ended_while_down_removes_at_start_and_one_that_did_not_keeps_its_end(
    files: Files,
) -> None:
    config, state, doc = files
    ep = [e["address"] for e in doc["endpoints"]]
    now = time.time()
    FleetStateFile(state).save(FleetState().drain(ep[6], now - 5).drain(ep[5], now + 300))
    srv = await _server(config, state)
    try:
        qwen = _lb(srv, "qwen2.5-7b-instruct--v1")
        assert "v100-1" not in qwen  # its drain ended while the server was down
        assert qwen["h100-1"].health_status == health_check_pb2.HealthStatus.DRAINING
        assert srv.fleet.draining[ep[5]] == pytest.approx(now + 300)
        stored = json.loads(state.read_text())
        assert stored["hidden"] == [ep[6]] and list(stored["draining"]) == [ep[5]]
    finally:
        await srv.stop(0)


async def test_undrain_and_reregistering_cancel_a_drain(
    http: tuple[XdsServer, Callable[..., Any]], files: Files,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    srv, call = http
    ep = files[2]["endpoints"]
    key = ep[6]["address"]
    caplog.set_level(logging.INFO, logger="xds_server")
    assert (await call("POST", f"/v1/endpoints/{key}/drain"))[0] == 202
    await wait_until(
        lambda: _lb(srv, "qwen2.5-7b-instruct--v1")["v100-1"].health_status
        == health_check_pb2.HealthStatus.DRAINING,
        "DRAINING",
    )
    status, body = await call("DELETE", f"/v1/endpoints/{key}/drain")
    assert status == 200 and body == {"endpoint": key, "draining": False, "was_draining": True}
    await wait_until(
        lambda: _lb(srv, "qwen2.5-7b-instruct--v1")["v100-1"].health_status
        != health_check_pb2.HealthStatus.DRAINING,
        "served again",
    )
    assert json.loads(files[1].read_text())["draining"] == {}
    assert any(f"what=undrain endpoint={key}" in m for m in caplog.messages)
    # undrain again: nothing to cancel, nothing changes
    assert (await call("DELETE", f"/v1/endpoints/{key}/drain"))[1]["was_draining"] is False
    # drain, then register the same address again: the drain is cancelled
    assert (await call("POST", f"/v1/endpoints/{key}/drain"))[0] == 202
    assert (await call("POST", "/v1/endpoints", ep[6]))[0] == 201
    assert key not in srv.fleet.draining
    # a drain that ended removed the endpoint: undrain is a 404 saying to register it again
    assert (await call("POST", f"/v1/endpoints/{key}/drain", {"drain_ms": 0}))[0] == 202
    await wait_until(lambda: "v100-1" not in _lb(srv, "qwen2.5-7b-instruct--v1"), "removed")
    status, body = await call("DELETE", f"/v1/endpoints/{key}/drain")
    assert status == 404 and "register it again" in body["error"]["message"]
    assert (await call("POST", "/v1/endpoints", ep[6]))[0] == 201
    await wait_until(lambda: "v100-1" in _lb(srv, "qwen2.5-7b-instruct--v1"), "back")


async def test_a_drain_survives_a_config_reload_and_is_forgotten_with_its_endpoint(
    http: tuple[XdsServer, Callable[..., Any]], files: Files,
) -> None:  # fmt: skip
    srv, call = http
    config, state, doc = files
    key = doc["endpoints"][6]["address"]
    assert (await call("POST", f"/v1/endpoints/{key}/drain"))[0] == 202
    doc["gpu_profiles"]["H100"] = {"relative_capacity": 4.0}
    write_config(config, doc)
    await wait_until(lambda: _lb(srv, "qwen2.5-7b-instruct--v1")["h100-1"].load_balancing_weight.value == 40,
                     "the reload")  # fmt: skip
    assert key in srv.fleet.draining
    doc["endpoints"] = [e for e in doc["endpoints"] if e["address"] != key]
    write_config(config, doc)
    await wait_until(lambda: key not in srv.fleet.draining, "the drain forgotten with its endpoint")
    # a reload's reconciliation is served first and stored right after (a derived state: a failed write is
    # logged, not raised), so the file follows a moment later
    await wait_until(lambda: json.loads(state.read_text())["draining"] == {}, "the stored drain forgotten")


async def test_a_change_that_cannot_be_stored_changes_nothing(
    http: tuple[XdsServer, Callable[..., Any]], files: Files,
) -> None:  # fmt: skip
    srv, call = http
    state = files[1]
    key = files[2]["endpoints"][5]["address"]
    blocker = state.with_name(f".{state.name}.{os.getpid()}.tmp")  # this process's server
    blocker.mkdir()  # the temporary file cannot be created, for any user
    status, body = await call("PUT", f"/v1/endpoints/{key}/weight", {"weight": 7})
    assert status == 500 and body["error"]["code"] == "fleet_state_not_stored"
    assert str(state) in body["error"]["message"]
    assert key not in srv.fleet.weight_overrides
    blocker.rmdir()
    assert (await call("PUT", f"/v1/endpoints/{key}/weight", {"weight": 7}))[0] == 200
    assert json.loads(state.read_text())["weight_overrides"] == {key: 7}


async def test_stored_changes_that_no_longer_fit_the_config_stop_the_start_naming_both(files: Files) -> None:
    config, state, _ = files
    gone = EndpointConfig.model_validate({"address": "127.0.0.9:9", "model": "removed-model", "gpu": "H100"})
    FleetStateFile(state).save(FleetState().register(gone))
    srv = XdsServer(config, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), state_file=state)
    with pytest.raises(ConfigError) as err:
        await srv.start()
    await srv.stop(0)
    assert err.value.source == f"{config} with the fleet API changes stored in {state}"
    assert any(f.endswith(".model") and "removed-model" in m for f, m in err.value.problems)
    probe = FleetStateFile(state)
    probe.lock()  # the failed start let go of the file
    probe.close()
