"""Fewer ext_proc messages through a real Envoy: each message is a gRPC round trip.

ext_proc answers the response headers with a ``mode_override`` (the filter's ``allow_mode_override``): a
non-2xx answer (charged nothing) gets no body message at all while the client still gets the whole error
body; a 2xx JSON answer that fits Envoy's buffer comes as one BUFFERED body message instead of the body
and an empty end-of-stream chunk. A request on a path that is not inference is answered at its headers
with an override that skips its body and response phases. The messages ext_proc answered are read back
from its own ``/metrics`` (``inferlb_ext_proc_processing_seconds_count`` by phase).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, http_request, in_mode, started_stack

pytestmark = pytest.mark.e2e

TENANT = "mode-override"
KEY = "sk-mode-override-key"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """The default fleet with response accounting on (the default), other paths let through, and one
    tenant of its own."""
    work = tmp_path_factory.mktemp("mode-override")
    doc = in_mode(make_config_doc(), "ext_proc")  # ext_proc's own messages are what this module counts
    doc["ext_proc"].pop("account_responses", None)
    doc["ext_proc"]["non_inference_paths"] = "allow"
    doc["tenants"] += [{"name": TENANT, "api_keys": [KEY]}]
    with started_stack(work, doc) as rs:
        assert rs.config.ext_proc.account_responses
        yield rs


def messages_answered(rs: RunningStack) -> dict[str, int]:
    """ext_proc messages answered so far, by phase, from its ``/metrics``."""
    text = http_request(str(rs.config.ext_proc.metrics_listen), "GET", "/metrics").body.decode()
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "inferlb_ext_proc_processing_seconds_count":
                out[s.labels["phase"]] = out.get(s.labels["phase"], 0) + int(s.value)
    return out


def wait_answered(rs: RunningStack, phase: str, at_least: int, timeout_s: float = 10.0) -> dict[str, int]:
    """The per-phase counts once ``phase`` reached ``at_least`` (bounded wait: the metric is observed after
    the answer is written, which can land just after the client got its response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = messages_answered(rs)
        if now.get(phase, 0) >= at_least or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def requests_total(rs: RunningStack, *, tenant: str, model: str, status: str) -> float:
    """ext_proc's ``inferlb_requests_total`` for one tenant, model and status (0 when absent)."""
    text = http_request(str(rs.config.ext_proc.metrics_listen), "GET", "/metrics").body.decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "inferlb_requests_total" and s.labels == {
                "tenant": tenant,
                "model": model,
                "status": status,
            }:
                return s.value
    return 0.0


def chat(rs: RunningStack, **extra: object) -> tuple[int, dict[str, object]]:
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}
    reply = http_request(rs.gateway, "POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"})
    return reply.status, json.loads(reply.body)


def added_messages(rs: RunningStack, before: dict[str, int]) -> dict[str, int]:
    """Messages answered since ``before``, by phase (phases with none left out)."""
    time.sleep(0.3)  # a later message, if Envoy sent one, is answered within this
    now = messages_answered(rs)
    added = {phase: now.get(phase, 0) - before.get(phase, 0) for phase in {*now, *before}}
    return {phase: n for phase, n in added.items() if n}


def test_a_non_2xx_response_sends_ext_proc_no_body(stack: RunningStack) -> None:
    rs = stack
    before = messages_answered(rs)
    # n above the simulated server's batch size (64 in the fast fleet): ext_proc admits it, the model
    # server answers 400
    status, doc = chat(rs, n=100)
    assert status == 400
    assert "batch size" in str(doc["error"])  # the model server's own error body reached the client whole
    wait_answered(rs, "response_headers", before.get("response_headers", 0) + 1)
    assert added_messages(rs, before) == {"request_headers": 1, "request_body": 1, "response_headers": 1}
    assert requests_total(rs, tenant=TENANT, model="qwen2.5-7b-instruct", status="400") == 1


def test_a_2xx_json_response_comes_as_one_body_message(stack: RunningStack) -> None:
    rs = stack
    before = messages_answered(rs)
    status, doc = chat(rs)
    assert status == 200
    usage = doc["usage"]
    assert isinstance(usage, dict)
    wait_answered(rs, "response_body", before.get("response_body", 0) + 1)
    assert added_messages(rs, before) == {
        "request_headers": 1,
        "request_body": 1,
        "response_headers": 1,
        "response_body": 1,
    }
    assert requests_total(rs, tenant=TENANT, model="qwen2.5-7b-instruct", status="200") >= 1


def test_a_let_through_request_gets_no_body_or_response_phases(stack: RunningStack) -> None:
    rs = stack
    before = messages_answered(rs)
    reply = http_request(
        rs.gateway, "POST", "/v1/not-an-inference-path", {"x": 1}, {"Authorization": f"Bearer {KEY}"}
    )
    assert reply.status > 0  # whatever the route answers, the client got a reply
    after = wait_answered(rs, "request_headers", before.get("request_headers", 0) + 1)
    assert after.get("request_headers", 0) == before.get("request_headers", 0) + 1
    time.sleep(0.3)  # a later message, if Envoy sent one, is answered within this
    now = messages_answered(rs)
    for phase in ("request_body", "response_headers", "response_body"):
        assert now.get(phase, 0) == before.get(phase, 0), phase
