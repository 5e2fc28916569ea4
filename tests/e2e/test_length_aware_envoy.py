"""Length-aware placement through a real Envoy 1.40 (:mod:`inferlb.policy.length_aware`), with the openai SDK.

One stack, three models: llama is length-aware (long = output cap above 100 tokens; fast tier = relative
capacity >= 1.5: the H100 and A100s, not the V100), qwen is not (behaviour unchanged), and phi is
length-aware with no GPU fast enough (its fast subset is empty: long requests fall back to every GPU).
A fourth model, mistral, is tiered (``tiers``: caps above 100 tokens on GPUs of capacity >= 3 (its H100),
above 40 on >= 1.5 (H100 and A100), the rest anywhere) on one H100, one A100 and one V100.
Which GPU served each request is read from gpusim's ``x-inferlb-endpoint`` / ``x-inferlb-gpu`` headers.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from inferlb.ops.stack import admin_get, free_ports
from tests.conftest import LOOPBACK, make_config_doc
from tests.e2e.conftest import RunningStack, in_mode, started_stack

pytestmark = pytest.mark.e2e

LLAMA = "llama-3.1-8b-instruct"
QWEN = "qwen2.5-7b-instruct"
PHI = "phi-3-mini"
MISTRAL = "mistral-7b"
MIDDLE_CAP = 60
THRESHOLD = 100
LONG_CAP = 150
SHORT_CAP = 4
#: Requests per check: with the default weights (H100 34, A100 17, V100 10) the V100 takes ~13% of the
#: llama v1 cluster's short requests, so 60 leave it none with probability < 1e-3 (sequential requests
#: meet no queue, so the weighted pick follows the weights).
N = 60


@pytest.fixture(scope="module")
def length_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(make_config_doc(), request_path)
    llama = next(m for m in doc["models"] if m["name"] == LLAMA)
    llama["cluster"]["length_aware"] = {"long_output_tokens": THRESHOLD, "fast_min_relative_capacity": 1.5}
    doc["models"].append(
        {
            "name": PHI,
            "cluster": {"length_aware": {"long_output_tokens": THRESHOLD, "fast_min_relative_capacity": 50}},
        }
    )
    for name, gpu, port in zip(("phi-h100", "phi-v100"), ("H100", "V100"), free_ports(2), strict=True):
        doc["endpoints"].append(
            {"name": name, "address": f"{LOOPBACK}:{port}", "model": PHI, "gpu": gpu, "simulated": True}
        )
    doc["models"].append(
        {
            "name": MISTRAL,
            "cluster": {
                "length_aware": {
                    "tiers": [
                        {"above_output_tokens": THRESHOLD, "min_relative_capacity": 3.0},
                        {"above_output_tokens": 40, "min_relative_capacity": 1.5},
                    ]
                }
            },
        }
    )
    for gpu, port in zip(("H100", "A100", "V100"), free_ports(3), strict=True):
        doc["endpoints"].append(
            {
                "name": f"mistral-{gpu.lower()}",
                "address": f"{LOOPBACK}:{port}",
                "model": MISTRAL,
                "gpu": gpu,
                "simulated": True,
            }
        )
    with started_stack(tmp_path_factory.mktemp("length"), doc) as rs:
        yield rs


def _served_by(
    client: openai.OpenAI, model: str, max_tokens: int, n: int, *, extra_headers: dict[str, str] | None = None
) -> Counter[tuple[str, str]]:
    """``(endpoint, gpu)`` of each of ``n`` chat completions asking for ``max_tokens``."""
    out: Counter[tuple[str, str]] = Counter()
    for _ in range(n):
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=max_tokens,
            extra_headers=extra_headers,
        )
        completion = raw.parse()
        assert completion.usage is not None
        assert completion.usage.completion_tokens == max_tokens
        out[(raw.headers["x-inferlb-endpoint"], raw.headers["x-inferlb-gpu"])] += 1
    return out


def _gpus(served: Counter[tuple[str, str]]) -> set[str]:
    return {gpu for _, gpu in served}


def _dynamic_cluster(rs: RunningStack, name: str) -> dict[str, Any]:
    dump = json.loads(admin_get(rs.config, "/config_dump?resource=dynamic_active_clusters"))
    return next(e["cluster"] for e in dump["configs"] if e.get("cluster", {}).get("name") == name)


def _stats(rs: RunningStack) -> dict[str, str]:
    text = admin_get(rs.config, "/stats").decode()
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def test_envoy_accepts_the_subset_clusters(length_stack: RunningStack) -> None:
    rs = length_stack
    rejected = {k: v for k, v in _stats(rs).items() if k.endswith("update_rejected") and v != "0"}
    assert rejected == {}
    subsets = _dynamic_cluster(rs, f"{LLAMA}--v1")["lb_subset_config"]
    assert subsets["fallback_policy"] == "ANY_ENDPOINT"
    assert subsets["subset_selectors"] == [{"keys": ["gpu_tier"]}]
    assert _dynamic_cluster(rs, f"{LLAMA}--v1")["lb_policy"] == "LEAST_REQUEST"
    assert "lb_subset_config" not in _dynamic_cluster(rs, f"{QWEN}--v1")


@pytest.mark.parametrize("key", ["sk-demo-a", "sk-demo-b"], ids=["high-priority", "default-priority"])
def test_long_requests_land_only_on_fast_gpus(length_stack: RunningStack, key: str) -> None:
    served = _served_by(length_stack.openai_client(key), LLAMA, LONG_CAP, N)
    assert _gpus(served) <= {"H100", "A100"}, served
    assert sum(served.values()) == N
    # balanced within the fast subset, not pinned to one GPU
    assert len(served) >= 2, served


def test_short_requests_spread_over_every_gpu(length_stack: RunningStack) -> None:
    served = _served_by(length_stack.openai_client(), LLAMA, SHORT_CAP, N)
    assert "V100" in _gpus(served), served
    assert {"H100", "A100"} <= _gpus(served), served


def test_a_client_cannot_choose_its_length_class(length_stack: RunningStack) -> None:
    client = length_stack.openai_client()
    short_claiming_long = _served_by(
        client, LLAMA, SHORT_CAP, N, extra_headers={"x-inferlb-length-class": "long"}
    )
    assert "V100" in _gpus(short_claiming_long), short_claiming_long
    long_claiming_short = _served_by(
        client, LLAMA, LONG_CAP, 20, extra_headers={"x-inferlb-length-class": "short"}
    )
    assert _gpus(long_claiming_short) <= {"H100", "A100"}, long_claiming_short


def test_a_model_without_length_aware_routing_is_unchanged(length_stack: RunningStack) -> None:
    served = _served_by(length_stack.openai_client(), QWEN, LONG_CAP, N)
    assert _gpus(served) == {"H100", "V100"}, served


def test_long_requests_fall_back_to_every_gpu_when_no_gpu_is_fast(length_stack: RunningStack) -> None:
    served = _served_by(length_stack.openai_client(), PHI, LONG_CAP, N)
    assert {name for name, _ in served} == {"phi-h100", "phi-v100"}, served


def test_envoy_accepts_one_list_selector_for_the_tiered_classes(length_stack: RunningStack) -> None:
    subsets = _dynamic_cluster(length_stack, f"{MISTRAL}--v1")["lb_subset_config"]
    assert subsets["subset_selectors"] == [{"keys": ["length_classes"]}]
    assert subsets["list_as_any"] is True
    assert subsets["fallback_policy"] == "ANY_ENDPOINT"


def test_tiered_longest_requests_land_only_on_the_h100(length_stack: RunningStack) -> None:
    served = _served_by(length_stack.openai_client(), MISTRAL, LONG_CAP, 30)
    assert set(served) == {("mistral-h100", "H100")}, served


def test_tiered_middle_requests_land_on_the_h100_and_the_a100_only(length_stack: RunningStack) -> None:
    served = _served_by(length_stack.openai_client(), MISTRAL, MIDDLE_CAP, N)
    assert _gpus(served) == {"H100", "A100"}, served


def test_tiered_short_requests_run_anywhere(length_stack: RunningStack) -> None:
    served = _served_by(length_stack.openai_client(), MISTRAL, SHORT_CAP, N)
    assert _gpus(served) == {"H100", "A100", "V100"}, served
