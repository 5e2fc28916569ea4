"""The endpoint picker's rule over numpy columns (pure): :func:`inferlb.policy.picker.pick`'s picks for large
fleets, at a fraction of its CPU.

:func:`~inferlb.policy.picker.pick` walks one :class:`~inferlb.policy.picker.EndpointState` per endpoint in
Python: 0.5-1 ms per pick at 1,000 endpoints. :class:`FleetColumns` keeps the same state as numpy arrays
(one per field, one row per endpoint), updated in place as the caller learns of changes (a request entered
or left, a new scrape), and :meth:`FleetColumns.pick` scores every row at once. Its answer is exactly
:func:`~inferlb.policy.picker.pick`'s for the same state and arguments: the same eligibility (healthy,
positive weight, the subset, the length class), the same floating-point operations in the same order (the
fleet sums are Python's ``sum`` over the eligible rows in endpoint order, as ``pick`` takes them), the same
load guard, the same sampled candidates (the same draws of :class:`random.Random`) and the same salted tie
order (:func:`~inferlb.policy.picker.pick`'s hash, as a ``uint64`` column). Inputs are finite, integer
fields (``in_flight``, matched blocks, prompt tokens) below 2**53, as the request path's are.

The numpy call overhead (a few microseconds per operation) makes the columns dearer than the Python loop on
small fleets: :data:`COLUMNAR_MIN_ENDPOINTS` is where the request path switches
(``bench/picker_scoring.py`` measures both).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt

from inferlb.policy.class_guard import SetLoad
from inferlb.policy.picker import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_WEIGHTS,
    EndpointState,
    PickerWeights,
    _tie_key,
    factors,
    no_eligible,
)

#: Fleets of at least this many endpoints are picked over columns by the request path
#: (:class:`inferlb.policy.endpoint_book.EndpointBook`); smaller ones by the Python loop, cheaper there
#: (``bench/picker_scoring.py``: the columns' ~40 us per pick is the loop's between 48 and 64 endpoints).
COLUMNAR_MIN_ENDPOINTS: Final = 56

_F = npt.NDArray[np.float64]
_I = npt.NDArray[np.int64]
_B = npt.NDArray[np.bool_]
_T = TypeVar("_T", bound=np.generic)


class FleetColumns:
    """One fleet's :class:`~inferlb.policy.picker.EndpointState` rows as numpy columns (not thread-safe).

    Row ``i`` is ``endpoints[i]`` as given; :meth:`set_in_flight`, :meth:`add_in_flight` and
    :meth:`set_row` change one row in place (O(1), no rebuild); :meth:`pick` orders the rows for one
    request.

    Args:
        endpoints: the fleet, in the order :func:`~inferlb.policy.picker.pick` would be given it
            (addresses unique).

    Raises:
        ValueError: an address appears twice.

    Attributes:
        addresses: the rows' addresses, row order.
        index: address -> row.
    """

    __slots__ = (
        "_decode",
        "_in_flight",
        "_in_flight_ok",
        "_kv",
        "_ok",
        "_prefill",
        "_prefill_scale",
        "_sums",
        "_ties",
        "_waiting",
        "_weight",
        "addresses",
        "index",
    )

    def __init__(self, endpoints: Sequence[EndpointState]) -> None:
        self.addresses: tuple[str, ...] = tuple(e.address for e in endpoints)
        self.index: dict[str, int] = {a: i for i, a in enumerate(self.addresses)}
        if len(self.index) != len(self.addresses):
            raise ValueError("endpoints: an address appears twice")
        self._weight: _F = np.array([e.weight for e in endpoints], dtype=np.float64)
        self._ok: _B = np.array([e.healthy and e.weight > 0 for e in endpoints], dtype=np.bool_)
        self._in_flight: _I = np.array([e.in_flight for e in endpoints], dtype=np.int64)
        self._waiting: _F = np.array([e.waiting for e in endpoints], dtype=np.float64)
        self._kv: _F = np.array([e.kv_usage for e in endpoints], dtype=np.float64)
        self._prefill: _F = np.array([e.prefill_tokens for e in endpoints], dtype=np.float64)
        self._decode: _F = np.array([e.decode_tokens for e in endpoints], dtype=np.float64)
        # w / p_e per row: the prefill load's 1 / p_e in the score kept times w (pick()'s same quotient)
        self._prefill_scale: _F = np.array([_prefill_scale(e) for e in endpoints], dtype=np.float64)
        self._ties: dict[bytes, npt.NDArray[np.uint64]] = {}
        # the eligible rows' in-flight total, kept as rows change; the float sums, cached until a row changes
        self._in_flight_ok = int(self._in_flight[self._ok].sum())
        self._sums: tuple[float, float, float, float] | None = None

    def __len__(self) -> int:
        return len(self.addresses)

    def set_in_flight(self, address: str, n: int) -> None:
        """Row ``address``'s ``in_flight`` is now ``n`` (requests). Raises KeyError: no such row."""
        i = self.index[address]
        if self._ok[i]:
            self._in_flight_ok += n - int(self._in_flight[i])
        self._in_flight[i] = n

    def add_in_flight(self, address: str, delta: int) -> None:
        """Row ``address``'s ``in_flight`` changes by ``delta`` (requests). Raises KeyError: no such row."""
        i = self.index[address]
        if self._ok[i]:
            self._in_flight_ok += delta
        self._in_flight[i] += delta

    def in_flight(self, address: str) -> int:
        """Row ``address``'s ``in_flight`` (requests). Raises KeyError: no such row."""
        return int(self._in_flight[self.index[address]])

    def set_row(self, state: EndpointState) -> None:
        """Row ``state.address`` is now ``state`` (every field). Raises KeyError: no such row."""
        i = self.index[state.address]
        if self._ok[i]:
            self._in_flight_ok -= int(self._in_flight[i])
        self._weight[i] = state.weight
        self._ok[i] = state.healthy and state.weight > 0
        self._in_flight[i] = state.in_flight
        self._waiting[i] = state.waiting
        self._kv[i] = state.kv_usage
        self._prefill[i] = state.prefill_tokens
        self._decode[i] = state.decode_tokens
        self._prefill_scale[i] = _prefill_scale(state)
        if self._ok[i]:
            self._in_flight_ok += state.in_flight
        self._sums = None

    def set_telemetry(self, rows: _I, waiting: _F, kv_usage: _F) -> None:
        """Rows ``rows`` get ``waiting`` and ``kv_usage`` (arrays of the same length; a new scrape, or
        telemetry gone stale)."""
        self._waiting[rows] = waiting
        self._kv[rows] = kv_usage
        self._sums = None

    def _tie_column(self, salt: bytes) -> npt.NDArray[np.uint64]:
        """Each row's tie hash as a big-endian ``uint64`` (its order is the digests' byte order)."""
        col = self._ties.get(salt)
        if col is None:
            hashes = [int.from_bytes(_tie_key(salt, a), "big") for a in self.addresses]
            col = np.array(hashes, dtype=np.uint64)
            if len(self._ties) >= 4:
                self._ties.clear()
            self._ties[salt] = col
        return col

    def set_load(self, hosts: Collection[str] | None) -> SetLoad:
        """The load and capacity of the eligible rows (healthy, positive weight) within ``hosts`` (every
        eligible row with None): ``in_flight + waiting`` and ``weight`` summed, as
        :func:`inferlb.policy.class_guard.set_loads` sums them over endpoint states (the capacity guard of
        length classes)."""
        mask = self._eligible(None, hosts)
        load = float(self._in_flight[mask].sum()) + float(self._waiting[mask].sum())
        return SetLoad(load=load, capacity=float(self._weight[mask].sum()))

    def _eligible(self, subset: Collection[str] | None, class_hosts: Collection[str] | None) -> _B:
        mask = self._ok
        for allowed in (subset, class_hosts):
            if allowed is None:
                continue
            within = np.zeros(len(self.addresses), dtype=np.bool_)
            rows = [i for i in map(self.index.get, allowed) if i is not None]
            within[rows] = True
            mask = mask & within
        return mask

    def pick(
        self,
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
        """:func:`inferlb.policy.picker.pick` over these rows: the same arguments (but the endpoints), the
        same answer, the same errors.

        Returns:
            Up to ``weights.max_hosts`` addresses: within the load bound by score, then over it by load.

        Raises:
            NoEligibleEndpoint: no row is healthy, in the subset and in the class.
            ValueError: ``block_tokens < 1``.
        """
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        whole = subset is None and class_hosts is None
        ok = self._ok if whole else self._eligible(subset, class_hosts)
        rows = np.flatnonzero(ok)
        if not len(rows):
            raise no_eligible(subset, class_hosts)
        prompt = max(prompt_tokens, 0)
        # the fleet sums as pick() takes them: Python's sum over the eligible rows, in row order
        prefill_sum: Callable[[], float]
        decode_sum: Callable[[], float]
        if whole:
            if self._sums is None:
                self._sums = (
                    sum(self._weight[rows].tolist()),
                    sum(self._waiting[rows].tolist()),
                    sum(self._prefill[rows].tolist()),
                    sum(self._decode[rows].tolist()),
                )
            total_weight, waiting, prefill, decode = self._sums
            in_flight = self._in_flight_ok
            prefill_sum, decode_sum = (lambda: prefill), (lambda: decode)
        else:
            total_weight = sum(self._weight[rows].tolist())
            waiting = sum(self._waiting[rows].tolist())
            in_flight = int(self._in_flight[rows].sum())
            prefill_sum = lambda: sum(self._prefill[rows].tolist())  # noqa: E731 - called only when needed
            decode_sum = lambda: sum(self._decode[rows].tolist())  # noqa: E731
        work = in_flight + waiting + 1.0
        share_bound, f_load, f_tokens, f_decode, f_prefix = factors(
            weights,
            total_weight=total_weight,
            work=work,
            prefill_sum=prefill_sum,
            decode_sum=decode_sum,
            prompt=prompt,
            prompt_blocks=prompt_blocks,
        )
        matched = matched_blocks or {}
        k = weights.candidates
        if k and len(rows) > 2 * k:
            rows = self._candidates(rows, matched, k, candidate_seed)
        w_kv = weights.kv

        every = len(rows) == len(self.addresses)  # rows in order, none left out: the columns as they are

        def take(col: npt.NDArray[_T]) -> npt.NDArray[_T]:
            return col if every else col[rows]

        w = take(self._weight)
        outstanding = take(self._in_flight) + take(self._waiting)
        over = outstanding + 1.0 > np.ceil(share_bound * w)
        # the score, term by term in pick()'s order (the same rounding)
        score = -f_load * outstanding - w_kv * w * np.clip(take(self._kv), 0.0, 1.0)
        if f_prefix or f_tokens:
            zero = min(prompt_blocks, 0)  # pick()'s clip of a match of 0
            full = np.full(len(self.addresses), zero, dtype=np.int64)
            index = self.index
            for address, blocks in matched.items():
                r = index.get(address)
                if r is not None:
                    full[r] = 0 if blocks < 0 else prompt_blocks if blocks > prompt_blocks else blocks
            m = take(full)
            score = score + f_prefix * w * m
            if f_tokens:
                miss = prompt - block_tokens * m
                queued = take(self._prefill) + np.maximum(miss, 0)
                score = score - f_tokens * queued * take(self._prefill_scale)
        if f_decode:
            score = score - f_decode * take(self._decode)
        ties = self._tie_column(salt)
        n = weights.max_hosts
        within = ~over
        best = self._first((-score / w)[within], rows[within], n, ties)
        if len(best) < n:
            best += self._first(((outstanding + 1.0) / w)[over], rows[over], n - len(best), ties)
        return tuple(best)

    def _first(self, keys: _F, rows: _I, n: int, ties: npt.NDArray[np.uint64]) -> list[str]:
        """The addresses of ``rows`` with the ``n`` smallest ``keys``, ties by the tie hash (``ties``, per
        row), then by position (as :func:`~inferlb.policy.picker.pick`'s ``(key, hash, position)``
        sort)."""
        if not len(keys):
            return []
        if len(keys) > n:
            cut = keys.min() if n == 1 else np.partition(keys, n - 1)[n - 1]
            few = np.flatnonzero(keys <= cut)
            keys, rows = keys[few], rows[few]
        order = np.lexsort((ties[rows], keys))[:n]  # stable: equal keys and hashes keep their positions
        addresses = self.addresses
        return [addresses[r] for r in rows[order].tolist()]

    def _candidates(self, rows: _I, matched: Mapping[str, int], k: int, seed: int) -> _I:
        """pick()'s sampled candidates as rows, in its order: the ``k`` eligible rows matching the most
        blocks, then the ``k`` least loaded of ``2k`` drawn by ``seed`` (the same draws)."""
        eligible = rows.tolist()
        addresses = self.addresses
        holders: list[int] = []
        if matched:
            position = {r: j for j, r in enumerate(eligible)}
            held = [position[r] for r in map(self.index.get, matched) if r is not None and r in position]
            holders = [eligible[j] for j in sorted(held)]
            if len(holders) > k:
                holders.sort(key=lambda r: (-matched[addresses[r]], addresses[r]))
                del holders[k:]
        seen = set(holders)
        drawn = [eligible[j] for j in random.Random(seed).sample(range(len(eligible)), 2 * k)]
        drawn = [r for r in drawn if r not in seen]
        in_flight, waiting, weight = self._in_flight, self._waiting, self._weight
        drawn.sort(key=lambda r: ((int(in_flight[r]) + float(waiting[r])) / float(weight[r]), addresses[r]))
        return np.array(holders + drawn[:k], dtype=np.int64)


def _prefill_scale(e: EndpointState) -> float:
    """``w / p_e``: the factor :func:`~inferlb.policy.picker.pick` applies to an endpoint's prefill load
    (1.0 exactly when it has no ``prefill_weight``, and for a row of no weight, never eligible)."""
    return e.weight / (e.prefill_weight or e.weight) if e.weight > 0 else 1.0
