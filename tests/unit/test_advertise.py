"""Bind and advertised addresses: ``xds.listen`` / ``ext_proc.listen`` / ``meter_listen`` are bound,
``xds.advertise`` / ``ext_proc.advertise`` / ``meter_advertise`` are what Envoy dials (its bootstrap, the
request-path and settler clusters), and the unspecified address is never advertised."""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format

from ext_proc import process
from inferlb.config.schema import default_config_path, parse_config
from inferlb.errors import ConfigError
from inferlb.ops.stack import on_free_ports
from xds_server import __main__ as xds_main
from xds_server import resources as r
from xds_server.bootstrap import render_bootstrap
from xds_server.resources.clusters import build_ext_proc_cluster, build_meter_clusters
from xds_server.resources.common import EXT_AUTHZ_CLUSTER
from xds_server.server import XdsServer

WAIT_S = 5.0


def _doc(**sections: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = copy.deepcopy(yaml.safe_load(default_config_path().read_text(encoding="utf-8")))
    for name, fields in sections.items():
        doc[name].update(fields)
    return doc


def _xds_endpoint(doc: dict[str, Any]) -> tuple[int, str, int]:
    b = json_format.ParseDict(render_bootstrap(parse_config(doc)), bootstrap_pb2.Bootstrap())
    [cluster] = b.static_resources.clusters
    sa = cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    return cluster.type, sa.address, sa.port_value


def _fields(err: ConfigError) -> str:
    return " ".join(f"{f}: {m}" for f, m in err.problems)


def test_the_bootstrap_dials_xds_advertise_and_the_server_binds_listen() -> None:
    doc = _doc(xds={"listen": "0.0.0.0:18000", "advertise": "xds.inferlb.svc.cluster.local:28000"})
    kind, host, port = _xds_endpoint(doc)
    assert (kind, host, port) == (cluster_pb2.Cluster.LOGICAL_DNS, "xds.inferlb.svc.cluster.local", 28000)
    xds = parse_config(doc).xds
    assert str(xds.grpc_address()) == "0.0.0.0:18000"  # what the server binds


def test_advertise_defaults_to_listen() -> None:
    assert _xds_endpoint(_doc()) == (cluster_pb2.Cluster.STATIC, "127.0.0.1", 18000)
    config = parse_config(_doc())
    assert config.xds.dial_address() == config.xds.listen
    assert config.ext_proc.dial_addresses() == (config.ext_proc.listen,)
    assert config.ext_proc.meter_dial_addresses() == (config.ext_proc.meter_listen,)
    assert config.xds.api_dial_address() == config.xds.api_listen


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"xds": {"listen": "0.0.0.0:18000"}}, "xds.advertise"),
        ({"xds": {"listen": "[::]:18000"}}, "xds.advertise"),
        ({"xds": {"listen": "0.0.0.0:18000", "advertise": "0.0.0.0:18000"}}, "xds.advertise"),
        ({"xds": {"api_advertise": "0.0.0.0:18001"}}, "xds.api_advertise"),
        ({"ext_proc": {"listen": "0.0.0.0:18080"}}, "ext_proc.advertise"),
        ({"ext_proc": {"advertise": "0.0.0.0:18080"}}, "ext_proc.advertise"),
        ({"ext_proc": {"meter_listen": "0.0.0.0:18079"}}, "ext_proc.meter_advertise"),
    ],
)
def test_the_unspecified_address_is_never_advertised(sections: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_doc(**sections))
    assert field in _fields(err.value)
    assert "unspecified" in _fields(err.value)


def test_a_bind_on_every_interface_with_an_advertise_is_accepted() -> None:
    config = parse_config(
        _doc(
            xds={
                "listen": "0.0.0.0:18000",
                "advertise": "xds:18000",
                "api_listen": "0.0.0.0:18001",
                "api_advertise": "xds:18001",
            },
            ext_proc={
                "listen": "0.0.0.0:18080",
                "advertise": "request-path:18080",
                "meter_listen": "0.0.0.0:18079",
                "meter_advertise": "request-path:18079",
            },
        )
    )
    assert str(config.xds.api_dial_address()) == "xds:18001"
    assert [str(a) for a in config.ext_proc.dial_addresses()] == ["request-path:18080"]


def test_the_meter_bind_may_be_unspecified_when_nothing_meters() -> None:
    doc = _doc(ext_proc={"protocol": "ext_proc", "meter_listen": "0.0.0.0:18079"})
    assert parse_config(doc).ext_proc.meters_access_log() is False


def test_advertise_with_a_unix_socket_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_doc(xds={"listen_unix": "/run/inferlb/xds.sock", "advertise": "xds:18000"}))
    assert "advertise" in _fields(err.value) and "listen_unix" in _fields(err.value)


