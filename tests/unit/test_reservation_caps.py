"""What admission reserves: prompt + the largest output cap the request carries x ``n`` x prompts, over every
combination of the cap fields (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``) on every
generating endpoint, while the context-length check and the model server keep the cap the server applies."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ext_proc import handlers
from ext_proc.handlers import Gateway, PendingRequest, PreparedRequest
from inferlb.config.schema import parse_config
from inferlb.request.parsing import EndpointKind, parse_request

DEFAULT_MAX_TOKENS = 77
CONFIG = parse_config(
    {
        "models": [{"name": "llama", "context_length": 10_000_000, "default_max_tokens": DEFAULT_MAX_TOKENS}],
        "tenants": [{"name": "t", "api_keys": ["sk-t-000001"]}],
    }
)
GATEWAY = Gateway.from_config(CONFIG)
TENANT = CONFIG.tenants[0]
PATHS = {
    EndpointKind.CHAT_COMPLETIONS: "/v1/chat/completions",
    EndpointKind.COMPLETIONS: "/v1/completions",
    EndpointKind.RESPONSES: "/v1/responses",
}
#: the output cap fields of each endpoint's own API (OpenAI API reference): other endpoints' fields are
#: ignored by the model servers and so by the reservation
OWN_CAPS = {
    EndpointKind.CHAT_COMPLETIONS: ("max_tokens", "max_completion_tokens"),
    EndpointKind.COMPLETIONS: ("max_tokens",),
    EndpointKind.RESPONSES: ("max_output_tokens",),
}
CAP_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

cap = st.one_of(st.none(), st.integers(1, 100_000))


def prepare(kind: EndpointKind, doc: dict[str, Any]) -> PreparedRequest:
    pending = PendingRequest(tenant=TENANT, kind=kind, path=PATHS[kind])
    prepared = handlers.prepare_body(GATEWAY, pending, json.dumps(doc).encode())
    assert isinstance(prepared, PreparedRequest), prepared
    return prepared


@given(
    kind=st.sampled_from(sorted(PATHS, key=str)),
    caps=st.tuples(cap, cap, cap),
    n=st.one_of(st.none(), st.integers(1, 8)),
    best_of=st.one_of(st.none(), st.integers(1, 8)),
    prompts=st.integers(1, 3),
)
def test_admission_reserves_the_largest_output_cap_times_n(
    kind: EndpointKind,
    caps: tuple[int | None, int | None, int | None],
    n: int | None,
    best_of: int | None,
    prompts: int,
) -> None:
    doc: dict[str, Any] = {"model": "llama"}
    for name, value in zip(CAP_FIELDS, caps, strict=True):
        if value is not None:
            doc[name] = value
    choices = 1
    if kind is EndpointKind.CHAT_COMPLETIONS:
        doc["messages"] = [{"role": "user", "content": "hello there"}]
        if n is not None:
            doc["n"] = n
            choices = n
    elif kind is EndpointKind.COMPLETIONS:
        doc["prompt"] = ["hello there"] * prompts if prompts > 1 else "hello there"
        if n is not None:
            doc["n"] = n
        if best_of is not None:
            doc["best_of"] = best_of
        choices = max(n or 1, best_of or 1) * prompts
    else:
        doc["input"] = "hello there"
    prepared = prepare(kind, doc)

    own = [doc[f] for f in OWN_CAPS[kind] if f in doc]
    largest = max(own) if own else DEFAULT_MAX_TOKENS
    assert prepared.reserved_tokens == prepared.prompt_tokens + largest * choices
    # the model server's cap is unchanged: for chat the newer field wins, as OpenAI and vLLM read it
    if kind is EndpointKind.CHAT_COMPLETIONS:
        applied = doc.get("max_completion_tokens", doc.get("max_tokens"))
    else:
        applied = doc.get(OWN_CAPS[kind][0])
    assert prepared.request.max_output_tokens == applied


def test_a_small_max_completion_tokens_does_not_hide_a_large_max_tokens() -> None:
    doc = {"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1}
    prepared = prepare(EndpointKind.CHAT_COMPLETIONS, {**doc, "max_tokens": 10_000, "n": 2})
    assert prepared.reserved_tokens == prepared.prompt_tokens + 20_000
    request = parse_request(EndpointKind.CHAT_COMPLETIONS, json.dumps({**doc, "max_tokens": 10_000}).encode())
    assert (request.max_output_tokens, request.largest_output_tokens) == (1, 10_000)
