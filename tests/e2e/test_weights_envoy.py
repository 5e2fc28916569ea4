"""Telemetry weights through a real Envoy: the whole stack in ``weights.mode: telemetry``; a simulated GPU
throttled with ``POST /sim/fault`` loses weight in Envoy's ``/clusters`` within seconds and gets it back on
recovery; muted (stale) telemetry falls back to the profile weight, never 0; ``inferlb status`` shows the
weights with their inputs."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from inferlb.ops.cli import main
from inferlb.ops.stack import clusters_json
from inferlb.ops.status import host_rows
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, http_request, started_stack

pytestmark = pytest.mark.e2e

TOKEN = "e2e-weights-token-0123456789"
#: Throttle must show in Envoy within this (the policy needs ~1.5 s at these settings, plus the push).
FALL_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def telemetry_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("weights")
    doc = make_config_doc()
    doc["xds"]["api_token"] = TOKEN
    doc["weights"] = {"mode": "telemetry", "stale_after_ms": 1_500, "smoothing_tau_ms": 300}
    doc["telemetry"] = {"scrape_interval_ms": 200, "scrape_timeout_ms": 500}
    with started_stack(work, doc) as rs:
        yield rs


def _envoy_weight(rs: RunningStack, name: str) -> int:
    rows = {r.name: r for r in host_rows(rs.config, clusters_json(rs.config))}
    return rows[name].weight


def _address(rs: RunningStack, name: str) -> str:
    return next(str(e.address) for e in rs.config.endpoints if e.display_name == name)


def _fault(rs: RunningStack, name: str, body: dict[str, Any]) -> None:
    reply = http_request(_address(rs, name), "POST", "/sim/fault", body)
    assert reply.status == 200, reply.body


def _until(predicate: Callable[[], bool], what: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_throttled_gpu_loses_weight_in_envoy_and_gets_it_back(telemetry_stack: RunningStack) -> None:
    rs = telemetry_stack
    _until(lambda: _envoy_weight(rs, "h100-0") == 340, "Envoy holding the telemetry-scale weight", 10.0)
    assert _envoy_weight(rs, "v100-0") == 100  # every endpoint on the 100-per-capacity scale
    _fault(rs, "h100-0", {"action": "throttle", "factor": 2.0})
    try:
        took = _until(
            lambda: _envoy_weight(rs, "h100-0") <= 200, "the throttled H100's weight to fall", FALL_WITHIN_S
        )
    finally:
        _fault(rs, "h100-0", {"action": "recover"})
    print(f"throttled H100: Envoy weight fell 340 -> <=200 in {took:.2f} s")
    assert _envoy_weight(rs, "a100-0") == 170
    _until(
        lambda: _envoy_weight(rs, "h100-0") >= 306, "the recovered H100's weight to come back", FALL_WITHIN_S
    )


def test_stale_telemetry_falls_back_to_the_profile_weight_never_zero(telemetry_stack: RunningStack) -> None:
    rs = telemetry_stack
    _fault(rs, "a100-1", {"action": "throttle", "factor": 4.0})
    try:
        _until(lambda: _envoy_weight(rs, "a100-1") <= 60, "the throttled A100 at ~1/4 of 170", FALL_WITHIN_S)
        _fault(rs, "a100-1", {"action": "mute"})  # /metrics and /sim/telemetry answer 503 from now on
        seen: list[int] = []

        def profile() -> bool:
            seen.append(_envoy_weight(rs, "a100-1"))
            return seen[-1] == 170

        _until(profile, "stale telemetry -> the A100's profile weight", 6.0)
        assert min(seen) >= 1
    finally:
        _fault(rs, "a100-1", {"action": "recover"})


def test_status_shows_each_weight_with_its_inputs(telemetry_stack: RunningStack) -> None:
    rs = telemetry_stack
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["status", "--config", str(rs.config_path), "--json", "--weights", "--token", TOKEN])
    assert code == 0
    rows = {r["name"]: r for r in json.loads(buf.getvalue())}
    assert set(rows) == {e.display_name for e in rs.config.endpoints}
    h100 = rows["h100-1"]
    assert h100["source"] == "telemetry" and h100["fresh"] is True
    assert h100["envoy_weight"] == h100["served_weight"]
    assert h100["factors"]["target"] is not None and h100["running"] is not None
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["status", "--config", str(rs.config_path), "--token", TOKEN])
    assert code == 0
    assert "inferlb weights (mode telemetry" in buf.getvalue()