def test_the_request_path_cluster_dials_ext_proc_advertise() -> None:
    doc = _doc(
        ext_proc={
            "listen": "0.0.0.0:18080",
            "advertise": "request-path.inferlb.svc:28080",
            "meter_listen": "0.0.0.0:18079",
            "meter_advertise": "meter.inferlb.svc:28079",
        }
    )
    config = parse_config(doc)
    cluster = build_ext_proc_cluster(config)
    # a name: STRICT_DNS, so every pod address of a headless Service is an endpoint
    assert cluster.type == cluster_pb2.Cluster.STRICT_DNS
    [ep] = cluster.load_assignment.endpoints[0].lb_endpoints
    sa = ep.endpoint.address.socket_address
    assert (sa.address, sa.port_value) == ("request-path.inferlb.svc", 28080)
    [meter] = build_meter_clusters(config)
    msa = meter.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (meter.type, msa.address, msa.port_value) == (
        cluster_pb2.Cluster.LOGICAL_DNS,
        "meter.inferlb.svc",
        28079,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_xds_server_binds_every_interface_and_serves_at_the_advertised_address(
    tmp_path: Path,
) -> None:
    port = _free_port()
    doc = _doc(xds={"listen": f"0.0.0.0:{port}", "advertise": f"127.0.0.1:{port}"})
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    server = XdsServer(path, api_bind=("127.0.0.1", 0))  # the gRPC bind comes from xds.listen
    await server.start()
    try:
        assert (server.host, server.port) == ("0.0.0.0", port)
        _, host, dial_port = _xds_endpoint(doc)
        async with grpc.aio.insecure_channel(f"{host}:{dial_port}") as channel:
            stream = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
            await stream.write(
                discovery_pb2.DiscoveryRequest(type_url=r.CLUSTER_TYPE, node=base_pb2.Node(id="gw-any"))
            )
            cds = await asyncio.wait_for(stream.read(), WAIT_S)
            assert isinstance(cds, discovery_pb2.DiscoveryResponse)
            assert EXT_AUTHZ_CLUSTER in {_cluster_name(a) for a in cds.resources}
            stream.cancel()
    finally:
        await server.stop(0)


def _cluster_name(packed: Any) -> str:
    c = cluster_pb2.Cluster()
    packed.Unpack(c)
    return c.name


def test_xds_server_flags_bind_and_check_the_advertised_address(tmp_path: Path) -> None:
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(_doc(xds={"advertise": "xds:18000"})), encoding="utf-8")
    assert xds_main._addresses(path, "0.0.0.0:18000", "xds:18000") == ("0.0.0.0", 18000)
    assert xds_main._addresses(path, None, None) is None
    with pytest.raises(ValueError, match=r"xds\.advertise"):
        xds_main._addresses(path, None, "elsewhere:18000")
    with pytest.raises(ValueError, match="unspecified"):
        xds_main._addresses(path, None, "0.0.0.0:18000")
    assert xds_main.main(["--config", str(path), "--advertise", "elsewhere:18000"]) == 1


def test_request_path_flags(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    doc = _doc(ext_proc={"listen": "0.0.0.0:18080", "advertise": "request-path:18080"})
    config = parse_config(doc)
    listen = config.ext_proc.listen
    assert str(process._advertised(config, listen, None)) == "request-path:18080"
    assert str(process._advertised(config, listen, "request-path:18080")) == "request-path:18080"
    with pytest.raises(ValueError, match=r"ext_proc\.advertise"):
        process._advertised(config, listen, "other:18080")
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    args = process.service_arguments("python -m ext_authz", "test", "ext_proc.listen").parse_args(
        ["--config", str(path), "--listen", "0.0.0.0:18080", "--advertise", "other:18080"]
    )
    with caplog.at_level(logging.ERROR):
        assert process.run_service(args, logging.getLogger("test"), _never) == 1
    assert "--advertise other:18080" in caplog.text


async def _never(_start: process.StartUp) -> int:
    raise AssertionError("the service must not start")


def test_free_ports_drop_the_advertised_addresses_of_the_old_ports() -> None:
    doc = _doc(
        xds={"listen": "0.0.0.0:18000", "advertise": "xds:18000", "api_advertise": "xds:18001"},
        ext_proc={"advertise": "request-path:18080", "meter_advertise": "request-path:18079"},
    )
    config = parse_config(on_free_ports(doc))
    assert config.xds.dial_address() == config.xds.listen and config.xds.listen.host == "127.0.0.1"
    assert config.xds.api_dial_address() == config.xds.api_listen
    assert config.ext_proc.dial_addresses() == (config.ext_proc.listen,)
    assert config.ext_proc.meter_dial_addresses() == (config.ext_proc.meter_listen,)
