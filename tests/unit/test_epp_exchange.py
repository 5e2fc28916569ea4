"""The EPP's stream state machine, decisions and pool state, over real protos and the real picker (no gRPC):
the FULL_DUPLEX_STREAMED answer order, the body streamed back whole, the subset hint, 400/413/429/503, the
served report and the in-flight count."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from epp.exchange import (
    DESTINATION_ENDPOINT,
    STREAMED_CHUNK_BYTES,
    Exchange,
    served_endpoint,
    subset_hint,
)
from epp.metrics import EppMetrics
from epp.picking import EndpointPicker, RequestSeen, Routed
from epp.pool import Pool, PoolEndpoint, PoolError, Saturation, parse_address, saturated
from inferlb.policy.picker import EndpointState, PickerWeights
from inferlb.policy.telemetry import ServerMetrics

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
_Mode = processing_mode_pb2.ProcessingMode


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_picker(
    addresses: tuple[str, ...] = (A, B, C), *, waiting: float = 0.0, kv: float = 0.0, max_hosts: int = 1
) -> tuple[EndpointPicker, Pool, Clock]:
    clock = Clock()
    pool = Pool([PoolEndpoint(address=a) for a in addresses], stale_after_s=1.5, clock=clock)
    for a in addresses:
        pool.observed(a, ServerMetrics(family="vllm", waiting_requests=waiting, kv_cache_usage=kv))
    metrics = EppMetrics(pool.addresses, pool.in_flight)
    weights = PickerWeights(max_hosts=max_hosts)
    return EndpointPicker(pool, metrics, weights=weights, salt=b"test"), pool, clock


def make_exchange(picker: EndpointPicker, *, max_body_bytes: int = 1 << 20) -> Exchange:
    return Exchange(
        picker.decide,
        on_served=picker.served,
        on_refused=picker.count_refusal,
        max_body_bytes=max_body_bytes,
    )


def headers_msg(
    *, path: str = "/v1/chat/completions", method: str = "POST", end_of_stream: bool = False
) -> ep.ProcessingRequest:
    hs = [
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in ((":path", path), (":method", method))
    ]
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs), end_of_stream=end_of_stream)
    )


def body_msg(chunk: bytes, *, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk, end_of_stream=end_of_stream))


def with_subset(msg: ep.ProcessingRequest, value: object) -> ep.ProcessingRequest:
    space = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    field = space.fields["x-gateway-destination-endpoint-subset"]
    if isinstance(value, str):
        field.string_value = value
    else:
        assert isinstance(value, list)
        field.list_value.SetInParent()
        for v in value:
            field.list_value.values.add().string_value = v
    return msg


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()


def destination(out: ep.ProcessingResponse) -> tuple[str, str]:
    """The header value and the envoy.lb metadata value a headers answer sets."""
    (option,) = out.request_headers.response.header_mutation.set_headers
    assert option.header.key == DESTINATION_ENDPOINT
    meta = out.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_ENDPOINT].string_value
    return option.header.raw_value.decode(), meta


def streamed(outs: list[ep.ProcessingResponse], phase: str = "request_body") -> tuple[bytes, list[bool]]:
    body, ends = b"", []
    for out in outs:
        assert out.WhichOneof("response") == phase
        chunk = getattr(out, phase).response.body_mutation.streamed_response
        assert len(chunk.body) <= STREAMED_CHUNK_BYTES
        body += chunk.body
        ends.append(chunk.end_of_stream)
    return body, ends


def test_full_duplex_answers_nothing_until_the_body_ends_then_headers_then_the_body() -> None:
    picker, pool, _ = make_picker()
    ex = make_exchange(picker)
    assert ex.on_message(headers_msg()) == []
    assert ex.on_message(body_msg(CHAT[:10], end_of_stream=False)) == []
    outs = ex.on_message(body_msg(CHAT[10:], end_of_stream=True))
    assert outs[0].WhichOneof("response") == "request_headers"
    assert outs[0].request_headers.response.clear_route_cache
    header, meta = destination(outs[0])
    assert header == meta and header in (A, B, C)
    assert streamed(outs[1:]) == (CHAT, [True])
    assert not ex.done and ex.routed == Routed(endpoints=(header,))
    assert pool.in_flight()[header] == 1


def test_trailers_end_the_body_and_get_their_answer_after_it() -> None:
    picker, _, _ = make_picker()
    ex = make_exchange(picker)
    ex.on_message(headers_msg())
    assert ex.on_message(body_msg(CHAT, end_of_stream=False)) == []
    outs = ex.on_message(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    assert [o.WhichOneof("response") for o in outs] == ["request_headers", "request_body", "request_trailers"]
    # the body does not end the stream: the trailers follow it upstream
    assert streamed(outs[1:2]) == (CHAT, [False])


def test_a_request_without_a_body_is_picked_at_its_headers() -> None:
    picker, _, _ = make_picker()
    (out,) = make_exchange(picker).on_message(
        headers_msg(path="/v1/models", method="GET", end_of_stream=True)
    )
    assert destination(out)[0] in (A, B, C)


@given(
    body=st.binary(min_size=0, max_size=3 * STREAMED_CHUNK_BYTES + 7),
    cuts=st.lists(st.integers(min_value=0, max_value=3 * STREAMED_CHUNK_BYTES + 7), max_size=6),
)
@example(body=b"", cuts=[])
@example(body=b"x" * (2 * STREAMED_CHUNK_BYTES), cuts=[1])
@settings(deadline=None)  # bodies up to ~190 KB: no time bound in a unit test on a shared machine
def test_any_chunking_of_a_body_goes_upstream_whole_in_bounded_chunks(body: bytes, cuts: list[int]) -> None:
    """Pass-through paths (not parsed) so any bytes qualify: the body streamed back is the body received,
    in chunks of at most STREAMED_CHUNK_BYTES, exactly the last one ending the stream."""
    picker, _, _ = make_picker()
    ex = make_exchange(picker, max_body_bytes=len(body) + 1)
    ex.on_message(headers_msg(path="/other"))
    points = sorted({min(c, len(body)) for c in cuts})
    pieces = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    outs: list[ep.ProcessingResponse] = []
    for i, piece in enumerate(pieces):
        outs += ex.on_message(body_msg(piece, end_of_stream=i == len(pieces) - 1))
    assert outs[0].WhichOneof("response") == "request_headers"
    got, ends = streamed(outs[1:])
    assert got == body
    assert ends == [False] * (len(ends) - 1) + [True]


def test_a_bad_body_is_a_400_naming_the_field() -> None:
    picker, pool, _ = make_picker()
    ex = make_exchange(picker)
    ex.on_message(headers_msg())
    (out,) = ex.on_message(body_msg(b'{"model": "m", "messages": "hi"}', end_of_stream=True))
    assert out.immediate_response.status.code == 400
    assert json.loads(out.immediate_response.body)["error"]["param"] == "messages"
    assert ex.done and ex.routed is None
    assert sum(pool.in_flight().values()) == 0


def test_a_body_over_the_limit_is_a_413() -> None:
    picker, _, _ = make_picker()
    ex = make_exchange(picker, max_body_bytes=8)
    ex.on_message(headers_msg())
    assert ex.on_message(body_msg(b"12345678", end_of_stream=False)) == []
    (out,) = ex.on_message(body_msg(b"9", end_of_stream=True))
    assert out.immediate_response.status.code == 413
    assert b'inferlb_epp_requests_total{outcome="413"} 1.0' in generate_latest(picker.metrics.registry)


@pytest.mark.parametrize("hint", [[B, C], f"{B}, {C}", [f"{B},{C}"]])
def test_the_subset_hint_limits_the_pick(hint: object) -> None:
    """Every host of the list (three allowed) is in the subset, first choice and fallbacks alike."""
    picker, _, _ = make_picker(max_hosts=3)
    for _ in range(5):
        ex = make_exchange(picker)
        ex.on_message(with_subset(headers_msg(), hint))
        outs = ex.on_message(body_msg(CHAT, end_of_stream=True))
        assert sorted(destination(outs[0])[0].split(",")) == [B, C]


def test_a_list_pick_orders_the_pool_within_max_hosts() -> None:
    picker, pool, _ = make_picker(max_hosts=2)
    pool.enter(A)
    pool.enter(A)
    routed = picker.decide(RequestSeen(method="GET", path="/v1/models"))
    assert isinstance(routed, Routed) and len(routed.endpoints) == 2 and A not in routed.endpoints
    assert pool.in_flight()[routed.endpoints[0]] == 1


@pytest.mark.parametrize("hint", [[], "", ["192.0.2.1:9"]])
def test_an_empty_or_foreign_subset_is_a_503(hint: object) -> None:
    picker, _, _ = make_picker()
    ex = make_exchange(picker)
    ex.on_message(with_subset(headers_msg(), hint))
    (out,) = ex.on_message(body_msg(CHAT, end_of_stream=True))
    assert out.immediate_response.status.code == 503
    err = json.loads(out.immediate_response.body)["error"]
    assert err["code"] == "no_endpoint_available" and "subset" in err["message"]


def test_no_healthy_endpoint_is_a_503_and_stale_metrics_make_one_unhealthy() -> None:
    picker, pool, clock = make_picker((A, B))
    clock.now += 1.0
    pool.observed(B, ServerMetrics(family="vllm", waiting_requests=0))
    clock.now += 1.0  # A last scraped 2 s ago, over its 1.5 s staleness bound; B 1 s ago
    assert [s.healthy for s in pool.snapshot()] == [False, True]
    assert picker.decide(RequestSeen(method="GET", path="/v1/models")) == Routed(endpoints=(B,))
    clock.now += 1.0
    reply = picker.decide(RequestSeen(method="GET", path="/v1/models"))
    assert not isinstance(reply, Routed) and reply.status == 503


def test_every_eligible_endpoint_saturated_is_a_429_one_free_is_picked() -> None:
    picker, pool, _ = make_picker((A, B), waiting=5)
    reply = picker.decide(RequestSeen(method="GET", path="/v1/models"))
    assert not isinstance(reply, Routed)
    assert reply.status == 429 and ("retry-after", "1") in reply.headers
    assert json.loads(reply.body)["error"]["type"] == "rate_limit_error"
    pool.observed(B, ServerMetrics(family="vllm", waiting_requests=0, kv_cache_usage=0.79))
    assert picker.decide(RequestSeen(method="GET", path="/v1/models")) == Routed(endpoints=(B,))
    # saturation is judged within the subset: a free endpoint outside it does not save the request
    reply = picker.decide(RequestSeen(method="GET", path="/v1/models", subset=(A,)))
    assert not isinstance(reply, Routed) and reply.status == 429


@pytest.mark.parametrize(
    ("waiting", "kv", "expected"), [(4.9, 0.79, False), (5, 0.0, True), (0, 0.8, True), (0, 1.0, True)]
)
def test_saturation_thresholds(waiting: float, kv: float, expected: bool) -> None:
    state = EndpointState(address=A, waiting=waiting, kv_usage=kv)
    assert saturated(state, Saturation()) is expected


def test_the_served_report_is_counted_and_moves_the_in_flight_count() -> None:
    picker, pool, _ = make_picker((A, B))
    routed = Routed(endpoints=(A, B))
    pool.enter(A)
    assert picker.served(routed, B) == B
    assert pool.in_flight() == {A: 0, B: 1}
    text = generate_latest(picker.metrics.registry).decode()
    assert f'inferlb_epp_served_total{{endpoint="{B}",match="fallback"}} 1.0' in text
    assert picker.served(Routed(endpoints=(A,)), "192.0.2.1:9") == A
    assert picker.served(Routed(endpoints=(A,)), None) == A
    text = generate_latest(picker.metrics.registry).decode()
    assert f'inferlb_epp_served_total{{endpoint="{A}",match="other"}} 1.0' in text
    assert f'inferlb_epp_served_total{{endpoint="{A}",match="unreported"}} 1.0' in text


def test_the_response_path_reads_the_served_endpoint_and_streams_the_body_back() -> None:
    reports: list[tuple[Routed, str | None]] = []
    picker, _, _ = make_picker()
    ex = Exchange(
        picker.decide,
        on_served=lambda r, s: reports.append((r, s)),
        on_refused=lambda r: None,
        max_body_bytes=1 << 20,
    )
    ex.on_message(headers_msg())
    outs = ex.on_message(body_msg(CHAT, end_of_stream=True))
    picked = destination(outs[0])[0]
    msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
    msg.metadata_context.filter_metadata["envoy.lb"].fields[
        "x-gateway-destination-endpoint-served"
    ].string_value = picked
    (out,) = ex.on_message(msg)
    assert out.WhichOneof("response") == "response_headers"
    assert reports == [(Routed(endpoints=(picked,)), picked)]
    assert streamed(
        ex.on_message(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: 1\n\n"))), "response_body"
    ) == (b"data: 1\n\n", [False])
    assert not ex.done
    last = ex.on_message(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"", end_of_stream=True)))
    assert streamed(last, "response_body") == (b"", [True])
    assert ex.done and len(reports) == 1


def test_buffered_mode_answers_headers_at_once_and_routes_on_the_body_answer() -> None:
    picker, _, _ = make_picker()
    ex = make_exchange(picker)
    first = headers_msg()
    first.protocol_config.request_body_mode = _Mode.BUFFERED
    (out,) = ex.on_message(first)
    assert out.WhichOneof("response") == "request_headers"
    (out,) = ex.on_message(body_msg(CHAT, end_of_stream=True))
    assert out.WhichOneof("response") == "request_body"
    (option,) = out.request_body.response.header_mutation.set_headers
    assert option.header.raw_value.decode() in (A, B, C)
    assert not out.request_body.response.HasField("body_mutation")


def test_metadata_readers_ignore_what_is_not_a_hint() -> None:
    msg = headers_msg()
    assert subset_hint(msg) is None and served_endpoint(msg) is None
    msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields["other"].string_value = A
    assert subset_hint(msg) is None
    hinted = with_subset(headers_msg(), [A, ""])
    hinted.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
        "x-gateway-destination-endpoint-subset"
    ].list_value.values.add().number_value = 3
    assert subset_hint(hinted) == (A,)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10.0.0.1:80", "10.0.0.1:80"), (" [::1]:9 ", "[::1]:9"), ("::1:9", "[::1]:9")],
)
def test_addresses_are_ip_port(text: str, expected: str) -> None:
    assert parse_address(text, field="--endpoint") == expected


@pytest.mark.parametrize("text", ["host:80", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:70000", ":80"])
def test_an_address_that_is_not_ip_port_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(PoolError) as err:
        parse_address(text, field="endpoints[2].address")
    assert err.value.field == "endpoints[2].address"


def test_a_pool_is_refused_empty_or_with_a_repeated_address() -> None:
    with pytest.raises(PoolError):
        Pool([])
    with pytest.raises(PoolError):
        Pool([PoolEndpoint(address=A), PoolEndpoint(address=A)])
    pool = Pool([PoolEndpoint(address=A)])
    assert not pool.synced
    pool.scrape_failed(A)
    assert pool.synced and not pool.snapshot()[0].healthy


@pytest.mark.parametrize("mode", [_Mode.NONE, _Mode.STREAMED])
def test_modes_without_the_body_first_pick_at_the_headers_and_pass_the_chunks(mode: int) -> None:
    """NONE and STREAMED: Envoy needs the headers answer before any body, so the pick is by load alone,
    nothing is parsed (no 400 for the body it has not seen), and a body chunk gets a plain continue."""
    picker, _, _ = make_picker()
    ex = make_exchange(picker)
    first = headers_msg()
    first.protocol_config.request_body_mode = mode
    (out,) = ex.on_message(first)
    assert destination(out)[0] in (A, B, C)
    (chunk,) = ex.on_message(body_msg(b"not json", end_of_stream=True))
    assert chunk.WhichOneof("response") == "request_body"
    assert not chunk.request_body.response.HasField("body_mutation")


def test_a_post_without_a_body_on_an_inference_path_is_a_400() -> None:
    picker, _, _ = make_picker()
    (out,) = make_exchange(picker).on_message(headers_msg(end_of_stream=True))
    assert out.immediate_response.status.code == 400
