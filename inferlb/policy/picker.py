"""Endpoint picking (pure): an ordered list of endpoints for one request, from the prefix cache each endpoint
holds and the load it carries.

This is the scoring core of the endpoint picker. The request path calls :func:`pick` once per request on a
model that picks endpoints, and hands the result to Envoy the way the Gateway API Inference Extension's
endpoint-picker protocol does (``x-gateway-destination-endpoint: ip:port[,ip:port...]``, first choice
first, the rest a fallback order); Envoy's ``override_host`` load-balancing policy sends the request to the
first listed host it holds as healthy and falls back to the cluster's own policy otherwise. No I/O here: the
live state (what each endpoint caches, its queue, its KV usage, the gateway's own in-flight counts) is read
by the adapters and passed in.

The rule (every weight configurable, :class:`PickerWeights`). For endpoint ``e`` with capacity weight
``w_e`` (the GPU's relative capacity, e.g. the EDS weight), over the eligible endpoints ``E`` with total
weight ``W = sum w_e``:

* **Eligible** endpoints are the healthy ones of positive weight, within the request's subset when it has
  one (the EPP subset hint) and within its length class's hosts when it has one (``class_hosts``: the GPUs
  allowed for its output cap, as :mod:`inferlb.policy.length_aware` classes them). None eligible:
  :class:`NoEligibleEndpoint` (the EPP protocol answers 503).
* **Request load** ``L_e = (in_flight_e + waiting_e) / w_e`` (requests per unit of capacity), against the
  fleet's ``Lbar = (T + 1) / W`` with ``T = sum (in_flight + waiting)`` (the mean with this request).
* **Load guard** (bounded-load consistent hashing, Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing
  with Bounded Loads", SODA 2018): an endpoint's capacity is ``ceil(load_factor * (T + 1) * w_e / W)``
  requests; an endpoint whose outstanding requests would exceed it by taking the request is *over the
  bound* and is listed only after every endpoint within it, whatever its prefix match. Since the capacities
  add up to at least ``load_factor * (T + 1) > T + 1``, some endpoint is always within the bound, so the
  first choice never exceeds ``load_factor * (T + 1) * w_e / W + 1`` requests: a hot prefix spills to other
  endpoints instead of piling onto the one that caches it, and an idle fleet has every endpoint within.
* **Prefill load** in tokens: ``Q_e = (prefill_tokens_e + miss_e) / p_e``, the prompt tokens ``e`` would
  have to prefill before this request's first token (those sent and not yet prefilled, plus this request's
  own miss ``miss_e = max(prompt_tokens - block_tokens * matched_e, 0)``) per unit of *prefill* capacity
  ``p_e`` (``prefill_weight``, in ``w_e``'s unit: the weight times the GPU profile's
  ``prefill_relative_capacity / relative_capacity``, since prefill is compute-bound and decode
  bandwidth-bound, an H100 prefills 7.2 V100s' worth but decodes 3.4; ``p_e = w_e`` when the profile
  gives no prefill capacity): an estimate of the request's time to first token (prefill time is about
  linear in tokens at these lengths; vLLM's chunked prefill runs a fixed token budget per step). It prices
  a cache hit and a queue in the same unit, against ``Qbar = prompt_tokens``: the request's own cold
  prefill on a unit of prefill capacity, so a queue of several prompts outweighs any hit. When
  ``prompt_tokens`` is unknown (0), ``Qbar`` is the fleet's mean queue ``sum prefill_tokens / W`` instead,
  and the term is 0 when that is 0 too. Only this term uses ``p_e``: request and decode load stay per unit
  of ``w_e``.
* **Decode load** ``D_e = decode_tokens_e / w_e`` (completion tokens still owed by the requests in flight,
  at most their ``max_tokens``), against ``Dbar = (sum decode_tokens + 1) / W``.
* **Score** of an endpoint within the bound::

      prefix * matched_e / prompt_blocks - load * L_e / Lbar - tokens * Q_e / Qbar
          - decode * D_e / Dbar - kv * kv_usage_e

  with ``matched_e`` the leading prompt blocks ``e`` caches (0..``prompt_blocks``) and ``kv_usage_e`` its
  KV-cache usage (0..1, vLLM's ``vllm:kv_cache_usage_perc``; 0 when unknown). Every load term is relative
  to the fleet's mean, so the weights do not depend on the fleet's size or traffic. A new prefix (no
  endpoint holds any of it) is placed by load alone: it spreads to the least-loaded endpoints. The score
  follows llm-d's inference scheduler (prefix-cache scorer plus queue and KV-cache utilisation scorers,
  weighted) with token-based load as in "Preble: Efficient Distributed Prompt Scheduling for LLM Serving"
  (Srivatsa et al., ICLR 2025), which balances prefill work rather than request counts.
* **Candidates**: with ``PickerWeights.candidates = k > 0`` and more eligible endpoints than ``2k``, at
  most ``2k`` are scored: the ``k`` matching the most blocks, plus the ``k`` least loaded of ``2k`` drawn at
  random by ``candidate_seed`` (power of ``d`` choices: Mitzenmacher, "The Power of Two Choices in
  Randomized Load Balancing", IEEE TPDS 2001). The load guard and the means still cover every eligible
  endpoint. Exact scoring (``candidates = 0``, the default) scores every eligible endpoint.
* **Ties** break by a hash of ``(salt, address)``: a pick is a pure function of its inputs (identical inputs,
  identical picks), and different salts (a per-process value) keep several request-path replicas from all
  choosing the same endpoint among equals.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import operator
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import lru_cache
from typing import Final, Protocol

import msgspec

from inferlb.errors import InferlbError

#: Hosts listed in one pick at most (the first is the choice, the rest a fallback order for Envoy).
DEFAULT_MAX_HOSTS: Final = 3
#: vLLM's default ``--block-size`` (tokens per KV-cache block), the default of :func:`pick`'s
#: ``block_tokens``.
DEFAULT_BLOCK_TOKENS: Final = 16


class NoEligibleEndpoint(InferlbError):
    """No endpoint can take the request: none is healthy, or none is in the request's subset or class."""


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
        prefill_tokens: prompt tokens of the requests in flight whose first token the gateway has not seen
            yet (prefill still owed; tokens, >= 0), 0 if not counted.
        decode_tokens: completion tokens the requests in flight may still generate (each at most its
            ``max_tokens`` less the tokens seen; tokens, >= 0), 0 if not counted.
        prefill_weight: relative prefill capacity in ``weight``'s unit (> 0; ``weight`` times the GPU
            profile's ``prefill_relative_capacity / relative_capacity``), what the prefill load ``Q_e`` is
            divided by; None: ``weight`` (prefill scales as decode).
    """

    address: str
    weight: float = 1.0
    healthy: bool = True
    in_flight: int = 0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefill_tokens: float = 0.0
    decode_tokens: float = 0.0
    prefill_weight: float | None = None


class PickerWeights(msgspec.Struct, frozen=True, kw_only=True):
    """The weights of :func:`pick`'s score and its load guard (the formula: the module doc).

    Attributes:
        prefix: weight of the matched share of the prompt's blocks (0..1).
        load: weight of the endpoint's request load relative to the fleet mean.
        kv: weight of the endpoint's KV-cache usage (0..1).
        tokens: weight of the endpoint's prefill load in tokens (queued prefill plus this request's miss)
            relative to the fleet mean.
        decode: weight of the endpoint's outstanding completion tokens relative to the fleet mean.
        load_factor: the load guard's bound, a multiple of the mean load (> 1; 1.25 is the bounded-load
            paper's example, llm-d and Envoy's ``hash_balance_factor`` 150 use 1.5). The default 2.0 was
            measured on ``bench/prefix_live.py``'s shared-prefix workload at 90% of capacity (8 GPUs, ~14
            requests in flight): at 1.25 the bound, rounded up per endpoint of small weight, moved users off
            the GPU holding their prefix (hit 88% of the ideal); at 2.0, 94%, per-GPU in-flight max/mean
            still 1.32.
        max_hosts: endpoints listed per pick at most (>= 1).
        candidates: 0: score every eligible endpoint; ``k > 0``: score only the ``k`` best-matching and
            ``k`` sampled endpoints when more than ``2k`` are eligible (see the module doc).
    """

    prefix: float = 2.0
    load: float = 1.0
    kv: float = 0.5
    tokens: float = 1.0
    decode: float = 0.0
    load_factor: float = 2.0
    max_hosts: int = DEFAULT_MAX_HOSTS
    candidates: int = 0

    def __post_init__(self) -> None:
        if not self.load_factor > 1.0:
            raise ValueError(f"load_factor must be > 1, got {self.load_factor}")
        if self.max_hosts < 1:
            raise ValueError(f"max_hosts must be >= 1, got {self.max_hosts}")
        if self.candidates < 0:
            raise ValueError(f"candidates must be >= 0, got {self.candidates}")
        if not min(self.prefix, self.load, self.kv, self.tokens, self.decode) >= 0:
            raise ValueError("picker weights must be >= 0")


#: The weights :func:`pick` uses when none are given.
DEFAULT_WEIGHTS: Final = PickerWeights()


@lru_cache(maxsize=1 << 16)
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
    prompt_tokens: int = 0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    class_hosts: Collection[str] | None = None,
    candidate_seed: int = 0,
) -> tuple[str, ...]:
    """Order the endpoints for one request, best first (the rule: the module doc).

    Args:
        endpoints: the model's endpoints (any order; addresses unique).
        prompt_blocks: the request's full prompt blocks (>= 0; the denominator of the matched share).
        matched_blocks: address -> leading prompt blocks that endpoint caches (from a prefix index);
            missing addresses match 0.
        subset: when given, only these addresses are eligible (the EPP subset hint).
        weights: the score's weights and the load guard.
        salt: tie-break salt (a per-process value keeps replicas from herding).
        prompt_tokens: the request's prompt tokens (>= 0; 0: unknown, no miss is priced).
        block_tokens: tokens per block of ``matched_blocks`` (>= 1; vLLM's ``--block-size``).
        class_hosts: when given, only these addresses are eligible (the hosts of the request's length
            class).
        candidate_seed: seeds the sampled candidates when ``weights.candidates > 0`` (e.g. a request
            counter); ignored otherwise.

    Returns:
        Up to ``weights.max_hosts`` addresses: within the load bound by score, then over it by load.

    Raises:
        NoEligibleEndpoint: no endpoint is healthy, in the subset and in the class.
        ValueError: ``block_tokens < 1``.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if subset is None and class_hosts is None:
        eligible = [e for e in endpoints if e.healthy and e.weight > 0]
    else:
        eligible = [
            e
            for e in endpoints
            if e.healthy
            and e.weight > 0
            and (subset is None or e.address in subset)
            and (class_hosts is None or e.address in class_hosts)
        ]
    if not eligible:
        raise no_eligible(subset, class_hosts)
    prompt = max(prompt_tokens, 0)
    total_weight = sum(map(_WEIGHT, eligible))
    work = sum(map(_IN_FLIGHT, eligible)) + sum(map(_WAITING, eligible)) + 1.0
    share_bound, f_load, f_tokens, f_decode, f_prefix = factors(
        weights,
        total_weight=total_weight,
        work=work,
        prefill_sum=lambda: sum(map(_PREFILL, eligible)),
        decode_sum=lambda: sum(map(_DECODE, eligible)),
        prompt=prompt,
        prompt_blocks=prompt_blocks,
    )
    matched = matched_blocks or {}
    scored = eligible
    k = weights.candidates
    if k and len(eligible) > 2 * k:
        scored = _candidates(eligible, matched, k, candidate_seed)
    w_kv = weights.kv
    within: list[tuple[float, int]] = []
    over: list[tuple[float, int]] = []
    get = matched.get
    ceil = math.ceil
    for i, e in enumerate(scored):
        outstanding = e.in_flight + e.waiting
        w = e.weight
        if outstanding + 1.0 > ceil(share_bound * w):
            over.append(((outstanding + 1.0) / w, i))
            continue
        kv = e.kv_usage
        score = -f_load * outstanding - w_kv * w * (0.0 if kv < 0.0 else 1.0 if kv > 1.0 else kv)
        if f_prefix or f_tokens:
            m = get(e.address, 0) if f_prefix or matched else 0
            m = 0 if m < 0 else prompt_blocks if m > prompt_blocks else m
            score += f_prefix * w * m
            if f_tokens:
                miss = prompt - block_tokens * m
                # the score is kept times w (divided below): w / p_e turns Q_e's 1 / p_e into 1 / w
                pw = e.prefill_weight
                score -= f_tokens * (e.prefill_tokens + (miss if miss > 0 else 0)) * (w / (pw or w))
        if f_decode:
            score -= f_decode * e.decode_tokens
        within.append((-score / w, i))
    n = weights.max_hosts
    best = _first(within, n, scored, salt)
    if len(best) < n:
        best += _first(over, n - len(best), scored, salt)
    return tuple(best)


def factors(
    weights: PickerWeights,
    *,
    total_weight: float,
    work: float,
    prefill_sum: Callable[[], float],
    decode_sum: Callable[[], float],
    prompt: int,
    prompt_blocks: int,
) -> tuple[float, float, float, float, float]:
    """:func:`pick`'s per-request constants from the eligible endpoints' sums (the module doc's means).

    Args:
        weights: the score's weights.
        total_weight: ``W``, the eligible endpoints' total weight (> 0).
        work: ``T + 1``, their outstanding requests plus this one.
        prefill_sum: their total ``prefill_tokens`` (called only when ``prompt`` is 0 and the token term
            is weighted).
        decode_sum: their total ``decode_tokens`` (called only when the decode term is weighted).
        prompt: the request's prompt tokens (>= 0; 0: unknown).
        prompt_blocks: its full prompt blocks.

    Returns:
        ``(share_bound, f_load, f_tokens, f_decode, f_prefix)``: the load guard's bound per unit of weight
        (requests), and each term's weight over its mean folded into one factor (``weight * (x / w) /
        mean = factor * x / w``).
    """
    # Qbar: the request's own prefill; unknown, the fleet's mean queue per unit of weight
    if not weights.tokens:
        prefill = 0.0
    elif prompt:
        prefill = float(prompt)
    else:
        prefill = prefill_sum() / total_weight
    decode = decode_sum() + 1.0 if weights.decode else 1.0
    return (
        weights.load_factor * work / total_weight,
        weights.load * total_weight / work,
        weights.tokens / prefill if prefill > 0 else 0.0,
        weights.decode * total_weight / decode,
        weights.prefix / prompt_blocks if prompt_blocks > 0 else 0.0,
    )


def no_eligible(subset: Collection[str] | None, class_hosts: Collection[str] | None) -> NoEligibleEndpoint:
    """The error of a pick with no eligible endpoint, naming the restrictions the request had."""
    where = [w for w, given in (("subset", subset), ("length class", class_hosts)) if given is not None]
    named = f" in the request's {' and '.join(where)}" if where else ""
    return NoEligibleEndpoint("no healthy endpoint" + named)


_WEIGHT: Final = operator.attrgetter("weight")
_IN_FLIGHT: Final = operator.attrgetter("in_flight")
_WAITING: Final = operator.attrgetter("waiting")
_PREFILL: Final = operator.attrgetter("prefill_tokens")
_DECODE: Final = operator.attrgetter("decode_tokens")


def _first(items: list[tuple[float, int]], n: int, scored: list[EndpointState], salt: bytes) -> list[str]:
    """The addresses of the ``n`` smallest keys, ties broken by the salted address hash: only the keys up to
    the ``n``-th smallest get a tie hash (one pass, then a sort of those few)."""
    if not items:
        return []
    cut = min(items)[0] if n == 1 else heapq.nsmallest(n, items)[-1][0]
    few = sorted((x, _tie_key(salt, scored[i].address), i) for x, i in items if x <= cut)
    return [scored[i].address for _, _, i in few[:n]]


def _candidates(
    eligible: list[EndpointState], matched: Mapping[str, int], k: int, seed: int
) -> list[EndpointState]:
    """The ``k`` eligible endpoints matching the most blocks, then the ``k`` least loaded of ``2k`` drawn by
    ``seed`` (without replacement), no endpoint twice."""
    holders = [e for e in eligible if e.address in matched] if matched else []
    if len(holders) > k:
        holders.sort(key=lambda e: (-matched[e.address], e.address))
        del holders[k:]
    seen = {e.address for e in holders}
    drawn = [e for e in random.Random(seed).sample(eligible, 2 * k) if e.address not in seen]
    drawn.sort(key=lambda e: ((e.in_flight + e.waiting) / e.weight, e.address))
    return holders + drawn[:k]
