"""Output-length prediction and the capacity guard through a real Envoy 1.40 (both request-path modes).

Every client sends one default cap (``max_tokens`` 1,024) while the real answers are mostly short (the
simulated model ends them with gpusim's ``x-gpusim-eos-after``: 40 tokens, every tenth 150), the case where
classing by the cap confines all traffic to the fast tier. Three length-aware models (long = above 100
tokens, fast = relative capacity >= 1.5), each on one A100 (1.7) and three V100s (1.0), so the fast tier
holds 1.7 / 4.7 = 36% of the capacity:

- ``pred``: ``predict_output`` and ``capacity_guard_factor: 1.5``;
- ``plain``: neither (classes by the cap: everything is long, everything on the A100);
- ``guard``: the guard alone;
- ``picked``: both options on a model whose endpoints the request path picks (``endpoint_picking: load``;
  the picker's class hosts, not Envoy's subsets, confine it);
- ``learnt``: ``learn_thresholds`` (the threshold learnt from the caps seen: 1,024, the only one, confines
  nothing).

Placement is read from gpusim's ``x-inferlb-gpu`` response header.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from inferlb.ops.stack import free_ports
from simulation.gpusim.server import EOS_AFTER_HEADER
from tests.conftest import LOOPBACK, make_config_doc
from tests.e2e.conftest import RunningStack, in_mode, started_stack
from tests.e2e.test_extproc_accounting import metric_samples

pytestmark = pytest.mark.e2e

PRED, PLAIN, GUARD, PICKED, LEARNT = "pred", "plain", "guard", "picked", "learnt"
CAP = 1024
SHORT_ANSWER, LONG_ANSWER = 40, 150
FACTOR = 1.5
#: The A100's share of each model's capacity.
FAST_SHARE = 1.7 / (1.7 + 3 * 1.0)
#: Requests measured per model, sent by this many clients at once.
N, CLIENTS = 160, 16
#: Sequential requests that teach the predictor first (its ``min_samples`` is 8).
WARMUP = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(make_config_doc(), request_path)
    options: dict[str, dict[str, Any]] = {
        PRED: {"predict_output": True, "capacity_guard_factor": FACTOR},
        PLAIN: {},
        GUARD: {"capacity_guard_factor": FACTOR},
        PICKED: {"predict_output": True, "capacity_guard_factor": FACTOR},
        # a derivation at every request, after 8 of them (per request-path process)
        LEARNT: {"learn_thresholds": {"window": 64, "min_samples": 8, "rederive_every_s": 0}},
    }
    ports = iter(free_ports(4 * len(options)))
    for name, extra in options.items():
        la = {"long_output_tokens": 100, "fast_min_relative_capacity": 1.5, **extra}
        model: dict[str, Any] = {"name": name, "cluster": {"length_aware": la}}
        if name == PICKED:
            model["endpoint_picking"] = {"mode": "load"}
        doc["models"].append(model)
        gpus = ("A100", "V100", "V100", "V100")
        where = {f"{name}-{g.lower()}-{i}": (g, f"{LOOPBACK}:{next(ports)}") for i, g in enumerate(gpus)}
        doc["endpoints"] += [
            {"name": n, "address": a, "model": name, "gpu": g, "simulated": True}
            for n, (g, a) in where.items()
        ]
    with started_stack(tmp_path_factory.mktemp("predict"), doc) as rs:
        yield rs


def answer_tokens(i: int) -> int:
    """The real length of request ``i``'s answer: every tenth long, the rest short."""
    return LONG_ANSWER if i % 10 == 0 else SHORT_ANSWER


def ask(
    client: openai.OpenAI, model: str, i: int, *, user: str | None = None, tokens: int | None = None
) -> str:
    """One chat completion capped at :data:`CAP` (a question of its own, or ``user``'s conversation); the GPU
    type that served it."""
    want = answer_tokens(i) if tokens is None else tokens
    extra: dict[str, Any] = {} if user is None else {"user": user}
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": f"question {i} for {model}"}],
        max_tokens=CAP,
        extra_headers={EOS_AFTER_HEADER: str(want)},
        **extra,
    )
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == want
    return raw.headers["x-inferlb-gpu"]


