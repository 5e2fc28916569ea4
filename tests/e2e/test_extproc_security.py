"""What reaches a model server through a real Envoy: never the tenant's API key, and an
``x-forwarded-for`` that is Envoy's (``use_remote_address``), not the client's claim.

A model ``recorder`` is served by a tiny HTTP server in this test process that records the headers of
every request it gets and answers an OpenAI chat completion.
"""

from __future__ import annotations

import ipaddress
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import openai
import pytest

from inferlb.ops.stack import Stack
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import RunningStack, in_mode, stop_stack

pytestmark = pytest.mark.e2e

RECORDER = "recorder"


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        body = json.dumps(
            {
                "id": "chatcmpl-rec",
                "object": "chat.completion",
                "created": 0,
                "model": RECORDER,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # the stdlib's parameter name
        return


@pytest.fixture(scope="module")
def recorder_stack(
    tmp_path_factory: pytest.TempPathFactory, request_path: str
) -> Iterator[tuple[RunningStack, type[_Recorder]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    work = tmp_path_factory.mktemp("security")
    doc = in_mode(make_config_doc(), request_path)
    doc["models"].append({"name": RECORDER})
    doc["endpoints"].append(
        {"address": f"127.0.0.1:{server.server_address[1]}", "model": RECORDER, "gpu": "A100"}
    )
    path = write_config(work / "inferlb.yaml", doc)
    stack = Stack(path, workdir=work, log_level="info")
    try:
        stack.start(timeout_s=60)
        yield RunningStack(stack, stack.config, path, doc), _Recorder
    finally:
        stop_stack(stack)
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_api_key_never_reaches_a_model_server(
    recorder_stack: tuple[RunningStack, type[_Recorder]],
) -> None:
    rs, rec = recorder_stack
    rec.seen.clear()
    for key in ("sk-demo-a", "sk-demo-b"):  # HIGH and DEFAULT routes
        with openai.OpenAI(base_url=f"http://{rs.gateway}/v1", api_key=key, max_retries=0) as c:
            resp = c.chat.completions.create(model=RECORDER, messages=[{"role": "user", "content": "hi"}])
        assert resp.choices[0].message.content == "ok"
    assert len(rec.seen) == 2
    for hdrs in rec.seen:
        assert "authorization" not in hdrs
        # the routing headers ext_proc set were used by the route, then removed with every internal one
        assert not [h for h in hdrs if h.startswith("x-inferlb-")], hdrs


def test_x_forwarded_for_is_envoys_not_the_clients(
    recorder_stack: tuple[RunningStack, type[_Recorder]],
) -> None:
    rs, rec = recorder_stack
    rec.seen.clear()
    with openai.OpenAI(
        base_url=f"http://{rs.gateway}/v1",
        api_key="sk-demo-a",
        max_retries=0,
        default_headers={"x-forwarded-for": "203.0.113.7", "x-envoy-external-address": "203.0.113.7"},
    ) as c:
        c.chat.completions.create(model=RECORDER, messages=[{"role": "user", "content": "hi"}])
    [hdrs] = rec.seen
    # exactly one address, Envoy's view of the peer (for a loopback peer Envoy writes its own node address,
    # Envoy's conn_manager_utility), and the client's claim is gone from every header
    xff = hdrs["x-forwarded-for"]
    assert "," not in xff and ipaddress.ip_address(xff)
    assert not any("203.0.113.7" in v for v in hdrs.values()), hdrs
