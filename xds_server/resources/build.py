"""The whole set: :func:`build_resources`, every xDS resource of a config, by type URL then name.

The top of the package: it imports the resource modules, none of them imports it.
"""

from __future__ import annotations

from collections.abc import Mapping

from inferlb.config.schema import Config
from xds_server.resources.clusters import build_clusters
from xds_server.resources.common import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, XdsResources
from xds_server.resources.endpoints import (
    EndpointOverride,
    LbEndpointCache,
    build_load_assignments,
    check_endpoint_addresses,
)
from xds_server.resources.listener import build_listener
from xds_server.resources.routes import build_route_configuration


def build_resources(
    config: Config,
    source: str = "<config>",
    *,
    resolved_hosts: Mapping[str, str] | None = None,
    overrides: Mapping[str, EndpointOverride] | None = None,
    lb_cache: LbEndpointCache | None = None,
) -> XdsResources:
    """Every xDS resource of a config, by type URL then name.

    Args:
        config: a validated config.
        source: where the config came from, for error messages.
        resolved_hosts: ``{host name: IP literal}`` for endpoints written with a host name
            (``gpusim:8001`` in a container stack). This module does no I/O: the server resolves names
            with getaddrinfo and passes the answers in.
        overrides: per-endpoint changes on top of the config (weight, draining, length classes), by
            :func:`~xds_server.resources.endpoints.endpoint_key`.
        lb_cache: a memo of built endpoints the caller keeps across calls for the same config objects
            (:class:`~xds_server.resources.endpoints.LbEndpointCache`): a weight change on 1% of a fleet
            rebuilds 1% of its endpoints.

    Raises:
        ConfigError: the config cannot be expressed in Envoy (an endpoint host name that was not
            resolved, see :func:`~xds_server.resources.endpoints.check_endpoint_addresses`).
    """
    checked = (id(config), tuple(sorted((resolved_hosts or {}).items())))
    if lb_cache is None or lb_cache.addresses_checked != checked:
        check_endpoint_addresses(config, source, resolved_hosts)
        if lb_cache is not None:
            lb_cache.addresses_checked = checked
    listener = build_listener(config)
    routes = build_route_configuration(config)
    assignments = build_load_assignments(
        config, resolved_hosts=resolved_hosts, overrides=overrides, lb_cache=lb_cache
    )
    return XdsResources(
        by_type={
            CLUSTER_TYPE: {c.name: c for c in build_clusters(config)},
            ENDPOINT_TYPE: {a.cluster_name: a for a in assignments},
            LISTENER_TYPE: {listener.name: listener},
            ROUTE_TYPE: {routes.name: routes},
        }
    )
