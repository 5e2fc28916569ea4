"""End-to-end fixtures: the whole stack (gpusim, xds_server, ext_proc, real Envoy) on free loopback ports.

One stack per test module (start-up takes a few seconds); tests that change shared state (quotas) use
tenants or models no other test in the module relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from inferlb.config.schema import Config
from inferlb.ops.stack import Stack, find_envoy
from tests.conftest import make_config_doc, write_config

pytestmark = pytest.mark.e2e


@dataclass
class Reply:
    """An HTTP response, read whole."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(
    addr: str,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> Reply:
    """One HTTP/1.1 request to ``addr`` (``host:port``); returns status, lower-cased headers and body."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


@dataclass
class RunningStack:
    """A started stack and what tests need to reach it."""

    stack: Stack
    config: Config
    config_path: Path
    doc: dict[str, Any]

    @property
    def gateway(self) -> str:
        return str(self.config.gateway.listen)

    def openai_client(self, key: str = "sk-demo-a") -> openai.OpenAI:
        """The official OpenAI SDK pointed at the gateway (no retries, 30 s timeout)."""
        return openai.OpenAI(base_url=f"http://{self.gateway}/v1", api_key=key, max_retries=0, timeout=30)

    def chat(
        self,
        model: str,
        key: str = "sk-demo-a",
        *,
        max_tokens: int = 4,
        content: str = "hello",
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> Reply:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **extra,
        }
        return http_request(
            self.gateway,
            "POST",
            "/v1/chat/completions",
            body,
            {"Authorization": f"Bearer {key}", **(headers or {})},
        )


@contextlib.contextmanager
def started_stack(work: Path, doc: dict[str, Any]) -> Iterator[RunningStack]:
    """Write ``doc`` to ``work/inferlb.yaml``, start the whole stack on it, stop it on exit."""
    path = write_config(work / "inferlb.yaml", doc)
    stack = Stack(path, workdir=work, log_level="info")
    stack.start(timeout_s=60)
    try:
        yield RunningStack(stack, stack.config, path, doc)
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """The default fleet, fast simulated GPUs, on free ports; stopped after the module."""
    with started_stack(tmp_path_factory.mktemp("stack"), make_config_doc()) as rs:
        yield rs


async def spawn_envoy(bootstrap: Path, log: Path) -> asyncio.subprocess.Process:
    """Start the real Envoy (:func:`inferlb.ops.stack.find_envoy`) on ``bootstrap`` with one worker and
    warning logs into ``log``, under a random ``--base-id`` so several Envoys of one test run do not share
    shared-memory names. The caller kills it."""
    with log.open("wb") as fh:
        return await asyncio.create_subprocess_exec(
            find_envoy(), "-c", str(bootstrap), "--base-id", str(random.randint(10_000, 2_000_000)),
            "--concurrency", "1", "-l", "warning", stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
