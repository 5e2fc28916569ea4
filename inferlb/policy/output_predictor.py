"""Output-length prediction for length classes (pure, online, bounded memory).

Why: length-aware placement (:mod:`inferlb.policy.length_aware`) classes a request by its output cap, the
client's ``max_tokens``. Real clients send an uninformative cap, a fixed default (1,024) or none at all
(the model's ``default_max_tokens`` applies), so every request looks long and every one is confined to the
fast tier, which saturates (the design note "Length classes need honest caps": p99 1.8-2.2x least request
in a 1,000-GPU simulation). The gateway sees every answer's real length (the metered ``completion_tokens``,
:mod:`inferlb.policy.settlement` and ext_proc's response meter), so it can learn what a client's requests
really produce and class by that instead.

What it learns, per **key** ``(tenant, model, endpoint kind)`` (:class:`PredictionKey`):

* a decayed quantile sketch of the per-choice completion length (:class:`DecayedSketch`), for the key as a
  whole and per prompt-length bucket (:func:`prompt_bucket`: powers of four of the prompt's tokens; a
  long document to summarise and a short question of one client answer differently);
* the last completions of each **conversation** (the caller's id: the session header, else the ``user``
  field, else a hash of a chat's opening messages, :func:`inferlb.policy.affinity.conversation_opening`,
  which later turns repeat), the strongest signal: a conversation that writes code goes on writing code;
* the last caps the key sent, to tell when its cap carries no information (:meth:`OutputPredictor
  .cap_uninformative`).

The prediction (:meth:`OutputPredictor.predict`) is, first found: the largest of the conversation's last
:attr:`PredictorParams.conversation_memory` completions; the key's sketch for the request's prompt bucket
at :attr:`PredictorParams.quantile`, once it holds :attr:`PredictorParams.min_samples` completions; the
key's whole sketch at that quantile, likewise; else nothing (cold start: the caller classes by the cap, as
without a predictor). It is clamped to the cap (a model server never writes more than it) and scaled by
the choices (``n`` x prompts), as :meth:`inferlb.request.parsing.InferenceRequest.output_token_cap` is.

**Which quantile, and why 0.75** (:data:`DEFAULT_QUANTILE`): one key's requests are one stream the sketch
cannot tell apart (beyond the prompt bucket and the conversation), so the quantile decides which share of
long answers makes the whole stream long: at quantile ``q`` a key's requests class long once more than
``1 - q`` of its completions are long. The median would minimise the requests misclassed; but the two
mistakes do not cost the same: a long answer sent to a slow GPU decodes there for the whole of its length
(a V100 takes ~3x an H100's time: the tail latency length-aware placement exists to cut), while a short
answer confined to the fast tier costs that tier a short request's work, which the capacity guard
(:mod:`inferlb.policy.class_guard`) bounds anyway. So the quantile leans long, to 0.75: a key whose
quarter of answers are long is placed as long. It stays below the cap's behaviour (quantile 1).

**Uninformative caps** (:meth:`OutputPredictor.cap_uninformative`), the rule: a request's cap is
uninformative when (1) the request set none (the model's default stands in), or (2) it equals the model's
``default_max_tokens`` (a client passing the documented default on), or (3) the key's last
:attr:`PredictorParams.cap_window` caps have (near) no spread, ``max <= cap_spread x min`` with at least
:attr:`PredictorParams.min_samples` of them, while its completions show the cap tells nothing about them:
they vary (the sketch's 0.9 quantile over its 0.1 quantile is at least :attr:`PredictorParams
.completion_spread`) or they stay far below it (the 0.9 quantile at most half the cap). A client that sets
its cap per request (caps that spread) keeps its own caps: it knows more than any sketch.

The prediction decides the length class only, never the quota reservation: admission keeps reserving the
cap (a prediction can be wrong; the cap is the most the answer can cost).

**Decay and memory.** Every observation's weight is ``2 ** (i / half_life)`` for the ``i``-th one the
sketch took, so an observation ``half_life`` observations old counts half a new one (a client whose
traffic changes is followed within a few half-lives); the weights are renormalised before they overflow.
Decay counts observations, not seconds: the predictor is deterministic (the same inputs in the same order
give the same predictions) and needs no clock. Memory is bounded by :attr:`PredictorParams.max_keys` keys
(least recently used first out), each with at most :data:`PROMPT_BUCKETS` + 1 sketches of
:data:`SKETCH_BINS` floats and :attr:`PredictorParams.cap_window` caps, and
:attr:`PredictorParams.max_conversations` conversations of :attr:`PredictorParams.conversation_memory`
completions each.

Not thread-safe: one event loop owns it (the request-path process's; with several request-path
processes each learns from the answers it settles).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, NamedTuple

#: Default classing quantile (see the module docstring for why).
DEFAULT_QUANTILE: Final = 0.75
#: Largest completion the sketch tells apart (tokens): larger ones land in its last bin.
SKETCH_MAX_TOKENS: Final = 1 << 20
#: Bins per doubling of the completion length: bin edges ``2 ** (i / 4)``, ~19% apart.
BINS_PER_DOUBLING: Final = 4
#: Bins of one sketch.
SKETCH_BINS: Final = BINS_PER_DOUBLING * 20 + 1
#: Prompt-length buckets: powers of four of the prompt's tokens, the last open-ended (4,096 and above).
PROMPT_BUCKETS: Final = 8
#: Weights are renormalised when the next observation's weight would pass this.
_RENORMALISE_AT: Final = 1e200


def _bin_edges() -> tuple[int, ...]:
    edges: list[int] = []
    for i in range(SKETCH_BINS):
        edge = math.ceil(2 ** (i / BINS_PER_DOUBLING) - 1e-9)
        edges.append(max(edge, edges[-1] + 1) if edges else edge)
    return tuple(edges)


#: Upper edge (tokens) of each bin: the smallest integer ``>= 2 ** (i / BINS_PER_DOUBLING)``, raised where
#: needed to stay strictly increasing (the first bins are 1, 2, 3, 4, 5, ...).
_EDGES: Final[tuple[int, ...]] = _bin_edges()


def bin_of(tokens: int) -> int:
    """The sketch bin of a completion of ``tokens`` (>= 0): the first whose upper edge is at least it (the
    last for anything larger)."""
    return min(bisect_left(_EDGES, tokens), SKETCH_BINS - 1)


def bin_upper(index: int) -> int:
    """The upper edge (tokens) of bin ``index``: what a quantile falling in it reads as (an upper bound)."""
    return _EDGES[index]


def prompt_bucket(prompt_tokens: int) -> int:
    """The prompt-length bucket of a prompt of ``prompt_tokens`` (>= 0): ``floor(log4(tokens))`` + 1 for a
    non-empty prompt, 0 for an empty one, at most ``PROMPT_BUCKETS - 1`` (0; 1-3; 4-15; 16-63; ...;
    4,096 and above)."""
    if prompt_tokens <= 0:
        return 0
    return min((prompt_tokens.bit_length() + 1) // 2, PROMPT_BUCKETS - 1)


class DecayedSketch:
    """A histogram of completion lengths on :data:`SKETCH_BINS` log-spaced bins with exponentially decayed
    weights (module docstring: decay per observation, half-life ``half_life`` observations).

    Args:
        half_life: observations after which one counts half (> 0).

    Raises:
        ValueError: ``half_life`` not > 0.
    """

    __slots__ = ("_cumulative", "_growth", "_next", "_weights", "count", "total")

    def __init__(self, half_life: float) -> None:
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self._growth = 2.0 ** (1.0 / half_life)
        self._weights = array("d", bytes(8 * SKETCH_BINS))
        self._next = 1.0
        #: the running sums of the weights, computed at the first quantile after an add
        self._cumulative: list[float] | None = None
        #: summed weight of every bin
        self.total = 0.0
        #: observations taken (not decayed), for the minimum-sample rule
        self.count = 0

    def add(self, tokens: int) -> None:
        """Take one completion of ``tokens`` (>= 0; larger than :data:`SKETCH_MAX_TOKENS` counts there)."""
        w = self._next
        self._cumulative = None
        self._weights[bin_of(max(0, tokens))] += w
        self.total += w
        self.count += 1
        self._next = w * self._growth
        if self._next > _RENORMALISE_AT:
            scale = 1.0 / self._next
            for i, x in enumerate(self._weights):
                self._weights[i] = x * scale
            self.total *= scale
            self._next = 1.0

    def quantile(self, q: float) -> int | None:
        """The ``q``-quantile (0 < q <= 1) of the decayed completions, as its bin's upper edge (tokens);
        None when empty."""
        if self.count == 0:
            return None
        cumulative = self._cumulative
        if cumulative is None:
            cumulative = self._cumulative = list(accumulate(self._weights))
        # the relative slack absorbs the rounding of the running sum (q = 1 must reach the last bin in use)
        i = bisect_left(cumulative, q * cumulative[-1] * (1 - 1e-12))
        return _EDGES[min(i, SKETCH_BINS - 1)]


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictorParams:
    """The predictor's settings (the defaults are the documented choices).

    Attributes:
        quantile: the classing quantile (0 < q <= 1; :data:`DEFAULT_QUANTILE`, module docstring).
        half_life: observations per sketch after which one counts half.
        min_samples: completions a sketch needs before it predicts, and caps the window needs before the
            spread rule applies.
        conversation_memory: completions kept per conversation (the prediction is their largest).
        max_keys / max_conversations: the most keys and conversations kept (least recently used out).
        cap_window: the last caps kept per key for the spread rule.
        cap_spread: caps whose largest is at most this times their smallest have no spread (>= 1).
        completion_spread: completions vary when their 0.9 quantile is at least this times their 0.1
            quantile (> 1).
    """

    quantile: float = DEFAULT_QUANTILE
    half_life: float = 200.0
    min_samples: int = 8
    conversation_memory: int = 4
    max_keys: int = 1024
    max_conversations: int = 16384
    cap_window: int = 32
    cap_spread: float = 1.1
    completion_spread: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if not self.half_life > 0:
            raise ValueError(f"half_life must be > 0, got {self.half_life}")
        for name in ("min_samples", "conversation_memory", "max_keys", "max_conversations", "cap_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.cap_spread >= 1:
            raise ValueError(f"cap_spread must be >= 1, got {self.cap_spread}")
        if not self.completion_spread > 1:
            raise ValueError(f"completion_spread must be > 1, got {self.completion_spread}")


class PredictionKey(NamedTuple):
    """Whose completions a prediction learns from: one tenant's requests to one model on one endpoint kind
    (``chat.completions``, ``completions``, ``responses``). A named tuple: it keys the predictor's dicts
    on every request, and a tuple hashes and compares in C."""

    tenant: str
    model: str
    kind: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthQuery:
    """One request as the predictor sees it (built by the request path, kept until its answer settles).

    Attributes:
        key: its :class:`PredictionKey`.
        prompt_tokens: its counted prompt (tokens, >= 0).
        conversation: its conversation id (session header, ``user``, or a chat's opening), or None.
        cap: the per-choice output cap the request set (tokens), None when it set none.
        default_cap: the model's ``default_max_tokens`` (tokens), what stands in for a missing cap.
        width: choices it generates (``n`` x prompts, >= 1).
    """

    key: PredictionKey
    prompt_tokens: int
    conversation: str | None
    cap: int | None
    default_cap: int
    width: int = 1

    @property
    def effective_cap(self) -> int:
        """The per-choice cap that applies: the request's, else the model's default (tokens)."""
        return self.default_cap if self.cap is None else self.cap


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthEstimate:
    """What a request's length class is decided on.

    Attributes:
        output_tokens: the whole output to class by (tokens, all choices): the cap, or the prediction.
        predicted: True when ``output_tokens`` is the prediction (the cap was uninformative and the
            predictor knew the key), False when it is the cap.
    """

    output_tokens: int
    predicted: bool


class _KeyState:
    __slots__ = ("buckets", "caps", "whole")

    def __init__(self, params: PredictorParams) -> None:
        self.whole = DecayedSketch(params.half_life)
        self.buckets: dict[int, DecayedSketch] = {}
        self.caps: deque[int] = deque(maxlen=params.cap_window)


class OutputPredictor:
    """Online per-key output-length predictor (module docstring).

    Args:
        params: its settings.
    """

    __slots__ = ("_conversations", "_keys", "params")

    def __init__(self, params: PredictorParams | None = None) -> None:
        self.params = params or PredictorParams()
        self._keys: OrderedDict[PredictionKey, _KeyState] = OrderedDict()
        self._conversations: OrderedDict[tuple[PredictionKey, str], deque[int]] = OrderedDict()

    def __len__(self) -> int:
        """Keys held."""
        return len(self._keys)

    @property
    def conversations(self) -> int:
        """Conversations held."""
        return len(self._conversations)

    def _key(self, key: PredictionKey, *, create: bool) -> _KeyState | None:
        state = self._keys.get(key)
        if state is not None:
            self._keys.move_to_end(key)
            return state
        if not create:
            return None
        state = _KeyState(self.params)
        self._keys[key] = state
        if len(self._keys) > self.params.max_keys:
            self._keys.popitem(last=False)
        return state

    def note_cap(self, query: LengthQuery) -> None:
        """Record the cap ``query`` set (the spread rule's window); a request that set none records
        nothing."""
        if query.cap is not None:
            state = self._key(query.key, create=True)
            assert state is not None
            state.caps.append(query.cap)

    def observe(self, query: LengthQuery, completion_tokens: int) -> None:
        """Learn the answer of ``query``: ``completion_tokens`` over all its choices (the metered usage,
        tokens >= 0), taken per choice (rounded up)."""
        per_choice = -(-max(0, completion_tokens) // max(1, query.width))
        state = self._key(query.key, create=True)
        assert state is not None
        state.whole.add(per_choice)
        bucket = prompt_bucket(query.prompt_tokens)
        sketch = state.buckets.get(bucket)
        if sketch is None:
            sketch = state.buckets[bucket] = DecayedSketch(self.params.half_life)
        sketch.add(per_choice)
        if query.conversation is not None:
            ck = (query.key, query.conversation)
            recent = self._conversations.get(ck)
            if recent is None:
                recent = self._conversations[ck] = deque(maxlen=self.params.conversation_memory)
                if len(self._conversations) > self.params.max_conversations:
                    self._conversations.popitem(last=False)
            else:
                self._conversations.move_to_end(ck)
            recent.append(per_choice)

    def predict_per_choice(self, query: LengthQuery) -> int | None:
        """The predicted per-choice completion of ``query`` (tokens, before the cap's clamp), None when the
        predictor knows nothing of it yet (module docstring: conversation, then bucket, then key)."""
        if query.conversation is not None:
            recent = self._conversations.get((query.key, query.conversation))
            if recent:
                return max(recent)
        state = self._keys.get(query.key)
        if state is None:
            return None
        need, q = self.params.min_samples, self.params.quantile
        sketch = state.buckets.get(prompt_bucket(query.prompt_tokens))
        if sketch is not None and sketch.count >= need:
            return sketch.quantile(q)
        if state.whole.count >= need:
            return state.whole.quantile(q)
        return None

    def predict(self, query: LengthQuery) -> int | None:
        """The predicted whole output of ``query`` (tokens, all choices), at most its cap x width; None
        when the predictor knows nothing of it yet."""
        per_choice = self.predict_per_choice(query)
        if per_choice is None:
            return None
        return min(per_choice, query.effective_cap) * max(1, query.width)

    def cap_uninformative(self, query: LengthQuery) -> bool:
        """True when ``query``'s cap says nothing of its answer's length (the module docstring's rule)."""
        if query.cap is None or query.cap == query.default_cap:
            return True
        state = self._keys.get(query.key)
        if state is None or len(state.caps) < self.params.min_samples:
            return False
        if max(state.caps) > self.params.cap_spread * min(state.caps):
            return False
        if state.whole.count < self.params.min_samples:
            return False
        high, low = state.whole.quantile(0.9), state.whole.quantile(0.1)
        assert high is not None and low is not None
        return high >= self.params.completion_spread * max(low, 1) or 2 * high <= query.cap

    def estimate(self, query: LengthQuery) -> LengthEstimate:
        """Record ``query``'s cap (:meth:`note_cap`) and return what its class is decided on: the
        prediction when its cap is uninformative and the predictor knows its key, else the cap (x width:
        :meth:`inferlb.request.parsing.InferenceRequest.output_token_cap`)."""
        self.note_cap(query)
        cap_tokens = query.effective_cap * max(1, query.width)
        if not self.cap_uninformative(query):
            return LengthEstimate(output_tokens=cap_tokens, predicted=False)
        predicted = self.predict(query)
        if predicted is None:
            return LengthEstimate(output_tokens=cap_tokens, predicted=False)
        return LengthEstimate(output_tokens=predicted, predicted=True)
