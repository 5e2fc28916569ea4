"""The real Envoy binary driven by our xDS server: weights in /clusters, live pushes, a NACK, the 404 route.

The xDS server runs in-process (in the test's event loop) so the test can read its counters and publish
a snapshot Envoy must reject; Envoy runs as a child process with a bootstrap from
:func:`xds_server.bootstrap.render_bootstrap`. No ext_proc runs: the config fails open, so every request
ends on the catch-all 404 route, which is what we want to see for client-sent routing headers.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2

from inferlb.config.schema import default_config_path, load_config
from inferlb.ops.stack import free_ports
from tests.e2e.conftest import spawn_envoy
from xds_server import resources as r
from xds_server.bootstrap import render_bootstrap
from xds_server.server import XdsServer

pytestmark = pytest.mark.e2e

WAIT_S = 20.0
MODEL_CLUSTERS = ("llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1")
T = TypeVar("T")


def _http(url: str, *, headers: dict[str, str] | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def _poll(
    fetch: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str, timeout_s: float = WAIT_S
) -> T:
    """Call ``fetch`` until ``ok`` holds for its result, at most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        try:
            last = await fetch()
        except OSError:
            last = None
        if last is not None and ok(last):
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last seen: {last!r}")


@dataclass
class Stack:
    xds: XdsServer
    envoy: asyncio.subprocess.Process
    config_file: Path
    doc: dict[str, Any]
    admin: str
    gateway: str
    log: Path

    async def admin_get(self, path: str) -> bytes:
        status, body = await asyncio.to_thread(_http, self.admin + path)
        if status != 200:
            raise OSError(f"admin {path}: HTTP {status}")
        return body

    async def weights(self) -> dict[str, dict[str, int]]:
        """``{cluster: {hostname: weight}}`` from Envoy's ``/clusters?format=json``."""
        data = json.loads(await self.admin_get("/clusters?format=json"))
        return {
            c["name"]: {h.get("hostname", ""): int(h.get("weight", 0)) for h in c.get("host_statuses", [])}
            for c in data.get("cluster_statuses", [])
            if c["name"] in MODEL_CLUSTERS
        }

    async def stats(self) -> dict[str, int]:
        text = (await self.admin_get("/stats?usedonly")).decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name] = int(value)
        return out

    def write_config(self) -> None:
        self.config_file.write_text(yaml.safe_dump(self.doc), encoding="utf-8")


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    gw, admin, xds, ext_proc, *eps = free_ports(4 + 8)
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["gateway"].update(listen=f"127.0.0.1:{gw}", admin=f"127.0.0.1:{admin}", node_cluster="e2e-gateways")
    doc["xds"]["listen"] = f"127.0.0.1:{xds}"
    # no ext_proc runs here: fail open so requests reach the router (and its catch-all route)
    doc["ext_proc"].update(listen=f"127.0.0.1:{ext_proc}", failure_mode_allow=True)
    for endpoint, port in zip(doc["endpoints"], eps, strict=True):
        endpoint["address"] = f"127.0.0.1:{port}"  # nothing listens: /clusters shows them all the same
    config_file = tmp_path / "inferlb.yaml"
    config_file.write_text(yaml.safe_dump(doc), encoding="utf-8")
    server = XdsServer(config_file, poll_interval_s=0.1, api_bind=("127.0.0.1", 0))
    await server.start()
    bootstrap = tmp_path / "bootstrap.yaml"
    bootstrap.write_text(yaml.safe_dump(render_bootstrap(load_config(config_file), node_id="e2e-envoy")))
    log = tmp_path / "envoy.log"
    envoy = await spawn_envoy(bootstrap, log)
    try:
        yield Stack(
            xds=server,
            envoy=envoy,
            config_file=config_file,
            doc=doc,
            admin=f"http://127.0.0.1:{admin}",
            gateway=f"http://127.0.0.1:{gw}",
            log=log,
        )
    finally:
        if envoy.returncode is None:
            envoy.kill()
        await asyncio.wait_for(envoy.wait(), WAIT_S)
        await server.stop(0)


EXPECTED_WEIGHTS = {
    "llama-3.1-8b-instruct--v1": {"h100-0": 34, "a100-0": 17, "a100-1": 17, "v100-0": 10},
    "llama-3.1-8b-instruct--v2": {"a100-2": 17},
    "qwen2.5-7b-instruct--v1": {"h100-1": 34, "v100-1": 10, "v100-2": 10},
}


async def _dynamic_cluster(stack: Stack, name: str) -> dict[str, Any]:
    dump = json.loads(await stack.admin_get("/config_dump?resource=dynamic_active_clusters"))
    for entry in dump.get("configs", []):
        cluster = entry.get("cluster", {})
        if cluster.get("name") == name:
            assert isinstance(cluster, dict)
            return cluster
    raise OSError(f"cluster {name} not in config_dump")


async def _eds_version(stack: Stack) -> str:
    snap = stack.xds.cache.snapshot()
    assert snap is not None
    return snap.version(r.ENDPOINT_TYPE)


