"""What GPUs and model servers report, as frozen values, and pure parsers for it. No I/O.

Two sources feed the weight policy (:mod:`inferlb.policy.weights`):

* **GPU telemetry** (:class:`GpuTelemetry`), from NVML through ``inferlb agent`` (:mod:`inferlb.ops.agent`),
  from a DCGM exporter's ``/metrics`` (:func:`parse_dcgm_metrics`), or from the simulated fleet's ``GET
  /sim/telemetry``. The agent reports a :class:`GpuReport` as JSON (:meth:`GpuReport.to_json`), which
  :func:`parse_gpu_report` reads back with every field checked.
* **Model-server metrics** (:class:`ServerMetrics`), parsed from a server's Prometheus ``/metrics`` text with
  ``prometheus_client``'s parser by :func:`parse_server_metrics`, under the names each server family uses:

  - **vLLM**: waiting ``vllm:num_requests_waiting``, running ``vllm:num_requests_running``, KV usage
    ``vllm:kv_cache_usage_perc`` (older ``vllm:gpu_cache_usage_perc``), ``vllm:generation_tokens_total``,
    ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (older
    ``vllm:gpu_prefix_cache_hits_total`` / ``..._queries_total``), ``vllm:request_success_total``.
  - **SGLang**: waiting ``sglang:num_queue_reqs``, running ``sglang:num_running_reqs``, KV usage
    ``sglang:token_usage``, throughput gauge ``sglang:gen_throughput`` (tokens/s),
    ``sglang:generation_tokens_total``, prefix cache as ``sglang:cached_tokens_total`` over
    ``sglang:prompt_tokens_total`` (tokens), ``sglang:num_requests_total``.
  - **TGI**: waiting ``tgi_queue_size``, running ``tgi_batch_current_size``, no KV gauge, generated tokens as
    the sum of the ``tgi_request_generated_tokens`` histogram, ``tgi_request_success``.
  - **TRT-LLM** (Triton backend): ``nv_trt_llm_request_metrics`` with ``request_type`` ``"waiting"``,
    ``"active"`` (running) and ``"max"`` (the batch bound); KV usage
    ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}`` (else ``used`` over ``max``
    blocks), or NVIDIA Dynamo's ``trtllm_kv_cache_utilization``.

  Sources: docs.vllm.ai "Production Metrics"; docs.sglang.io "Production Metrics"; huggingface.co
  text-generation-inference "Metrics"; the Triton ``tensorrtllm_backend`` README ("Triton Metrics") and
  NVIDIA Dynamo's TensorRT-LLM observability page. A metric present under several label sets (one per model
  or engine) is summed for counts and counters, and its maximum is taken for KV usage (the fullest engine is
  the one that preempts).

DCGM (``dcgm-exporter``) names read by :func:`parse_dcgm_metrics`, one GPU per ``gpu`` label:
``DCGM_FI_DEV_GPU_UTIL`` (%), ``DCGM_FI_DEV_FB_USED`` / ``DCGM_FI_DEV_FB_FREE`` (MiB),
``DCGM_FI_DEV_GPU_TEMP`` (C), ``DCGM_FI_DEV_POWER_USAGE`` (W), ``DCGM_FI_DEV_SM_CLOCK`` /
``DCGM_FI_DEV_MAX_SM_CLOCK`` (MHz), ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` (the NVML bit mask).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from inferlb.errors import InferlbError
from inferlb.policy.weights import WeightInputs

# NVML clock throttle ("clocks event") reason bits, from nvml.h (``nvmlClocksEventReason*``, formerly
# ``nvmlClocksThrottleReason*``); the same mask DCGM exports as DCGM_FI_DEV_CLOCK_THROTTLE_REASONS.
REASON_SW_POWER_CAP = 0x04
#: HW slowdown: clocks cut by 2x or more because of temperature, power brake or power draw (nvml.h);
#: NVML does not say which, so it counts as both thermal and power.
REASON_HW_SLOWDOWN = 0x08
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80
THERMAL_REASONS = REASON_SW_THERMAL | REASON_HW_THERMAL | REASON_HW_SLOWDOWN
POWER_REASONS = REASON_SW_POWER_CAP | REASON_HW_POWER_BRAKE | REASON_HW_SLOWDOWN

MIB = 1024 * 1024


class TelemetryParseError(InferlbError):
    """Telemetry could not be read: not Prometheus text, no known metric, or a JSON report with a bad field.

    Attributes:
        field: the offending field (dotted, e.g. ``gpus[1].temperature_c``) or ``""`` for the whole input.
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


