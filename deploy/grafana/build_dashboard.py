"""Write deploy/grafana/inferlb.json, the Grafana dashboard of the local stack's Prometheus metrics.

Run ``python deploy/grafana/build_dashboard.py`` after changing a panel and commit the JSON. Every query
uses only metrics the stack exports (deploy/prometheus/prometheus.yml scrapes them): gpusim's vLLM names
(``simulation/gpusim/vllm_metrics.py``; the ``endpoint`` label is the scrape config's), the xDS server's
``inferlb_telemetry_weight`` and ``inferlb_xds_*`` (``xds_server/``), the request path's
``inferlb_quota_rejections_total`` (``ext_proc/metrics.py``) and Envoy's ``envoy_cluster_upstream_rq_total``.
gpusim has no inter-token histogram, so the latency panel shows TTFT and end-to-end latency.
tests/e2e/test_prometheus_dashboard.py checks every query returns data from a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("inferlb.json")

#: (title, panel type, unit, [(PromQL, legend)]) of each panel, in dashboard order.
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Per-GPU load (requests running)", "heatmap", "short", [
        ("sum by (endpoint) (vllm:num_requests_running)", "{{endpoint}}"),
    ]),
    ("Weight share per endpoint (inferlb, weights.mode: telemetry)", "timeseries", "percentunit", [
        ("inferlb_telemetry_weight / on (cluster) group_left sum by (cluster) (inferlb_telemetry_weight)",
         "{{cluster}} {{endpoint}}"),
    ]),
    ("Request share per endpoint (served)", "timeseries", "percentunit", [
        ("sum by (endpoint) (rate(vllm:request_success_total[1m]))"
         " / ignoring (endpoint) group_left sum (rate(vllm:request_success_total[1m]))", "{{endpoint}}"),
    ]),
    ("Envoy upstream requests per cluster", "timeseries", "reqps", [
        ("sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_total[1m]))", "{{envoy_cluster_name}}"),
    ]),
    ("Time to first token p50 / p95", "timeseries", "s", [
        ("histogram_quantile(0.5, sum by (le, endpoint) (rate(vllm:time_to_first_token_seconds_bucket[1m])))",
         "p50 {{endpoint}}"),
        ("histogram_quantile(0.95, sum by (le, endpoint)"
         " (rate(vllm:time_to_first_token_seconds_bucket[1m])))",
         "p95 {{endpoint}}"),
    ]),
    ("End-to-end request latency p95", "timeseries", "s", [
        ("histogram_quantile(0.95, sum by (le, endpoint)"
         " (rate(vllm:e2e_request_latency_seconds_bucket[1m])))",
         "{{endpoint}}"),
    ]),
    ("Queueing: requests waiting", "timeseries", "short", [
        ("sum by (endpoint) (vllm:num_requests_waiting)", "{{endpoint}}"),
    ]),
    ("Queue time p95", "timeseries", "s", [
        ("histogram_quantile(0.95, sum by (le, endpoint)"
         " (rate(vllm:request_queue_time_seconds_bucket[1m])))",
         "{{endpoint}}"),
    ]),
    ("Quota rejections by tenant", "timeseries", "short", [
        ("sum by (tenant, limit) (increase(inferlb_quota_rejections_total[5m]))", "{{tenant}} {{limit}}"),
    ]),
    ("xDS pushes and NACKs", "timeseries", "short", [
        ("sum by (type) (increase(inferlb_xds_responses_total[5m]))", "push {{type}}"),
        ("sum by (type) (increase(inferlb_xds_nacks_total[5m]))", "NACK {{type}}"),
    ]),
]  # fmt: skip


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model: two panels a row, 12 x 8 grid units each, on a
    ``DS_PROMETHEUS`` data-source variable."""
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panels = []
    for i, (title, kind, unit, queries) in enumerate(PANELS):
        panel: dict[str, Any] = {
            "id": i + 1,
            "title": title,
            "type": kind,
            "datasource": ds,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [
                {"refId": chr(ord("A") + j), "datasource": ds, "expr": expr, "legendFormat": legend}
                for j, (expr, legend) in enumerate(queries)
            ],
        }
        if kind == "heatmap":
            panel["options"] = {"calculate": False, "yAxis": {"axisPlacement": "left"}}
        panels.append(panel)
    return {
        "title": "inferlb",
        "uid": "inferlb",
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {"name": "DS_PROMETHEUS", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n", encoding="utf-8")
