"""Response accounting through a real Envoy, the official ``openai`` SDK as the client, in both
request-path modes.

With ``ext_proc.account_responses`` on (the default): in ``ext_proc`` mode Envoy sends ext_proc the response
headers and streams it the response body; in ``ext_authz`` mode Envoy's Lua filter reads the usage as the
body streams by and its batched gRPC access log brings it to the settler in the ext_authz process. Either way
each quota reservation is settled once with the response's real usage. What is charged is read back from the
service's own ``/metrics`` (``inferlb_prompt_tokens_total``, ``inferlb_completion_tokens_total`` by tenant and
model). A stream whose client did not ask for usage gets ``include_usage`` added in both modes, and the
usage chunk is hidden again (by ext_proc's response stream, or by Envoy's Lua filter in ext_authz mode).
Where the modes differ (in ext_authz mode a stream cut before its usage event is charged its reservation),
the test says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from inferlb.config.schema import Config
from inferlb.ops.stack import free_ports
from tests.conftest import redis_or_skip
from tests.e2e.conftest import (
    SHARED_TENANTS,
    RunningStack,
    SharedStacks,
    chat_body,
    http_request,
    shared_doc,
    started_stack,
)

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
LLAMA = "llama-3.1-8b-instruct"
#: This module's tenants (:data:`tests.e2e.conftest.SHARED_TENANTS`), one per test, so each test reads its
#: own counters (labels are per tenant): ``acct-conc`` runs one request at a time, ``acct-burst`` has
#: 2,000 tokens/min.
TENANTS = ("acct-json", "acct-sse", "acct-sse-hidden", "acct-abort", "acct-conc", "acct-burst")
BURST_KEY = "sk-acct-burst-key"


def metric_samples(config: Config) -> Iterator[Sample]:
    """Every sample of every request-path process's ``/metrics`` (``metrics_listen`` and the
    ``extra_listen`` processes')."""
    for addr in (config.ext_proc.metrics_listen, *config.ext_proc.extra_metrics_addresses()):
        text = http_request(str(addr), "GET", "/metrics").body.decode()
        for fam in text_string_to_metric_families(text):
            yield from fam.samples


def charged(config: Config, tenant: str, model: str) -> tuple[int, int]:
    """(prompt, completion) tokens the gateway has charged ``tenant`` on ``model``, from the ``/metrics``
    of its processes."""
    got = {"inferlb_prompt_tokens_total": 0.0, "inferlb_completion_tokens_total": 0.0}
    for s in metric_samples(config):
        if s.name in got and s.labels.get("tenant") == tenant and s.labels.get("model") == model:
            got[s.name] += s.value
    return int(got["inferlb_prompt_tokens_total"]), int(got["inferlb_completion_tokens_total"])


def settlements(config: Config) -> dict[str, int]:
    """``inferlb_meter_settlements_total`` by outcome (ext_authz mode's settler), from ``/metrics``."""
    out: dict[str, int] = {}
    for s in metric_samples(config):
        if s.name == "inferlb_meter_settlements_total":
            out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + int(s.value)
    return out


