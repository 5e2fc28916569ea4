"""The xDS server with ``discovery.kubernetes`` against the API server emulator: discovered endpoints join
the fleet state and the EDS snapshot (DRAINING when terminating), leave it when deleted, compose with the
fleet API and config reloads, and the ones the config cannot serve are left out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from inferlb.config.schema import default_config_path
from inferlb.errors import ConfigError
from tests.conftest import wait_until
from tests.kube_emulator import KubeEmulator
from xds_server import resources as r
from xds_server.server import XdsServer

LLAMA_V1 = "llama-3.1-8b-instruct--v1"
QWEN = "qwen2.5-7b-instruct--v1"
TOKEN = "k8s-discovery-token-0123456789"


def _doc(kubeconfig: Path) -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["xds"]["push_debounce_ms"] = 20
    doc["discovery"] = {
        "kubernetes": {
            "namespace": "default",
            "services": ["llama"],
            "inference_pools": ["qwen-pool"],
            "kubeconfig": str(kubeconfig),
            "backoff_base_ms": 20,
            "backoff_max_ms": 200,
        }
    }
    return doc


def _hosts(server: XdsServer, cluster: str) -> dict[str, endpoint_pb2.LbEndpoint]:
    """``host:port`` -> LbEndpoint of one cluster in the published snapshot."""
    snap = server.cache.snapshot()
    assert snap is not None
    cla = snap.resources[r.ENDPOINT_TYPE][cluster].message
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    out = {}
    for loc in cla.endpoints:
        for lb in loc.lb_endpoints:
            sa = lb.endpoint.address.socket_address
            out[f"{sa.address}:{sa.port_value}"] = lb
    return out


def _draining(server: XdsServer, cluster: str, key: str) -> bool | None:
    lb = _hosts(server, cluster).get(key)
    return None if lb is None else lb.health_status == health_check_pb2.DRAINING


def _edit(config_file: Path, **xds: Any) -> None:
    doc = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    doc["xds"].update(xds)
    config_file.write_text(yaml.safe_dump(doc), encoding="utf-8")


@pytest.fixture
async def emulator() -> AsyncIterator[KubeEmulator]:
    emu = KubeEmulator()
    await emu.start()
    try:
        yield emu
    finally:
        await emu.stop()


@pytest.fixture
def config_file(tmp_path: Path, emulator: KubeEmulator) -> Path:
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(_doc(emulator.kubeconfig(tmp_path / "kubeconfig"))), encoding="utf-8")
    return path


@pytest.fixture
async def server(config_file: Path) -> AsyncIterator[XdsServer]:
    srv = XdsServer(config_file, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), poll_interval_s=0.05)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(0)


async def test_discovered_endpoints_join_the_fleet_and_the_snapshot(
    emulator: KubeEmulator, server: XdsServer
) -> None:
    file_keys = {str(e.address) for e in server.file_config.endpoints} if server.file_config else set()
    emulator.replay("endpointslices.jsonl", "initial")
    emulator.replay("inferencepool.jsonl", "initial")
    await wait_until(lambda: "127.0.1.2:8000" in _hosts(server, LLAMA_V1), "the slice's endpoints in EDS")
    await wait_until(lambda: "127.0.2.2:8001" in _hosts(server, QWEN), "the pool's endpoints in EDS")
    assert server.effective is not None
    served = {str(e.address): e for e in server.effective.endpoints}
    discovered = {"127.0.1.1:8000", "127.0.1.2:8000", "127.0.2.1:8000", "127.0.2.1:8001", "127.0.2.2:8000",
                  "127.0.2.2:8001"}  # fmt: skip
    assert set(served) == file_keys | discovered
    assert (served["127.0.1.1:8000"].gpu, served["127.0.2.2:8000"].gpu) == ("A100", "V100")
    assert _draining(server, LLAMA_V1, "127.0.1.1:8000") is False
    # capacity weights follow the GPU profile: an A100 next to the file's A100s weighs the same
    assert (
        _hosts(server, LLAMA_V1)["127.0.1.1:8000"].load_balancing_weight.value
        == _hosts(server, LLAMA_V1)["127.0.0.1:8002"].load_balancing_weight.value
    )

    emulator.replay("endpointslices.jsonl", "added")
    emulator.replay("endpointslices.jsonl", "terminating")
    await wait_until(
        lambda: _draining(server, LLAMA_V1, "127.0.1.2:8000") is True, "the terminating one DRAINING"
    )
    emulator.replay("inferencepool.jsonl", "added_not_ready")
    await wait_until(lambda: _draining(server, QWEN, "127.0.2.3:8000") is True, "the not-ready pod DRAINING")
    emulator.replay("endpointslices.jsonl", "removed")
    await wait_until(lambda: "127.0.1.2:8000" not in _hosts(server, LLAMA_V1), "the removed endpoint gone")
    assert "127.0.1.3:8000" in _hosts(server, LLAMA_V1)
    assert file_keys <= {str(e.address) for e in server.effective.endpoints}  # the file's still served


async def test_fleet_api_and_reloads_compose_with_discovery(
    emulator: KubeEmulator, server: XdsServer, config_file: Path
) -> None:
    emulator.replay("inferencepool.jsonl", "initial")
    await wait_until(lambda: "127.0.2.1:8000" in _hosts(server, QWEN), "the pool's endpoints")
    # the fleet API knows the discovered endpoints: a weight pin and a drain
    await server.override_weight("127.0.2.1:8000", 77, actor="test")
    await wait_until(
        lambda: _hosts(server, QWEN)["127.0.2.1:8000"].load_balancing_weight.value == 77, "the pin"
    )
    await server.drain_endpoint("127.0.2.2:8000", 60_000, actor="test")
    await wait_until(lambda: _draining(server, QWEN, "127.0.2.2:8000") is True, "the API drain")
    # a config edit keeps serving them (and the pin)
    _edit(config_file, drain_period_ms=12_345)
    await wait_until(
        lambda: server.config is not None and server.config.xds.drain_period_ms == 12_345, "reload"
    )
    assert _hosts(server, QWEN)["127.0.2.1:8000"].load_balancing_weight.value == 77
    # the pod goes away: its pin is forgotten with it
    emulator.replay("inferencepool.jsonl", "added_not_ready")
    emulator.replay("inferencepool.jsonl", "ready")
    emulator.replay("inferencepool.jsonl", "terminating")
    emulator.replay("inferencepool.jsonl", "deleted")
    await wait_until(lambda: "127.0.2.1:8000" not in _hosts(server, QWEN), "the deleted pod gone")
    assert "127.0.2.1:8000" not in server.fleet.weight_overrides


async def test_endpoints_the_config_cannot_serve_are_left_out(
    emulator: KubeEmulator, server: XdsServer
) -> None:
    emulator.replay("inferencepool.jsonl", "initial")
    emulator.replay("endpointslices.jsonl", "initial")
    bad = {"type": "MODIFIED", "resource": "endpointslices", "object": {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "llama-abcde", "namespace": "default", "labels": {
            "kubernetes.io/service-name": "llama", "inferlb.io/model": "no-such-model"}},
        "addressType": "IPv4", "ports": [{"port": 8000}],
        "endpoints": [{"addresses": ["127.0.1.1"], "conditions": {"ready": True}}]}}  # fmt: skip
    await wait_until(lambda: "127.0.1.1:8000" in _hosts(server, LLAMA_V1), "the slice's endpoints")
    emulator.apply(bad)
    await wait_until(lambda: "127.0.1.1:8000" not in _hosts(server, LLAMA_V1), "the unservable endpoint out")
    assert "127.0.2.1:8000" in _hosts(server, QWEN)  # the others keep serving
    assert any("no-such-model" in p for p in server.discovered.problems)


async def test_unreadable_kubeconfig_fails_the_start_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(_doc(tmp_path / "no-such-kubeconfig")), encoding="utf-8")
    srv = XdsServer(path, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0))
    try:
        with pytest.raises(ConfigError) as err:
            await srv.start()
        assert [f for f, _ in err.value.problems] == ["discovery.kubernetes.kubeconfig"]
        assert "cannot read Kubernetes credentials" in err.value.problems[0][1]
    finally:
        await srv.stop(0)


async def test_fleet_listing_names_kubernetes_as_the_source(
    emulator: KubeEmulator, config_file: Path
) -> None:
    srv = XdsServer(
        config_file, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), api_token=TOKEN, poll_interval_s=0.05
    )
    await srv.start()
    try:
        emulator.replay("endpointslices.jsonl", "initial")
        emulator.replay("endpointslices.jsonl", "added")
        emulator.replay("endpointslices.jsonl", "terminating")
        await wait_until(lambda: _draining(srv, LLAMA_V1, "127.0.1.2:8000") is True, "the terminating one")
        url = f"http://127.0.0.1:{srv.api_port}/v1/endpoints"
        async with (
            aiohttp.ClientSession() as s,
            s.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp,
        ):
            assert resp.status == 200
            rows = {row["key"]: row for row in (await resp.json())["endpoints"]}
        term, ok, file_row = rows["127.0.1.2:8000"], rows["127.0.1.3:8000"], rows["127.0.0.1:8001"]
        assert (term["source"], term["draining"], term["drain_ends_at"]) == ("kubernetes", True, None)
        assert term["discovered_from"] == "EndpointSlice default/llama-abcde"
        assert (ok["source"], ok["draining"], ok["name"]) == ("kubernetes", False, "default/llama-2:8000")
        assert (file_row["source"], file_row["discovered_from"]) == ("config", None)
    finally:
        await srv.stop(0)
