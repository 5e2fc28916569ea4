"""The EPP's fair queue wired into its decisions (real protos, the real picker, a fake clock; the event loop
only holds the futures and timers, no test waits on time): a saturated pool makes requests wait, ends and
scrapes admit them with bands strict and fairness ids fair by tokens, a full queue and an expired wait are
429s with ``retry-after``, a cancelled waiter leaves, and the priority and cost each request brings."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import generate_latest

from epp.exchange import Exchange
from epp.flow import (
    DEFAULT_FAIRNESS_ID,
    QueueSettings,
    Waiting,
    fairness_id,
    parse_objective,
    request_cost,
    request_priority,
)
from epp.metrics import EppMetrics
from epp.picking import EndpointPicker, Refused, RequestSeen, Routed
from epp.pool import Pool, PoolEndpoint, Saturation
from inferlb.errors import RequestError
from inferlb.policy.telemetry import ServerMetrics
from inferlb.request.parsing import EndpointKind, parse_request
from inferlb.request.tokens import count_prompt_tokens
from tests.unit.test_epp_exchange import Clock

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def make_picker(
    addresses: tuple[str, ...] = (A,),
    *,
    depth: float = 1,
    max_queued: int = 50,
    max_wait_s: float = 60,
    stale_after_s: float = 1.5,
) -> tuple[EndpointPicker, Pool, Clock]:
    clock = Clock()
    pool = Pool([PoolEndpoint(address=a) for a in addresses], stale_after_s=stale_after_s, clock=clock)
    for a in addresses:
        pool.observed(a, ServerMetrics(family="vllm", waiting_requests=0.0, kv_cache_usage=0.1))
    metrics = EppMetrics(pool.addresses, pool.in_flight)
    queue = QueueSettings(
        max_queued=max_queued, max_wait_s=max_wait_s, objectives={"premium": 100, "batch": -5}
    )
    picker = EndpointPicker(
        pool, metrics, saturation=Saturation(queue_depth=depth), salt=b"test", queue=queue
    )
    return picker, pool, clock


def chat(max_tokens: int, content: str = "hi") -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    ).encode()


def submit(
    picker: EndpointPicker, body: bytes, **headers: str
) -> tuple[Exchange, list[ep.ProcessingResponse]]:
    """One request through an exchange: its headers (plus ``headers``, ``_`` for ``-``) and a whole body."""
    pairs = [(":path", "/v1/chat/completions"), (":method", "POST")]
    pairs += [(k.replace("_", "-"), v) for k, v in headers.items()]
    hs = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    ex = Exchange(
        picker.decide, on_served=picker.served, on_refused=picker.count_refusal, max_body_bytes=1 << 20
    )
    assert (
        ex.on_message(
            ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))
        )
        == []
    )
    out = ex.on_message(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    return ex, out


def finish(picker: EndpointPicker, ex: Exchange) -> None:
    """The request's response ended: the EPP releases its pick (as the servicer does)."""
    assert ex.routed is not None
    picker.finished(picker.served(ex.routed, None))


def outcome(ex: Exchange) -> Routed | Refused | None:
    """The decision on ``ex``'s waiting request, or None while it waits."""
    assert ex.waiting is not None
    fut = ex.waiting.outcome
    return fut.result() if fut.done() else None


def sample(picker: EndpointPicker, name: str) -> float:
    for line in generate_latest(picker.metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"no sample {name}")


async def test_a_saturated_pool_queues_and_an_end_admits_the_next_in_order() -> None:
    picker, pool, _ = make_picker()
    first, out = submit(picker, chat(10))
    assert first.routed is not None and out[0].WhichOneof("response") == "request_headers"
    # one in flight since the scrape makes A's backlog 1 = --queue-depth: the rest wait, in band order
    waiting = {
        "low": submit(picker, chat(10), x_inferlb_priority="low")[0],
        "batch": submit(picker, chat(10), x_gateway_inference_objective="batch")[0],
        "default": submit(picker, chat(10))[0],
        "premium": submit(picker, chat(10), x_gateway_inference_objective="premium")[0],
        "numeric": submit(picker, chat(10), x_inferlb_priority="7")[0],
    }
    assert all(ex.waiting is not None and outcome(ex) is None for ex in waiting.values())
    assert picker.flow is not None and len(picker.flow) == 5
    assert picker.flow.waiting() == {-1: 1, -5: 1, 0: 1, 100: 1, 7: 1}
    text = generate_latest(picker.metrics.registry).decode()
    assert 'inferlb_epp_queue_length{priority="100"} 1.0' in text
    order = []
    current = first
    for _ in waiting:
        finish(picker, current)
        admitted = [
            name for name, ex in waiting.items() if ex.waiting is not None and outcome(ex) is not None
        ]
        assert len(admitted) == 1, admitted  # one end, one admission: the backlog is back at the depth
        name = admitted[0]
        ex = waiting[name]
        decision = outcome(ex)
        assert isinstance(decision, Routed) and decision.endpoints == (A,)
        answers = ex.resume(decision)
        assert (
            answers[0].request_headers.response.header_mutation.set_headers[0].header.raw_value == A.encode()
        )
        order.append(name)
        current = ex
    assert order == ["premium", "numeric", "default", "low", "batch"]
    finish(picker, current)
    assert pool.in_flight() == {A: 0} and len(picker.flow) == 0
    assert sample(picker, 'inferlb_epp_queue_wait_seconds_count{outcome="admitted"}') == 5


