"""Endpoint picking with length-aware placement: the config takes both, ``GET /v1/picking`` rows carry each
endpoint's length classes, the book answers a class's hosts, and :func:`ext_proc.picking.choose` picks a
long request among its class's hosts only (a short one, or a class with no host, among all)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ext_proc import handlers
from ext_proc.handlers import Gateway, PendingRequest, PreparedRequest
from ext_proc.metrics import ExtProcMetrics
from ext_proc.picking import Picked, PickingState, PickWaiter, choose
from inferlb.config.schema import Config, parse_config
from inferlb.policy.endpoint_book import parse_picking_state
from inferlb.request.parsing import EndpointKind
from xds_server.resources.clusters import build_clusters

FAST, SLOW_1, SLOW_2 = "10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"
CLUSTER = "llama--v1"


def config(length_aware: dict[str, Any] | None = None, queue: dict[str, Any] | None = None) -> Config:
    picking: dict[str, Any] = {"mode": "load"} if queue is None else {"mode": "load", "queue": queue}
    return parse_config(
        {
            "models": [
                {
                    "name": "llama",
                    "context_length": 100_000,
                    "endpoint_picking": picking,
                    "cluster": {"length_aware": length_aware or {"long_output_tokens": 100}},
                }
            ],
            "endpoints": [
                {"address": FAST, "model": "llama", "gpu": "H100"},
                {"address": SLOW_1, "model": "llama", "gpu": "V100"},
                {"address": SLOW_2, "model": "llama", "gpu": "V100"},
            ],
            "tenants": [{"name": "t", "api_keys": ["sk-t-000001"]}],
        }
    )


def test_picking_and_length_aware_placement_go_together() -> None:
    """The picker confines the classes: no lb_subset_config beside the override_host policy (Envoy 1.40
    refuses the two together)."""
    (cluster,) = [c for c in build_clusters(config()) if c.name == CLUSTER]
    assert cluster.HasField("load_balancing_policy") and not cluster.HasField("lb_subset_config")


def state(classes: dict[str, list[str] | None], *, fast_busy: int = 0) -> PickingState:
    picking = PickingState(salt=b"test")
    rows = [
        {"address": a, "weight": 1, "healthy": True, "waiting": 0, "kv_usage": 0, "telemetry_age_ms": 0,
         "length_classes": classes[a]}
        for a in (FAST, SLOW_1, SLOW_2)
    ]  # fmt: skip
    picking.book.update(parse_picking_state({"clusters": {CLUSTER: rows}, "stale_after_ms": 1e9}), now=0.0)
    for _ in range(fast_busy):
        picking.book.enter(FAST)
    return picking


def prepared(cfg: Config, max_tokens: int) -> PreparedRequest:
    gateway = Gateway.from_config(cfg)
    pending = PendingRequest(
        tenant=cfg.tenants[0], kind=EndpointKind.CHAT_COMPLETIONS, path="/v1/chat/completions"
    )
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    out = handlers.prepare_body(gateway, pending, json.dumps(body).encode())
    assert isinstance(out, PreparedRequest), out
    return out


def pick(picking: PickingState, request: PreparedRequest) -> tuple[str, ...]:
    out = choose(picking, request, CLUSTER, ExtProcMetrics(), now=0.0)
    assert isinstance(out, Picked), out
    picking.book.leave(out.held)
    return out.hosts


def test_the_book_answers_each_class_its_hosts() -> None:
    picking = state({FAST: ["long"], SLOW_1: [], SLOW_2: None})
    assert picking.book.class_hosts(CLUSTER, "long") == {FAST}
    assert picking.book.class_hosts(CLUSTER, "long-0") == frozenset()
    with pytest.raises(ValueError, match=r"^clusters.c\[0\].length_classes: "):
        parse_picking_state(
            {"clusters": {"c": [{"address": "a:1", "weight": 1, "healthy": True, "length_classes": "long"}]},
             "stale_after_ms": 1}
        )  # fmt: skip


def test_a_long_request_is_picked_within_its_class_even_when_that_host_is_busier() -> None:
    cfg = config()
    picking = state({FAST: ["long"], SLOW_1: [], SLOW_2: []}, fast_busy=3)
    # by load alone the idle slow GPUs come first; the long class has only the fast one
    assert pick(picking, prepared(cfg, 500)) == (FAST,)
    assert pick(picking, prepared(cfg, 50))[0] != FAST


def test_the_live_classes_decide_and_a_class_with_no_host_falls_back_to_all() -> None:
    cfg = config()
    # the live sets took SLOW_2 into the long class (the fast GPU throttled)
    picking = state({FAST: ["long"], SLOW_1: [], SLOW_2: ["long"]}, fast_busy=3)
    assert set(pick(picking, prepared(cfg, 500))) == {FAST, SLOW_2}
    assert pick(picking, prepared(cfg, 500))[0] == SLOW_2
    picking = state({FAST: [], SLOW_1: [], SLOW_2: []}, fast_busy=3)
    assert pick(picking, prepared(cfg, 500))[0] in (SLOW_1, SLOW_2)


def test_tiered_classes_pick_within_the_requests_tier() -> None:
    cfg = config(
        {"tiers": [{"above_output_tokens": 1000, "min_relative_capacity": 3}, {"above_output_tokens": 100,
         "min_relative_capacity": 0.5}]}
    )  # fmt: skip
    picking = state({FAST: ["long-0", "long-1"], SLOW_1: ["long-1"], SLOW_2: []}, fast_busy=3)
    assert pick(picking, prepared(cfg, 5000)) == (FAST,)
    assert set(pick(picking, prepared(cfg, 500))) == {FAST, SLOW_1}
    assert pick(picking, prepared(cfg, 500))[0] == SLOW_1


async def test_with_a_fair_queue_a_long_request_waits_for_room_within_its_class() -> None:
    """The fast GPU is saturated (one in flight at max_in_flight 1), the slow ones idle: a long request
    waits (room elsewhere cannot take it) instead of a 503, and is picked there once the GPU has room."""
    cfg = config(queue={"max_queued": 4, "max_wait_ms": 1000, "max_in_flight": 1})
    picking = state({FAST: ["long"], SLOW_1: [], SLOW_2: []}, fast_busy=1)
    out = choose(picking, prepared(cfg, 500), CLUSTER, ExtProcMetrics(), now=0.0)
    assert isinstance(out, PickWaiter), out
    picking.book.leave(FAST)
    picking.dispatch(0.0)
    picked = out.outcome.result()
    assert isinstance(picked, Picked) and picked.hosts == (FAST,), picked
