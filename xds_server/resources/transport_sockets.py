"""Envoy's TLS transport sockets: the gateway listener's ``DownstreamTlsContext`` (``gateway.tls``) and the
``UpstreamTlsContext`` of each cluster that dials one of inferlb's services over mutual TLS (``xds.tls``:
the bootstrap's ``inferlb_xds``; ``ext_proc.tls``: ``inferlb_ext_proc`` / ``inferlb_ext_authz`` and the
settlers' ``inferlb_meter*``), and the SDS files they read their certificates through.

Why SDS files: Envoy reads a certificate named inline in a TLS context (``tls_certificates``) once; it
watches the files of a *secret* and loads them again when they change (envoy/api
``config.core.v3.PathConfigSource``: "when sourcing configuration for a secret, the certificate and key
files are also watched for updates"; measured on Envoy 1.40: an inline ``tls_certificates`` with
``watched_directory`` kept serving the old certificate after a rename over its file, a secret from a
``path_config_source`` served the new one). So each context names its certificates by SDS secret
(``tls_certificate_sds_secret_configs``, ``validation_context_sds_secret_config``) from a
``path_config_source``: a small YAML file in ``gateway.sds_dir`` holding one ``Secret`` with the file names
(:func:`sds_files`). Each secret's ``watched_directory`` is its files' directory, so a Kubernetes Secret
volume's rotation (a rename of its ``..data`` link) is seen as well as a plain rename over the file.

A file's name carries a digest of its contents: a config whose certificate paths change names new files
(written by ``inferlb up`` or ``inferlb bootstrap --sds-dir``), never a stale one; Envoy requires the file a
``path_config_source`` names to exist when it loads the config (envoy/api ``PathConfigSource.path``).

Pure: a config goes in, protos and file contents come out.
"""

from __future__ import annotations

import hashlib
import os.path
from collections.abc import Sequence
from typing import Any, Final

import yaml
from envoy.config.core.v3 import base_pb2, config_source_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import json_format, wrappers_pb2

from inferlb.config.schema import Config, GrpcAddress, HostPort, ServiceTls
from xds_server.resources.common import is_ip, pack

#: The transport socket extension Envoy's TLS lives in.
TLS_TRANSPORT_SOCKET: Final = "envoy.transport_sockets.tls"
SECRET_TYPE: Final = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"

#: SDS secret names (each also the stem of its file in ``gateway.sds_dir``).
GATEWAY_CERT_SECRET: Final = "inferlb_gateway_cert"
GATEWAY_CLIENT_CA_SECRET: Final = "inferlb_gateway_client_ca"
ENVOY_CLIENT_CERT_SECRET: Final = "inferlb_envoy_client_cert"
SERVICES_CA_SECRET: Final = "inferlb_services_ca"

#: ALPN the gateway offers clients: HTTP/2 first, then HTTP/1.1 (its HTTP connection manager is AUTO).
DOWNSTREAM_ALPN: Final = ("h2", "http/1.1")
#: ALPN of a gRPC cluster: HTTP/2 over TLS is ``h2`` (RFC 7540 3.3). Measured on Envoy 1.40: grpcio's
#: servers also served Envoy's HTTP/2 (``explicit_http_config``) offered no ALPN; others may refuse that.
GRPC_ALPN: Final = ("h2",)

_SAN = common_pb2.SubjectAltNameMatcher


def _watched(*paths: str) -> base_pb2.WatchedDirectory | None:
    dirs = {os.path.dirname(p) for p in paths}
    return base_pb2.WatchedDirectory(path=dirs.pop()) if len(dirs) == 1 else None


def _secrets(config: Config) -> list[secret_pb2.Secret]:
    """Every secret the config's TLS contexts name: the gateway's certificate and client CA, Envoy's client
    certificate and the services' CA, each only when configured."""
    gw = config.gateway
    out: list[secret_pb2.Secret] = []

    def cert(name: str, cert_file: str, key_file: str) -> None:
        out.append(
            secret_pb2.Secret(
                name=name,
                tls_certificate=common_pb2.TlsCertificate(
                    certificate_chain=base_pb2.DataSource(filename=cert_file),
                    private_key=base_pb2.DataSource(filename=key_file),
                    watched_directory=_watched(cert_file, key_file),
                ),
            )
        )

    def ca(name: str, ca_file: str) -> None:
        out.append(
            secret_pb2.Secret(
                name=name,
                validation_context=common_pb2.CertificateValidationContext(
                    trusted_ca=base_pb2.DataSource(filename=ca_file), watched_directory=_watched(ca_file)
                ),
            )
        )

    if gw.tls is not None:
        cert(GATEWAY_CERT_SECRET, gw.tls.cert_file, gw.tls.key_file)
        if gw.tls.client_ca_file is not None:
            ca(GATEWAY_CLIENT_CA_SECRET, gw.tls.client_ca_file)
    if gw.upstream_tls is not None:
        cert(ENVOY_CLIENT_CERT_SECRET, gw.upstream_tls.cert_file, gw.upstream_tls.key_file)
        ca(SERVICES_CA_SECRET, gw.upstream_tls.ca_file)
    return out


def _file_text(secret: secret_pb2.Secret) -> str:
    body = json_format.MessageToDict(secret, preserving_proto_field_name=True)
    return yaml.safe_dump({"resources": [{"@type": SECRET_TYPE, **body}]}, sort_keys=False)


def _file_name(name: str, text: str) -> str:
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"


