"""xds_server.fleet_store and the fleet state's document form: any FleetState survives a save and a load
unchanged (order of registration included), a bad file is refused naming it, one server per file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferlb.config.schema import EndpointConfig
from xds_server.fleet_state import FleetState, from_document, to_document
from xds_server.fleet_store import FleetStateFile, StateFileError
from xds_server.resources import endpoint_key

_hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"),
    st.from_regex(r"gpu-[a-z0-9]{1,8}\.example", fullmatch=True),
)
_addresses = st.builds(lambda h, p: f"{h}:{p}", _hosts, st.integers(1, 65535))
_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Zs", "Cc")), min_size=1, max_size=12)
_endpoints = st.fixed_dictionaries(
    {
        "address": _addresses,
        "model": st.sampled_from(["llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "m"]),
        "version": st.none() | st.sampled_from(["v1", "v2"]),
        "gpu": st.sampled_from(["H100", "A100", "V100", "L4"]),
        "region": st.sampled_from(["local", "us-east"]),
        "zone": st.sampled_from(["a", "b"]),
        "simulated": st.booleans(),
        "name": st.none() | _names,
        "gpu_node": st.none() | st.from_regex(r"node-[0-9]{1,3}", fullmatch=True),
        "gpu_index": st.none() | st.integers(0, 1023),
        "gpu_uuid": st.none() | st.from_regex(r"GPU-[0-9a-f]{8}", fullmatch=True),
    }
).map(EndpointConfig.model_validate)
# wall-clock drain ends, from the past to long after now; the decimal digits matter (a restart keeps them)
_times = st.floats(0, 4e9, allow_nan=False, allow_infinity=False)


@st.composite
def fleet_states(draw: st.DrawFn) -> FleetState:
    """A FleetState built by a random sequence of fleet API changes."""
    state = FleetState()
    keys = draw(st.lists(_addresses, min_size=1, max_size=6, unique=True))
    for _ in range(draw(st.integers(0, 25))):
        op = draw(st.sampled_from(["register", "drain", "undrain", "deregister", "pin", "unpin"]))
        key = draw(st.sampled_from(keys))
        if op == "register":
            endpoint = draw(_endpoints)
            keys.append(endpoint_key(endpoint))
            state = state.register(endpoint)
        elif op == "drain":
            state = state.drain(key, draw(_times))
        elif op == "undrain":
            state = state.undrain(key)
        elif op == "deregister":
            state = state.deregister(key)
        elif op == "pin":
            state = state.override_weight(key, draw(st.integers(1, 1_000_000)))
        else:
            state = state.override_weight(key, None)
    return state


def _same(a: FleetState, b: FleetState) -> None:
    assert a == b
    assert list(a.registered.items()) == list(b.registered.items())  # registration order is EDS order


@given(fleet_states())
def test_document_round_trip(state: FleetState) -> None:
    doc = to_document(state)
    _same(from_document(json.loads(json.dumps(doc))), state)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(state=fleet_states())
def test_file_round_trip(tmp_path: Path, state: FleetState) -> None:
    store = FleetStateFile(tmp_path / "fleet.json")
    store.save(state, now=1.5)
    loaded = FleetStateFile(tmp_path / "fleet.json").load()
    assert loaded is not None
    _same(loaded, state)
    assert json.loads(store.path.read_text())["saved_at"] == 1.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.json"]  # no temporary file left


def test_a_missing_file_is_a_first_start(tmp_path: Path) -> None:
    assert FleetStateFile(tmp_path / "none.json").load() is None


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty"),
        (b'{"inferlb_fleet_state": 1, "registered": [', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b'{"inferlb_fleet_state": 2}', "inferlb_fleet_state: expected 1"),
        (b"[]", "expected a JSON object"),
        (b'{"inferlb_fleet_state": 1, "draining": {"127.0.0.1:1": "soon"}}', "draining"),
        (b'{"inferlb_fleet_state": 1, "weight_overrides": {"127.0.0.1:1": 0}}', "weight_overrides"),
        (b'{"inferlb_fleet_state": 1, "registered": [{"address": "x"}]}', "registered[0]"),
        (b'{"inferlb_fleet_state": 1, "extra": 1}', "unknown fields ['extra']"),
    ],
)
def test_a_bad_file_is_refused_naming_it(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "fleet.json"
    path.write_bytes(content)
    with pytest.raises(StateFileError) as err:
        FleetStateFile(path).load()
    assert err.value.path == path
    assert str(path) in str(err.value) and reason in str(err.value)


def test_a_registered_address_twice_is_refused(tmp_path: Path) -> None:
    e = {"address": "127.0.0.1:9", "model": "m", "gpu": "H100"}
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"inferlb_fleet_state": 1, "registered": [e, e]}))
    with pytest.raises(StateFileError, match="registered twice"):
        FleetStateFile(path).load()


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.mkdir()  # read_bytes fails (as it does for a file without read permission, for every user)
    with pytest.raises(StateFileError, match="cannot read"):
        FleetStateFile(path).load()


def test_a_failed_save_replaces_nothing(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    store = FleetStateFile(path)
    store.save(FleetState().override_weight("127.0.0.1:1", 5))
    before = path.read_bytes()
    path.with_name(f".{path.name}.{os.getpid()}.tmp").mkdir()  # the temporary file cannot be created
    with pytest.raises(StateFileError, match="cannot write"):
        store.save(FleetState())
    assert path.read_bytes() == before


def test_one_server_per_state_file(tmp_path: Path) -> None:
    first = FleetStateFile(tmp_path / "fleet.json")
    first.lock()
    second = FleetStateFile(tmp_path / "fleet.json")
    with pytest.raises(StateFileError, match="in use by another xds_server"):
        second.lock()
    first.close()
    second.lock()  # released with its holder
    second.close()
