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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from inferlb.config.schema import Config
from inferlb.ops.stack import Stack, clusters_json, find_envoy
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


#: The request-path protocols every request-side e2e test runs over (``ext_proc.protocol``).
REQUEST_PATH_MODES = ("ext_proc", "ext_authz")


def in_mode(doc: dict[str, Any], mode: str) -> dict[str, Any]:
    """``doc`` set to serve requests through ``mode`` (``ext_proc.protocol``, set explicitly whatever the
    default is); ``doc``'s ``account_responses`` is kept (in ``ext_authz`` mode Envoy meters responses into
    the access log)."""
    doc.setdefault("ext_proc", {})["protocol"] = mode
    return doc


@pytest.fixture(scope="module", params=REQUEST_PATH_MODES)
def request_path(request: pytest.FixtureRequest) -> str:
    """Each request-path protocol in turn (module scope: one stack per module and mode)."""
    mode: str = request.param
    return mode


def skip_in(mode: str, current: str, why: str) -> None:
    """Skip the running test when the stack runs in ``mode`` (``current``), saying ``why``."""
    if current == mode:
        pytest.skip(f"not in {mode} mode: {why}")


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    """The default fleet, fast simulated GPUs, on free ports, in each request-path mode; stopped after the
    module."""
    with started_stack(tmp_path_factory.mktemp("stack"), in_mode(make_config_doc(), request_path)) as rs:
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


# -- failure drills: a bounded closed-loop load and the simulated GPUs' faults -------------------------------


@dataclass
class Outcome:
    """One request of :func:`closed_loop`: its status (an exception's class name when the transport failed,
    ``"cut"`` for a 200 stream that ended without ``[DONE]``), when it started (monotonic s), how long it
    took, and the endpoint that answered (``x-inferlb-endpoint``; None when no response came)."""

    status: int | str
    started: float
    seconds: float
    endpoint: str | None

    @property
    def ok(self) -> bool:
        return self.status == 200


def chat_body(model: str, *, max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    """A small chat completion request."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def closed_loop(
    gateway: str,
    body: dict[str, Any],
    *,
    clients: int,
    duration_s: float,
    key: str = "sk-demo-a",
    client_timeout_s: float = 30.0,
    max_requests: int = 20_000,
) -> list[Outcome]:
    """``clients`` clients each sending ``body`` to ``/v1/chat/completions`` one after the other for
    ``duration_s`` seconds (bounded: at most ``max_requests`` in all, each at most ``client_timeout_s``)."""
    out: list[Outcome] = []
    stop = time.monotonic() + duration_s
    url = f"http://{gateway}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=client_timeout_s)

    async def client(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop and len(out) < max_requests:
            t0 = time.monotonic()
            endpoint: str | None = None
            status: int | str
            try:
                async with http.post(url, json=body, headers=headers, timeout=timeout) as r:
                    endpoint = r.headers.get("x-inferlb-endpoint")
                    data = await r.read()
                    status = r.status
                    if status == 200 and body.get("stream") and b"[DONE]" not in data:
                        status = "cut"
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = type(exc).__name__
            out.append(Outcome(status, t0, time.monotonic() - t0, endpoint))

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return out


def sim_fault(config: Config, name: str, action: str) -> dict[str, Any]:
    """``POST /sim/fault`` ``{"action": action}`` to the simulated endpoint ``name``; its new state."""
    endpoint = next(e for e in config.endpoints if e.display_name == name)
    reply = http_request(str(endpoint.address), "POST", "/sim/fault", {"action": action}, timeout_s=5)
    assert reply.status == 200, reply.body
    state: dict[str, Any] = reply.json()
    return state


def failed_hosts(config: Config, cluster: str) -> set[str]:
    """The endpoints of ``cluster`` Envoy holds as failing an active health check or outlier-ejected
    (admin ``/clusters?format=json``), by their address ``host:port``."""
    out = set()
    for c in clusters_json(config).get("cluster_statuses", []):
        if c.get("name") != cluster:
            continue
        for h in c.get("host_statuses", []):
            health = h.get("health_status", {})
            if health.get("failed_active_health_check") or health.get("failed_outlier_check"):
                sa = h["address"]["socket_address"]
                out.add(f"{sa['address']}:{sa['port_value']}")
    return out


def saturable_doc(model: str, default_budget: dict[str, int], retry_after_s: int) -> dict[str, Any]:
    """The test config with ``model``'s DEFAULT circuit breaker at ``default_budget`` (HIGH roomy: 256), the
    gateway's overflow ``retry-after`` at ``retry_after_s``, and decoding at 200 tokens/s per sequence on a
    V100 (a 300-token completion holds its slot 0.4-1.5 s), so a few concurrent requests saturate it."""
    doc = make_config_doc()
    doc["simulation"]["decode_tokens_per_s"] = 200
    doc["gateway"]["overflow_retry_after_s"] = retry_after_s
    entry = next(m for m in doc["models"] if m["name"] == model)
    entry["cluster"] = {
        "circuit_breaker_default": default_budget,
        "circuit_breaker_high": {"max_connections": 256, "max_pending_requests": 256, "max_requests": 256},
    }
    return doc
