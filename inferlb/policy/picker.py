"""Endpoint picking (pure): an ordered list of endpoints for one request, from the prefix cache each endpoint
holds and the load it carries.

This is the scoring core of the endpoint picker. The request path calls :func:`pick` once per request on a
model that picks endpoints, and hands the result to Envoy the way the Gateway API Inference Extension's
endpoint-picker protocol does (``x-gateway-destination-endpoint: ip:port[,ip:port...]``, first choice
first, the rest a fallback order); Envoy's ``override_host`` load-balancing policy sends the request to the
first listed host it holds as healthy and falls back to the cluster's own policy otherwise. No I/O here: the
live state (what each endpoint caches, its queue, its KV usage, the gateway's own in-flight count) is read
by the adapters and passed in.

The rule (every weight configurable, :class:`PickerWeights`):

* **Eligible** endpoints are the healthy ones, within the request's subset when it has one (the EPP subset
  hint). None eligible: :class:`NoEligibleEndpoint` (the EPP protocol answers 503).
* **Load** of an endpoint is its outstanding work over its capacity weight: ``(in_flight + waiting) /
  weight`` (requests per unit of capacity; ``weight`` is the GPU's relative capacity, e.g. the EDS weight).
* **Load guard** (bounded-load consistent hashing, Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing
  with Bounded Loads", SODA 2018): an endpoint's capacity is ``ceil(load_factor * (T + 1) * weight / W)``
  requests, where ``T`` is the eligible endpoints' outstanding work and ``W`` their total weight (its share
  of ``load_factor`` times the fleet's work with this request); an endpoint whose outstanding work would
  exceed it by taking the request is *over the bound* and is listed only after every endpoint within it,
  whatever its prefix match. So a hot prefix spills to other endpoints instead of piling onto the one that
  caches it, and (the ceiling) an idle fleet has every endpoint within the bound.
* **Score** of an endpoint within the bound: ``prefix * matched_fraction - load * load / mean_load -
  kv * kv_usage``, where ``matched_fraction`` is the share of the request's prompt blocks the endpoint
  holds as a leading run (0..1) and ``kv_usage`` its KV-cache usage (0..1, vLLM's
  ``vllm:kv_cache_usage_perc``; 0 when unknown). A new prefix (no endpoint holds any of it) is therefore
  placed by load alone: it spreads to the least-loaded endpoints.
* **Ties** break by a hash of ``(salt, address)``: a pick is a pure function of its inputs (identical inputs,
  identical picks), and different salts (a per-process value) keep several request-path replicas from all
  choosing the same endpoint among equals.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Final, Protocol

import msgspec

from inferlb.errors import InferlbError

#: Hosts listed in one pick at most (the first is the choice, the rest a fallback order for Envoy).
DEFAULT_MAX_HOSTS: Final = 3


class NoEligibleEndpoint(InferlbError):
    """No endpoint can take the request: none is healthy, or none is in the request's subset."""


class PrefixIndex(Protocol):
    """Where a request's prompt blocks are cached, per endpoint: the seam between :func:`pick` and the
    indexes that feed it (*approximate*, learnt from the gateway's own picks; *precise*, rebuilt from the
    model servers' KV events).

    A block key is an ``int`` naming one full block of prompt tokens together with every block before it
    (a chained hash, as vLLM's block hashes are), so equal keys at position ``i`` mean equal prompts up to
    the end of block ``i``.
    """

    def matched_blocks(self, keys: Sequence[int], addresses: Collection[str]) -> Mapping[str, int]:
        """Address -> how many of ``keys``, from the first, the endpoint holds (addresses holding none may
        be left out)."""
        ...

    def record_pick(self, address: str, keys: Sequence[int]) -> None:
        """The request with ``keys`` was sent to ``address`` (an approximate index learns from it; a
        precise one may ignore it)."""
        ...


class NoPrefixIndex:
    """A :class:`PrefixIndex` that knows of no cached block: picks by load alone."""

    def matched_blocks(self, keys: Sequence[int], addresses: Collection[str]) -> Mapping[str, int]:
        """Nothing is known cached: an empty mapping."""
        return {}

    def record_pick(self, address: str, keys: Sequence[int]) -> None:
        """Nothing to learn."""


