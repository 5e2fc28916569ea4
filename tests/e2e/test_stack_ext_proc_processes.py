"""The stack runs one ext_proc (or ext_authz) process per ``ext_proc.listen``/``extra_listen`` address, each
with its own metrics address (and in ext_authz mode its own settler, ``extra_meter_listen``), and Envoy
spreads requests over them; a killed process stops getting requests (outlier detection, and in ext_authz
mode a retry of a check that never reached it); ``--metrics-listen HOST:0`` picks a free port."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from inferlb.config.schema import HostPort
from inferlb.ops.stack import Child, Stack, StackError, admin_get, clusters_json, free_ports, port_open
from inferlb.ops.status import host_rows
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import http_request, in_mode, stop_stack
from tests.e2e.test_extproc_accounting import process_samples
from xds_server.resources.clusters import REQUEST_PATH_EJECT_AFTER_FAILURES, REQUEST_PATH_EJECTION_MS
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, EXT_PROC_CLUSTER

pytestmark = pytest.mark.e2e

REQUESTS = 24


def _total(metrics_addr: str, name: str) -> float:
    """Sum of metric ``name``'s samples on one request-path process's ``/metrics``."""
    return sum(process_samples(metrics_addr, name).values())


def _doc_without_tenant_limits() -> dict[str, Any]:
    """The test config with every tenant unlimited: with ``quota_backend: memory`` each ext_proc process
    would enforce a limit on its own share, so the config refuses extra processes plus limits. The
    protocol is ext_proc (ext_authz mode meters in one process: extra_listen is refused there)."""
    doc = in_mode(make_config_doc(), "ext_proc")
    doc["tenants"] = [{k: t[k] for k in ("name", "api_keys", "priority")} for t in doc["tenants"]]
    return doc


def _two_process_doc(request_path: str) -> tuple[dict[str, Any], int, int, int]:
    """:func:`_doc_without_tenant_limits` in ``request_path`` mode with a second process; the doc and that
    process's listen, metrics and settler ports."""
    doc = in_mode(_doc_without_tenant_limits(), request_path)
    extra, extra_metrics, extra_meter = free_ports(3)
    doc["ext_proc"]["extra_listen"] = [f"127.0.0.1:{extra}"]
    doc["ext_proc"]["extra_metrics_listen"] = [f"127.0.0.1:{extra_metrics}"]
    doc["ext_proc"]["extra_meter_listen"] = [f"127.0.0.1:{extra_meter}"]
    return doc, extra, extra_metrics, extra_meter


def _chat(stack: Stack, i: int) -> int:
    """One small chat request through the gateway; its status."""
    return http_request(
        str(stack.config.gateway.listen),
        "POST",
        "/v1/chat/completions",
        {"model": "qwen", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
        {"Authorization": "Bearer sk-demo-a"},
        timeout_s=15,
    ).status


def test_each_extra_listen_address_gets_its_own_ext_proc_process(tmp_path: Path, request_path: str) -> None:
    doc, extra, extra_metrics, extra_meter = _two_process_doc(request_path)
    stack = Stack(write_config(tmp_path / "c.yaml", doc), workdir=tmp_path)
    assert ("ext_proc.extra_listen[0]", stack.config.ext_proc.extra_listen[0]) in stack.sockets()
    if request_path == "ext_authz":  # metered (the default): the second process's settler too
        meter = HostPort(host="127.0.0.1", port=extra_meter)
        assert ("ext_proc.extra_meter_listen[0]", meter) in stack.sockets()
    stack.start(timeout_s=60)
    try:
        second = stack.child(f"{request_path}-2")
        assert second.exited() is None
        assert "--listen" in second.argv and f"127.0.0.1:{extra}" in second.argv
        for i in range(REQUESTS):
            assert _chat(stack, i) == 200
        first = _total(str(stack.config.ext_proc.metrics_listen), "inferlb_requests_total")
        other = _total(f"127.0.0.1:{extra_metrics}", "inferlb_requests_total")
        # Envoy round-robins requests over the request-path cluster's two endpoints: both processes work
        assert first > 0 and other > 0, (first, other)
        assert first + other == REQUESTS
        if request_path == "ext_authz":  # each settled its own, at its own settler (one flush later)
            # `inferlb status --all` lists each settler's cluster with its one endpoint
            rows = host_rows(stack.config, clusters_json(stack.config), only_models=False)
            settlers = {r.cluster: r.address for r in rows if r.cluster.startswith("inferlb_meter")}
            assert settlers == {
                "inferlb_meter": str(stack.config.ext_proc.meter_listen),
                "inferlb_meter_1": f"127.0.0.1:{extra_meter}",
            }
            assert stack.drain_envoy()
            got = [
                _total(str(a), "inferlb_meter_settlements_total")
                for a in (stack.config.ext_proc.metrics_listen, f"127.0.0.1:{extra_metrics}")
            ]
            assert got == [first, other]
    finally:
        stop_stack(stack)


def _connect_failures(stack: Stack, cluster: str) -> int:
    """Envoy's ``upstream_cx_connect_fail`` of the request-path cluster ``cluster``."""
    text = admin_get(stack.config, f"/stats?filter=^cluster\\.{cluster}\\.upstream_cx_connect_fail$").decode()
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())


