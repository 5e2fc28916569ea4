"""The Clusters: one EDS Cluster per model version (:func:`inferlb.config.schema.cluster_name`), plus the
HTTP/2 cluster ``inferlb_ext_proc``.

Each model-version cluster sets every resilience knob explicitly from the model's ``cluster`` policy: LB
policy, outlier detection, circuit breakers per routing priority, panic threshold, slow start, health
checks. A length-aware model's clusters get an ``lb_subset_config`` (one selector on ``gpu_tier``, or on
``length_classes`` with ``list_as_any`` when tiered; fallback ``ANY_ENDPOINT``), which selects on the
``envoy.lb`` metadata of their endpoints (:mod:`xds_server.resources.endpoints`); not when the model picks
endpoints (its picker confines the classes). A model with
``endpoint_picking`` gets Envoy's ``override_host`` load-balancing policy instead
(:func:`override_host_policy`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Literal

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import base_pb2, extension_pb2, health_check_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.load_balancing_policies.common.v3 import common_pb2 as lb_common_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, wrappers_pb2

from inferlb.config.schema import CircuitBreaker, ClusterPolicy, Config, GrpcAddress, HealthCheck, UnixSocket
from inferlb.policy.affinity import HASH_LB_POLICIES
from inferlb.policy.length_aware import subset_key
from inferlb.request import headers
from xds_server.resources.common import (
    EXT_AUTHZ_CLUSTER,
    EXT_PROC_CLUSTER,
    ads_source,
    duration_ms,
    grpc_service_address,
    meter_cluster_name,
    pack,
)
from xds_server.resources.transport_sockets import GRPC_ALPN, transport_socket, upstream_tls_context

#: The ext_proc cluster carries one HTTP/2 stream per client request: Envoy's default circuit breaker
#: (1024 requests) would 503 the gateway before any model cluster is saturated, so lift it.
EXT_PROC_MAX_REQUESTS: Final = 1_000_000
EXT_PROC_CONNECT_TIMEOUT_MS: Final = 1_000
#: Connections to one request-path process that failed in a row (refused, timed out, reset before a
#: response: Envoy's local-origin errors) before outlier detection ejects it; a refusal of the service
#: (an HTTP answer) is never one.
REQUEST_PATH_EJECT_AFTER_FAILURES: Final = 3
#: How long (ms) an ejected request-path process gets no checks, times the ejections in a row (Envoy's
#: ``base_ejection_time``; capped at :data:`REQUEST_PATH_MAX_EJECTION_MS`). Back in, it is ejected again
#: after :data:`REQUEST_PATH_EJECT_AFTER_FAILURES` more failures.
REQUEST_PATH_EJECTION_MS: Final = 10_000
REQUEST_PATH_MAX_EJECTION_MS: Final = 60_000


def request_path_outlier_detection() -> outlier_detection_pb2.OutlierDetection:
    """The outlier detection of the request-path cluster (``inferlb_ext_authz`` / ``inferlb_ext_proc``): a
    process that is down (``extra_listen``'s or ``listen``'s, killed or not started) is ejected after
    :data:`REQUEST_PATH_EJECT_AFTER_FAILURES` connection failures in a row, so Envoy stops sending it checks
    (without it, Envoy's round robin keeps sending it every other check). Local-origin errors are counted
    apart (``split_external_local_origin_errors``: connect failure, timeout, reset), and only they eject:
    the service never answers 5xx (ext_authz refusals are 4xx, or 403 + ``x-inferlb-status``), and
    ext_proc's answers are gRPC over HTTP 200. ``max_ejection_percent`` 100: with every process down,
    Envoy's panic mode sends to all anyway. Envoy docs, "Outlier detection" (local origin errors)."""
    off = wrappers_pb2.UInt32Value(value=0)
    return outlier_detection_pb2.OutlierDetection(
        split_external_local_origin_errors=True,
        consecutive_local_origin_failure=wrappers_pb2.UInt32Value(value=REQUEST_PATH_EJECT_AFTER_FAILURES),
        enforcing_consecutive_local_origin_failure=wrappers_pb2.UInt32Value(value=100),
        # the HTTP-status and success-rate detectors stay off (see above)
        enforcing_consecutive_5xx=off,
        enforcing_consecutive_gateway_failure=off,
        enforcing_success_rate=off,
        enforcing_local_origin_success_rate=off,
        enforcing_failure_percentage=off,
        enforcing_failure_percentage_local_origin=off,
        base_ejection_time=duration_ms(REQUEST_PATH_EJECTION_MS),
        max_ejection_time=duration_ms(REQUEST_PATH_MAX_EJECTION_MS),
        max_ejection_percent=wrappers_pb2.UInt32Value(value=100),
    )


def _http2_protocol_options() -> dict[str, any_pb2.Any]:
    opts = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": pack(opts)}


_LB_POLICY: Final[Mapping[str, int]] = {
    "least_request": cluster_pb2.Cluster.LEAST_REQUEST,
    "round_robin": cluster_pb2.Cluster.ROUND_ROBIN,
    "ring_hash": cluster_pb2.Cluster.RING_HASH,
    "maglev": cluster_pb2.Cluster.MAGLEV,
}


def _thresholds(priority: int, cb: CircuitBreaker) -> circuit_breaker_pb2.CircuitBreakers.Thresholds:
    return circuit_breaker_pb2.CircuitBreakers.Thresholds(
        priority=priority,
        max_connections=wrappers_pb2.UInt32Value(value=cb.max_connections),
        max_pending_requests=wrappers_pb2.UInt32Value(value=cb.max_pending_requests),
        max_requests=wrappers_pb2.UInt32Value(value=cb.max_requests),
        max_retries=wrappers_pb2.UInt32Value(value=cb.max_retries),
        # remaining_* gauges let `inferlb status` show how close a cluster is to tripping
        track_remaining=True,
    )


def build_model_cluster(
    name: str, policy: ClusterPolicy, *, picking: HostSource | None = None
) -> cluster_pb2.Cluster:
    """One EDS Cluster for one model version, every resilience knob set explicitly from ``policy``; with
    ``picking`` (the model's ``endpoint_picking`` on: where the request path puts its hosts) its load
    balancing is :func:`override_host_policy`.

    Envoy's defaults differ from what inference needs (Envoy docs, outlier detection and
    ``healthy_panic_threshold``): gateway-failure enforcement
    defaults to 0% and the panic threshold to 50%, so both are always sent.
    """
    od = policy.outlier_detection
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=ads_source()),
        connect_timeout=duration_ms(policy.connect_timeout_ms),
        lb_policy=_LB_POLICY[policy.lb_policy],
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            healthy_panic_threshold=percent_pb2.Percent(value=policy.healthy_panic_threshold),
            # Envoy's default window (1 s) delays an ejection or a failed health check by up to that long
            update_merge_window=duration_ms(policy.update_merge_window_ms),
        ),
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx=wrappers_pb2.UInt32Value(value=od.consecutive_5xx),
            enforcing_consecutive_5xx=wrappers_pb2.UInt32Value(value=100),
            consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=od.consecutive_gateway_failure),
            enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(
                value=od.enforcing_consecutive_gateway_failure
            ),
            interval=duration_ms(od.interval_ms),
            base_ejection_time=duration_ms(od.base_ejection_time_ms),
            max_ejection_percent=wrappers_pb2.UInt32Value(value=od.max_ejection_percent),
            failure_percentage_threshold=wrappers_pb2.UInt32Value(value=od.failure_percentage_threshold),
            enforcing_failure_percentage=wrappers_pb2.UInt32Value(value=od.enforcing_failure_percentage),
            failure_percentage_minimum_hosts=wrappers_pb2.UInt32Value(
                value=od.failure_percentage_minimum_hosts
            ),
            failure_percentage_request_volume=wrappers_pb2.UInt32Value(
                value=od.failure_percentage_request_volume
            ),
        ),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                _thresholds(base_pb2.RoutingPriority.DEFAULT, policy.circuit_breaker_default),
                _thresholds(base_pb2.RoutingPriority.HIGH, policy.circuit_breaker_high),
            ]
        ),
    )
    if policy.lb_policy == "least_request":
        cluster.least_request_lb_config.active_request_bias.CopyFrom(
            base_pb2.RuntimeDouble(
                default_value=policy.active_request_bias, runtime_key=f"inferlb.{name}.active_request_bias"
            )
        )
    if policy.slow_start_window_ms:
        slow = cluster_pb2.Cluster.SlowStartConfig(
            slow_start_window=duration_ms(policy.slow_start_window_ms),
            aggression=base_pb2.RuntimeDouble(
                default_value=policy.slow_start_aggression,
                runtime_key=f"inferlb.{name}.slow_start_aggression",
            ),
            min_weight_percent=percent_pb2.Percent(value=policy.slow_start_min_weight_percent),
        )
        # the config validator allows slow start with these two policies only
        if policy.lb_policy == "least_request":
            cluster.least_request_lb_config.slow_start_config.CopyFrom(slow)
        else:
            cluster.round_robin_lb_config.slow_start_config.CopyFrom(slow)
    if policy.lb_policy in HASH_LB_POLICIES:
        # bounded load: a hot key spills to the next host on the ring instead of overloading one GPU
        cluster.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value = (
            policy.hash_balance_factor
        )
    if policy.locality_weighted:
        cluster.common_lb_config.locality_weighted_lb_config.SetInParent()
    if picking:
        # the typed policy replaces lb_policy and its *_lb_config (Envoy ignores them beside it); the
        # fallback carries bias, slow start and locality weighting instead
        cluster.ClearField("lb_policy")
        cluster.ClearField("least_request_lb_config")
        cluster.ClearField("round_robin_lb_config")
        cluster.common_lb_config.ClearField("locality_weighted_lb_config")
        cluster.load_balancing_policy.CopyFrom(override_host_policy(name, policy, picking))
    if policy.length_aware is not None and not picking:
        # a picking model's picker keeps long requests on their class's hosts itself
        # (ext_proc.picking.class_hosts): Envoy 1.40 refuses load_balancing_policy beside lb_subset_config
        # ("cannot be combined"), so its fallback balances over every endpoint
        cluster.lb_subset_config.CopyFrom(length_aware_subsets(policy))
    hc = policy.health_check
    if hc is not None:
        cluster.health_checks.append(health_check(hc))
        # With active health checking Envoy keeps a host that left EDS while it still passes its checks
        # (service discovery docs, "eventually consistent"): a deregistered or drained-out GPU would keep
        # its traffic. The fleet API's word wins.
        cluster.ignore_health_on_host_removal = True
    return cluster


