"""When no GPU can answer, Envoy's own reply reaches the client as an OpenAI-style JSON error with the
right status (Envoy's local_reply_config from the xDS server), not as Envoy's plain text."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferlb.ops.stack import Stack, free_ports
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import REQUEST_PATH_MODES, http_request, in_mode, stop_stack

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("mode", REQUEST_PATH_MODES)
def test_a_model_whose_gpus_are_all_down_gets_a_json_503(tmp_path: Path, mode: str) -> None:
    doc = in_mode(make_config_doc(), mode)
    (dead_port,) = free_ports(1)  # nothing listens here
    doc["models"].append({"name": "dead-model"})
    doc["endpoints"].append(
        {"name": "gone-0", "address": f"127.0.0.1:{dead_port}", "model": "dead-model", "gpu": "A100"}
    )
    stack = Stack(write_config(tmp_path / "c.yaml", doc), workdir=tmp_path)
    stack.start(timeout_s=60)
    try:
        r = http_request(
            str(stack.config.gateway.listen),
            "POST",
            "/v1/chat/completions",
            {"model": "dead-model", "messages": [{"role": "user", "content": "hi"}]},
            {"Authorization": "Bearer sk-demo-a"},
        )
        assert r.status == 503, r.body
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["type"] == "server_error"
        assert "upstream" in err["message"]
        # a readable code for the cause, the response flags in the message, OpenAI's whole shape
        assert err["code"] in {"upstream_connect_failure", "no_healthy_upstream"}, err
        assert "Envoy response flags: " in err["message"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] is None
        # a live model on the same gateway is unaffected
        ok = http_request(
            str(stack.config.gateway.listen),
            "POST",
            "/v1/chat/completions",
            {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            {"Authorization": "Bearer sk-demo-a"},
        )
        assert ok.status == 200
    finally:
        stop_stack(stack)
