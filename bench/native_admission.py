"""What an Envoy-native admission path would cost: no per-request side call, admission by Envoy's own C++
filters, beside Envoy alone and the ext_authz metered gateway, in one run. A measurement for a design
decision, not a mode of the gateway (nothing here is served by ``inferlb up``).

Run: ``.venv/bin/python bench/native_admission.py [--duration 3] [--rounds 3] [--connections 1,16,64]``
(needs ``wrk`` and ``nginx``). Prints one table; not a test.

Every cell is an Envoy (2 workers) on a static bootstrap built as ``bench/authz_envoy_split.py`` builds its
pieces (the gateway's own listener, routes and clusters, endpoints inline), in front of the same nginx
backend, with one real ``python -m ext_authz`` process (the checks of the ext_authz cell, and the settler's
gRPC access-log service of every metered cell):

- ``envoy alone``: the gateway listener cut to the router and one catch-all route (``router only`` of the
  split);
- ``ext_authz metered``: the production listener (``ext_proc.protocol: ext_authz``, ``account_responses``):
  one HTTP check per request, the Lua filters, the gRPC access log;
- ``native: key + body routing``: the production listener of a config that fails open on every path,
  with the ext_authz filters removed: every request takes the fail-open path the gateway already has
  (``transform`` reads the body's ``model`` into a routing header, routes match it, an alias is written
  canonical; ``api_key_auth`` maps the key to the tenant name and forwards it in
  :data:`CLIENT_HEADER`, the key removed upstream);
- ``native + local_ratelimit``: plus Envoy's ``local_ratelimit`` with one token bucket per tenant
  (descriptor ``client`` = :data:`CLIENT_HEADER`, set far above the load so nothing is refused): a
  request-count limit per Envoy worker-shared bucket, no tokens;
- ``native + rate_limit_quota``: Envoy's ``rate_limit_quota`` filter in place of ``local_ratelimit``, one
  bucket per tenant (bucket id ``{name: tenant, client: <CLIENT_HEADER>}``) whose quota a minimal RLQS
  server (:func:`serve_rlqs`, its own Python process, counted in the cell's Python CPU) assigns
  asynchronously: Envoy reports each bucket's usage every :data:`RLQS_REPORT_S` and the server answers
  with a token bucket far above the load; no request waits for it (until the first assignment a bucket
  allows all);
- ``native + ratelimit + metering``: ``native + local_ratelimit`` plus the metering Lua filter (the
  production one, run on every 2xx answer instead of only on a request with a meter id) and the gRPC
  access log to the settler (every entry, with :data:`CLIENT_HEADER`: the settler would charge the tenant
  from it; here it ignores entries without a meter id, so its CPU is the receiving only).

Load: wrk POSTing the ~3 KB chat body of ``bench/gateway_overhead.py`` (repeated prompts), ``--duration`` s
per cell and round, cells shuffled anew every round; medians over the rounds. CPU per request: user +
system of that Envoy, and of the Python process apart (counted only in the cells that use it).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from authz_envoy_split import (
    CHAT_PATH,
    Hcm,
    Sample,
    _copy,
    _drop_filters,
    bootstrap,
    production_hcm,
    start_envoy,
    steps,
    stop_all,
)
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, extension_pb2, grpc_service_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.common.matching.v3 import extension_matcher_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.api_key_auth.v3 import api_key_auth_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.http.rate_limit_quota.v3 import rate_limit_quota_pb2 as rlq_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.type.matcher.v3 import http_inputs_pb2
from envoy.type.v3 import percent_pb2, ratelimit_strategy_pb2, token_bucket_pb2
from extproc_overhead import MODEL, start_listening, wrk
from gateway_overhead import inferlb_config, interleaved, start_nginx, tree_cpu_s, wait_ready, wrk_script
from google.protobuf import duration_pb2, json_format, wrappers_pb2
from rich.console import Console
from rich.table import Table
from xds.core.v3 import extension_pb2 as xds_extension_pb2
from xds.type.matcher.v3 import matcher_pb2

from inferlb.config.schema import Config, HostPort, parse_config
from inferlb.ops.stack import Child, free_ports
from xds_server.resources import listener as lst
from xds_server.resources.clusters import _http2_protocol_options
from xds_server.resources.common import (
    API_KEY_FILTER,
    EXT_AUTHZ_FILTER,
    EXT_AUTHZ_OTHER_MODE_FILTER,
    duration_ms,
    grpc_service_address,
    pack,
)

#: The request header ``api_key_auth`` forwards the tenant name in (the early header mutation removes a
#: client's own ``x-inferlb-*`` headers before any filter, so only Envoy sets it).
CLIENT_HEADER = "x-inferlb-client"
#: The per-tenant bucket of the ``local_ratelimit`` cells (requests per second): far above the load.
BUCKET_PER_S = 10_000_000
LOCAL_RATELIMIT_FILTER = "envoy.filters.http.local_ratelimit"
#: The cells whose Envoy talks to the Python process (checks, access log): its CPU is counted in theirs.
USES_PYTHON = frozenset({"ext_authz metered", "native + rate_limit_quota", "native + ratelimit + metering"})
#: The RLQS cluster of the ``rate_limit_quota`` cell, and the seconds between Envoy's usage reports.
RLQS_CLUSTER = "native_rlqs"
RLQS_REPORT_S = 1
RLQS_DOMAIN = "inferlb"
#: The guard of the production metering Lua filter (a request with a meter id or the usage-added mark),
#: replaced by "meter every 2xx answer" in the native cells.
_METER_GUARD = """  local authz = handle:streamInfo():dynamicMetadata():get(AUTHZ)
  if authz == nil then return end
  local hide = authz[ADDED] ~= nil
  if authz[METER] == nil and not hide then return end
