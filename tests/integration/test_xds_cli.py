"""``inferlb xds clients`` against an in-process xDS server with one SotW and one Delta stream."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from inferlb.config.schema import default_config_path
from inferlb.ops import cli
from xds_server import resources as r
from xds_server.server import XdsServer

TOKEN = "cli-test-token-0123456789"
WAIT_S = 5.0


async def test_xds_clients_lists_each_envoy_with_acked_versions_and_last_nack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one table row per client, unwrapped
    path = tmp_path / "inferlb.yaml"
    path.write_text(default_config_path().read_text(encoding="utf-8"), encoding="utf-8")
    server = XdsServer(path, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), api_token=TOKEN)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    sotw = stub.StreamAggregatedResources()
    delta = stub.DeltaAggregatedResources()
    try:
        await sotw.write(
            discovery_pb2.DiscoveryRequest(
                type_url=r.CLUSTER_TYPE, node=base_pb2.Node(id="gw-sotw", cluster="c1")
            )
        )
        cds = await asyncio.wait_for(sotw.read(), WAIT_S)
        await sotw.write(
            discovery_pb2.DiscoveryRequest(
                type_url=r.CLUSTER_TYPE, response_nonce=cds.nonce, version_info=cds.version_info
            )
        )
        await delta.write(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=r.CLUSTER_TYPE, node=base_pb2.Node(id="gw-delta", cluster="c2")
            )
        )
        dcds = await asyncio.wait_for(delta.read(), WAIT_S)
        await delta.write(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=r.CLUSTER_TYPE,
                response_nonce=dcds.nonce,
                error_detail=status_pb2.Status(code=3, message="cluster rejected by the test"),
            )
        )
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while server.servicer.stats.acks < 1 or server.servicer.stats.nacks < 1:
            assert asyncio.get_running_loop().time() < deadline, "ACK and NACK not seen"
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{server.api_port}"
        code = await asyncio.to_thread(cli.main, ["xds", "clients", "--url", url, "--token", TOKEN, "--json"])
        assert code == 0
        clients = {c["node_id"]: c for c in json.loads(capsys.readouterr().out)}
        assert clients["gw-sotw"]["mode"] == "sotw"
        assert clients["gw-sotw"]["types"]["Cluster"]["acked_version"] == cds.version_info
        assert clients["gw-sotw"]["last_nack"] is None
        assert clients["gw-delta"]["mode"] == "delta"
        assert clients["gw-delta"]["last_nack"]["error_message"] == "cluster rejected by the test"
        assert clients["gw-delta"]["types"]["Cluster"]["nacked_version"] == dcds.system_version_info

        code = await asyncio.to_thread(cli.main, ["xds", "clients", "--url", url, "--token", TOKEN])
        table = capsys.readouterr().out
        assert code == 0
        assert "gw-sotw" in table and "gw-delta" in table and "cluster rejected by the test" in table
        # a wrong token is a run-time failure (exit 1) with the server's answer shown
        code = await asyncio.to_thread(cli.main, ["xds", "clients", "--url", url, "--token", "x" * 20])
        assert code == 1
        assert "401" in capsys.readouterr().out
    finally:
        sotw.cancel()
        delta.cancel()
        await channel.close()
        await server.stop(0)


def test_bootstrap_verb_renders_delta_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bootstrap", "--ads-mode", "delta"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["dynamic_resources"]["ads_config"]["api_type"] == "DELTA_GRPC"
