"""Live length classes through a real Envoy 1.40 (:func:`inferlb.policy.length_aware.live_class_sets`): a
tiered model on one H100, one A100 and one V100 with telemetry weights; its H100 throttled to half speed with
gpusim's ``POST /sim/fault`` no longer holds the longest class's capacity alone, so the xDS server lists the
A100 in ``long-0`` too (EDS endpoint metadata), Envoy rebuilds the cluster's subsets, and long-0 requests
land on the A100 as well; after recovery they are back on the H100 only. Which GPU served each request is
read from gpusim's ``x-inferlb-gpu`` header."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from inferlb.ops.stack import admin_get, free_ports
from tests.conftest import LOOPBACK, make_config_doc
from tests.e2e.conftest import RunningStack, http_request, in_mode, started_stack
from tests.e2e.test_length_aware_envoy import LONG_CAP, MISTRAL, _gpus, _served_by
from tests.e2e.test_weights_envoy import _until

pytestmark = pytest.mark.e2e

CLUSTER = f"{MISTRAL}--v1"
#: The classes follow the throttle within about a second here (scrape 200 ms, tau 300 ms, push debounce).
FOLLOW_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def live_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(make_config_doc(), request_path)
    doc["weights"] = {"mode": "telemetry", "stale_after_ms": 1_500, "smoothing_tau_ms": 300}
    doc["telemetry"] = {"scrape_interval_ms": 200, "scrape_timeout_ms": 500}
    tiers = [{"above_output_tokens": 100, "min_relative_capacity": 3.0}]
    tiers.append({"above_output_tokens": 40, "min_relative_capacity": 1.5})
    doc["models"].append({"name": MISTRAL, "cluster": {"length_aware": {"tiers": tiers}}})
    gpus = ("H100", "A100", "V100")
    doc["endpoints"] += [
        {"name": f"mistral-{g.lower()}", "address": f"{LOOPBACK}:{p}", "model": MISTRAL, "gpu": g}
        for g, p in zip(gpus, free_ports(3), strict=True)
    ]
    for e in doc["endpoints"][-3:]:
        e["simulated"] = True
    with started_stack(tmp_path_factory.mktemp("live-classes"), doc) as rs:
        yield rs


def _envoy_classes(rs: RunningStack) -> dict[str, list[str]]:
    """Each endpoint's ``envoy.lb`` ``length_classes`` as Envoy holds them (``/config_dump`` with EDS)."""
    dump = json.loads(admin_get(rs.config, "/config_dump?resource=dynamic_endpoint_configs&include_eds"))
    cla = next(
        c["endpoint_config"] for c in dump["configs"] if c["endpoint_config"]["cluster_name"] == CLUSTER
    )
    return {
        lb["endpoint"]["hostname"]: lb["metadata"]["filter_metadata"]["envoy.lb"]["length_classes"]
        for loc in cla["endpoints"]
        for lb in loc["lb_endpoints"]
    }


def _fault(rs: RunningStack, action: dict[str, object]) -> None:
    addr = next(str(e.address) for e in rs.config.endpoints if e.display_name == "mistral-h100")
    reply = http_request(addr, "POST", "/sim/fault", action)
    assert reply.status == 200, reply.body


def _classes_are(rs: RunningStack, want: dict[str, list[str]]) -> Callable[[], bool]:
    return lambda: _envoy_classes(rs) == want


PROFILE = {"mistral-h100": ["long-0", "long-1"], "mistral-a100": ["long-1"], "mistral-v100": []}
#: H100 at half speed: 1.7 + the A100's 1.7 reach long-0's 3.4; long-1's 5.1 takes the V100 too
THROTTLED = {
    "mistral-h100": ["long-0", "long-1"],
    "mistral-a100": ["long-0", "long-1"],
    "mistral-v100": ["long-1"],
}


def test_long_requests_follow_a_throttled_h100_to_the_a100_and_back(live_stack: RunningStack) -> None:
    rs = live_stack
    client = rs.openai_client()
    _until(_classes_are(rs, PROFILE), "Envoy holding the profile's classes", FOLLOW_WITHIN_S)
    assert _gpus(_served_by(client, MISTRAL, LONG_CAP, 20)) == {"H100"}
    _fault(rs, {"action": "throttle", "factor": 2.0})
    try:
        took = _until(_classes_are(rs, THROTTLED), "the A100 in long-0 in Envoy", FOLLOW_WITHIN_S)
        print(f"throttled H100: the A100 joined long-0 in Envoy after {took:.2f} s")
        rejected = admin_get(rs.config, "/stats?filter=update_rejected").decode()
        assert all(line.endswith(": 0") for line in rejected.splitlines() if line), rejected
        served = _served_by(client, MISTRAL, LONG_CAP, 30)
        assert _gpus(served) == {"H100", "A100"}, served
    finally:
        _fault(rs, {"action": "recover"})
    took = _until(_classes_are(rs, PROFILE), "the profile's classes after recovery", FOLLOW_WITHIN_S)
    print(f"recovered H100: back to the profile's classes in Envoy after {took:.2f} s")
    assert _gpus(_served_by(client, MISTRAL, LONG_CAP, 20)) == {"H100"}
