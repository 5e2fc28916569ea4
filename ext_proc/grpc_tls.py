"""Mutual TLS on the request path's gRPC servers (ext_proc's, and the settler's access-log service in the
ext_authz process): grpc's ``dynamic_ssl_server_credentials`` over
:func:`inferlb.adapters.tls.pem_reloader`, so a rotated certificate, key or client CA is used from the
next connection on (grpc asks the fetcher before every new connection's handshake)."""

from __future__ import annotations

import grpc

from inferlb.adapters.tls import PemFiles, Reloader, pem_reloader
from inferlb.config.schema import ServiceTls


def _certificate_configuration(pem: PemFiles) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(pem.private_key, pem.cert_chain)], root_certificates=pem.client_ca
    )


def grpc_server_credentials(tls: ServiceTls, field: str) -> tuple[grpc.ServerCredentials, Reloader[PemFiles]]:
    """Server credentials for ``server.add_secure_port``: ``tls``'s certificate chain and key, every client
    required to present a certificate signed by ``tls.client_ca_file``, the files read again when they
    change (on the next connection; files that do not load keep the last good ones).

    Returns:
        the credentials and their reloader (its ``reloads`` / ``failures`` counters).

    Raises:
        OSError, ssl.SSLError: the files do not load."""
    reloader = pem_reloader(tls, field)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        changed = reloader.poll()
        return None if changed is None else _certificate_configuration(changed)

    credentials = grpc.dynamic_ssl_server_credentials(
        _certificate_configuration(reloader.current), fetch, require_client_authentication=True
    )
    return credentials, reloader
