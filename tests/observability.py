"""The Prometheus scrape config of deploy/prometheus/prometheus.yml against a config's stack."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from inferlb.config.schema import Config

ROOT = Path(__file__).parents[1]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "inferlb.json"


def metrics_addresses(config: Config) -> dict[str, str]:
    """Where the stack of ``config`` (``inferlb up``) serves Prometheus metrics: role -> ``host:port``.

    Roles: ``envoy`` (``gateway.admin``, ``/stats/prometheus``), ``xds-server`` (``xds.api_listen``),
    ``request-path`` (``ext_proc.metrics_listen``) and each endpoint's name (its gpusim address)."""
    out = {"envoy": str(config.gateway.admin), "request-path": str(config.ext_proc.metrics_listen)}
    if config.xds.api_listen is not None:
        out["xds-server"] = str(config.xds.api_listen)
    out.update({e.name: str(e.address) for e in config.endpoints})
    return out


def scrape_targets(doc: dict[str, Any]) -> list[str]:
    """Every ``static_configs`` target of a Prometheus config document, in file order."""
    return [t for job in doc["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]


def rewritten_scrape_config(default: Config, stack: Config, interval_s: float) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with each target moved from ``default``'s address to the address
    of the same role in ``stack`` and scrapes every ``interval_s`` seconds.

    Raises:
        KeyError: a target is no metrics address of ``default``.
    """
    doc: dict[str, Any] = copy.deepcopy(yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8")))
    role = {addr: name for name, addr in metrics_addresses(default).items()}
    new = metrics_addresses(stack)
    doc["global"]["scrape_interval"] = doc["global"]["evaluation_interval"] = f"{interval_s}s"
    for job in doc["scrape_configs"]:
        for sc in job["static_configs"]:
            sc["targets"] = [new[role[t]] for t in sc["targets"]]
    return doc