def sds_files(config: Config) -> dict[str, str]:
    """``{file name: YAML text}`` of every SDS file in ``gateway.sds_dir`` the config's TLS contexts read
    (empty without TLS). Each holds one ``Secret`` (``resources: [{"@type": ..., name, tls_certificate |
    validation_context}]``, the shape of a ``DiscoveryResponse`` that Envoy's ``path_config_source``
    reads) naming the certificate files; its name is ``<secret>-<12 hex of the text's SHA-256>.yaml``."""
    out = {}
    for s in _secrets(config):
        text = _file_text(s)
        out[_file_name(s.name, text)] = text
    return out


def _sds(config: Config, name: str) -> secret_pb2.SdsSecretConfig:
    """An ``SdsSecretConfig`` for secret ``name`` from its file in ``gateway.sds_dir``."""
    secret = next(s for s in _secrets(config) if s.name == name)
    assert config.gateway.sds_dir is not None  # the schema requires it with any TLS
    path = os.path.join(config.gateway.sds_dir, _file_name(name, _file_text(secret)))
    return secret_pb2.SdsSecretConfig(
        name=name,
        sds_config=config_source_pb2.ConfigSource(
            path_config_source=config_source_pb2.PathConfigSource(path=path),
            resource_api_version=config_source_pb2.ApiVersion.V3,
        ),
    )


def downstream_tls_context(config: Config) -> tls_pb2.DownstreamTlsContext | None:
    """The gateway listener's TLS (``gateway.tls``; None without it): its certificate from
    :data:`GATEWAY_CERT_SECRET`, ALPN :data:`DOWNSTREAM_ALPN`, and with ``client_ca_file`` a required client
    certificate verified against :data:`GATEWAY_CLIENT_CA_SECRET`."""
    tls = config.gateway.tls
    if tls is None:
        return None
    common = tls_pb2.CommonTlsContext(
        tls_certificate_sds_secret_configs=[_sds(config, GATEWAY_CERT_SECRET)],
        alpn_protocols=DOWNSTREAM_ALPN,
    )
    if tls.client_ca_file is not None:
        common.validation_context_sds_secret_config.CopyFrom(_sds(config, GATEWAY_CLIENT_CA_SECRET))
    return tls_pb2.DownstreamTlsContext(
        common_tls_context=common,
        require_client_certificate=wrappers_pb2.BoolValue(value=tls.client_ca_file is not None),
    )


def service_names(tls: ServiceTls, dialled: Sequence[GrpcAddress]) -> tuple[str, ...]:
    """The names Envoy accepts in a service's certificate: ``tls.server_name``, else every distinct host it
    dials (``dialled``'s TCP addresses, in order).

    Raises:
        ValueError: no name at all (only Unix sockets dialled, which the schema refuses with TLS): Envoy
            would then accept any certificate the CA signed."""
    if tls.server_name is not None:
        return (tls.server_name,)
    names = tuple(dict.fromkeys(a.host for a in dialled if isinstance(a, HostPort)))
    if not names:
        raise ValueError("tls.server_name: no name to check the service's certificate against")
    return names


def upstream_tls_context(
    config: Config, tls: ServiceTls, dialled: Sequence[GrpcAddress], *, alpn: Sequence[str] = ()
) -> tls_pb2.UpstreamTlsContext:
    """Envoy's side of the mutual TLS to one service: its client certificate from
    :data:`ENVOY_CLIENT_CERT_SECRET`, the service's certificate verified against
    :data:`SERVICES_CA_SECRET` and required to name one of :func:`service_names` (a DNS subject alternative
    name, or an IP one for an IP literal), SNI the first name when it is a DNS name, and ``alpn``.

    Raises:
        ValueError: ``gateway.upstream_tls`` is not set (the schema refuses that config)."""
    if config.gateway.upstream_tls is None:
        raise ValueError("gateway.upstream_tls: needed for the mutual TLS to inferlb's services")
    names = service_names(tls, dialled)
    matchers = [
        common_pb2.SubjectAltNameMatcher(
            san_type=_SAN.IP_ADDRESS if is_ip(n) else _SAN.DNS,
            matcher=string_pb2.StringMatcher(exact=n),
        )
        for n in names
    ]
    common = tls_pb2.CommonTlsContext(
        tls_certificate_sds_secret_configs=[_sds(config, ENVOY_CLIENT_CERT_SECRET)],
        combined_validation_context=tls_pb2.CommonTlsContext.CombinedCertificateValidationContext(
            default_validation_context=common_pb2.CertificateValidationContext(
                match_typed_subject_alt_names=matchers
            ),
            validation_context_sds_secret_config=_sds(config, SERVICES_CA_SECRET),
        ),
        alpn_protocols=list(alpn),
    )
    sni = names[0] if names and not is_ip(names[0]) else ""
    return tls_pb2.UpstreamTlsContext(common_tls_context=common, sni=sni)


def transport_socket(
    context: tls_pb2.UpstreamTlsContext | tls_pb2.DownstreamTlsContext,
) -> base_pb2.TransportSocket:
    """``context`` as the ``envoy.transport_sockets.tls`` transport socket."""
    return base_pb2.TransportSocket(name=TLS_TRANSPORT_SOCKET, typed_config=pack(context))


def transport_socket_dict(context: tls_pb2.UpstreamTlsContext) -> dict[str, Any]:
    """:func:`transport_socket` as a bootstrap's plain dict (``typed_config`` with its ``@type``)."""
    body = json_format.MessageToDict(context, preserving_proto_field_name=True)
    return {
        "name": TLS_TRANSPORT_SOCKET,
        "typed_config": {"@type": f"type.googleapis.com/{context.DESCRIPTOR.full_name}", **body},
    }
