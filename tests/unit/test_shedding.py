"""Low-priority shedding, the pure parts: the limit (a share of the DEFAULT circuit breaker per ext_proc
process), which priorities count and which are shed, the in-flight count, the per-cluster limits a config
yields and the 503 a shed request gets."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ext_proc import handlers
from ext_proc.handlers import Gateway, PendingRequest, PreparedRequest
from inferlb.config.schema import Priority, parse_config
from inferlb.errors import ConfigError
from inferlb.policy.quota import QuotaBook, limits_from_config
from inferlb.policy.shedding import InFlight, counted, low_priority_limit, sheds
from inferlb.request.parsing import EndpointKind


@given(
    max_requests=st.integers(1, 100_000),
    percent=st.integers(1, 100),
    processes=st.integers(1, 64),
)
def test_the_limit_is_a_share_of_max_requests_per_process_and_never_zero(
    max_requests: int, percent: int, processes: int
) -> None:
    limit = low_priority_limit(max_requests, percent, processes)
    assert 1 <= limit <= max_requests
    # the processes together never hold more than the share (unless the floor of 1 each lifts it)
    assert limit == 1 or limit * processes * 100 <= max_requests * percent
    # and hold all of it but for rounding: one more each would pass it
    assert (limit + 1) * processes * 100 > max_requests * percent


def test_the_limit_by_example() -> None:
    assert low_priority_limit(4096, 50) == 2048
    assert low_priority_limit(4, 50) == 2
    assert low_priority_limit(4, 100) == 4
    assert low_priority_limit(4, 50, processes=2) == 1
    assert low_priority_limit(4, 10) == 1  # an idle cluster always takes a low request


@pytest.mark.parametrize(
    ("max_requests", "percent", "processes"), [(0, 50, 1), (4, 0, 1), (4, 101, 1), (4, 50, 0)]
)
def test_the_limit_refuses_out_of_range_inputs(max_requests: int, percent: int, processes: int) -> None:
    with pytest.raises(ValueError, match="low_priority_limit"):
        low_priority_limit(max_requests, percent, processes)


@given(priority=st.sampled_from(Priority), in_flight=st.integers(0, 10_000), limit=st.integers(1, 10_000))
def test_only_low_is_shed_and_only_at_the_limit(priority: Priority, in_flight: int, limit: int) -> None:
    assert sheds(priority, in_flight, limit) == (priority is Priority.LOW and in_flight >= limit)
    assert counted(priority) == (priority is not Priority.HIGH)


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.booleans()), max_size=200))
def test_in_flight_counts_enters_minus_leaves_never_below_zero(ops: list[tuple[str, bool]]) -> None:
    counts = InFlight()
    model: dict[str, int] = {}
    for cluster, enter in ops:
        if enter:
            counts.enter(cluster)
            model[cluster] = model.get(cluster, 0) + 1
        else:
            counts.leave(cluster)
            model[cluster] = max(0, model.get(cluster, 0) - 1)
        assert counts.get(cluster) == model[cluster]
    # clusters back at 0 are forgotten
    assert counts.snapshot() == {k: v for k, v in model.items() if v}


def _config(**ext_proc: Any) -> Any:
    return parse_config(
        {
            # ext_proc mode's gateway-side low-priority shedding (by in-flight count)
            "ext_proc": {"protocol": "ext_proc", **ext_proc},
            "gateway": {"overflow_retry_after_s": 3},
            "models": [
                {
                    "name": "llama",
                    "versions": [
                        {"name": "v1", "traffic_percent": 90},
                        {"name": "v2", "traffic_percent": 10},
                    ],
                    "cluster": {
                        "circuit_breaker_default": {"max_requests": 10},
                        "low_priority_max_requests_percent": 40,
                    },
                },
                {"name": "qwen"},  # the defaults: 50% of 4096
            ],
            "tenants": [
                {"name": "gold", "api_keys": ["sk-gold-0001"], "priority": "high"},
                {"name": "plain", "api_keys": ["sk-plain-001"]},
                {"name": "bulk", "api_keys": ["sk-bulk-0001"], "priority": "low"},
            ],
        }
    )


def test_the_config_yields_one_limit_per_cluster() -> None:
    assert dict(Gateway.from_config(_config()).low_priority_limits) == {
        "llama--v1": 4,
        "llama--v2": 4,
        "qwen--v1": 2048,
    }
    two = _config(listen="127.0.0.1:18080", extra_listen=["127.0.0.1:18090"])
    assert dict(Gateway.from_config(two).low_priority_limits) == {
        "llama--v1": 2,
        "llama--v2": 2,
        "qwen--v1": 1024,
    }
    # without the response phases nothing tells ext_proc a request ended: no count, no shedding
    assert dict(Gateway.from_config(_config(account_responses=False)).low_priority_limits) == {}


@pytest.mark.parametrize("percent", [0, 101, "50"])
def test_the_percent_is_validated(percent: object) -> None:
    doc = {"models": [{"name": "m", "cluster": {"low_priority_max_requests_percent": percent}}]}
    with pytest.raises((ConfigError, ValueError), match="low_priority_max_requests_percent"):
        parse_config(doc)


def _prepared(gateway: Gateway, key: str) -> PreparedRequest:
    tenant = gateway.routing.authenticate(f"Bearer {key}")
    pending = PendingRequest(tenant=tenant, kind=EndpointKind.CHAT_COMPLETIONS, path="/v1/chat/completions")
    body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}]}).encode()
    prepared = handlers.prepare_body(gateway, pending, body)
    assert isinstance(prepared, PreparedRequest)
    return prepared


def test_a_low_request_at_the_limit_gets_503_overloaded_with_retry_after() -> None:
    gateway = Gateway.from_config(_config())
    low = _prepared(gateway, "sk-bulk-0001")
    assert handlers.shed_low_priority(gateway, low, "llama--v1", 3) is None
    reply = handlers.shed_low_priority(gateway, low, "llama--v1", 4)
    assert reply is not None
    assert reply.status == 503
    assert ("retry-after", "3") in reply.headers
    assert reply.details == handlers.LOW_PRIORITY_SHED_DETAILS
    err = json.loads(reply.body)["error"]
    assert (err["type"], err["code"], err["param"]) == ("server_error", "overloaded", None)
    # default and high are never shed by ext_proc, whatever the count; a cluster without a limit neither
    for key in ("sk-plain-001", "sk-gold-0001"):
        assert handlers.shed_low_priority(gateway, _prepared(gateway, key), "llama--v1", 1000) is None
    assert handlers.shed_low_priority(gateway, low, "unknown--v1", 1000) is None


def test_route_goes_to_the_version_picked_before_admission() -> None:
    gateway = Gateway.from_config(_config())
    prepared = _prepared(gateway, "sk-plain-001")
    decision = handlers.admit(gateway, _book(), prepared, now=0.0, rng=random.Random(0))
    assert isinstance(decision, handlers.ContinueRequest) and decision.admitted is not None
    for version in ("v1", "v2"):
        cont = handlers.route(gateway, prepared, decision.admitted, rng=random.Random(0), version=version)
        assert ("x-inferlb-version", version) in cont.set_headers


def _book() -> QuotaBook:
    return QuotaBook(limits_from_config(_config()), 0.0)
