"""The whole request path through a real Envoy: xDS-configured routes and weights, ext_proc routing and
refusals, the simulated fleet serving, the official OpenAI SDK as a client."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferlb.ops.stack import clusters_json
from inferlb.ops.status import host_rows
from inferlb.policy.capacity import capacity_weight
from inferlb.request.headers import ENDPOINT
from tests.e2e.conftest import RunningStack, http_request

pytestmark = pytest.mark.e2e

LLAMA = "llama-3.1-8b-instruct"
QWEN = "qwen2.5-7b-instruct"

#: The counter gpusim raises for every HTTP request that reaches a simulated GPU's inference paths.
RECEIVED = "gpusim_requests_received"


def endpoints_of(rs: RunningStack, model: str, version: str | None = None) -> set[str]:
    return {
        e.display_name
        for e in rs.config.endpoints
        if e.model == model and (version is None or rs.config.endpoint_version(e) == version)
    }


def backend_requests(rs: RunningStack) -> int:
    """Inference requests every simulated GPU has received, summed from their /metrics."""
    total = 0
    for e in rs.config.endpoints:
        text = http_request(str(e.address), "GET", "/metrics").body.decode()
        for fam in text_string_to_metric_families(text):
            if fam.name == RECEIVED:
                total += int(sum(s.value for s in fam.samples if s.name == f"{RECEIVED}_total"))
    return total


def test_weights_from_the_config_are_what_envoy_reports(shared_stack: RunningStack) -> None:
    rs = shared_stack
    rows = host_rows(rs.config, clusters_json(rs.config))
    seen = {r.name: r.weight for r in rows}
    want = {e.display_name: capacity_weight(rs.config, e) for e in rs.config.endpoints}
    assert seen == want
    assert {r.gpu: r.weight for r in rows} == {"H100": 34, "A100": 17, "V100": 10}
    assert {r.cluster for r in rows} == {f"{LLAMA}--v1", f"{LLAMA}--v2", f"{QWEN}--v1"}


@pytest.mark.parametrize(("model", "canonical"), [(QWEN, QWEN), ("qwen", QWEN), ("llama3", LLAMA)])
def test_the_model_named_only_in_the_body_picks_the_cluster(
    shared_stack: RunningStack, model: str, canonical: str
) -> None:
    mine = endpoints_of(shared_stack, canonical)

    def hosts() -> list[tuple[str, str, int]]:
        rows = host_rows(shared_stack.config, clusters_json(shared_stack.config))
        return sorted((r.name, r.health, r.rq_total) for r in rows if r.name in mine)

    # a stack started for this module may still be taking its hosts' first health checks: balancing is
    # over the healthy ones, so wait (bounded) until Envoy counts every GPU of the model healthy
    deadline = time.monotonic() + 15
    while any(health != "healthy" for _, health, _ in hosts()) and time.monotonic() < deadline:
        time.sleep(0.1)
    served = set()
    for _ in range(12):
        r = shared_stack.chat(model)
        assert r.status == 200, r.body
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4
        served.add(r.headers[ENDPOINT])
    assert served <= mine
    # balanced over the model's GPUs, not pinned to one (Envoy's view of each host if not)
    assert len(served) >= 2, hosts()


def test_canary_split_is_90_10_within_3_points(shared_stack: RunningStack) -> None:
    rs = shared_stack
    n = 2000
    body = {"model": LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def go() -> Counter[str]:
        got: Counter[str] = Counter()
        sem = asyncio.Semaphore(32)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as s:

            async def one() -> None:
                async with (
                    sem,
                    s.post(
                        f"http://{rs.gateway}/v1/chat/completions",
                        json=body,
                        headers={"Authorization": "Bearer sk-demo-a"},
                    ) as resp,
                ):
                    await resp.read()
                    got[resp.headers.get(ENDPOINT, f"status {resp.status}")] += 1

            await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), timeout=240)
        return got

    got = asyncio.run(go())
    v1 = sum(got[e] for e in endpoints_of(rs, LLAMA, "v1"))
    v2 = sum(got[e] for e in endpoints_of(rs, LLAMA, "v2"))
    assert v1 + v2 == n, got
    assert abs(v2 / n - 0.10) <= 0.03, (v1, v2)


REFUSALS = [
    # (what, request kwargs for http_request, status, error type, error code)
    ("malformed JSON", {"body": b"{not json", "key": "sk-demo-a"}, 400, "invalid_request_error", None),
    (
        "missing model",
        {"body": {"messages": [{"role": "user", "content": "x"}]}, "key": "sk-demo-a"},
        400,
        "invalid_request_error",
        None,
    ),
    (
        "unknown key",
        {"body": {"model": QWEN, "messages": []}, "key": "sk-nobody-here"},
        401,
        "authentication_error",
        "invalid_api_key",
    ),
    (
        "no key",
        {"body": {"model": QWEN, "messages": []}, "key": None},
        401,
        "authentication_error",
        "invalid_api_key",
    ),
    (
        "unknown model",
        {"body": {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}, "key": "sk-demo-a"},
        404,
        "invalid_request_error",
        "model_not_found",
    ),
]


@pytest.mark.parametrize(("what", "req", "status", "etype", "code"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_reach_the_client_and_never_a_gpu(
    shared_stack: RunningStack, what: str, req: dict[str, object], status: int, etype: str, code: str | None
) -> None:
    before = backend_requests(shared_stack)
    headers = {"Authorization": f"Bearer {req['key']}"} if req["key"] else {}
    r = http_request(shared_stack.gateway, "POST", "/v1/chat/completions", req["body"], headers)  # type: ignore[arg-type]
    assert r.status == status, (what, r.body)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == etype and err["message"]
    if code is not None:
        assert err["code"] == code
    assert backend_requests(shared_stack) == before


def test_a_wrong_method_gets_405_with_allow(shared_stack: RunningStack) -> None:
    """RFC 9110 15.5.6: a 405 names the methods the path takes (``allow``), in both request-path modes."""
    key = {"Authorization": "Bearer sk-demo-a"}
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("POST", "/v1/models", "GET")):
        r = http_request(shared_stack.gateway, method, path, {} if method == "POST" else None, key)
        assert r.status == 405, (method, path, r.body)
        assert r.headers["allow"] == allowed
        assert r.json()["error"]["code"] == "method_not_allowed"


def test_a_body_over_the_limit_gets_413_before_any_gpu(shared_stack: RunningStack) -> None:
    before = backend_requests(shared_stack)
    limit = shared_stack.config.gateway.max_request_body_bytes
    big = {"model": QWEN, "messages": [{"role": "user", "content": "a " * (limit // 2 + 10)}]}
    r = http_request(
        shared_stack.gateway, "POST", "/v1/chat/completions", big, {"Authorization": "Bearer sk-demo-a"}
    )
    assert r.status == 413
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "request_too_large"
    assert backend_requests(shared_stack) == before


def test_over_quota_is_429_with_retry_after_and_never_reaches_a_gpu(shared_stack: RunningStack) -> None:
    # sk-demo-c has 2,000 tokens/min: a few 600-token requests use it up
    statuses = []
    for _ in range(6):
        r = shared_stack.chat(QWEN, "sk-demo-c", max_tokens=500, content="hello " * 90)
        statuses.append(r.status)
        if r.status == 429:
            break
    assert statuses[-1] == 429, statuses
    assert statuses[0] == 200
    before = backend_requests(shared_stack)
    r = shared_stack.chat(QWEN, "sk-demo-c", max_tokens=500, content="hello " * 90)
    assert r.status == 429
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error"
    assert backend_requests(shared_stack) == before


def test_client_sent_inferlb_headers_have_no_effect(shared_stack: RunningStack) -> None:
    rs = shared_stack
    spoof = {
        "x-inferlb-tenant": "team-a",
        "x-inferlb-priority": "high",
        "x-inferlb-model": QWEN,
        "x-inferlb-version": "v1",
    }
    # the routing headers cannot redirect a request: the body's model decides
    for _ in range(5):
        r = rs.chat(LLAMA, headers=spoof)
        assert r.status == 200
        assert r.headers[ENDPOINT] in endpoints_of(rs, LLAMA)
    # a tenant header cannot borrow another tenant's identity or quota: an unknown key stays unknown,
    # and sk-demo-c (2,000 tokens/min) still runs out although it claims to be team-a (100M tokens/min)
    assert rs.chat(QWEN, "sk-not-a-key-at-all", headers=spoof).status == 401
    statuses = [rs.chat(QWEN, "sk-demo-c", max_tokens=700, headers=spoof).status for _ in range(4)]
    assert 429 in statuses, statuses


def test_the_openai_sdk_works_streamed_and_not(shared_stack: RunningStack) -> None:
    client = openai.OpenAI(base_url=f"http://{shared_stack.gateway}/v1", api_key="sk-demo-b", max_retries=0)
    try:
        resp = client.chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": "hi there"}], max_tokens=7
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 7
        assert resp.choices[0].message.content
        chunks = list(
            client.chat.completions.create(
                model="llama3",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 5
        models = {m.id for m in client.models.list()}
        assert {LLAMA, QWEN} <= models
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"http://{shared_stack.gateway}/v1", api_key="sk-wrong-key", max_retries=0
            ).models.list()
    finally:
        client.close()


def test_status_json_lists_every_endpoint(shared_stack: RunningStack) -> None:
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    from inferlb.ops.cli import main  # noqa: PLC0415

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["status", "--config", str(shared_stack.config_path), "--json"])
    assert code == 0
    rows = json.loads(buf.getvalue())
    assert {r["name"] for r in rows} == {e.display_name for e in shared_stack.config.endpoints}


def test_top_draws_every_endpoints_load_and_request_share(shared_stack: RunningStack) -> None:
    """``inferlb top`` samples Envoy while requests flow: every endpoint has a row, and the request shares
    of the model's endpoints over the window add up to the whole (the requests sent during it)."""
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415
    import re  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from inferlb.ops.cli import main  # noqa: PLC0415

    model = shared_stack.config.models[0]
    cluster = model.cluster_name(model.versions[0].name)
    argv = ["top", "--config", str(shared_stack.config_path), "--iterations", "4", "--interval", "0.4"]
    buf = io.StringIO()
    codes: list[int] = []
    with contextlib.redirect_stdout(buf):
        top = threading.Thread(target=lambda: codes.append(main(argv)))
        top.start()
        for _ in range(200):  # requests until the last sample is taken (bounded)
            assert shared_stack.chat(model.name).status == 200
            if not top.is_alive():
                break
        top.join(timeout=30)
    assert codes == [0]
    out = buf.getvalue()
    assert "in-flight requests per unit of capacity" in out
    for e in shared_stack.config.endpoints:
        assert e.display_name in out
    # each row of the model's cluster: weight share, then request share (or '-' for none in the window)
    shares = [
        int(m.group(2))
        for line in out.splitlines()
        if cluster in line and (m := re.search(r"(\d+)%\s*│\s*(\d+)%", line))
    ]
    assert shares and 97 <= sum(shares) <= 103  # rounded to whole percents
