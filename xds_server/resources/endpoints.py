"""The endpoints: one ClusterLoadAssignment per model-version cluster, and what the server changes about
an endpoint on top of the config.

Each assignment is empty when the pool is empty (Envoy must get an answer to finish warming); endpoints are
grouped by (region, zone), weights from :func:`inferlb.policy.capacity.capacity_weight`, localities get
EDS priorities from the model's ``cluster.failover`` (:func:`locality_priority`). A length-aware model's
endpoints get ``envoy.lb`` metadata from their GPU profile
(:func:`inferlb.policy.length_aware.endpoint_lb_metadata`: ``{gpu_tier: fast|standard}``, or
``{length_classes: [long-0, ...]}``, the classes the GPU may serve), or, with ``weights.mode: telemetry``,
the live classes the telemetry computes (:attr:`EndpointOverride.length_classes`,
:func:`inferlb.policy.length_aware.live_class_sets`); their cluster's subset selectors match on it
(:func:`xds_server.resources.clusters.length_aware_subsets`).

Endpoints are known by :func:`endpoint_key` (their ``host:port``); :class:`EndpointOverride` carries the
fleet API's and the telemetry's changes, and :class:`LbEndpointCache` memoizes built endpoints and
assignments across publishes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import struct_pb2, wrappers_pb2

from inferlb.config.schema import ClusterPolicy, Config, EndpointConfig, HostPort, ModelConfig, cluster_name
from inferlb.errors import ConfigError
from inferlb.policy.capacity import capacity_weight
from inferlb.policy.length_aware import ENVOY_LB_NAMESPACE, endpoint_lb_metadata, lb_metadata_of_classes
from xds_server.resources.common import METADATA_NAMESPACE, is_ip, socket_address


def endpoint_key(e: EndpointConfig) -> str:
    """The key an endpoint is known by in overrides and the fleet API: its address as written
    (``host:port``, e.g. ``gpusim:8001`` or ``10.0.0.5:8000``); config validation keeps it unique."""
    return str(e.address)


@dataclass(frozen=True, kw_only=True)
class EndpointOverride:
    """What the server changes about one endpoint on top of the config (fleet API, telemetry weights).

    Attributes:
        weight: Envoy ``load_balancing_weight`` to send instead of the capacity weight (>= 1), or None.
        draining: send ``health_status: DRAINING`` (Envoy sends it no new requests; in-flight ones finish).
        length_classes: for a length-aware model's endpoint, the confined length classes it may serve
            (names, longest first) instead of those of its GPU profile
            (:func:`inferlb.policy.length_aware.live_endpoint_classes`: the telemetry's live sets); None: the
            profile's (:func:`inferlb.policy.length_aware.endpoint_lb_metadata`). Ignored for other models.
    """

    weight: int | None = None
    draining: bool = False
    length_classes: tuple[str, ...] | None = None


_NO_OVERRIDE: Final = EndpointOverride()


def _endpoint_ip(e: EndpointConfig, resolved_hosts: Mapping[str, str]) -> HostPort:
    resolved = resolved_hosts.get(e.address.host)
    if resolved is None:  # an IP literal (check_endpoint_addresses refused unresolved names)
        return e.address
    return HostPort(host=resolved, port=e.address.port)


#: One endpoint's inputs to its LbEndpoint: ``(id(endpoint), ip, port, weight override or 0, draining,
#: length classes override or None)``.
_EndpointInputs = tuple[int, str, int, int, bool, tuple[str, ...] | None]


@dataclass
class LbEndpointCache:
    """Memo for :func:`~xds_server.resources.build.build_resources` across publishes of the same config
    objects.

    The caller owns it, keeps the config it was used with alive (keys hold object ids, unique only among
    live objects) and replaces it when that config changes. With it, a weight change on 1% of a fleet
    rebuilds those endpoints and their clusters' assignments only; unchanged assignments come back as the
    very same proto objects, which the snapshot cache then does not serialize again.

    Attributes:
        endpoints: ``{inputs: LbEndpoint}``.
        assignments: ``{cluster name: (inputs of all its endpoints, ClusterLoadAssignment)}``.
    """

    endpoints: dict[_EndpointInputs, endpoint_components_pb2.LbEndpoint] = field(default_factory=dict)
    #: ``{id(endpoint): endpoint_key(endpoint)}`` (formatting 10,000 addresses costs ~10 ms a publish).
    keys: dict[int, str] = field(default_factory=dict)
    assignments: dict[str, tuple[tuple[_EndpointInputs, ...], endpoint_pb2.ClusterLoadAssignment]] = field(
        default_factory=dict
    )
    #: ``(id(config), {(model, version): (endpoints, their keys)})``: the fleet grouped by cluster once
    grouped: tuple[int, dict[tuple[str, str], tuple[list[EndpointConfig], list[str]]]] | None = None
    #: ``{cluster name: (resolved hosts, override of each endpoint)}`` of its last build: a cluster whose
    #: inputs are unchanged is answered from :attr:`assignments` without a pass over its endpoints
    cluster_inputs: dict[str, tuple[object, ...]] = field(default_factory=dict)
    #: ``(id(config), resolved hosts)`` whose endpoint addresses :func:`check_endpoint_addresses` passed
    addresses_checked: tuple[int, tuple[tuple[str, str], ...]] | None = None

    def __len__(self) -> int:
        return len(self.endpoints)


def _lb_endpoint(
    config: Config,
    e: EndpointConfig,
    address: HostPort,
    override: EndpointOverride,
    policy: ClusterPolicy,
    *,
    version: str,
) -> endpoint_components_pb2.LbEndpoint:
    # metadata "inferlb": the gateway's response headers and access log read name and version
    # (%UPSTREAM_METADATA(inferlb:name)%, xds_server.resources.routes.SERVED_BY_HEADERS)
    meta = struct_pb2.Struct()
    meta.update({"name": e.display_name, "gpu": e.gpu, "version": version})
    weight = override.weight if override.weight is not None else capacity_weight(config, e)
    filter_metadata = {METADATA_NAMESPACE: meta}
    if policy.length_aware is not None:
        # the subset load balancer reads the envoy.lb namespace (clusters.length_aware_subsets)
        tier = struct_pb2.Struct()
        if override.length_classes is None:
            tier.update(endpoint_lb_metadata(config, e.gpu, policy.length_aware))
        else:
            tier.update(lb_metadata_of_classes(policy.length_aware, override.length_classes))
        filter_metadata[ENVOY_LB_NAMESPACE] = tier
    lb = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=socket_address(address), hostname=e.display_name),
        load_balancing_weight=wrappers_pb2.UInt32Value(value=max(1, weight)),
        metadata=base_pb2.Metadata(filter_metadata=filter_metadata),
    )
    if override.draining:
        lb.health_status = health_check_pb2.HealthStatus.DRAINING
    return lb


def build_load_assignment(
    config: Config,
    model: ModelConfig,
    version: str,
    *,
    resolved_hosts: Mapping[str, str] | None = None,
    overrides: Mapping[str, EndpointOverride] | None = None,
    endpoints: Sequence[EndpointConfig] | None = None,
    lb_cache: LbEndpointCache | None = None,
) -> endpoint_pb2.ClusterLoadAssignment:
    """The ClusterLoadAssignment of one model version: its endpoints grouped by (region, zone), localities
    in sorted order, endpoints in config order. No endpoints -> an assignment with no localities (Envoy
    needs that answer to finish warming the cluster, then answers 503 fast).

    Args:
        resolved_hosts: ``{host name: IP}`` for endpoints written with a host name (see
            :func:`~xds_server.resources.build.build_resources`).
        overrides: ``{endpoint_key: EndpointOverride}``; endpoints not named keep their config weight.
        endpoints: this version's endpoints when the caller already grouped them (else filtered from
            ``config.endpoints``).
        lb_cache: memo of built endpoints and assignments (:class:`LbEndpointCache`), reused across
            publishes; an unchanged assignment is returned as the same object as last time.
    """
    hosts = resolved_hosts or {}
    ovr = overrides or {}
    policy = model.cluster
    mine = (
        endpoints
        if endpoints is not None
        else [e for e in config.endpoints if e.model == model.name and config.endpoint_version(e) == version]
    )
    name = cluster_name(model.name, version)
    resolved = []
    for e in mine:
        address = _endpoint_ip(e, hosts)
        if not ovr:
            override = _NO_OVERRIDE
        elif lb_cache is None:
            override = ovr.get(endpoint_key(e), _NO_OVERRIDE)
        else:
            key = lb_cache.keys.get(id(e))
            if key is None:
                key = lb_cache.keys[id(e)] = endpoint_key(e)
            override = ovr.get(key, _NO_OVERRIDE)
        resolved.append((e, address, override))
    signature: tuple[_EndpointInputs, ...] = ()
    if lb_cache is not None:
        signature = tuple(
            (id(e), a.host, a.port, o.weight or 0, o.draining, o.length_classes) for e, a, o in resolved
        )
        hit = lb_cache.assignments.get(name)
        if hit is not None and hit[0] == signature:
            return hit[1]
    by_locality: dict[tuple[str, str], list[endpoint_components_pb2.LbEndpoint]] = {}
    for (e, address, override), inputs in zip(resolved, signature or [None] * len(resolved), strict=True):
        if inputs is None or lb_cache is None:
            lb = _lb_endpoint(config, e, address, override, policy, version=version)
        else:
            cached = lb_cache.endpoints.get(inputs)
            if cached is None:
                cached = _lb_endpoint(config, e, address, override, policy, version=version)
                lb_cache.endpoints[inputs] = cached
            lb = cached
        by_locality.setdefault((e.region, e.zone), []).append(lb)
    localities = []
    for (region, zone), lbs in sorted(by_locality.items()):
        loc = endpoint_components_pb2.LocalityLbEndpoints(
            locality=base_pb2.Locality(region=region, zone=zone),
            lb_endpoints=lbs,
            priority=locality_priority(config, policy.failover, region, zone),
        )
        if policy.locality_weighted:
            weight = policy.locality_weights.get(
                f"{region}/{zone}", sum(lb.load_balancing_weight.value for lb in lbs)
            )
            loc.load_balancing_weight.value = max(1, min(weight, MAX_LOCALITY_WEIGHT))
        localities.append(loc)
    # Envoy wants priorities contiguous from 0: when the gateway's own zone has no endpoints of this
    # model, the nearest level that has some becomes priority 0
    dense = {p: i for i, p in enumerate(sorted({loc.priority for loc in localities}))}
    for loc in localities:
        loc.priority = dense[loc.priority]
    cla = endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name,
        endpoints=localities,
        policy=endpoint_pb2.ClusterLoadAssignment.Policy(
            overprovisioning_factor=wrappers_pb2.UInt32Value(value=policy.overprovisioning_factor)
        ),
    )
    if lb_cache is not None:
        lb_cache.assignments[name] = (signature, cla)
    return cla


#: Envoy caps the sum of locality weights of one priority at 2^32 - 1; keep each well below it.
MAX_LOCALITY_WEIGHT: Final = 1_000_000_000


def locality_priority(config: Config, failover: str, region: str, zone: str) -> int:
    """The EDS priority of endpoints in ``region``/``zone`` for a gateway at ``gateway.region``/``zone``.

    ``off``: 0 everywhere. ``region``: 0 in the gateway's region, 1 elsewhere. ``zone``: 0 in its zone, 1 in
    its region's other zones, 2 in other regions. Envoy uses priority 0 while it is healthy enough and
    spills the rest of the traffic to 1, then 2 (Envoy docs, "Priority levels").
    """
    same_region = region == config.gateway.region
    if failover == "region":
        return 0 if same_region else 1
    if failover == "zone":
        if same_region and zone == config.gateway.zone:
            return 0
        return 1 if same_region else 2
    return 0


def build_load_assignments(
    config: Config,
    *,
    resolved_hosts: Mapping[str, str] | None = None,
    overrides: Mapping[str, EndpointOverride] | None = None,
    lb_cache: LbEndpointCache | None = None,
) -> list[endpoint_pb2.ClusterLoadAssignment]:
    """One ClusterLoadAssignment per model-version cluster, config order, empty pools included.

    Endpoints are grouped by (model, version) in one pass (a 10,000-endpoint fleet in 100 clusters is
    one pass, not 100)."""
    if lb_cache is not None:
        return _memo_load_assignments(config, resolved_hosts or {}, overrides or {}, lb_cache)
    # Config.endpoint_version scans the models per call: look the default versions up once
    only_version = {m.name: m.versions[0].name for m in config.models}
    grouped: dict[tuple[str, str], list[EndpointConfig]] = {}
    for e in config.endpoints:
        grouped.setdefault((e.model, e.version or only_version[e.model]), []).append(e)
    return [
        build_load_assignment(
            config,
            m,
            v.name,
            resolved_hosts=resolved_hosts,
            overrides=overrides,
            endpoints=grouped.get((m.name, v.name), []),
        )
        for m in config.models
        for v in m.versions
    ]


def _memo_load_assignments(
    config: Config,
    hosts: Mapping[str, str],
    overrides: Mapping[str, EndpointOverride],
    memo: LbEndpointCache,
) -> list[endpoint_pb2.ClusterLoadAssignment]:
    """:func:`build_load_assignments` with a memo: the fleet is grouped by cluster once per config, and a
    cluster whose inputs (the resolved host names, each endpoint's override) did not change since the
    last call is returned as the same object without a pass over its endpoints. A 1% weight change on a
    10,000-endpoint fleet then costs dictionary lookups for the 99% and rebuilds the rest."""
    if memo.grouped is None or memo.grouped[0] != id(config):
        only_version = {m.name: m.versions[0].name for m in config.models}
        groups: dict[tuple[str, str], tuple[list[EndpointConfig], list[str]]] = {}
        for e in config.endpoints:
            entry = groups.setdefault((e.model, e.version or only_version[e.model]), ([], []))
            entry[0].append(e)
            entry[1].append(endpoint_key(e))
        memo.grouped = (id(config), groups)
        memo.cluster_inputs.clear()
    grouped = memo.grouped[1]
    hosts_now = tuple(sorted(hosts.items()))
    out = []
    for m in config.models:
        for v in m.versions:
            endpoints, keys = grouped.get((m.name, v.name), ([], []))
            name = cluster_name(m.name, v.name)
            inputs = (hosts_now, *map(overrides.get, keys))
            hit = memo.assignments.get(name)
            if hit is not None and memo.cluster_inputs.get(name) == inputs:
                out.append(hit[1])
                continue
            cla = build_load_assignment(
                config,
                m,
                v.name,
                resolved_hosts=hosts,
                overrides=overrides,
                endpoints=endpoints,
                lb_cache=memo,
            )
            memo.cluster_inputs[name] = inputs
            out.append(cla)
    return out


def check_endpoint_addresses(
    config: Config, source: str = "<config>", resolved_hosts: Mapping[str, str] | None = None
) -> None:
    """EDS endpoints are not resolved by Envoy: each must be an IP literal, or a host name the caller
    resolved (``resolved_hosts``, filled at the edge with getaddrinfo).

    Raises:
        ConfigError: naming ``endpoints[i].address`` for every host name not resolved.
    """
    hosts = resolved_hosts or {}
    problems = [
        (
            f"endpoints[{i}].address",
            f"EDS endpoints need an IP address, and host name {e.address.host!r} was not resolved to one",
        )
        for i, e in enumerate(config.endpoints)
        if e.address.host not in hosts and not is_ip(e.address.host)
    ]
    if problems:
        raise ConfigError(source, problems)
