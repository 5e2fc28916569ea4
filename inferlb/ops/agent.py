"""``inferlb agent``: one per GPU node. Reads NVML (nvidia-ml-py, ``import pynvml``), exposes the values as
Prometheus metrics and reports them to the control plane.

Every period (``telemetry.agent_interval_ms``, 1 s) the agent reads each GPU through the NVML seam
(:mod:`inferlb.adapters.nvml`: utilization, memory, temperature, throttle reasons, power, SM clocks); a GPU
whose read fails is left out of that report and counted in ``inferlb_agent_nvml_errors_total``.

**Report.** ``POST {url}/v1/telemetry/gpu`` with the JSON body of
:class:`inferlb.policy.telemetry.GpuReport`::

    {"node": "gpu-node-7", "sent_at": 1767000000.0,
     "gpus": [{"index": 0, "uuid": "GPU-...", "name": "NVIDIA H100 80GB HBM3", "utilization_percent": 97.0,
               "memory_used_bytes": ..., "memory_total_bytes": ..., "temperature_c": 64.0,
               "throttle_reasons": 0, "thermal_throttled": false, "power_throttled": false,
               "sm_clock_mhz": 1980.0, "max_sm_clock_mhz": 1980.0, "clock_ratio": 1.0, "power_w": 512.3}]}

A failed POST (refused, timed out, non-2xx) is logged and counted (``inferlb_agent_reports_total{outcome=
"error"}``); the next period tries again with fresh values (no backlog: old telemetry is worthless).

**Metrics.** ``GET /metrics`` on ``--listen`` serves the last reading under DCGM exporter names
(``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED``/``_FREE`` in MiB, ``DCGM_FI_DEV_GPU_TEMP``,
``DCGM_FI_DEV_POWER_USAGE``, ``DCGM_FI_DEV_SM_CLOCK``, ``DCGM_FI_DEV_MAX_SM_CLOCK``,
``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS``, labels ``gpu``, ``UUID``, ``modelName``, ``Hostname``), so dashboards
and :func:`inferlb.policy.telemetry.parse_dcgm_metrics` read an agent and a dcgm-exporter alike.

**No GPU.** :func:`inferlb.adapters.nvml.open_nvml` raises :class:`~inferlb.adapters.nvml.NoGpuError` with the
reason; the CLI prints it and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferlb.adapters.nvml import Pynvml, close_nvml, read_all
from inferlb.policy.telemetry import MIB, GpuReport, GpuTelemetry

log = logging.getLogger("inferlb.ops.agent")

#: Path the control plane receives GPU reports on (``POST``, JSON :class:`GpuReport`).
REPORT_PATH = "/v1/telemetry/gpu"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _GpuCollector(Collector):
    """Serves the last reading under DCGM exporter names (see the module doc)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.gpus: list[GpuTelemetry] = []

    def collect(self) -> Iterable[Metric]:
        labels = ["gpu", "UUID", "modelName", "Hostname"]
        fields: list[tuple[str, str, Any]] = [
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda g: g.utilization_percent),
            ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda g: g.memory_used_bytes / MIB),
            (
                "DCGM_FI_DEV_FB_FREE",
                "Framebuffer memory free (in MiB).",
                lambda g: (g.memory_total_bytes - g.memory_used_bytes) / MIB,
            ),
            ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda g: g.temperature_c),
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda g: g.power_w),
            ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", lambda g: g.sm_clock_mhz),
            (
                "DCGM_FI_DEV_MAX_SM_CLOCK",
                "Maximum SM clock frequency (in MHz).",
                lambda g: g.max_sm_clock_mhz,
            ),
            (
                "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                "Current clock throttle reasons (NVML bit mask).",
                lambda g: g.throttle_reasons,
            ),
        ]
        for name, doc, get in fields:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for g in self.gpus:
                value = get(g)
                if value is not None:
                    family.add_metric([str(g.index), g.uuid, g.name, self.node], float(value))
            yield family