def counter(rs: RunningStack, name: str, **labels: str) -> float:
    """The sum of ``name`` (a request-path counter) over the samples with ``labels``, every process."""
    return sum(
        s.value
        for s in metric_samples(rs.config)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def settled(rs: RunningStack, model: str, completion_tokens: float) -> None:
    """Wait until ``model``'s charged completion tokens reach ``completion_tokens`` (its answers settled:
    at once with ext_proc, after the access log's flush with ext_authz)."""
    deadline = time.monotonic() + 10
    while counter(rs, "inferlb_completion_tokens_total", model=model) < completion_tokens:
        assert time.monotonic() < deadline, f"{model}'s answers never settled"
        time.sleep(0.05)


def placements(rs: RunningStack, model: str, start: int) -> Counter[str]:
    """GPU type -> requests, of :data:`N` requests from :data:`CLIENTS` concurrent clients."""
    client = rs.openai_client()
    with ThreadPoolExecutor(CLIENTS) as pool:
        return Counter(pool.map(lambda i: ask(client, model, i), range(start, start + N)))


def fast_share(served: Counter[str]) -> float:
    return served["A100"] / sum(served.values())


@pytest.mark.parametrize("model", [PRED, PICKED], ids=["envoy-subsets", "endpoint-picking"])
def test_predicted_classes_keep_the_fast_tier_within_its_capacity_share(
    stack: RunningStack, model: str
) -> None:
    client = stack.openai_client()
    taught = 0
    for i in range(WARMUP):
        ask(client, model, i)
        taught += answer_tokens(i)
    settled(stack, model, taught)
    served = placements(stack, model, WARMUP)
    assert fast_share(served) <= FACTOR * FAST_SHARE, served
    assert {"A100", "V100"} <= set(served), served
    # the answers decided the classes (the cold start's by the cap)
    assert counter(stack, "inferlb_length_class_decisions_total", model=model, source="prediction") >= N
    assert counter(stack, "inferlb_length_class_decisions_total", model=model, source="cap") >= 1
    if model == PICKED:  # the picker chose every host
        assert counter(stack, "inferlb_endpoint_picks_total", model=model, outcome="picked") >= WARMUP + N


def test_a_conversation_with_long_answers_is_placed_on_the_fast_tier(stack: RunningStack) -> None:
    client = stack.openai_client()
    before = counter(stack, "inferlb_completion_tokens_total", model=PRED)
    gpus = []
    for turn in range(5):
        gpus.append(ask(client, PRED, 10_000 + turn, user="coder", tokens=LONG_ANSWER))
        settled(stack, PRED, before + (turn + 1) * LONG_ANSWER)
    # its first answer taught the predictor; the rest are long, on the A100 (nothing else is in flight)
    assert gpus[1:] == ["A100"] * 4, gpus


def test_without_prediction_or_guard_every_request_is_confined(stack: RunningStack) -> None:
    served = placements(stack, PLAIN, 0)
    assert served == Counter({"A100": N}), served


def test_the_guard_alone_spills_the_confined_class_under_load(stack: RunningStack) -> None:
    served = placements(stack, GUARD, 0)
    assert "V100" in served, served
    assert counter(stack, "inferlb_length_class_spills_total", model=GUARD) >= served["V100"]


def gauges(rs: RunningStack, name: str, **labels: str) -> list[float]:
    """The values of ``name`` (a request-path gauge) with ``labels``, one per process that has it."""
    return [
        s.value
        for s in metric_samples(rs.config)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def test_learnt_thresholds_do_not_confine_one_default_cap(stack: RunningStack) -> None:
    client = stack.openai_client()
    tokens = 4  # short answers: the test is about placement, not decoding
    # the configured threshold (100) serves until a process has seen min_samples requests; then the learnt
    # one: 1,024, the only cap seen, confines nothing
    for i in range(40):
        ask(client, LEARNT, i, tokens=tokens)
        learnt = gauges(stack, "inferlb_length_class_threshold_tokens", model=LEARNT)
        if i >= 8 and learnt and all(t == CAP for t in learnt):
            break
    else:
        raise AssertionError(f"the threshold was never learnt: {learnt}")
    with ThreadPoolExecutor(8) as pool:
        served = Counter(pool.map(lambda i: ask(client, LEARNT, i, tokens=tokens), range(100, 132)))
    assert "V100" in served, served
    assert counter(stack, "inferlb_length_class_decisions_total", model=LEARNT, length_class="short") >= 32
