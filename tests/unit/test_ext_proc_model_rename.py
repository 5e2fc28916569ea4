"""ext_proc handlers: a request naming a model by an alias goes upstream with the canonical name in its body
(and the matching ``content-length``); the canonical name is never rewritten; with a metered stream the
rename and ``include_usage`` are one body; the usage chunk is hidden only when the gateway asked for it."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from ext_proc import handlers
from ext_proc.handlers import BodyExpected, ContinueRequest, Gateway
from inferlb.config.schema import parse_config
from inferlb.policy.quota import QuotaBook, limits_from_config
from inferlb.request import headers as h

CANONICAL = "llama-3.1-8b-instruct"
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}


def make_gateway(*, account_responses: bool = True, protocol: str = "ext_proc") -> tuple[Gateway, QuotaBook]:
    config = parse_config(
        {
            "ext_proc": {"account_responses": account_responses, "protocol": protocol},
            "models": [{"name": CANONICAL, "aliases": ["llama3", "llama-3.1-8b"], "default_max_tokens": 50}],
            "tenants": [{"name": "gold", "api_keys": ["sk-gold-0001"]}],
        }
    )
    return Gateway.from_config(config), QuotaBook(limits_from_config(config), 0.0)


def send(gateway: Gateway, quotas: QuotaBook, body: bytes, path: str = PATHS["chat"]) -> ContinueRequest:
    headers = {":method": "POST", ":path": path, "authorization": "Bearer sk-gold-0001"}
    first = handlers.on_request_headers(gateway, headers, end_of_stream=False)
    assert isinstance(first, BodyExpected)
    out = handlers.on_request_body(gateway, quotas, first.pending, body, now=0.0, rng=random.Random(3))
    assert isinstance(out, ContinueRequest), out
    return out


def chat(model: str, **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def upstream(out: ContinueRequest) -> bytes:
    """The body the model server gets, checked against the content-length ext_proc sets for it."""
    assert out.body is not None
    assert dict(out.set_headers)["content-length"] == str(len(out.body))
    return out.body


@pytest.mark.parametrize("alias", ["llama3", "llama-3.1-8b"])
def test_alias_goes_upstream_as_the_canonical_name(alias: str) -> None:
    gateway, quotas = make_gateway()
    body = chat(alias, max_tokens=4)
    out = send(gateway, quotas, body)
    assert dict(out.set_headers)[h.MODEL] == CANONICAL
    assert upstream(out) == body.replace(f'"{alias}"'.encode(), f'"{CANONICAL}"'.encode())
    assert out.reservation is not None
    assert not out.reservation.strip_usage_event  # not a stream: nothing to hide


@pytest.mark.parametrize("account_responses", [True, False])
def test_canonical_name_is_forwarded_unchanged(account_responses: bool) -> None:
    gateway, quotas = make_gateway(account_responses=account_responses)
    out = send(gateway, quotas, chat(CANONICAL, max_tokens=4))
    assert out.body is None
    assert "content-length" not in dict(out.set_headers)


def test_aliased_metered_stream_is_one_rewrite_with_include_usage() -> None:
    gateway, quotas = make_gateway()
    out = send(gateway, quotas, chat("llama3", stream=True))
    doc = json.loads(upstream(out))
    assert doc["model"] == CANONICAL
    assert doc["stream_options"] == {"include_usage": True}
    assert out.reservation is not None
    assert out.reservation.strip_usage_event  # the gateway asked for the usage chunk: the client never did


def test_aliased_stream_that_asked_for_usage_keeps_its_usage_chunk() -> None:
    gateway, quotas = make_gateway()
    body = chat("llama3", stream=True, stream_options={"include_usage": True})
    out = send(gateway, quotas, body)
    assert upstream(out) == body.replace(b'"llama3"', f'"{CANONICAL}"'.encode())
    assert out.reservation is not None
    # the body was rewritten for the name only: the client's own usage chunk must reach it
    assert not out.reservation.strip_usage_event


def test_aliased_stream_without_accounting_is_renamed_only() -> None:
    gateway, quotas = make_gateway(account_responses=False)
    body = chat("llama3", stream=True)
    out = send(gateway, quotas, body)
    assert upstream(out) == body.replace(b'"llama3"', f'"{CANONICAL}"'.encode())
    assert out.reservation is not None
    assert not out.reservation.strip_usage_event


@pytest.mark.parametrize("protocol", ["ext_proc", "ext_authz"])
def test_canonical_metered_stream_gets_include_usage_only(protocol: str) -> None:
    # ext_authz: the same body change, applied by Envoy's Lua filter from the splices
    gateway, quotas = make_gateway(protocol=protocol)
    body = chat(CANONICAL, stream=True)
    out = send(gateway, quotas, body)
    assert upstream(out) == b'{"stream_options":{"include_usage":true},' + body[1:]
    assert out.reservation is not None
    assert out.reservation.strip_usage_event


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        (PATHS["completions"], {"prompt": "hi", "max_tokens": 3}),
        (PATHS["embeddings"], {"input": ["a", "b"]}),
        (PATHS["responses"], {"input": "hi", "max_output_tokens": 3}),
    ],
)
def test_every_inference_endpoint_renames_the_alias(path: str, payload: dict[str, Any]) -> None:
    gateway, quotas = make_gateway()
    body = json.dumps({"model": "llama3", **payload}).encode()
    out = send(gateway, quotas, body, path)
    assert upstream(out) == body.replace(b'"llama3"', f'"{CANONICAL}"'.encode())
