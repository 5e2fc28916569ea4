"""The Envoy v3 bootstrap of an inferlb gateway: who it is, its admin port, and where its xDS server is.

Everything else (listeners, routes, clusters, endpoints) comes over ADS from ``xds_server``, so the only
static cluster is ``inferlb_xds``. Pure: a config goes in, a dict ready for ``yaml.safe_dump`` /
``json.dumps`` comes out. ``envoy/bootstrap-ads.yaml`` is :func:`render_bootstrap_yaml` of the default
config (``inferlb bootstrap`` prints the same) and ``envoy/bootstrap-delta.yaml`` the same in Delta mode;
a unit test keeps them from drifting. With TLS (``gateway.tls``, ``gateway.upstream_tls``) Envoy also needs
the SDS files of :func:`sds_files` in ``gateway.sds_dir``.

Three modes (:data:`ADS_MODES`): ``sotw`` (ADS, state of the world, ``api_type: GRPC``: every response
carries all resources of its type), ``delta`` (ADS, incremental, ``api_type: DELTA_GRPC``: only changed
resources and the names of removed ones; what large fleets need, since a weight change on one GPU resends
one cluster's assignment instead of all of them) and ``xds`` (no ADS: LDS and CDS each on its own gRPC
stream to xds_server's per-type services, state of the world; the resources those services serve point
EDS and RDS at the per-type services too, so Envoy opens an EDS and an RDS stream as well). Without ADS
Envoy cannot be told the order of types; it relies on warming (a cluster waits for its endpoints, a
listener for its routes), which is why ADS is the default.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import yaml

from inferlb.config.schema import Config, HostPort, UnixSocket
from xds_server.resources import transport_sockets as tls_resources
from xds_server.resources.transport_sockets import GRPC_ALPN, transport_socket_dict, upstream_tls_context

#: Name of the static cluster that points Envoy at the xDS server.
XDS_CLUSTER: Final = "inferlb_xds"
DEFAULT_NODE_ID: Final = "inferlb-gateway-0"
#: Envoy's connect timeout to the xDS server (s, as Envoy's duration string).
XDS_CONNECT_TIMEOUT: Final = "1s"

_HTTP_PROTOCOL_OPTIONS: Final = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_FILE_ACCESS_LOG: Final = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"

AdsMode = Literal["sotw", "delta", "xds"]
ADS_MODES: Final[tuple[AdsMode, ...]] = ("sotw", "delta", "xds")
#: Envoy ``api_type`` per mode (``ads_config``'s, or each per-type ``api_config_source``'s for ``xds``).
_API_TYPE: Final = {"sotw": "GRPC", "delta": "DELTA_GRPC", "xds": "GRPC"}

#: What each committed bootstrap under ``envoy/`` is rendered from: file name -> (config source, ADS mode).
#: A unit test renders each one again and compares it with the committed file.
COMMITTED_BOOTSTRAPS: Final[dict[str, tuple[str, AdsMode]]] = {
    "bootstrap-ads.yaml": ("inferlb/data/local.yaml", "sotw"),
    "bootstrap-delta.yaml": ("inferlb/data/local.yaml", "delta"),
    "bootstrap-xds.yaml": ("inferlb/data/local.yaml", "xds"),
    "bootstrap-compose.yaml": ("examples/compose.yaml", "sotw"),
}

_MODE_TEXT: Final = {
    "sotw": "ADS (state of the world): each update carries every resource of a changed type",
    "delta": "Delta ADS (DELTA_GRPC): each update carries only the resources that changed",
    "xds": "the per-type discovery services (LDS, CDS, RDS, EDS streams, no ADS)",
}


def bootstrap_header(*, source: str, mode: AdsMode = "sotw") -> str:
    """The comment block heading a rendered bootstrap: what it was generated from and the command that
    prints it again (``inferlb bootstrap [SOURCE] [--ads-mode delta]``), so that command's output is the
    whole file, header included."""
    command = "inferlb bootstrap"
    if source != "inferlb/data/local.yaml":
        command += f" {source}"
    if mode != "sotw":
        command += f" --ads-mode {mode}"
    return (
        f"# Envoy v3 bootstrap for the inferlb gateway, generated from {source}.\n"
        f"# Do not edit by hand: regenerate it with\n#   {command} > FILE\n"
        "# Envoy takes listeners, routes, clusters and endpoints from xds_server over\n"
        f"# {_MODE_TEXT[mode]}.\n"
    )


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _pipe_address(path: str) -> dict[str, Any]:
    return {"pipe": {"path": path}}


def render_bootstrap(
    config: Config,
    *,
    node_id: str = DEFAULT_NODE_ID,
    xds_host: str | None = None,
    xds_port: int | None = None,
    mode: AdsMode = "sotw",
) -> dict[str, Any]:
    """An Envoy v3 bootstrap (``envoy.config.bootstrap.v3.Bootstrap`` as a plain dict) for one gateway.

    Args:
        config: the inferlb config (``gateway.node_cluster``, ``gateway.admin``, and where Envoy dials the
            xDS server: ``xds.advertise``, else ``xds.listen``:
            :meth:`~inferlb.config.schema.XdsConfig.dial_address`).
        node_id: this Envoy's ``node.id`` (unique per Envoy; the xDS server logs NACKs with it).
        xds_host, xds_port: override that address (e.g. a container's service name); either one
            given, the bootstrap dials TCP even when ``xds.listen_unix`` is set. Neither given and
            ``xds.listen_unix`` set: the ``inferlb_xds`` cluster dials that socket (a ``pipe`` address).
        mode: ``sotw`` (ADS, ``api_type: GRPC``), ``delta`` (ADS, ``api_type: DELTA_GRPC``) or ``xds``
            (no ADS: ``lds_config`` and ``cds_config`` each an ``api_config_source`` over gRPC).

    Raises:
        ValueError: an unknown ``mode``.

    Returns:
        a dict with ``node``, ``admin``, ``static_resources`` (the ``inferlb_xds`` HTTP/2 cluster, STATIC for
        an IP or a Unix socket, LOGICAL_DNS for a host name, over mutual TLS with ``xds.tls``) and
        ``dynamic_resources`` (ADS over gRPC, v3,
        node sent on the first message only, reconnect backoff :func:`reconnect_policy`, LDS and CDS from
        ADS; or for ``xds`` LDS and CDS on their own streams).
    """
    if mode not in _API_TYPE:
        raise ValueError(f"ADS mode must be one of {list(ADS_MODES)}, got {mode!r}")
    dial = config.xds.dial_address()
    tcp = dial if isinstance(dial, HostPort) else config.xds.listen
    xds = HostPort(host=xds_host or tcp.host, port=xds_port or tcp.port)
    unix = dial if isinstance(dial, UnixSocket) and xds_host is None and xds_port is None else None
    xds_address = _pipe_address(unix.path) if unix is not None else _socket_address(xds.host, xds.port)
    admin = config.gateway.admin
    return {
        "node": {"id": node_id, "cluster": config.gateway.node_cluster},
        "admin": {
            "address": _socket_address(admin.host, admin.port),
            "access_log": [
                {
                    "name": "envoy.access_loggers.file",
                    "typed_config": {"@type": _FILE_ACCESS_LOG, "path": "/dev/null"},
                }
            ],
        },
        "static_resources": {
            "clusters": [
                {
                    "name": XDS_CLUSTER,
                    "type": "STATIC" if unix is not None or xds.is_ip else "LOGICAL_DNS",
                    "connect_timeout": XDS_CONNECT_TIMEOUT,
                    # xDS is gRPC: the cluster must speak HTTP/2
                    "typed_extension_protocol_options": {
                        _HTTP_PROTOCOL_OPTIONS: {
                            "@type": f"type.googleapis.com/{_HTTP_PROTOCOL_OPTIONS}",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": XDS_CLUSTER,
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": xds_address}}]}],
                    },
                    **_xds_tls(config, xds),
                }
            ]
        },
        "dynamic_resources": (
            _per_type_dynamic_resources(config) if mode == "xds" else _ads_dynamic_resources(mode, config)
        ),
    }


def _xds_tls(config: Config, dialled: HostPort) -> dict[str, Any]:
    """``xds.tls``: the ``inferlb_xds`` cluster's ``transport_socket``, mutual TLS with Envoy's client
    certificate and ALPN ``h2`` (:func:`~xds_server.resources.transport_sockets.upstream_tls_context`,
    its certificates from SDS files Envoy watches); without it, nothing (plain text)."""
    if config.xds.tls is None:
        return {}
    context = upstream_tls_context(config, config.xds.tls, (dialled,), alpn=GRPC_ALPN)
    return {"transport_socket": transport_socket_dict(context)}


def sds_files(config: Config) -> dict[str, str]:
    """``{file name: YAML text}`` of the SDS files an Envoy of ``config`` reads in ``gateway.sds_dir``
    (:func:`~xds_server.resources.transport_sockets.sds_files`; empty without TLS): what ``inferlb up``
    and ``inferlb bootstrap --sds-dir`` write beside the bootstrap."""
    return tls_resources.sds_files(config)


def _duration(ms: int) -> str:
    """``ms`` as a protobuf JSON duration (``"0.250s"``)."""
    return f"{ms / 1000:.3f}s"


def reconnect_policy(config: Config) -> dict[str, Any]:
    """The ``retry_policy`` of the xDS ``envoy_grpc`` service (``GrpcService.EnvoyGrpc.retry_policy``, "only
    supported for xDS gRPC streams": the backoff of re-establishing the stream): ``retry_back_off`` with
    ``base_interval`` ``xds.reconnect_base_ms`` and ``max_interval`` ``xds.reconnect_max_ms``. Without it
    Envoy waits from 1 s doubling to 10 s (jittered) between attempts, so after an xDS server restart an
    Envoy could stay away for ~18 s; with the defaults (250 ms to 1 s) it is back within about a second
    of the server's return."""
    return {
        "retry_back_off": {
            "base_interval": _duration(config.xds.reconnect_base_ms),
            "max_interval": _duration(config.xds.reconnect_max_ms),
        }
    }


def _api_source(api_type: str, config: Config) -> dict[str, Any]:
    return {
        "api_type": api_type,
        "transport_api_version": "V3",
        "set_node_on_first_message_only": True,
        "grpc_services": [
            {"envoy_grpc": {"cluster_name": XDS_CLUSTER, "retry_policy": reconnect_policy(config)}}
        ],
    }


def _ads_dynamic_resources(mode: AdsMode, config: Config) -> dict[str, Any]:
    return {
        "ads_config": _api_source(_API_TYPE[mode], config),
        # fresh dicts each: a shared object would come out of yaml.safe_dump as an anchor/alias
        "lds_config": {"ads": {}, "resource_api_version": "V3"},
        "cds_config": {"ads": {}, "resource_api_version": "V3"},
    }


def _per_type_dynamic_resources(config: Config) -> dict[str, Any]:
    # the same ApiConfigSource xds_server.config_source puts in the clusters' eds_config and the listener's
    # rds.config_source, so every stream goes to the inferlb_xds cluster
    return {
        "lds_config": {"api_config_source": _api_source("GRPC", config), "resource_api_version": "V3"},
        "cds_config": {"api_config_source": _api_source("GRPC", config), "resource_api_version": "V3"},
    }


def render_bootstrap_yaml(config: Config, *, source: str = "inferlb/data/local.yaml", **kwargs: Any) -> str:
    """:func:`render_bootstrap` as YAML text behind :func:`bootstrap_header` (what ``inferlb bootstrap``
    prints and the files under ``envoy/`` hold). ``kwargs`` are :func:`render_bootstrap`'s keyword
    arguments; ``source`` only changes the header."""
    body = yaml.safe_dump(render_bootstrap(config, **kwargs), sort_keys=False, default_flow_style=False)
    return bootstrap_header(source=source, mode=kwargs.get("mode", "sotw")) + body