"""


def _forward_client(hcm: Hcm) -> None:
    """``api_key_auth`` forwards the tenant name in :data:`CLIENT_HEADER` and removes the key upstream."""
    forwarding = api_key_auth_pb2.Forwarding(header=CLIENT_HEADER, hide_credentials=True)
    for f in hcm.http_filters:
        if f.name == API_KEY_FILTER:
            wrapped = extension_matcher_pb2.ExtensionWithMatcher()
            assert f.typed_config.Unpack(wrapped)
            auth = api_key_auth_pb2.ApiKeyAuth()
            assert wrapped.extension_config.typed_config.Unpack(auth)
            auth.forwarding.CopyFrom(forwarding)
            wrapped.extension_config.typed_config.CopyFrom(pack(auth))
            f.typed_config.CopyFrom(pack(wrapped))
    # the virtual host's per-route config (the tenants' keys) carries its own forwarding, and wins
    for vh in hcm.route_config.virtual_hosts:
        if API_KEY_FILTER in vh.typed_per_filter_config:
            wrapper = route_components_pb2.FilterConfig()
            assert vh.typed_per_filter_config[API_KEY_FILTER].Unpack(wrapper)
            per_route = api_key_auth_pb2.ApiKeyAuthPerRoute()
            assert wrapper.config.Unpack(per_route)
            per_route.forwarding.CopyFrom(forwarding)
            wrapper.config.CopyFrom(pack(per_route))
            vh.typed_per_filter_config[API_KEY_FILTER].CopyFrom(pack(wrapper))
            return
    raise RuntimeError("the routes have no fail-open API key config")


def native_hcm(config: Config) -> Hcm:
    """The production listener of ``config`` (which fails open everywhere) without its ext_authz filters,
    the splice Lua filter, the metering Lua filter and the access log: the fail-open path alone."""
    hcm = production_hcm(config)
    _drop_filters(hcm, {EXT_AUTHZ_FILTER, EXT_AUTHZ_OTHER_MODE_FILTER, lst.LUA_FILTER, lst.METER_LUA_FILTER})
    hcm.ClearField("access_log")
    _forward_client(hcm)
    return hcm


def local_ratelimit(tenants: list[str], per_s: int = BUCKET_PER_S) -> hcm_pb2.HttpFilter:
    """Envoy's ``local_ratelimit`` with one bucket of ``per_s`` requests per second per tenant (descriptor
    ``client`` from :data:`CLIENT_HEADER`), enforced on every request; the default bucket (a request
    without the header, none here: ``api_key_auth`` refused it) is :data:`BUCKET_PER_S`, so a small
    ``per_s`` that refuses shows the tenant's descriptor matched."""
    every = base_pb2.RuntimeFractionalPercent(
        default_value=percent_pb2.FractionalPercent(
            numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED
        )
    )
    second = duration_pb2.Duration(seconds=1)
    bucket, default = (
        token_bucket_pb2.TokenBucket(
            max_tokens=n, tokens_per_fill=wrappers_pb2.UInt32Value(value=n), fill_interval=second
        )
        for n in (per_s, BUCKET_PER_S)
    )
    action = route_components_pb2.RateLimit.Action(
        request_headers=route_components_pb2.RateLimit.Action.RequestHeaders(
            header_name=CLIENT_HEADER, descriptor_key="client"
        )
    )
    rl = local_rate_limit_pb2.LocalRateLimit(
        stat_prefix="native_tenant",
        token_bucket=default,
        filter_enabled=every,
        filter_enforced=every,
        descriptors=[
            ratelimit_pb2.LocalRateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="client", value=t)], token_bucket=bucket
            )
            for t in tenants
        ],
        rate_limits=[route_components_pb2.RateLimit(actions=[action])],
    )
    return hcm_pb2.HttpFilter(name=LOCAL_RATELIMIT_FILTER, typed_config=pack(rl))


