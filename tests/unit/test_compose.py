"""docker-compose.yml describes the same stack as `inferlb up`, and Debian's docker-compose accepts it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferlb.config.schema import ExtProcConfig, HostPort, default_config_path, load_config, parse_config
from inferlb.ops.stack import SERVICE_MODULES

ROOT = Path(__file__).parents[2]


def _norm(doc: dict[str, Any]) -> dict[str, Any]:
    """A config dump with every socket address removed: what is left is fleet, models, tenants, policy."""
    doc["gateway"].pop("listen")
    doc["gateway"].pop("admin")
    doc["xds"].pop("listen")
    doc["xds"].pop("api_listen")
    doc["ext_proc"].pop("listen")
    doc["ext_proc"].pop("metrics_listen")
    doc["ext_proc"].pop("meter_listen")
    for e in doc["endpoints"]:
        e.pop("address")
    return doc


def test_compose_config_is_the_local_config_with_service_addresses() -> None:
    local = load_config(default_config_path())
    compose = load_config(ROOT / "examples" / "compose.yaml")
    assert _norm(compose.model_dump()) == _norm(local.model_dump())
    assert {e.address.host for e in compose.endpoints} == {"gpusim"}
    assert [e.address.port for e in compose.endpoints] == [e.address.port for e in local.endpoints]


def test_compose_services_are_the_stack_services() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    services = doc["services"]
    observability = {"prometheus", "grafana"}
    assert set(services) == {
        "gpusim",
        "xds-server",
        "ext-proc",
        "ext-authz",
        "ext-authz-2",
        "envoy",
        *observability,
    }
    # Prometheus and Grafana are opt-in: the default stack is the four services of `inferlb up`
    assert all(services[name]["profiles"] == ["observability"] for name in observability)
    services = {name: svc for name, svc in services.items() if name not in observability}
    # the ext_authz request path is the default; ext_proc's is opt-in, on ext-authz's ports
    assert "profiles" not in services["ext-authz"]
    assert services["ext-proc"]["profiles"] == ["ext_proc"]
    assert "ext-authz" in services["envoy"]["depends_on"]
    # ext-proc's ports, and the settler's (ext_proc.meter_listen's default port)
    settler = str(ExtProcConfig().meter_listen.port)
    assert services["ext-authz"]["expose"] == [*services["ext-proc"]["expose"], settler]
    # a second ext_authz process, opt-in again, on the same ports of its own host, serving the config's
    # extra_listen[0] (its settler is the config's extra_meter_listen[0])
    second = services["ext-authz-2"]
    assert second["profiles"] == ["ext_authz_replicas"]
    assert second["expose"] == services["ext-authz"]["expose"]
    flags = dict(zip(second["command"][3::2], second["command"][4::2], strict=True))
    assert flags == {"--listen": "ext-authz-2:18080", "--metrics-listen": "ext-authz-2:18081"}
    assert second["command"][:3] == services["ext-authz"]["command"]
    modules = {name: svc["command"][0] for name, svc in services.items() if name != "envoy"}
    # the same modules inferlb.ops.stack.Stack starts with `python -m` (ext-authz-2 as its ext_authz-2)
    assert modules == {name: SERVICE_MODULES[name.removesuffix("-2").replace("-", "_")] for name in modules}
    compose = load_config(ROOT / "examples" / "compose.yaml")
    assert compose.xds.api_listen is not None
    assert services["xds-server"]["expose"] == [
        str(compose.xds.listen.port),
        str(compose.xds.api_listen.port),
    ]
    assert compose.ext_proc.protocol == "ext_authz"
    assert services["ext-authz"]["expose"] == [
        str(compose.ext_proc.listen.port),
        str(compose.ext_proc.metrics_listen.port),
        str(compose.ext_proc.meter_listen.port),
    ]
    assert sorted(services["gpusim"]["expose"]) == sorted(str(e.address.port) for e in compose.endpoints)
    assert {compose.xds.listen.host, compose.ext_proc.listen.host} == {"xds-server", "ext-authz"}
    assert compose.ext_proc.meter_listen.host == "ext-authz"
    assert services["envoy"]["image"].startswith("envoyproxy/envoy:v1.")
    assert "./envoy/bootstrap-compose.yaml:/etc/envoy/bootstrap.yaml:ro" in services["envoy"]["volumes"]


def test_the_image_copies_every_package_pyproject_installs() -> None:
    """``pip install .`` in the image installs only what the Dockerfile copied: a package left out (as
    ``ext_authz`` once was) makes its service's ``python -m`` fail in the container."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines()
        if line.startswith("COPY ")
    }
    assert packages <= copied, packages - copied
    # and every service docker-compose.yml runs is one of them
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    modules = {
        svc["command"][0].split(".")[0]
        for name, svc in doc["services"].items()
        if name not in {"envoy", "prometheus", "grafana"}
    }
    assert modules <= packages, modules - packages


def test_docker_compose_config_accepts_the_file() -> None:
    if shutil.which("docker-compose") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have Debian's docker-compose (.ci/run installs it)")
        pytest.skip("Debian's docker-compose is not installed (.ci/run installs it)")
    proc = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_second_ext_authz_service_is_a_configs_extra_listen_process() -> None:
    # the config its comment asks for: ext-authz-2 is process 1, with its own settler for Envoy's log
    doc = yaml.safe_load((ROOT / "examples" / "compose.yaml").read_text(encoding="utf-8"))
    doc["ext_proc"].update(
        protocol="ext_authz",
        listen="ext-authz:18080",
        metrics_listen="ext-authz:18081",
        meter_listen="ext-authz:18079",
        quota_backend="redis",
        extra_listen=["ext-authz-2:18080"],
        extra_metrics_listen=["ext-authz-2:18081"],
        extra_meter_listen=["ext-authz-2:18079"],
    )
    ep = parse_config(doc).ext_proc
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
    listen = services["ext-authz-2"]["command"][services["ext-authz-2"]["command"].index("--listen") + 1]
    process = ep.process_index(HostPort.model_validate(listen))
    assert process == 1
    assert str(ep.meter_addresses()[process]) == "ext-authz-2:18079"
