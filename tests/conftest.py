"""Shared test helpers: free loopback ports and small configs built on them.

Every test server binds 127.0.0.1 only. ``make_config_doc`` returns a config document (a dict) shaped like
the default local config but on free ports and with a fast simulated fleet, so end-to-end tests run in
seconds; tests adjust the dict and write it with ``write_config``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import settings

from inferlb.config.schema import default_config_path
from inferlb.ops.redis_server import RedisServer, find_redis_server
from inferlb.ops.stack import on_free_ports

LOOPBACK = "127.0.0.1"

# Every Hypothesis test, unless its own @settings says otherwise: no per-example deadline (speed is the
# benchmarks' business; a loaded 2-core machine once took 322 ms over the default 200 ms deadline on an
# example that runs in 12 ms) and derandomized, so a run of the suite is the same run every time (a
# counterexample found while developing becomes an @example).
settings.register_profile("inferlb", deadline=None, derandomize=True)
settings.load_profile("inferlb")
#: ``ext_proc.meter_flush_interval_ms`` of the fast test config (the default is 1,000): what the tests
#: that use it check (each entry settled once, at its usage) does not depend on when a batch leaves Envoy;
#: a test about the flush itself sets the interval it needs.
TEST_METER_FLUSH_MS = 250


def make_config_doc(*, fast: bool = True) -> dict[str, Any]:
    """The default local config as a dict, moved to free loopback ports.

    With ``fast`` the simulated GPUs are ~100x quicker than the defaults (tests send thousands of
    requests) while keeping the H100/A100/V100 capacity ratios, and Envoy flushes its metering access log
    (ext_authz mode) every :data:`TEST_METER_FLUSH_MS` instead of every second, so settlements land and a
    stack stops (:meth:`inferlb.ops.stack.Stack.drain_envoy` waits one flush) sooner.
    """
    doc: dict[str, Any] = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    on_free_ports(doc, LOOPBACK)
    if fast:
        doc["simulation"].update(
            prefill_tokens_per_s=2_000_000, decode_tokens_per_s=5_000, max_batch=64, max_queue=4096
        )
        doc["ext_proc"]["meter_flush_interval_ms"] = TEST_METER_FLUSH_MS
    return doc


def write_config(path: Path, doc: dict[str, Any]) -> Path:
    """Write a config document as YAML and return the path."""
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def config_doc() -> dict[str, Any]:
    """A fresh fast config document on free ports (see :func:`make_config_doc`)."""
    return make_config_doc()


@pytest.fixture
def config_file(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    """Write a config document under ``tmp_path``; returns a writer."""
    return lambda doc: write_config(tmp_path / "inferlb.yaml", doc)


async def wait_until(
    predicate: Callable[[], bool], what: str, timeout_s: float = 5.0, poll_s: float = 0.02
) -> None:
    """Poll ``predicate`` every ``poll_s`` seconds until it holds; fail the test naming ``what`` after
    ``timeout_s`` seconds. Every wait in the async tests goes through this, so none can hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(poll_s)


def redis_or_skip(directory: Path, **kw: Any) -> RedisServer:
    """A :class:`~inferlb.ops.redis_server.RedisServer` with its files in ``directory`` (not started yet);
    the test is skipped when redis-server is not installed, and fails when ``CI`` is set (``.ci/run``
    installs it)."""
    if find_redis_server() is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed but CI is set: .ci/run must install it")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return RedisServer(directory, **kw)
