"""Prometheus metrics of one simulated endpoint, under vLLM's metric names, in a registry of its own.

vLLM names (docs.vllm.ai "Production Metrics"; vLLM design doc ``docs/design/metrics.md``), each labelled
``model_name`` as vLLM does:

==========================================  =========  ======================================================
``vllm:num_requests_running``               gauge      requests in the running batch
``vllm:num_requests_waiting``               gauge      requests queued behind it
``vllm:kv_cache_usage_perc``                gauge      KV-cache usage 0..1 (an estimate, see
simulation.gpusim.engine) ``vllm:prompt_tokens_total``                counter    prompt tokens prefilled
``vllm:generation_tokens_total``            counter    tokens generated (all choices)
``vllm:request_success_total``              counter    requests finished, label ``finished_reason``
                                                       (``length`` for generation, ``stop`` for embeddings)
``vllm:time_to_first_token_seconds``        histogram  arrival to first token (simulated time)
``vllm:e2e_request_latency_seconds``        histogram  arrival to last token (simulated time)
``vllm:request_queue_time_seconds``         histogram  time spent waiting for a batch slot
==========================================  =========  ======================================================

The simulator's own counters (``gpusim:`` prefix) let tests prove what reached a backend:
``gpusim:requests_received_total`` counts every POST to an inference route (chat, completions, embeddings),
valid or not; ``gpusim:requests_refused_total{reason}`` the ones answered with an error;
``gpusim:requests_aborted_total`` the ones whose client went away; ``gpusim:gpu_busy_seconds_total`` the
time a step was running (utilization = its rate); ``gpusim:slowdown_factor`` the current throttle factor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from simulation.gpusim.engine import EngineStats

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
            (CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
             s.prompt_tokens_total),
            (CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
             s.generation_tokens_total),
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
    """

    def __init__(self, *, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        # No auto_describe: it would call collect() (and read the engine) at registration.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(model_name, stats))
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
