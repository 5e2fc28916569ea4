"""The stack runs one ext_proc (or ext_authz) process per ``ext_proc.listen``/``extra_listen`` address, each
with its own metrics address (and in ext_authz mode its own settler, ``extra_meter_listen``), and Envoy
spreads requests over them; ``--metrics-listen HOST:0`` picks a free port."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from inferlb.config.schema import HostPort
from inferlb.ops.stack import Child, Stack, StackError, clusters_json, free_ports, port_open
from inferlb.ops.status import host_rows
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import http_request, in_mode, stop_stack
from tests.e2e.test_extproc_accounting import process_samples

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


def test_each_extra_listen_address_gets_its_own_ext_proc_process(tmp_path: Path, request_path: str) -> None:
    doc = in_mode(_doc_without_tenant_limits(), request_path)
    extra, extra_metrics, extra_meter = free_ports(3)
    doc["ext_proc"]["extra_listen"] = [f"127.0.0.1:{extra}"]
    doc["ext_proc"]["extra_metrics_listen"] = [f"127.0.0.1:{extra_metrics}"]
    doc["ext_proc"]["extra_meter_listen"] = [f"127.0.0.1:{extra_meter}"]
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
            r = http_request(
                str(stack.config.gateway.listen),
                "POST",
                "/v1/chat/completions",
                {"model": "qwen", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
                {"Authorization": "Bearer sk-demo-a"},
                timeout_s=15,
            )
            assert r.status == 200, r.body
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
