"""End-to-end fixtures: the whole stack (gpusim, xds_server, ext_proc, real Envoy) on free loopback ports.

One stack per test module and request-path mode (start-up and stop take 5-15 s on the 2-core machine),
or one per mode for the whole session (``shared_stack``, :class:`SharedStacks`) for modules that only send
requests and read counters; tests that change shared state (quotas) use tenants or models no other test
relies on. :func:`stop_stack` stops a stack's children together once Envoy is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import json
import os
import random
import signal
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


#: Seconds :func:`stop_stack` waits for a child after its SIGTERM before it sends SIGKILL (as
#: :meth:`inferlb.ops.stack.Child.stop`'s default grace).
STOP_GRACE_S = 5.0


def stop_stack(stack: Stack) -> None:
    """Stop ``stack`` as :meth:`Stack.stop <inferlb.ops.stack.Stack.stop>` does, Envoy first (drained
    first when it meters into the access log, so no settlement is lost), but then every other child at
    once: each is sent SIGTERM before any is waited for, then each gets :data:`STOP_GRACE_S` seconds before
    SIGKILL. The Python services each take about a second to stop (their shutdown graces, measured 0.9-2.0 s
    per child on the 2-core machine), which :meth:`Stack.stop` spends one child after the other; none of
    them needs another to stop first once Envoy is gone. :meth:`Stack.stop` then closes the logs."""
    envoy = next((c for c in stack.children if c.name == "envoy"), None)
    if envoy is not None and envoy.exited() is None:
        if stack.config.ext_proc.meters_access_log():
            stack.drain_envoy()
        envoy.stop()
    running = [c.proc for c in stack.children if c.proc is not None and c.proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_GRACE_S)
    stack.stop()


#: Envoy ``--base-id`` slots (0-9 within this process's ten; a :class:`Stack` left to its default takes
#: slot 1): :func:`started_stack` cycles through these, one stack after another ...
_STACK_SLOTS = itertools.cycle(range(2, 8))
#: ... and the shared stacks of :class:`SharedStacks`, alive the whole session, hold one each.
_SHARED_SLOTS = {"ext_proc": 8, "ext_authz": 9}


def envoy_base_id(slot: int) -> int:
    """Envoy's ``--base-id`` for ``slot`` (0-9) of this process: :class:`Stack`'s default is slot 1
    (``pid % 50,000 * 10 + 1``), so each test process has ten and no two Envoys alive at once in one
    process share one (Envoy refuses to start on a base id in use: ``unable to bind domain socket``)."""
    return (os.getpid() % 50_000) * 10 + slot


@contextlib.contextmanager
def started_stack(work: Path, doc: dict[str, Any], *, base_id: int | None = None) -> Iterator[RunningStack]:
    """Write ``doc`` to ``work/inferlb.yaml``, start the whole stack on it (Envoy on ``base_id``, by
    default the next of :data:`_STACK_SLOTS`), stop it on exit (:func:`stop_stack`)."""
    path = write_config(work / "inferlb.yaml", doc)
    if base_id is None:
        base_id = envoy_base_id(next(_STACK_SLOTS))
    stack = Stack(path, workdir=work, log_level="info", base_id=base_id)
    stack.start(timeout_s=60)
    try:
        yield RunningStack(stack, stack.config, path, doc)
    finally:
        stop_stack(stack)


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


#: Tenants of the modules on the shared stacks (:func:`shared_doc`), each of one module and most of one
#: test, so what one spends (requests and tokens per minute, a concurrency slot) cannot change what another
#: sees: ``resp-*`` of test_responses_accounting, ``acct-*`` of test_extproc_accounting (``acct-conc``: one
#: request at a time; ``acct-burst``: 2,000 tokens/min, the demo team-c's limit, spent by its burst).
SHARED_TENANTS: tuple[dict[str, Any], ...] = (
    *({"name": t, "api_keys": [f"sk-{t}-key"]} for t in ("resp-json", "resp-sse")),
    *(
        {"name": t, "api_keys": [f"sk-{t}-key"]}
        for t in ("acct-json", "acct-sse", "acct-sse-hidden", "acct-abort")
    ),
    {"name": "acct-conc", "api_keys": ["sk-acct-conc-key"], "max_concurrent_requests": 1},
    {
        "name": "acct-burst",
        "api_keys": ["sk-acct-burst-key"],
        "priority": "default",
        "requests_per_minute": 600,
        "tokens_per_minute": 2_000,
    },
)


def shared_doc(mode: str) -> dict[str, Any]:
    """The config of the shared stack of ``mode`` (:func:`shared_stack`): the default fleet on free ports
    (:func:`tests.conftest.make_config_doc`), the default response accounting (``account_responses``
    unset: the default is what test_extproc_accounting and test_responses_accounting check), decode at
    2,000 tokens/s per V100 sequence (an aborted stream must end before its completion does; small
    completions take a few ms either way), and :data:`SHARED_TENANTS` beside the demo tenants."""
    doc = in_mode(make_config_doc(), mode)
    doc["ext_proc"].pop("account_responses", None)
    doc["simulation"]["decode_tokens_per_s"] = 2_000
    doc["tenants"] += [dict(t) for t in SHARED_TENANTS]
    return doc


class SharedStacks:
    """Started :func:`shared_doc` stacks, one per request-path mode, each started by the first module that
    asks for it and stopped at the end of the session (an idle stack costs under 1% of a core: health
    checks and scrapes).

    What carries over between modules, and why it cannot change a result: quota use (every module spends
    only its own tenants; the demo team-c's small token quota is spent by test_gateway alone), gpusim's
    counters and recorded requests (tests compare before/after their own requests, or read the request the
    reply names, and requests are never concurrent across tests), and settlements landing one access-log
    flush after a response (read per tenant, as deltas). No module on it injects GPU faults, restarts or
    kills a child or rewrites its config: one that does needs a stack of its own. :meth:`get` fails when a
    child of the stack has exited.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._stacks: dict[str, RunningStack] = {}
        self._exits = contextlib.ExitStack()

    def get(self, mode: str) -> RunningStack:
        """The shared stack of ``mode``, started now if it is the first use.

        Raises:
            AssertionError: one of its children has exited (the stack is broken).
        """
        rs = self._stacks.get(mode)
        if rs is None:
            work = self._tmp.mktemp(f"shared-{mode}")
            started = started_stack(work, shared_doc(mode), base_id=envoy_base_id(_SHARED_SLOTS[mode]))
            rs = self._stacks[mode] = self._exits.enter_context(started)
        gone = rs.stack.first_exited()
        assert gone is None, f"the shared {mode} stack lost {gone.name}: {gone.log_tail()}"
        return rs

    def close(self) -> None:
        """Stop every stack started (:func:`stop_stack`)."""
        self._exits.close()


@pytest.fixture(scope="session")
def shared_stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStacks]:
    """The session's :class:`SharedStacks`; every stack started is stopped at the end."""
    stacks = SharedStacks(tmp_path_factory)
    try:
        yield stacks
    finally:
        stacks.close()


@pytest.fixture(scope="module")
def shared_stack(shared_stacks: SharedStacks, request_path: str) -> RunningStack:
    """The stack of :func:`shared_doc` in each request-path mode, shared by every module that uses this
    fixture (see :class:`SharedStacks` for what such a module may and may not do to it). Where
    ``running_stack`` starts a stack per module and mode (about 5-15 s with its stop on the 2-core
    machine), this starts one per mode for the session."""
    return shared_stacks.get(request_path)


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
