"""``xds.listen_unix`` and ``ext_proc.listen_unix``: the whole stack with the xDS server and the request-path
service (ext_proc's gRPC, or ext_authz's HTTP in that mode) on Unix domain sockets (mode 0600) serves a chat
request through the real Envoy, which dials them as ``pipe`` addresses."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from inferlb.ops.stack import clusters_json, port_open
from inferlb.request.headers import ENDPOINT
from tests.conftest import make_config_doc
from tests.e2e.conftest import in_mode, started_stack
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, EXT_PROC_CLUSTER

pytestmark = pytest.mark.e2e


def test_stack_on_unix_sockets_serves_a_chat_and_the_sockets_are_owner_only(
    tmp_path: Path, request_path: str
) -> None:
    xds_sock, ext_proc_sock = tmp_path / "xds.sock", tmp_path / "ext_proc.sock"
    doc = in_mode(make_config_doc(), request_path)
    doc["xds"]["listen_unix"] = str(xds_sock)
    doc["ext_proc"]["listen_unix"] = str(ext_proc_sock)
    with started_stack(tmp_path, doc) as rs:
        r = rs.chat("qwen2.5-7b-instruct")
        assert r.status == 200, r.body
        assert r.json()["choices"][0]["message"]["content"]
        assert r.headers.get(ENDPOINT)
        for sock in (xds_sock, ext_proc_sock):
            mode = sock.stat().st_mode
            assert stat.S_ISSOCK(mode), sock
            assert stat.S_IMODE(mode) == 0o600, (sock, oct(stat.S_IMODE(mode)))
        # nothing listens on the TCP addresses the sockets replace
        assert not port_open(rs.config.xds.listen)
        assert not port_open(rs.config.ext_proc.listen)
        # Envoy holds the request-path service's endpoint as the socket path
        name = EXT_AUTHZ_CLUSTER if request_path == "ext_authz" else EXT_PROC_CLUSTER
        (ext_proc,) = [c for c in clusters_json(rs.config)["cluster_statuses"] if c["name"] == name]
        assert [h["address"] for h in ext_proc["host_statuses"]] == [{"pipe": {"path": str(ext_proc_sock)}}]
    # grpc (and ext_authz's server) remove their socket files on a clean stop
    assert not xds_sock.exists() and not ext_proc_sock.exists()
