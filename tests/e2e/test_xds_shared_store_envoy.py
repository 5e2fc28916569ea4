"""Two xDS servers sharing one Redis fleet store, one real Envoy on each: a drain made through server A's API
stops traffic to that endpoint through Envoy B, which only server B feeds.

The whole stack (gpusim, ext_proc, xds_server A, Envoy A) runs from one config with
``xds.state_redis_url``; server B is a second ``python -m xds_server`` on the same fleet and store, on its
own ports, and Envoy B (bootstrap from :func:`xds_server.bootstrap.render_bootstrap`, its own listener and
admin ports) reaches the same ext_proc and GPUs. Each reply names the GPU that served it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from inferlb.config.schema import load_config
from inferlb.ops.redis_server import RedisServer
from inferlb.ops.stack import free_ports
from tests.conftest import make_config_doc, redis_or_skip, write_config
from tests.e2e.conftest import RunningStack, http_request, spawn_envoy, started_stack
from xds_server.bootstrap import render_bootstrap

pytestmark = pytest.mark.e2e

TOKEN = "e2e-shared-store-token-0123"
MODEL = "qwen2.5-7b-instruct"
WAIT_S = 30.0


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_or_skip(tmp_path_factory.mktemp("redis"), appendonly=True) as server:
        yield server


def _served(gateway: str, n: int) -> Counter[str]:
    """Which GPU served each of ``n`` chat requests through ``gateway`` (``!<status>`` for a failure)."""
    out: Counter[str] = Counter()
    for _ in range(n):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        reply = http_request(
            gateway, "POST", "/v1/chat/completions", body, {"Authorization": "Bearer sk-demo-a"}
        )
        out[reply.headers.get("x-inferlb-endpoint", "?") if reply.status == 200 else f"!{reply.status}"] += 1
    return out


def _eds_health(admin: str, host: str) -> str:
    """Envoy's EDS health of ``host`` (``host:port``) in any cluster; ``absent`` when it holds none."""
    data = json.loads(http_request(admin, "GET", "/clusters?format=json").body)
    for c in data.get("cluster_statuses", []):
        for h in c.get("host_statuses", []):
            sock = h["address"]["socket_address"]
            if f"{sock['address']}:{sock['port_value']}" == host:
                return str(h.get("health_status", {}).get("eds_health_status", "HEALTHY"))
    return "absent"


def _until(what: str, check: object, timeout_s: float = WAIT_S) -> float:
    deadline = time.monotonic() + timeout_s
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return time.monotonic() - t0
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def test_a_drain_through_server_a_stops_traffic_through_envoy_b(
    tmp_path: Path, redis: RedisServer
) -> None:
    doc = make_config_doc()
    doc["xds"].update(api_token=TOKEN, push_debounce_ms=20, drain_period_ms=600_000)
    doc["xds"].update(state_redis_url=redis.url, state_redis_poll_ms=200)
    (tmp_path / "a").mkdir()
    with started_stack(tmp_path / "a", doc) as rs:
        await _second_server_and_envoy(rs, tmp_path)


async def _second_server_and_envoy(rs: RunningStack, tmp_path: Path) -> None:
    doc_b = copy.deepcopy(rs.doc)
    xds, api, gw, admin = free_ports(4)
    doc_b["xds"].update(listen=f"127.0.0.1:{xds}", api_listen=f"127.0.0.1:{api}")
    doc_b["gateway"].update(listen=f"127.0.0.1:{gw}", admin=f"127.0.0.1:{admin}")
    conf_b = write_config(tmp_path / "b.yaml", doc_b)
    (tmp_path / "b").mkdir()
    with (tmp_path / "b" / "xds_server.log").open("wb") as log:
        server_b = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "xds_server", "--config", str(conf_b),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    envoy_b = None
    try:
        boot = render_bootstrap(load_config(conf_b), node_id="gateway-b")
        boot_path = tmp_path / "b" / "envoy.yaml"
        boot_path.write_text(yaml.safe_dump(boot), encoding="utf-8")
        envoy_b = await spawn_envoy(boot_path, tmp_path / "b" / "envoy.log")
        gateway_b, admin_b = f"127.0.0.1:{gw}", f"127.0.0.1:{admin}"
        h100 = next(e["address"] for e in rs.doc["endpoints"] if e["name"] == "h100-1")
        served_by = {e["name"] for e in rs.doc["endpoints"] if e["model"] == MODEL}
        await asyncio.to_thread(_until, "Envoy B serving", lambda: set(_served(gateway_b, 2)) <= served_by)
        before = await asyncio.to_thread(_served, gateway_b, 40)
        assert before["h100-1"] > 0, before  # the biggest qwen GPU takes its share through Envoy B

        drain = http_request(str(rs.config.xds.api_listen), "POST", f"/v1/endpoints/{h100}/drain", {},
                             {"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        assert drain.status == 202, drain.body
        took = await asyncio.to_thread(
            _until, "Envoy B holding the drain", lambda: _eds_health(admin_b, h100) == "DRAINING"
        )
        assert took < 2.0, f"the drain reached Envoy B after {took:.2f} s"
        after = await asyncio.to_thread(_served, gateway_b, 40)
        assert after["h100-1"] == 0 and sum(after.values()) == 40, after
        assert all(not k.startswith("!") for k in after), after
        # Envoy A, fed by server A, holds the same drain
        assert _eds_health(str(rs.config.gateway.admin), h100) == "DRAINING"
    finally:
        if envoy_b is not None and envoy_b.returncode is None:
            envoy_b.kill()
            await asyncio.wait_for(envoy_b.wait(), WAIT_S)
        server_b.terminate()
        try:
            await asyncio.wait_for(server_b.wait(), 15)
        except TimeoutError:
            server_b.kill()
            await asyncio.wait_for(server_b.wait(), 15)