class AgentMetrics:
    """The agent's Prometheus registry: the GPUs (DCGM names) and the agent's own counters."""

    def __init__(self, node: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._gpus = _GpuCollector(node)
        self.registry.register(self._gpus)
        self.reports = Counter(
            "inferlb_agent_reports", "GPU reports POSTed to the control plane, by outcome.", ["outcome"],
            registry=self.registry,
        )  # fmt: skip
        self.nvml_errors = Counter(
            "inferlb_agent_nvml_errors", "GPU reads that failed in NVML.", registry=self.registry
        )
        for outcome in ("ok", "error"):
            self.reports.labels(outcome)

    def update(self, gpus: list[GpuTelemetry]) -> None:
        """Serve ``gpus`` from now on."""
        self._gpus.gpus = gpus

    def exposition(self) -> bytes:
        """Prometheus text format."""
        return generate_latest(self.registry)


async def post_report(
    session: aiohttp.ClientSession,
    url: str,
    report: GpuReport,
    *,
    timeout_s: float,
    token: str | None = None,
) -> str | None:
    """``POST {url}/v1/telemetry/gpu`` with the report, as ``Authorization: Bearer <token>`` when a token is
    given (the xDS server's intake takes the fleet API token); returns None on a 2xx answer, else why it
    failed."""
    target = url.rstrip("/") + REPORT_PATH
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with session.post(
            target, json=report.to_json(), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if 200 <= resp.status < 300:
                return None
            body = (await resp.text())[:200]
            return f"{target} answered {resp.status}: {body}"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"{target}: {type(exc).__name__}: {exc}"


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """How the agent runs.

    Attributes:
        node: node name in reports and the ``Hostname`` label (default: the host name).
        url: control-plane base URL to POST reports to; None = metrics only.
        metrics_host / metrics_port: where ``/metrics`` listens (port 0: a free one); None = no listener.
        interval_s: seconds between readings.
        post_timeout_s: timeout of one POST (s).
        token: bearer token for the control plane's intake (the xDS fleet API token), or None.
    """

    node: str
    url: str | None
    token: str | None = None
    metrics_host: str | None = "127.0.0.1"
    metrics_port: int = 9402
    interval_s: float = 1.0
    post_timeout_s: float = 2.0


def default_node_name() -> str:
    """The host name (what the agent reports as ``node`` unless told otherwise)."""
    return socket.gethostname()


class Agent:
    """The agent's loop over an open NVML (see :func:`open_nvml`), its ``/metrics`` listener and its POSTs.

    Args:
        nvml: the pynvml seam, already initialised.
        gpu_count: from :func:`open_nvml`.
        settings: see :class:`AgentSettings`.
    """

    def __init__(self, nvml: Pynvml, gpu_count: int, settings: AgentSettings) -> None:
        self.nvml = nvml
        self.gpu_count = gpu_count
        self.settings = settings
        self.metrics = AgentMetrics(settings.node)
        self.last_report: GpuReport | None = None
        self._runner: web.AppRunner | None = None

    def read(self) -> GpuReport:
        """Read every GPU now, update ``/metrics``, and return the report."""
        gpus, failed = read_all(self.nvml, self.gpu_count)
        for f in failed:
            self.metrics.nvml_errors.inc()
            log.warning("GPU %d: NVML read failed: %s", f.index, f.reason)
        self.metrics.update(gpus)
        report = GpuReport(node=self.settings.node, gpus=tuple(gpus), sent_at=time.time())
        self.last_report = report
        return report

    async def start_metrics(self) -> tuple[str, int] | None:
        """Listen for ``GET /metrics``; returns the bound address, or None when disabled.

        Raises:
            OSError: the address cannot be bound.
        """
        if self.settings.metrics_host is None:
            return None
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.metrics_host, self.settings.metrics_port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        return str(host), int(port)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def run(self, stop: asyncio.Event, *, iterations: int | None = None) -> None:
        """Read and report every ``interval_s`` until ``stop`` is set (or ``iterations`` readings)."""
        done = 0
        async with aiohttp.ClientSession() as session:
            while not stop.is_set() and (iterations is None or done < iterations):
                report = self.read()
                if self.settings.url is not None:
                    failure = await post_report(
                        session,
                        self.settings.url,
                        report,
                        timeout_s=self.settings.post_timeout_s,
                        token=self.settings.token,
                    )
                    self.metrics.reports.labels("ok" if failure is None else "error").inc()
                    if failure is not None:
                        log.warning("report not delivered: %s", failure)
                done += 1
                if iterations is not None and done >= iterations:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.settings.interval_s)

    async def close(self) -> None:
        """Stop ``/metrics`` and shut NVML down. Safe to call twice."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        close_nvml(self.nvml)