def _slow_start(name: str, policy: ClusterPolicy) -> lb_common_pb2.SlowStartConfig | None:
    if not policy.slow_start_window_ms:
        return None
    return lb_common_pb2.SlowStartConfig(
        slow_start_window=duration_ms(policy.slow_start_window_ms),
        aggression=base_pb2.RuntimeDouble(
            default_value=policy.slow_start_aggression, runtime_key=f"inferlb.{name}.slow_start_aggression"
        ),
        min_weight_percent=percent_pb2.Percent(value=policy.slow_start_min_weight_percent),
    )


def fallback_policy(name: str, policy: ClusterPolicy) -> extension_pb2.TypedExtensionConfig:
    """The cluster's own balancing as a typed load-balancing extension: ``least_request`` (Envoy's weighted
    least request, ``active_request_bias`` as the legacy field's) or ``round_robin``, with slow start and
    locality-weighted balancing when the policy sets them.

    Raises:
        ValueError: a hash policy (``ring_hash``/``maglev``); the config refuses it with endpoint picking.
    """
    locality = (
        lb_common_pb2.LocalityLbConfig(
            locality_weighted_lb_config=lb_common_pb2.LocalityLbConfig.LocalityWeightedLbConfig()
        )
        if policy.locality_weighted
        else None
    )
    slow = _slow_start(name, policy)
    if policy.lb_policy == "least_request":
        lr = least_request_pb2.LeastRequest(
            active_request_bias=base_pb2.RuntimeDouble(
                default_value=policy.active_request_bias, runtime_key=f"inferlb.{name}.active_request_bias"
            ),
            slow_start_config=slow,
            locality_lb_config=locality,
        )
        return extension_pb2.TypedExtensionConfig(
            name="envoy.load_balancing_policies.least_request", typed_config=pack(lr)
        )
    if policy.lb_policy == "round_robin":
        rr = round_robin_pb2.RoundRobin(slow_start_config=slow, locality_lb_config=locality)
        return extension_pb2.TypedExtensionConfig(
            name="envoy.load_balancing_policies.round_robin", typed_config=pack(rr)
        )
    raise ValueError(f"no override_host fallback for lb_policy {policy.lb_policy}")


