"""The real-server examples (``examples/vllm.yaml``, ``examples/sglang.yaml``) load with inferlb's own config
loader, and the claims their comments make hold: the served model names, the metric names the telemetry
parser reads (against a live vLLM v0.26.0's family list), the KV-events sockets of precise picking."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from inferlb.config.schema import Config, load_config
from inferlb.policy.telemetry import parse_server_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
VLLM_FAMILIES = ROOT / "tests" / "data" / "vllm_metric_families_v0.26.0.txt"


def _served_names(text: str) -> set[str]:
    """Every ``--served-model-name X`` of an example's comments (the commands that started its servers)."""
    return set(re.findall(r"--served-model-name[ \t]+([A-Za-z0-9_.:/-]+)", text))


def _metric_names(text: str, prefix: str) -> set[str]:
    """Every metric name with ``prefix`` that an example's comments list."""
    return set(re.findall(rf"\b{re.escape(prefix)}[a-z_]+", text))


@pytest.mark.parametrize("name", ["vllm.yaml", "sglang.yaml"])
def test_example_loads_real_servers_only(name: str) -> None:
    cfg = load_config(EXAMPLES / name)
    assert isinstance(cfg, Config)
    assert cfg.endpoints and not any(e.simulated for e in cfg.endpoints)
    assert {e.gpu for e in cfg.endpoints} <= set(cfg.gpu_profiles)
    # The servers' --served-model-name is the model's name: what the gateway sends upstream.
    text = (EXAMPLES / name).read_text(encoding="utf-8")
    served = _served_names(text)
    assert served and served <= {m.name for m in cfg.models}
    assert cfg.weights.mode == "telemetry"
    for model in cfg.models:
        assert model.cluster.health_check is not None and model.cluster.health_check.path == "/health"
        if model.endpoint_picking.mode == "precise":
            own = [e for e in cfg.endpoints if e.model == model.name]
            assert own and all(e.kv_events is not None for e in own)
            assert all(str(e.kv_events.endpoint).startswith("tcp://") for e in own if e.kv_events)


def test_vllm_example_names_metrics_a_live_vllm_exports_and_inferlb_reads() -> None:
    text = (EXAMPLES / "vllm.yaml").read_text(encoding="utf-8")
    listed = _metric_names(text, "vllm:")
    families = {
        line.split()[0] for line in VLLM_FAMILIES.read_text(encoding="utf-8").splitlines()
        if line.startswith("vllm:")
    }
    current = {n for n in listed if not n.startswith("vllm:gpu_")}  # the deprecated names are named as such
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= current
    assert current <= families
    # Each listed metric, exported alone, is read by the parser the xDS server scrapes with.
    exposition = "\n".join(
        f"# TYPE {n.removesuffix('_total')} {'counter' if n.endswith('_total') else 'gauge'}\n"
        f'{n}{{model_name="llama-3.1-8b-instruct"}} 3.0'
        for n in sorted(current)
    )
    m = parse_server_metrics(exposition + "\n")
    assert m.waiting_requests == 3 and m.running_requests == 3
    assert m.kv_cache_usage == 3.0
    assert m.generation_tokens_total == 3 and m.request_success_total == 3


def test_sglang_example_names_metrics_inferlb_reads() -> None:
    text = (EXAMPLES / "sglang.yaml").read_text(encoding="utf-8")
    listed = _metric_names(text, "sglang:")
    assert {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"} <= listed
    exposition = "\n".join(
        f"# TYPE {n.removesuffix('_total')} {'counter' if n.endswith('_total') else 'gauge'}\n{n} 2.0"
        for n in sorted(listed)
    )
    m = parse_server_metrics(exposition + "\n")
    assert m.waiting_requests == 2 and m.running_requests == 2 and m.kv_cache_usage == 2.0