def rate_limit_quota() -> hcm_pb2.HttpFilter:
    """Envoy's ``rate_limit_quota`` filter: a request with :data:`CLIENT_HEADER` falls in bucket
    ``{name: tenant, client: <header>}``, reported to the RLQS server on :data:`RLQS_CLUSTER` every
    :data:`RLQS_REPORT_S`; allowed until the server's first assignment (Envoy docs, "Rate Limit Quota")."""
    settings = rlq_pb2.RateLimitQuotaBucketSettings
    client = extension_pb2.TypedExtensionConfig(
        name="client",
        typed_config=pack(http_inputs_pb2.HttpRequestHeaderMatchInput(header_name=CLIENT_HEADER)),
    )
    bucket = settings(
        bucket_id_builder=settings.BucketIdBuilder(
            bucket_id_builder={
                "name": settings.BucketIdBuilder.ValueBuilder(string_value="tenant"),
                "client": settings.BucketIdBuilder.ValueBuilder(custom_value=client),
            }
        ),
        reporting_interval=duration_pb2.Duration(seconds=RLQS_REPORT_S),
        no_assignment_behavior=settings.NoAssignmentBehavior(
            fallback_rate_limit=ratelimit_strategy_pb2.RateLimitStrategy(
                blanket_rule=ratelimit_strategy_pb2.RateLimitStrategy.ALLOW_ALL
            )
        ),
    )
    matcher = matcher_pb2.Matcher(
        matcher_list=matcher_pb2.Matcher.MatcherList(
            matchers=[
                matcher_pb2.Matcher.MatcherList.FieldMatcher(
                    predicate=lst.header_present(CLIENT_HEADER, "tenant"),
                    on_match=matcher_pb2.Matcher.OnMatch(
                        action=xds_extension_pb2.TypedExtensionConfig(
                            name="bucket", typed_config=pack(bucket)
                        )
                    ),
                )
            ]
        )
    )
    config = rlq_pb2.RateLimitQuotaFilterConfig(
        rlqs_server=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=RLQS_CLUSTER)
        ),
        domain=RLQS_DOMAIN,
        bucket_matchers=matcher,
    )
    return hcm_pb2.HttpFilter(name="envoy.filters.http.rate_limit_quota", typed_config=pack(config))


