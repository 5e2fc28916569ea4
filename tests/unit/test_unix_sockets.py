"""``xds.listen_unix`` / ``ext_proc.listen_unix``: the config fields, the ``pipe`` addresses Envoy gets
(the ext_proc cluster, the bootstrap's xDS cluster) and the socket binding helper."""

from __future__ import annotations

import copy
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2

# registers the Any types the bootstrap names, so json_format can parse them
from envoy.extensions.access_loggers.file.v3 import file_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format

from inferlb.adapters.unix_socket import (
    SOCKET_MODE,
    UnixSocketError,
    bind_unix_socket,
    unix_socket_open,
)
from inferlb.config.schema import ConfigError, UnixSocket, default_config_path, parse_config
from inferlb.ops.stack import port_open
from xds_server import resources as r
from xds_server.bootstrap import XDS_CLUSTER, render_bootstrap
from xds_server.resources.common import EXT_AUTHZ_CLUSTER


def _doc(**sections: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = copy.deepcopy(yaml.safe_load(default_config_path().read_text(encoding="utf-8")))
    doc["ext_proc"]["protocol"] = "ext_proc"  # listen_unix is ext_proc mode's (ext_authz mode refuses it)
    for name, fields in sections.items():
        doc[name].update(fields)
    return doc


def _problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    return err.value.problems


# -- config -------------------------------------------------------------------------------------------


def test_listen_unix_is_off_by_default_and_tcp_is_the_address() -> None:
    config = parse_config(_doc())
    assert config.xds.listen_unix is None and config.ext_proc.listen_unix is None
    assert config.xds.grpc_address() == config.xds.listen
    assert config.ext_proc.grpc_address() == config.ext_proc.listen


def test_listen_unix_replaces_the_tcp_address_and_leaves_the_tcp_sockets() -> None:
    config = parse_config(
        _doc(xds={"listen_unix": "/run/inferlb/xds.sock"}, ext_proc={"listen_unix": "/run/e.sock"})
    )
    assert config.xds.grpc_address() == UnixSocket(path="/run/inferlb/xds.sock")
    assert str(config.ext_proc.grpc_address()) == "unix:/run/e.sock"
    fields = [f for f, _ in config.listen_sockets()]
    assert "xds.listen" not in fields and "ext_proc.listen" not in fields
    assert "ext_proc.metrics_listen" in fields and "gateway.listen" in fields


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("relative.sock", "must be absolute"),
        ("/run/inferlb/", "names a file"),
        ("/" + "a" * 107, "at most 107 bytes"),
    ],
)
def test_a_bad_listen_unix_path_is_refused_naming_the_field(path: str, words: str) -> None:
    for section in ("xds", "ext_proc"):
        [(field, message)] = _problems(_doc(**{section: {"listen_unix": path}}))
        assert field == f"{section}.listen_unix"
        assert words in message


def test_the_longest_path_the_kernel_takes_is_accepted() -> None:
    path = "/" + "a" * 106
    assert parse_config(_doc(xds={"listen_unix": path})).xds.listen_unix == UnixSocket(path=path)


def test_listen_unix_with_extra_listen_is_refused() -> None:
    doc = _doc(ext_proc={"listen_unix": "/tmp/e.sock", "extra_listen": ["127.0.0.1:18090"]})
    doc["tenants"] = [{k: t[k] for k in ("name", "api_keys")} for t in doc["tenants"]]
    [(field, message)] = _problems(doc)
    assert field == "ext_proc.listen_unix"
    assert "extra_listen" in message


def test_both_services_on_one_socket_path_is_refused() -> None:
    [(field, message)] = _problems(
        _doc(xds={"listen_unix": "/tmp/x.sock"}, ext_proc={"listen_unix": "/tmp/x.sock"})
    )
    assert field == "ext_proc.listen_unix"
    assert "xds.listen_unix" in message


# -- what Envoy gets ------------------------------------------------------------------------------------


def test_ext_proc_cluster_dials_the_unix_socket_as_a_pipe() -> None:
    config = parse_config(_doc(ext_proc={"listen_unix": "/run/inferlb/ext_proc.sock"}))
    c = next(c for c in r.build_clusters(config) if c.name == r.EXT_PROC_CLUSTER)
    assert c.type == cluster_pb2.Cluster.STATIC
    [lb] = c.load_assignment.endpoints[0].lb_endpoints
    address = lb.endpoint.address
    assert address.WhichOneof("address") == "pipe"
    assert address.pipe.path == "/run/inferlb/ext_proc.sock"
    # HTTP/2 still: ext_proc is gRPC over the socket
    assert "envoy.extensions.upstreams.http.v3.HttpProtocolOptions" in c.typed_extension_protocol_options


