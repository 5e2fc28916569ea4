"""Through real Envoy: what a model server receives. The simulated GPUs record the headers of each
inference request (``GET /sim/requests``); the client's Host, its forwarded-for claim, the API key and
every internal ``x-inferlb-*`` header, and every ``x-envoy-*`` header (Envoy's or a client's) never get
there."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from inferlb.request import headers
from tests.e2e.conftest import RunningStack, http_request

pytestmark = pytest.mark.e2e

CLIENT_HEADERS = {
    "Host": "evil.example",
    "X-Forwarded-For": "203.0.113.7",
    "X-Inferlb-Prompt-Tokens": "1",
    "X-Inferlb-Tenant": "someone-else",
    "X-Envoy-Made-Up": "by-the-client",
}


def _is_own_address(ip: str) -> bool:
    """``ip`` is one of this machine's addresses (a socket binds to it; nothing is sent)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def _received(stack: RunningStack, endpoint: str) -> dict[str, Any]:
    """The newest request the simulated GPU named ``endpoint`` recorded."""
    [ep] = [e for e in stack.config.endpoints if e.display_name == endpoint]
    reply = http_request(str(ep.address), "GET", "/sim/requests")
    assert reply.status == 200
    recorded: list[dict[str, Any]] = reply.json()["requests"]
    assert recorded, endpoint
    return recorded[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_model_servers_get_no_client_host_no_internal_headers_and_envoys_peer_address(
    shared_stack: RunningStack, stream: bool
) -> None:
    reply = shared_stack.chat("qwen", headers=CLIENT_HEADERS, stream=stream)
    assert reply.status == 200, reply.body
    got = _received(shared_stack, reply.headers[headers.ENDPOINT])
    hdrs: dict[str, str] = got["headers"]
    assert got["path"] == "/v1/chat/completions"
    # the route's host_rewrite_literal: the model's canonical name, not what the client sent
    assert hdrs["host"] == "qwen2.5-7b-instruct"
    assert "evil.example" not in str(hdrs), hdrs
    # Envoy's view of the peer only (the client's claim removed before use_remote_address appends): for a
    # loopback peer Envoy writes its own node address (conn_manager_utility: the machine's primary
    # address, which is why a loopback client's request can carry a non-loopback x-forwarded-for)
    assert "203.0.113.7" not in str(hdrs), hdrs
    xff = hdrs["x-forwarded-for"]
    assert "," not in xff and _is_own_address(xff), hdrs
    assert "authorization" not in hdrs
    internal = sorted(h for h in hdrs if h.startswith((headers.PREFIX, "x-envoy-")))
    assert internal == [], internal  # the gateway's, Envoy's (x-envoy-external-address), the client's
    assert "someone-else" not in str(hdrs)