#: Where a picking model's hosts are read from: the header, or the ``envoy.lb`` dynamic metadata.
HostSource = Literal["header", "metadata"]


def host_source(config: Config) -> HostSource:
    """Where the request path puts its picks for Envoy: ext_proc mode writes the ``envoy.lb`` metadata (and
    the header, for the model server to see), ext_authz mode only the header (its filter writes only its
    own namespace)."""
    return "metadata" if config.ext_proc.protocol == "ext_proc" else "header"


def override_host_policy(
    name: str, policy: ClusterPolicy, source: HostSource
) -> cluster_pb2.LoadBalancingPolicy:
    """The ``load_balancing_policy`` of a picking model's cluster: Envoy's
    ``envoy.load_balancing_policies.override_host`` (API ``extensions.load_balancing_policies.override_host
    .v3.OverrideHost``, built for endpoint pickers), reading the hosts from ``source``: the header
    :data:`~inferlb.request.headers.DESTINATION_ENDPOINT` or dynamic metadata ``envoy.lb`` /
    ``x-gateway-destination-endpoint``, as the Gateway API Inference Extension's protocol names them, and
    falling back to :func:`fallback_policy` (the cluster's own weighted least request or round robin).

    Envoy sends the request to the first listed host it holds in the cluster and each retry to the next
    listed one; a host it does not hold is skipped, and with none left (or no list at all: a request the
    picker did not see, one that failed open) the fallback picks as for any cluster, so EDS weights,
    health checks, outlier detection, circuit breakers and retries keep working around a pick. One
    source, not both: Envoy 1.40 joins the lists of every source it finds (measured: header ``A,B`` and
    metadata ``C`` were tried A, B, C), so the same list in both would be walked twice, a retry going back
    to the first host instead of to the fallback.
    """
    if source == "header":
        oh_source = override_host_pb2.OverrideHost.OverrideHostSource(header=headers.DESTINATION_ENDPOINT)
    else:
        oh_source = override_host_pb2.OverrideHost.OverrideHostSource(
            metadata=metadata_pb2.MetadataKey(
                key=headers.DESTINATION_ENDPOINT_NAMESPACE,
                path=[metadata_pb2.MetadataKey.PathSegment(key=headers.DESTINATION_ENDPOINT)],
            )
        )
    oh = override_host_pb2.OverrideHost(
        override_host_sources=[oh_source],
        fallback_policy=cluster_pb2.LoadBalancingPolicy(
            policies=[
                cluster_pb2.LoadBalancingPolicy.Policy(typed_extension_config=fallback_policy(name, policy))
            ]
        ),
    )
    return cluster_pb2.LoadBalancingPolicy(
        policies=[
            cluster_pb2.LoadBalancingPolicy.Policy(
                typed_extension_config=extension_pb2.TypedExtensionConfig(
                    name="envoy.load_balancing_policies.override_host", typed_config=pack(oh)
                )
            )
        ]
    )