async def test_fairness_ids_of_one_band_share_admitted_tokens_whatever_their_request_sizes() -> None:
    picker, _, _ = make_picker()
    current, _ = submit(picker, chat(1))
    sizes = {"heavy": 2000, "light": 125}
    pending: dict[str, list[Exchange]] = {t: [] for t in sizes}
    for tenant, size in sizes.items():
        for _ in range(4):
            pending[tenant].append(submit(picker, chat(size), x_gateway_inference_fairness_id=tenant)[0])
    admitted = dict.fromkeys(sizes, 0)
    for _ in range(200):
        finish(picker, current)
        (tenant, ex) = next((t, e) for t, exs in pending.items() for e in exs if outcome(e) is not None)
        pending[tenant].remove(ex)
        assert ex.waiting is not None
        admitted[tenant] += ex.waiting.cost_tokens
        ex.resume(outcome(ex))  # type: ignore[arg-type]
        current = ex
        # the tenant keeps four waiting: both stay backlogged
        pending[tenant].append(submit(picker, chat(sizes[tenant]), x_gateway_inference_fairness_id=tenant)[0])
    assert abs(admitted["heavy"] - admitted["light"]) <= 0.1 * min(admitted.values()), admitted


async def test_a_scrape_showing_room_admits_and_stale_endpoints_answer_the_waiter_503() -> None:
    picker, pool, clock = make_picker((A, B))
    pool.observed(A, ServerMetrics(family="vllm", waiting_requests=3.0, kv_cache_usage=0.1))
    pool.observed(B, ServerMetrics(family="vllm", waiting_requests=0.0, kv_cache_usage=0.95))
    ex, out = submit(picker, chat(5))
    assert out == [] and outcome(ex) is None
    pool.observed(A, ServerMetrics(family="vllm", waiting_requests=0.0, kv_cache_usage=0.1))
    picker.dispatch()  # the scraper's round hook
    decision = outcome(ex)
    assert isinstance(decision, Routed) and decision.endpoints == (A,)
    other, _ = submit(picker, chat(5))
    assert outcome(other) is None  # A's backlog is 1 again, B's KV cache is full
    clock.now += 2.0  # no good scrape for longer than stale_after: nothing is eligible any more
    picker.dispatch()
    late = outcome(other)
    assert isinstance(late, Refused) and late.status == 503
    assert other.resume(late)[0].immediate_response.status.code == 503


async def test_a_full_queue_is_a_429_at_once_and_an_expired_wait_a_429_with_retry_after() -> None:
    picker, _, clock = make_picker(max_queued=2, max_wait_s=5, stale_after_s=60)
    submit(picker, chat(1))
    first, _ = submit(picker, chat(1))
    clock.now += 3
    second, _ = submit(picker, chat(1))
    full, out = submit(picker, chat(1))
    assert full.waiting is None and full.done
    reply = out[0].immediate_response
    assert reply.status.code == 429 and json.loads(reply.body)["error"]["code"] == "queue_full"
    assert ("retry-after", b"1") in [(h.header.key, h.header.raw_value) for h in reply.headers.set_headers]
    assert sample(picker, "inferlb_epp_queue_full_total") == 1
    assert picker.flow is not None
    clock.now += 2.5  # the first waited 5.5 s, the second 2.5 s
    picker.flow.expire_due()
    expired = outcome(first)
    assert isinstance(expired, Refused) and expired.status == 429 and outcome(second) is None
    answer = first.resume(expired)[0].immediate_response
    assert json.loads(answer.body)["error"]["code"] == "queue_timeout"
    assert ("retry-after", "1") in expired.headers
    assert sample(picker, "inferlb_epp_queue_expired_total") == 1
    assert sample(picker, 'inferlb_epp_requests_total{outcome="429"}') == 2


