"""Telemetry types and parsers (inferlb.policy.telemetry): each model-server family, DCGM, the agent's
report."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.policy.telemetry import (
    MIB,
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    GpuReport,
    GpuTelemetry,
    ServerMetrics,
    TelemetryParseError,
    ThrottleReasons,
    counter_rate,
    parse_dcgm_metrics,
    parse_gpu_report,
    parse_server_metrics,
    weight_inputs,
)
from simulation.gpusim.engine import EngineStats
from simulation.gpusim.vllm_metrics import EndpointMetrics

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.71
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.2
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 250.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 52000.0
vllm:generation_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 90.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 10.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 100.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 12.5
"""

# vLLM before v0.10 (V0 engine names)
VLLM_OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.35
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 40.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 10.0
"""

SGLANG = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.032225e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct"} 355.5
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 41.0
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 5
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 24
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 16000
# TYPE tgi_request_success counter
tgi_request_success 1234
# TYPE tgi_request_generated_tokens histogram
tgi_request_generated_tokens_bucket{le="1"} 0
tgi_request_generated_tokens_bucket{le="+Inf"} 1234
tgi_request_generated_tokens_sum 98765
tgi_request_generated_tokens_count 1234
"""

TRTLLM = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 6
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 64
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 9
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 300
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 700
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 1000
"""

DCGM = """\
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-aaaa",modelName="NVIDIA H100 80GB HBM3",Hostname="n1"} 1980
DCGM_FI_DEV_SM_CLOCK{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3",Hostname="n1"} 990
# TYPE DCGM_FI_DEV_MAX_SM_CLOCK gauge
DCGM_FI_DEV_MAX_SM_CLOCK{gpu="0",UUID="GPU-aaaa",modelName="NVIDIA H100 80GB HBM3"} 1980
DCGM_FI_DEV_MAX_SM_CLOCK{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3"} 1980
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-aaaa",modelName="NVIDIA H100 80GB HBM3"} 54
DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3"} 88
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-aaaa",modelName="NVIDIA H100 80GB HBM3"} 412.5
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3"} 300.0
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-aaaa",modelName="NVIDIA H100 80GB HBM3"} 97
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3"} 100
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-aaaa",modelName="NVIDIA H100 80GB HBM3"} 1000
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3"} 2000
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-aaaa",modelName="NVIDIA H100 80GB HBM3"} 80000
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3"} 79000
# HELP DCGM_FI_DEV_CLOCK_THROTTLE_REASONS Current clock throttle reasons.
# TYPE DCGM_FI_DEV_CLOCK_THROTTLE_REASONS gauge
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="0",UUID="GPU-aaaa",modelName="NVIDIA H100 80GB HBM3"} 0
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3"} 32
"""


def test_vllm_metrics_sum_over_engines_and_take_the_fullest_kv_cache() -> None:
    m = parse_server_metrics(VLLM)
    assert m.family == "vllm"
    assert (m.waiting_requests, m.running_requests) == (5.0, 15.0)
    assert m.kv_cache_usage == pytest.approx(0.71)
    assert (m.prefix_cache_hits_total, m.prefix_cache_queries_total) == (250.0, 1000.0)
    assert m.prefix_cache_hit_rate == pytest.approx(0.25)
    assert m.generation_tokens_total == 53000.0
    assert m.request_success_total == 100.0
    assert m.max_batch is None and m.generation_tokens_per_s is None


def test_older_vllm_names_are_read() -> None:
    m = parse_server_metrics(VLLM_OLD)
    assert m.family == "vllm"
    assert m.kv_cache_usage == pytest.approx(0.35)
    assert m.prefix_cache_hit_rate == pytest.approx(0.25)
    assert m.generation_tokens_total is None


def test_sglang_metrics() -> None:
    m = parse_server_metrics(SGLANG)
    assert m.family == "sglang"
    assert (m.waiting_requests, m.running_requests) == (7.0, 41.0)
    assert m.kv_cache_usage == pytest.approx(0.28)
    assert m.generation_tokens_per_s == pytest.approx(355.5)
    assert m.generation_tokens_total == pytest.approx(7.557572e6)
    assert m.prefix_cache_hit_rate == pytest.approx(2.032225e6 / 8.128902e6)


def test_tgi_metrics() -> None:
    m = parse_server_metrics(TGI)
    assert m.family == "tgi"
    assert (m.waiting_requests, m.running_requests) == (5.0, 24.0)
    assert m.kv_cache_usage is None
    assert m.generation_tokens_total == 98765.0
    assert m.request_success_total == 1234.0


def test_trtllm_metrics_from_block_counts_and_from_the_fraction() -> None:
    m = parse_server_metrics(TRTLLM)
    assert m.family == "trtllm"
    assert (m.waiting_requests, m.running_requests, m.max_batch) == (3.0, 9.0, 64.0)
    assert m.kv_cache_usage == pytest.approx(0.3)
    with_fraction = TRTLLM + (
        "nv_trt_llm_kv_cache_block_metrics"
        '{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.9\n'
    )
    assert parse_server_metrics(with_fraction).kv_cache_usage == pytest.approx(0.9)
    dynamo = TRTLLM.replace("nv_trt_llm_kv_cache_block_metrics", "other_blocks") + (
        "# TYPE trtllm_kv_cache_utilization gauge\ntrtllm_kv_cache_utilization 0.42\n"
    )
    assert parse_server_metrics(dynamo).kv_cache_usage == pytest.approx(0.42)


def test_the_simulated_servers_own_exposition_parses_as_vllm() -> None:
    stats = EngineStats(
        running_requests=6, running_slots=6, waiting_requests=2, kv_tokens=1000, kv_usage=0.125,
        prompt_tokens_total=500, generation_tokens_total=777, requests_finished_total=3,
        requests_refused_total=0, requests_cancelled_total=0, steps_total=10, busy_seconds_total=1.5,
        slowdown=1.0, prefix_cache_queries_total=500, prefix_cache_hits_total=320,
    )  # fmt: skip
    metrics = EndpointMetrics(model_name="m", stats=lambda: stats)
    metrics.request_finished(queue_s=0.1, ttft_s=0.2, e2e_s=1.0)
    m = parse_server_metrics(metrics.exposition().decode())
    assert m == ServerMetrics(
        family="vllm",
        waiting_requests=2.0,
        running_requests=6.0,
        kv_cache_usage=0.125,
        generation_tokens_total=777.0,
        request_success_total=1.0,
        prefix_cache_hits_total=320.0,
        prefix_cache_queries_total=500.0,
    )
    assert m.prefix_cache_hit_rate == pytest.approx(0.64)


def test_nan_samples_are_ignored() -> None:
    m = parse_server_metrics(
        VLLM_OLD.replace(
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.35', 'vllm:gpu_cache_usage_perc{model_name="m"} NaN'
        )
    )
    assert m.kv_cache_usage is None


@pytest.mark.parametrize(
    "text",
    [
        'vllm:num_requests_waiting{model_name="m" 3\n',  # broken label set
        'vllm:num_requests_running{model_name="m"} not-a-number\n',
    ],
)
def test_text_that_is_not_prometheus_is_refused(text: str) -> None:
    with pytest.raises(TelemetryParseError, match="not Prometheus text"):
        parse_server_metrics(text)


def test_garbage_is_refused() -> None:
    with pytest.raises(TelemetryParseError):
        parse_server_metrics("this is not { prometheus\n")


def test_other_metrics_are_skipped_whatever_they_hold() -> None:
    # lines of metrics the parser does not read are dropped before parsing, even malformed ones
    text = VLLM + 'some_histogram_bucket{le="0.1" 3\n'
    assert parse_server_metrics(text) == parse_server_metrics(VLLM)


def test_text_without_any_known_metric_is_refused() -> None:
    with pytest.raises(TelemetryParseError, match="no known model-server metric"):
        parse_server_metrics("# TYPE up gauge\nup 1\n")
    with pytest.raises(TelemetryParseError):
        parse_server_metrics("")


def test_dcgm_metrics_one_gpu_per_label() -> None:
    gpus = parse_dcgm_metrics(DCGM)
    assert [g.index for g in gpus] == [0, 1]
    cool, hot = gpus
    assert cool.uuid == "GPU-aaaa" and cool.name == "NVIDIA H100 80GB HBM3"
    assert cool.utilization_percent == 97 and cool.temperature_c == 54 and cool.power_w == 412.5
    assert cool.memory_used_bytes == 80000 * MIB and cool.memory_total_bytes == 81000 * MIB
    assert cool.clock_ratio == 1.0 and not cool.thermal_throttled and not cool.power_throttled
    assert hot.throttle_reasons == REASON_SW_THERMAL and hot.thermal_throttled and not hot.power_throttled
    assert hot.clock_ratio == pytest.approx(0.5)
    with pytest.raises(TelemetryParseError, match="DCGM_FI_DEV_GPU_UTIL"):
        parse_dcgm_metrics(VLLM)


@pytest.mark.parametrize(
    ("mask", "thermal", "power"),
    [
        (0, False, False),
        (0x01, False, False),  # GPU idle is not a throttle
        (REASON_SW_THERMAL, True, False),
        (0x40, True, False),
        (REASON_SW_POWER_CAP, False, True),
        (REASON_HW_POWER_BRAKE, False, True),
        (REASON_HW_SLOWDOWN, True, True),
    ],
)
def test_throttle_reason_bits(mask: int, thermal: bool, power: bool) -> None:
    r = ThrottleReasons.from_mask(mask)
    assert (r.thermal, r.power) == (thermal, power)


def gpu(**overrides: Any) -> GpuTelemetry:
    values: dict[str, Any] = {
        "index": 0, "uuid": "GPU-1", "name": "H100", "utilization_percent": 55.0,
        "memory_used_bytes": 10 * 2**30, "memory_total_bytes": 80 * 2**30, "temperature_c": 61.0,
        "sm_clock_mhz": 1500.0, "max_sm_clock_mhz": 1980.0, "power_w": 350.0,
    }  # fmt: skip
    values.update(overrides)
    return GpuTelemetry(**values)


gpus_st = st.builds(
    gpu,
    index=st.integers(0, 15),
    utilization_percent=st.floats(0, 100),
    temperature_c=st.floats(-10, 120),
    throttle_reasons=st.integers(0, 0x7FF),
    sm_clock_mhz=st.one_of(st.none(), st.floats(1, 3000)),
    power_w=st.one_of(st.none(), st.floats(0, 1000)),
)


@given(st.lists(gpus_st, max_size=8), st.text(min_size=1, max_size=40), st.floats(0, 2e9))
def test_a_gpu_report_round_trips_through_json(gpus: list[GpuTelemetry], node: str, sent_at: float) -> None:
    report = GpuReport(node=node, gpus=tuple(gpus), sent_at=sent_at)
    assert parse_gpu_report(json.loads(json.dumps(report.to_json()))) == report


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.pop("node"), "node"),
        (lambda r: r.update(node=""), "node"),
        (lambda r: r.update(gpus={}), "gpus"),
        (lambda r: r.update(sent_at="now"), "sent_at"),
        (lambda r: r["gpus"][1].pop("uuid"), "gpus[1].uuid"),
        (lambda r: r["gpus"][0].update(utilization_percent=140), "gpus[0].utilization_percent"),
        (lambda r: r["gpus"][0].update(temperature_c=True), "gpus[0].temperature_c"),
        (lambda r: r["gpus"][0].update(index=1.5), "gpus[0].index"),
        (lambda r: r["gpus"][0].update(memory_used_bytes=10**15), "gpus[0].memory_used_bytes"),
        (lambda r: r["gpus"][1].update(thermal_throttled="yes"), "gpus[1].thermal_throttled"),
        (lambda r: r["gpus"].append(3), "gpus[2]"),
    ],
)
def test_a_bad_gpu_report_names_the_field(mutate: Any, field: str) -> None:
    body = GpuReport(node="n1", gpus=(gpu(), gpu(index=1, uuid="GPU-2")), sent_at=1.0).to_json()
    mutate(body)
    with pytest.raises(TelemetryParseError) as info:
        parse_gpu_report(body)
    assert info.value.field == field


def test_a_report_without_throttle_flags_decodes_the_mask() -> None:
    body = gpu().to_json()
    body.update(throttle_reasons=REASON_SW_POWER_CAP)
    del body["thermal_throttled"], body["power_throttled"]
    g = GpuTelemetry.from_json(body)
    assert g.power_throttled and not g.thermal_throttled


def test_counter_rate() -> None:
    assert counter_rate(100.0, 10.0, 400.0, 12.0) == 150.0
    assert counter_rate(400.0, 10.0, 100.0, 12.0) is None  # restarted
    assert counter_rate(None, 10.0, 100.0, 12.0) is None
    assert counter_rate(1.0, 10.0, 2.0, 10.0) is None


def test_weight_inputs_take_each_source_only_while_fresh() -> None:
    server = parse_server_metrics(TRTLLM)
    hot = gpu(thermal_throttled=True, sm_clock_mhz=990.0)
    both = weight_inputs(
        profile_capacity=3.4, max_batch=16, server=server, server_age_s=0.5, gpu=hot, gpu_age_s=1.0,
        stale_after_s=5.0, generation_tokens_per_s=300.0, reference_tokens_per_s=30.0,
    )  # fmt: skip
    assert both.telemetry_age_s == 0.5
    assert (both.waiting_requests, both.running_requests, both.max_batch) == (3, 9, 64)
    assert both.kv_cache_usage == pytest.approx(0.3)
    assert both.thermal_throttled and both.clock_ratio == pytest.approx(0.5)
    assert both.generation_tokens_per_s == 300.0
    gpu_only = weight_inputs(
        profile_capacity=3.4, max_batch=16, server=server, server_age_s=9.0, gpu=hot, gpu_age_s=1.0,
        stale_after_s=5.0,
    )  # fmt: skip
    assert gpu_only.telemetry_age_s == 1.0 and gpu_only.waiting_requests == 0 and gpu_only.max_batch == 16
    assert gpu_only.thermal_throttled
    neither = weight_inputs(
        profile_capacity=3.4, max_batch=16, server=server, server_age_s=9.0, gpu=None, gpu_age_s=None,
        stale_after_s=5.0,
    )  # fmt: skip
    assert neither.telemetry_age_s is None
    sglang = weight_inputs(
        profile_capacity=1.0, max_batch=64, server=parse_server_metrics(SGLANG), server_age_s=0.0, gpu=None,
        gpu_age_s=None, stale_after_s=5.0,
    )  # fmt: skip
    assert sglang.generation_tokens_per_s == pytest.approx(355.5)
