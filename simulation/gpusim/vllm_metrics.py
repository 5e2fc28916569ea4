"""Prometheus metrics of one simulated endpoint, under vLLM's metric names, in a registry of its own.

vLLM names (docs.vllm.ai "Production Metrics"; vLLM design doc ``docs/design/metrics.md``), each labelled
``model_name`` as vLLM does:

==========================================  =========  ======================================================
``vllm:num_requests_running``               gauge      requests in the running batch
``vllm:num_requests_waiting``               gauge      requests queued behind it
``vllm:kv_cache_usage_perc``                gauge      KV-cache blocks in use over the GPU's blocks, 0..1
                                                       (the pool the prefix cache uses; simulation.kvcache)
``vllm:num_preemptions_total``              counter    running requests preempted for want of KV blocks
``vllm:prompt_tokens_total``                counter    prompt tokens prefilled
``vllm:generation_tokens_total``            counter    tokens generated (all choices)
``vllm:prefix_cache_queries_total``         counter    prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``            counter    prompt tokens found there (simulation.kvcache)
``vllm:cache_config_info``                  gauge      1, labels ``block_size``, ``num_gpu_blocks``,
                                                       ``enable_prefix_caching``, ``gpu_memory_utilization``
``vllm:request_success_total``              counter    requests finished, label ``finished_reason``
                                                       (``length`` for generation, ``stop`` for embeddings)
``vllm:time_to_first_token_seconds``        histogram  arrival to first token (simulated time)
``vllm:e2e_request_latency_seconds``        histogram  arrival to last token (simulated time)
``vllm:request_queue_time_seconds``         histogram  time spent waiting for a batch slot
==========================================  =========  ======================================================

Names and types are those of a real vLLM v0.26.0 (``shared/fixtures/vllm_metric_families_v0.26.0.txt``,
checked by the unit tests); the deprecated ``vllm:gpu_cache_usage_perc`` and ``vllm:gpu_prefix_cache_*`` are
not exported. ``vllm:cache_config_info`` carries, as vLLM's does, its cache config as labels (vLLM puts every
``CacheConfig`` field there; these are the ones the simulator has) and no ``model_name``.

The simulator's own counters (``gpusim:`` prefix) let tests prove what reached a backend:
``gpusim:requests_received_total`` counts every POST to an inference route (chat, completions, embeddings),
valid or not; ``gpusim:requests_refused_total{reason}`` the ones answered with an error;
``gpusim:requests_aborted_total`` the ones whose client went away; ``gpusim:gpu_busy_seconds_total`` the
time a step was running (utilization = its rate); ``gpusim:slowdown_factor`` the current throttle factor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from simulation.gpusim.engine import GPU_MEMORY_UTILIZATION, EngineStats

#: Buckets of vLLM's TTFT histogram (seconds), as in vLLM's v1 Prometheus logger.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: Buckets of vLLM's request latency histograms (seconds), as in vLLM's v1 Prometheus logger.
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

#: Prometheus exposition content type (text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, kw_only=True)
class CacheConfigInfo:
    """The KV-cache config ``vllm:cache_config_info`` shows: tokens per block, the GPU's blocks, whether
    prefix caching is on."""

    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool

    def labels(self) -> dict[str, str]:
        """The gauge's labels, valued as vLLM writes them (``str()`` of each field; booleans ``True``)."""
        return {
            "block_size": str(self.block_size),
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(GPU_MEMORY_UTILIZATION),
            "num_gpu_blocks": str(self.num_gpu_blocks),
        }


class _CacheConfigCollector(Collector):
    """``vllm:cache_config_info``: an info gauge of value 1."""

    def __init__(self, info: CacheConfigInfo) -> None:
        self._labels = info.labels()

    def collect(self) -> Iterable[Metric]:
        metric = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(self._labels)
        )
        metric.add_metric(list(self._labels.values()), 1.0)
        yield metric


class _EngineCollector(Collector):
    """Reads the engine's state at scrape time, so gauges and token counters are never stale."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model = model_name
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        labels = ["model_name"]
        values = [self._model]
        families: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]] = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
             s.running_requests),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             s.waiting_requests),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             s.kv_usage),
            (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             s.num_preemptions_total),
            (CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
             s.prompt_tokens_total),
            (CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
             s.generation_tokens_total),
            (CounterMetricFamily, "vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries_total),
            (CounterMetricFamily, "vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits_total),
            (CounterMetricFamily, "gpusim:gpu_busy_seconds", "Seconds the simulated GPU spent running steps.",
             s.busy_seconds_total),
            (GaugeMetricFamily, "gpusim:slowdown_factor", "Slowdown of the simulated GPU (1 = normal).",
             s.slowdown),
        ]  # fmt: skip
        for family, name, doc, value in families:
            metric = family(name, doc, labels=labels)
            metric.add_metric(values, value)
            yield metric


class EndpointMetrics:
    """The metrics of one simulated endpoint, in their own :class:`CollectorRegistry` (several endpoints
    share a process, and each ``/metrics`` must show only its own).

    Args:
        model_name: the ``model_name`` label (the endpoint's model).
        stats: returns the engine's current :class:`EngineStats`; called at each scrape.
        cache_config: what ``vllm:cache_config_info`` shows; None: no such gauge.
    """

    def __init__(
        self,
        *,
        model_name: str,
        stats: Callable[[], EngineStats],
        cache_config: CacheConfigInfo | None = None,
    ) -> None:
        self.model_name = model_name
        # No auto_describe: it would call collect() (and read the engine) at registration.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(model_name, stats))
        if cache_config is not None:
            self.registry.register(_CacheConfigCollector(cache_config))
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            ["model_name", "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._queue = Histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._received = Counter(
            "gpusim:requests_received", "Inference requests received (valid or not).",
            ["model_name"], registry=self.registry,
        )  # fmt: skip
        self._refused = Counter(
            "gpusim:requests_refused", "Inference requests answered with an error, by reason.",
            ["model_name", "reason"], registry=self.registry,
        )  # fmt: skip
        self._aborted = Counter(
            "gpusim:requests_aborted", "Inference requests whose client went away before the end.",
            ["model_name"], registry=self.registry,
        )  # fmt: skip
        # Create the label sets up front so every series shows (at 0) from the first scrape.
        for reason in ("length", "stop"):  # generation stops at max_tokens; embeddings stop after prefill
            self._success.labels(model_name, reason)
        self._received.labels(model_name)
        self._aborted.labels(model_name)
        for h in (self._ttft, self._e2e, self._queue):
            h.labels(model_name)

    def request_received(self) -> None:
        """A POST reached an inference route."""
        self._received.labels(self.model_name).inc()

    def request_refused(self, reason: str) -> None:
        """An inference request got an error (``reason``: bad_request, model_not_found, queue_full,
        gpu_failed)."""
        self._refused.labels(self.model_name, reason).inc()

    def request_aborted(self) -> None:
        """The client of a running or queued request went away."""
        self._aborted.labels(self.model_name).inc()

    def request_finished(
        self, *, queue_s: float, ttft_s: float, e2e_s: float, finished_reason: str = "length"
    ) -> None:
        """A request completed; durations in seconds of simulated time from its arrival (an embedding's
        time to first token is its prefill end, the same as its end to end latency)."""
        self._success.labels(self.model_name, finished_reason).inc()
        self._queue.labels(self.model_name).observe(queue_s)
        self._ttft.labels(self.model_name).observe(ttft_s)
        self._e2e.labels(self.model_name).observe(e2e_s)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