def wait_charged(
    config: Config, tenant: str, model: str, before: tuple[int, int], timeout_s: float = 10.0
) -> tuple[int, int]:
    """The (prompt, completion) charged since ``before``, once something was charged (bounded wait:
    the settlement of an aborted stream lands when Envoy closes the ext_proc stream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = charged(config, tenant, model)
        delta = (now[0] - before[0], now[1] - before[1])
        if delta != (0, 0) or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


@pytest.fixture(scope="module", params=("memory", "redis"))
def quota_backend(request: pytest.FixtureRequest) -> str:
    """Each quota store in turn: in-process, or a real Redis shared by the replicas."""
    backend: str = request.param
    return backend


@pytest.fixture(scope="module")
def accounting_stack(
    tmp_path_factory: pytest.TempPathFactory,
    shared_stacks: SharedStacks,
    request_path: str,
    quota_backend: str,
) -> Iterator[RunningStack]:
    """The config of the shared stacks (:func:`tests.e2e.conftest.shared_doc`: the default fleet with the
    default config's response accounting, decode slowed to 2,000 tokens/s per V100 sequence so an abort
    mid-stream comes before the end, one tenant per test of this module) in each request-path mode and
    with each quota store. In-process: the shared stack itself; each test spends and reads only its own
    tenant (by difference), so what other modules did on it does not count. With Redis: a stack of its
    own, two replicas sharing a real Redis (in ext_authz mode each with its own settler, Envoy's access
    log sending each entry to the replica that admitted it)."""
    assert set(TENANTS) <= {t["name"] for t in SHARED_TENANTS}
    if quota_backend == "memory":
        rs = shared_stacks.get(request_path)
        assert rs.config.ext_proc.account_responses
        yield rs
        return
    doc = shared_doc(request_path)
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_or_skip(tmp_path_factory.mktemp("redis")))
        doc["ext_proc"].update(quota_backend="redis", redis_url=redis.url)
        grpc_port, metrics_port, meter_port = free_ports(3)
        doc["ext_proc"]["extra_listen"] = [f"127.0.0.1:{grpc_port}"]
        doc["ext_proc"]["extra_metrics_listen"] = [f"127.0.0.1:{metrics_port}"]
        doc["ext_proc"]["extra_meter_listen"] = [f"127.0.0.1:{meter_port}"]
        rs = stack.enter_context(started_stack(tmp_path_factory.mktemp("acct"), doc))
        assert rs.config.ext_proc.account_responses
        yield rs


def test_a_json_response_is_charged_its_usage(accounting_stack: RunningStack) -> None:
    rs = accounting_stack
    before = charged(rs.config, "acct-json", QWEN)
    with rs.openai_client("sk-acct-json-key") as c:
        resp = c.chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": "count my tokens"}], max_tokens=9
        )
    assert resp.usage is not None
    assert wait_charged(rs.config, "acct-json", QWEN, before) == (
        resp.usage.prompt_tokens,
        resp.usage.completion_tokens,
    )


def test_a_stream_that_asked_for_usage_is_charged_it_and_sees_it(accounting_stack: RunningStack) -> None:
    rs = accounting_stack
    before = charged(rs.config, "acct-sse", LLAMA)
    with rs.openai_client("sk-acct-sse-key") as c:
        chunks = list(
            c.chat.completions.create(
                model=LLAMA,
                messages=[{"role": "user", "content": "stream with usage"}],
                max_tokens=11,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1
    assert wait_charged(rs.config, "acct-sse", LLAMA, before) == (
        usage[0].prompt_tokens,
        usage[0].completion_tokens,
    )


def test_a_stream_that_did_not_ask_is_charged_but_never_sees_the_usage_chunk(
    accounting_stack: RunningStack, request_path: str
) -> None:
    rs = accounting_stack
    messages: Any = [{"role": "user", "content": "stream without usage"}]
    with rs.openai_client("sk-acct-sse-hidden-key") as c:
        # the same prompt non-streamed tells the prompt count the stream must be charged
        start = charged(rs.config, "acct-sse-hidden", QWEN)
        ref = c.chat.completions.create(model=QWEN, messages=messages, max_tokens=1)
        assert ref.usage is not None
        ref_charge = wait_charged(rs.config, "acct-sse-hidden", QWEN, start)
        before = (start[0] + ref_charge[0], start[1] + ref_charge[1])  # once the reference has settled
        chunks = list(c.chat.completions.create(model=QWEN, messages=messages, max_tokens=13, stream=True))
    assert chunks and all(ch.usage is None for ch in chunks)
    # no usage-only chunk: the gateway asked for it and removed it (ext_proc's stream, Envoy's Lua filter)
    assert all(ch.choices for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text
    # the usage the gateway asked for
    metered_before = settlements(rs.config).get("metered", 0)
    assert wait_charged(rs.config, "acct-sse-hidden", QWEN, before) == (ref.usage.prompt_tokens, 13)
    if request_path == "ext_authz":
        assert settlements(rs.config).get("metered", 0) > metered_before


def _normalized(sse: bytes) -> bytes:
    """``sse`` with each chunk's ``id`` and ``created`` (per request) replaced by fixed values."""
    sse = re.sub(rb'"id":"[^"]*"', b'"id":"x"', sse)
    return re.sub(rb'"created":\d+', b'"created":0', sse)


def test_a_stream_that_did_not_ask_gets_the_model_servers_bytes(accounting_stack: RunningStack) -> None:
    rs = accounting_stack
    body = chat_body(QWEN, max_tokens=9, stream=True)
    key = {"Authorization": "Bearer sk-acct-sse-hidden-key"}
    through = http_request(rs.gateway, "POST", "/v1/chat/completions", body, key)
    assert through.status == 200, through.body
    endpoint = next(e for e in rs.config.endpoints if e.model == QWEN)
    direct = http_request(str(endpoint.address), "POST", "/v1/chat/completions", body)
    assert direct.status == 200
    # byte for byte what the simulated GPU sends a client that did not ask for usage (no usage-only
    # chunk, no "usage": null member), once the per-request id and timestamp are set aside
    assert b'"usage"' not in through.body
    assert _normalized(through.body) == _normalized(direct.body)
    assert through.body.endswith(b"data: [DONE]\n\n")


def test_an_aborted_stream_is_charged_for_what_was_produced(
    accounting_stack: RunningStack, request_path: str
) -> None:
    rs = accounting_stack
    max_tokens = 4_000  # >= 1.2 s of decode on the fastest GPU at 2,000 tokens/s x 3.4
    before = charged(rs.config, "acct-abort", QWEN)
    with rs.openai_client("sk-acct-abort-key") as c:
        stream = c.chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": "a long story please"}],
            max_tokens=max_tokens,
            stream=True,
        )
        seen = 0
        for ch in stream:
            seen += sum(1 for choice in ch.choices if choice.delta.content)
            if seen >= 20:
                break
        stream.close()
    prompt, completion = wait_charged(rs.config, "acct-abort", QWEN, before)
    assert prompt > 0
    # charged what was produced: at least what the client read, well short of the reservation (ext_proc
    # counts the streamed deltas' tokens; in ext_authz mode Envoy's Lua filter counts their text bytes,
    # never fewer than their tokens)
    print(f"\n{request_path}: read {seen} content chunks, charged {completion} of {max_tokens}")
    assert seen <= completion < max_tokens


