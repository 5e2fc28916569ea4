"""Fleet changes made without editing the config file: register, drain, deregister, weight overrides.

Pure: a :class:`FleetState` is an immutable value; each change returns a new one. The server applies it on
top of the last good config file with :func:`effective_config` and :func:`effective_overrides`, so a config
edit and fleet API changes compose (the file gives the base fleet, the API adds, hides and re-weights
endpoints; an endpoint registered at an address the file also lists replaces the file's entry).

Endpoints are named by :func:`xds_server.resources.endpoints.endpoint_key` (their ``host:port``). Times are
seconds on the caller's monotonic clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from inferlb.config.schema import Config, EndpointConfig, parse_config
from inferlb.errors import ConfigError
from xds_server.resources.endpoints import EndpointOverride, endpoint_key


class UnknownEndpointError(KeyError):
    """A fleet change named an endpoint that is neither in the config nor registered."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(key)

    def __str__(self) -> str:
        return f"no endpoint {self.key!r} in the fleet"


def _frozen(m: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(m))


@dataclass(frozen=True, kw_only=True)
class FleetState:
    """What the fleet API changed, on top of the config file.

    Attributes:
        registered: ``{key: endpoint}`` registered over the API, in registration order.
        draining: ``{key: time it is removed}`` for endpoints sent as DRAINING.
        hidden: keys of config-file endpoints deregistered over the API (a new registration at the same
            address brings the endpoint back).
        weight_overrides: ``{key: Envoy weight >= 1}`` set over the API (these win over telemetry weights).
    """

    registered: Mapping[str, EndpointConfig] = field(default_factory=lambda: MappingProxyType({}))
    draining: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    hidden: frozenset[str] = frozenset()
    weight_overrides: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def changes_config(self) -> bool:
        """True when the endpoint list differs from the config file's (registrations or hidden ones)."""
        return bool(self.registered or self.hidden)

    def register(self, endpoint: EndpointConfig) -> FleetState:
        """Add (or replace) an endpoint; it is no longer hidden, draining or re-weighted."""
        key = endpoint_key(endpoint)
        registered = {k: v for k, v in self.registered.items() if k != key}
        registered[key] = endpoint
        return replace(
            self,
            registered=_frozen(registered),
            hidden=self.hidden - {key},
            draining=_frozen({k: v for k, v in self.draining.items() if k != key}),
            weight_overrides=_frozen({k: v for k, v in self.weight_overrides.items() if k != key}),
        )

    def drain(self, key: str, remove_at: float) -> FleetState:
        """Mark an endpoint DRAINING until ``remove_at``; draining again keeps the earlier removal time."""
        until = min(remove_at, self.draining.get(key, remove_at))
        return replace(self, draining=_frozen({**self.draining, key: until}))

    def deregister(self, key: str) -> FleetState:
        """Remove an endpoint now: a registered one is forgotten, a config-file one is hidden."""
        return replace(
            self,
            registered=_frozen({k: v for k, v in self.registered.items() if k != key}),
            hidden=self.hidden | {key},
            draining=_frozen({k: v for k, v in self.draining.items() if k != key}),
            weight_overrides=_frozen({k: v for k, v in self.weight_overrides.items() if k != key}),
        )

    def override_weight(self, key: str, weight: int | None) -> FleetState:
        """Pin an endpoint's Envoy weight (``None`` clears the pin).

        Raises:
            ValueError: ``weight`` below 1 (Envoy NACKs a 0 weight).
        """
        if weight is not None and weight < 1:
            raise ValueError(f"weight must be at least 1 (Envoy rejects 0), got {weight}")
        overrides = {k: v for k, v in self.weight_overrides.items() if k != key}
        if weight is not None:
            overrides[key] = weight
        return replace(self, weight_overrides=_frozen(overrides))

    def expire(self, now: float) -> FleetState:
        """Deregister every endpoint whose drain period ended at or before ``now``."""
        state = self
        for key, until in self.draining.items():
            if until <= now:
                state = state.deregister(key)
        return state

    def next_expiry(self) -> float | None:
        """The earliest drain end, or None when nothing drains."""
        return min(self.draining.values(), default=None)

    def forget_hidden(self, config: Config) -> FleetState:
        """Drop hidden keys the config file no longer lists (so re-adding one to the file brings it back)."""
        listed = {endpoint_key(e) for e in config.endpoints}
        return replace(self, hidden=frozenset(k for k in self.hidden if k in listed))


def effective_endpoints(config: Config, state: FleetState) -> list[EndpointConfig]:
    """The fleet Envoy gets: the file's endpoints (minus hidden and re-registered ones), then the
    registered ones."""
    file_endpoints = [
        e
        for e in config.endpoints
        if endpoint_key(e) not in state.hidden and endpoint_key(e) not in state.registered
    ]
    return [*file_endpoints, *state.registered.values()]


def effective_config(config: Config, state: FleetState, source: str = "<fleet>") -> Config:
    """``config`` with its endpoints replaced by :func:`effective_endpoints`, validated again.

    Registered endpoints go through the same checks as the file's (known model, version and GPU type,
    unique address).

    Raises:
        ConfigError: the combination is invalid, fields named (``endpoints[i]...``, counting the file's
            remaining endpoints first, then registered ones).
    """
    if not state.changes_config:
        return config
    doc = config.model_dump(mode="json", exclude={"endpoints"})
    doc["endpoints"] = [e.model_dump(mode="json") for e in effective_endpoints(config, state)]
    return parse_config(doc, source)


def known_keys(config: Config, state: FleetState) -> set[str]:
    """Every endpoint key the fleet API may change now."""
    return {endpoint_key(e) for e in effective_endpoints(config, state)}


def effective_overrides(
    state: FleetState,
    telemetry_weights: Mapping[str, int],
    length_classes: Mapping[str, tuple[str, ...]] | None = None,
) -> dict[str, EndpointOverride]:
    """Per-endpoint overrides for :func:`xds_server.resources.build.build_resources`.

    Weight precedence: a fleet API pin, then a telemetry weight, then (no override) the capacity weight.
    Draining endpoints get ``draining=True``. ``length_classes``: the telemetry's live length classes of
    the endpoints whose classes differ from their GPU profile's (the rest keep the profile's).
    """
    classes = length_classes or {}
    out: dict[str, EndpointOverride] = {}
    for key in {*state.weight_overrides, *telemetry_weights, *state.draining, *classes}:
        weight = state.weight_overrides.get(key, telemetry_weights.get(key))
        out[key] = EndpointOverride(
            weight=weight, draining=key in state.draining, length_classes=classes.get(key)
        )
    return out


def parse_endpoint(data: Any, source: str = "<fleet api>") -> EndpointConfig:
    """Validate one endpoint as the fleet API receives it (the config file's endpoint shape).

    Raises:
        ConfigError: fields named ``endpoint.<field>``.
    """
    if not isinstance(data, dict):
        raise ConfigError(source, [("endpoint", f"expected a JSON object, got {type(data).__name__}")])
    try:
        return EndpointConfig.model_validate(data)
    except ValidationError as exc:
        problems = [
            (
                ".".join(["endpoint", *(str(p) for p in err["loc"] if not str(p).startswith("function-"))]),
                err["msg"],
            )
            for err in exc.errors(include_url=False)
        ]
        raise ConfigError(source, problems) from None
