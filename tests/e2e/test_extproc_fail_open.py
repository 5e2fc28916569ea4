"""Fail-open through real Envoy with the request-path process (ext_proc, or ext_authz in that mode)
stopped: Envoy itself routes each request by its body's ``model`` (aliases included) to that model's main
version, answers an unknown model with OpenAI's 404, and checks the API key against the tenants' keys (401
OpenAI JSON without a known one); a client cannot skip the check with the request path's own headers, the
keys do not show in Envoy's config dump, and while the request path answers nothing of this runs."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from inferlb.request import headers
from tests.conftest import make_config_doc
from tests.e2e.conftest import Reply, RunningStack, http_request, in_mode, started_stack
from xds_server import resources as r

pytestmark = pytest.mark.e2e

CLIENT_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    """Every path fails open but ``/v1/completions`` (closed); no ``fail_open_model``; in each request-path
    mode (ext_authz: the completions path is checked by the second, fail-closed, ext_authz filter)."""
    doc = in_mode(make_config_doc(), request_path)
    doc["ext_proc"].update(
        failure_mode_allow=True,
        message_timeout_ms=1_000,
        path_failure_modes={"/v1/completions": "closed"},
    )
    with started_stack(tmp_path_factory.mktemp("fail-open"), doc) as rs:
        yield rs


@pytest.fixture(scope="module")
def ext_proc_down(stack: RunningStack) -> RunningStack:
    """The same stack after its request-path process (ext_proc or ext_authz) is killed."""
    proc = stack.stack.child(stack.config.ext_proc.protocol).proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    return stack


def _post(rs: RunningStack, path: str, body: dict[str, Any], hdrs: dict[str, str]) -> Reply:
    return http_request(rs.gateway, "POST", path, body, hdrs, timeout_s=CLIENT_TIMEOUT_S)


def _chat(rs: RunningStack, model: str, hdrs: dict[str, str]) -> Reply:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return _post(rs, "/v1/chat/completions", body, hdrs)


def _error(reply: Reply) -> dict[str, Any]:
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    err = reply.json()["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    return err


def _served_by(rs: RunningStack, reply: Reply) -> tuple[str, str]:
    """``(model, version)`` of the endpoint that served ``reply``."""
    [ep] = [e for e in rs.config.endpoints if e.display_name == reply.headers[headers.ENDPOINT]]
    return ep.model, ep.version or ""


def _admin(rs: RunningStack, path: str) -> str:
    url = f"http://{rs.config.gateway.admin}{path}"
    with urllib.request.urlopen(url, timeout=CLIENT_TIMEOUT_S) as resp:
        return str(resp.read().decode())


def _stat(rs: RunningStack, name: str) -> int:
    for line in _admin(rs, f"/stats?filter={name}").splitlines():
        key, _, value = line.partition(": ")
        if key.endswith(name):
            return int(value)
    return 0


GOOD = {"Authorization": "Bearer sk-demo-a"}
COMPLETION = {"model": "qwen", "prompt": "hi", "max_tokens": 2}


def test_with_ext_proc_up_nothing_of_the_fail_open_path_runs(stack: RunningStack) -> None:
    transformed = _stat(stack, "http_transform.rq_transformed")
    r1 = _chat(stack, "qwen", GOOD)
    assert r1.status == 200, r1.body
    assert r.FAILED_OPEN_HEADER not in r1.headers
    bad = _chat(stack, "qwen", {"Authorization": "Bearer sk-nope-123456"})
    assert bad.status == 401
    # ext_proc's own refusal (it masks the key), not Envoy's
    assert _error(bad)["message"].startswith("Incorrect API key provided: sk-"), bad.body
    unknown = _chat(stack, "no-such-model", GOOD)
    assert unknown.status == 404 and "'no-such-model'" in _error(unknown)["message"]
    completion = _post(stack, "/v1/completions", COMPLETION, GOOD)  # the fail-closed path
    assert completion.status == 200, completion.body
    assert r.FAILED_OPEN_HEADER not in completion.headers
    # the body was not parsed by Envoy, and Envoy checked no key
    assert _stat(stack, "http_transform.rq_transformed") == transformed
    assert _stat(stack, "api_key_auth.allowed") == 0
    assert _stat(stack, "api_key_auth.unauthorized") == 0


def test_failed_open_requests_go_to_the_bodys_model_main_version(ext_proc_down: RunningStack) -> None:
    rs = ext_proc_down
    for model, expect in (
        ("qwen2.5-7b-instruct", "qwen2.5-7b-instruct"),
        ("qwen", "qwen2.5-7b-instruct"),
        ("llama3", "llama-3.1-8b-instruct"),
        ("llama-3.1-8b-instruct", "llama-3.1-8b-instruct"),
    ):
        for _ in range(3):
            reply = _chat(rs, model, GOOD)
            assert reply.status == 200, (model, reply.body)
            assert reply.headers[r.FAILED_OPEN_HEADER] == "true"
            assert reply.json()["model"] == expect  # the model server got the canonical name
            served_model, version = _served_by(rs, reply)
            assert served_model == expect
            if expect.startswith("llama"):
                assert version == "v1", version  # the main version (90%), never the canary
    emb = _post(rs, "/v1/embeddings", {"model": "qwen", "input": "hello"}, GOOD)
    assert emb.status == 200, emb.body
    assert emb.headers[r.FAILED_OPEN_HEADER] == "true"
    assert _served_by(rs, emb)[0] == "qwen2.5-7b-instruct"
    # the request-path filter's own count of requests let through (ext_proc.* or ext_authz.*)
    assert _stat(rs, f"{rs.config.ext_proc.protocol}.failure_mode_allowed") > 0


def test_the_one_fail_closed_path_answers_5xx_json_while_the_others_fail_open(
    ext_proc_down: RunningStack,
) -> None:
    rs = ext_proc_down
    for _ in range(3):
        closed = _post(rs, "/v1/completions", COMPLETION, GOOD)
        # a failed ext_proc stream is Envoy's 500, a failed check its status_on_error 503
        assert closed.status == (500 if rs.config.ext_proc.protocol == "ext_proc" else 503), closed.body
        assert r.FAILED_OPEN_HEADER not in closed.headers
        assert _error(closed)["code"] == "gateway_processor_unavailable"
        assert _chat(rs, "qwen", GOOD).headers[r.FAILED_OPEN_HEADER] == "true"


def test_failed_open_unknown_or_missing_model_gets_openai_errors(ext_proc_down: RunningStack) -> None:
    unknown = _chat(ext_proc_down, "gpt-9", GOOD)
    assert unknown.status == 404, unknown.body
    err = _error(unknown)
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "model_not_found", "model")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    missing = _post(ext_proc_down, "/v1/chat/completions", body, GOOD)
    assert missing.status == 400, missing.body
    err = _error(missing)
    assert (err["type"], err["param"]) == ("invalid_request_error", "model")


def test_failed_open_requests_need_a_tenants_key(ext_proc_down: RunningStack) -> None:
    rs = ext_proc_down
    refused = _stat(rs, "api_key_auth.unauthorized")
    none = _chat(rs, "qwen", {})
    assert none.status == 401, none.body
    err = _error(none)
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
    assert err["message"].startswith("You didn't provide an API key")
    for key in ("Bearer sk-not-a-key", "sk-not-a-key", "Basic c2stZGVtby1h", "bearer sk-demo-a"):
        wrong = _chat(rs, "qwen", {"Authorization": key})
        assert wrong.status == 401, (key, wrong.body)
        err = _error(wrong)
        assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
        assert err["message"] == "Incorrect API key provided."
    # an unknown model is not revealed to a client without a key
    assert _chat(rs, "gpt-9", {}).status == 401
    assert _stat(rs, "api_key_auth.unauthorized") == refused + 6
    # every tenant's key works
    for key in ("sk-demo-b", "sk-demo-c"):
        assert _chat(rs, "qwen", {"Authorization": f"Bearer {key}"}).status == 200
    # Envoy strips only a "Bearer " prefix (case-sensitive) and takes any other value whole: a tenant's
    # bare key passes where ext_proc asks for the Bearer scheme, a lower-case "bearer" is refused (above)
    assert _chat(rs, "qwen", {"Authorization": "sk-demo-a"}).status == 200


def test_a_client_cannot_skip_the_check_with_ext_procs_headers(ext_proc_down: RunningStack) -> None:
    rs = ext_proc_down
    spoof = {
        headers.MODEL: "qwen2.5-7b-instruct",
        headers.VERSION: "default",
        headers.PRIORITY: "high",
        headers.BODY_MODEL: "qwen",
    }
    assert _chat(rs, "qwen", spoof).status == 401
    assert _chat(rs, "qwen", {"Authorization": "Bearer sk-not-a-key", **spoof}).status == 401
    # with a good key the body decides, not the client's headers
    reply = _chat(rs, "llama3", {**GOOD, **spoof})
    assert reply.status == 200 and _served_by(rs, reply)[0] == "llama-3.1-8b-instruct"
    # the model server sees neither the key nor the gateway's headers
    [ep] = [e for e in rs.config.endpoints if e.display_name == reply.headers[headers.ENDPOINT]]
    got = http_request(str(ep.address), "GET", "/sim/requests").json()["requests"][-1]["headers"]
    assert "authorization" not in got
    assert sorted(h for h in got if h.startswith(headers.PREFIX)) == []


def test_envoys_config_dump_redacts_the_keys(ext_proc_down: RunningStack) -> None:
    dump = _admin(ext_proc_down, "/config_dump")
    json.loads(dump)
    assert "ApiKeyAuthPerRoute" in dump and "[redacted]" in dump
    for tenant in ext_proc_down.config.tenants:
        for key in tenant.api_keys:
            assert key not in dump
