"""A model named by an alias reaches the model server under its canonical name, through a real Envoy.

The simulated GPUs serve the aliases of the config they started with, like a vLLM started with
``--served-model-name``; an alias added to the config file later is known to the gateway after its reload
but not to them (a real vLLM serving ``llama-3.1-8b-instruct`` knows no alias at all). ext_proc rewrites the
body's ``model`` to the canonical name, so the request still succeeds, and the answer carries the name the
model server used (gpusim echoes the request's ``model``, as vLLM does).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from inferlb.ops.stack import Stack
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import RunningStack, http_request, in_mode, stop_stack

pytestmark = pytest.mark.e2e

LLAMA = "llama-3.1-8b-instruct"
NEW_ALIAS = "llama-hot-reloaded"
KEY = "sk-demo-a"
MESSAGES: Any = [{"role": "user", "content": "which model am I talking to?"}]


@pytest.fixture(scope="module")
def alias_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    """The default fleet (response accounting on: ext_proc meters the stream itself, ext_authz through
    Envoy's Lua filter and access log; both add include_usage to a stream and hide it again) whose config
    file gains an alias once it is running."""
    work = tmp_path_factory.mktemp("alias")
    doc = in_mode(make_config_doc(), request_path)
    path = write_config(work / "inferlb.yaml", doc)
    stack = Stack(path, workdir=work, log_level="info")
    stack.start(timeout_s=60)
    try:
        assert stack.config.ext_proc.account_responses
        rs = RunningStack(stack, stack.config, path, doc)
        model = next(m for m in doc["models"] if m["name"] == LLAMA)
        model["aliases"] = [*model.get("aliases", []), NEW_ALIAS]
        write_config(path, doc)
        wait_for_alias(rs, NEW_ALIAS)
        yield rs
    finally:
        stop_stack(stack)


def wait_for_alias(rs: RunningStack, alias: str, timeout_s: float = 20.0) -> None:
    """Wait (bounded) until ext_proc, having polled the changed file, answers ``GET /v1/models/{alias}``."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = http_request(
            rs.gateway, "GET", f"/v1/models/{alias}", headers={"Authorization": f"Bearer {KEY}"}
        )
        if reply.status == 200:
            assert reply.json()["id"] == LLAMA
            return
        assert reply.status == 404, reply.body
        assert time.monotonic() < deadline, f"ext_proc did not pick up the alias {alias!r} in {timeout_s} s"
        time.sleep(0.1)


def llama_server(rs: RunningStack) -> str:
    """The address of one simulated GPU serving the llama model."""
    return next(str(ep.address) for ep in rs.config.endpoints if ep.model == LLAMA)


def client(rs: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{rs.gateway}/v1", api_key=KEY, max_retries=0, timeout=30)


def test_the_model_server_does_not_know_the_new_alias(alias_stack: RunningStack) -> None:
    # the premise: sent as is, the alias would be refused by the model server
    body = {"model": NEW_ALIAS, "messages": MESSAGES, "max_tokens": 2}
    reply = http_request(llama_server(alias_stack), "POST", "/v1/chat/completions", body)
    assert reply.status == 404, reply.body
    assert reply.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("name", [NEW_ALIAS, "llama3", LLAMA])
def test_the_model_server_gets_the_canonical_name(alias_stack: RunningStack, name: str) -> None:
    reply = alias_stack.chat(name, content="which model am I talking to?", max_tokens=3)
    assert reply.status == 200, reply.body
    assert reply.headers.get("x-inferlb-endpoint")
    doc = reply.json()
    assert doc["model"] == LLAMA  # the name the model server was sent (gpusim echoes it)
    assert doc["usage"]["completion_tokens"] == 3


def test_an_aliased_stream_is_renamed_and_keeps_its_usage_hidden(alias_stack: RunningStack) -> None:
    # one rewrite for both: the canonical name and the gateway's include_usage, whose chunk is stripped
    with client(alias_stack) as c:
        chunks = list(
            c.chat.completions.create(model=NEW_ALIAS, messages=MESSAGES, max_tokens=5, stream=True)
        )
    assert chunks
    assert {ch.model for ch in chunks} == {LLAMA}
    assert all(ch.usage is None and ch.choices for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks)
    # the bytes too: the model server puts "usage": null on every chunk of an include_usage stream; a
    # client that did not ask for usage gets none of them (the SDK reads a missing and a null usage alike)
    raw = alias_stack.chat(NEW_ALIAS, max_tokens=5, stream=True)
    assert raw.status == 200 and raw.body.endswith(b"data: [DONE]\n\n"), raw.body
    assert raw.body.count(b"data: ") >= 5 + 1 and b"usage" not in raw.body, raw.body


def test_an_aliased_stream_that_asked_for_usage_sees_it(alias_stack: RunningStack) -> None:
    with client(alias_stack) as c:
        chunks = list(
            c.chat.completions.create(
                model=NEW_ALIAS,
                messages=MESSAGES,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert {ch.model for ch in chunks} == {LLAMA}
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1
    assert usage[0].completion_tokens == 4
