"""Endpoint picking's prefix sources, pure parts: each mode's index and keys (:func:`ext_proc.picking
.prefix_source`), the keys a parsed request carries (:func:`ext_proc.handlers.picking_block_keys`), the
config's ``endpoints[].kv_events`` (and what it refuses, naming the field), the picking state's
``kv_events`` as the xDS server serves it and the book parses it, and gpusim's arguments from it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ext_proc.handlers import picking_block_keys
from ext_proc.picking import prefix_source
from inferlb.config.schema import EndpointPicking, parse_config
from inferlb.errors import ConfigError
from inferlb.ops.stack import gpusim_kv_events_args
from inferlb.policy.endpoint_book import parse_picking_state
from inferlb.policy.kv_index import PreciseKvIndex
from inferlb.policy.picker import NoPrefixIndex
from inferlb.policy.prefix_index import ApproximatePrefixIndex
from inferlb.policy.prefix_indexes import APPROXIMATE_CAPACITY_TOKENS
from inferlb.request.blocks import prompt_block_keys
from inferlb.request.parsing import EndpointKind, parse_request
from simulation.gpusim.__main__ import _kv_events_args
from tests.conftest import make_config_doc

QWEN = "qwen2.5-7b-instruct"


def _chat(text: str) -> Any:
    body = {"model": QWEN, "messages": [{"role": "user", "content": text}]}
    return parse_request(EndpointKind.CHAT_COMPLETIONS, json.dumps(body).encode())


LONG = "the quick brown fox jumps over the lazy dog " * 40


@pytest.mark.parametrize("mode", ["off", "load"])
def test_off_and_load_have_no_index_and_no_keys(mode: str) -> None:
    picking = EndpointPicking(mode=mode)  # type: ignore[arg-type]
    source = prefix_source(picking)
    assert isinstance(source.index, NoPrefixIndex)
    assert source.keys(_chat(LONG)) == ()
    assert picking_block_keys(picking, _chat(LONG)) == ()


@pytest.mark.parametrize(
    ("mode", "kind"), [("approximate", ApproximatePrefixIndex), ("precise", PreciseKvIndex)]
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefix_modes_key_the_prompt_at_their_block_size(mode: str, kind: type, block_size: int) -> None:
    picking = EndpointPicking(mode=mode, block_size=block_size)  # type: ignore[arg-type]
    source = prefix_source(picking)
    assert isinstance(source.index, kind)
    request = _chat(LONG)
    keys = source.keys(request)
    assert keys and keys == prompt_block_keys(request, block_size=block_size)
    assert picking_block_keys(picking, request) == keys
    # a fresh index per source: two models (or a changed setting) never share one
    assert prefix_source(picking).index is not source.index
    if isinstance(source.index, PreciseKvIndex):
        assert source.index.block_size == block_size


def test_the_approximate_index_learns_the_first_turn_and_matches_the_second() -> None:
    source = prefix_source(EndpointPicking(mode="approximate"))
    first = source.keys(_chat(LONG))
    source.index.record_pick("10.0.0.1:8000", first)
    body = {
        "model": QWEN,
        "messages": [
            {"role": "user", "content": LONG},
            {"role": "assistant", "content": "a reply"},
            {"role": "user", "content": "and then?"},
        ],
    }
    second = source.keys(parse_request(EndpointKind.CHAT_COMPLETIONS, json.dumps(body).encode()))
    matched = source.index.matched_blocks(second, ["10.0.0.1:8000", "10.0.0.2:8000"])
    assert set(matched) == {"10.0.0.1:8000"} and matched["10.0.0.1:8000"] >= len(first) - 1
    assert APPROXIMATE_CAPACITY_TOKENS // 16 >= 1


# -- config ---------------------------------------------------------------------------------------------


def _doc(mode: str = "precise") -> dict[str, Any]:
    doc = make_config_doc()
    next(m for m in doc["models"] if m["name"] == QWEN)["endpoint_picking"] = {"mode": mode}
    return doc


def _index_of_first_qwen(doc: dict[str, Any]) -> int:
    return next(i for i, e in enumerate(doc["endpoints"]) if e["model"] == QWEN)


def test_kv_events_are_parsed_bare_or_with_a_replay_endpoint() -> None:
    doc = _doc()
    first = _index_of_first_qwen(doc)
    qwen = [i for i, e in enumerate(doc["endpoints"]) if e["model"] == QWEN]
    doc["endpoints"][qwen[0]]["kv_events"] = "tcp://127.0.0.1:5557"
    doc["endpoints"][qwen[1]]["kv_events"] = {
        "endpoint": "tcp://127.0.0.1:5560",
        "replay_endpoint": "tcp://127.0.0.1:5561",
        "topic": "kv",
    }
    config = parse_config(doc)
    a, b = config.endpoints[qwen[0]].kv_events, config.endpoints[qwen[1]].kv_events
    assert a is not None and a.endpoint == "tcp://127.0.0.1:5557" and a.replay_endpoint is None
    assert b is not None and b.replay_endpoint == "tcp://127.0.0.1:5561" and b.topic == "kv"
    assert first == qwen[0]
    # gpusim binds each on its port, as vLLM binds its default tcp://*:5557
    args = gpusim_kv_events_args(config)
    assert args[::2] == ["--kv-events-config"] * 2
    shared, own = _kv_events_args(args[1::2])
    assert shared is None
    names = [config.endpoints[i].display_name for i in qwen[:2]]
    assert own[names[0]].endpoint == "tcp://*:5557" and own[names[0]].publishes
    assert own[names[1]].replay_endpoint == "tcp://*:5561" and own[names[1]].topic == "kv"
    # off by default: the embedded config has no kv_events and gpusim gets no argument
    assert gpusim_kv_events_args(parse_config(make_config_doc())) == []


@pytest.mark.parametrize(
    "value",
    ["tcp://*:5557", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "udp://1.2.3.4:5", ""],
)
def test_a_malformed_kv_events_endpoint_is_refused_naming_the_field(value: str) -> None:
    doc = _doc()
    i = _index_of_first_qwen(doc)
    doc["endpoints"][i]["kv_events"] = value
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    [(field, message)] = err.value.problems
    assert field == f"endpoints[{i}].kv_events.endpoint", err.value.problems
    assert "tcp://host:port" in message


def _one_refusal(doc: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    [(field, message)] = err.value.problems
    return field, message


def test_a_replay_endpoint_equal_to_the_endpoint_or_another_endpoints_socket_is_refused() -> None:
    doc = _doc()
    qwen = [i for i, e in enumerate(doc["endpoints"]) if e["model"] == QWEN]
    same = {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5557"}
    doc["endpoints"][qwen[0]]["kv_events"] = same
    field, message = _one_refusal(doc)
    assert field == f"endpoints[{qwen[0]}].kv_events.replay_endpoint" and "differ" in message
    doc["endpoints"][qwen[0]]["kv_events"] = "tcp://127.0.0.1:5557"
    doc["endpoints"][qwen[1]]["kv_events"] = dict(same, endpoint="tcp://127.0.0.1:5558")
    field, message = _one_refusal(doc)
    assert field == f"endpoints[{qwen[1]}].kv_events" and "already used" in message


@pytest.mark.parametrize("mode", ["off", "load", "approximate"])
def test_kv_events_on_a_model_not_in_precise_mode_are_refused(mode: str) -> None:
    doc = _doc(mode)
    i = _index_of_first_qwen(doc)
    doc["endpoints"][i]["kv_events"] = "tcp://127.0.0.1:5557"
    field, message = _one_refusal(doc)
    assert field == f"endpoints[{i}].kv_events"
    assert f"mode {mode}" in message and "precise" in message


# -- the picking state ----------------------------------------------------------------------------------


def _state(kv: Any) -> dict[str, Any]:
    row = {"address": "10.0.0.1:8000", "weight": 10, "healthy": True, "kv_events": kv}
    return {"clusters": {"c": [row]}, "stale_after_ms": 5000}


def test_the_book_reads_each_endpoints_kv_events() -> None:
    kv = {"endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": "tcp://10.0.0.1:5558", "topic": ""}
    [row] = parse_picking_state(_state(kv)).clusters["c"]
    assert (row.kv_events, row.kv_events_replay, row.kv_events_topic) == (
        "tcp://10.0.0.1:5557",
        "tcp://10.0.0.1:5558",
        "",
    )
    [row] = parse_picking_state(_state(None)).clusters["c"]
    assert row.kv_events is None and row.kv_events_replay is None


@pytest.mark.parametrize(
    "kv", ["tcp://10.0.0.1:5557", {"endpoint": 5}, {"endpoint": "x", "replay_endpoint": 1}]
)
def test_a_bad_kv_events_in_the_state_is_refused_naming_the_field(kv: Any) -> None:
    with pytest.raises(ValueError, match=r"clusters\.c\[0\]\.kv_events"):
        parse_picking_state(_state(kv))


def test_gpusim_refuses_two_shared_kv_events_configs_or_a_name_twice() -> None:
    one = '{"enable_kv_cache_events": true, "publisher": "zmq"}'
    with pytest.raises(ValueError, match="one JSON"):
        _kv_events_args([one, one])
    with pytest.raises(ValueError, match="once per name"):
        _kv_events_args([f"a={one}", f"a={one}"])
    shared, own = _kv_events_args([one, f"a={one}"])
    assert shared is not None and set(own) == {"a"}