def health_check(hc: HealthCheck) -> health_check_pb2.HealthCheck:
    """The Envoy ``HealthCheck`` of a model cluster: ``GET hc.path`` must answer 200 within ``timeout``
    (a check that times out fails, so a hung server is found), every ``interval`` plus up to
    ``interval_jitter``; ``unhealthy_threshold`` failures in a row take the host out, ``healthy_threshold``
    passes bring it back; ``no_traffic_interval`` while the cluster has had no traffic."""
    return health_check_pb2.HealthCheck(
        timeout=duration_ms(hc.timeout_ms),
        interval=duration_ms(hc.interval_ms),
        interval_jitter=duration_ms(hc.interval_jitter_ms),
        no_traffic_interval=duration_ms(hc.no_traffic_interval_ms),
        unhealthy_threshold=wrappers_pb2.UInt32Value(value=hc.unhealthy_threshold),
        healthy_threshold=wrappers_pb2.UInt32Value(value=hc.healthy_threshold),
        http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path=hc.path),
    )


def length_aware_subsets(policy: ClusterPolicy) -> cluster_pb2.Cluster.LbSubsetConfig:
    """The ``lb_subset_config`` of a length-aware model's clusters (:mod:`inferlb.policy.length_aware`).

    One selector on the endpoints' ``envoy.lb`` key ``gpu_tier`` (two tiers), or ``length_classes`` with
    ``list_as_any`` (tiered: an endpoint lists every class it may serve, and a route's value matches any
    element, so the overlapping sets of the classes need one selector); fallback ``ANY_ENDPOINT``, so a
    route without ``metadata_match`` (short requests) and a confined request whose subset is empty are
    balanced over every endpoint (``NO_FALLBACK``, Envoy's default, would fail them as if the cluster had
    no hosts). Each subset runs the cluster's own ``lb_policy`` with its weights. Verified against Envoy
    1.40 (tests/e2e/test_length_aware_envoy.py), which accepts the cluster field with the legacy
    ``lb_policy`` enum; the typed ``envoy.load_balancing_policies.subset`` policy would also need the inner
    policy restated as an extension.
    """
    subset = cluster_pb2.Cluster.LbSubsetConfig
    length_aware = policy.length_aware
    if length_aware is None:
        raise ValueError("length_aware_subsets needs a cluster policy with length_aware set")
    return subset(
        fallback_policy=subset.ANY_ENDPOINT,
        subset_selectors=[subset.LbSubsetSelector(keys=[subset_key(length_aware)])],
        list_as_any=length_aware.tiers is not None,
        # with locality-weighted balancing, a subset keeps picking the locality first by its weight
        locality_weight_aware=policy.locality_weighted,
    )


