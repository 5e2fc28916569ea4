"""The EPP's prefix indexes: ``--prefix-index approximate`` learns from its own picks (and from the
gateway's served report), ``precise`` from KV events; a repeated long prompt is picked where its blocks are
held; the flags that build them, and bad ones refused naming the flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epp.__main__ import _parser, pool_endpoints, prefix_settings
from epp.metrics import EppMetrics
from epp.picking import EndpointPicker, RequestSeen, Routed, block_keys, prefix_index
from epp.pool import Pool, PoolEndpoint, PoolError
from inferlb.policy.kv_index import BlockStored, PreciseKvIndex
from inferlb.policy.picker import NoPrefixIndex
from inferlb.policy.prefix_index import ApproximatePrefixIndex
from inferlb.policy.telemetry import ServerMetrics
from inferlb.request.blocks import prompt_block_keys
from inferlb.request.parsing import EndpointKind, parse_request
from inferlb.request.prompt_ids import conversation_ids
from tests.conftest import make_config_doc, write_config

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
MODEL = "llama-3.1-8b-instruct"


def chat(i: int) -> bytes:
    """A chat body whose prompt is many blocks long (a document of its own per ``i``)."""
    content = f"document {i}: " + " ".join(f"word{i}-{j}" for j in range(300))
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def seen(i: int) -> RequestSeen:
    return RequestSeen(method="POST", path="/v1/chat/completions", body=chat(i))


def make_picker(mode: str) -> EndpointPicker:
    pool = Pool([PoolEndpoint(address=a) for a in (A, B, C)], stale_after_s=1e9, clock=lambda: 0.0)
    for a in (A, B, C):
        pool.observed(a, ServerMetrics(family="vllm", waiting_requests=0, kv_cache_usage=0))
    metrics = EppMetrics(pool.addresses, pool.in_flight)
    return EndpointPicker(pool, metrics, index=prefix_index(mode, block_size=16), salt=b"test")  # type: ignore[arg-type]


def first(decision: object) -> str:
    assert isinstance(decision, Routed), decision
    return decision.endpoints[0]


def test_prefix_index_modes_build_the_request_paths_indexes() -> None:
    assert isinstance(prefix_index("off"), NoPrefixIndex)
    assert isinstance(prefix_index("approximate"), ApproximatePrefixIndex)
    index = prefix_index("precise", block_size=32)
    assert isinstance(index, PreciseKvIndex) and index.block_size == 32
    with pytest.raises(ValueError, match="load"):
        prefix_index("load")  # type: ignore[arg-type]


def test_block_keys_are_the_request_paths_keys() -> None:
    request = parse_request(EndpointKind.CHAT_COMPLETIONS, chat(0))
    keys = block_keys(request, block_size=16)
    assert keys and keys == prompt_block_keys(request, block_size=16)
    assert block_keys(None) == ()


def test_a_repeated_prompt_is_picked_where_the_index_learnt_it() -> None:
    """Three prompts in flight, one per endpoint (equal loads); each repeat goes to its prompt's endpoint.
    With no index the repeats go by load and tie hash: not all three where their prompts went."""
    picker = make_picker("approximate")
    placed = [first(picker.decide(seen(i))) for i in range(3)]
    assert sorted(placed) == sorted((A, B, C)), "in-flight counts spread the first three"
    # repeated in the other order: by load and tie hash they would go where the first three went, in order
    assert [first(picker.decide(seen(i))) for i in (2, 1, 0)] == placed[::-1]


def test_without_an_index_the_repeats_go_by_load() -> None:
    picker = make_picker("off")
    placed = [first(picker.decide(seen(i))) for i in range(3)]
    assert [first(picker.decide(seen(i))) for i in (2, 1, 0)] != placed[::-1]
    decision = picker.decide(seen(0))
    assert isinstance(decision, Routed) and decision.keys == ()


def test_the_served_report_records_the_prompt_on_the_endpoint_that_served_it() -> None:
    picker = make_picker("approximate")
    routed = picker.decide(seen(7))
    assert isinstance(routed, Routed) and routed.keys
    other = next(a for a in (A, B, C) if a != routed.endpoints[0])
    assert picker.served(routed, other) == other
    picker.finished(other)
    assert picker.index.matched_blocks(routed.keys, [other]) == {other: len(routed.keys)}
    # an endpoint outside the pool (a gateway's foreign report) teaches nothing
    routed = picker.decide(seen(8))
    assert isinstance(routed, Routed)
    picker.finished(picker.served(routed, "192.0.2.1:9"))
    assert picker.index.matched_blocks(routed.keys, ["192.0.2.1:9"]) == {}


def test_precise_picks_the_endpoint_whose_kv_events_hold_the_prompt() -> None:
    picker = make_picker("precise")
    index = picker.index
    assert isinstance(index, PreciseKvIndex)
    ids = tuple(conversation_ids(parse_request(EndpointKind.CHAT_COMPLETIONS, chat(3))))
    full = len(ids) // 16 * 16
    index.apply(
        C,
        [
            BlockStored(
                block_hashes=tuple(range(1, full // 16 + 1)),
                parent_block_hash=None,
                token_ids=ids[:full],
                block_size=16,
            )
        ],
    )
    # A and B are idle, C has one in flight: the cached prompt still goes to C
    first(picker.decide(seen(50)))
    picker.pool.enter(C)
    assert first(picker.decide(seen(3))) == C


def _settings(argv: list[str]) -> Any:
    args = _parser().parse_args(argv)
    return prefix_settings(args, pool_endpoints(args))


def test_prefix_flags_and_their_config_defaults(tmp_path: Path) -> None:
    s = _settings(["--endpoint", f"{A},{B}"])
    assert (s.mode, s.block_size, dict(s.kv_events)) == ("off", 16, {})
    s = _settings(
        [
            *("--endpoint", f"{A},{B}", "--prefix-index", "precise", "--block-size", "32"),
            *("--kv-events", f"{A}=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"),
        ]
    )
    assert s.mode == "precise" and s.block_size == 32
    assert s.kv_events[A].endpoint == "tcp://127.0.0.1:5557"
    assert s.kv_events[A].replay_endpoint == "tcp://127.0.0.1:5558"
    doc: dict[str, Any] = make_config_doc()
    model = next(m for m in doc["models"] if m["name"] == MODEL)
    model["endpoint_picking"] = {"mode": "precise", "block_size": 8}
    mine = [e for e in doc["endpoints"] if e["model"] == MODEL]
    mine[0]["kv_events"] = "tcp://127.0.0.1:6001"
    path = write_config(tmp_path / "c.yaml", doc)
    s = _settings(["--config", str(path), "--model", MODEL])
    assert (s.mode, s.block_size) == ("precise", 8)
    assert {a: k.endpoint for a, k in s.kv_events.items()} == {mine[0]["address"]: "tcp://127.0.0.1:6001"}
    s = _settings(["--config", str(path), "--model", MODEL, "--prefix-index", "approximate"])
    assert (s.mode, dict(s.kv_events)) == ("approximate", {})


@pytest.mark.parametrize(
    "extra",
    [
        ["--prefix-index", "precise"],
        ["--kv-events", f"{A}=tcp://127.0.0.1:5557"],
        ["--prefix-index", "precise", "--kv-events", f"{C}=tcp://127.0.0.1:5557"],
        ["--prefix-index", "precise", "--kv-events", f"{A}"],
        ["--prefix-index", "precise", "--kv-events", f"{A}=http://127.0.0.1:5557"],
        ["--prefix-index", "precise", *(["--kv-events", f"{A}=tcp://127.0.0.1:5557"] * 2)],
    ],
)
def test_bad_kv_event_flags_are_refused_naming_the_flag(extra: list[str]) -> None:
    with pytest.raises(PoolError) as err:
        _settings(["--endpoint", f"{A},{B}", *extra])
    assert err.value.field == "--kv-events"


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(PoolError) as err:
        _settings(["--endpoint", A, "--block-size", "0"])
    assert err.value.field == "--block-size"
