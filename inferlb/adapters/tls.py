"""Mutual TLS on the services' listening sockets (``xds.tls``, ``ext_proc.tls``: :class:`ServiceTls`), with
the certificate, key and client CA read again when their files change, without a restart.

- gRPC (the xDS server, ext_proc, the settler's access-log service): :func:`pem_reloader` gives the PEM
  bytes for grpc's ``dynamic_ssl_server_credentials`` with ``require_client_authentication``: grpc calls
  the fetcher before every new connection's handshake (grpc ``dynamic_ssl_server_credentials`` docs), and
  it answers a new configuration only when a file's identity (inode, size, mtime) changed. The grpc half
  lives in the services (``xds_server.server``, :mod:`ext_proc.grpc_tls`): adapters import no grpc.
- asyncio HTTP (ext_authz's service): :func:`ssl_server_context`, an ``ssl.SSLContext`` with
  ``CERT_REQUIRED`` whose ``sni_callback`` (run for every ClientHello, SNI or not) hands the handshake the
  context built from the current files.

Both keep the last good files when new ones do not load (a key replaced before its certificate, say): the
failure is logged, and the files are tried again when one of them changes again. A peer without a
certificate signed by ``client_ca_file`` is refused in the handshake, before any request.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from inferlb.config.schema import ServiceTls

log = logging.getLogger(__name__)

T = TypeVar("T")
#: What identifies a file's contents without reading it: (inode, size, mtime ns) of each file, None when
#: it cannot be stat'ed. A rename over a file (or a Kubernetes ``..data`` swap) changes the inode.
Signature = tuple[tuple[int, int, int] | None, ...]


def _signature(paths: tuple[str, ...]) -> Signature:
    out: list[tuple[int, int, int] | None] = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class Reloader(Generic[T]):
    """Builds ``T`` (credentials, an SSL context) from a :class:`ServiceTls`'s files and builds it again when
    their signature changes. Thread-safe: grpc calls from its own threads.

    Args:
        tls: the files.
        build: the files -> ``T``; raises (``ssl.SSLError``, ``ValueError``, ``OSError``) when they do not
            load as a certificate chain, its key and CAs.
        field: the config field (``xds.tls``), for logs.

    Raises:
        OSError, ssl.SSLError, ValueError: from the first build (start-up fails)."""

    def __init__(self, tls: ServiceTls, build: Callable[[ServiceTls], T], field: str) -> None:
        self._tls = tls
        self._paths = (tls.cert_file, tls.key_file, tls.client_ca_file)
        self._build = build
        self._field = field
        self._lock = threading.Lock()
        self._signature = _signature(self._paths)
        self.current: T = build(tls)
        #: Successful reloads after the first build, and reloads that failed (the last good one kept).
        self.reloads = 0
        self.failures = 0

    def poll(self) -> T | None:
        """The new ``T`` when the files changed since the last build and load, else None (unchanged, or
        they fail to load: logged, the last good one stays)."""
        sig = _signature(self._paths)
        if sig == self._signature:
            return None
        with self._lock:
            if sig == self._signature:
                return None
            self._signature = sig
            try:
                built = self._build(self._tls)
            except (OSError, ssl.SSLError, ValueError) as e:
                self.failures += 1
                log.warning(
                    "%s: the changed certificate files do not load (%s); keeping the last good ones",
                    self._field,
                    e,
                )
                return None
            self.current = built
            self.reloads += 1
            log.info("%s: loaded the changed certificate files", self._field)
            return built


def server_ssl_context(tls: ServiceTls) -> ssl.SSLContext:
    """A server ``ssl.SSLContext`` of ``tls``'s files as they are now: its certificate chain and key, TLS
    1.2 or later, a client certificate signed by ``client_ca_file`` required (``CERT_REQUIRED``).

    Raises:
        OSError, ssl.SSLError: a file is missing, or they do not load as a chain, its key and CAs."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=tls.client_ca_file)
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


@dataclass(frozen=True, kw_only=True)
class PemFiles:
    """The bytes of a :class:`ServiceTls`'s files, checked to load together (grpc takes bytes)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes


def read_pem_files(tls: ServiceTls) -> PemFiles:
    """``tls``'s files as bytes, after :func:`server_ssl_context` checked that they load as a chain, its
    key and CAs (grpc would otherwise fail every handshake with them, saying nothing why).

    Raises:
        OSError, ssl.SSLError: they do not."""
    server_ssl_context(tls)
    with open(tls.cert_file, "rb") as c, open(tls.key_file, "rb") as k, open(tls.client_ca_file, "rb") as a:
        return PemFiles(cert_chain=c.read(), private_key=k.read(), client_ca=a.read())


def pem_reloader(tls: ServiceTls, field: str) -> Reloader[PemFiles]:
    """A :class:`Reloader` of :func:`read_pem_files`: what a grpc server's dynamic credentials fetch.

    Raises:
        OSError, ssl.SSLError: the files do not load."""
    return Reloader(tls, read_pem_files, field)


def ssl_server_context(tls: ServiceTls, field: str) -> tuple[ssl.SSLContext, Reloader[ssl.SSLContext]]:
    """An ``ssl.SSLContext`` for an asyncio server (``loop.create_server(..., ssl=...)``): each handshake
    runs on the context of the files as they are (:func:`server_ssl_context`, built again when they change),
    handed over by the ``sni_callback``, which OpenSSL runs for every ClientHello (with or without SNI).

    Returns:
        the context to listen with and its :class:`Reloader`.

    Raises:
        OSError, ssl.SSLError: the files do not load."""
    reloader = Reloader(tls, server_ssl_context, field)
    outer = server_ssl_context(tls)

    def use_current(conn: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext) -> None:
        reloader.poll()
        conn.context = reloader.current

    outer.sni_callback = use_current
    return outer, reloader
