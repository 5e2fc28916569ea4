"""The real Prometheus (Debian's ``prometheus``) scrapes a running stack with deploy/prometheus/prometheus.yml
and every query of the Grafana dashboard (deploy/grafana/inferlb.json) returns data."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferlb.config.schema import default_config_path, load_config
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, in_mode, started_stack
from tests.observability import DASHBOARD, rewritten_scrape_config, scrape_targets

PROMETHEUS = "/usr/bin/prometheus"
#: A tenant of one request a minute: its second request is a quota rejection.
LIMITED = {"name": "prom-limited", "api_keys": ["sk-prom-limited"], "requests_per_minute": 1}
MODELS = ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _query(base: str, expr: str) -> list[Any]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    result: list[Any] = body["data"]["result"]
    return result


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    if shutil.which(PROMETHEUS) is None:
        pytest.skip(f"{PROMETHEUS} is absent (Debian's prometheus package; .ci/run installs it)")
    doc = in_mode(make_config_doc(), "ext_authz")
    doc["tenants"].append(dict(LIMITED))
    doc["weights"] = {"mode": "telemetry"}  # the weight-share panel shows the telemetry policy's weights
    with started_stack(tmp_path_factory.mktemp("prom-stack"), doc) as rs:
        yield rs


def test_every_dashboard_query_returns_data(stack: RunningStack, tmp_path: Path) -> None:
    scrape = rewritten_scrape_config(load_config(default_config_path()), stack.config, interval_s=1)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(scrape), encoding="utf-8")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    exprs = [
        t["expr"] for p in json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"] for t in p["targets"]
    ]
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={cfg}", f"--web.listen-address=127.0.0.1:{port}",
         f"--storage.tsdb.path={tmp_path / 'data'}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    empty = exprs
    try:
        deadline = time.monotonic() + 90
        for _ in range(90):  # bounded in count and time: requests, then one query round a second
            for i in range(4):
                assert stack.chat(MODELS[i % 2]).status == 200
            stack.chat(MODELS[0], key=LIMITED["api_keys"][0])  # the second onwards: 429
            try:
                up = _query(base, "up")
            except OSError:
                up = []
            if len(up) == len(scrape_targets(scrape)):  # every target scraped at least once
                assert {r["value"][1] for r in up} == {"1"}, [r["metric"] for r in up if r["value"][1] != "1"]
                empty = [e for e in exprs if not _query(base, e)]
                if not empty:
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        weights = _query(base, "inferlb_telemetry_weight") if empty else []
        assert not empty, f"dashboard queries without data: {empty}; inferlb_telemetry_weight: {weights[:3]}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
