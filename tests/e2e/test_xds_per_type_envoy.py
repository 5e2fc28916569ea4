"""A real Envoy on the per-type discovery services (``inferlb bootstrap --ads-mode xds``): LDS and CDS from
its bootstrap, EDS and RDS from what the clusters and listener name, each on its own gRPC stream, no ADS.
Envoy takes the config's weights and routes, and follows a live edit (a weight change and a removed
canary cluster) without a NACK."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from inferlb.config.schema import default_config_path, load_config
from inferlb.ops.stack import free_ports
from tests.e2e.conftest import spawn_envoy
from tests.e2e.test_xds_envoy import EXPECTED_WEIGHTS, WAIT_S, Stack, _poll
from xds_server import resources as r
from xds_server.bootstrap import XDS_CLUSTER, render_bootstrap
from xds_server.server import XdsServer

pytestmark = pytest.mark.e2e


async def test_envoy_on_the_per_type_services_follows_config_changes(tmp_path: Path) -> None:
    gw, admin, xds, ext_proc, *eps = free_ports(4 + 8)
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["gateway"].update(listen=f"127.0.0.1:{gw}", admin=f"127.0.0.1:{admin}")
    doc["xds"].update(listen=f"127.0.0.1:{xds}", push_debounce_ms=20)
    doc["ext_proc"].update(listen=f"127.0.0.1:{ext_proc}", failure_mode_allow=True)
    for endpoint, port in zip(doc["endpoints"], eps, strict=True):
        endpoint["address"] = f"127.0.0.1:{port}"
    config_file = tmp_path / "inferlb.yaml"
    config_file.write_text(yaml.safe_dump(doc), encoding="utf-8")
    server = XdsServer(config_file, poll_interval_s=0.1, api_bind=("127.0.0.1", 0))
    await server.start()
    boot = tmp_path / "bootstrap.yaml"
    boot.write_text(yaml.safe_dump(render_bootstrap(load_config(config_file), node_id="e2e-xds", mode="xds")))
    log = tmp_path / "envoy.log"
    envoy = await spawn_envoy(boot, log)
    stack = Stack(
        xds=server,
        envoy=envoy,
        config_file=config_file,
        doc=doc,
        admin=f"http://127.0.0.1:{admin}",
        gateway=f"http://127.0.0.1:{gw}",
        log=log,
    )
    try:
        await _poll(
            stack.weights, lambda w: w == EXPECTED_WEIGHTS, "Envoy to hold the config weights over EDS"
        )
        await _poll(
            stack.stats,
            lambda s: (
                s.get("listener_manager.total_listeners_active") == 1
                and s.get("listener_manager.workers_started") == 1
            ),
            "the listener (its routes over RDS) to be active",
        )
        # every stream is a per-type one (no ADS): CDS, LDS, RDS and one EDS stream or more
        streams = [c.to_json() for c in server.servicer.clients.values()]
        types = sorted({t for c in streams for t in c["types"]})
        assert types == ["Cluster", "ClusterLoadAssignment", "Listener", "RouteConfiguration"]
        assert all(len(c["types"]) == 1 for c in streams), streams
        # what Envoy runs names the per-type services, not ADS
        dump = json.loads(await stack.admin_get("/config_dump?resource=dynamic_active_clusters"))
        cluster = next(
            e["cluster"] for e in dump["configs"] if e["cluster"]["name"] == "qwen2.5-7b-instruct--v1"
        )
        api = cluster["eds_cluster_config"]["eds_config"]["api_config_source"]
        assert api["api_type"] == "GRPC"
        assert api["grpc_services"][0]["envoy_grpc"]["cluster_name"] == XDS_CLUSTER
        routes = json.loads(await stack.admin_get("/config_dump?resource=dynamic_route_configs"))
        assert [c["route_config"]["name"] for c in routes["configs"]] == [r.ROUTE_CONFIG_NAME]

        # a live edit: V100s get more weight and the llama canary (v2) goes away
        doc["gpu_profiles"]["V100"]["relative_capacity"] = 1.5
        doc["models"][0]["versions"] = [{"name": "v1", "traffic_percent": 100}]
        doc["endpoints"] = [e for e in doc["endpoints"] if e.get("version") != "v2"]
        stack.write_config()
        want = {
            "llama-3.1-8b-instruct--v1": {"h100-0": 34, "a100-0": 17, "a100-1": 17, "v100-0": 15},
            "qwen2.5-7b-instruct--v1": {"h100-1": 34, "v100-1": 15, "v100-2": 15},
        }
        await _poll(stack.weights, lambda w: w == want, "Envoy to follow the edit over the per-type streams")
        assert server.servicer.stats.nacks == 0
        assert server.servicer.stats.streams_by_mode["sotw"] >= 4
        assert envoy.returncode is None, log.read_text(errors="replace")
    finally:
        if envoy.returncode is None:
            envoy.kill()
        await asyncio.wait_for(envoy.wait(), WAIT_S)
        await server.stop(0)
