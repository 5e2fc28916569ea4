"""Length-class thresholds learnt online from the output caps the gateway sees (pure: no I/O, the clock is
passed in).

Why: the static thresholds of length-aware placement (:func:`inferlb.policy.length_aware.tier_thresholds`
over a training window) are fitted on what requests *generate*. The gateway classes them by what clients
*declare*, an upper bound, and many clients send one default cap (every request ``max_tokens: 1024``): with
thresholds fitted on true lengths every such request looks long and the whole model's work goes to the fast
tier (in the 1,000-GPU discrete-event fleet, p99 1.8-2.2x that of plain least request). The same rule
applied to the caps the gateway sees is harmless by construction: one fixed cap confines nothing (no request
is above the largest cap seen), and caps that vary still separate the long requests from the short.

The rule: :class:`ThresholdLearner` keeps the last ``window`` requests' ``(cap, work)`` (a ring, with the
work summed per distinct cap beside it, so memory is bounded by ``window`` and a derivation costs
``O(distinct caps)``, not ``O(window)``), and every ``rederive_every_s`` at most derives
``T_1 >= T_2 >= ...`` by :func:`~inferlb.policy.length_aware.tier_thresholds` over that window: ``T_k`` is the
smallest cap seen such that the requests above it carry at most ``fraction x share_k`` of the window's work.
A new set of thresholds replaces the one in use only when it moves some class's confined work share (the
window's work above ``T_k``, over the window's work) by more than ``hysteresis``, so thresholds do not flap
with the sampling noise of a stationary mix, and follow a real shift of it. Everything is deterministic: the
same calls give the same thresholds.

What a request's ``work`` is: what the request path knows when it decides the class, the prompt tokens
and the output cap, priced by :func:`request_work` in generated-token equivalents (the shares the rule
compares do not depend on the unit). The cap, not the completion the server will write: the thresholds must
be known before the answer exists, and pricing a request at its cap over-states the long (capped) requests'
share of the work, so the learnt thresholds confine at most the share the rule allows (the safe side).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from itertools import pairwise
from typing import Final

from inferlb.policy.length_aware import DEFAULT_TIER_WORK_FRACTION, tier_thresholds

#: Requests in the window the thresholds are derived from. 4,096 holds several minutes of one model's traffic
#: at tens of requests per second and makes a derivation's sampling noise small (a class share of 0.05 of
#: the work is ~200 requests), at a few hundred kB per model.
DEFAULT_WINDOW: Final = 4096
#: Requests seen before the first derivation: before, :meth:`ThresholdLearner.thresholds` is None and the
#: caller keeps its static thresholds.
DEFAULT_MIN_SAMPLES: Final = 256
#: Least seconds between two derivations.
DEFAULT_REDERIVE_EVERY_S: Final = 10.0
#: The least change of a class's confined work share (absolute, of the window's work) that replaces the
#: thresholds in use: 0.05 is a tenth of a typical fast set's budget (fraction 0.75 x a share of ~0.6).
DEFAULT_HYSTERESIS: Final = 0.05
#: GPU work of one prompt token relative to one generated token, at full batch: ``decode_tokens_per_s x
#: max_batch / prefill_tokens_per_s`` of the simulated V100 defaults (30 x 16 / 4,000 = 0.12,
#: :class:`inferlb.config.schema.Simulation`, of the order of a 7-8B model in vLLM). The same ratio as the
#: fleet simulator's ``request_service_seconds`` (prefill seconds plus decode at full batch), in tokens.
DEFAULT_PROMPT_TOKEN_WORK: Final = 0.12


def request_work(
    prompt_tokens: int, output_tokens: int, *, prompt_token_work: float = DEFAULT_PROMPT_TOKEN_WORK
) -> float:
    """One request's GPU work in generated-token equivalents: ``output_tokens + prompt_token_work x
    prompt_tokens`` (tokens; ``prompt_token_work`` as :data:`DEFAULT_PROMPT_TOKEN_WORK`). Proportional to
    the fleet simulator's prefill-plus-decode seconds at full batch when ``prompt_token_work`` is the
    model's ratio of prefill to decode throughput; negative counts count as 0."""
    return max(output_tokens, 0) + prompt_token_work * max(prompt_tokens, 0)


