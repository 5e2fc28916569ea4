"""A failing GPU back from ejection is out again at once: ``update_merge_window`` 0 (Envoy's default, 1 s,
kept an ejected host in the balancer for up to a second each time), through the real Envoy with outlier
detection alone and no retries, so every 503 reaches the client and can be counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from inferlb.ops.stack import admin_get
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, chat_body, closed_loop, in_mode, sim_fault, started_stack

pytestmark = pytest.mark.e2e

QWEN_CLUSTER = "qwen2.5-7b-instruct--v1"


def _counter(config: Any, name: str) -> int:
    stats = json.loads(admin_get(config, f"/stats?format=json&filter=^{name}$"))
    return sum(int(s.get("value", 0)) for s in stats.get("stats", []))


@pytest.fixture(scope="module")
def bare_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    """No retries and no active health check: outlier detection alone, so every 503 reaches the client
    and the errors per return from ejection can be counted."""
    doc = in_mode(make_config_doc(), request_path)
    doc["gateway"]["num_retries"] = 0
    qwen = next(m for m in doc["models"] if m["name"] == "qwen2.5-7b-instruct")
    qwen["cluster"] = {
        "health_check": None,
        "outlier_detection": {
            "consecutive_5xx": 3,
            "consecutive_gateway_failure": 3,
            "interval_ms": 200,
            "base_ejection_time_ms": 300,
            "max_ejection_percent": 100,
        },
    }
    with started_stack(tmp_path_factory.mktemp("bare"), doc) as rs:
        yield rs


async def test_a_gpu_back_from_ejection_is_out_again_at_once(bare_stack: RunningStack) -> None:
    """Envoy's default ``update_merge_window`` (1 s) keeps an ejected host in the balancer for up to a
    second; a fast-failing GPU has no requests in flight, so least-request sends it much of the traffic
    meanwhile (measured with a 1 s window: 263 errors for 6 ejections in 6 s, ~44 per return). With the
    window at 0 a return costs about ``consecutive_gateway_failure`` (503 is a gateway error) errors plus
    what was in flight (measured: 21 for 6, ~3.5 per return)."""
    rs = bare_stack
    ejections = f"cluster.{QWEN_CLUSTER}.outlier_detection.ejections_enforced_total"
    before = _counter(rs.config, ejections)
    sim_fault(rs.config, "v100-1", "fail")
    try:
        outcomes = await closed_loop(rs.gateway, chat_body("qwen"), clients=16, duration_s=6.0)
    finally:
        sim_fault(rs.config, "v100-1", "recover")
    ejected = _counter(rs.config, ejections) - before
    errors = [o for o in outcomes if not o.ok]
    assert all(o.status == 503 and o.endpoint == "v100-1" for o in errors)
    # the ejection time grows with each ejection (300 ms x n): several returns in 6 s
    assert ejected >= 3, ejected
    per_return = len(errors) / ejected
    assert per_return <= 3 + 8, (len(errors), ejected)
