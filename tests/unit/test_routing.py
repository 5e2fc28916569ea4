"""Routing: API key -> tenant, name/alias -> model, traffic split (sticky per user, random otherwise)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.config.schema import Config, Priority, load_config, parse_config
from inferlb.config.schema import default_config_path as default_path
from inferlb.errors import RequestError
from inferlb.policy.routing import RoutingTable, VersionSplit, priority_header_value, sticky_point


@pytest.fixture(scope="module")
def config() -> Config:
    return parse_config(
        {
            "models": [
                {
                    "name": "llama",
                    "aliases": ["llama3", "l3"],
                    "versions": [
                        {"name": "v1", "traffic_percent": 90},
                        {"name": "v2", "traffic_percent": 10},
                    ],
                },
                {"name": "qwen"},
                {
                    "name": "dark",
                    "versions": [
                        {"name": "old", "traffic_percent": 0},
                        {"name": "new", "traffic_percent": 100},
                    ],
                },
            ],
            "tenants": [
                {"name": "a", "api_keys": ["sk-key-aaaa", "sk-key-a2a2"], "priority": "high"},
                {"name": "b", "api_keys": ["sk-key-bbbb"]},
            ],
        }
    )


@pytest.fixture(scope="module")
def table(config: Config) -> RoutingTable:
    return RoutingTable(config)


def test_authenticate_bearer_keys(table: RoutingTable) -> None:
    assert table.authenticate("Bearer sk-key-aaaa").name == "a"
    assert table.authenticate("bearer sk-key-a2a2").name == "a"
    assert table.authenticate("Bearer   sk-key-bbbb  ").name == "b"


@pytest.mark.parametrize(
    "value",
    [None, "", "sk-key-aaaa", "Basic c2s6eA==", "Bearer ", "Bearer sk-key-unknown", "Bearer sk-key-aaa"],
)
def test_authenticate_refuses(table: RoutingTable, value: str | None) -> None:
    with pytest.raises(RequestError) as info:
        table.authenticate(value)
    err = info.value
    assert (err.status, err.type, err.code) == (401, "authentication_error", "invalid_api_key")
    assert "sk-key-unknown" not in err.message  # the key is never echoed in full


def test_resolve_model_by_name_and_alias(table: RoutingTable) -> None:
    assert table.resolve_model("llama").name == "llama"
    assert table.resolve_model("l3").name == "llama"
    with pytest.raises(RequestError) as info:
        table.resolve_model("gpt-5")
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")


def test_single_version_and_zero_percent_versions(table: RoutingTable) -> None:
    rng = random.Random(1)
    assert {table.pick_version(table.resolve_model("qwen"), None, rng) for _ in range(50)} == {"v1"}
    assert {table.pick_version(table.resolve_model("dark"), None, rng) for _ in range(200)} == {"new"}


def test_random_split_follows_traffic_percent(table: RoutingTable) -> None:
    rng = random.Random(42)
    llama = table.resolve_model("llama")
    counts = Counter(table.pick_version(llama, None, rng) for _ in range(20_000))
    assert counts["v2"] / 20_000 == pytest.approx(0.10, abs=0.01)


def test_sticky_split_per_user(table: RoutingTable) -> None:
    llama = table.resolve_model("llama")
    rng = random.Random(0)
    picks = {f"user-{i}": table.pick_version(llama, f"user-{i}", rng) for i in range(5000)}
    # the same user always gets the same version, whatever the RNG does
    for user, version in list(picks.items())[:200]:
        assert table.pick_version(llama, user, random.Random()) == version
    share = sum(v == "v2" for v in picks.values()) / len(picks)
    assert share == pytest.approx(0.10, abs=0.02)


@given(st.text(max_size=30), st.text(min_size=1, max_size=30))
def test_sticky_point_in_range_and_stable(model: str, user: str) -> None:
    p = sticky_point(model, user)
    assert 0.0 <= p < 100.0
    assert sticky_point(model, user) == p


@given(st.floats(0.0, 100.0, exclude_max=True))
def test_split_pick_matches_bounds(point: float) -> None:
    split = VersionSplit(names=("a", "b", "c"), upper_bounds=(50.0, 80.0, 100.0))
    expected = "a" if point < 50 else "b" if point < 80 else "c"
    assert split.pick(point) == expected


def test_split_tolerates_bounds_short_of_100() -> None:
    split = VersionSplit(names=("a", "b"), upper_bounds=(33.333333, 99.9999999))
    assert split.pick(99.99999999) == "b"


def test_priority_header_values() -> None:
    assert [priority_header_value(p) for p in Priority] == ["high", "default", "low"]


def test_default_config_tables() -> None:
    table = RoutingTable(load_config(default_path()))
    assert table.authenticate("Bearer sk-demo-c").name == "team-c"
    assert table.resolve_model("llama3").name == "llama-3.1-8b-instruct"