def test_a_concurrent_streamed_burst_never_exceeds_the_tokens_per_minute_quota(
    accounting_stack: RunningStack,
) -> None:
    rs = accounting_stack
    tenant = next(t for t in rs.config.tenants if BURST_KEY in t.api_keys)
    quota = tenant.tokens_per_minute
    assert quota == 2_000
    refused_retry_after: list[str | None] = []

    async def one(c: openai.AsyncOpenAI, i: int) -> int:
        """Admitted tokens of one streamed request (its usage event), or 0 when refused."""
        try:
            stream = await c.chat.completions.create(
                model=QWEN,
                messages=[{"role": "user", "content": f"burst request number {i}"}],
                max_tokens=150,
                stream=True,
                stream_options={"include_usage": True},
            )
            total = 0
            async for ch in stream:
                if ch.usage is not None:
                    total = ch.usage.total_tokens
            assert total > 0
            return total
        except openai.RateLimitError as err:
            refused_retry_after.append(err.response.headers.get("retry-after"))
            return 0

    async def burst() -> list[int]:
        async with openai.AsyncOpenAI(
            base_url=f"http://{rs.gateway}/v1", api_key=BURST_KEY, max_retries=0, timeout=30
        ) as c:
            first = await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(24))), 60)
            # a second wave once the first has settled: settled usage still counts in the minute
            second = await asyncio.wait_for(asyncio.gather(*(one(c, 100 + i) for i in range(24))), 60)
            return [*first, *second]

    admitted = asyncio.run(burst())
    assert sum(admitted) <= quota, admitted
    assert 0 < sum(1 for a in admitted if a) < len(admitted)
    assert refused_retry_after and all(r is not None and int(r) >= 1 for r in refused_retry_after)


def test_a_concurrency_slot_is_held_until_the_response_ends(accounting_stack: RunningStack) -> None:
    rs = accounting_stack
    body = chat_body(QWEN, max_tokens=3_000, stream=True)
    key = {"Authorization": "Bearer sk-acct-conc-key"}
    with rs.openai_client("sk-acct-conc-key") as c:
        stream = c.chat.completions.create(
            model=QWEN, messages=body["messages"], max_tokens=3_000, stream=True
        )
        next(iter(stream))  # admitted and streaming: its slot is held
        second = http_request(rs.gateway, "POST", "/v1/chat/completions", chat_body(QWEN), key)
        assert second.status == 429
        assert second.json()["error"]["message"].startswith("Too many concurrent requests")
        for _ in stream:
            pass
    # released at the response's end (ext_authz: when its access-log entry arrives, one flush later)
    deadline = time.monotonic() + 10
    while (
        status := http_request(rs.gateway, "POST", "/v1/chat/completions", chat_body(QWEN), key).status
    ) == 429:
        assert time.monotonic() < deadline, "the slot was never released"
        time.sleep(0.1)
    assert status == 200


def process_samples(addr: object, name: str) -> dict[str, float]:
    """One process's samples of metric ``name`` (label values joined by ``,``, in label name order ->
    value)."""
    text = http_request(str(addr), "GET", "/metrics").body.decode()
    return {
        ",".join(s.labels.values()): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def test_each_replica_settles_what_it_admitted(accounting_stack: RunningStack, request_path: str) -> None:
    rs = accounting_stack
    ep = rs.config.ext_proc
    if not ep.extra_listen:
        pytest.skip("one request-path process with the in-process quota store")
    for i in range(8):  # Envoy spreads checks over both replicas
        assert (
            http_request(
                rs.gateway,
                "POST",
                "/v1/chat/completions",
                chat_body(QWEN, max_tokens=2),
                {"Authorization": "Bearer sk-acct-json-key"},
            ).status
            == 200
        ), i
    processes = (ep.metrics_listen, *ep.extra_metrics_addresses())
    served = [sum(process_samples(a, "inferlb_requests_total").values()) for a in processes]
    assert all(n > 0 for n in served), served
    if request_path != "ext_authz":
        return
    # each replica's settler got the entries of its own ids and none of the other's (an entry at the
    # wrong settler would be an unknown id there), none waited for the TTL
    deadline = time.monotonic() + 10
    while True:
        settled = [process_samples(a, "inferlb_meter_settlements_total") for a in processes]
        if all(s.get("metered", 0) > 0 for s in settled) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(s.get("metered", 0) > 0 and s.get("expired", 0) == 0 for s in settled), settled
    ignored = [process_samples(a, "inferlb_meter_entries_ignored_total") for a in processes]
    assert all(i.get("unknown", 0) == 0 for i in ignored), ignored
