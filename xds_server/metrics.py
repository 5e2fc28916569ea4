"""Prometheus metrics of the xDS server, served at ``/metrics`` by :mod:`xds_server.http_api`.

One :class:`XdsMetrics` per server, on its own ``CollectorRegistry`` (so several servers in one process,
as in tests, do not share series). Gauges and counters are read from the server's state at scrape time
(nothing to keep in step); push latency is a histogram observed as pushes are written.

Series (``mode`` is ``sotw`` or ``delta``; ``type`` the short xDS type name, e.g. ``Cluster``):

- ``inferlb_xds_streams{mode}``: open ADS streams; ``inferlb_xds_subscriptions{mode,type}``: open streams
  subscribed to a type.
- ``inferlb_xds_responses_total{mode,type}``: responses written (pushes and answers to requests).
- ``inferlb_xds_push_latency_seconds{mode}``: from the first change of a coalesced burst to a push
  response written on a stream.
- ``inferlb_xds_nacks_total{mode,type}``; ``inferlb_xds_acks_total``; ``inferlb_xds_stale_nonces_total``.
- ``inferlb_xds_snapshot_serial{type}``: the ``<n>`` of the type's current version ``<instance>-<n>``;
  ``inferlb_xds_snapshots_published_total``; ``inferlb_xds_config_reload_errors_total``;
  ``inferlb_xds_publish_errors_total``; ``inferlb_xds_fleet_endpoints{state}``;
  ``inferlb_xds_oversized_responses_total``; ``inferlb_xds_snapshot_groups``.

The server is known by what is read from it (:class:`MetricsSource`, :class:`HasMetrics`), not by its class:
:class:`xds_server.server.XdsServer` imports this module, not the other way round.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferlb.config.schema import Config
from xds_server.ads import MODES, AggregatedDiscoveryServicer
from xds_server.cache import SnapshotCache
from xds_server.fleet_state import FleetState
from xds_server.resources.common import PUSH_ORDER

#: Push latency buckets (s): coalescing adds up to ``push_debounce_ms`` (100 ms by default), so the
#: interesting range is 10 ms .. a few s.
PUSH_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0)


class MetricsSource(Protocol):
    """What the metrics read from the server at scrape time (:class:`xds_server.server.XdsServer` is one):
    its ADS servicer (``stats``, ``clients``), snapshot cache (``groups()``, ``snapshot()``), the served
    config and fleet changes, and its error counts."""

    @property
    def servicer(self) -> AggregatedDiscoveryServicer: ...
    @property
    def cache(self) -> SnapshotCache: ...
    @property
    def effective(self) -> Config | None: ...
    @property
    def fleet(self) -> FleetState: ...
    @property
    def reload_errors(self) -> int: ...
    @property
    def publish_errors(self) -> int: ...


class HasMetrics(Protocol):
    """A server with its :class:`XdsMetrics` (what :func:`render_metrics` renders)."""

    @property
    def metrics(self) -> XdsMetrics: ...


def _short(type_url: str) -> str:
    return type_url.rsplit(".", 1)[-1]


class _StateCollector(Collector):
    def __init__(self, server: MetricsSource) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        srv = self._server
        stats = srv.servicer.stats
        streams = GaugeMetricFamily("inferlb_xds_streams", "Open ADS streams", labels=["mode"])
        subs = GaugeMetricFamily(
            "inferlb_xds_subscriptions", "Open ADS streams subscribed to a type", labels=["mode", "type"]
        )
        for mode in MODES:
            clients = [c for c in srv.servicer.clients.values() if c.mode == mode]
            streams.add_metric([mode], len(clients))
            for t in PUSH_ORDER:
                subs.add_metric([mode, _short(t)], sum(1 for c in clients if t in c.state.types))
        yield streams
        yield subs
        responses = CounterMetricFamily(
            "inferlb_xds_responses", "xDS responses written", labels=["mode", "type"]
        )
        nacks = CounterMetricFamily(
            "inferlb_xds_nacks", "NACKs received (error_detail set)", labels=["mode", "type"]
        )
        for mode in MODES:
            for t in PUSH_ORDER:
                responses.add_metric([mode, _short(t)], stats.pushes[(mode, t)])
                nacks.add_metric([mode, _short(t)], stats.nacks_by[(mode, t)])
        yield responses
        yield nacks
        yield CounterMetricFamily("inferlb_xds_acks", "ACKs received", value=stats.acks)
        yield CounterMetricFamily(
            "inferlb_xds_oversized_responses",
            "Responses over gRPC's 4 MiB default message size",
            value=stats.oversized_responses,
        )
        yield GaugeMetricFamily(
            "inferlb_xds_snapshot_groups", "Node groups with a snapshot", value=len(srv.cache.groups())
        )
        yield CounterMetricFamily(
            "inferlb_xds_stale_nonces", "Requests with a stale nonce", value=stats.stale_nonces
        )
        serial = GaugeMetricFamily(
            "inferlb_xds_snapshot_serial", "Publish number of each type's current version", labels=["type"]
        )
        snapshot = srv.cache.snapshot()
        if snapshot is not None:
            for t in PUSH_ORDER:
                serial.add_metric([_short(t)], float(snapshot.version(t).rsplit("-", 1)[-1]))
        yield serial
        published = snapshot.serial if snapshot is not None else 0
        yield CounterMetricFamily("inferlb_xds_snapshots_published", "Snapshots published", value=published)
        yield CounterMetricFamily(
            "inferlb_xds_config_reload_errors", "Config file changes refused", value=srv.reload_errors
        )
        yield CounterMetricFamily(
            "inferlb_xds_publish_errors", "Snapshots refused at publish", value=srv.publish_errors
        )
        fleet = GaugeMetricFamily(
            "inferlb_xds_fleet_endpoints", "Endpoints served, by state", labels=["state"]
        )
        total = len(srv.effective.endpoints) if srv.effective is not None else 0
        fleet.add_metric(["draining"], len(srv.fleet.draining))
        fleet.add_metric(["registered"], len(srv.fleet.registered))
        fleet.add_metric(["total"], total)
        yield fleet


class XdsMetrics:
    """The metrics of one server.

    Args:
        server: what the gauges and counters are read from at scrape time.

    Attributes:
        registry: the ``CollectorRegistry`` ``/metrics`` renders.
        push_latency: the ``inferlb_xds_push_latency_seconds{mode}`` histogram.
    """

    def __init__(self, server: MetricsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.push_latency = Histogram(
            "inferlb_xds_push_latency_seconds",
            "From the first change of a coalesced burst to a push written on a stream",
            labelnames=["mode"],
            buckets=PUSH_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(server))

    def observe_push(self, mode: str, seconds: float) -> None:
        """Record one push response written ``seconds`` after its first change."""
        self.push_latency.labels(mode=mode).observe(max(0.0, seconds))


def render_metrics(server: HasMetrics) -> tuple[bytes, str]:
    """The Prometheus text exposition of ``server``'s metrics and its content type."""
    return generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST
