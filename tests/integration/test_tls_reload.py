"""The services' mutual TLS in process (:mod:`inferlb.adapters.tls`): a grpc aio server and an asyncio
server on loopback with real certificates; a client without a certificate signed by the client CA is refused
in the handshake, and a rotated server certificate or client CA is used from the next connection on,
without a restart."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ext_proc.grpc_tls import grpc_server_credentials
from inferlb.adapters.tls import ssl_server_context
from inferlb.config.schema import ServiceTls
from tests.tls_certs import CertificateAuthority, handshake, replace_file

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
