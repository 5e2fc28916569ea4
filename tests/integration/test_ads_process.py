"""``python -m xds_server`` as a process: ready line, serving ADS, clean SIGTERM, fail fast on bad config."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from inferlb.config.schema import default_config_path
from xds_server import resources as r

WAIT_S = 15.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _config(tmp_path: Path, **xds: Any) -> tuple[Path, int]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    port = _free_port()
    doc["xds"] = {"listen": f"127.0.0.1:{port}", "api_listen": f"127.0.0.1:{_free_port()}", **xds}
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path, port


@contextlib.contextmanager
def _xds_process(config: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "xds_server", "--config", str(config), "--log-level", "info"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)
        if proc.stderr is not None:
            proc.stderr.close()


def _wait_for_line(proc: subprocess.Popen[str], needle: str) -> str:
    """Read stderr lines until one contains ``needle`` (bounded by WAIT_S and by the process exiting)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + WAIT_S
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} in xds_server output:\n{''.join(seen)}")


async def _first_listener_response(port: int) -> discovery_pb2.DiscoveryResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(
            discovery_pb2.DiscoveryRequest(type_url=r.LISTENER_TYPE, node=base_pb2.Node(id="proc-test"))
        )
        resp = await asyncio.wait_for(call.read(), WAIT_S)
        call.cancel()
        assert isinstance(resp, discovery_pb2.DiscoveryResponse)
        return resp


async def test_serves_ads_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    config, port = _config(tmp_path)
    with _xds_process(config) as proc:
        line = _wait_for_line(proc, "xds_server ready on")
        assert f"xds_server ready on 127.0.0.1:{port}" in line
        resp = await _first_listener_response(port)
        assert resp.type_url == r.LISTENER_TYPE
        assert len(resp.resources) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
        assert proc.stderr is not None
        rest = proc.stderr.read()
        assert "xds_server stopped" in rest
        assert "Traceback" not in rest


def test_versions_do_not_repeat_across_restarts(tmp_path: Path) -> None:
    config, port = _config(tmp_path)
    versions = []
    for _ in range(2):
        with _xds_process(config) as proc:
            _wait_for_line(proc, "xds_server ready on")
            versions.append(asyncio.run(_first_listener_response(port)).version_info)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=WAIT_S) == 0
    assert versions[0] != versions[1]


def test_bad_config_at_start_exits_1_with_the_field_named(tmp_path: Path) -> None:
    config, _ = _config(tmp_path, push_debounce_ms=-5)
    with _xds_process(config) as proc:
        assert proc.wait(timeout=WAIT_S) == 1
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert "xds.push_debounce_ms" in err
    assert "cannot start" in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_either_signal_stops_it(tmp_path: Path, sig: signal.Signals) -> None:
    config, _ = _config(tmp_path)
    with _xds_process(config) as proc:
        _wait_for_line(proc, "xds_server ready on")
        proc.send_signal(sig)
        assert proc.wait(timeout=WAIT_S) == 0
