"""Fleet changes made without editing the config file: register, drain, deregister, weight overrides.

Pure: a :class:`FleetState` is an immutable value; each change returns a new one. The server applies it on
top of the last good config file with :func:`effective_config` and :func:`effective_overrides`, so a config
edit and fleet API changes compose (the file gives the base fleet, the API adds, hides and re-weights
endpoints; an endpoint registered at an address the file also lists replaces the file's entry).

Endpoints are named by :func:`xds_server.resources.endpoints.endpoint_key` (their ``host:port``). Times are
Unix seconds (wall clock, ``time.time()``): a drain's end is a moment in the world, so it means the same
after a restart (a monotonic clock restarts with the machine and differs between processes).

What composes with what:

- re-registering an endpoint (same address) replaces it and cancels its drain and its weight pin;
- :meth:`FleetState.undrain` cancels a drain that has not ended; once it ended the endpoint is removed like
  a deregistration, and a registration brings it back;
- a config reload keeps drains, pins and deregistrations of every endpoint still served
  (:meth:`FleetState.reconcile`), and forgets them for endpoints the new file (and the API's registrations)
  no longer has, so an address added to the file again later comes back plain.

The durable form is a JSON document (:func:`to_document`, :func:`from_document`; the file store is
:mod:`xds_server.fleet_store`)::

    {"inferlb_fleet_state": 1,
     "registered": [{endpoint, the config file's shape}, ...],      # registration order
     "draining": {"host:port": removal time, Unix s},
     "hidden": ["host:port", ...],                                   # config-file endpoints deregistered
     "weight_overrides": {"host:port": Envoy weight >= 1}}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final

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
        draining: ``{key: time it is removed, Unix s}`` for endpoints sent as DRAINING.
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

    def undrain(self, key: str) -> FleetState:
        """Cancel a drain that has not ended: the endpoint is served as before (no-op when not draining)."""
        return replace(self, draining=_frozen({k: v for k, v in self.draining.items() if k != key}))

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

    def reconcile(self, config: Config) -> FleetState:
        """This state against a (new) config file: :meth:`forget_hidden`, and forget the drains and weight
        pins of endpoints that are no longer served (neither in the file nor registered)."""
        state = self.forget_hidden(config)
        served = known_keys(config, state)
        return replace(
            state,
            draining=_frozen({k: v for k, v in state.draining.items() if k in served}),
            weight_overrides=_frozen({k: v for k, v in state.weight_overrides.items() if k in served}),
        )

    @property
    def empty(self) -> bool:
        """True when the fleet API changed nothing."""
        return not (self.registered or self.draining or self.hidden or self.weight_overrides)


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
    """``config`` with its endpoints replaced by :func:`effective_endpoints`, validated again (its TLS files
    not read again: checked when ``config`` was loaded).

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
    # the certificate files were checked when ``config`` was loaded; mid-rotation they may not load for a
    # moment, which must not refuse an endpoint's registration
    return parse_config(doc, source, check_tls_files=False)


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


#: The ``inferlb_fleet_state`` value of the documents :func:`to_document` writes.
DOCUMENT_VERSION: Final = 1


def to_document(state: FleetState) -> dict[str, Any]:
    """The JSON-ready form of ``state`` (module docstring): registered endpoints in registration order,
    the rest sorted by key, so equal states give equal documents."""
    return {
        "inferlb_fleet_state": DOCUMENT_VERSION,
        "registered": [_endpoint_document(e) for e in state.registered.values()],
        "draining": {k: state.draining[k] for k in sorted(state.draining)},
        "hidden": sorted(state.hidden),
        "weight_overrides": {k: state.weight_overrides[k] for k in sorted(state.weight_overrides)},
    }


def _endpoint_document(e: EndpointConfig) -> dict[str, Any]:
    """An endpoint as the config file writes it: ``address`` as ``host:port``, defaults left out."""
    return {**e.model_dump(mode="json", exclude_defaults=True), "address": str(e.address)}


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _str_keys(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name}: expected an object keyed by 'host:port'")
    return value


def from_document(doc: Any) -> FleetState:
    """Read a document :func:`to_document` wrote.

    Raises:
        ValueError: not such a document (another ``inferlb_fleet_state`` version, a wrong type, an
            endpoint the schema refuses, a registered address twice), the field named.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    version = doc.get("inferlb_fleet_state")
    if version != DOCUMENT_VERSION:
        raise ValueError(f"inferlb_fleet_state: expected {DOCUMENT_VERSION}, got {version!r}")
    unknown = sorted(set(doc) - {"inferlb_fleet_state", "saved_at", "registered", "draining", "hidden",
                                 "weight_overrides"})  # fmt: skip
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    raw_registered = doc.get("registered", [])
    if not isinstance(raw_registered, list):
        raise ValueError("registered: expected a list of endpoints")
    registered: dict[str, EndpointConfig] = {}
    for i, item in enumerate(raw_registered):
        try:
            endpoint = parse_endpoint(item, "<fleet state>")
        except ConfigError as exc:
            detail = "; ".join(f"{f}: {m}" for f, m in exc.problems)
            raise ValueError(f"registered[{i}]: {detail}") from None
        key = endpoint_key(endpoint)
        if key in registered:
            raise ValueError(f"registered[{i}]: {key} is registered twice")
        registered[key] = endpoint
    draining = _str_keys(doc, "draining")
    if not all(_is_number(v) for v in draining.values()):
        raise ValueError("draining: every removal time must be a finite number (Unix s)")
    hidden = doc.get("hidden", [])
    if not isinstance(hidden, list) or not all(isinstance(k, str) for k in hidden):
        raise ValueError("hidden: expected a list of 'host:port'")
    weights = _str_keys(doc, "weight_overrides")
    if not all(type(w) is int and w >= 1 for w in weights.values()):
        raise ValueError("weight_overrides: every weight must be an integer >= 1")
    return FleetState(
        registered=_frozen(registered),
        draining=_frozen({k: float(v) for k, v in draining.items()}),
        hidden=frozenset(hidden),
        weight_overrides=_frozen(weights),
    )
