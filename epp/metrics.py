"""Prometheus metrics of the EPP (prometheus_client), in their own registry.

Label values are endpoint addresses of the pool (fixed at start-up), a fixed outcome vocabulary or a
fixed match vocabulary, so cardinality is bounded by the pool.

- ``inferlb_epp_requests_total{outcome}``: requests answered: ``routed``, or the status of an immediate
  response (``400``, ``413``, ``429``, ``503``, ``500``);
- ``inferlb_epp_picks_total{endpoint}``: requests whose first choice was ``endpoint``;
- ``inferlb_epp_served_total{endpoint, match}``: responses by the endpoint the gateway reported as having
  served them (``x-gateway-destination-endpoint-served``) and how that compares with the pick: ``first``
  (the first choice), ``fallback`` (a later host of the list), ``other`` (not in the list), or
  ``unreported`` (the gateway sent no such metadata); ``endpoint`` is the first choice when the reported
  one is not of the pool or none was reported;
- ``inferlb_epp_in_flight{endpoint}``: requests this EPP routed to ``endpoint`` that have not ended;
- ``inferlb_epp_scrape_errors_total{endpoint}``: failed scrapes of the endpoint's ``/metrics``;
- ``inferlb_epp_processing_seconds{phase}``: time to answer one ext_proc message;
- with a fair queue (:mod:`epp.flow`): ``inferlb_epp_queue_length{priority}`` (requests waiting now),
  ``inferlb_epp_queue_wait_seconds{outcome}`` (how long each waiter waited, by how it left: ``admitted``,
  ``expired``, ``cancelled`` when its stream ended, ``unavailable`` when no endpoint was eligible any
  more), ``inferlb_epp_queue_expired_total`` and ``inferlb_epp_queue_full_total`` (refused with the queue
  full). The priority label takes the priorities of waiting requests only, so it is bounded by the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Histogram buckets for one ext_proc message (s): 50 us to 1 s.
PROCESSING_BUCKETS: Final = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0)
#: Histogram buckets for a wait in the fair queue (s): 1 ms to 30 s.
QUEUE_WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EppMetrics:
    """The EPP's metric families over the pool's ``addresses``, registered in ``registry`` (a fresh one by
    default); ``in_flight`` reads the live counts when scraped."""

    def __init__(
        self,
        addresses: Sequence[str],
        in_flight: Callable[[], Mapping[str, int]],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inferlb_epp_requests", "Requests answered, by outcome", ("outcome",), registry=r
        )
        self.picks = Counter(
            "inferlb_epp_picks", "Requests by first-choice endpoint", ("endpoint",), registry=r
        )
        self.served = Counter(
            "inferlb_epp_served",
            "Responses by the endpoint reported as serving them, against the pick",
            ("endpoint", "match"),
            registry=r,
        )
        self.scrape_errors = Counter(
            "inferlb_epp_scrape_errors", "Failed scrapes of an endpoint's /metrics", ("endpoint",), registry=r
        )
        self.processing = Histogram(
            "inferlb_epp_processing_seconds",
            "Time to answer one ext_proc message",
            ("phase",),
            buckets=PROCESSING_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "inferlb_epp_queue_wait_seconds",
            "Time a request waited in the fair queue, by how it left",
            ("outcome",),
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.queue_expired = Counter(
            "inferlb_epp_queue_expired", "Requests refused after waiting the longest wait", registry=r
        )
        self.queue_full = Counter(
            "inferlb_epp_queue_full", "Requests refused at once with the fair queue full", registry=r
        )
        gauge = Gauge("inferlb_epp_in_flight", "Requests routed and not ended", ("endpoint",), registry=r)
        for address in addresses:
            gauge.labels(address).set_function(_reader(in_flight, address))


def _reader(counts: Callable[[], Mapping[str, int]], address: str) -> Callable[[], float]:
    return lambda: float(counts().get(address, 0))