async def test_envoy_takes_config_weights_pushes_and_survives_a_nack(stack: Stack) -> None:
    # 1. the weights of the config are what Envoy balances on
    await _poll(stack.weights, lambda w: w == EXPECTED_WEIGHTS, "Envoy /clusters to show the config weights")
    ready = await _poll(
        stack.stats,
        lambda s: (
            s.get("listener_manager.total_listeners_active") == 1
            and s.get("control_plane.connected_state") == 1
            # a listener counts as active before the workers start accepting on it (connection
            # refused in between): the workers' gauge says when the gateway port takes connections
            and s.get("listener_manager.workers_started") == 1
        ),
        "the listener to be active on started workers",
    )
    cds_before = ready["cluster_manager.cds.update_success"]
    assert ready.get("cluster_manager.warming_clusters", 0) == 0

    # 2. a client-sent routing header is stripped before routing: with no ext_proc running (fail-open),
    #    Envoy checks the key itself (none here: 401 OpenAI JSON) and then routes by the body's model (an
    #    unknown one: 404), never by the client's x-inferlb-model
    spoofed = {
        "x-inferlb-model": "qwen2.5-7b-instruct",
        "x-inferlb-version": "v1",
        "content-type": "application/json",
    }
    status, body = await asyncio.to_thread(
        _http,
        stack.gateway + "/v1/chat/completions",
        headers=spoofed,
        body=b'{"model": "qwen2.5-7b-instruct", "messages": []}',
    )
    assert status == 401
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    status, body = await asyncio.to_thread(
        _http,
        stack.gateway + "/v1/chat/completions",
        headers={**spoofed, "authorization": "Bearer sk-demo-a"},
        body=b'{"model": "no-such-model", "messages": []}',
    )
    assert status == 404
    assert json.loads(body)["error"]["code"] == "model_not_found"

    # 3. a config edit (a weight and a cluster setting) is pushed live; the changed clusters warm and
    #    come back with their endpoints (EDS resent after CDS)
    stack.doc["gpu_profiles"]["V100"]["relative_capacity"] = 1.5
    stack.doc["models"][1]["cluster"] = {"healthy_panic_threshold": 10}
    stack.write_config()
    changed = {
        c: {h: (15 if h.startswith("v100") else w) for h, w in hosts.items()}
        for c, hosts in EXPECTED_WEIGHTS.items()
    }
    await _poll(stack.weights, lambda w: w == changed, "the changed weights to show in /clusters")
    qwen = await _poll(
        lambda: _dynamic_cluster(stack, "qwen2.5-7b-instruct--v1"),
        lambda c: c.get("common_lb_config", {}).get("healthy_panic_threshold", {}).get("value") == 10,
        "the new panic threshold in config_dump",
    )
    assert qwen["outlier_detection"]["enforcing_consecutive_gateway_failure"] == 100
    after = await _poll(
        stack.stats,
        lambda s: (
            s["cluster_manager.cds.update_success"] > cds_before
            and s.get("cluster_manager.warming_clusters", 0) == 0
        ),
        "a CDS update with no cluster left warming",
    )
    rejected = {k: v for k, v in after.items() if k.endswith("update_rejected") and v}
    assert rejected == {}
    assert stack.xds.servicer.stats.nacks == 0

    # 3b. a cluster-only change: the endpoint version does not change, yet the re-created cluster must get
    #     its assignment again to leave warming (the server resends endpoints after clusters)
    eds_version = await _eds_version(stack)
    stack.doc["models"][1]["cluster"] = {"healthy_panic_threshold": 12}
    stack.write_config()
    await _poll(
        lambda: _dynamic_cluster(stack, "qwen2.5-7b-instruct--v1"),
        lambda c: c.get("common_lb_config", {}).get("healthy_panic_threshold", {}).get("value") == 12,
        "the cluster-only change in config_dump",
    )
    after = await _poll(
        stack.stats,
        lambda s: (
            s["cluster_manager.cds.update_success"] > after["cluster_manager.cds.update_success"]
            and s.get("cluster_manager.warming_clusters", 0) == 0
        ),
        "the re-created cluster to leave warming",
        # Envoy gives up waiting for an assignment after its 15 s initial_fetch_timeout: leaving warming
        # well before that means the endpoints were resent, not timed out
        timeout_s=8.0,
    )
    assert after.get("cluster.qwen2.5-7b-instruct--v1.init_fetch_timeout", 0) == 0
    assert await _eds_version(stack) == eds_version
    assert (await stack.weights()) == changed

    # 4. a snapshot Envoy must reject (least-request choice_count 1 < 2) is NACKed, counted, not resent,
    #    and the last good clusters keep serving
    assert stack.xds.config is not None
    res = r.build_resources(stack.xds.config)
    clusters = dict(res.by_type[r.CLUSTER_TYPE])
    bad = cluster_pb2.Cluster()
    bad.CopyFrom(clusters["llama-3.1-8b-instruct--v1"])
    bad.least_request_lb_config.choice_count.value = 1
    clusters[bad.name] = bad
    stack.xds.cache.set_resources(r.XdsResources(by_type={**res.by_type, r.CLUSTER_TYPE: clusters}))
    await _poll(
        stack.stats,
        lambda s: s.get("cluster_manager.cds.update_rejected") == 1,
        "Envoy to reject the bad clusters",
    )
    await _poll(
        lambda: asyncio.sleep(0, stack.xds.servicer.stats.nacks),
        lambda n: n == 1,
        "the server to count the NACK",
    )
    sent = stack.xds.servicer.stats.responses_sent
    await asyncio.sleep(1.0)  # a NACK loop would resend within milliseconds
    assert stack.xds.servicer.stats.responses_sent == sent
    assert stack.xds.servicer.stats.nacks == 1
    assert (await stack.weights()) == changed

    # 5. the next good config is taken
    stack.doc["gpu_profiles"]["H100"]["relative_capacity"] = 4.0
    stack.write_config()
    final = {
        c: {h: (40 if h.startswith("h100") else w) for h, w in hosts.items()} for c, hosts in changed.items()
    }
    await _poll(stack.weights, lambda w: w == final, "the next good config after the NACK")
    last = await _poll(
        stack.stats,
        lambda s: s["cluster_manager.cds.update_success"] > after["cluster_manager.cds.update_success"],
        "CDS to accept the good clusters again",
    )
    assert last["cluster_manager.cds.update_rejected"] == 1
    assert stack.envoy.returncode is None, stack.log.read_text(errors="replace")