def _static_endpoints(name: str, addresses: Sequence[GrpcAddress]) -> endpoint_pb2.ClusterLoadAssignment:
    """The load assignment of cluster ``name``: one locality with ``addresses`` in order."""
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                lb_endpoints=[
                    endpoint_components_pb2.LbEndpoint(
                        endpoint=endpoint_components_pb2.Endpoint(address=grpc_service_address(a))
                    )
                    for a in addresses
                ]
            )
        ],
    )


def _service_tls(
    config: Config, dialled: Sequence[GrpcAddress], *, alpn: Sequence[str]
) -> base_pb2.TransportSocket | None:
    """The mutual TLS of a cluster that dials the request-path processes (``ext_proc.tls``; None without
    it): :func:`xds_server.resources.transport_sockets.upstream_tls_context` over ``dialled``."""
    tls = config.ext_proc.tls
    if tls is None:
        return None
    return transport_socket(upstream_tls_context(config, tls, dialled, alpn=alpn))


def build_ext_proc_cluster(config: Config) -> cluster_pb2.Cluster:
    """The ``inferlb_ext_proc`` cluster: HTTP/2 (Envoy 1.40 500s every request over HTTP/1.1, measured
    here), one endpoint per ext_proc process where Envoy dials it (``ext_proc.advertise``, else ``listen``;
    then ``extra_listen``: :meth:`~inferlb.config.schema.ExtProcConfig.dial_addresses`),
    STATIC for IP literals, else STRICT_DNS (each address a name resolves to is an endpoint, so the pods
    of a headless Kubernetes Service each get Envoy's connections; LOGICAL_DNS would dial one); with
    ``ext_proc.listen_unix`` its one endpoint is that socket as a ``pipe`` address (STATIC).

    With ``ext_proc.protocol: ext_authz`` it is ``inferlb_ext_authz`` instead, on the same addresses, over
    HTTP/1.1 (Envoy's HTTP authorization client; Envoy pools several keep-alive connections per endpoint
    and worker, one check in flight on each).

    Both get :func:`request_path_outlier_detection` (a dead process stops getting requests) and lift
    ``max_retries`` with the other bounds (ext_authz retries a check that never reached a process on
    another one: :func:`xds_server.resources.listener.build_ext_authz_filter`)."""
    authz = config.ext_proc.protocol == "ext_authz"
    addresses = config.ext_proc.dial_addresses()
    if all(isinstance(a, UnixSocket) or a.is_ip for a in addresses):
        kind = cluster_pb2.Cluster.STATIC
    else:  # every address a name resolves to is an endpoint (a headless Service: one per replica)
        kind = cluster_pb2.Cluster.STRICT_DNS
    name = EXT_AUTHZ_CLUSTER if authz else EXT_PROC_CLUSTER
    return cluster_pb2.Cluster(
        name=name,
        type=kind,
        connect_timeout=duration_ms(EXT_PROC_CONNECT_TIMEOUT_MS),
        typed_extension_protocol_options=None if authz else _http2_protocol_options(),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    priority=p,
                    max_connections=wrappers_pb2.UInt32Value(value=EXT_PROC_MAX_REQUESTS),
                    max_pending_requests=wrappers_pb2.UInt32Value(value=EXT_PROC_MAX_REQUESTS),
                    max_requests=wrappers_pb2.UInt32Value(value=EXT_PROC_MAX_REQUESTS),
                    max_retries=wrappers_pb2.UInt32Value(value=EXT_PROC_MAX_REQUESTS),
                )
                for p in (base_pb2.RoutingPriority.DEFAULT, base_pb2.RoutingPriority.HIGH)
            ]
        ),
        outlier_detection=request_path_outlier_detection(),
        load_assignment=_static_endpoints(name, addresses),
        transport_socket=_service_tls(config, addresses, alpn=() if authz else GRPC_ALPN),
    )


