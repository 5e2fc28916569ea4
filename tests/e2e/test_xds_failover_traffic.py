"""Locality failover moving live traffic through a real Envoy (the whole stack: gpusim, xds_server,
ext_proc, Envoy).

One model's three simulated GPUs sit in the gateway's own zone (eu/a), the region's other zone (eu/b) and
another region (us/a); ``cluster.failover: zone`` makes them priorities 0, 1 and 2, and active health
checks watch ``/health``. ``POST /sim/fault {"action": "fail"}`` makes a GPU's ``/health`` answer 503:
Envoy marks it unhealthy and the requests move to the next priority, then come back on recovery. Each
reply names the GPU that served it (``x-inferlb-endpoint``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, http_request, started_stack

pytestmark = pytest.mark.e2e

MODEL = "qwen2.5-7b-instruct"
#: health checks every 200 ms, one failure marks a host unhealthy, one pass brings it back
MOVE_WITHIN_S = 10.0
#: requests per sample; every one must land in the expected locality
SAMPLE = 20


@pytest.fixture(scope="module")
def failover_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("failover")
    doc = make_config_doc()
    doc["gateway"].update(region="eu", zone="a", num_retries=0)
    doc["models"][1]["cluster"] = {
        "failover": "zone",
        "health_check": {
            "path": "/health",
            "interval_ms": 200,
            "interval_jitter_ms": 0,
            "no_traffic_interval_ms": 200,
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
        },
    }
    localities = {"h100-1": ("eu", "a"), "v100-1": ("eu", "b"), "v100-2": ("us", "a")}
    for e in doc["endpoints"]:
        if e["name"] in localities:
            e["region"], e["zone"] = localities[e["name"]]
    with started_stack(work, doc) as rs:
        yield rs


def _address(rs: RunningStack, name: str) -> str:
    return next(str(e.address) for e in rs.config.endpoints if e.display_name == name)


def _fault(rs: RunningStack, name: str, action: str) -> None:
    reply = http_request(_address(rs, name), "POST", "/sim/fault", {"action": action})
    assert reply.status == 200, reply.body


def _sample(rs: RunningStack, n: int = SAMPLE) -> Counter[str]:
    """Which GPU served each of ``n`` requests (``!<status>`` for a failed one)."""
    served: Counter[str] = Counter()
    for _ in range(n):
        reply = rs.chat(MODEL, max_tokens=1)
        served[
            reply.headers.get("x-inferlb-endpoint", "?") if reply.status == 200 else f"!{reply.status}"
        ] += 1
    return served


def _until_all(rs: RunningStack, gpu: str, what: str) -> float:
    """Send samples until one lands entirely on ``gpu``; returns the seconds it took."""
    t0 = time.monotonic()
    last: Counter[str] = Counter()
    while time.monotonic() - t0 < MOVE_WITHIN_S:
        last = _sample(rs, 5)
        if last == Counter({gpu: 5}):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"timed out after {MOVE_WITHIN_S}s waiting for {what}; last sample {dict(last)}")


def test_traffic_fails_over_to_the_other_zone_then_region_and_comes_back(
    failover_stack: RunningStack,
) -> None:
    rs = failover_stack
    _until_all(rs, "h100-1", "the own zone's GPU to serve everything")
    assert _sample(rs) == Counter({"h100-1": SAMPLE})  # priority 0 only while it is healthy
    _fault(rs, "h100-1", "fail")
    try:
        took_zone = _until_all(rs, "v100-1", "traffic to move to the region's other zone")
        assert _sample(rs) == Counter({"v100-1": SAMPLE})
        _fault(rs, "v100-1", "fail")
        try:
            took_region = _until_all(rs, "v100-2", "traffic to move to the other region")
            assert _sample(rs) == Counter({"v100-2": SAMPLE})
        finally:
            _fault(rs, "v100-1", "recover")
        took_back_zone = _until_all(rs, "v100-1", "traffic back in the region once eu/b recovers")
    finally:
        _fault(rs, "h100-1", "recover")
    took_home = _until_all(rs, "h100-1", "traffic back in the own zone once it recovers")
    assert _sample(rs) == Counter({"h100-1": SAMPLE})
    print(
        f"failover: eu/a -> eu/b {took_zone:.2f} s, eu/b -> us/a {took_region:.2f} s, "
        f"us/a -> eu/b {took_back_zone:.2f} s, eu/b -> eu/a {took_home:.2f} s"
    )
