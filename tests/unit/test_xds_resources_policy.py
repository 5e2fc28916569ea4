"""xds_server.resources, issue 4: priority shedding, local replies, affinity, failure modes, security."""

from __future__ import annotations

import json
from typing import Any

import yaml
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2

from inferlb.config import ClusterPolicy, default_config_path, parse_config
from xds_server import resources as r


def _default_doc() -> dict[str, Any]:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _hcm(listener: listener_pb2.Listener) -> http_connection_manager_pb2.HttpConnectionManager:
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def test_default_priority_budget_is_tighter_than_high() -> None:
    policy = ClusterPolicy()
    low, high = policy.circuit_breaker_default, policy.circuit_breaker_high
    for name in ("max_connections", "max_pending_requests", "max_requests", "max_retries"):
        assert getattr(low, name) < getattr(high, name), name


def test_overflow_reply_is_openai_503_with_retry_after() -> None:
    doc = _default_doc()
    doc["gateway"]["overflow_retry_after_s"] = 3
    mappers = list(_hcm(r.build_listener(parse_config(doc))).local_reply_config.mappers)
    # first match wins: the overflow mapper must come before the generic upstream-failure one
    [overflow] = [m for m in mappers if list(m.filter.response_flag_filter.flags) == [r.OVERFLOW_FLAG]]
    generic = next(m for m in mappers if "UH" in m.filter.response_flag_filter.flags)
    assert mappers.index(overflow) < mappers.index(generic)
    assert overflow.status_code.value == 503
    assert {(h.header.key, h.header.value) for h in overflow.headers_to_add} == {("retry-after", "3")}
    err = json.loads(overflow.body.inline_string)["error"]
    assert (err["type"], err["code"]) == ("server_error", "overloaded")
    assert overflow.body_format_override.content_type == "application/json"