class ThresholdLearner:
    """Output-cap thresholds of a model's confined length classes, learnt from the requests it sees (module
    docstring). Not thread-safe: one owner (the request path's event loop) calls it.

    Args:
        set_shares: each confined class's GPU set capacity over the cluster's (0..1), longest class
            (smallest set) first, non-decreasing: the second members of
            :func:`~inferlb.policy.length_aware.tier_capacity_shares`. A share of 0 (no GPU may serve the
            class) gets the largest cap seen: it confines nothing.
        fraction: the share of a set's capacity its confined requests may take (0 < fraction <= 1).
        window: the requests the thresholds are derived from, the most recent (>= 1).
        min_samples: requests seen before the first derivation (1..window).
        rederive_every_s: least seconds between two derivations (>= 0; the clock is the caller's).
        hysteresis: the least change of a class's confined work share that replaces the thresholds in use
            (0 <= hysteresis < 1; 0: every derivation replaces them).

    Raises:
        ValueError: a parameter out of its range (the message names it).
    """

    __slots__ = (
        "_count_at",
        "_current",
        "_derived_at",
        "_fraction",
        "_hysteresis",
        "_min_samples",
        "_rederive_every_s",
        "_ring",
        "_set_shares",
        "_window",
        "_work_at",
    )

    def __init__(
        self,
        set_shares: Sequence[float],
        *,
        fraction: float = DEFAULT_TIER_WORK_FRACTION,
        window: int = DEFAULT_WINDOW,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        rederive_every_s: float = DEFAULT_REDERIVE_EVERY_S,
        hysteresis: float = DEFAULT_HYSTERESIS,
    ) -> None:
        shares = tuple(float(s) for s in set_shares)
        if not shares:
            raise ValueError("set_shares: need one share per confined class, got none")
        if any(not 0 <= s <= 1 for s in shares):
            raise ValueError(f"set_shares must be in [0, 1], got {shares}")
        if any(a > b for a, b in pairwise(shares)):
            raise ValueError(f"set_shares must not fall (longest class, smallest set first), got {shares}")
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window={window}], got {min_samples}")
        if not (rederive_every_s >= 0 and math.isfinite(rederive_every_s)):
            raise ValueError(f"rederive_every_s must be a finite number >= 0, got {rederive_every_s}")
        if not 0 <= hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis}")
        self._set_shares = shares
        self._fraction = fraction
        self._window = window
        self._min_samples = min_samples
        self._rederive_every_s = rederive_every_s
        self._hysteresis = hysteresis
        self._ring: deque[tuple[int, float]] = deque()
        #: work and requests per distinct cap of the ring (a cap leaves both when its last request does)
        self._work_at: dict[int, float] = {}
        self._count_at: dict[int, int] = {}
        self._current: tuple[int, ...] | None = None
        self._derived_at = -math.inf

    @property
    def set_shares(self) -> tuple[float, ...]:
        """The classes' set shares, longest class first."""
        return self._set_shares

    @property
    def samples(self) -> int:
        """Requests in the window now (<= ``window``)."""
        return len(self._ring)

    @property
    def distinct_caps(self) -> int:
        """Distinct caps in the window now (<= ``window``)."""
        return len(self._work_at)

    def observe(self, cap_tokens: int, work: float, now_s: float) -> None:
        """One request the gateway saw: its output cap as classed (tokens, >= 0) and its estimated GPU work
        (>= 0, any unit, e.g. :func:`request_work`), at ``now_s`` (the caller's clock, s). The oldest
        request leaves a full window. Derives the thresholds when one is due (:meth:`thresholds`).

        Raises:
            ValueError: a negative cap, or a work not finite and >= 0.
        """
        if cap_tokens < 0:
            raise ValueError(f"cap_tokens must be >= 0, got {cap_tokens}")
        if not (work >= 0 and math.isfinite(work)):
            raise ValueError(f"work must be a finite number >= 0, got {work}")
        ring = self._ring
        if len(ring) >= self._window:
            old_cap, old_work = ring.popleft()
            left = self._count_at[old_cap] - 1
            if left:
                self._count_at[old_cap] = left
                # float sums and differences may leave a hair below the true sum: never below 0
                self._work_at[old_cap] = max(0.0, self._work_at[old_cap] - old_work)
            else:
                del self._count_at[old_cap]
                del self._work_at[old_cap]
        ring.append((cap_tokens, work))
        self._work_at[cap_tokens] = self._work_at.get(cap_tokens, 0.0) + work
        self._count_at[cap_tokens] = self._count_at.get(cap_tokens, 0) + 1
        if now_s - self._derived_at >= self._rederive_every_s:
            self._derive(now_s)

    def thresholds(self, now_s: float) -> tuple[int, ...] | None:
        """The thresholds in use at ``now_s`` (s): ``T_1 >= T_2 >= ...`` (tokens), one per class, longest
        first (a request whose cap exceeds ``T_k``, and no ``T_j`` of a longer class, is of class ``k``);
        None until ``min_samples`` requests were seen (and while the window carries no work). Derives them
        anew first when the last derivation is ``rederive_every_s`` or more old."""
        if now_s - self._derived_at >= self._rederive_every_s:
            self._derive(now_s)
        return self._current

    def confined_shares(self, thresholds: Sequence[int]) -> tuple[float, ...] | None:
        """The window's work share (0..1) above each of ``thresholds`` (tokens): what the requests confined
        to each class's set (caps above its threshold, longer classes included, as the sets nest) would
        take of the work. None when the window carries no work."""
        work = self._work_at
        total = math.fsum(work.values())
        if not total > 0:
            return None
        return tuple(math.fsum(w for c, w in work.items() if c > t) / total for t in thresholds)

    def _derive(self, now_s: float) -> None:
        self._derived_at = now_s
        if len(self._ring) < self._min_samples:
            return
        work = self._work_at
        caps = sorted(work)
        weights = [work[c] for c in caps]
        total = math.fsum(weights)
        if not total > 0:
            return
        # above[i]: the work of the caps above caps[i]
        above = [0.0] * len(caps)
        acc = 0.0
        for i in range(len(caps) - 1, -1, -1):
            above[i] = acc
            acc += weights[i]
        # tier_thresholds takes distinct positive shares; equal shares (equal sets) get equal thresholds,
        # and a share of 0 the largest cap seen (nothing above it: the class confines nothing)
        positive = sorted({s for s in self._set_shares if s > 0})
        by_share: dict[float, int] = {}
        if positive:
            fresh = tier_thresholds(positive, list(zip(caps, weights, strict=True)), fraction=self._fraction)
            by_share = dict(zip(positive, fresh, strict=True))
        candidate = tuple(by_share.get(s, caps[-1]) for s in self._set_shares)
        current = self._current
        if current is not None and self._hysteresis > 0:

            def share_above(t: int) -> float:
                i = bisect_right(caps, t)
                return (above[i - 1] if i else acc) / total

            moved = max(abs(share_above(a) - share_above(b)) for a, b in zip(current, candidate, strict=True))
            if moved <= self._hysteresis:
                return
        self._current = candidate
