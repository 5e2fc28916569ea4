"""ext_authz mode's metering in config and Envoy resources: ``account_responses`` and tenant
``max_concurrent_requests`` are accepted with ``protocol: ext_authz`` (the access log meters), the refusals
that remain name their field, and the gateway gets the meter id as dynamic metadata (never upstream), the
response Lua filter, the metadata-filtered batched gRPC access log and its HTTP/2 cluster; without
metering none of that is built."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.common.matching.v3 import extension_matcher_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.type.matcher.v3 import http_inputs_pb2

from ext_proc.handlers import Gateway
from inferlb.config.schema import default_config_path, parse_config
from inferlb.errors import ConfigError
from inferlb.policy.settlement import meter_id_prefix
from inferlb.request import headers
from xds_server import resources as r
from xds_server.resources.clusters import build_clusters
from xds_server.resources.common import METER_CLUSTER


def authz_doc(**ext_proc: Any) -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["ext_proc"].update(protocol="ext_authz", **ext_proc)
    return doc


def hcm_of(doc: dict[str, Any]) -> http_connection_manager_pb2.HttpConnectionManager:
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert r.build_listener(parse_config(doc)).filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def lua_sources(hcm: http_connection_manager_pb2.HttpConnectionManager) -> list[str]:
    """The source of each Lua filter of ``hcm`` in chain order; the splice filter's behind its matcher,
    which skips it on requests without body splices."""
    out = []
    for f in hcm.http_filters:
        lua = lua_pb2.Lua()
        wrapped = extension_matcher_pb2.ExtensionWithMatcher()
        if f.typed_config.Unpack(wrapped):
            if not wrapped.extension_config.typed_config.Unpack(lua):
                continue
            predicate = wrapped.xds_matcher.matcher_list.matchers[0].predicate
            header = http_inputs_pb2.HttpRequestHeaderMatchInput()
            assert predicate.not_matcher.single_predicate.input.typed_config.Unpack(header)
            assert header.header_name == headers.BODY_SPLICE
        elif not f.typed_config.Unpack(lua):
            continue
        out.append(lua.default_source_code.inline_string)
    return out


def test_metering_and_concurrency_limits_are_accepted_in_ext_authz_mode() -> None:
    doc = authz_doc()
    doc["tenants"][0]["max_concurrent_requests"] = 3
    config = parse_config(doc)
    assert config.ext_proc.account_responses and config.ext_proc.meters_access_log()
    assert ("ext_proc.meter_listen", config.ext_proc.meter_listen) in config.listen_sockets()
    # Envoy meters: streams still get include_usage (Envoy's Lua filter hides the chunk again); low is
    # shed by the in-flight count the settlements keep (ext_authz.meter)
    gateway = Gateway.from_config(config)
    assert gateway.asks_usage
    assert not gateway.account_responses and gateway.low_priority_limits
    unmetered = Gateway.from_config(parse_config(authz_doc(account_responses=False)))
    assert dict(unmetered.low_priority_limits) == {}


def test_what_ext_authz_cannot_meter_is_refused_by_field() -> None:
    doc = authz_doc(account_responses=False)
    doc["tenants"][0]["max_concurrent_requests"] = 3
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert "tenants[0].max_concurrent_requests" in str(info.value)


def test_a_metered_gateway_logs_metered_requests_to_the_settler() -> None:
    doc = authz_doc(meter_flush_interval_ms=250, meter_buffer_bytes=8192)
    hcm = hcm_of(doc)
    [log] = hcm.access_log
    assert log.name == "envoy.access_loggers.http_grpc"
    assert log.filter.metadata_filter.matcher.filter == "envoy.filters.http.ext_authz"
    assert [p.key for p in log.filter.metadata_filter.matcher.path] == [headers.METER]
    # one process: its ids' prefix, and no entry for a request without an id
    assert log.filter.metadata_filter.matcher.value.string_match.prefix == meter_id_prefix(0)
    assert log.filter.metadata_filter.match_if_key_not_found.value is False
    assert log.filter.metadata_filter.HasField("match_if_key_not_found")
    grpc_log = als_pb2.HttpGrpcAccessLogConfig()
    assert log.typed_config.Unpack(grpc_log)
    common = grpc_log.common_config
    assert common.grpc_service.envoy_grpc.cluster_name == METER_CLUSTER
    assert common.buffer_flush_interval.ToMilliseconds() == 250
    assert common.buffer_size_bytes.value == 8192
    authz = ext_authz_pb2.ExtAuthz()
    assert hcm.http_filters[0].typed_config.Unpack(authz)
    response = authz.http_service.authorization_response
    names = [p.exact for p in response.dynamic_metadata_from_headers.patterns]
    assert names == [headers.METER, headers.USAGE_ADDED, headers.STATUS]
    assert headers.METER not in [p.exact for p in response.allowed_upstream_headers.patterns]
    # the splice filter (request half, skipped without splices) and the metering filter (response half)
    splice, meter_lua = lua_sources(hcm)
    assert "function envoy_on_request" in splice and "envoy_on_response" not in splice
    assert "function envoy_on_response" in meter_lua and "envoy_on_request" not in meter_lua
    [meter] = [c for c in build_clusters(parse_config(doc)) if c.name == METER_CLUSTER]
    assert meter.type == cluster_pb2.Cluster.STATIC
    assert "envoy.extensions.upstreams.http.v3.HttpProtocolOptions" in meter.typed_extension_protocol_options


def test_an_unmetered_gateway_has_no_access_log_nor_response_scan() -> None:
    doc = authz_doc(account_responses=False)
    hcm = hcm_of(doc)
    assert list(hcm.access_log) == []
    [splice] = lua_sources(hcm)
    assert "envoy_on_response" not in splice
    assert METER_CLUSTER not in {c.name for c in build_clusters(parse_config(doc))}
