"""TLS through the real Envoy, with certificates made here (:mod:`tests.tls_certs`): the gateway listener
on TLS (``gateway.tls``, a client certificate required), and mutual TLS between Envoy and the xDS server
(``xds.tls``: the bootstrap's ``inferlb_xds`` cluster) and the request-path service (``ext_proc.tls``:
ext_authz's HTTP and the settler's access-log gRPC; ext_proc's gRPC in that mode).

One stack: a chat completion over HTTPS; Envoy's clusters to the services handshake TLS; the
service ports refuse a client with no certificate, or one from another CA, in the handshake; and
rotations are picked up without a restart: the gateway serves a new certificate, Envoy loads a new client
certificate (admin ``/certs``), the services present a new server certificate and accept a client
certificate of a newly trusted CA.
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inferlb.ops.stack import admin_get
from tests.conftest import make_config_doc
from tests.e2e.conftest import in_mode, started_stack
from tests.tls_certs import CertificateAuthority, client_context, handshake, replace_file
from xds_server.bootstrap import XDS_CLUSTER
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, EXT_PROC_CLUSTER, METER_CLUSTER

pytestmark = pytest.mark.e2e

GATEWAY = "127.0.0.1"
XDS_NAME = "xds.inferlb.test"
REQUEST_PATH_NAME = "request-path.inferlb.test"
HTTP_PROBE = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def _until(what: str, check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not {what} after {timeout_s:.0f} s")


def _https_chat(port: int, ctx: ssl.SSLContext, model: str) -> tuple[int, dict[str, Any]]:
    """One chat completion over HTTPS to the gateway on ``127.0.0.1:port`` (its certificate names that IP)."""
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"Authorization": "Bearer sk-demo-a", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _stat(config: Any, name: str) -> int:
    text = admin_get(config, f"/stats?filter=^{name}$").decode()
    return sum(int(line.rsplit(": ", 1)[1]) for line in text.splitlines() if line.startswith(name + ":"))


def _envoy_cert_serials(config: Any) -> set[int]:
    """Serial numbers (Envoy prints them in hex) of every certificate chain Envoy holds (admin
    ``/certs``)."""
    certs = json.loads(admin_get(config, "/certs"))["certificates"]
    return {int(c["serial_number"], 16) for entry in certs for c in entry.get("cert_chain", [])}


# One stack start, in the default request-path mode: it dials the request path over mutual TLS twice, the
# ext_authz HTTP check and the settler's gRPC (the same UpstreamTlsContext and grpc credentials as ext_proc
# mode's cluster, which tests/unit/test_tls_config.py renders and
# tests/integration/test_tls_reload.py::test_ext_proc_process_serves_only_mutual_tls starts). The test is
# written for both modes: add "ext_proc" to run it there too (+1 stack start, ~14 s here).
@pytest.mark.parametrize("request_path", ["ext_authz"])
def test_tls_gateway_and_mutual_tls_to_the_services_with_rotation(tmp_path: Path, request_path: str) -> None:
    pki = tmp_path / "pki"
    pki.mkdir()
    services_ca, envoy_ca, gateway_ca, clients_ca = (
        CertificateAuthority(n) for n in ("services CA", "envoy CA", "gateway CA", "gateway clients CA")
    )
    for name, ca in (("services-ca", services_ca), ("envoy-ca", envoy_ca), ("gateway-ca", gateway_ca)):
        replace_file(pki / f"{name}.crt", ca.cert_pem)
    replace_file(pki / "clients-ca.crt", clients_ca.cert_pem)
    gw_crt, gw_key = gateway_ca.issue(GATEWAY).write(pki, "gateway")
    envoy_issued = envoy_ca.issue("envoy", client=True)
    envoy_crt, envoy_key = envoy_issued.write(pki, "envoy")
    xds_crt, xds_key = services_ca.issue(XDS_NAME).write(pki, "xds")
    rp_crt, rp_key = services_ca.issue(REQUEST_PATH_NAME).write(pki, "request-path")
    client = clients_ca.issue("a client", client=True).write(pki, "client")

    doc = in_mode(make_config_doc(), request_path)
    doc["gateway"].update(
        tls={
            "cert_file": str(gw_crt),
            "key_file": str(gw_key),
            "client_ca_file": str(pki / "clients-ca.crt"),
        },
        upstream_tls={
            "cert_file": str(envoy_crt),
            "key_file": str(envoy_key),
            "ca_file": str(pki / "services-ca.crt"),
        },
        sds_dir=str(tmp_path / "sds"),
    )
    envoy_ca_file = str(pki / "envoy-ca.crt")
    doc["xds"]["tls"] = {
        "cert_file": str(xds_crt),
        "key_file": str(xds_key),
        "client_ca_file": envoy_ca_file,
        "server_name": XDS_NAME,
    }
    doc["ext_proc"]["tls"] = {
        "cert_file": str(rp_crt),
        "key_file": str(rp_key),
        "client_ca_file": envoy_ca_file,
        "server_name": REQUEST_PATH_NAME,
    }
    with started_stack(tmp_path, doc) as rs:
        cfg = rs.config
        gw_port = cfg.gateway.listen.port
        # a chat completion over HTTPS with a client certificate, through the request path over mutual TLS
        status, body = _https_chat(
            gw_port, client_context(pki / "gateway-ca.crt", client), "qwen2.5-7b-instruct"
        )
        assert status == 200, body
        assert body["choices"][0]["message"]["content"]
        # the gateway asks for a client certificate: none, or one from another CA, is refused
        for cert in (None, CertificateAuthority("stranger").issue("x", client=True).write(pki, "stranger")):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                handshake(gw_port, client_context(pki / "gateway-ca.crt", cert), GATEWAY, payload=HTTP_PROBE)

        # Envoy dialled each service over TLS (its xDS stream, the check / ext_proc stream, the settler)
        rp_cluster = EXT_AUTHZ_CLUSTER if request_path == "ext_authz" else EXT_PROC_CLUSTER
        assert _stat(cfg, f"cluster.{XDS_CLUSTER}.ssl.handshake") >= 1
        assert _stat(cfg, f"cluster.{rp_cluster}.ssl.handshake") >= 1
        if cfg.ext_proc.meters_access_log():
            _until(
                "the settler reached over TLS",
                lambda: _stat(cfg, f"cluster.{METER_CLUSTER}.ssl.handshake") >= 1,
            )

        # each service port refuses a client without a certificate, or with one Envoy's CA did not sign
        grpc_alpn = ("h2",)
        rp_alpn: tuple[str, ...] = () if request_path == "ext_authz" else grpc_alpn
        rp_probe = HTTP_PROBE if request_path == "ext_authz" else b""
        # (port, name in its certificate, ALPN, bytes that make it answer, its certificate's file stem)
        services = [
            (cfg.xds.listen.port, XDS_NAME, grpc_alpn, b"", "xds"),
            (cfg.ext_proc.listen.port, REQUEST_PATH_NAME, rp_alpn, rp_probe, "request-path"),
        ]
        if cfg.ext_proc.meters_access_log():
            services.append(
                (cfg.ext_proc.meter_listen.port, REQUEST_PATH_NAME, grpc_alpn, b"", "request-path")
            )
        stranger = (
            CertificateAuthority("stranger CA").issue("envoy", client=True).write(pki, "stranger-envoy")
        )
        for port, name, alpn, probe, _ in services:
            ok = client_context(pki / "services-ca.crt", (envoy_crt, envoy_key))
            handshake(port, ok, name, alpn=alpn, payload=probe)
            for cert in (None, stranger):
                with pytest.raises((ssl.SSLError, ConnectionError)):
                    handshake(
                        port, client_context(pki / "services-ca.crt", cert), name, alpn=alpn, payload=probe
                    )

        # -- rotation, nothing restarted -------------------------------------------------------------
        # the gateway's certificate: Envoy serves the new one on new connections
        new_gw = gateway_ca.issue(GATEWAY)
        new_gw.write(pki, "gateway")
        gw_ctx = client_context(pki / "gateway-ca.crt", client)
        _until(
            "serving the rotated gateway certificate",
            lambda: handshake(gw_port, gw_ctx, GATEWAY, payload=HTTP_PROBE) == new_gw.serial,
        )
        # Envoy's client certificate: loaded again from its files (admin /certs lists it)
        new_envoy = envoy_ca.issue("envoy", client=True)
        new_envoy.write(pki, "envoy")
        _until(
            "holding the rotated client certificate",
            lambda: new_envoy.serial in _envoy_cert_serials(cfg),
        )
        # the services: a new server certificate, and a client certificate of a newly trusted CA
        new_envoy_ca = CertificateAuthority("envoy CA 2")
        replace_file(pki / "envoy-ca.crt", envoy_ca.cert_pem + new_envoy_ca.cert_pem)
        new_client = new_envoy_ca.issue("envoy", client=True).write(pki, "envoy-2")
        for port, name, alpn, probe, stem in services:
            rotated = services_ca.issue(name)
            rotated.write(pki, stem)
            ctx = client_context(pki / "services-ca.crt", new_client)
            assert handshake(port, ctx, name, alpn=alpn, payload=probe) == rotated.serial

        # and requests still flow through the same Envoy
        status, body = _https_chat(
            gw_port, client_context(pki / "gateway-ca.crt", client), "qwen2.5-7b-instruct"
        )
        assert status == 200, body