@dataclass(frozen=True, kw_only=True)
class ThrottleReasons:
    """NVML clock throttle reasons decoded from the bit mask."""

    mask: int
    thermal: bool
    power: bool

    @classmethod
    def from_mask(cls, mask: int) -> ThrottleReasons:
        """Decode an NVML ``nvmlClocksEventReason*`` bit mask (see :data:`THERMAL_REASONS`,
        :data:`POWER_REASONS`)."""
        return cls(mask=mask, thermal=bool(mask & THERMAL_REASONS), power=bool(mask & POWER_REASONS))


@dataclass(frozen=True, kw_only=True)
class GpuTelemetry:
    """One GPU at one instant, as NVML reports it.

    Attributes:
        index: NVML device index on its node.
        uuid: NVML UUID (``GPU-...``), or a stable made-up one for a simulated GPU.
        name: product name (``NVIDIA H100 80GB HBM3``) or the GPU profile name.
        utilization_percent: percent of the last sample period a kernel ran (0..100).
        memory_used_bytes / memory_total_bytes: device memory (bytes).
        temperature_c: GPU core temperature (degrees C).
        throttle_reasons: the NVML clock throttle reason bit mask (0 = none).
        thermal_throttled / power_throttled: decoded from ``throttle_reasons``.
        sm_clock_mhz / max_sm_clock_mhz: current and maximum SM clock (MHz), None when unknown.
        power_w: board power draw (W), None when unknown.
    """

    index: int
    uuid: str
    name: str
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: float
    throttle_reasons: int = 0
    thermal_throttled: bool = False
    power_throttled: bool = False
    sm_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    power_w: float | None = None

    @property
    def clock_ratio(self) -> float | None:
        """Current over maximum SM clock in (0, 1], or None when either is unknown or zero."""
        if not self.sm_clock_mhz or not self.max_sm_clock_mhz:
            return None
        return max(1e-6, min(1.0, self.sm_clock_mhz / self.max_sm_clock_mhz))

    @property
    def memory_used_fraction(self) -> float:
        """``memory_used_bytes / memory_total_bytes`` (0 when the total is unknown)."""
        return self.memory_used_bytes / self.memory_total_bytes if self.memory_total_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON object with every attribute plus ``clock_ratio``."""
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "utilization_percent": self.utilization_percent,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_total_bytes": self.memory_total_bytes,
            "temperature_c": self.temperature_c,
            "throttle_reasons": self.throttle_reasons,
            "thermal_throttled": self.thermal_throttled,
            "power_throttled": self.power_throttled,
            "sm_clock_mhz": self.sm_clock_mhz,
            "max_sm_clock_mhz": self.max_sm_clock_mhz,
            "clock_ratio": self.clock_ratio,
            "power_w": self.power_w,
        }

    @classmethod
    def from_json(cls, obj: Any, *, where: str = "") -> GpuTelemetry:
        """Read :meth:`to_json`'s object back (``clock_ratio`` is derived, so ignored).

        Raises:
            TelemetryParseError: not an object, a missing or mistyped field, or a value out of range
                (utilization outside 0..100, negative memory, used above total); ``field`` names it.
        """
        prefix = f"{where}." if where else ""
        if not isinstance(obj, Mapping):
            raise TelemetryParseError(f"expected an object, got {type(obj).__name__}", field=where)
        reasons = _int(obj, "throttle_reasons", prefix, default=0)
        decoded = ThrottleReasons.from_mask(reasons)
        gpu = cls(
            index=_int(obj, "index", prefix),
            uuid=_str(obj, "uuid", prefix),
            name=_str(obj, "name", prefix),
            utilization_percent=_num(obj, "utilization_percent", prefix),
            memory_used_bytes=_int(obj, "memory_used_bytes", prefix),
            memory_total_bytes=_int(obj, "memory_total_bytes", prefix),
            temperature_c=_num(obj, "temperature_c", prefix),
            throttle_reasons=reasons,
            thermal_throttled=_bool(obj, "thermal_throttled", prefix, default=decoded.thermal),
            power_throttled=_bool(obj, "power_throttled", prefix, default=decoded.power),
            sm_clock_mhz=_opt_num(obj, "sm_clock_mhz", prefix),
            max_sm_clock_mhz=_opt_num(obj, "max_sm_clock_mhz", prefix),
            power_w=_opt_num(obj, "power_w", prefix),
        )
        if not 0 <= gpu.utilization_percent <= 100:
            raise TelemetryParseError(
                f"must be in 0..100, got {gpu.utilization_percent}", field=f"{prefix}utilization_percent"
            )
        if gpu.memory_used_bytes < 0 or gpu.memory_total_bytes < 0:
            raise TelemetryParseError("must be >= 0", field=f"{prefix}memory_used_bytes")
        if gpu.memory_total_bytes and gpu.memory_used_bytes > gpu.memory_total_bytes:
            raise TelemetryParseError(
                f"{gpu.memory_used_bytes} is above memory_total_bytes {gpu.memory_total_bytes}",
                field=f"{prefix}memory_used_bytes",
            )
        return gpu


@dataclass(frozen=True, kw_only=True)
class GpuReport:
    """What one ``inferlb agent`` reports for its node: ``POST {url}/v1/telemetry/gpu`` with
    :meth:`to_json` as the body.

    Attributes:
        node: the node's name (host name by default), used to match GPUs to endpoints.
        gpus: one entry per GPU.
        sent_at: the agent's wall-clock time (Unix seconds) when it read NVML.
    """

    node: str
    gpus: tuple[GpuTelemetry, ...]
    sent_at: float

    def to_json(self) -> dict[str, Any]:
        """``{"node": ..., "sent_at": ..., "gpus": [GpuTelemetry.to_json(), ...]}``."""
        return {"node": self.node, "sent_at": self.sent_at, "gpus": [g.to_json() for g in self.gpus]}


def parse_gpu_report(obj: Any) -> GpuReport:
    """Read a :class:`GpuReport` from a decoded JSON body.

    Raises:
        TelemetryParseError: a missing or bad field, named (``gpus[2].uuid``).
    """
    if not isinstance(obj, Mapping):
        raise TelemetryParseError(f"expected a JSON object, got {type(obj).__name__}")
    node = _str(obj, "node", "")
    if not node:
        raise TelemetryParseError("must not be empty", field="node")
    gpus = obj.get("gpus")
    if not isinstance(gpus, list):
        raise TelemetryParseError("expected a list", field="gpus")
    sent_at = _num(obj, "sent_at", "")
    return GpuReport(
        node=node,
        gpus=tuple(GpuTelemetry.from_json(g, where=f"gpus[{i}]") for i, g in enumerate(gpus)),
        sent_at=sent_at,
    )


ServerFamily = Literal["vllm", "sglang", "tgi", "trtllm"]


@dataclass(frozen=True, kw_only=True)
class ServerMetrics:
    """One scrape of a model server's ``/metrics``, in one vocabulary whatever the server. None = the server
    does not export it.

    Attributes:
        family: which server's names were found.
        waiting_requests: requests queued for a batch slot.
        running_requests: requests in the running batch.
        max_batch: the server's batch bound when it exports one (TRT-LLM ``request_type="max"``).
        kv_cache_usage: KV-cache usage 0..1.
        prefix_cache_hits_total / prefix_cache_queries_total: prefix-cache counters (vLLM counts tokens
            since v1; SGLang cached vs prompt tokens).
        generation_tokens_total: tokens generated since the server started (a counter).
        generation_tokens_per_s: the server's own throughput gauge (SGLang ``gen_throughput``).
        request_success_total: requests finished successfully (a counter).
    """

    family: ServerFamily
    waiting_requests: float | None = None
    running_requests: float | None = None
    max_batch: float | None = None
    kv_cache_usage: float | None = None
    prefix_cache_hits_total: float | None = None
    prefix_cache_queries_total: float | None = None
    generation_tokens_total: float | None = None
    generation_tokens_per_s: float | None = None
    request_success_total: float | None = None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hits over queries since start (0..1), None without both counters or with no query yet."""
        if not self.prefix_cache_queries_total or self.prefix_cache_hits_total is None:
            return None
        return self.prefix_cache_hits_total / self.prefix_cache_queries_total


