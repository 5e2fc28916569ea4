"""deploy/prometheus/prometheus.yml scrapes every component of the default stack, at its addresses."""

from __future__ import annotations

import importlib.util
import json

import yaml

from inferlb.config.schema import default_config_path, load_config
from tests.observability import DASHBOARD, SCRAPE_CONFIG, metrics_addresses, scrape_targets


def test_every_target_is_a_metrics_address_of_the_default_stack_and_each_is_scraped() -> None:
    doc = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    targets = scrape_targets(doc)
    addresses = metrics_addresses(load_config(default_config_path()))
    assert len(targets) == len(set(targets))
    assert set(targets) == set(addresses.values())
    jobs = {job["job_name"]: job for job in doc["scrape_configs"]}
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert jobs["envoy"]["static_configs"][0]["targets"] == [addresses["envoy"]]
    # each gpusim target carries its endpoint's name, the `endpoint` label the dashboard groups by
    for sc in jobs["gpusim"]["static_configs"]:
        assert [addresses[sc["labels"]["endpoint"]]] == sc["targets"]


def test_the_committed_dashboard_is_the_builders() -> None:
    spec = importlib.util.spec_from_file_location(
        "build_dashboard", DASHBOARD.with_name("build_dashboard.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads(DASHBOARD.read_text(encoding="utf-8")) == module.dashboard()