def test_a_killed_process_stops_getting_requests(tmp_path: Path, request_path: str) -> None:
    """Kill -9 one of two processes: requests keep succeeding after at most
    :data:`REQUEST_PATH_EJECT_AFTER_FAILURES` failures (none in ext_authz mode, which sends a check that
    could not connect to the other process), the dead one is ejected, and Envoy stops connecting to it.
    Without outlier detection every other request failed (503) for as long as the process was down."""
    doc, extra, _, _ = _two_process_doc(request_path)
    stack = Stack(write_config(tmp_path / "c.yaml", doc), workdir=tmp_path)
    cluster = EXT_AUTHZ_CLUSTER if request_path == "ext_authz" else EXT_PROC_CLUSTER
    stack.start(timeout_s=60)
    try:
        assert all(_chat(stack, i) == 200 for i in range(4))
        second = stack.child(f"{request_path}-2")
        assert second.proc is not None
        os.killpg(second.proc.pid, signal.SIGKILL)
        second.proc.wait(timeout=10)
        killed_at = time.monotonic()
        time.sleep(0.5)  # Envoy sees the dead process's pooled connections close
        statuses = [_chat(stack, i) for i in range(REQUESTS)]
        failed = [s for s in statuses if s != 200]
        tried = _connect_failures(stack, cluster)
        print(f"\n{request_path}: {len(failed)}/{REQUESTS} failed after the kill {failed}, {tried} connects")
        # ext_authz: the checks that found the process dead were sent to the other one
        allowed = 0 if request_path == "ext_authz" else REQUEST_PATH_EJECT_AFTER_FAILURES
        assert len(failed) <= allowed, statuses
        assert statuses[-REQUESTS // 2 :] == [200] * (REQUESTS // 2), statuses
        assert 1 <= tried <= REQUEST_PATH_EJECT_AFTER_FAILURES, tried
        [dead] = [
            h
            for c in clusters_json(stack.config)["cluster_statuses"]
            if c["name"] == cluster
            for h in c["host_statuses"]
            if h["address"]["socket_address"]["port_value"] == extra
        ]
        assert dead["health_status"].get("failed_outlier_check") is True, dead["health_status"]
        # while it is ejected every request goes to the live process and none tries the dead one
        ejected_until = killed_at + REQUEST_PATH_EJECTION_MS / 1000 - 1.0
        sent = 0
        while time.monotonic() < ejected_until and sent < REQUESTS:
            assert _chat(stack, sent) == 200
            sent += 1
        assert sent and _connect_failures(stack, cluster) == tried, sent
    finally:
        stack.stop()


def test_a_busy_extra_ext_proc_address_is_refused_up_front(tmp_path: Path) -> None:
    doc = _doc_without_tenant_limits()
    (extra,) = free_ports(1)
    doc["ext_proc"]["extra_listen"] = [f"127.0.0.1:{extra}"]
    doc["ext_proc"]["extra_metrics_listen"] = [f"127.0.0.1:{free_ports(1)[0]}"]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", extra))
        squatter.listen()
        stack = Stack(write_config(tmp_path / "c.yaml", doc), workdir=tmp_path)
        with pytest.raises(StackError, match=r"ext_proc\.extra_listen\[0\]"):
            stack.start(timeout_s=20)
        assert stack.children == []


def test_metrics_listen_port_zero_picks_a_free_port(tmp_path: Path) -> None:
    doc = in_mode(make_config_doc(), "ext_proc")
    path = write_config(tmp_path / "c.yaml", doc)
    (listen,) = free_ports(1)
    child = Child(
        "ext_proc",
        [
            sys.executable,
            "-m",
            "ext_proc",
            "--config",
            str(path),
            "--listen",
            f"127.0.0.1:{listen}",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        tmp_path / "ext_proc.log",
    )
    child.start({**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 30
        found = None
        while found is None and time.monotonic() < deadline:
            assert child.exited() is None, child.log_tail()
            found = re.search(r"ext_proc metrics on 127\.0\.0\.1:(\d+)", child.log_tail(50))
            time.sleep(0.05)
        assert found is not None, child.log_tail()
        port = int(found[1])
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            assert b"inferlb_ext_proc_processing_seconds" in resp.read()
        grpc_addr = HostPort(host="127.0.0.1", port=listen)
        while not port_open(grpc_addr) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert port_open(grpc_addr)
    finally:
        child.stop()
    assert child.exited() == 0, child.log_tail()
