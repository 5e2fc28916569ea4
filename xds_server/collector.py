"""Telemetry into endpoint weights: the xDS server's control loop.

Three inputs, kept per endpoint with the (monotonic) time each arrived:

* **Model-server metrics**: every ``telemetry.scrape_interval_ms`` the server ``GET``\\ s each endpoint's
  ``/metrics`` (timeout ``telemetry.scrape_timeout_ms``), parsed with
  :func:`inferlb.policy.telemetry.parse_server_metrics` (vLLM, SGLang, TGI, TRT-LLM names). The generation
  rate is the ``generation_tokens_total`` counter's rate between two scrapes
  (:func:`inferlb.policy.telemetry.counter_rate`). A failed scrape (refused, timed out, 5xx, not Prometheus
  text) is counted in ``inferlb_telemetry_scrape_failures_total{source="metrics"}`` and never stops the loop;
  the last good sample simply ages.
* **GPU telemetry** from ``inferlb agent`` on each GPU node: ``POST /v1/telemetry/gpu`` with the agent's
  :class:`~inferlb.policy.telemetry.GpuReport` (``{node, sent_at, gpus}``). The route sits on the xDS server's
  HTTP API and is **authenticated like the fleet API** (``Authorization: Bearer <xds.api_token or
  INFERLB_XDS_API_TOKEN>``), so one secret guards everything that can move traffic. A GPU belongs to the
  endpoint whose ``gpu_uuid`` equals its NVML UUID; else to the endpoint whose ``gpu_node`` (default: the
  endpoint address's host) is the report's ``node`` and whose ``gpu_index`` (default 0) is the GPU's index
  (:func:`gpu_match_keys`). UUIDs survive ``CUDA_VISIBLE_DEVICES`` renumbering; node+index needs no
  inventory. Ages count from when the report arrived (the agent's clock may be skewed).
* **Simulated GPUs** (``simulated: true`` endpoints): the server polls gpusim's ``GET /sim/telemetry`` (the
  same NVML-shaped JSON) in the same loop and with the same timeout as ``/metrics``, as if an agent had
  posted it. Polling was chosen over gpusim posting to the intake: gpusim then needs neither the control
  plane's address nor its token, and stays a plain model server.

Every loop period, each endpoint's weight is advanced with :func:`inferlb.policy.weights.step` (EWMA,
hysteresis, slow start, stale fallback; the formula is documented there), with the per-cluster fleet median
decode rate as the throughput reference (:func:`inferlb.policy.weights.fleet_reference_rate`). **All endpoints
of the fleet are on one scale** (``weights.scale``, 100 per unit of capacity): an endpoint without fresh
telemetry steps to its profile weight (``scale * relative_capacity``), never to the static capacity weight (10
per unit) and never to 0. With ``weights.mode: telemetry`` the weights go to
:meth:`~xds_server.server.XdsServer.set_telemetry_weights` (a fleet API pin still wins) and the push
coalescer sends them; with ``static`` they are computed and shown (``GET /v1/weights``) but not pushed.

Slow start: endpoints present when the loop first runs start ramped (a restart of the control plane must
not cut the whole fleet to 10%); one added later ramps over ``weights.slow_start_ms``, except in a cluster
with Envoy's ``slow_start_window_ms``, where Envoy's ramp applies and ours is off (never both).

Routes added to the HTTP API (JSON; ``/v1`` behind the bearer token):

* ``POST /v1/telemetry/gpu``: 202 ``{"matched": {uuid: endpoint key}, "unmatched": [uuid...]}``; 400 with
  the bad field as ``param`` (``gpus[1].uuid``).
* ``GET /v1/weights``: per endpoint the weight, where it comes from (``pin``, ``telemetry``, ``capacity``),
  the inputs behind it and the factors of :func:`inferlb.policy.weights.target_weight` (``inferlb status``
  shows them), and for a length-aware model the length classes served (``length_classes``), the live and the
  profile ones, and the held performance factor behind them.

**Live length classes** (length-aware models, ``weights.mode: telemetry``): each period every endpoint's
performance factor (:func:`inferlb.policy.length_aware.class_set_performance`: the weight model's
clock-throttle factor; not its queue or KV factors, nor the noisy measured speed ratio) is held with
:func:`inferlb.policy.length_aware.hold_performance` (EWMA with the weights' ``smoothing_tau_ms``, the
weights' hysteresis, stale = 1.0), and each cluster's confined classes are
re-derived with :func:`inferlb.policy.length_aware.live_class_sets`: a class keeps the capacity its GPU
classes give it, so a throttled H100 brings the next fastest GPU into the longest class. The endpoints whose
classes then differ from their profile's go to :meth:`~xds_server.server.XdsServer.set_telemetry_weights` with
the weights and out as EDS endpoint metadata through the same coalesced push; Envoy rebuilds a cluster's
subsets when an endpoint's metadata changes. With ``static`` weights the profile's classes stay.

**Endpoint picking** (models with ``endpoint_picking``): their endpoints are scraped whatever
``weights.mode`` (the picker scores queue and KV usage), and each is also probed on its model's
``cluster.health_check.path`` every period, with the health check's timeout and thresholds (out after
``unhealthy_threshold`` failed probes in a row, back after ``healthy_threshold`` passes, as Envoy's own
active check; a model without health checks is never probed). ``GET /v1/picking`` (behind the token)
serves what the request-path processes pick from (:meth:`TelemetryCollector.picking_json`, read by
:mod:`ext_proc.picking`): per picking cluster each endpoint's EDS address, served weight, health (not
draining, probe passing), waiting and running requests, KV-cache usage and the sample's age.

The server is known by what the collector needs of it (:class:`TelemetryTarget`), not by its class:
:mod:`xds_server.__main__` hands it the :class:`~xds_server.server.XdsServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import aiohttp
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from inferlb.config.schema import Config, EndpointConfig, HealthCheck, cluster_name
from inferlb.errors import RequestError
from inferlb.policy.capacity import capacity_weight, prefill_ratio
from inferlb.policy.length_aware import (
    ClassSetMember,
    PerformanceHold,
    allowed_classes,
    class_set_performance,
    confined_classes,
    hold_performance,
    live_endpoint_classes,
)
from inferlb.policy.telemetry import (
    GpuTelemetry,
    ServerMetrics,
    TelemetryParseError,
    counter_rate,
    parse_gpu_report,
    parse_server_metrics,
    weight_inputs,
)
from inferlb.policy.weights import (
    WeightBreakdown,
    WeightInputs,
    WeightParams,
    WeightState,
    fleet_reference_rate,
    profile_weight,
    step,
    target_weight,
)
from xds_server.fleet_state import FleetState
from xds_server.resources.endpoints import endpoint_key

log = logging.getLogger("xds_server.collector")

#: Batch bound assumed for a real model server that does not export one: vLLM's ``--max-num-seqs``
#: default (256). Simulated endpoints use ``simulation.max_batch``; TRT-LLM reports its own.
DEFAULT_MAX_BATCH = 256

GpuSource = Literal["agent", "sim"]


@dataclass(frozen=True, kw_only=True)
class ServerSample:
    """One good scrape of an endpoint's ``/metrics``: the parsed metrics, when it arrived (monotonic s) and
    the generation rate since the previous good scrape (tokens/s; None for the first, or after a restart)."""

    metrics: ServerMetrics
    at: float
    generation_tokens_per_s: float | None


@dataclass(frozen=True, kw_only=True)
class GpuSample:
    """One GPU reading matched to an endpoint: from an agent report or a simulated GPU's ``/sim/telemetry``,
    with its arrival time (monotonic s) and the node that reported it (the endpoint's host for ``sim``)."""

    gpu: GpuTelemetry
    at: float
    source: GpuSource
    node: str


@dataclass(frozen=True, kw_only=True)
class EndpointWeight:
    """The outcome of one control-loop step for one endpoint.

    Attributes:
        key: :func:`xds_server.resources.endpoints.endpoint_key`.
        cluster: its Envoy cluster.
        inputs: what the policy saw; breakdown: the target and its factors.
        weight: the weight the policy pushes (``weights.scale`` units, in ``[1, max_weight]``).
        held_performance: the performance factor the length classes are built from
            (:func:`inferlb.policy.length_aware.hold_performance`, (0, 1]; 1.0 healthy or stale).
        length_classes / profile_classes: for a length-aware model's endpoint, the confined length classes
            it may serve by the live rule (:func:`inferlb.policy.length_aware.live_class_sets`) and by its GPU
            profile alone; None for other models.
    """

    key: str
    cluster: str
    inputs: WeightInputs
    breakdown: WeightBreakdown
    weight: int
    held_performance: float = 1.0
    length_classes: tuple[str, ...] | None = None
    profile_classes: tuple[str, ...] | None = None


def gpu_match_keys(endpoint: EndpointConfig) -> tuple[str | None, tuple[str, int]]:
    """``(uuid or None, (node, index))`` an endpoint's GPU telemetry is matched by (see the module doc)."""
    node = endpoint.gpu_node or endpoint.address.host
    return endpoint.gpu_uuid, (node, endpoint.gpu_index if endpoint.gpu_index is not None else 0)


def match_gpus(
    endpoints: Iterable[EndpointConfig], node: str, gpus: Iterable[GpuTelemetry]
) -> tuple[dict[str, GpuTelemetry], list[str]]:
    """Match one node's reported GPUs to endpoints.

    Returns:
        ``({endpoint key: telemetry}, [uuids of GPUs no endpoint claims])``. A GPU may feed several
        endpoints (two model servers sharing one GPU); a UUID match wins over node+index for the endpoints
        that name a UUID.
    """
    by_uuid: dict[str, list[str]] = {}
    by_slot: dict[tuple[str, int], list[str]] = {}
    for e in endpoints:
        uuid, slot = gpu_match_keys(e)
        if uuid is not None:
            by_uuid.setdefault(uuid, []).append(endpoint_key(e))
        else:
            by_slot.setdefault(slot, []).append(endpoint_key(e))
    matched: dict[str, GpuTelemetry] = {}
    unmatched: list[str] = []
    for g in gpus:
        keys = by_uuid.get(g.uuid, []) + by_slot.get((node, g.index), [])
        if not keys:
            unmatched.append(g.uuid)
        for k in keys:
            matched[k] = g
    return matched, unmatched


def _params_for(config: Config, params: WeightParams) -> dict[str, WeightParams]:
    """Per model name: the policy parameters (slow start off where Envoy's ``slow_start_config`` is on)."""
    no_ramp = replace(params, slow_start_s=0.0)
    return {m.name: no_ramp if m.cluster.slow_start_window_ms else params for m in config.models}


class _Metrics(Collector):
    """``inferlb_telemetry_*`` series on the xDS server's registry (read at scrape time)."""

    def __init__(self, collector: TelemetryCollector) -> None:
        self._c = collector

    def collect(self) -> Iterator[Metric]:
        c = self._c
        scrapes = CounterMetricFamily(
            "inferlb_telemetry_scrapes",
            "Scrapes attempted, by source (metrics, sim_telemetry)",
            labels=["source"],
        )
        failures = CounterMetricFamily(
            "inferlb_telemetry_scrape_failures",
            "Scrapes that failed (refused, timeout, HTTP error, unparsable), by source and endpoint",
            labels=["source", "endpoint"],
        )
        for src, n in sorted(c.scrapes.items()):
            scrapes.add_metric([src], n)
        for (src, key), n in sorted(c.failures.items()):
            failures.add_metric([src, key], n)
        reports = CounterMetricFamily(
            "inferlb_telemetry_gpu_reports", "GPU telemetry reports received, by result", labels=["result"]
        )
        for result, n in sorted(c.reports.items()):
            reports.add_metric([result], n)
        weight = GaugeMetricFamily(
            "inferlb_telemetry_weight",
            "Weight the policy computed per endpoint",
            labels=["endpoint", "cluster"],
        )
        fresh = GaugeMetricFamily(
            "inferlb_telemetry_fresh", "1 when the endpoint's telemetry is fresh, else 0", labels=["endpoint"]
        )
        for w in c.last.values():
            weight.add_metric([w.key, w.cluster], w.weight)
            fresh.add_metric([w.key], 1.0 if w.breakdown.fresh else 0.0)
        yield from (scrapes, failures, reports, weight, fresh)


class MetricsRegistry(Protocol):
    """The server's metrics, as far as the collector adds to them: the registry its series go on."""

    @property
    def registry(self) -> CollectorRegistry: ...


class TelemetryTarget(Protocol):
    """What the collector needs of the server it feeds (:class:`xds_server.server.XdsServer` is one): the
    served config and resolved host names (what to scrape), the fleet API's weight pins and the weights and
    length classes pushed (for ``GET /v1/weights``), the metrics registry, and the entry point the weights
    go to."""

    @property
    def effective(self) -> Config | None: ...
    @property
    def resolved_hosts(self) -> Mapping[str, str]: ...
    @property
    def fleet(self) -> FleetState: ...
    @property
    def telemetry_weights(self) -> Mapping[str, int]: ...
    @property
    def telemetry_classes(self) -> Mapping[str, tuple[str, ...]]: ...
    @property
    def metrics(self) -> MetricsRegistry: ...
    def set_telemetry_weights(
        self, weights: Mapping[str, int], length_classes: Mapping[str, tuple[str, ...]] | None = None
    ) -> None: ...


class TelemetryCollector:
    """Scrapes, receives GPU reports, steps the weight policy and hands weights to a server
    (:class:`TelemetryTarget`: the :class:`~xds_server.server.XdsServer`).

    Usage (``xds_server.__main__`` does this)::

        collector = TelemetryCollector()
        server = XdsServer(path, api_routes=collector.routes())
        await server.start()
        await collector.start(server)
        ...
        await collector.stop()

    Args:
        clock: monotonic seconds (tests pass a fake one to drive :meth:`recompute`).

    Attributes:
        servers / gpus: the last good sample per endpoint key.
        states: the policy state per endpoint key; ``last``: the last step's outcome per key.
        scrapes / failures / reports: counters behind the ``inferlb_telemetry_*`` metrics.
        last_error: per ``(source, key)`` the last failure's reason.
        cycles: completed loop periods.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._server: TelemetryTarget | None = None
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._params_owner: Config | None = None
        self._params: dict[str, WeightParams] = {}
        self._base_params = WeightParams()
        self._seeded = False
        self.servers: dict[str, ServerSample] = {}
        self.gpus: dict[str, GpuSample] = {}
        self.states: dict[str, WeightState] = {}
        self.holds: dict[str, PerformanceHold] = {}
        self.last: dict[str, EndpointWeight] = {}
        self.scrapes: dict[str, int] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.reports: dict[str, int] = {}
        self.last_error: dict[tuple[str, str], str] = {}
        self.cycles = 0
        #: endpoint key -> its health probe's run (endpoint picking's models only)
        self.health: dict[str, HealthRun] = {}

    # -- lifecycle ----------------------------------------------------------------------------------------
    def routes(self) -> list[web.RouteDef]:
        """The HTTP API routes: ``POST /v1/telemetry/gpu`` and ``GET /v1/weights``."""
        return [
            web.post("/v1/telemetry/gpu", self._post_gpu_report),
            web.get("/v1/weights", self._get_weights),
            web.get("/v1/picking", self._get_picking),
        ]

    async def start(self, server: TelemetryTarget) -> None:
        """Attach to a started server, register the metrics and start the loop."""
        self._server = server
        server.metrics.registry.register(_Metrics(self))
        self._session = aiohttp.ClientSession()
        self._task = asyncio.create_task(self._loop(), name="xds-telemetry")

    async def stop(self) -> None:
        """Stop the loop and close the HTTP client."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _config(self) -> Config:
        srv = self._server
        assert srv is not None and srv.effective is not None, "start() the collector with a started server"
        return srv.effective

    async def _loop(self) -> None:
        while True:
            started = self._clock()
            cfg = self._config()
            try:
                # Static weights need no telemetry: scraping 10,000 endpoints every period on the xDS
                # server's event loop slowed its pushes ~30x (bench/xds_scale.py). The loop still ticks, so
                # a reload that switches to telemetry mode starts collecting within one period.
                if cfg.weights.mode == "telemetry":
                    await self.scrape_once()
                    self.recompute()
                elif picking_endpoints(cfg):
                    # the picker needs queue and KV usage of its models' endpoints even with static weights
                    await self.scrape_once(only_picking=True)
            except Exception:  # the loop must survive anything one cycle throws
                log.exception("telemetry cycle failed; retrying next period")
            self.cycles += 1
            period = cfg.telemetry.scrape_interval_ms / 1000
            await asyncio.sleep(max(0.0, period - (self._clock() - started)))

    # -- scraping -----------------------------------------------------------------------------------------
    def _base_url(self, e: EndpointConfig) -> str:
        assert self._server is not None
        host = self._server.resolved_hosts.get(e.address.host, e.address.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{e.address.port}"

    def _failed(self, source: str, key: str, reason: str) -> None:
        self.failures[(source, key)] = self.failures.get((source, key), 0) + 1
        if self.last_error.get((source, key)) != reason:
            log.warning("telemetry %s of %s failed: %s", source, key, reason)
        self.last_error[(source, key)] = reason

    async def _get(self, url: str, timeout_s: float) -> bytes:
        assert self._session is not None
        async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {body[:120].decode(errors='replace')}")
            return body

    async def _scrape_metrics(self, e: EndpointConfig, timeout_s: float) -> None:
        key = endpoint_key(e)
        self.scrapes["metrics"] = self.scrapes.get("metrics", 0) + 1
        try:
            body = await self._get(self._base_url(e) + "/metrics", timeout_s)
            metrics = parse_server_metrics(body.decode("utf-8", errors="replace"))
        except TimeoutError:
            self._failed("metrics", key, f"timeout after {timeout_s:g} s")
            return
        except (aiohttp.ClientError, OSError, RuntimeError, TelemetryParseError) as exc:
            self._failed("metrics", key, f"{type(exc).__name__}: {exc}")
            return
        now = self._clock()
        prev = self.servers.get(key)
        rate = None
        if prev is not None:
            rate = counter_rate(
                prev.metrics.generation_tokens_total, prev.at, metrics.generation_tokens_total, now
            )
        self.servers[key] = ServerSample(metrics=metrics, at=now, generation_tokens_per_s=rate)
        self.last_error.pop(("metrics", key), None)

    async def _scrape_sim_telemetry(self, e: EndpointConfig, timeout_s: float) -> None:
        key = endpoint_key(e)
        self.scrapes["sim_telemetry"] = self.scrapes.get("sim_telemetry", 0) + 1
        try:
            body = await self._get(self._base_url(e) + "/sim/telemetry", timeout_s)
            gpu = GpuTelemetry.from_json(json.loads(body))
        except TimeoutError:
            self._failed("sim_telemetry", key, f"timeout after {timeout_s:g} s")
            return
        except (aiohttp.ClientError, OSError, RuntimeError, TelemetryParseError, ValueError) as exc:
            self._failed("sim_telemetry", key, f"{type(exc).__name__}: {exc}")
            return
        self.gpus[key] = GpuSample(gpu=gpu, at=self._clock(), source="sim", node=e.address.host)
        self.last_error.pop(("sim_telemetry", key), None)

    async def scrape_once(self, *, only_picking: bool = False) -> None:
        """Scrape every endpoint's ``/metrics`` (and ``/sim/telemetry`` of simulated ones) concurrently,
        each bounded by ``telemetry.scrape_timeout_ms``, and probe the health of endpoint picking's
        endpoints (:meth:`_probe_health`). ``only_picking``: only endpoint picking's endpoints, ``/metrics``
        and the probe. Failures are counted, never raised."""
        cfg = self._config()
        timeout_s = cfg.telemetry.scrape_timeout_ms / 1000
        picking = picking_endpoints(cfg)
        scraped = [e for e in cfg.endpoints if endpoint_key(e) in picking] if only_picking else cfg.endpoints
        jobs = [self._scrape_metrics(e, timeout_s) for e in scraped]
        if not only_picking:
            jobs += [self._scrape_sim_telemetry(e, timeout_s) for e in cfg.endpoints if e.simulated]
        models = {m.name: m for m in cfg.models}
        for e in cfg.endpoints:
            hc = models[e.model].cluster.health_check
            if endpoint_key(e) in picking and hc is not None:
                jobs.append(self._probe_health(e, hc))
        await asyncio.gather(*jobs)
        for key in set(self.health) - picking:  # endpoints gone or no longer picked
            del self.health[key]

    async def _probe_health(self, e: EndpointConfig, hc: HealthCheck) -> None:
        """One health probe (``GET hc.path``, 200 passes, within ``hc.timeout_ms``) of an endpoint picking's
        endpoint, advancing its :class:`HealthRun` by ``hc``'s thresholds."""
        key = endpoint_key(e)
        self.scrapes["health"] = self.scrapes.get("health", 0) + 1
        try:
            await self._get(self._base_url(e) + hc.path, hc.timeout_ms / 1000)
            passed = True
        except TimeoutError:
            self._failed("health", key, f"timeout after {hc.timeout_ms} ms")
            passed = False
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:
            self._failed("health", key, f"{type(exc).__name__}: {exc}")
            passed = False
        if passed:
            self.last_error.pop(("health", key), None)
        run = self.health.get(key, HealthRun())
        self.health[key] = run.after(passed, healthy_threshold=hc.healthy_threshold,
                                     unhealthy_threshold=hc.unhealthy_threshold)  # fmt: skip

    # -- GPU reports --------------------------------------------------------------------------------------
    def accept_report(self, body: Any) -> tuple[dict[str, str], list[str]]:
        """Take one agent report (decoded JSON).

        Returns:
            ``({uuid: endpoint key}, [unmatched uuids])``.

        Raises:
            TelemetryParseError: a bad report (field named); nothing is stored.
        """
        report = parse_gpu_report(body)
        matched, unmatched = match_gpus(self._config().endpoints, report.node, report.gpus)
        now = self._clock()
        for key, gpu in matched.items():
            self.gpus[key] = GpuSample(gpu=gpu, at=now, source="agent", node=report.node)
        return {g.uuid: k for k, g in matched.items()}, unmatched

    async def _post_gpu_report(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self.reports["invalid"] = self.reports.get("invalid", 0) + 1
            err = RequestError(400, f"body is not JSON: {exc}", type="invalid_request_error")
            return web.json_response(err.to_openai_json(), status=400)
        try:
            matched, unmatched = self.accept_report(body)
        except TelemetryParseError as exc:
            self.reports["invalid"] = self.reports.get("invalid", 0) + 1
            err = RequestError(
                400, str(exc), type="invalid_request_error", code="invalid_report", param=exc.field or None
            )
            return web.json_response(err.to_openai_json(), status=400)
        self.reports["accepted"] = self.reports.get("accepted", 0) + 1
        return web.json_response({"matched": matched, "unmatched": unmatched}, status=202)

    # -- the policy ---------------------------------------------------------------------------------------
    def _policy(self, cfg: Config) -> tuple[WeightParams, dict[str, WeightParams]]:
        if self._params_owner is not cfg:
            self._base_params = WeightParams.from_config(cfg.weights)
            self._params = _params_for(cfg, self._base_params)
            self._params_owner = cfg
        return self._base_params, self._params

    def _max_batch(self, cfg: Config, e: EndpointConfig) -> int:
        return cfg.simulation.max_batch if e.simulated else DEFAULT_MAX_BATCH

    def compute(self, now: float) -> dict[str, EndpointWeight]:
        """Step every endpoint's weight to ``now`` (monotonic s) and return the outcomes by key.

        Endpoints no longer served are forgotten. Pure apart from updating :attr:`states` and :attr:`last`.
        """
        cfg = self._config()
        base, per_model = self._policy(cfg)
        stale = base.stale_after_s
        models = {m.name: m for m in cfg.models}
        cluster_of: dict[str, str] = {}
        for e in cfg.endpoints:
            cluster_of[endpoint_key(e)] = models[e.model].cluster_name(cfg.endpoint_version(e))
        # per-cluster reference decode rate (tokens/s per sequence per unit of capacity), fresh samples only
        samples: dict[str, list[tuple[float, float, int]]] = {}
        for e in cfg.endpoints:
            key = endpoint_key(e)
            s = self.servers.get(key)
            if s is None or now - s.at > stale:
                continue
            rate = s.generation_tokens_per_s or s.metrics.generation_tokens_per_s
            running = round(s.metrics.running_requests or 0)
            if rate is not None:
                cap = cfg.gpu_profiles[e.gpu].relative_capacity
                samples.setdefault(cluster_of[key], []).append((cap, rate, running))
        reference = {c: fleet_reference_rate(v) for c, v in samples.items()}
        out: dict[str, EndpointWeight] = {}
        for e in cfg.endpoints:
            key = endpoint_key(e)
            cluster = cluster_of[key]
            params = per_model.get(e.model, base)
            s = self.servers.get(key)
            g = self.gpus.get(key)
            inputs = weight_inputs(
                profile_capacity=cfg.gpu_profiles[e.gpu].relative_capacity,
                max_batch=self._max_batch(cfg, e),
                server=s.metrics if s else None,
                server_age_s=now - s.at if s else None,
                gpu=g.gpu if g else None,
                gpu_age_s=now - g.at if g else None,
                stale_after_s=stale,
                generation_tokens_per_s=s.generation_tokens_per_s if s else None,
                reference_tokens_per_s=reference.get(cluster),
            )
            state = self.states.get(key)
            if state is None and not self._seeded:
                # present at the first period: start ramped (a control-plane restart must not cut the fleet)
                state, _ = step(None, inputs, now - params.slow_start_s, params)
            state, weight = step(state, inputs, now, params)
            self.states[key] = state
            breakdown = target_weight(inputs, params)
            hold = hold_performance(
                self.holds.get(key),
                class_set_performance(breakdown),
                now,
                tau_s=params.smoothing_tau_s,
                hysteresis=params.hysteresis,
            )
            self.holds[key] = hold
            out[key] = EndpointWeight(
                key=key,
                cluster=cluster,
                inputs=inputs,
                breakdown=breakdown,
                weight=weight,
                held_performance=hold.held,
            )
        self._seeded = True
        self._classify(cfg, out)
        for gone in set(self.states) - set(out):
            del self.states[gone]
            self.holds.pop(gone, None)
        for gone in (set(self.servers) | set(self.gpus)) - set(out):
            self.servers.pop(gone, None)
            self.gpus.pop(gone, None)
        self.last = out
        return out

    def _classify(self, cfg: Config, out: dict[str, EndpointWeight]) -> None:
        """Fill in the live and profile length classes of every length-aware model's endpoint in ``out``,
        one cluster at a time (:func:`inferlb.policy.length_aware.live_endpoint_classes` over the held
        performance factors)."""
        models = {m.name: m for m in cfg.models}
        by_cluster: dict[str, list[EndpointConfig]] = {}
        for e in cfg.endpoints:
            if models[e.model].cluster.length_aware is not None:
                by_cluster.setdefault(out[endpoint_key(e)].cluster, []).append(e)
        for endpoints in by_cluster.values():
            policy = models[endpoints[0].model].cluster.length_aware
            assert policy is not None
            members = [
                ClassSetMember(
                    name=endpoint_key(e),
                    capacity=cfg.gpu_profiles[e.gpu].relative_capacity,
                    performance=out[endpoint_key(e)].held_performance,
                )
                for e in endpoints
            ]
            live = live_endpoint_classes(members, confined_classes(policy))
            for e in endpoints:
                key = endpoint_key(e)
                out[key] = replace(
                    out[key],
                    length_classes=live[key],
                    profile_classes=allowed_classes(cfg, e.gpu, policy),
                )

    def live_class_overrides(self) -> dict[str, tuple[str, ...]]:
        """``{endpoint key: live length classes}`` of the last :meth:`compute`, for the endpoints whose live
        classes differ from their profile's (what :meth:`recompute` hands the server)."""
        return {
            k: w.length_classes
            for k, w in self.last.items()
            if w.length_classes is not None and w.length_classes != w.profile_classes
        }

    def recompute(self) -> dict[str, int]:
        """One period: :meth:`compute` now and, with ``weights.mode: telemetry``, hand the weights to the
        server (it pushes only when they changed). Returns what was handed over (empty in static mode)."""
        srv = self._server
        assert srv is not None
        outcome = self.compute(self._clock())
        telemetry = self._config().weights.mode == "telemetry"
        weights = {k: w.weight for k, w in outcome.items()} if telemetry else {}
        # static mode keeps the profile's length classes, as it keeps the capacity weights
        srv.set_telemetry_weights(weights, self.live_class_overrides() if telemetry else {})
        return weights

    # -- GET /v1/weights ----------------------------------------------------------------------------------
    def weights_json(self) -> dict[str, Any]:
        """The body of ``GET /v1/weights`` (see :func:`inferlb.ops.status.weight_rows` for the fields)."""
        srv = self._server
        assert srv is not None
        cfg = self._config()
        now = self._clock()
        base, per_model = self._policy(cfg)
        rows = []
        for e in cfg.endpoints:
            key = endpoint_key(e)
            w = self.last.get(key)
            s = self.servers.get(key)
            g = self.gpus.get(key)
            pin = srv.fleet.weight_overrides.get(key)
            pushed = srv.telemetry_weights.get(key)
            if pin is not None:
                served, source = pin, "pin"
            elif pushed is not None:
                served, source = pushed, "telemetry"
            else:
                served, source = capacity_weight(cfg, e), "capacity"
            cap = cfg.gpu_profiles[e.gpu].relative_capacity
            row: dict[str, Any] = {
                "key": key,
                "name": e.display_name,
                "model": e.model,
                "cluster": w.cluster if w else None,
                "gpu": e.gpu,
                "served_weight": served,
                "weight_source": source,
                "policy_weight": w.weight if w else None,
                "profile_weight": profile_weight(cap, per_model.get(e.model, base)),
                "capacity_weight": capacity_weight(cfg, e),
                "length_classes": _served_classes(srv.telemetry_classes.get(key), w),
                "profile_classes": None
                if w is None or w.profile_classes is None
                else list(w.profile_classes),
                "live_classes": None if w is None or w.length_classes is None else list(w.length_classes),
                "held_performance": None if w is None else w.held_performance,
                "server_age_s": None if s is None else round(now - s.at, 3),
                "gpu_age_s": None if g is None else round(now - g.at, 3),
                "gpu_source": None if g is None else g.source,
                "scrape_failures": self.failures.get(("metrics", key), 0)
                + self.failures.get(("sim_telemetry", key), 0),
                "last_error": self.last_error.get(("metrics", key))
                or self.last_error.get(("sim_telemetry", key)),
            }
            if w is not None:
                i, b = w.inputs, w.breakdown
                row["inputs"] = {
                    "telemetry_age_s": i.telemetry_age_s,
                    "waiting_requests": i.waiting_requests,
                    "running_requests": i.running_requests,
                    "max_batch": i.max_batch,
                    "kv_cache_usage": i.kv_cache_usage,
                    "thermal_throttled": i.thermal_throttled,
                    "power_throttled": i.power_throttled,
                    "clock_ratio": i.clock_ratio,
                    "generation_tokens_per_s": i.generation_tokens_per_s,
                    "reference_tokens_per_s": i.reference_tokens_per_s,
                    "error_rate": i.error_rate,
                }
                row["factors"] = {
                    "fresh": b.fresh,
                    "speed_ratio": b.speed_ratio,
                    "throttle": b.throttle,
                    "performance": b.performance,
                    "load": b.load,
                    "kv": b.kv,
                    "errors": b.errors,
                    "target": b.target,
                }
            if g is not None:
                row["gpu_telemetry"] = {
                    "uuid": g.gpu.uuid,
                    "node": g.node,
                    "utilization_percent": g.gpu.utilization_percent,
                    "temperature_c": g.gpu.temperature_c,
                    "throttle_reasons": g.gpu.throttle_reasons,
                    "power_w": g.gpu.power_w,
                }
            rows.append(row)
        return {
            "mode": cfg.weights.mode,
            "scale": cfg.weights.scale,
            "stale_after_ms": cfg.weights.stale_after_ms,
            "scrape_interval_ms": cfg.telemetry.scrape_interval_ms,
            "cycles": self.cycles,
            "endpoints": rows,
        }

    async def _get_weights(self, _request: web.Request) -> web.Response:
        return web.json_response(self.weights_json())

    # -- GET /v1/picking ----------------------------------------------------------------------------------
    def served_weight(self, cfg: Config, e: EndpointConfig) -> int:
        """The ``load_balancing_weight`` the server sends for ``e``: a fleet API pin, else the pushed
        telemetry weight, else the capacity weight."""
        srv = self._server
        assert srv is not None
        key = endpoint_key(e)
        pin = srv.fleet.weight_overrides.get(key)
        if pin is not None:
            return pin
        return srv.telemetry_weights.get(key) or capacity_weight(cfg, e)

    def picking_json(self) -> dict[str, Any]:
        """The body of ``GET /v1/picking``: what the request path picks endpoints from.

        Shape: ``{"clusters": {cluster: [endpoint, ...]}, "stale_after_ms": weights.stale_after_ms}``, one
        entry per cluster of a model with ``endpoint_picking`` (an empty list when it has no endpoint), each
        endpoint ``{"address": "ip:port" as EDS sends it (IPv6 in brackets), "key", "name", "weight": the
        served weight, "prefill_weight": the served weight times the GPU profile's
        ``prefill_relative_capacity / relative_capacity`` (:func:`~inferlb.policy.capacity.prefill_ratio`;
        the weight when the profile gives no prefill capacity), "healthy": false while draining or failing
        its probe, "draining", "waiting", "running", "kv_usage": from the last good scrape (null before
        one), "telemetry_age_ms": that scrape's age (null before one), "kv_events": the endpoint's
        ``kv_events`` (``{"endpoint", "replay_endpoint", "topic"}``, null when it has none),
        "length_classes": for a length-aware model, the confined length classes it may serve (the live sets
        pushed, else its GPU profile's; null for other models)}``.
        """
        srv = self._server
        assert srv is not None
        cfg = self._config()
        now = self._clock()
        clusters: dict[str, list[dict[str, Any]]] = {
            m.cluster_name(v.name): [] for m in cfg.models if m.endpoint_picking.enabled for v in m.versions
        }
        for e in cfg.endpoints:
            cluster = cluster_name(e.model, cfg.endpoint_version(e))
            rows = clusters.get(cluster)
            if rows is None:
                continue
            key = endpoint_key(e)
            host = srv.resolved_hosts.get(e.address.host, e.address.host)
            address = f"[{host}]:{e.address.port}" if ":" in host else f"{host}:{e.address.port}"
            draining = key in srv.fleet.draining
            run = self.health.get(key)
            sample = self.servers.get(key)
            m = sample.metrics if sample is not None else None
            weight = self.served_weight(cfg, e)
            rows.append(
                {
                    "address": address,
                    "key": key,
                    "name": e.display_name,
                    "weight": weight,
                    "prefill_weight": weight * prefill_ratio(cfg, e),
                    "healthy": not draining and (run is None or run.healthy),
                    "draining": draining,
                    "waiting": None if m is None else m.waiting_requests,
                    "running": None if m is None else m.running_requests,
                    "kv_usage": None if m is None else m.kv_cache_usage,
                    "telemetry_age_ms": None if sample is None else round((now - sample.at) * 1000),
                    "kv_events": None if e.kv_events is None else e.kv_events.model_dump(),
                    "length_classes": _picking_classes(cfg, e, srv.telemetry_classes.get(key)),
                }
            )
        return {"clusters": clusters, "stale_after_ms": cfg.weights.stale_after_ms}

    async def _get_picking(self, _request: web.Request) -> web.Response:
        return web.json_response(self.picking_json())


@dataclass(frozen=True, kw_only=True)
class HealthRun:
    """An endpoint's health by its probes, as Envoy's active health check counts (Envoy docs, "Health
    checking"): ``healthy`` flips after ``unhealthy_threshold`` failures in a row, back after
    ``healthy_threshold`` passes in a row. A new endpoint starts healthy (as Envoy holds a host from EDS
    before its first check)."""

    healthy: bool = True
    passes: int = 0
    failures: int = 0

    def after(self, passed: bool, *, healthy_threshold: int, unhealthy_threshold: int) -> HealthRun:
        """The run after one more probe."""
        if passed:
            passes = self.passes + 1
            return HealthRun(healthy=self.healthy or passes >= healthy_threshold, passes=passes, failures=0)
        failures = self.failures + 1
        return HealthRun(healthy=self.healthy and failures < unhealthy_threshold, passes=0, failures=failures)


def picking_endpoints(cfg: Config) -> set[str]:
    """The keys of the endpoints of models with ``endpoint_picking`` on."""
    picking = {m.name for m in cfg.models if m.endpoint_picking.enabled}
    return {endpoint_key(e) for e in cfg.endpoints if e.model in picking} if picking else set()


def _picking_classes(cfg: Config, e: EndpointConfig, pushed: tuple[str, ...] | None) -> list[str] | None:
    """The confined length classes a picking model's endpoint may serve, as ``GET /v1/picking`` sends them:
    the pushed live ones (the same as its EDS ``envoy.lb`` metadata), else its GPU profile's; None when the
    model is not length-aware."""
    policy = next(m for m in cfg.models if m.name == e.model).cluster.length_aware
    if policy is None:
        return None
    return list(pushed) if pushed is not None else list(allowed_classes(cfg, e.gpu, policy))


def _served_classes(pushed: tuple[str, ...] | None, w: EndpointWeight | None) -> list[str] | None:
    """The length classes the server sends for an endpoint: the pushed live ones, else its profile's (None
    for a model that is not length-aware, or before the first step)."""
    if pushed is not None:
        return list(pushed)
    return None if w is None or w.profile_classes is None else list(w.profile_classes)