# sample name -> {frozenset(labels) -> value}; counters are stored under their ``_total`` sample name.
_Samples = dict[str, list[tuple[dict[str, str], float]]]


#: Sample names :func:`parse_server_metrics` reads. Lines of other metrics (histogram buckets are most of a
#: vLLM exposition) are dropped before parsing: prometheus_client's parser costs ~2 us per line.
_SERVER_NAMES = frozenset(
    {
        "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
        "vllm:generation_tokens_total", "vllm:request_success_total",
        "sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", "sglang:gen_throughput",
        "sglang:cached_tokens_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "tgi_queue_size", "tgi_batch_current_size", "tgi_request_generated_tokens_sum",
        "tgi_request_success_total", "tgi_request_success",
        "nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics", "trtllm_kv_cache_utilization",
    }
)  # fmt: skip


def _keep_only(text: str, names: frozenset[str]) -> str:
    """The lines of ``text`` that hold a sample named in ``names`` (and their ``# TYPE`` lines)."""
    kept: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] == "TYPE" and (parts[2] in names or parts[2] + "_total" in names):
                kept.append(line)
            continue
        end = len(line)
        for stop in ("{", " ", "\t"):
            i = line.find(stop)
            if 0 <= i < end:
                end = i
        if line[:end] in names:
            kept.append(line)
    return "\n".join(kept) + "\n"


def _samples(text: str, names: frozenset[str] | None = None) -> _Samples:
    if names is not None:
        text = _keep_only(text, names)
    out: _Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if isinstance(s.value, float) and math.isnan(s.value):
                    continue
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except ValueError as exc:
        raise TelemetryParseError(f"not Prometheus text format: {exc}") from None
    return out


def _picked(samples: _Samples, names: tuple[str, ...], where: Mapping[str, str] | None) -> list[float]:
    """Values of the first of ``names`` that has samples matching ``where`` (all its label sets), or []."""
    for name in names:
        rows = samples.get(name)
        if rows is None:
            continue
        picked = [v for labels, v in rows if not where or all(labels.get(k) == w for k, w in where.items())]
        if picked:
            return picked
    return []


def _sum(samples: _Samples, *names: str, where: Mapping[str, str] | None = None) -> float | None:
    """Sum over label sets of the first name present (labels filtered by ``where``)."""
    picked = _picked(samples, names, where)
    return sum(picked) if picked else None


def _max(samples: _Samples, *names: str, where: Mapping[str, str] | None = None) -> float | None:
    """Largest value over label sets of the first name present (labels filtered by ``where``)."""
    picked = _picked(samples, names, where)
    return max(picked) if picked else None


def parse_server_metrics(text: str) -> ServerMetrics:
    """Parse a model server's Prometheus ``/metrics`` text (vLLM, SGLang, TGI or TRT-LLM; see the module doc).

    The family is the first of vLLM, SGLang, TGI, TRT-LLM whose queue or batch metric appears.

    Raises:
        TelemetryParseError: the text is not Prometheus exposition format, or holds no known queue or
            batch metric of any family.
    """
    s = _samples(text, _SERVER_NAMES)
    if "vllm:num_requests_waiting" in s or "vllm:num_requests_running" in s:
        return ServerMetrics(
            family="vllm",
            waiting_requests=_sum(s, "vllm:num_requests_waiting"),
            running_requests=_sum(s, "vllm:num_requests_running"),
            kv_cache_usage=_max(s, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            prefix_cache_hits_total=_sum(
                s, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"
            ),
            prefix_cache_queries_total=_sum(
                s, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"
            ),
            generation_tokens_total=_sum(s, "vllm:generation_tokens_total"),
            request_success_total=_sum(s, "vllm:request_success_total"),
        )
    if "sglang:num_queue_reqs" in s or "sglang:num_running_reqs" in s:
        return ServerMetrics(
            family="sglang",
            waiting_requests=_sum(s, "sglang:num_queue_reqs"),
            running_requests=_sum(s, "sglang:num_running_reqs"),
            kv_cache_usage=_max(s, "sglang:token_usage"),
            prefix_cache_hits_total=_sum(s, "sglang:cached_tokens_total"),
            prefix_cache_queries_total=_sum(s, "sglang:prompt_tokens_total"),
            generation_tokens_total=_sum(s, "sglang:generation_tokens_total"),
            generation_tokens_per_s=_sum(s, "sglang:gen_throughput"),
            request_success_total=_sum(s, "sglang:num_requests_total"),
        )
    if "tgi_queue_size" in s or "tgi_batch_current_size" in s:
        return ServerMetrics(
            family="tgi",
            waiting_requests=_sum(s, "tgi_queue_size"),
            running_requests=_sum(s, "tgi_batch_current_size"),
            generation_tokens_total=_sum(s, "tgi_request_generated_tokens_sum"),
            request_success_total=_sum(s, "tgi_request_success_total", "tgi_request_success"),
        )
    if "nv_trt_llm_request_metrics" in s:
        req = "nv_trt_llm_request_metrics"
        kv = _max(s, "nv_trt_llm_kv_cache_block_metrics", where={"kv_cache_block_type": "fraction"})
        if kv is None:
            used = _sum(s, "nv_trt_llm_kv_cache_block_metrics", where={"kv_cache_block_type": "used"})
            most = _sum(s, "nv_trt_llm_kv_cache_block_metrics", where={"kv_cache_block_type": "max"})
            kv = used / most if used is not None and most else None
        if kv is None:
            kv = _max(s, "trtllm_kv_cache_utilization")
        return ServerMetrics(
            family="trtllm",
            waiting_requests=_sum(s, req, where={"request_type": "waiting"}),
            running_requests=_sum(s, req, where={"request_type": "active"}),
            max_batch=_sum(s, req, where={"request_type": "max"}),
            kv_cache_usage=kv,
        )
    raise TelemetryParseError(
        "no known model-server metric (vllm:num_requests_waiting, sglang:num_queue_reqs, tgi_queue_size, "
        "nv_trt_llm_request_metrics)"
    )


def parse_dcgm_metrics(text: str) -> list[GpuTelemetry]:
    """Parse a DCGM exporter's ``/metrics`` text into one :class:`GpuTelemetry` per ``gpu`` label, by index.

    Memory comes as framebuffer MiB used and free (total = used + free); a GPU without
    ``DCGM_FI_DEV_GPU_UTIL`` is skipped.

    Raises:
        TelemetryParseError: not Prometheus text, or no ``DCGM_FI_DEV_GPU_UTIL`` sample at all.
    """
    s = _samples(text)
    if "DCGM_FI_DEV_GPU_UTIL" not in s:
        raise TelemetryParseError("no DCGM_FI_DEV_GPU_UTIL sample")
    per_gpu: dict[str, dict[str, float]] = {}
    info: dict[str, dict[str, str]] = {}
    for name, rows in s.items():
        if not name.startswith("DCGM_FI_"):
            continue
        for labels, v in rows:
            gpu = labels.get("gpu")
            if gpu is None:
                continue
            per_gpu.setdefault(gpu, {})[name] = v
            info.setdefault(gpu, labels)
    out: list[GpuTelemetry] = []
    for gpu, values in per_gpu.items():
        if "DCGM_FI_DEV_GPU_UTIL" not in values:
            continue
        labels = info[gpu]
        used = values.get("DCGM_FI_DEV_FB_USED", 0.0)
        free = values.get("DCGM_FI_DEV_FB_FREE", 0.0)
        reasons = ThrottleReasons.from_mask(int(values.get("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 0)))
        out.append(
            GpuTelemetry(
                index=int(gpu) if gpu.isdigit() else len(out),
                uuid=labels.get("UUID", labels.get("uuid", f"gpu-{gpu}")),
                name=labels.get("modelName", ""),
                utilization_percent=values["DCGM_FI_DEV_GPU_UTIL"],
                memory_used_bytes=int(used * MIB),
                memory_total_bytes=int((used + free) * MIB),
                temperature_c=values.get("DCGM_FI_DEV_GPU_TEMP", 0.0),
                throttle_reasons=reasons.mask,
                thermal_throttled=reasons.thermal,
                power_throttled=reasons.power,
                sm_clock_mhz=values.get("DCGM_FI_DEV_SM_CLOCK"),
                max_sm_clock_mhz=values.get("DCGM_FI_DEV_MAX_SM_CLOCK"),
                power_w=values.get("DCGM_FI_DEV_POWER_USAGE"),
            )
        )
    return sorted(out, key=lambda g: g.index)


def counter_rate(
    previous: float | None, previous_at: float, current: float | None, current_at: float
) -> float | None:
    """Per-second rate of a counter between two scrapes (e.g. generation tokens/s), or None when either
    value is missing, no time passed, or the counter went down (the server restarted)."""
    if previous is None or current is None or current_at <= previous_at or current < previous:
        return None
    return (current - previous) / (current_at - previous_at)


def gpu_by_uuid(gpus: Iterable[GpuTelemetry]) -> dict[str, GpuTelemetry]:
    """Index GPUs by UUID (a later entry with the same UUID wins)."""
    return {g.uuid: g for g in gpus}


# -- JSON field readers -------------------------------------------------------------------------------------


def _get(obj: Mapping[str, Any], key: str, prefix: str) -> Any:
    if key not in obj:
        raise TelemetryParseError("missing", field=f"{prefix}{key}")
    return obj[key]


def _num(obj: Mapping[str, Any], key: str, prefix: str) -> float:
    v = _get(obj, key, prefix)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise TelemetryParseError(f"expected a finite number, got {v!r}", field=f"{prefix}{key}")
    return float(v)


def _opt_num(obj: Mapping[str, Any], key: str, prefix: str) -> float | None:
    if obj.get(key) is None:
        return None
    return _num(obj, key, prefix)


def _int(obj: Mapping[str, Any], key: str, prefix: str, *, default: int | None = None) -> int:
    if default is not None and obj.get(key) is None:
        return default
    v = _get(obj, key, prefix)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TelemetryParseError(f"expected an integer, got {v!r}", field=f"{prefix}{key}")
    return v


def _str(obj: Mapping[str, Any], key: str, prefix: str) -> str:
    v = _get(obj, key, prefix)
    if not isinstance(v, str):
        raise TelemetryParseError(f"expected a string, got {v!r}", field=f"{prefix}{key}")
    return v


def _bool(obj: Mapping[str, Any], key: str, prefix: str, *, default: bool) -> bool:
    if obj.get(key) is None:
        return default
    v = obj[key]
    if not isinstance(v, bool):
        raise TelemetryParseError(f"expected true or false, got {v!r}", field=f"{prefix}{key}")
    return v


def weight_inputs(
    *,
    profile_capacity: float,
    max_batch: int,
    server: ServerMetrics | None,
    server_age_s: float | None,
    gpu: GpuTelemetry | None,
    gpu_age_s: float | None,
    stale_after_s: float,
    generation_tokens_per_s: float | None = None,
    reference_tokens_per_s: float | None = None,
    error_rate: float = 0.0,
) -> WeightInputs:
    """Combine one endpoint's model-server scrape and its GPU's telemetry into :class:`WeightInputs`.

    Each source counts only while fresh (age <= ``stale_after_s``); the inputs' ``telemetry_age_s`` is the age
    of the freshest source that counts, or None when neither does (the weight policy then gives the profile
    weight). The server's own batch bound (TRT-LLM) overrides ``max_batch``; its throughput gauge (SGLang) is
    used when ``generation_tokens_per_s`` is not given. Counts are rounded to whole requests and KV usage
    clamped to [0, 1], since exporters report floats.
    """
    server_ok = server is not None and server_age_s is not None and server_age_s <= stale_after_s
    gpu_ok = gpu is not None and gpu_age_s is not None and gpu_age_s <= stale_after_s
    ages = [a for a, ok in ((server_age_s, server_ok), (gpu_age_s, gpu_ok)) if ok and a is not None]
    kwargs: dict[str, Any] = {}
    if server_ok and server is not None:
        if server.max_batch and server.max_batch >= 1:
            max_batch = int(server.max_batch)
        kwargs.update(
            waiting_requests=max(0, round(server.waiting_requests or 0)),
            running_requests=max(0, round(server.running_requests or 0)),
            kv_cache_usage=min(1.0, max(0.0, server.kv_cache_usage or 0.0)),
        )
        if generation_tokens_per_s is None:
            generation_tokens_per_s = server.generation_tokens_per_s
        kwargs.update(
            generation_tokens_per_s=generation_tokens_per_s, reference_tokens_per_s=reference_tokens_per_s
        )
    if gpu_ok and gpu is not None:
        kwargs.update(
            thermal_throttled=gpu.thermal_throttled,
            power_throttled=gpu.power_throttled,
            clock_ratio=gpu.clock_ratio,
        )
    return WeightInputs(
        profile_capacity=profile_capacity,
        max_batch=max_batch,
        telemetry_age_s=min(ages) if ages else None,
        error_rate=min(1.0, max(0.0, error_rate)),
        **kwargs,
    )