async def test_a_cancelled_waiter_leaves_the_queue_and_is_never_admitted() -> None:
    picker, pool, _ = make_picker()
    current, _ = submit(picker, chat(1))
    gone, _ = submit(picker, chat(1))
    stays, _ = submit(picker, chat(1))
    assert gone.waiting is not None and picker.flow is not None
    assert picker.abandon(gone.waiting) is None
    assert len(picker.flow) == 1 and gone.waiting.outcome.cancelled()
    # a waiter whose stream task was cancelled (its future cancelled) before it could abandon is skipped
    third, _ = submit(picker, chat(1))
    assert stays.waiting is not None and third.waiting is not None
    stays.waiting.outcome.cancel()
    finish(picker, current)
    assert isinstance(outcome(third), Routed) and len(picker.flow) == 0
    assert pool.in_flight() == {A: 1}
    assert sample(picker, 'inferlb_epp_queue_wait_seconds_count{outcome="cancelled"}') == 2
    # abandoning after the admission gives the decision back, for the caller to release
    late = picker.abandon(third.waiting)
    assert isinstance(late, Routed)


async def test_without_waiters_a_request_with_room_is_routed_and_with_waiters_it_queues_behind() -> None:
    picker, _, _ = make_picker((A, B))
    a, _ = submit(picker, chat(1))
    b, _ = submit(picker, chat(1))
    assert a.routed is not None and b.routed is not None
    assert {a.routed.endpoints, b.routed.endpoints} == {(A,), (B,)}  # each has room for one
    c, _ = submit(picker, chat(1))
    assert c.waiting is not None
    finish(picker, a)
    assert isinstance(outcome(c), Routed)


def test_priority_from_objective_then_header_then_zero() -> None:
    objectives = {"premium": 100}
    seen = RequestSeen(method="POST", path="/v1/chat/completions")
    assert request_priority(seen, objectives) == 0
    assert (
        request_priority(RequestSeen(method="", path="", objective="premium", priority="-3"), objectives)
        == 100
    )
    assert (
        request_priority(RequestSeen(method="", path="", objective="unknown", priority="-3"), objectives)
        == -3
    )
    assert request_priority(RequestSeen(method="", path="", priority=" HIGH "), objectives) == 1
    for bad in ("urgent", "1.5", str(2**31)):
        with pytest.raises(RequestError, match="x-inferlb-priority") as err:
            request_priority(RequestSeen(method="", path="", priority=bad), objectives)
        assert err.value.status == 400
    assert fairness_id(seen) == DEFAULT_FAIRNESS_ID
    assert fairness_id(RequestSeen(method="", path="", fairness_id=" team-a ")) == "team-a"


async def test_a_bad_priority_header_is_a_400_naming_it() -> None:
    picker, _, _ = make_picker()
    _, out = submit(picker, chat(1), x_inferlb_priority="soon")
    reply = out[0].immediate_response
    assert reply.status.code == 400 and b"x-inferlb-priority" in reply.body


def test_cost_is_prompt_tokens_plus_the_completion_budget() -> None:
    body = chat(300, content="how many tokens is this prompt")
    request = parse_request(EndpointKind.CHAT_COMPLETIONS, body)
    prompt = count_prompt_tokens(request)
    assert request_cost(request, default_max_tokens=256) == prompt + 300
    bare = parse_request(
        EndpointKind.CHAT_COMPLETIONS, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    )
    assert request_cost(bare, default_max_tokens=256) == count_prompt_tokens(bare) + 256
    assert request_cost(None, default_max_tokens=64) == 64


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"max_queued": -1}, "--max-queued"),
        ({"max_wait_s": 0}, "--max-wait"),
        ({"default_max_tokens": 0}, "--default-max-tokens"),
    ],
)
def test_bad_queue_settings_are_refused_naming_the_flag(kw: dict[str, float], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        QueueSettings(**kw)  # type: ignore[arg-type]


def test_objectives_are_name_equals_priority() -> None:
    assert parse_objective(" premium = 100 ") == ("premium", 100)
    for bad in ("premium", "=3", "premium=high", f"x={2**31}"):
        with pytest.raises(ValueError, match="--objective"):
            parse_objective(bad)


def test_without_a_queue_nothing_waits() -> None:
    clock = Clock()
    pool = Pool([PoolEndpoint(address=A)], clock=clock)
    pool.observed(A, ServerMetrics(family="vllm", waiting_requests=0.0, kv_cache_usage=0.1))
    picker = EndpointPicker(
        pool,
        EppMetrics(pool.addresses, pool.in_flight),
        saturation=Saturation(queue_depth=1),
        queue=QueueSettings(),
    )
    assert picker.flow is None
    # the backlog is not read without a queue: in flight alone saturates nothing (today's behaviour)
    for _ in range(3):
        assert isinstance(
            picker.decide(RequestSeen(method="POST", path="/v1/chat/completions", body=chat(1))), Routed
        )
    pool.observed(A, ServerMetrics(family="vllm", waiting_requests=1.0, kv_cache_usage=0.1))
    reply = picker.decide(RequestSeen(method="POST", path="/v1/chat/completions", body=chat(1)))
    assert isinstance(reply, Refused) and reply.status == 429
    assert not isinstance(reply, Waiting)