def build_clusters(config: Config) -> list[cluster_pb2.Cluster]:
    """Every Cluster: one EDS cluster per model version (config order), then ``inferlb_ext_proc`` (or
    ``inferlb_ext_authz``, and the settlers' clusters when ext_authz mode meters responses)."""
    out = [
        build_model_cluster(
            m.cluster_name(v.name),
            m.cluster,
            picking=host_source(config) if m.endpoint_picking.enabled else None,
        )
        for m in config.models
        for v in m.versions
    ]
    out.append(build_ext_proc_cluster(config))
    out += build_meter_clusters(config)
    return out


def build_meter_clusters(config: Config) -> list[cluster_pb2.Cluster]:
    """One cluster per request-path process's settler (``ext_proc.protocol: ext_authz`` with
    ``account_responses``; else none), in process order: ``inferlb_meter`` on ``ext_proc.meter_advertise``
    (else ``meter_listen``),
    then ``inferlb_meter_<i + 1>`` on each ``extra_meter_listen`` address
    (:meth:`~inferlb.config.schema.ExtProcConfig.meter_dial_addresses`,
    :func:`~xds_server.resources.common.meter_cluster_name`): the gRPC access-log service, HTTP/2, STATIC
    for an IP literal, else LOGICAL_DNS. One endpoint each, so an entry reaches the process that holds its
    reservation (:func:`xds_server.resources.listener.build_meter_access_logs`). Envoy keeps one access-log
    stream per worker on each."""
    if not config.ext_proc.meters_access_log():
        return []
    out = []
    for process, addr in enumerate(config.ext_proc.meter_dial_addresses()):
        name = meter_cluster_name(process)
        out.append(
            cluster_pb2.Cluster(
                name=name,
                type=cluster_pb2.Cluster.STATIC if addr.is_ip else cluster_pb2.Cluster.LOGICAL_DNS,
                connect_timeout=duration_ms(EXT_PROC_CONNECT_TIMEOUT_MS),
                typed_extension_protocol_options=_http2_protocol_options(),
                load_assignment=_static_endpoints(name, (addr,)),
                transport_socket=_service_tls(config, (addr,), alpn=GRPC_ALPN),
            )
        )
    return out
