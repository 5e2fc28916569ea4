"""Responses API accounting through a real Envoy: the official ``openai`` SDK's ``client.responses.create``
(streamed and not) against the simulated fleet, in both request-path modes; the gateway must charge exactly
the ``usage`` the SDK saw (``input_tokens`` as prompt, ``output_tokens`` as completion), read back from its
``/metrics``."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import SHARED_TENANTS, RunningStack
from tests.e2e.test_extproc_accounting import charged, wait_charged

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
#: This module's tenants on the shared stack (:data:`tests.e2e.conftest.SHARED_TENANTS`), one per test.
TENANTS = ("resp-json", "resp-sse")


@pytest.fixture(scope="module")
def responses_stack(shared_stack: RunningStack) -> RunningStack:
    """The shared stack (:func:`tests.e2e.conftest.shared_doc`: the default fleet with the default response
    accounting, and one tenant per test of this module) in each request-path mode (ext_authz: the usage
    read by Envoy's Lua filter, settled from the access log). Each test reads its own tenant's charges as
    a difference, so what other modules did on the stack does not count."""
    assert shared_stack.config.ext_proc.account_responses
    assert set(TENANTS) <= {t["name"] for t in SHARED_TENANTS}
    return shared_stack


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
