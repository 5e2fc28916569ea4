"""xds_server.fleet_state (register, drain, deregister, weight pins on top of the config) and the
push-coalescing deadline rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.config.schema import Config, EndpointConfig, default_config_path, load_config
from inferlb.errors import ConfigError
from xds_server.coalesce import push_deadline
from xds_server.fleet_state import (
    FleetState,
    effective_config,
    effective_endpoints,
    effective_overrides,
    known_keys,
    parse_endpoint,
)
from xds_server.resources import endpoint_key


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(default_config_path())


NEW = EndpointConfig.model_validate(
    {"address": "127.0.0.1:9100", "model": "qwen2.5-7b-instruct", "gpu": "H100", "name": "h100-new"}
)


def test_register_adds_and_deregister_removes(config: Config) -> None:
    state = FleetState().register(NEW)
    eff = effective_config(config, state)
    assert [e.display_name for e in eff.endpoints][-1] == "h100-new"
    assert len(eff.endpoints) == len(config.endpoints) + 1
    gone = state.deregister("127.0.0.1:9100")
    assert effective_config(config, gone).endpoints == config.endpoints


def test_deregistering_a_config_endpoint_hides_it_until_registered_again(config: Config) -> None:
    key = endpoint_key(config.endpoints[0])
    state = FleetState().deregister(key)
    assert key not in known_keys(config, state)
    back = state.register(config.endpoints[0])
    assert key in known_keys(config, back)
    # registered at the same address as a file endpoint: replaces it, no duplicate
    assert len(effective_endpoints(config, back)) == len(config.endpoints)


def test_registration_is_validated_like_the_file(config: Config) -> None:
    bad = NEW.model_copy(update={"model": "no-such-model"})
    with pytest.raises(ConfigError) as err:
        effective_config(config, FleetState().register(bad))
    assert any(f.endswith(".model") for f, _ in err.value.problems)
    with pytest.raises(ConfigError) as err2:
        parse_endpoint({"address": "not-an-address", "model": "x", "gpu": "H100"})
    assert [f for f, _ in err2.value.problems] == ["endpoint.address"]


def test_drain_then_expiry_removes(config: Config) -> None:
    key = endpoint_key(config.endpoints[1])
    state = FleetState().drain(key, remove_at=10.0)
    assert state.drain(key, remove_at=50.0).draining[key] == 10.0  # draining again keeps the first end
    assert state.next_expiry() == 10.0
    assert effective_overrides(state, {})[key].draining
    assert state.expire(9.9) == state
    done = state.expire(10.0)
    assert key not in known_keys(config, done)
    assert done.next_expiry() is None


def test_undrain_cancels_a_drain_and_registering_again_does_too(config: Config) -> None:
    key = endpoint_key(config.endpoints[1])
    state = FleetState().override_weight(key, 9).drain(key, remove_at=10.0)
    back = state.undrain(key)
    assert key not in back.draining and back.next_expiry() is None
    assert back.weight_overrides[key] == 9  # only the drain is cancelled
    assert back.expire(1e12) == back  # nothing left to remove
    assert FleetState().undrain(key) == FleetState()
    again = state.register(config.endpoints[1])
    assert key not in again.draining and key not in again.weight_overrides
    # drained, undrained, drained again: a new drain with its own end
    assert back.drain(key, remove_at=50.0).draining[key] == 50.0


def test_reconcile_keeps_changes_of_served_endpoints_and_forgets_the_rest(config: Config) -> None:
    kept, dropped = endpoint_key(config.endpoints[0]), endpoint_key(config.endpoints[1])
    hidden = endpoint_key(config.endpoints[2])
    state = (
        FleetState().register(NEW).drain(kept, 10.0).override_weight(kept, 3).drain(dropped, 20.0)
        .override_weight(dropped, 4).deregister(hidden).drain("127.0.0.1:9100", 30.0)
    )  # fmt: skip
    assert state.reconcile(config) == state
    smaller = config.model_copy(update={"endpoints": config.endpoints[:1] + config.endpoints[3:]})
    out = state.reconcile(smaller)
    assert dict(out.draining) == {kept: 10.0, "127.0.0.1:9100": 30.0}  # a registered one stays served
    assert dict(out.weight_overrides) == {kept: 3}
    assert out.hidden == frozenset()
    assert list(out.registered) == ["127.0.0.1:9100"]
    # the dropped address added to the file again comes back plain
    assert effective_overrides(out.reconcile(config), {}).get(dropped) is None


def test_weight_precedence_pin_then_telemetry() -> None:
    state = FleetState().override_weight("a:1", 7)
    out = effective_overrides(state, {"a:1": 300, "b:2": 40})
    assert out["a:1"].weight == 7
    assert out["b:2"].weight == 40
    assert effective_overrides(state.override_weight("a:1", None), {"a:1": 300})["a:1"].weight == 300
    with pytest.raises(ValueError, match="at least 1"):
        state.override_weight("a:1", 0)


@given(
    first=st.floats(0, 1e6),
    gaps=st.lists(st.floats(0, 10), max_size=20),
    debounce=st.floats(0, 5),
    max_delay=st.floats(0, 50),
)
def test_push_deadline_never_exceeds_the_staleness_bound(
    first: float, gaps: list[float], debounce: float, max_delay: float
) -> None:
    last = first + sum(gaps)
    deadline = push_deadline(first_change=first, last_change=last, debounce_s=debounce, max_delay_s=max_delay)
    assert deadline <= first + max_delay
    assert deadline <= last + debounce
    # quiet for the whole debounce after the last change, unless the bound came first
    assert deadline == last + debounce or deadline == first + max_delay
