"""``ext_proc.process.run_event_loop``: uvloop when installed (with a real grpc aio ext_proc round trip on
it), asyncio's loop on request or when uvloop is missing, and a clear ImportError when uvloop is demanded
but missing."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from ext_proc.process import run_event_loop
from ext_proc.servicer import ExtProcState, add_to_server, make_server
from inferlb.config.schema import parse_config

uvloop = pytest.importorskip("uvloop")

CONFIG = {
    "models": [{"name": "llama", "versions": [{"name": "v1", "traffic_percent": 100}]}],
    "tenants": [{"name": "gold", "api_keys": ["sk-gold-0001"]}],
}


async def _on_uvloop() -> int:
    return 1 if isinstance(asyncio.get_running_loop(), uvloop.Loop) else 0


async def _models_list_status() -> int:
    """Serve ext_proc on a free loopback port and ask it for ``GET /v1/models`` (answered by ext_proc
    itself); returns the HTTP status of its immediate response."""
    server = make_server(1024 * 1024)
    add_to_server(server, ExtProcState(parse_config(CONFIG)))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            pairs = {
                ":method": "GET",
                ":path": "/v1/models",
                ":scheme": "http",
                ":authority": "127.0.0.1:10000",
                "authorization": "Bearer sk-gold-0001",
            }
            hm = base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            )
            call = stub.Process()
            await call.write(
                ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=True))
            )
            answer = await asyncio.wait_for(call.read(), timeout=10)
            call.cancel()
            return int(answer.immediate_response.status.code)
    finally:
        await server.stop(0)


def test_auto_runs_on_uvloop_when_installed() -> None:
    assert run_event_loop(_on_uvloop()) == (1, "uvloop")


def test_asyncio_choice_runs_on_the_standard_loop() -> None:
    assert run_event_loop(_on_uvloop(), "asyncio") == (0, "asyncio")


def test_grpc_aio_ext_proc_answers_on_uvloop() -> None:
    assert run_event_loop(_models_list_status(), "uvloop") == (200, "uvloop")


def test_auto_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # a None entry makes `import uvloop` raise ImportError
    assert run_event_loop(_on_uvloop()) == (0, "asyncio")


def test_demanding_a_missing_uvloop_raises_and_leaves_no_unawaited_coroutine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    # filterwarnings=error: a coroutine left unawaited would fail the test with a RuntimeWarning
    with pytest.raises(ImportError):
        run_event_loop(_on_uvloop(), "uvloop")
