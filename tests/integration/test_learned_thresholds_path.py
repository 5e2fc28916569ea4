"""Learnt length-class thresholds on the request path, in both modes (the real grpc ext_proc servicer; the
ext_authz check service, on its synchronous and its awaited path): clients that all send one default cap
(1,024) are confined while the configured threshold (100) serves, then never once the learner has seen
``min_samples`` requests; with mixed caps the learnt threshold confines the longest ones only. The same
traffic with the static threshold stays confined, which is what the learner fixes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from ext_proc.state import ExtProcState
from inferlb.config.schema import parse_config
from inferlb.request import headers as h
from tests.integration.test_ext_proc_accounting import req_body, req_headers, serving

KEY = "sk-learn-0001"
MIN_SAMPLES = 16


def config(protocol: str, *, learn: bool = True) -> dict[str, Any]:
    length_aware: dict[str, Any] = {"long_output_tokens": 100}
    if learn:
        # a derivation at every request (rederive_every_s 0): the test's clocks are frozen
        length_aware["learn_thresholds"] = {"window": 64, "min_samples": MIN_SAMPLES, "rederive_every_s": 0}
    return {
        "ext_proc": {"protocol": protocol},
        "models": [{"name": "llama", "cluster": {"length_aware": length_aware}}],
        # the fast set (one H100, 3.4 of 5.4) may take 0.75 x 0.63 = 0.47 of the work
        "endpoints": [
            {"address": "10.0.0.1:80", "model": "llama", "gpu": "H100"},
            {"address": "10.0.0.2:80", "model": "llama", "gpu": "V100"},
            {"address": "10.0.0.3:80", "model": "llama", "gpu": "V100"},
        ],
        "tenants": [{"name": "t", "api_keys": [KEY]}],
    }


def chat(max_tokens: int) -> bytes:
    body = {"model": "llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    return json.dumps(body).encode()


Classify = Callable[[int], Awaitable[str]]


@pytest.fixture(params=["ext_proc", "ext_authz-sync", "ext_authz-awaited"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def classifier(mode: str, cfg: dict[str, Any]) -> AsyncIterator[Classify]:
    """``classify(max_tokens)``: the ``x-inferlb-length-class`` the request path sets on one request."""
    if mode == "ext_proc":
        async with serving(cfg) as hx:

            async def classify_ext_proc(max_tokens: int) -> str:
                call = hx.stub.Process()
                try:
                    await hx.send(call, req_headers(KEY))
                    resp = await hx.send(call, req_body(chat(max_tokens)))
                finally:
                    call.cancel()
                mutation = resp.request_body.response.header_mutation
                got = {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
                return got[h.LENGTH_CLASS]

            yield classify_ext_proc
        return
    state = ExtProcState(parse_config({**cfg, "ext_proc": {"protocol": "ext_authz"}}), clock=lambda: 1000.0)
    # awaited: every body is counted in a worker thread, so each check is the future path
    service = CheckService(state, offload_body_bytes=1 if mode.endswith("awaited") else 1 << 30)

    async def classify_ext_authz(max_tokens: int) -> str:
        out = service.check(
            CheckRequest(
                method="POST",
                path="/v1/chat/completions",
                headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
                body=chat(max_tokens),
            )
        )
        answer = out if isinstance(out, CheckAnswer) else await asyncio.wait_for(out, 10)
        assert answer.status == 200, answer
        return dict(answer.headers)[h.LENGTH_CLASS]

    yield classify_ext_authz


async def classes_of(mode: str, cfg: dict[str, Any], caps: list[int]) -> list[str]:
    gen = classifier(mode, cfg)
    classify = await anext(gen)
    try:
        return [await classify(c) for c in caps]
    finally:
        await gen.aclose()


async def test_one_default_cap_is_not_confined_once_learnt(mode: str) -> None:
    classes = await classes_of(mode, config("ext_proc"), [1024] * 40)
    # the configured threshold (100) serves the first min_samples requests: each looks long
    assert classes[:MIN_SAMPLES] == ["long"] * MIN_SAMPLES
    # learnt from the caps seen: 1,024 is the largest, nothing is above it
    assert classes[MIN_SAMPLES:] == ["short"] * (40 - MIN_SAMPLES)


async def test_with_the_static_threshold_one_default_cap_stays_confined(mode: str) -> None:
    classes = await classes_of(mode, config("ext_proc", learn=False), [1024] * 40)
    assert classes == ["long"] * 40


async def test_mixed_caps_confine_the_longest_within_the_fast_sets_budget(mode: str) -> None:
    # per 10 requests: six capped at 100, three at 400, one at 1,000 (work ~ cap): above 400 is 1,000 of
    # 2,800 (0.36 <= 0.47), above 100 is 2,200 (0.79 > 0.47): the learnt threshold is 400
    caps = ([100] * 6 + [400] * 3 + [1000]) * 4
    classes = await classes_of(mode, config("ext_proc"), caps)
    learnt = {(c, k) for c, k in zip(caps[20:], classes[20:], strict=True)}
    assert learnt == {(100, "short"), (400, "short"), (1000, "long")}
