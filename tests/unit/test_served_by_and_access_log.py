"""The gateway's served-by response headers, its JSON access log and their inputs, as built protos:
the endpoints' ``inferlb`` metadata, the RouteConfiguration's ``response_headers_to_add``, the listener's
access loggers and ``header_to_metadata`` filter, ``gateway.access_log`` validation, and the usage
metadata ext_proc writes (the e2e test, tests/e2e/test_served_by_and_access_log.py, runs them in Envoy)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.header_to_metadata.v3 import header_to_metadata_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import json_format

from ext_proc.servicer import response_body_continue, with_usage_metadata
from inferlb.config.schema import Config, ConfigError, default_config_path, parse_config
from inferlb.policy.settlement import USAGE_NAMESPACE
from inferlb.request import headers
from inferlb.request.usage import Usage, UsageSource
from xds_server import resources as r
from xds_server.resources import listener as lst
from xds_server.resources.common import EXT_PROC_FILTER


def _doc(**gateway: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["gateway"].update(gateway)
    return doc


def _hcm(config: Config) -> http_connection_manager_pb2.HttpConnectionManager:
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert r.build_listener(config).filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def test_each_endpoint_carries_its_name_and_version_in_metadata() -> None:
    config = parse_config(_doc())
    for cla in r.build_load_assignments(config):
        version = cla.cluster_name.rsplit("--", 1)[1]
        for loc in cla.endpoints:
            for lb in loc.lb_endpoints:
                meta = lb.metadata.filter_metadata[r.METADATA_NAMESPACE]
                assert meta["version"] == version
                assert meta["name"] in {e.display_name for e in config.endpoints}


def test_every_route_answers_with_the_served_by_headers() -> None:
    rc = r.build_route_configuration(parse_config(_doc()))
    added = {o.header.key: (o.header.value, o.append_action) for o in rc.response_headers_to_add}
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert added == {
        headers.ENDPOINT: ("%UPSTREAM_METADATA(inferlb:name)%", overwrite),
        headers.MODEL_VERSION: ("%UPSTREAM_METADATA(inferlb:version)%", overwrite),
        headers.UPSTREAM_HOST: ("%UPSTREAM_HOST%", overwrite),
    }


@pytest.mark.parametrize("protocol", ["ext_proc", "ext_authz"])
def test_no_access_log_by_default(protocol: str) -> None:
    doc = _doc()
    doc["ext_proc"]["protocol"] = protocol
    hcm = _hcm(parse_config(doc))
    assert all(a.name == "envoy.access_loggers.http_grpc" for a in hcm.access_log)
    assert "envoy.filters.http.header_to_metadata" not in [f.name for f in hcm.http_filters]


@pytest.mark.parametrize(
    ("path", "name", "proto"),
    [
        ("stdout", "envoy.access_loggers.stdout", stream_pb2.StdoutAccessLog),
        ("/var/log/inferlb/access.log", "envoy.access_loggers.file", file_pb2.FileAccessLog),
    ],
)
def test_access_log_is_envoys_json_logger(path: str, name: str, proto: Any) -> None:
    hcm = _hcm(parse_config(_doc(access_log={"path": path, "format": "json"})))
    [entry] = [a for a in hcm.access_log if a.name == name]
    cfg = proto()
    assert entry.typed_config.Unpack(cfg)
    if proto is file_pb2.FileAccessLog:
        assert cfg.path == path
    fields = json_format.MessageToDict(cfg.log_format.json_format)
    assert fields == lst.ACCESS_LOG_FIELDS
    for field in ("tenant", "model", "version", "endpoint", "status", "prompt_tokens", "completion_tokens",
                  "ttft_ms", "duration_ms", "response_flags"):
        assert field in fields
    # the routing headers are copied to metadata after the request path's filters, before the router
    names = [f.name for f in hcm.http_filters]
    at = names.index("envoy.filters.http.header_to_metadata")
    assert at == len(names) - 2 and names[-1] == "envoy.filters.http.router"
    h2m = header_to_metadata_pb2.Config()
    assert hcm.http_filters[at].typed_config.Unpack(h2m)
    copied = {(rule.header, rule.on_header_present.key) for rule in h2m.request_rules}
    assert copied == {(h, k) for h, k, _ in lst.REQUEST_METADATA}
    spaces = {rule.on_header_present.metadata_namespace for rule in h2m.request_rules}
    assert spaces == {lst.REQUEST_NAMESPACE}
    assert not any(rule.remove for rule in h2m.request_rules)


def test_ext_proc_may_write_the_usage_namespace_only_with_an_access_log() -> None:
    def namespaces(**gateway: Any) -> list[str]:
        doc = _doc(**gateway)
        doc["ext_proc"]["protocol"] = "ext_proc"
        [f] = [f for f in _hcm(parse_config(doc)).http_filters if f.name == EXT_PROC_FILTER]
        cfg = ext_proc_pb2.ExternalProcessor()
        assert f.typed_config.Unpack(cfg)
        return list(cfg.metadata_options.receiving_namespaces.untyped)

    assert namespaces() == []
    assert namespaces(access_log={"path": "stdout"}) == [USAGE_NAMESPACE]


@pytest.mark.parametrize(
    ("value", "problem"),
    [("access.log", "absolute"), ("", "at least 1"), ("-", "absolute")],
)
def test_access_log_path_must_be_stdout_or_absolute(value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_doc(access_log={"path": value}))
    [(field, message)] = err.value.problems
    assert field == "gateway.access_log.path" and problem in message


def test_access_log_format_is_json_only() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_doc(access_log={"path": "stdout", "format": "text"}))
    assert [f for f, _ in err.value.problems] == ["gateway.access_log.format"]


def test_usage_metadata_is_added_to_a_copy() -> None:
    shared = response_body_continue(b"x", b"x")
    usage = Usage(prompt_tokens=17, completion_tokens=5, source=UsageSource.REPORTED)
    out = with_usage_metadata(shared, usage)
    assert json_format.MessageToDict(out.dynamic_metadata) == {
        USAGE_NAMESPACE: {"prompt_tokens": 17.0, "completion_tokens": 5.0}
    }
    assert out.HasField("response_body")
    assert not shared.HasField("dynamic_metadata")  # the shared constant is left alone
    assert isinstance(out, ep.ProcessingResponse)


def test_the_meter_lua_records_the_token_counts() -> None:
    lua = lst.meter_lua()
    assert '"prompt_tokens"%s*:%s*(%d+)' in lua and '"completion_tokens"%s*:%s*(%d+)' in lua
    assert f'meta:set("{USAGE_NAMESPACE}", "prompt_tokens", tonumber(p))' in lua
    assert "@PROMPT@" not in lua and "@COMPLETION@" not in lua
