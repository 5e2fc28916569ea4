"""The services' mutual TLS in process (:mod:`inferlb.adapters.tls`): a grpc aio server and an asyncio
server on loopback with real certificates; a client without a certificate signed by the client CA is refused
in the handshake, and a rotated server certificate or client CA is used from the next connection on,
without a restart."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ext_proc.grpc_tls import grpc_server_credentials
from inferlb.adapters.tls import ssl_server_context
from inferlb.config.schema import HostPort, ServiceTls, parse_config
from inferlb.ops.stack import port_open
from tests.conftest import make_config_doc, write_config
from tests.tls_certs import CertificateAuthority, client_context, handshake, replace_file

SERVER_NAME = "svc.inferlb.test"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, object]:
    ca = CertificateAuthority("services CA")
    client_ca = CertificateAuthority("clients CA")
    replace_file(tmp_path / "ca.crt", ca.cert_pem)
    replace_file(tmp_path / "client-ca.crt", client_ca.cert_pem)
    server = ca.issue(SERVER_NAME)
    crt, key = server.write(tmp_path, "server")
    tls = ServiceTls(cert_file=str(crt), key_file=str(key), client_ca_file=str(tmp_path / "client-ca.crt"))
    return {"ca": ca, "client_ca": client_ca, "server": server, "tls": tls, "dir": tmp_path}


def _client_context(pki: dict[str, object], client_ca: CertificateAuthority | None) -> ssl.SSLContext:
    d = pki["dir"]
    assert isinstance(d, Path)
    ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
    if client_ca is not None:
        crt, key = client_ca.issue("envoy", client=True).write(d, f"client-{id(client_ca)}")
        ctx.load_cert_chain(crt, key)
    return ctx


def _handshake(port: int, ctx: ssl.SSLContext) -> int:
    return handshake(port, ctx, SERVER_NAME, payload=b"x")


def channel_credentials(ca: Path, cert: tuple[Path, Path] | None) -> grpc.ChannelCredentials:
    """grpc client credentials trusting ``ca``, presenting ``cert`` (certificate, key) when given."""
    if cert is None:
        return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=cert[1].read_bytes(),
        certificate_chain=cert[0].read_bytes(),
    )


async def test_grpc_mutual_tls_refuses_strangers_and_reloads(pki: dict[str, object]) -> None:
    tls = pki["tls"]
    assert isinstance(tls, ServiceTls)
    creds, reloader = grpc_server_credentials(tls, "xds.tls")
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        d = pki["dir"]
        assert isinstance(d, Path)
        client_ca = pki["client_ca"]
        assert isinstance(client_ca, CertificateAuthority)
        crt, key = client_ca.issue("envoy", client=True).write(d, "envoy")

        async def check(ca_path: Path, cert: tuple[Path, Path] | None) -> None:
            channel_creds = channel_credentials(ca_path, cert)
            async with grpc.aio.secure_channel(
                f"127.0.0.1:{port}", channel_creds, options=[("grpc.ssl_target_name_override", SERVER_NAME)]
            ) as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

        await check(d / "ca.crt", (crt, key))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await check(d / "ca.crt", None)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        stranger = CertificateAuthority("stranger").issue("envoy", client=True).write(d, "stranger")
        with pytest.raises(grpc.aio.AioRpcError):
            await check(d / "ca.crt", stranger)

        # rotate: a server certificate from a new services CA, and a new client CA; the running server
        # takes both on the next connection
        ca2, client_ca2 = CertificateAuthority("services CA 2"), CertificateAuthority("clients CA 2")
        replace_file(d / "ca2.crt", ca2.cert_pem)
        ca2.issue(SERVER_NAME).write(d, "server")
        replace_file(d / "client-ca.crt", client_ca2.cert_pem)
        new_client = client_ca2.issue("envoy", client=True).write(d, "envoy2")
        await check(d / "ca2.crt", new_client)
        assert reloader.reloads == 1
        with pytest.raises(grpc.aio.AioRpcError):  # the old client CA is no longer trusted
            await check(d / "ca2.crt", (crt, key))
    finally:
        await server.stop(None)


async def test_asyncio_mutual_tls_refuses_strangers_and_reloads(pki: dict[str, object]) -> None:
    tls = pki["tls"]
    assert isinstance(tls, ServiceTls)
    ctx, reloader = ssl_server_context(tls, "ext_proc.tls")

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(await reader.readexactly(1))
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        client_ca = pki["client_ca"]
        assert isinstance(client_ca, CertificateAuthority)
        first = pki["server"]
        good = _client_context(pki, client_ca)
        serial = await asyncio.to_thread(_handshake, port, good)
        assert serial == first.serial  # type: ignore[attr-defined]
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await asyncio.to_thread(_handshake, port, _client_context(pki, None))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await asyncio.to_thread(_handshake, port, _client_context(pki, CertificateAuthority("stranger")))

        d = pki["dir"]
        assert isinstance(d, Path)
        ca = pki["ca"]
        assert isinstance(ca, CertificateAuthority)
        rotated = ca.issue(SERVER_NAME)
        rotated.write(d, "server")
        client_ca2 = CertificateAuthority("clients CA 2")
        replace_file(d / "client-ca.crt", client_ca2.cert_pem)
        assert await asyncio.to_thread(_handshake, port, _client_context(pki, client_ca2)) == rotated.serial
        assert reloader.reloads == 1
        with pytest.raises((ssl.SSLError, ConnectionError)):  # the old client CA is gone
            await asyncio.to_thread(_handshake, port, _client_context(pki, client_ca))
    finally:
        server.close()
        await server.wait_closed()


def test_ext_proc_process_serves_only_mutual_tls(tmp_path: Path) -> None:
    """``python -m ext_proc`` with ``ext_proc.tls``: a client with a certificate of the client CA gets the
    gRPC server's HTTP/2 preface over TLS (ALPN h2); one without, or with a stranger's, is refused in the
    handshake; and a plain-text client gets nothing."""
    ca, envoy_ca = CertificateAuthority("services CA"), CertificateAuthority("envoy CA")
    replace_file(tmp_path / "ca.crt", ca.cert_pem)
    replace_file(tmp_path / "envoy-ca.crt", envoy_ca.cert_pem)
    crt, key = ca.issue(SERVER_NAME).write(tmp_path, "server")
    envoy = envoy_ca.issue("envoy", client=True).write(tmp_path, "envoy")
    doc = make_config_doc()
    doc["ext_proc"]["protocol"] = "ext_proc"
    doc["ext_proc"]["tls"] = {
        "cert_file": str(crt),
        "key_file": str(key),
        "client_ca_file": str(tmp_path / "envoy-ca.crt"),
        "server_name": SERVER_NAME,
    }
    doc["gateway"].update(
        upstream_tls={
            "cert_file": str(envoy[0]),
            "key_file": str(envoy[1]),
            "ca_file": str(tmp_path / "ca.crt"),
        },
        sds_dir=str(tmp_path / "sds"),
    )
    config = write_config(tmp_path / "inferlb.yaml", doc)
    port = parse_config(doc).ext_proc.listen.port
    log = (tmp_path / "ext_proc.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ext_proc", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while not port_open(HostPort(host="127.0.0.1", port=port)):
            assert proc.poll() is None, (tmp_path / "ext_proc.log").read_text()
            assert time.monotonic() < deadline, "ext_proc not listening after 30 s"
            time.sleep(0.1)
        ok = client_context(tmp_path / "ca.crt", envoy)
        assert handshake(port, ok, SERVER_NAME, alpn=("h2",)) > 0
        stranger = CertificateAuthority("stranger").issue("envoy", client=True).write(tmp_path, "stranger")
        for cert in (None, stranger):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                handshake(port, client_context(tmp_path / "ca.crt", cert), SERVER_NAME, alpn=("h2",))
        # a plain-text HTTP/2 client (Envoy without upstream TLS) gets no answer
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            s.settimeout(2)
            try:
                answer = s.recv(64)
            except (TimeoutError, ConnectionError):
                answer = b""
            assert not answer.startswith(b"\x00"), answer  # no HTTP/2 frame: a TLS alert or nothing
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
