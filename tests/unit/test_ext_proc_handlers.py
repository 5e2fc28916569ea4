"""ext_proc handlers: every refusal with its status, OpenAI JSON body and details; the success headers."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from ext_proc import handlers
from ext_proc.handlers import BodyExpected, ContinueRequest, Gateway, ImmediateReply, PendingRequest
from inferlb.config.schema import Config, parse_config
from inferlb.errors import RequestError
from inferlb.policy.quota import QuotaBook, limits_from_config
from inferlb.request import headers as h
from inferlb.request.parsing import EndpointKind, InferenceRequest, parse_request
from inferlb.request.tokens import count_prompt_tokens

BODY_LIMIT = 4096


def make_config() -> Config:
    return parse_config(
        {
            "gateway": {"max_request_body_bytes": BODY_LIMIT},
            "models": [
                {
                    "name": "llama",
                    "aliases": ["llama3"],
                    "context_length": 1000,
                    "default_max_tokens": 100,
                    "versions": [
                        {"name": "v1", "traffic_percent": 90},
                        {"name": "v2", "traffic_percent": 10},
                    ],
                },
                {"name": "qwen", "default_max_tokens": 50},
            ],
            "tenants": [
                {"name": "gold", "api_keys": ["sk-gold-0001"], "priority": "high"},
                {
                    "name": "small",
                    "api_keys": ["sk-small-001"],
                    "tokens_per_minute": 300,
                    "requests_per_minute": 3,
                },
            ],
        }
    )


@pytest.fixture
def gateway() -> Gateway:
    return Gateway.from_config(make_config())


@pytest.fixture
def quotas() -> QuotaBook:
    return QuotaBook(limits_from_config(make_config()), 0.0)


def req_headers(
    path: str = "/v1/chat/completions", method: str = "POST", key: str | None = "sk-gold-0001", **extra: str
) -> dict[str, str]:
    out = {":method": method, ":path": path, ":authority": "gw", "content-type": "application/json", **extra}
    if key is not None:
        out["authorization"] = f"Bearer {key}"
    return out


def error_of(reply: object, status: int) -> dict[str, Any]:
    assert isinstance(reply, ImmediateReply), reply
    assert reply.status == status
    assert ("content-type", "application/json") in reply.headers
    assert reply.details
    assert not any(c.isspace() for c in reply.details)
    doc = json.loads(reply.body)
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    return dict(doc["error"])


def chat_body(model: str = "llama", **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello there"}], **extra}
    ).encode()


def run_body(
    gateway: Gateway,
    quotas: QuotaBook,
    body: bytes,
    *,
    key: str = "sk-gold-0001",
    path: str = "/v1/chat/completions",
    now: float = 0.0,
    end_of_stream: bool = True,
) -> object:
    first = handlers.on_request_headers(gateway, req_headers(path, key=key), end_of_stream=False)
    assert isinstance(first, BodyExpected)
    return handlers.on_request_body(
        gateway, quotas, first.pending, body, now=now, rng=random.Random(7), end_of_stream=end_of_stream
    )


# -- headers phase --------------------------------------------------------------------------------
def test_headers_accept_inference_post_and_strip_spoofed_headers(gateway: Gateway) -> None:
    out = handlers.on_request_headers(
        gateway,
        req_headers(**{"x-inferlb-tenant": "gold", "x-inferlb-model": "qwen", "x-other": "1"}),
        end_of_stream=False,
    )
    assert isinstance(out, BodyExpected)
    assert out.remove_headers == ("x-inferlb-model", "x-inferlb-tenant")
    assert out.pending.tenant.name == "gold"
    assert out.pending.kind is EndpointKind.CHAT_COMPLETIONS


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/chat/completions?x=1"])
def test_headers_accept_every_inference_path(gateway: Gateway, path: str) -> None:
    assert isinstance(
        handlers.on_request_headers(gateway, req_headers(path), end_of_stream=False), BodyExpected
    )


@pytest.mark.parametrize("key", [None, "sk-wrong-0000"])
def test_headers_401_before_the_body(gateway: Gateway, key: str | None) -> None:
    err = error_of(handlers.on_request_headers(gateway, req_headers(key=key), end_of_stream=False), 401)
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")


def test_headers_401_even_for_unknown_paths(gateway: Gateway) -> None:
    error_of(handlers.on_request_headers(gateway, req_headers("/nope", key=None), end_of_stream=True), 401)


def test_headers_400_inference_post_without_body(gateway: Gateway) -> None:
    err = error_of(handlers.on_request_headers(gateway, req_headers(), end_of_stream=True), 400)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/chat", "/", "/v2/chat/completions", "/health"])
def test_headers_404_unknown_path(gateway: Gateway, path: str) -> None:
    err = error_of(handlers.on_request_headers(gateway, req_headers(path), end_of_stream=False), 404)
    assert (err["type"], err["code"]) == ("invalid_request_error", "unknown_url")


def test_headers_405_wrong_method(gateway: Gateway) -> None:
    error_of(handlers.on_request_headers(gateway, req_headers(method="GET"), end_of_stream=True), 405)
    error_of(
        handlers.on_request_headers(gateway, req_headers("/v1/models", "POST"), end_of_stream=False), 405
    )


def test_models_list_answered_by_ext_proc(gateway: Gateway) -> None:
    out = handlers.on_request_headers(gateway, req_headers("/v1/models", "GET"), end_of_stream=True)
    assert isinstance(out, ImmediateReply)
    assert out.status == 200
    doc = json.loads(out.body)
    assert doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == ["llama", "qwen"]
    assert all(m["object"] == "model" for m in doc["data"])


def test_model_object_by_alias_and_unknown(gateway: Gateway) -> None:
    out = handlers.on_request_headers(gateway, req_headers("/v1/models/llama3", "GET"), end_of_stream=True)
    assert isinstance(out, ImmediateReply)
    assert out.status == 200
    assert json.loads(out.body)["id"] == "llama"
    err = error_of(
        handlers.on_request_headers(gateway, req_headers("/v1/models/x", "GET"), end_of_stream=True), 404
    )
    assert err["code"] == "model_not_found"


# -- body phase -----------------------------------------------------------------------------------
def test_body_success_sets_routing_headers(gateway: Gateway, quotas: QuotaBook) -> None:
    out = run_body(gateway, quotas, chat_body("llama3", user="alice"))
    assert isinstance(out, ContinueRequest)
    assert out.clear_route_cache
    got = dict(out.set_headers)
    assert got[h.MODEL] == "llama"  # alias resolved to the canonical name
    assert got[h.VERSION] in {"v1", "v2"}
    assert got[h.TENANT] == "gold"
    assert got[h.PRIORITY] == "high"
    assert int(got[h.PROMPT_TOKENS]) == 3 + 3 + 1 + 2  # cookbook: priming + message + "user" + "hello there"
    assert out.admitted is not None
    assert out.admitted.tokens == int(got[h.PROMPT_TOKENS]) + 100


def test_body_sticky_version_per_user(gateway: Gateway, quotas: QuotaBook) -> None:
    versions = set()
    for i in range(20):
        out = run_body(gateway, quotas, chat_body(user="bob"), now=float(i))
        assert isinstance(out, ContinueRequest)
        versions.add(dict(out.set_headers)[h.VERSION])
    assert len(versions) == 1


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b""])
def test_body_400_malformed(gateway: Gateway, quotas: QuotaBook, raw: bytes) -> None:
    err = error_of(run_body(gateway, quotas, raw), 400)
    assert err["type"] == "invalid_request_error"


def test_body_400_missing_model(gateway: Gateway, quotas: QuotaBook) -> None:
    err = error_of(
        run_body(gateway, quotas, json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()), 400
    )
    assert err["param"] == "model"


def test_body_404_unknown_model(gateway: Gateway, quotas: QuotaBook) -> None:
    err = error_of(run_body(gateway, quotas, chat_body("gpt-9")), 404)
    assert (err["code"], err["param"]) == ("model_not_found", "model")


def test_body_413_too_large(gateway: Gateway, quotas: QuotaBook) -> None:
    big = chat_body(pad="x" * BODY_LIMIT)
    out = run_body(gateway, quotas, big)
    err = error_of(out, 413)
    assert err["code"] == "request_too_large"
    assert isinstance(out, ImmediateReply)
    assert out.details == "inferlb_body_too_large"
    # a partial body (Envoy's buffer filled before the end) is refused the same way
    error_of(run_body(gateway, quotas, chat_body(), end_of_stream=False), 413)


def test_body_400_context_length(gateway: Gateway, quotas: QuotaBook) -> None:
    err = error_of(run_body(gateway, quotas, chat_body(max_tokens=995)), 400)
    assert err["code"] == "context_length_exceeded"


def test_body_429_with_retry_after(gateway: Gateway, quotas: QuotaBook) -> None:
    # 300 tokens/min; each request reserves 9 prompt + 100 default output = 109 tokens
    assert isinstance(run_body(gateway, quotas, chat_body(), key="sk-small-001"), ContinueRequest)
    assert isinstance(run_body(gateway, quotas, chat_body(), key="sk-small-001"), ContinueRequest)
    out = run_body(gateway, quotas, chat_body(), key="sk-small-001")
    err = error_of(out, 429)
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert isinstance(out, ImmediateReply)
    retry = dict(out.headers)["retry-after"]
    # 218 tokens counted in second 0, 109 more need it to leave the window: at t = 61
    assert retry == "61"
    assert out.details == "inferlb_quota_tokens_per_minute"
    # not a moment before the advertised wait; after it, admitted
    assert isinstance(run_body(gateway, quotas, chat_body(), key="sk-small-001", now=60.9), ImmediateReply)
    assert isinstance(run_body(gateway, quotas, chat_body(), key="sk-small-001", now=61.0), ContinueRequest)


def test_body_429_retry_after_at_least_one_second(gateway: Gateway, quotas: QuotaBook) -> None:
    small = json.dumps(
        {"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    ).encode()
    for _ in range(3):
        assert isinstance(run_body(gateway, quotas, small, key="sk-small-001"), ContinueRequest)
    out = run_body(gateway, quotas, small, key="sk-small-001", now=60.5)  # 3 rpm: next request at t=61
    assert isinstance(out, ImmediateReply)
    assert out.status == 429
    assert dict(out.headers)["retry-after"] == "1"
    assert out.details == "inferlb_quota_requests_per_minute"


def test_body_429_request_that_never_fits(gateway: Gateway, quotas: QuotaBook) -> None:
    out = run_body(gateway, quotas, chat_body(max_tokens=400), key="sk-small-001")
    err = error_of(out, 429)
    assert "never" in err["message"]
    assert isinstance(out, ImmediateReply)
    assert "retry-after" not in dict(out.headers)


def test_refusals_take_no_quota(gateway: Gateway, quotas: QuotaBook) -> None:
    error_of(run_body(gateway, quotas, chat_body("gpt-9"), key="sk-small-001"), 404)
    error_of(run_body(gateway, quotas, b"{", key="sk-small-001"), 400)
    assert quotas.available("small", 0.0) == (3, 300)


def test_completions_and_embeddings_reserve_what_they_can_produce(
    gateway: Gateway, quotas: QuotaBook
) -> None:
    pending = PendingRequest(
        tenant=gateway.routing.authenticate("Bearer sk-gold-0001"),
        kind=EndpointKind.COMPLETIONS,
        path="/v1/completions",
    )
    body = json.dumps({"model": "qwen", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 7, "n": 2}).encode()
    prepared = handlers.prepare_body(gateway, pending, body)
    assert isinstance(prepared, handlers.PreparedRequest)
    assert prepared.prompt_tokens == 5
    assert prepared.reserved_tokens == 5 + 7 * 2 * 2
    emb = PendingRequest(tenant=pending.tenant, kind=EndpointKind.EMBEDDINGS, path="/v1/embeddings")
    prepared = handlers.prepare_body(
        gateway, emb, json.dumps({"model": "qwen", "input": "hello world"}).encode()
    )
    assert isinstance(prepared, handlers.PreparedRequest)
    assert prepared.reserved_tokens == prepared.prompt_tokens == count_prompt_tokens(prepared.request) == 2


def test_refusal_helper_rounds_retry_after_up() -> None:
    out = handlers.refusal(RequestError(429, "m", type="rate_limit_error", retry_after_s=2.01), "d")
    assert dict(out.headers)["retry-after"] == "3"
    out = handlers.refusal(RequestError(429, "m", type="rate_limit_error", retry_after_s=0.0001), "d")
    assert dict(out.headers)["retry-after"] == "1"


# -- limits: context floor before tokenizing, per-prompt context, counting budget, echo -----------
class _MustNotCount:
    """A counter that fails the test if asked to tokenize (the floor must decide alone)."""

    max_token_bytes = 128

    def count(self, text: str) -> int:
        raise AssertionError(f"tokenized {len(text)} characters")


def test_body_over_context_by_its_floor_is_refused_without_tokenizing() -> None:
    config = make_config()
    gateway = Gateway.from_config(
        config.model_copy(
            update={"gateway": config.gateway.model_copy(update={"max_request_body_bytes": 1 << 20})}
        ),
        counter=_MustNotCount(),
    )
    pending = PendingRequest(
        tenant=config.tenants[0], kind=EndpointKind.CHAT_COMPLETIONS, path="/v1/chat/completions"
    )
    word = "a" * (128 * 1001)  # at least 1001 tokens: over llama's 1000
    out = handlers.prepare_body(gateway, pending, chat_body(messages=[{"role": "user", "content": word}]))
    err = error_of(out, 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert "at least" in err["message"]


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        (
            "/v1/completions",
            {"model": "llama", "prompt": ["hi", "word " * 990], "max_tokens": 20},
            "prompt[1]",
        ),
        (
            "/v1/completions",
            {"model": "llama", "prompt": [[1] * 10, [2] * 999], "max_tokens": 2},
            "prompt[1]",
        ),
        ("/v1/embeddings", {"model": "llama", "input": ["hi", "word " * 1001, "x"]}, "input[1]"),
        ("/v1/embeddings", {"model": "llama", "input": [[7] * 1001]}, "input"),
    ],
)
def test_each_prompt_is_checked_against_the_context_length(
    path: str, payload: dict[str, Any], param: str
) -> None:
    config = make_config()
    gateway = Gateway.from_config(
        config.model_copy(
            update={"gateway": config.gateway.model_copy(update={"max_request_body_bytes": 1 << 20})}
        )
    )
    quotas = QuotaBook(limits_from_config(config), 0.0)
    err = error_of(run_body(gateway, quotas, json.dumps(payload).encode(), path=path), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", param)


def test_counting_past_its_deadline_is_a_413_not_a_timeout(gateway: Gateway) -> None:
    pending = PendingRequest(
        tenant=gateway.config.tenants[0], kind=EndpointKind.CHAT_COMPLETIONS, path="/v1/chat/completions"
    )
    out = handlers.prepare_body(gateway, pending, chat_body(), deadline=-1.0)
    err = error_of(out, 413)
    assert isinstance(out, ImmediateReply)
    assert out.details == handlers.COUNTING_BUDGET_DETAILS
    assert "time budget" in err["message"]
    # the budget is a share of Envoy's message_timeout (5 s by default)
    assert gateway.counting_budget_s == pytest.approx(5.0 * handlers.COUNTING_BUDGET_FRACTION)


def test_error_messages_echo_at_most_256_characters_of_a_value(gateway: Gateway, quotas: QuotaBook) -> None:
    name = "m" * 3_000_000
    config = make_config()
    big = Gateway.from_config(
        config.model_copy(
            update={"gateway": config.gateway.model_copy(update={"max_request_body_bytes": 4 << 20})}
        )
    )
    out = run_body(big, quotas, chat_body(name))
    assert isinstance(out, ImmediateReply) and len(out.body) < 1024
    assert error_of(out, 404)["message"].count("m") < 300
    for path in ("/" + "p" * 100_000, "/v1/models/" + "q" * 100_000):
        reply = handlers.on_request_headers(gateway, req_headers(path, method="GET"), end_of_stream=True)
        assert isinstance(reply, ImmediateReply) and reply.status == 404 and len(reply.body) < 1024
    reply = handlers.on_request_headers(gateway, req_headers(method="X" * 10_000), end_of_stream=False)
    assert isinstance(reply, ImmediateReply) and reply.status == 405 and len(reply.body) < 1024
    assert ("allow", "POST") in reply.headers  # RFC 9110: a 405 names the methods the path takes
    # the backstop: any message is cut at MAX_ERROR_MESSAGE_CHARS
    long_err = RequestError(400, "y" * 100_000, type="invalid_request_error", param="z" * 10_000)
    doc = json.loads(handlers.refusal(long_err, "inferlb_x").body)["error"]
    assert len(doc["message"]) <= handlers.MAX_ERROR_MESSAGE_CHARS + 3 and len(doc["param"]) <= 303


# -- responses and non-inference paths ------------------------------------------------------------
def test_responses_are_counted_as_a_conversation_and_routed(gateway: Gateway, quotas: QuotaBook) -> None:
    body = json.dumps({"model": "llama", "input": "hello there", "max_output_tokens": 10}).encode()
    out = run_body(gateway, quotas, body, path="/v1/responses")
    assert isinstance(out, ContinueRequest)
    headers = dict(out.set_headers)
    # the same prompt as a chat request with one user message
    assert headers[h.PROMPT_TOKENS] == str(count_prompt_tokens(_chat_request()))
    assert (
        out.reservation is not None and out.reservation.reserved_tokens == int(headers[h.PROMPT_TOKENS]) + 10
    )
    over = json.dumps({"model": "llama", "input": "hi", "max_output_tokens": 995}).encode()
    err = error_of(run_body(gateway, quotas, over, path="/v1/responses"), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "input")


def _chat_request() -> InferenceRequest:
    return parse_request(EndpointKind.CHAT_COMPLETIONS, chat_body())


def test_non_inference_paths_denied_by_default_allowed_by_policy() -> None:
    config = make_config()
    deny = Gateway.from_config(config)
    allow = Gateway.from_config(
        config.model_copy(
            update={"ext_proc": config.ext_proc.model_copy(update={"non_inference_paths": "allow"})}
        )
    )
    hdrs = req_headers("/v1/files", method="GET", **{"x-inferlb-tenant": "gold"})
    assert error_of(handlers.on_request_headers(deny, hdrs, end_of_stream=True), 404)["code"] == "unknown_url"
    out = handlers.on_request_headers(allow, hdrs, end_of_stream=True)
    assert out == handlers.PassThrough(remove_headers=("x-inferlb-tenant",))
    # the API key is still checked, and /v1/models is still answered by the gateway
    error_of(
        handlers.on_request_headers(allow, req_headers("/v1/files", key="sk-nope-0000"), end_of_stream=True),
        401,
    )
    models = handlers.on_request_headers(allow, req_headers("/v1/models", method="GET"), end_of_stream=True)
    assert isinstance(models, ImmediateReply) and models.status == 200


def test_each_model_counts_with_its_own_tokenizer_and_image_estimate(quotas: QuotaBook) -> None:
    raw = make_config().model_dump(mode="json")
    raw["models"][1] = {**raw["models"][1], "tokenizer": "estimate", "image_tokens": 7}
    gateway = Gateway.from_config(parse_config(raw))
    image = {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "héllo"}, image]}]
    llama = run_body(gateway, quotas, chat_body("llama", messages=messages))
    qwen = run_body(gateway, quotas, chat_body("qwen", messages=messages))
    assert isinstance(llama, ContinueRequest) and isinstance(qwen, ContinueRequest)
    # estimate: 3 priming + 3 per message + 4 bytes of "user" + 6 bytes of "héllo" + 7 for the image
    assert dict(qwen.set_headers)[h.PROMPT_TOKENS] == str(3 + 3 + 4 + 6 + 7)
    assert int(dict(llama.set_headers)[h.PROMPT_TOKENS]) > 765  # cl100k and OpenAI's image price


def test_a_tokenizer_that_cannot_load_is_a_clear_error(tmp_path: Any) -> None:
    raw = make_config().model_dump(mode="json")
    raw["models"][0] = {**raw["models"][0], "tokenizer": f"hf:{tmp_path / 'missing.json'}"}
    with pytest.raises(ValueError, match=r"models\[llama\]\.tokenizer"):
        Gateway.from_config(parse_config(raw))