def test_ext_authz_cluster_dials_the_unix_socket_as_a_pipe_over_http1() -> None:
    config = parse_config(
        _doc(ext_proc={"protocol": "ext_authz", "listen_unix": "/run/inferlb/ext_authz.sock"})
    )
    assert config.ext_proc.grpc_address() == UnixSocket(path="/run/inferlb/ext_authz.sock")
    assert "ext_proc.listen" not in [f for f, _ in config.listen_sockets()]
    c = next(c for c in r.build_clusters(config) if c.name == EXT_AUTHZ_CLUSTER)
    assert c.type == cluster_pb2.Cluster.STATIC
    [lb] = c.load_assignment.endpoints[0].lb_endpoints
    assert lb.endpoint.address.WhichOneof("address") == "pipe"
    assert lb.endpoint.address.pipe.path == "/run/inferlb/ext_authz.sock"
    # the check is HTTP/1.1: no HTTP/2 protocol options
    assert not c.typed_extension_protocol_options


def test_ext_proc_cluster_stays_tcp_by_default() -> None:
    config = parse_config(_doc())
    c = next(c for c in r.build_clusters(config) if c.name == r.EXT_PROC_CLUSTER)
    address = c.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address
    assert address.WhichOneof("address") == "socket_address"


def _xds_address(doc: dict[str, Any], **kwargs: Any) -> tuple[int, Any]:
    b = json_format.ParseDict(render_bootstrap(parse_config(doc), **kwargs), bootstrap_pb2.Bootstrap())
    [cluster] = b.static_resources.clusters
    assert cluster.name == XDS_CLUSTER
    return cluster.type, cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address


def test_bootstrap_xds_cluster_dials_the_unix_socket_as_a_pipe() -> None:
    kind, address = _xds_address(_doc(xds={"listen_unix": "/run/inferlb/xds.sock"}))
    assert kind == cluster_pb2.Cluster.STATIC
    assert address.WhichOneof("address") == "pipe"
    assert address.pipe.path == "/run/inferlb/xds.sock"


def test_an_explicit_xds_host_in_the_bootstrap_keeps_tcp() -> None:
    kind, address = _xds_address(_doc(xds={"listen_unix": "/run/x.sock"}), xds_host="xds-server")
    assert kind == cluster_pb2.Cluster.LOGICAL_DNS
    assert (address.socket_address.address, address.socket_address.port_value) == ("xds-server", 18000)


def test_the_default_bootstrap_has_no_pipe() -> None:
    _, address = _xds_address(_doc())
    assert address.WhichOneof("address") == "socket_address"


# -- binding ---------------------------------------------------------------------------------------------


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def _binder(held: list[socket.socket]) -> Any:
    def bind(address: str) -> int:
        assert address.startswith("unix:")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address.removeprefix("unix:"))
        s.listen()
        held.append(s)
        return 1

    return bind


def test_bind_makes_an_owner_only_socket(tmp_path: Path, sockets: list[socket.socket]) -> None:
    path = str(tmp_path / "s.sock")
    bind_unix_socket(path, "ext_proc.listen_unix", _binder(sockets))
    mode = Path(path).stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == SOCKET_MODE == 0o600
    assert unix_socket_open(path)
    assert port_open(UnixSocket(path=path))


def test_a_missing_directory_is_refused_naming_the_field(
    tmp_path: Path, sockets: list[socket.socket]
) -> None:
    path = str(tmp_path / "nowhere" / "s.sock")
    with pytest.raises(UnixSocketError) as err:
        bind_unix_socket(path, "xds.listen_unix", _binder(sockets))
    assert str(err.value).startswith(f"xds.listen_unix: {path}: ")
    assert "does not exist" in str(err.value)
    assert not sockets


def test_a_stale_socket_file_is_replaced(tmp_path: Path, sockets: list[socket.socket]) -> None:
    path = str(tmp_path / "s.sock")
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(path)
    old.close()  # its file stays, nobody listens
    assert not unix_socket_open(path)
    bind_unix_socket(path, "xds.listen_unix", _binder(sockets))
    assert unix_socket_open(path)


def test_a_live_socket_or_a_regular_file_is_not_removed(tmp_path: Path, sockets: list[socket.socket]) -> None:
    live = str(tmp_path / "live.sock")
    bind_unix_socket(live, "xds.listen_unix", _binder(sockets))
    with pytest.raises(UnixSocketError, match="another server is listening"):
        bind_unix_socket(live, "ext_proc.listen_unix", _binder(sockets))
    assert unix_socket_open(live)
    plain = tmp_path / "file"
    plain.write_text("keep me")
    with pytest.raises(UnixSocketError, match="not a socket"):
        bind_unix_socket(str(plain), "ext_proc.listen_unix", _binder(sockets))
    assert plain.read_text() == "keep me"


def test_a_failed_bind_is_a_unix_socket_error(tmp_path: Path) -> None:
    with pytest.raises(UnixSocketError, match="cannot listen"):
        bind_unix_socket(str(tmp_path / "s.sock"), "ext_proc.listen_unix", lambda _address: 0)


def test_port_open_on_a_missing_socket_or_a_directory_is_false(tmp_path: Path) -> None:
    assert not port_open(UnixSocket(path=str(tmp_path / "none.sock")))
    assert not unix_socket_open(str(tmp_path))  # a directory is no socket