class EndpointState(msgspec.Struct, frozen=True, kw_only=True):
    """What the picker knows of one endpoint at the time of a pick.

    Attributes:
        address: ``ip:port`` as Envoy's ``override_host`` matches it (the EDS endpoint's socket address).
        weight: relative capacity (> 0; the GPU profile's, or the endpoint's EDS weight).
        healthy: False: never picked (unhealthy, draining or ejected).
        in_flight: requests the gateway sent and has not seen end (counted by the request path).
        waiting: requests waiting in the model server's queue (``vllm:num_requests_waiting``), 0 if unknown.
        kv_usage: KV-cache usage 0..1 (``vllm:kv_cache_usage_perc``), 0 if unknown.
    """

    address: str
    weight: float = 1.0
    healthy: bool = True
    in_flight: int = 0
    waiting: float = 0.0
    kv_usage: float = 0.0


class PickerWeights(msgspec.Struct, frozen=True, kw_only=True):
    """The weights of :func:`pick`'s score and its load guard.

    Attributes:
        prefix: weight of the matched share of the prompt's blocks (0..1).
        load: weight of the endpoint's load relative to the fleet mean.
        kv: weight of the endpoint's KV-cache usage (0..1).
        load_factor: the load guard's bound, a multiple of the mean load (> 1; 1.25 is the bounded-load
            paper's example, llm-d and Envoy's ``hash_balance_factor`` 150 use 1.5).
        max_hosts: endpoints listed per pick at most (>= 1).
    """

    prefix: float = 2.0
    load: float = 1.0
    kv: float = 0.5
    load_factor: float = 1.25
    max_hosts: int = DEFAULT_MAX_HOSTS

    def __post_init__(self) -> None:
        if self.load_factor <= 1.0:
            raise ValueError(f"load_factor must be > 1, got {self.load_factor}")
        if self.max_hosts < 1:
            raise ValueError(f"max_hosts must be >= 1, got {self.max_hosts}")
        if min(self.prefix, self.load, self.kv) < 0:
            raise ValueError("picker weights must be >= 0")


#: The weights :func:`pick` uses when none are given.
DEFAULT_WEIGHTS: Final = PickerWeights()


def _tie_key(salt: bytes, address: str) -> bytes:
    return hashlib.blake2b(address.encode(), digest_size=8, key=salt[:64]).digest()


def pick(
    endpoints: Sequence[EndpointState],
    *,
    prompt_blocks: int = 0,
    matched_blocks: Mapping[str, int] | None = None,
    subset: Collection[str] | None = None,
    weights: PickerWeights = DEFAULT_WEIGHTS,
    salt: bytes = b"",
) -> tuple[str, ...]:
    """Order the endpoints for one request, best first.

    Args:
        endpoints: the model's endpoints (any order; addresses unique).
        prompt_blocks: the request's full prompt blocks (>= 0; the denominator of the matched share).
        matched_blocks: address -> leading prompt blocks that endpoint caches (from a prefix index);
            missing addresses match 0.
        subset: when given, only these addresses are eligible (the EPP subset hint).
        weights: the score's weights and the load guard.
        salt: tie-break salt (a per-process value keeps replicas from herding).

    Returns:
        Up to ``weights.max_hosts`` addresses: within the load bound by score, then over it by load.

    Raises:
        NoEligibleEndpoint: no endpoint is healthy and in the subset.
    """
    eligible = [
        e for e in endpoints if e.healthy and e.weight > 0 and (subset is None or e.address in subset)
    ]
    if not eligible:
        raise NoEligibleEndpoint(
            "no healthy endpoint" + (" in the request's subset" if subset is not None else "")
        )
    total_weight = sum(e.weight for e in eligible)
    work = sum(e.in_flight + e.waiting for e in eligible) + 1.0
    mean = work / total_weight
    share_bound = weights.load_factor * work / total_weight
    matched = matched_blocks or {}
    within: list[tuple[float, bytes, str]] = []
    over: list[tuple[float, bytes, str]] = []
    for e in eligible:
        outstanding = e.in_flight + e.waiting
        tie = _tie_key(salt, e.address)
        if outstanding + 1.0 > math.ceil(share_bound * e.weight):
            over.append(((outstanding + 1.0) / e.weight, tie, e.address))
            continue
        share = min(matched.get(e.address, 0), prompt_blocks) / prompt_blocks if prompt_blocks > 0 else 0.0
        load = outstanding / e.weight
        score = (
            weights.prefix * share - weights.load * load / mean - weights.kv * min(max(e.kv_usage, 0.0), 1.0)
        )
        within.append((-score, tie, e.address))
    within.sort()
    over.sort()
    return tuple(a for _, _, a in (within + over)[: weights.max_hosts])
