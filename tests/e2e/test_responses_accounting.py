"""Responses API accounting through a real Envoy: the official ``openai`` SDK's ``client.responses.create``
(streamed and not) against the simulated fleet, in both request-path modes; the gateway must charge exactly
the ``usage`` the SDK saw (``input_tokens`` as prompt, ``output_tokens`` as completion), read back from its
``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, in_mode, started_stack
from tests.e2e.test_extproc_accounting import charged, wait_charged

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
TENANTS = ("resp-json", "resp-sse")


@pytest.fixture(scope="module")
def responses_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    """The default fleet with the default response accounting, plus one tenant per test, in each
    request-path mode (ext_authz: the usage read by Envoy's Lua filter, settled from the access log)."""
    work = tmp_path_factory.mktemp("responses")
    doc = in_mode(make_config_doc(), request_path)
    doc["ext_proc"].pop("account_responses", None)  # the default is what is under test
    doc["tenants"] += [{"name": t, "api_keys": [f"sk-{t}-key"]} for t in TENANTS]
    with started_stack(work, doc) as rs:
        assert rs.config.ext_proc.account_responses
        yield rs


def test_a_response_body_is_charged_its_usage(responses_stack: RunningStack) -> None:
    rs = responses_stack
    before = charged(rs.config, "resp-json", QWEN)
    with rs.openai_client("sk-resp-json-key") as c:
        resp = c.responses.create(
            model=QWEN, instructions="Be brief.", input="count my response tokens", max_output_tokens=9
        )
    assert resp.status == "incomplete" and resp.output_text
    assert resp.usage is not None and resp.usage.output_tokens == 9
    assert wait_charged(rs.config, "resp-json", QWEN, before) == (
        resp.usage.input_tokens,
        resp.usage.output_tokens,
    )


def test_a_response_stream_is_charged_the_usage_of_its_completed_event(responses_stack: RunningStack) -> None:
    rs = responses_stack
    before = charged(rs.config, "resp-sse", QWEN)
    with rs.openai_client("sk-resp-sse-key") as c:
        events = list(
            c.responses.create(
                model=QWEN,
                input=[{"role": "user", "content": "stream a response"}],
                max_output_tokens=11,
                stream=True,
            )
        )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 11
    finished = [e.response for e in events if e.type == "response.incomplete"]
    assert len(finished) == 1 and events[-1].type == "response.incomplete"
    usage = finished[0].usage
    assert usage is not None and usage.output_tokens == 11
    assert finished[0].output_text == "".join(deltas)
    assert wait_charged(rs.config, "resp-sse", QWEN, before) == (usage.input_tokens, usage.output_tokens)
