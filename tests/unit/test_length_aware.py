"""Length-aware placement (:mod:`inferlb.policy.length_aware`): classification, config validation, the
ext_proc header and the xDS resources (subset config, endpoint tiers, long routes). Envoy's acceptance of them
is tested in tests/e2e/test_length_aware_envoy.py."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from hypothesis import given
from hypothesis import strategies as st

from ext_proc import handlers
from inferlb.config.schema import Config, LengthAwareRouting, LengthTier, parse_config
from inferlb.errors import ConfigError
from inferlb.policy.length_aware import (
    CLASSES_KEY,
    ENVOY_LB_NAMESPACE,
    FAST_TIER,
    LONG,
    SHORT,
    STANDARD_TIER,
    TIER_KEY,
    allowed_classes,
    confined_classes,
    endpoint_lb_metadata,
    gpu_tier,
    length_class,
    tier_capacity_shares,
    tier_thresholds,
)
from inferlb.policy.quota import QuotaBook, limits_from_config
from inferlb.request import headers as h
from inferlb.request.parsing import EndpointKind
from xds_server import resources as r

KEY = "sk-length-0001"


def _doc(length_aware: dict[str, Any] | None = None, **cluster: Any) -> dict[str, Any]:
    llama_cluster: dict[str, Any] = dict(cluster)
    if length_aware is not None:
        llama_cluster["length_aware"] = length_aware
    return {
        "models": [
            {"name": "llama", "default_max_tokens": 200, "cluster": llama_cluster},
            {"name": "qwen"},
        ],
        "endpoints": [
            {"name": "h", "address": "127.0.0.1:8001", "model": "llama", "gpu": "H100"},
            {"name": "a", "address": "127.0.0.1:8002", "model": "llama", "gpu": "A100"},
            {"name": "v", "address": "127.0.0.1:8003", "model": "llama", "gpu": "V100"},
            {"name": "q", "address": "127.0.0.1:8004", "model": "qwen", "gpu": "V100"},
        ],
        "tenants": [{"name": "t", "api_keys": [KEY]}],
    }


def _config(length_aware: dict[str, Any] | None = None, **cluster: Any) -> Config:
    return parse_config(_doc(length_aware, **cluster))


# -- classification -------------------------------------------------------------------------------------
@given(cap=st.integers(min_value=0, max_value=10**7), threshold=st.integers(min_value=1, max_value=10**7))
def test_long_exactly_when_the_cap_exceeds_the_threshold(cap: int, threshold: int) -> None:
    cls = length_class(cap, LengthAwareRouting(long_output_tokens=threshold))
    assert cls == (LONG if cap > threshold else SHORT)


@given(
    capacity=st.floats(min_value=0.01, max_value=100, allow_nan=False),
    floor=st.floats(min_value=0.01, max_value=100, allow_nan=False),
)
def test_tier_follows_the_gpu_profile_capacity(capacity: float, floor: float) -> None:
    config = parse_config({"models": [{"name": "m"}], "gpu_profiles": {"X": {"relative_capacity": capacity}}})
    tier = gpu_tier(config, "X", LengthAwareRouting(fast_min_relative_capacity=floor))
    assert tier == (FAST_TIER if capacity >= floor else STANDARD_TIER)


def test_default_tiers_put_a100_and_h100_in_the_fast_tier() -> None:
    config = _config({})
    policy = LengthAwareRouting()
    assert {g: gpu_tier(config, g, policy) for g in ("H100", "A100", "V100", "L4")} == {
        "H100": FAST_TIER,
        "A100": FAST_TIER,
        "V100": STANDARD_TIER,
        "L4": STANDARD_TIER,
    }


# -- config ---------------------------------------------------------------------------------------------
def test_off_by_default() -> None:
    assert _config().models[0].cluster.length_aware is None


def test_block_defaults() -> None:
    la = _config({}).models[0].cluster.length_aware
    assert la == LengthAwareRouting(long_output_tokens=384, fast_min_relative_capacity=1.5)


@pytest.mark.parametrize(
    ("length_aware", "cluster", "field", "words"),
    [
        ({"long_output_tokens": 0}, {}, "models[0].cluster.length_aware.long_output_tokens", "greater than"),
        (
            {"fast_min_relative_capacity": 0},
            {},
            "models[0].cluster.length_aware.fast_min_relative_capacity",
            "greater than",
        ),
        ({"threshold": 5}, {}, "models[0].cluster.length_aware.threshold", "Extra inputs"),
        ({}, {"lb_policy": "ring_hash"}, "models[0].cluster.length_aware", "least_request or round_robin"),
        ({}, {"lb_policy": "maglev"}, "models[0].cluster.length_aware", "not maglev"),
    ],
)
def test_bad_blocks_are_refused_naming_the_field(
    length_aware: dict[str, Any], cluster: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        _config(length_aware, **cluster)
    assert any(f == field and words in m for f, m in exc.value.problems), exc.value.problems


# -- ext_proc -------------------------------------------------------------------------------------------
def _route_headers(config: Config, body: dict[str, Any], kind: EndpointKind, path: str) -> dict[str, str]:
    gateway = handlers.Gateway.from_config(config)
    quotas = QuotaBook(limits_from_config(config), 0.0)
    pending = handlers.on_request_headers(
        gateway,
        {":method": "POST", ":path": path, "authorization": f"Bearer {KEY}"},
        end_of_stream=False,
    )
    assert isinstance(pending, handlers.BodyExpected)
    decision = handlers.on_request_body(
        gateway, quotas, pending.pending, json.dumps(body).encode(), now=0.0, rng=random.Random(1)
    )
    assert isinstance(decision, handlers.ContinueRequest), decision
    return dict(decision.set_headers)


_CHAT = (EndpointKind.CHAT_COMPLETIONS, "/v1/chat/completions")
_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "kind_path", "expected"),
    [
        ({"max_tokens": 100}, _CHAT, SHORT),
        ({"max_tokens": 101}, _CHAT, LONG),
        ({"max_completion_tokens": 500, "max_tokens": 10}, _CHAT, LONG),  # the larger cap counts
        ({"max_completion_tokens": 10, "max_tokens": 500}, _CHAT, LONG),
        ({}, _CHAT, LONG),  # no cap: the model default (200)
        ({"max_tokens": 60, "n": 2}, _CHAT, LONG),  # 120 tokens in all
        ({"max_tokens": 50, "n": 2}, _CHAT, SHORT),
        ({"max_output_tokens": 101}, (EndpointKind.RESPONSES, "/v1/responses"), LONG),
        ({"max_tokens": 40, "prompt": ["a", "b", "c"]}, (EndpointKind.COMPLETIONS, "/v1/completions"), LONG),
        ({"input": "x"}, (EndpointKind.EMBEDDINGS, "/v1/embeddings"), SHORT),  # generates nothing
    ],
)
def test_ext_proc_sets_the_length_class_from_the_output_cap(
    body: dict[str, Any], kind_path: tuple[EndpointKind, str], expected: str
) -> None:
    kind, path = kind_path
    full: dict[str, Any] = {"model": "llama", **body}
    if kind is EndpointKind.CHAT_COMPLETIONS:
        full["messages"] = _MESSAGES
    elif kind is EndpointKind.RESPONSES:
        full["input"] = "hi"
    elif kind is EndpointKind.COMPLETIONS:
        full.setdefault("prompt", "hi")
    got = _route_headers(_config({"long_output_tokens": 100}), full, kind, path)
    assert got[h.LENGTH_CLASS] == expected


def test_no_length_class_header_for_a_model_without_it() -> None:
    config = _config({"long_output_tokens": 100})
    body = {"model": "qwen", "messages": _MESSAGES, "max_tokens": 5000}
    assert h.LENGTH_CLASS not in _route_headers(config, body, *_CHAT)
    body = {"model": "llama", "messages": _MESSAGES, "max_tokens": 5000}
    assert h.LENGTH_CLASS not in _route_headers(_config(), body, *_CHAT)


def test_a_client_sent_length_class_is_removed() -> None:
    gateway = handlers.Gateway.from_config(_config({}))
    decision = handlers.on_request_headers(
        gateway,
        {
            ":method": "POST",
            ":path": "/v1/chat/completions",
            "authorization": f"Bearer {KEY}",
            h.LENGTH_CLASS: LONG,
        },
        end_of_stream=False,
    )
    assert isinstance(decision, handlers.BodyExpected)
    assert h.LENGTH_CLASS in decision.remove_headers
    assert h.LENGTH_CLASS in r.STRIPPED_REQUEST_HEADERS  # and Envoy strips it before routing


# -- xDS resources --------------------------------------------------------------------------------------
def _resources(config: Config) -> r.XdsResources:
    return r.build_resources(config)


def _cluster(config: Config, name: str) -> cluster_pb2.Cluster:
    c = _resources(config).by_type[r.CLUSTER_TYPE][name]
    assert isinstance(c, cluster_pb2.Cluster)
    return c


def test_length_aware_cluster_keeps_its_policy_inside_each_subset() -> None:
    config = _config({}, active_request_bias=1.5)
    c = _cluster(config, "llama--v1")
    assert c.HasField("lb_subset_config")
    subsets = c.lb_subset_config
    assert subsets.fallback_policy == cluster_pb2.Cluster.LbSubsetConfig.ANY_ENDPOINT
    assert [list(s.keys) for s in subsets.subset_selectors] == [[TIER_KEY]]
    assert c.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    assert c.least_request_lb_config.active_request_bias.default_value == 1.5
    assert not _cluster(config, "qwen--v1").HasField("lb_subset_config")
    rr = _cluster(_config({}, lb_policy="round_robin"), "llama--v1")
    assert rr.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN and rr.HasField("lb_subset_config")


def test_off_leaves_every_resource_byte_identical_to_a_config_without_the_field() -> None:
    without = _resources(parse_config(_doc()))
    explicit_none = parse_config(
        {**_doc(), "models": [{"name": "llama", "default_max_tokens": 200}, {"name": "qwen"}]}
    )
    assert {
        t: {n: m.SerializeToString(deterministic=True) for n, m in res.items()}
        for t, res in without.by_type.items()
    } == {
        t: {n: m.SerializeToString(deterministic=True) for n, m in res.items()}
        for t, res in _resources(explicit_none).by_type.items()
    }
    cla = without.by_type[r.ENDPOINT_TYPE]["llama--v1"]
    for loc in cla.endpoints:
        for lb in loc.lb_endpoints:
            assert ENVOY_LB_NAMESPACE not in lb.metadata.filter_metadata


def _tiers(config: Config, cluster: str) -> dict[str, str]:
    cla = _resources(config).by_type[r.ENDPOINT_TYPE][cluster]
    out = {}
    for loc in cla.endpoints:
        for lb in loc.lb_endpoints:
            meta = lb.metadata.filter_metadata
            if ENVOY_LB_NAMESPACE in meta:
                out[lb.endpoint.hostname] = meta[ENVOY_LB_NAMESPACE].fields[TIER_KEY].string_value
    return out


def test_endpoints_carry_their_tier_in_the_envoy_lb_namespace() -> None:
    assert _tiers(_config({}), "llama--v1") == {"h": FAST_TIER, "a": FAST_TIER, "v": STANDARD_TIER}
    assert _tiers(_config({"fast_min_relative_capacity": 2.0}), "llama--v1") == {
        "h": FAST_TIER,
        "a": STANDARD_TIER,
        "v": STANDARD_TIER,
    }
    assert _tiers(_config({}), "qwen--v1") == {}


def test_tiers_survive_a_weight_override_through_the_memo() -> None:
    config = _config({})
    memo = r.LbEndpointCache()
    overrides = {"127.0.0.1:8001": r.EndpointOverride(weight=7)}
    res = r.build_resources(config, overrides=overrides, lb_cache=memo)
    cla = res.by_type[r.ENDPOINT_TYPE]["llama--v1"]
    [h100] = [lb for loc in cla.endpoints for lb in loc.lb_endpoints if lb.endpoint.hostname == "h"]
    assert h100.load_balancing_weight.value == 7
    assert h100.metadata.filter_metadata[ENVOY_LB_NAMESPACE].fields[TIER_KEY].string_value == FAST_TIER


def test_long_routes_come_first_and_ask_for_the_fast_subset() -> None:
    routes = _resources(_config({})).by_type[r.ROUTE_TYPE][r.ROUTE_CONFIG_NAME]
    [vhost] = routes.virtual_hosts
    names = [rt.name for rt in vhost.routes if not rt.name.endswith(r.STREAM_ROUTE_SUFFIX)]
    assert names[:4] == ["llama--v1--long-high", "llama--v1--long", "llama--v1--high", "llama--v1"]
    assert "qwen--v1--long" not in names
    by_name = {rt.name: rt for rt in vhost.routes}
    for name, high in (("llama--v1--long-high", True), ("llama--v1--long", False)):
        rt = by_name[name]
        matchers = {m.name: m.string_match.exact for m in rt.match.headers}
        assert matchers[h.LENGTH_CLASS] == LONG
        assert matchers[h.MODEL] == "llama" and matchers[h.VERSION] == "v1"
        assert (h.PRIORITY in matchers) is high
        crit = rt.route.metadata_match.filter_metadata[ENVOY_LB_NAMESPACE]
        assert crit.fields[TIER_KEY].string_value == FAST_TIER
        assert rt.route.cluster == "llama--v1"
    # short requests take the usual routes: no metadata match, so the fallback (every endpoint) applies
    assert not by_name["llama--v1"].route.HasField("metadata_match")
    assert not by_name["llama--v1--high"].route.HasField("metadata_match")


# -- tiered placement: the threshold rule --------------------------------------------------------------------


def test_tier_sets_are_the_fastest_classes_nested_with_their_capacity_shares() -> None:
    # 2 H100 (3.4), 3 A100 (1.7), 3 V100 (1.0): 6.8 + 5.1 + 3.0 = 14.9 V100s
    caps = [3.4, 3.4, 1.7, 1.7, 1.7, 1.0, 1.0, 1.0]
    (h, share_h), (a, share_ha) = tier_capacity_shares(caps)
    assert (h, a) == (3.4, 1.7)
    assert share_h == pytest.approx(6.8 / 14.9) and share_ha == pytest.approx(11.9 / 14.9)
    assert tier_capacity_shares([1.0, 1.0]) == ()  # one class: nothing to confine
    with pytest.raises(ValueError, match="> 0"):
        tier_capacity_shares([1.0, 0.0])
    with pytest.raises(ValueError, match="no GPU"):
        tier_capacity_shares([])


samples_st = st.lists(
    st.tuples(st.integers(0, 2000), st.floats(0.01, 100.0, allow_nan=False)), min_size=1, max_size=60
)


@given(
    samples=samples_st,
    shares=st.lists(st.floats(0.05, 0.95), min_size=1, max_size=3, unique=True).map(sorted),
    fraction=st.floats(0.05, 1.0),
)
def test_tier_thresholds_give_each_set_at_most_its_budget_and_are_the_smallest_such_caps(
    samples: list[tuple[int, float]], shares: list[float], fraction: float
) -> None:
    thresholds = tier_thresholds(shares, samples, fraction=fraction)
    total = sum(w for _, w in samples)
    caps = sorted({c for c, _ in samples})
    assert len(thresholds) == len(shares)
    assert list(thresholds) == sorted(thresholds, reverse=True)  # the smaller the set, the higher its cap
    for t, share in zip(thresholds, shares, strict=True):
        budget = fraction * share * total
        assert t in caps
        assert sum(w for c, w in samples if c > t) <= budget * (1 + 1e-9)
        lower = [c for c in caps if c < t]
        if lower:  # one cap lower would put more than the budget on the set
            assert sum(w for c, w in samples if c > lower[-1]) > budget * (1 - 1e-9)


def test_tier_thresholds_on_a_known_distribution() -> None:
    # 10 requests of cap 100 (work 1 each), 5 of cap 500 (work 4), 1 of cap 1000 (work 10): total 40
    samples = [(100, 1.0)] * 10 + [(500, 4.0)] * 5 + [(1000, 10.0)]
    # set shares 0.5 and 0.8, fraction 0.5: budgets 10 and 16 of work; above 500: 10 <= 10; above 100: 30 > 16
    assert tier_thresholds([0.5, 0.8], samples, fraction=0.5) == (500, 500)
    # fraction 1: budgets 20 and 32: above 500 is 10 (above 100, 30, exceeds 20); above 100, 30 <= 32
    assert tier_thresholds([0.5, 0.8], samples, fraction=1.0) == (500, 100)


@pytest.mark.parametrize(
    ("shares", "samples", "fraction", "match"),
    [
        ([0.5], [], 0.5, "no samples"),
        ([0.5], [(1, 1.0)], 0.0, "fraction"),
        ([0.5], [(1, 1.0)], 1.5, "fraction"),
        ([0.0], [(1, 1.0)], 0.5, "shares must be in"),
        ([0.8, 0.5], [(1, 1.0)], 0.5, "increase"),
        ([0.5], [(-1, 1.0)], 0.5, ">= 0"),
        ([0.5], [(1, 0.0)], 0.5, "no work"),
    ],
)
def test_tier_thresholds_refuse_bad_input(
    shares: list[float], samples: list[tuple[int, float]], fraction: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        tier_thresholds(shares, samples, fraction=fraction)


# -- tiered form: config, classes, ext_proc header, xDS resources -------------------------------------------
TIERS = {
    "tiers": [
        {"above_output_tokens": 400, "min_relative_capacity": 3.0},
        {"above_output_tokens": 200, "min_relative_capacity": 1.5},
    ]
}


@given(cap=st.integers(0, 10**6), t0=st.integers(1, 10**5), gap=st.integers(1, 10**5))
def test_tiered_class_is_the_first_tier_the_cap_exceeds(cap: int, t0: int, gap: int) -> None:
    policy = LengthAwareRouting(
        tiers=(
            LengthTier(above_output_tokens=t0 + gap, min_relative_capacity=3.0),
            LengthTier(above_output_tokens=t0, min_relative_capacity=1.5),
        )
    )
    expected = "long-0" if cap > t0 + gap else "long-1" if cap > t0 else SHORT
    assert length_class(cap, policy) == expected
    assert [c.name for c in confined_classes(policy)] == ["long-0", "long-1"]


def test_tiered_gpus_serve_every_class_their_capacity_reaches() -> None:
    config = _config(TIERS)
    policy = config.models[0].cluster.length_aware
    assert policy is not None
    assert {g: allowed_classes(config, g, policy) for g in ("H100", "A100", "V100")} == {
        "H100": ("long-0", "long-1"),
        "A100": ("long-1",),
        "V100": (),
    }
    assert endpoint_lb_metadata(config, "A100", policy) == {CLASSES_KEY: ["long-1"]}
    # the two-tier form keeps its resources: gpu_tier metadata, one class "long" on the fast tier
    two = LengthAwareRouting()
    assert endpoint_lb_metadata(config, "A100", two) == {TIER_KEY: FAST_TIER}
    assert [(c.name, c.match_key, c.match_value) for c in confined_classes(two)] == [
        (LONG, TIER_KEY, FAST_TIER)
    ]


@pytest.mark.parametrize(
    ("tiers", "words"),
    [
        (
            [
                {"above_output_tokens": 200, "min_relative_capacity": 3.0},
                {"above_output_tokens": 400, "min_relative_capacity": 1.5},
            ],
            "tiers[1].above_output_tokens (400) must be below",
        ),
        (
            [
                {"above_output_tokens": 400, "min_relative_capacity": 1.5},
                {"above_output_tokens": 200, "min_relative_capacity": 1.5},
            ],
            "tiers[1].min_relative_capacity (1.5) must be below",
        ),
        ([], "at least 1"),
        ([{"above_output_tokens": 400}], "Field required"),
    ],
)
def test_bad_tiers_are_refused_naming_the_field(tiers: list[dict[str, Any]], words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _config({"tiers": tiers})
    assert any(
        f.startswith("models[0].cluster.length_aware.tiers") and words in m for f, m in exc.value.problems
    ), exc.value.problems


def test_tiers_and_the_two_tier_fields_are_not_mixed() -> None:
    with pytest.raises(ConfigError) as exc:
        _config({**TIERS, "long_output_tokens": 300})
    assert any("either tiers or long_output_tokens" in m for _, m in exc.value.problems), exc.value.problems


@pytest.mark.parametrize(
    ("max_tokens", "expected"), [(401, "long-0"), (400, "long-1"), (201, "long-1"), (200, SHORT)]
)
def test_ext_proc_sets_the_tiered_length_class(max_tokens: int, expected: str) -> None:
    body = {"model": "llama", "messages": _MESSAGES, "max_tokens": max_tokens}
    assert _route_headers(_config(TIERS), body, *_CHAT)[h.LENGTH_CLASS] == expected


def test_tiered_resources_one_list_selector_class_routes_and_endpoint_lists() -> None:
    res = _resources(_config(TIERS))
    c = res.by_type[r.CLUSTER_TYPE]["llama--v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    subsets = c.lb_subset_config
    assert [list(s.keys) for s in subsets.subset_selectors] == [[CLASSES_KEY]]
    assert subsets.list_as_any
    assert subsets.fallback_policy == cluster_pb2.Cluster.LbSubsetConfig.ANY_ENDPOINT
    cla = res.by_type[r.ENDPOINT_TYPE]["llama--v1"]
    lists = {
        lb.endpoint.hostname: [
            v.string_value
            for v in lb.metadata.filter_metadata[ENVOY_LB_NAMESPACE].fields[CLASSES_KEY].list_value.values
        ]
        for loc in cla.endpoints
        for lb in loc.lb_endpoints
    }
    assert lists == {"h": ["long-0", "long-1"], "a": ["long-1"], "v": []}
    [vhost] = res.by_type[r.ROUTE_TYPE][r.ROUTE_CONFIG_NAME].virtual_hosts
    names = [rt.name for rt in vhost.routes if not rt.name.endswith(r.STREAM_ROUTE_SUFFIX)]
    assert names[:6] == [
        "llama--v1--long-0-high",
        "llama--v1--long-0",
        "llama--v1--long-1-high",
        "llama--v1--long-1",
        "llama--v1--high",
        "llama--v1",
    ]
    by_name = {rt.name: rt for rt in vhost.routes}
    for cls in ("long-0", "long-1"):
        rt = by_name[f"llama--v1--{cls}"]
        assert {m.name: m.string_match.exact for m in rt.match.headers}[h.LENGTH_CLASS] == cls
        crit = rt.route.metadata_match.filter_metadata[ENVOY_LB_NAMESPACE]
        assert crit.fields[CLASSES_KEY].string_value == cls
    assert not by_name["llama--v1"].route.HasField("metadata_match")
