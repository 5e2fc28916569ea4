"""Bind on every interface, advertise another address: the whole stack with the xDS server, the
request-path service and its settler bound to ``0.0.0.0`` serves a chat through the real Envoy, which
dials the advertised addresses; and the Kubernetes deployment's bootstrap, rendered as its init container
renders it, is one Envoy accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf import json_format

from inferlb.config.schema import HostPort, load_config
from inferlb.ops.stack import clusters_json, find_envoy
from tests.conftest import make_config_doc
from tests.e2e.conftest import in_mode, started_stack
from xds_server.bootstrap import render_bootstrap
from xds_server.resources.clusters import build_clusters
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, EXT_PROC_CLUSTER
from xds_server.resources.listener import build_listener

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _split(doc_section: dict[str, str], listen: str, advertise: str) -> None:
    hp = HostPort.model_validate(doc_section[listen])
    doc_section[listen] = f"0.0.0.0:{hp.port}"
    doc_section[advertise] = f"127.0.0.1:{hp.port}"


def test_stack_bound_to_every_interface_serves_through_the_advertised_addresses(
    tmp_path: Path, request_path: str
) -> None:
    doc = in_mode(make_config_doc(), request_path)
    _split(doc["xds"], "listen", "advertise")
    _split(doc["ext_proc"], "listen", "advertise")
    if "meter_listen" in doc["ext_proc"]:
        _split(doc["ext_proc"], "meter_listen", "meter_advertise")
    with started_stack(tmp_path, doc) as rs:
        r = rs.chat("qwen2.5-7b-instruct")
        assert r.status == 200, r.body
        assert r.json()["choices"][0]["message"]["content"]
        assert rs.config.xds.listen.is_unspecified and rs.config.ext_proc.listen.is_unspecified
        name = EXT_AUTHZ_CLUSTER if request_path == "ext_authz" else EXT_PROC_CLUSTER
        (cluster,) = [c for c in clusters_json(rs.config)["cluster_statuses"] if c["name"] == name]
        [host] = cluster["host_statuses"]
        port = rs.config.ext_proc.listen.port
        assert host["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": port}


def test_the_kubernetes_bootstrap_is_valid_for_envoy(tmp_path: Path) -> None:
    # the init container's command (deploy/kubernetes/base/envoy.yaml) on the ConfigMap's file
    config = ROOT / "deploy" / "kubernetes" / "base" / "inferlb.yaml"
    cmd = [sys.executable, "-m", "inferlb", "bootstrap", str(config), "--node-id", "inferlb-envoy-0"]
    bootstrap = tmp_path / "bootstrap.yaml"
    bootstrap.write_text(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout)
    assert "inferlb-xds.inferlb.svc.cluster.local" in bootstrap.read_text()
    out = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(bootstrap)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_envoy_accepts_the_kubernetes_configs_clusters_and_listener(tmp_path: Path) -> None:
    # what the xDS server would serve for the ConfigMap's config, as static resources of its bootstrap:
    # the request-path cluster on the headless Service (STRICT_DNS) and the gateway listener on 0.0.0.0
    config = load_config(ROOT / "deploy" / "kubernetes" / "base" / "inferlb.yaml")
    b = render_bootstrap(config, node_id="inferlb-envoy-0")
    clusters = build_clusters(config)
    [rp] = [c for c in clusters if c.name == EXT_PROC_CLUSTER]
    assert rp.type == cluster_pb2.Cluster.STRICT_DNS
    b["static_resources"]["clusters"] += [json_format.MessageToDict(c) for c in clusters]
    listener = json_format.MessageToDict(build_listener(config))
    b["static_resources"]["listeners"] = [listener]
    b["admin"]["address"]["socket_address"]["address"] = (
        "127.0.0.1"  # validate binds nothing; stay on loopback
    )
    bootstrap = tmp_path / "bootstrap.json"
    bootstrap.write_text(json.dumps(b))
    out = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(bootstrap)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
