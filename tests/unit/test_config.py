"""The config model: the default file validates, and every kind of mistake is refused with its field named."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ext_proc.poller import ConfigPoller
from inferlb.config.schema import (
    Config,
    ConfigError,
    HostPort,
    cluster_name,
    default_config_path,
    load_config,
    parse_config,
)
from inferlb.policy.capacity import capacity_weight
from xds_server.server import parse_config_bytes


def default_doc() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(default_config_path().read_text(encoding="utf-8")))


def fields_of(exc: ConfigError) -> list[str]:
    return [f for f, _ in exc.problems]


def test_default_config_is_the_demo_fleet() -> None:
    cfg = load_config(default_config_path())
    gpus = {e.gpu for e in cfg.endpoints}
    assert len(cfg.endpoints) >= 6 and len(gpus) >= 3
    assert len(cfg.models) == 2
    canary = cfg.models[0]
    assert [(v.name, v.traffic_percent) for v in canary.versions] == [("v1", 90), ("v2", 10)]
    keys = {k: t for t in cfg.tenants for k in t.api_keys}
    assert keys["sk-demo-a"].priority == "high"
    assert keys["sk-demo-b"].priority == "low"
    assert keys["sk-demo-c"].tokens_per_minute == 2000
    assert str(cfg.gateway.listen) == "127.0.0.1:10000" and str(cfg.gateway.admin) == "127.0.0.1:9901"
    assert all(e.simulated for e in cfg.endpoints)


def test_examples_local_yaml_is_the_embedded_default() -> None:
    example = Path(__file__).parents[2] / "examples" / "local.yaml"
    assert example.read_bytes() == default_config_path().read_bytes()


def test_gpu_capacity_ratios_follow_the_field() -> None:
    cfg = load_config(default_config_path())
    cap = {k: p.relative_capacity for k, p in cfg.gpu_profiles.items()}
    assert cap["A100"] / cap["V100"] == pytest.approx(1.7)
    assert cap["H100"] / cap["A100"] == pytest.approx(2.0)
    weights = {e.gpu: capacity_weight(cfg, e) for e in cfg.endpoints}
    assert weights == {"H100": 34, "A100": 17, "V100": 10}


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["models"][0]["versions"][0].update(traffic_percent=80), "models[0].versions"),
        (lambda d: d["endpoints"][0].update(model="nope"), "endpoints[0].model"),
        (lambda d: d["endpoints"][0].update(version="v9"), "endpoints[0].version"),
        (lambda d: d["endpoints"][0].update(gpu="TPU"), "endpoints[0].gpu"),
        (lambda d: d["endpoints"][1].update(address=d["endpoints"][0]["address"]), "endpoints[1].address"),
        (lambda d: d["endpoints"][0].update(address="localhost"), "endpoints[0].address"),
        (lambda d: d["endpoints"][0].update(address="127.0.0.1:70000"), "endpoints[0].address.port"),
        (lambda d: d["tenants"][1].update(api_keys=["sk-demo-a"]), "tenants[1].api_keys"),
        (lambda d: d["tenants"][0].update(api_keys=[]), "tenants[0].api_keys"),
        (lambda d: d["tenants"][0].update(priority="urgent"), "tenants[0].priority"),
        (lambda d: d["tenants"][0].update(tokens_per_minute=0), "tenants[0].tokens_per_minute"),
        (lambda d: d["models"][1].update(aliases=["llama3"]), "models"),
        (lambda d: d["gateway"].update(listen=d["xds"]["listen"]), "xds.listen"),
        (
            lambda d: d["gpu_profiles"]["V100"].update(relative_capacity=0),
            "gpu_profiles.V100.relative_capacity",
        ),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d["ext_proc"].update(message_timeout_ms="soon"), "ext_proc.message_timeout_ms"),
    ],
)
def test_mistakes_are_refused_with_the_field_named(mutate: Any, field: str) -> None:
    doc = default_doc()
    mutate(doc)
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "x.yaml")
    assert field in fields_of(info.value), info.value.problems
    assert "x.yaml" in str(info.value)


def test_unreadable_and_non_yaml_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_profiles_named_in_a_file_keep_the_builtin_ones() -> None:
    cfg = parse_config({"models": [{"name": "m"}], "gpu_profiles": {"MI300X": {"relative_capacity": 3.0}}})
    assert {"MI300X", "H100", "A100", "V100"} <= set(cfg.gpu_profiles)


def test_single_version_endpoints_need_no_version() -> None:
    cfg = parse_config(
        {"models": [{"name": "m"}], "endpoints": [{"address": "127.0.0.1:9000", "model": "m", "gpu": "A100"}]}
    )
    assert cfg.endpoint_version(cfg.endpoints[0]) == "v1"


def test_hostport_parses_ipv6_and_names() -> None:
    assert str(HostPort.model_validate("[::1]:80")) == "[::1]:80"
    hp = HostPort.model_validate("gpusim:8001")
    assert (hp.host, hp.port, hp.is_ip) == ("gpusim", 8001, False)
    assert HostPort.model_validate("127.0.0.1:1").is_ip


@given(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=10))
def test_cluster_names_are_envoy_safe(model: str, version: str) -> None:
    name = cluster_name(model, version)
    assert all((c.isalnum() and c.isascii()) or c in "_.-" for c in name)


def test_config_is_frozen() -> None:
    cfg = load_config(default_config_path())
    assert isinstance(cfg, Config)
    with pytest.raises(Exception, match="frozen"):
        cfg.gateway.num_retries = 5  # type: ignore[misc]


def test_a_key_given_twice_is_refused_with_its_name_and_line(tmp_path: Path) -> None:
    text = (
        default_config_path()
        .read_text(encoding="utf-8")
        .replace("  num_retries: 2\n", "  num_retries: 2\n  num_retries: 7\n")
    )
    assert text.count("num_retries") == 2
    bad = tmp_path / "dup.yaml"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    ((field, message),) = info.value.problems
    assert field == "gateway.num_retries"
    assert "duplicate key" in message and f"line {text.splitlines().index('  num_retries: 7') + 1}" in message


def test_duplicate_keys_inside_lists_are_named_by_index(tmp_path: Path) -> None:
    bad = tmp_path / "dup.yaml"
    bad.write_text("models:\n  - name: m\n    context_length: 10\n    context_length: 20\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.problems[0][0] == "models[0].context_length"


# YAML booleans and quoted numbers are not numbers: pydantic's lax mode used to turn `true` into 1 and "384"
# into 384 (adversarial trial); every int/float field is strict, and an int still fills a float field.
NUMERIC_FIELDS = [
    (("tenants", 2, "tokens_per_minute"), "tenants[2].tokens_per_minute"),
    (("gateway", "max_request_body_bytes"), "gateway.max_request_body_bytes"),
    (("gpu_profiles", "H100", "relative_capacity"), "gpu_profiles.H100.relative_capacity"),
    (("ext_proc", "message_timeout_ms"), "ext_proc.message_timeout_ms"),
]


def _set(doc: dict[str, Any], path: tuple[str | int, ...], value: object) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


@given(
    st.sampled_from(NUMERIC_FIELDS),
    st.one_of(st.booleans(), st.integers(min_value=1, max_value=10**6).map(str), st.just("2.5")),
)
def test_booleans_and_quoted_numbers_are_not_numbers(
    target: tuple[tuple[str | int, ...], str], value: object
) -> None:
    path, field = target
    doc = default_doc()
    _set(doc, path, value)
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "x.yaml")
    assert field in fields_of(info.value), info.value.problems


def test_an_int_fills_a_float_field() -> None:
    doc = default_doc()
    doc["gpu_profiles"]["H100"]["relative_capacity"] = 3
    assert parse_config(doc).gpu_profiles["H100"].relative_capacity == 3.0


_LAUGHS = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['x'] * 9)}]\n"
    for prev, name in zip(["", "a", "b", "c", "d", "e", "f", "g"], "abcdefgh", strict=True)
)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param("a: &x [*x]\n", "recursive", id="recursive-alias"),
        pytest.param("gateway: &g {x: *g}\n", "recursive", id="recursive-mapping"),
        pytest.param(_LAUGHS, "aliases", id="alias-expansion"),
        pytest.param("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply", id="deep-nesting"),
        pytest.param(b"gateway: \xff\xfe\n", "not UTF-8", id="not-utf8"),
        pytest.param("gateway: {num_retries: 2, num_retries: 7}\n", "duplicate key", id="duplicate-key"),
    ],
)
def test_a_hostile_yaml_file_is_a_config_error_in_every_reader(
    tmp_path: Path, text: str | bytes, words: str
) -> None:
    """A recursive or exponentially aliased YAML document, one nested past the parser's recursion, bytes
    that are not UTF-8 and a repeated key are each a :class:`ConfigError` (the last good config keeps
    serving), quickly, from every reader of a config file: start-up (``load_config``), the xDS server's
    reload (``parse_config_bytes``) and ext_proc's poller. They were a RecursionError, a hang of minutes,
    a UnicodeDecodeError, and a repeated key silently taken on reload."""
    raw = text if isinstance(text, bytes) else text.encode()
    path = tmp_path / "hostile.yaml"
    path.write_bytes(raw)
    readers = {
        "load_config": lambda: load_config(path),
        "parse_config_bytes": lambda: parse_config_bytes(raw, str(path)),
        "ConfigPoller.read": lambda: ConfigPoller(path).read(),
    }
    for name, read in readers.items():
        with pytest.raises(ConfigError) as info:
            read()
        assert any(words in message for _, message in info.value.problems), (name, info.value.problems)
