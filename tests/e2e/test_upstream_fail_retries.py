"""Failing GPUs (``/health`` and generation answer 503) under load, through the real Envoy: the 503s are
retried on another GPU before any byte reaches the client, the active health check and outlier detection
take the GPU out (tests/e2e/test_outlier_merge_window.py: a GPU back from ejection is not a burst of
errors).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from inferlb.ops.stack import admin_get
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, chat_body, closed_loop, in_mode, sim_fault, started_stack

pytestmark = pytest.mark.e2e

LLAMA_CLUSTER = "llama-3.1-8b-instruct--v1"
QWEN_CLUSTER = "qwen2.5-7b-instruct--v1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(make_config_doc(), request_path)
    # ejections short enough that a failing GPU comes back (and fails again) within a test
    for m in doc["models"]:
        m.setdefault("cluster", {})["outlier_detection"] = {"interval_ms": 500, "base_ejection_time_ms": 1000}
    with started_stack(tmp_path_factory.mktemp("fail"), doc) as rs:
        yield rs


def _counter(config: Any, name: str) -> int:
    stats = json.loads(admin_get(config, f"/stats?format=json&filter=^{name}$"))
    return sum(int(s.get("value", 0)) for s in stats.get("stats", []))


async def _drill(rs: RunningStack, names: list[str], body: dict[str, Any], *, cycles: int) -> list[Any]:
    """A closed loop on ``body`` while the GPUs ``names`` fail for 2 s and recover for 1 s, ``cycles``
    times (each return from ejection or from a failed health check meets a GPU that may fail again)."""

    async def faults() -> None:
        await asyncio.sleep(0.5)
        for _ in range(cycles):
            for n in names:
                sim_fault(rs.config, n, "fail")
            await asyncio.sleep(2.0)
            for n in names:
                sim_fault(rs.config, n, "recover")
            await asyncio.sleep(1.0)

    load = asyncio.create_task(
        closed_loop(rs.gateway, body, clients=16, duration_s=0.5 + 3.0 * cycles + 0.5, client_timeout_s=20)
    )
    try:
        await faults()
        return await load
    finally:
        for n in names:
            sim_fault(rs.config, n, "recover")


async def test_one_of_eight_gpus_failing_costs_no_error(stack: RunningStack) -> None:
    retried = _counter(stack.config, f"cluster.{LLAMA_CLUSTER}.upstream_rq_retry")
    outcomes = await _drill(stack, ["a100-1"], chat_body("llama3"), cycles=3)
    statuses = Counter(o.status for o in outcomes)
    assert statuses == {200: len(outcomes)}, statuses
    # the failing GPU did answer 503s, and Envoy retried them elsewhere
    assert _counter(stack.config, f"cluster.{LLAMA_CLUSTER}.upstream_rq_retry") > retried
    assert len(outcomes) > 300


async def test_streams_on_a_failing_gpu_are_retried_too(stack: RunningStack) -> None:
    # a failed GPU answers 503 before any stream byte: still retriable
    outcomes = await _drill(stack, ["a100-1"], chat_body("llama3", stream=True), cycles=1)
    statuses = Counter(o.status for o in outcomes)
    assert statuses == {200: len(outcomes)}, statuses


async def test_two_of_three_gpus_failing_costs_no_error(stack: RunningStack) -> None:
    # outlier detection ejects at most 50% of a cluster; the health check and the retries to hosts not
    # tried yet (previous_hosts) cover the rest
    outcomes = await _drill(stack, ["v100-1", "v100-2"], chat_body("qwen"), cycles=2)
    statuses = Counter(o.status for o in outcomes)
    assert statuses == {200: len(outcomes)}, statuses
    served = Counter(o.endpoint for o in outcomes)
    assert served["h100-1"] > served["v100-1"] + served["v100-2"]
