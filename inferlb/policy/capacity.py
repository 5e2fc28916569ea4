"""The fleet model: what the config says about endpoints, turned into what Envoy balances on."""

from __future__ import annotations

import math

from inferlb.config.schema import Config, EndpointConfig

#: Envoy ``load_balancing_weight`` units per unit of relative capacity (V100 = 1.0 -> weight 10).
#: A factor of 10 keeps one decimal of the capacity ratio (A100 1.7 -> 17) in Envoy's integer weights.
WEIGHT_SCALE = 10
#: Envoy rejects 0 (EDS ``load_balancing_weight`` must be >= 1) and caps the sum per locality at 2^32-1.
MIN_WEIGHT = 1
MAX_WEIGHT = 1_000_000


def capacity_weight(config: Config, endpoint: EndpointConfig) -> int:
    """Envoy ``load_balancing_weight`` of an endpoint from its GPU profile alone.

    ``round(relative_capacity * WEIGHT_SCALE)`` clamped to ``[MIN_WEIGHT, MAX_WEIGHT]``; never 0, since
    Envoy NACKs a zero weight (envoy/config/endpoint/v3/endpoint_components.proto: ``uint32 gte 1``).

    Raises:
        KeyError: the endpoint's ``gpu`` has no profile (config validation prevents this).
    """
    cap = config.gpu_profiles[endpoint.gpu].relative_capacity
    return max(MIN_WEIGHT, min(MAX_WEIGHT, math.floor(cap * WEIGHT_SCALE + 0.5)))


def prefill_ratio(config: Config, endpoint: EndpointConfig) -> float:
    """How much faster the endpoint's GPU prefills than it decodes, relative to a V100: its profile's
    ``prefill_relative_capacity / relative_capacity`` (1.0 when the profile gives no prefill capacity).

    The endpoint picker's prefill weight is an endpoint's weight times this (an H100 in the embedded
    config: 7.23 / 3.4 = 2.13; prefill is compute-bound and decode bandwidth-bound, see
    :class:`inferlb.config.schema.GpuProfile`).

    Raises:
        KeyError: the endpoint's ``gpu`` has no profile (config validation prevents this).
    """
    profile = config.gpu_profiles[endpoint.gpu]
    prefill = profile.prefill_relative_capacity
    return 1.0 if prefill is None else prefill / profile.relative_capacity
