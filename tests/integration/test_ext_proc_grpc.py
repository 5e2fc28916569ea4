"""ext_proc over real gRPC: a grpc aio server on a free loopback port, driven by a grpc aio client that
speaks like Envoy (request headers, then the buffered body, one stream per HTTP request, reset at the end);
and ``python -m ext_proc`` as a process (ready line, config reload, bad config kept out, SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from ext_proc.servicer import OFFLOAD_BODY_BYTES, ExtProcState, add_to_server
from inferlb.config.schema import parse_config
from inferlb.request import headers as h

CONFIG: dict[str, Any] = {
    "gateway": {"max_request_body_bytes": 1024 * 1024},
    "models": [
        {
            "name": "llama",
            "aliases": ["llama3"],
            "default_max_tokens": 100,
            "versions": [{"name": "v1", "traffic_percent": 90}, {"name": "v2", "traffic_percent": 10}],
        }
    ],
    "tenants": [
        {"name": "gold", "api_keys": ["sk-gold-0001"], "priority": "high"},
        {"name": "small", "api_keys": ["sk-small-001"], "tokens_per_minute": 300},
    ],
}


def headers_msg(
    path: str = "/v1/chat/completions",
    method: str = "POST",
    key: str | None = "sk-gold-0001",
    *,
    end_of_stream: bool = False,
    extra: dict[str, str] | None = None,
) -> ep.ProcessingRequest:
    pairs = {
        ":method": method,
        ":path": path,
        ":scheme": "http",
        ":authority": "127.0.0.1:10000",
        **(extra or {}),
    }
    if key is not None:
        pairs["authorization"] = f"Bearer {key}"
    # Envoy >= 1.27 sends header values in raw_value
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=end_of_stream))


def body_msg(body: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))


def chat(model: str = "llama", text: str = "hello there", **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}], **extra}).encode()


def set_headers(mutation: ep.HeaderMutation) -> dict[str, str]:
    out = {}
    for opt in mutation.set_headers:
        assert opt.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        out[opt.header.key] = opt.header.raw_value.decode()
    return out


@pytest.fixture
async def server_addr() -> AsyncIterator[str]:
    server = grpc.aio.server()
    add_to_server(server, ExtProcState(parse_config(CONFIG)))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture
async def stub(server_addr: str) -> AsyncIterator[ep_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(server_addr) as channel:
        yield ep_grpc.ExternalProcessorStub(channel)


async def exchange(
    stub: ep_grpc.ExternalProcessorStub, *messages: ep.ProcessingRequest
) -> list[ep.ProcessingResponse]:
    """Send messages one at a time, reading each answer, and stop early at an immediate response; then
    reset the stream as Envoy does."""
    call = stub.Process()
    answers = []
    try:
        for m in messages:
            await call.write(m)
            resp = await asyncio.wait_for(call.read(), timeout=10)
            assert resp is not grpc.aio.EOF
            answers.append(resp)
            if resp.HasField("immediate_response"):
                break
    finally:
        call.cancel()
    return answers


def immediate(resp: ep.ProcessingResponse, status: int) -> dict[str, Any]:
    assert resp.HasField("immediate_response")
    ir = resp.immediate_response
    assert ir.status.code == status
    hdrs = set_headers(ir.headers)
    assert hdrs["content-type"] == "application/json"
    assert ir.details.startswith("inferlb_")
    doc = json.loads(ir.body)
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    return {"headers": hdrs, **doc["error"]}


async def test_success_sets_routing_headers_on_the_body_response(
    stub: ep_grpc.ExternalProcessorStub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    spoof = {"x-inferlb-tenant": "small", "x-inferlb-priority": "high"}
    first, second = await exchange(stub, headers_msg(extra=spoof), body_msg(chat("llama3", user="u1")))
    assert first.HasField("request_headers")
    assert sorted(first.request_headers.response.header_mutation.remove_headers) == [h.PRIORITY, h.TENANT]
    assert second.HasField("request_body")
    common = second.request_body.response
    assert common.clear_route_cache
    got = set_headers(common.header_mutation)
    assert got[h.MODEL] == "llama"
    assert got[h.VERSION] in {"v1", "v2"}
    assert got[h.TENANT] == "gold"
    assert got[h.PRIORITY] == "high"
    assert got[h.PROMPT_TOKENS] == "9"
    # the reset after the last message is normal: nothing logged at WARNING or above
    await asyncio.sleep(0.05)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_refusals_over_grpc(stub: ep_grpc.ExternalProcessorStub) -> None:
    (r,) = await exchange(stub, headers_msg(key="sk-nope-0000"))
    assert immediate(r, 401)["code"] == "invalid_api_key"
    (r,) = await exchange(stub, headers_msg("/v1/unknown"))
    assert immediate(r, 404)["code"] == "unknown_url"
    (r,) = await exchange(stub, headers_msg(end_of_stream=True))
    assert immediate(r, 400)["type"] == "invalid_request_error"
    _, r = await exchange(stub, headers_msg(), body_msg(b'{"model": '))
    assert immediate(r, 400)["type"] == "invalid_request_error"
    _, r = await exchange(stub, headers_msg(), body_msg(json.dumps({"messages": []}).encode()))
    assert immediate(r, 400)["param"] == "model"
    _, r = await exchange(stub, headers_msg(), body_msg(chat("gpt-9")))
    assert immediate(r, 404)["code"] == "model_not_found"
    _, r = await exchange(stub, headers_msg(), body_msg(chat(text="x" * (1024 * 1024))))
    assert immediate(r, 413)["code"] == "request_too_large"


async def test_quota_429_with_retry_after(stub: ep_grpc.ExternalProcessorStub) -> None:
    # each request reserves 9 prompt + 100 default output tokens of the 300/min quota; the streams stay
    # open (their responses have not ended), so the reservations are still held
    held = []
    for _ in range(2):
        call = stub.Process()
        held.append(call)
        for m in (headers_msg(key="sk-small-001"), body_msg(chat())):
            await call.write(m)
            ok = await asyncio.wait_for(call.read(), timeout=10)
        assert ok.HasField("request_body")
    _, r = await exchange(stub, headers_msg(key="sk-small-001"), body_msg(chat()))
    for call in held:
        call.cancel()
    err = immediate(r, 429)
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert int(err["headers"]["retry-after"]) >= 1


async def test_models_list(stub: ep_grpc.ExternalProcessorStub) -> None:
    (r,) = await exchange(stub, headers_msg("/v1/models", "GET", end_of_stream=True))
    assert r.immediate_response.status.code == 200
    assert [m["id"] for m in json.loads(r.immediate_response.body)["data"]] == ["llama"]


async def test_big_body_is_counted_off_the_loop(stub: ep_grpc.ExternalProcessorStub) -> None:
    text = "word " * (OFFLOAD_BODY_BYTES // 5 + 1000)
    _, r = await exchange(stub, headers_msg(), body_msg(chat(text=text)))
    assert r.HasField("request_body")
    tokens = int(set_headers(r.request_body.response.header_mutation)[h.PROMPT_TOKENS])
    assert tokens > OFFLOAD_BODY_BYTES // 5


async def test_concurrent_streams(stub: ep_grpc.ExternalProcessorStub) -> None:
    results = await asyncio.wait_for(
        asyncio.gather(*(exchange(stub, headers_msg(), body_msg(chat(user=f"u{i}"))) for i in range(64))),
        timeout=60,
    )
    assert all(len(r) == 2 and r[1].HasField("request_body") for r in results)


async def test_response_phase_messages_get_a_plain_continue(stub: ep_grpc.ExternalProcessorStub) -> None:
    resp_headers = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
    _, _, third = await exchange(stub, headers_msg(), body_msg(chat()), resp_headers)
    assert third.HasField("response_headers")
    assert not third.response_headers.response.HasField("header_mutation")


async def test_body_without_headers_phase_is_refused(stub: ep_grpc.ExternalProcessorStub) -> None:
    (r,) = await exchange(stub, body_msg(chat()))
    assert r.immediate_response.status.code == 500


# -- the process ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.lines.append(raw.decode(errors="replace").rstrip())

    async def wait_for_line(self, needle: str, within_s: float = 20.0) -> str:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for line in self.lines:
                if needle in line:
                    return line
            if self.proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        raise AssertionError(f"no log line with {needle!r}; got:\n" + "\n".join(self.lines))

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = await asyncio.wait_for(self.proc.wait(), timeout=15)
        except TimeoutError:
            self.proc.kill()
            rc = await self.proc.wait()
        await asyncio.wait_for(self._reader, timeout=5)
        return rc


async def first_status(addr: str, key: str) -> int:
    async with grpc.aio.insecure_channel(addr) as channel:
        answers = await exchange(
            ep_grpc.ExternalProcessorStub(channel), headers_msg(key=key), body_msg(chat())
        )
    last = answers[-1]
    return last.immediate_response.status.code if last.HasField("immediate_response") else 200


async def test_process_serves_reloads_and_stops(tmp_path: Path) -> None:
    port = free_port()
    metrics_port = free_port()
    cfg = {
        **CONFIG,
        "ext_proc": {
            "protocol": "ext_proc",
            "listen": f"127.0.0.1:{port}",
            "metrics_listen": f"127.0.0.1:{metrics_port}",
        },
    }
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Process(
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ext_proc",
            "--config",
            str(path),
            "--poll-interval",
            "0.1",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    )
    addr = f"127.0.0.1:{port}"
    try:
        assert f"ext_proc ready on {addr}" in await proc.wait_for_line("ext_proc ready on")
        assert await first_status(addr, "sk-gold-0001") == 200
        assert await first_status(addr, "sk-newt-0001") == 401
        # the metrics endpoint counts both (401 before the tenant is known)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert 'inferlb_requests_total{model="",status="401",tenant=""} 1.0' in text
        assert "inferlb_ext_proc_processing_seconds_bucket" in text

        # a new tenant in the file is served without a restart
        cfg["tenants"] = [*CONFIG["tenants"], {"name": "newt", "api_keys": ["sk-newt-0001"]}]
        path.write_text(yaml.safe_dump(cfg))
        await proc.wait_for_line("config reloaded")
        assert await first_status(addr, "sk-newt-0001") == 200

        # a bad file is refused with the field named, and the last good config keeps serving
        bad = {**cfg, "tenants": [{**cfg["tenants"][0], "requests_per_minute": -5}]}
        path.write_text(yaml.safe_dump(bad))
        line = await proc.wait_for_line("config reload refused")
        assert "tenants[0].requests_per_minute" in line
        assert await first_status(addr, "sk-newt-0001") == 200

        # a file xds_server would refuse (an endpoint host name that does not resolve: .invalid is reserved,
        # RFC 2606) is refused here too, so the two never serve different files
        unresolvable = {
            **cfg,
            "tenants": [*cfg["tenants"], {"name": "late", "api_keys": ["sk-late-0001"]}],
            "endpoints": [
                {
                    "name": "gpu-9",
                    "address": "gpu-9.invalid:8001",
                    "model": "llama",
                    "version": "v1",
                    "gpu": "H100",
                }
            ],
        }
        path.write_text(yaml.safe_dump(unresolvable))
        line = await proc.wait_for_line("endpoints[0].address")
        assert "config reload refused" in line and "does not resolve" in line
        assert await first_status(addr, "sk-late-0001") == 401
        assert await first_status(addr, "sk-newt-0001") == 200
    finally:
        rc = await proc.stop()
    assert rc == 0
    assert any("ext_proc stopped" in line for line in proc.lines)
    assert not any("Traceback" in line for line in proc.lines), "\n".join(proc.lines)


async def test_process_refuses_a_bad_config_at_start(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump({"models": [{"name": "m", "versions": [{"name": "v1", "traffic_percent": 50}]}]})
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ext_proc",
        "--config",
        str(path),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    with contextlib.suppress(TimeoutError):
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
        raise AssertionError("ext_proc did not exit on a bad config")
    assert proc.returncode == 1
    assert b"models[0].versions" in err


@pytest.mark.parametrize("service", ["ext_proc", "ext_authz"])
def test_each_service_refuses_a_config_of_the_other_protocol(tmp_path: Path, service: str) -> None:
    """``python -m ext_proc`` on an ``ext_authz`` config (the default) and the reverse exit 1 naming the
    protocol: Envoy would call the other service, and metering would be nobody's."""
    other = "ext_authz" if service == "ext_proc" else "ext_proc"
    cfg = {
        **CONFIG,
        "ext_proc": {
            "protocol": other,
            "listen": f"127.0.0.1:{free_port()}",
            "metrics_listen": f"127.0.0.1:{free_port()}",
        },
    }
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run(
        [sys.executable, "-m", service, "--config", str(path)],
        check=False, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"ext_proc.protocol is {other}, not {service}" in done.stderr
