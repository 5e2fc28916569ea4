"""The exact-preserving speed-ups of the ext_proc path: the token count cache, cached metric children,
the response-header reader and the affinity skip for models that do not hash."""

from __future__ import annotations

import random

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from ext_proc import handlers
from ext_proc.metrics import ExtProcMetrics
from ext_proc.servicer import header_map, response_status_and_type
from inferlb.config.schema import parse_config
from inferlb.policy.quota import QuotaBook, limits_from_config
from inferlb.request.tokens import COUNT_CACHE_ENTRY_CHARS, CountCache, TiktokenCounter, offline_encoding

ENC = offline_encoding()


@given(st.lists(st.text(max_size=200), max_size=30))
def test_cached_counts_equal_the_encoders(texts: list[str]) -> None:
    counter = TiktokenCounter(cache_chars=2_000)
    for text in texts + texts:  # the second pass is served (partly) from the cache
        assert counter.count(text) == len(ENC.encode_ordinary(text))
    assert counter.cache.cached_chars <= 2_000


def test_the_cache_is_lru_and_bounded_in_characters() -> None:
    calls: list[str] = []

    def count(text: str) -> int:
        calls.append(text)
        return len(text)

    entry = 10 + COUNT_CACHE_ENTRY_CHARS
    cache = CountCache(count, max_chars=3 * entry)
    a, b, c, d = ("a" * 10, "b" * 10, "c" * 10, "d" * 10)
    for t in (a, b, c, a):  # a is now the most recent
        cache.count(t)
    assert calls == [a, b, c] and len(cache) == 3
    cache.count(d)  # evicts b, the least recently used
    assert len(cache) == 3 and cache.cached_chars == 3 * entry
    cache.count(a)
    cache.count(b)
    assert calls == [a, b, c, d, b]
    # a text over the budget is counted but never cached
    big = "x" * (4 * entry)
    assert cache.count(big) == len(big) and big not in calls[:-1] and cache.cached_chars <= 3 * entry


def test_a_zero_budget_disables_the_cache() -> None:
    calls: list[str] = []
    cache = CountCache(lambda t: calls.append(t) or len(t), max_chars=0)
    cache.count("hello")
    cache.count("hello")
    assert calls == ["hello", "hello"] and len(cache) == 0


def test_metric_helpers_count_like_labels() -> None:
    fast, slow = ExtProcMetrics(), ExtProcMetrics()
    for status in ("200", "200", "429"):
        fast.request_ended("t", "m", status)
        slow.requests.labels("t", "m", status).inc()
    fast.tokens_charged("t", "m", 5, 7)
    slow.prompt_tokens.labels("t", "m").inc(5)
    slow.completion_tokens.labels("t", "m").inc(7)
    fast.processed("request_body", 0.0003)
    slow.processing_seconds.labels("request_body").observe(0.0003)

    def samples(m: ExtProcMetrics) -> list[str]:
        return [ln for ln in generate_latest(m.registry).decode().splitlines() if not ln.endswith("created")]

    assert [s.split(" ")[0] for s in samples(fast)] == [s.split(" ")[0] for s in samples(slow)]
    assert [s for s in samples(fast) if "_created" not in s] == [
        s for s in samples(slow) if "_created" not in s
    ]


HEADER = st.tuples(
    st.sampled_from(
        [":status", "content-type", "Content-Type", ":STATUS", "content-length", "Content-Length", "server"]
    ),
    st.text(max_size=20),
    st.booleans(),
)


@given(st.lists(HEADER, max_size=8))
def test_response_status_and_type_read_like_header_map(headers: list[tuple[str, str, bool]]) -> None:
    msg = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=k, raw_value=v.encode())
                if raw
                else base_pb2.HeaderValue(key=k, value=v)
                for k, v, raw in headers
            ]
        )
    )
    full = header_map(msg)
    assert response_status_and_type(msg) == (
        full.get(":status", ""),
        full.get("content-type", ""),
        full.get("content-length", ""),
    )


def _route_headers(lb_policy: str) -> dict[str, str]:
    config = parse_config(
        {
            "models": [{"name": "m", "cluster": {"lb_policy": lb_policy}}],
            "tenants": [{"name": "t", "api_keys": ["sk-test-0001"]}],
        }
    )
    gateway = handlers.Gateway.from_config(config)
    decision = handlers.on_request_headers(
        gateway,
        {":method": "POST", ":path": "/v1/chat/completions", "authorization": "Bearer sk-test-0001"},
        end_of_stream=False,
    )
    assert isinstance(decision, handlers.BodyExpected)
    body = (
        b'{"model":"m","user":"u1",'
        b'"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"}]}'
    )
    out = handlers.on_request_body(
        gateway,
        QuotaBook(limits_from_config(config), 0.0),
        decision.pending,
        body,
        now=0.0,
        rng=random.Random(1),
    )
    assert isinstance(out, handlers.ContinueRequest)
    return dict(out.set_headers)


def test_affinity_keys_only_for_models_that_hash() -> None:
    for policy in ("ring_hash", "maglev"):
        hashed = _route_headers(policy)
        assert len(hashed["x-inferlb-prefix"]) == 32 and len(hashed["x-inferlb-session"]) == 32
    for policy in ("least_request", "round_robin"):
        plain = _route_headers(policy)
        assert "x-inferlb-prefix" not in plain and "x-inferlb-session" not in plain
        assert plain["x-inferlb-model"] == "m"