def rlqs_cluster(port: int) -> dict[str, Any]:
    """The static HTTP/2 cluster of the RLQS server on 127.0.0.1:``port`` (bootstrap JSON)."""
    cluster = cluster_pb2.Cluster(
        name=RLQS_CLUSTER,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration_ms(1_000),
        typed_extension_protocol_options=_http2_protocol_options(),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=RLQS_CLUSTER,
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(
                    lb_endpoints=[
                        endpoint_components_pb2.LbEndpoint(
                            endpoint=endpoint_components_pb2.Endpoint(
                                address=grpc_service_address(HostPort(host="127.0.0.1", port=port))
                            )
                        )
                    ]
                )
            ],
        ),
    )
    out: dict[str, Any] = json_format.MessageToDict(cluster)
    return out


class QuotaServer(rlqs_pb2_grpc.RateLimitQuotaServiceServicer):  # type: ignore[misc]  # generated, untyped
    """A minimal RLQS server: every usage report is answered with a token-bucket assignment of ``per_s``
    requests per second for each bucket reported (a real one would size it from the tenant's quota and
    the usage every Envoy reports); counts the reports."""

    def __init__(self, per_s: int) -> None:
        self.reports = 0
        self.per_s = per_s

    async def StreamRateLimitQuotas(self, request_iterator: Any, context: Any) -> Any:
        action = rlqs_pb2.RateLimitQuotaResponse.BucketAction
        strategy = ratelimit_strategy_pb2.RateLimitStrategy(
            token_bucket=token_bucket_pb2.TokenBucket(
                max_tokens=self.per_s,
                tokens_per_fill=wrappers_pb2.UInt32Value(value=self.per_s),
                fill_interval=duration_pb2.Duration(seconds=1),
            )
        )
        async for report in request_iterator:
            self.reports += 1
            yield rlqs_pb2.RateLimitQuotaResponse(
                bucket_action=[
                    action(
                        bucket_id=usage.bucket_id,
                        quota_assignment_action=action.QuotaAssignmentAction(
                            assignment_time_to_live=duration_pb2.Duration(seconds=60),
                            rate_limit_strategy=strategy,
                        ),
                    )
                    for usage in report.bucket_quota_usages
                ]
            )


