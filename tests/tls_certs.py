"""Real X.509 certificates for the TLS tests, made with ``cryptography``: a CA, and leaf certificates it
signs for a server (``serverAuth``, DNS names as subject alternative names) or a client (``clientAuth``).

Keys are ECDSA P-256 (fast to make; every TLS stack in the tests takes them). Each certificate is valid
from a minute ago for a day. :func:`replace_file` writes a file the way a rotation should: a new file in the
same directory, then ``rename`` over the old one (atomic, and a move event for Envoy's watches).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, kw_only=True)
class Issued:
    """A certificate and its key, in PEM."""

    cert_pem: bytes
    key_pem: bytes
    serial: int

    def write(self, directory: Path, name: str) -> tuple[Path, Path]:
        """Write ``name.crt`` and ``name.key`` into ``directory`` (each replaced atomically); returns
        their paths."""
        crt, key = directory / f"{name}.crt", directory / f"{name}.key"
        replace_file(key, self.key_pem)
        replace_file(crt, self.cert_pem)
        return crt, key


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates."""

    def __init__(self, common_name: str = "inferlb test CA") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self._name = _name(common_name)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate in PEM (what a peer trusts)."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, dns_names: tuple[str, ...] = (), *, client: bool = False) -> Issued:
        """A leaf certificate signed by this CA: ``serverAuth`` with ``dns_names`` (default: the common
        name; an IP literal becomes an IP subject alternative name) as subject alternative names, or
        ``clientAuth`` when ``client``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        serial = x509.random_serial_number()
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        names = dns_names or (common_name,)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return Issued(cert_pem=cert.public_bytes(serialization.Encoding.PEM), key_pem=key_pem, serial=serial)


def peer_serial(der: bytes | None) -> int:
    """The serial number of a DER certificate (``SSLSocket.getpeercert(binary_form=True)``)."""
    assert der is not None, "the peer presented no certificate"
    return x509.load_der_x509_certificate(der).serial_number


def client_context(ca_file: Path, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """A client ``ssl.SSLContext`` trusting ``ca_file``, presenting ``cert`` (certificate, key) when
    given."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def handshake(
    port: int, ctx: ssl.SSLContext, server_name: str, *, alpn: tuple[str, ...] = (), payload: bytes = b""
) -> int:
    """Connect to ``127.0.0.1:port`` over TLS and return the serial of the certificate the server
    presented. With TLS 1.3 a server refuses a client certificate only after the client's side of the
    handshake is done, so this also sends ``payload`` (if any) and reads once: a refusal raises
    ``ssl.SSLError`` (an alert) or ``ConnectionResetError`` / EOF as ``ConnectionError``."""
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as s,
        ctx.wrap_socket(s, server_hostname=server_name) as t,
    ):
        serial = peer_serial(t.getpeercert(binary_form=True))
        if payload:
            t.sendall(payload)
        if not t.recv(1):
            raise ConnectionError("the server closed the connection")
        return serial
