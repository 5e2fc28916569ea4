"""deploy/prometheus/kubernetes.yml, run by the real Prometheus (Debian's ``prometheus``) over the pods of the
rendered Kubernetes overlay (deploy/kubernetes/overlays/vllm-example).

Debian's Prometheus is built without Kubernetes service discovery, so each job's ``kubernetes_sd_configs`` is
replaced by the targets that discovery would hand it (role ``pod``: one target per container port of every
pod in the namespace, carrying the ``__meta_kubernetes_pod_*`` labels), written as ``static_configs``; the
relabel rules under test are the file's own, applied by Prometheus itself. Nothing listens at the targets'
loopback addresses: the test reads which targets each job keeps, and with which labels, from
``/api/v1/targets``, not their scrapes."""

from __future__ import annotations

import copy
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferlb.config.schema import parse_config
from tests import kustomize_lite

PROMETHEUS = "/usr/bin/prometheus"
ROOT = Path(__file__).resolve().parents[2]
SCRAPE = ROOT / "deploy" / "prometheus" / "kubernetes.yml"
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "vllm-example"
WORKLOADS = frozenset({"Deployment", "StatefulSet", "DaemonSet"})
#: Where each job must find its metrics: (pod label app.kubernetes.io/name, container port name).
EXPECTED = {
    "envoy": ("inferlb-envoy", "http-admin"),
    "xds-server": ("inferlb-xds", "http-api"),
    "request-path": ("inferlb-request-path", "http-metrics"),
    "model-servers": ("vllm-llama-h100", "http"),
    "nvml-agent": ("inferlb-nvml-agent", "metrics"),
}
NODE = "gpu-node-1"


def _label_name(key: str) -> str:
    """A Kubernetes label key as Prometheus names it in ``__meta_kubernetes_pod_label_<name>``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _discovered(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Kubernetes pod discovery would give for one pod of each workload: a target per container port,
    each at a distinct loopback address, with the pod's meta labels."""
    out = []
    for i, w in enumerate(o for o in objects if o["kind"] in WORKLOADS):
        pod = w["spec"]["template"]
        name = f"{w['metadata']['name']}-0"
        meta = {
            f"__meta_kubernetes_pod_label_{_label_name(k)}": v for k, v in pod["metadata"]["labels"].items()
        }
        meta |= {"__meta_kubernetes_pod_name": name, "__meta_kubernetes_pod_node_name": NODE,
                 "__meta_kubernetes_namespace": w["metadata"]["namespace"]}  # fmt: skip
        for c in pod["spec"]["containers"]:
            for p in c.get("ports", []):
                labels = meta | {
                    "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
                }
                out.append({"targets": [f"127.0.{i + 1}.1:{p['containerPort']}"], "labels": labels})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def overlay() -> list[dict[str, Any]]:
    return kustomize_lite.render(OVERLAY)


@pytest.fixture(scope="module")
def active(overlay: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The active targets of the real Prometheus running the file's jobs over the overlay's pods."""
    if shutil.which(PROMETHEUS) is None:
        pytest.skip(f"{PROMETHEUS} is absent (Debian's prometheus package; .ci/run installs it)")
    doc = yaml.safe_load(SCRAPE.read_text(encoding="utf-8"))
    pods = _discovered(overlay)
    for job in doc["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod", "namespaces": {"names": ["inferlb"]}}]
        job["static_configs"] = copy.deepcopy(pods)
    doc["global"]["scrape_interval"] = "1h"  # only the relabelled target list is read
    tmp = tmp_path_factory.mktemp("prom-k8s")
    cfg = tmp / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(doc), encoding="utf-8")
    port = _free_port()
    with (tmp / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--web.listen-address=127.0.0.1:{port}",
             f"--storage.tsdb.path={tmp / 'data'}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            for _ in range(300):  # bounded in count and time
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5) as r:
                        data = json.load(r)["data"]
                    if len(data["activeTargets"]) + len(data["droppedTargets"]) == len(pods) * len(EXPECTED):
                        targets: list[dict[str, Any]] = data["activeTargets"]
                        return targets
                except OSError:
                    pass
                assert proc.poll() is None, (tmp / "prometheus.log").read_text(errors="replace")
                assert time.monotonic() < deadline, "Prometheus did not list its targets within 30 s"
                time.sleep(0.1)
            raise AssertionError("Prometheus did not list its targets")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_the_file_has_one_job_per_component() -> None:
    doc = yaml.safe_load(SCRAPE.read_text(encoding="utf-8"))
    assert [j["job_name"] for j in doc["scrape_configs"]] == list(EXPECTED)


def test_each_job_keeps_exactly_its_components_metrics_port(
    overlay: list[dict[str, Any]], active: list[dict[str, Any]]
) -> None:
    pods = _discovered(overlay)
    by_job: dict[str, list[dict[str, Any]]] = {}
    for t in active:
        by_job.setdefault(t["labels"]["job"], []).append(t)
    assert by_job.keys() == EXPECTED.keys()
    for job, (app, port_name) in EXPECTED.items():
        want = {
            p["targets"][0]
            for p in pods
            if p["labels"].get("__meta_kubernetes_pod_label_app_kubernetes_io_name") == app
            and p["labels"]["__meta_kubernetes_pod_container_port_name"] == port_name
        }
        assert len(want) == 1, (job, want)  # the overlay has that pod and port
        assert {t["discoveredLabels"]["__address__"] for t in by_job[job]} == want, job
        for t in by_job[job]:
            assert t["labels"]["pod"] == t["discoveredLabels"]["__meta_kubernetes_pod_name"]
    # Envoy's admin serves Prometheus text on its own path
    assert all(t["scrapeUrl"].endswith("/stats/prometheus") for t in by_job["envoy"])
    assert {t["labels"]["node"] for t in by_job["nvml-agent"]} == {NODE}


def test_model_server_targets_carry_their_inferlb_endpoint_and_model(
    overlay: list[dict[str, Any]], active: list[dict[str, Any]]
) -> None:
    [cm] = [
        o for o in overlay if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("inferlb-config")
    ]
    config = parse_config(yaml.safe_load(cm["data"]["config.yaml"]), "inferlb-config/config.yaml")
    endpoints = {e.name: e.model for e in config.endpoints}
    servers = [t for t in active if t["labels"]["job"] == "model-servers"]
    assert servers
    for t in servers:
        assert endpoints[t["labels"]["endpoint"]] == t["labels"]["model"]


def test_no_target_is_scraped_twice(active: list[dict[str, Any]]) -> None:
    addresses = [t["discoveredLabels"]["__address__"] for t in active]
    assert len(addresses) == len(set(addresses))