def serve_rlqs(port: int, per_s: int) -> None:
    """Serve :class:`QuotaServer` (``per_s``) on 127.0.0.1:``port`` until killed (``--rlqs-server``)."""
    import grpc  # noqa: PLC0415  # only this mode needs it

    async def main() -> None:
        server = grpc.aio.server()
        rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(QuotaServer(per_s), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _before_router(hcm: Hcm, filters: list[hcm_pb2.HttpFilter]) -> None:
    router = hcm.http_filters.pop()
    hcm.http_filters.extend([*filters, router])


def native_metering(hcm: Hcm, authz_hcm: Hcm) -> None:
    """The metering Lua filter on every 2xx answer and the production access log to the settler, logging
    every entry with :data:`CLIENT_HEADER`."""
    source = lst.meter_lua()
    if _METER_GUARD not in source:
        raise RuntimeError("the metering Lua filter's guard changed: update _METER_GUARD")
    lua = lst._lua(source.replace(_METER_GUARD, "  local hide = false\n"))
    _before_router(hcm, [hcm_pb2.HttpFilter(name=lst.METER_LUA_FILTER, typed_config=pack(lua))])
    for log in authz_hcm.access_log[:1]:
        grpc_log = als_pb2.HttpGrpcAccessLogConfig()
        assert log.typed_config.Unpack(grpc_log)
        grpc_log.additional_request_headers_to_log.append(CLIENT_HEADER)
        out = hcm.access_log.add()
        out.name = log.name
        out.typed_config.CopyFrom(pack(grpc_log))


def cells(authz: Config, native: Config, bucket_per_s: int = BUCKET_PER_S) -> list[tuple[str, Hcm]]:
    """(name, HCM) of each cell of the module docstring (``bucket_per_s``: the tenant bucket's size)."""
    alone = steps(authz)[0]
    assert alone[0] == "router only"
    production = production_hcm(authz)
    base = native_hcm(native)
    limited = _copy(base)
    _before_router(limited, [local_ratelimit([t.name for t in native.tenants], bucket_per_s)])
    quota = _copy(base)
    _before_router(quota, [rate_limit_quota()])
    metered = _copy(limited)
    native_metering(metered, production)
    return [
        ("envoy alone", alone[1]),
        ("ext_authz metered", production),
        ("native: key + body routing", base),
        ("native + local_ratelimit", limited),
        ("native + rate_limit_quota", quota),
        ("native + ratelimit + metering", metered),
    ]


def refused_key(url: str) -> int:
    """The status of one bench request with a key no tenant has (the native cells must answer 401)."""
    host, rest = url.removeprefix("http://").split("/", 1)
    conn = http.client.HTTPConnection(host, timeout=10)
    try:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        conn.request("POST", "/" + rest, body=body, headers={"authorization": "Bearer sk-nobody"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def admin_stat(admin: int, name: str) -> int:
    """The sum of the Envoy admin stats matching the regex ``name``."""
    conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=5)
    try:
        conn.request("GET", f"/stats?filter={name}")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) and print its table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--duration", type=int, default=3, help="seconds per cell and round (1-30)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all cells (1-10)")
    p.add_argument("--connections", default="1,16,64")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--bucket", type=int, default=BUCKET_PER_S, help="the tenant bucket (req/s; small: see it refuse)"
    )
    p.add_argument("--rlqs-server", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rlqs_server:
        serve_rlqs(args.rlqs_server, args.bucket)
        return 0
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            print(f"{tool} not found: apt-get install {tool}", file=sys.stderr)
            return 1
    duration, rounds = max(1, min(args.duration, 30)), max(1, min(args.rounds, 10))
    conns = [int(c) for c in args.connections.split(",")]
    work = Path(tempfile.mkdtemp(prefix="native-admission-"))
    script = wrk_script(work / "repeated.lua", unique=False)
    children: list[Child] = []
    try:
        (backend,) = free_ports(1)
        children.append(start_nginx(work, backend))
        path = inferlb_config(work, "authz", backend, protocol="ext_authz", accounting=True)
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        authz = parse_config(doc)
        native_doc = json.loads(json.dumps(doc))
        native_doc["ext_proc"].update(failure_mode_allow=True)
        native = parse_config(native_doc)
        service = Child(
            "ext_authz",
            [sys.executable, "-m", "ext_authz", "--config", str(path), "--log-level", "warning"],
            work / "ext_authz.log",
        )
        children.append(start_listening(service, authz.ext_proc.listen.port))
        assert service.proc is not None
        service_pid = service.proc.pid
        (rlqs_port,) = free_ports(1)
        rlqs = Child(
            "rlqs",
            [sys.executable, __file__, "--rlqs-server", str(rlqs_port), "--bucket", str(args.bucket)],
            work / "rlqs.log",
        )
        children.append(start_listening(rlqs, rlqs_port))
        assert rlqs.proc is not None
        python_pid = {"native + rate_limit_quota": rlqs.proc.pid}
        envoys: dict[str, tuple[str, int]] = {}
        base = (os.getpid() % 5_000) * 20
        todo = cells(authz, native, args.bucket)
        admins: dict[str, int] = {}
        for i, (name, hcm) in enumerate(todo):
            port, admin = free_ports(2)
            config = native if name.startswith("native") else authz
            boot = bootstrap(config, hcm, port, admin)
            boot["static_resources"]["clusters"].append(rlqs_cluster(rlqs_port))
            child = start_envoy(work, f"envoy-{i}", boot, port, base + i)
            children.append(child)
            assert child.proc is not None
            url = f"http://127.0.0.1:{port}{CHAT_PATH}"
            problem = wait_ready(url, None, 20)
            if problem is not None:
                raise RuntimeError(f"{name} does not answer 200: {problem}\n{child.log_tail(10)}")
            envoys[name] = (url, child.proc.pid)
            admins[name] = admin
            if name.startswith("native") and (status := refused_key(url)) != 401:
                raise RuntimeError(f"{name} answered {status} to an unknown key, not 401")
            wrk(url, script, 4, 1, timeout_s=10)  # warm-up

        def run(cell: tuple[str, str, int]) -> Sample:
            url, pid = envoys[cell[0]]
            python = python_pid.get(cell[0], service_pid)
            before = tree_cpu_s([pid]), tree_cpu_s([python])
            r = wrk(url, script, cell[2], duration, timeout_s=10)
            n = max(r.requests, 1)
            after = tree_cpu_s([pid]), tree_cpu_s([python])
            return Sample(
                result=r,
                envoy_us=(after[0] - before[0]) / n * 1e6,
                service_us=(after[1] - before[1]) / n * 1e6,
            )

        got = interleaved(
            [(name, "repeated", c) for name, _ in todo for c in conns], rounds, random.Random(args.seed), run
        )
        load = os.getloadavg()
        table = Table(
            title=f"Envoy-native admission vs ext_authz: POST {CHAT_PATH}, {duration} s per cell, median of "
            f"{rounds} rounds, cells shuffled per round; load average at the end {load[0]:.1f}/{load[1]:.1f}"
        )
        cols = ["gateway", "conns", "req/s", "p50 ms", "bad", "Envoy us/req", "python us/req", "CPU us/req"]
        cols += ["req/s / alone", "CPU / alone"]
        for col in cols:
            table.add_column(col, justify="left" if col == "gateway" else "right")
        for c in conns:
            alone = got[("envoy alone", "repeated", c)]
            alone_rps = statistics.median(s.result.rps for s in alone)
            alone_cpu = statistics.median(s.envoy_us for s in alone)
            for name, _ in todo:
                samples = got[(name, "repeated", c)]
                share = 1.0 if name in USES_PYTHON else 0.0
                envoy = statistics.median(s.envoy_us for s in samples)
                python = statistics.median(s.service_us * share for s in samples)
                total = statistics.median(s.envoy_us + s.service_us * share for s in samples)
                rps = statistics.median(s.result.rps for s in samples)
                table.add_row(
                    name,
                    str(c),
                    f"{rps:,.0f}",
                    f"{statistics.median(s.result.p50_ms for s in samples):.2f}",
                    str(sum(s.result.non_2xx + s.result.socket_errors for s in samples)),
                    f"{envoy:.0f}",
                    f"{python:.0f}",
                    f"{total:.0f}",
                    f"{rps / alone_rps:.2f}x",
                    f"{total / alone_cpu:.2f}x",
                )
        Console(width=200).print(table)
        checks = {
            name: {
                "ratelimit_ok": admin_stat(admin, "native_tenant.http_local_rate_limit.ok$"),
                "ratelimit_refused": admin_stat(admin, "native_tenant.http_local_rate_limit.rate_limited$"),
                "logs_written": admin_stat(admin, "grpc_access_log.logs_written$"),
                "rlqs_streams": admin_stat(admin, f"cluster.{RLQS_CLUSTER}.upstream_rq_total$"),
            }
            for name, admin in admins.items()
            if name.startswith("native")
        }
        print(json.dumps({"unknown key": 401, **checks}))
        print(json.dumps({"model": MODEL, "connections": conns, "rounds": rounds, "duration_s": duration}))
    finally:
        stop_all(children, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
