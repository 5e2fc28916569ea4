"""Timing model of one simulated GPU model server doing continuous batching. Pure: no I/O, no clock.

The model (all times in seconds, all rates in tokens/s, for one model replica on one GPU):

* **Capacity.** A GPU of relative capacity ``c`` (``config.gpu_profiles[gpu].relative_capacity``, V100 = 1.0)
  runs ``c`` times faster than the reference rates of ``config.simulation``, which are given for ``c = 1.0``.
  Prefill and decode may scale apart: prefill is compute-bound (dense FLOPs), decode memory-bound (HBM
  bandwidth), so a profile may give ``prefill_relative_capacity`` ``c_p`` and ``decode_relative_capacity``
  ``c_d`` (both default to ``c``; the bundled configs' values and their sources are in
  ``inferlb/data/local.yaml``). A *slowdown* factor ``s`` (1.0 normally; > 1.0 for a throttled GPU) divides
  the speed again.
* **Prefill.** ``prefill_seconds(P) = s * P / (c_p * prefill_tokens_per_s)`` for ``P`` prompt tokens. The
  step that completes a request's prefill produces its first output token (in vLLM the prefill forward pass
  samples token 1).
* **Decode.** Iteration-level scheduling as in Orca (Yu et al., OSDI 2022, "Orca: A Distributed Serving
  System for Transformer-Based Generative Models", section 3.1) and vLLM (Kwon et al., SOSP 2023, "Efficient
  Memory Management for Large Language Model Serving with PagedAttention"): the engine runs *steps*; every
  decoding sequence in the batch emits one token per step, so each decodes at one token per step time::

      decode_step_seconds(n) = s * (1 + b * (n - 1)) / (c_d * decode_tokens_per_s)

  for ``n`` decoding sequences (batch slots). ``b`` (:data:`BATCH_SLOWDOWN_PER_SEQUENCE`, 0.02) makes a step
  mildly slower as the batch fills: decode is memory-bandwidth bound, the weights are read once per step
  whatever the batch size, but every sequence adds its own KV-cache reads and attention work (both papers
  describe decode as memory-bound, its per-step latency growing slowly with batch size). 2% per extra
  sequence is an assumption chosen to be mild (a full batch of 16 runs each step 1.3x slower while producing
  16x the tokens), not a measurement.
* **Steps, chunked prefill, KV blocks and preemption** follow vLLM's scheduler, by the rules of
  :mod:`simulation.scheduler`: a step gives every decoding sequence its token, then prefill chunks fill the
  rest of the token budget (``max_num_batched_tokens``; None: every admitted prompt whole, no chunking);
  the step lasts ``step_seconds(prefill_seconds(chunk tokens), decode_step_seconds(decoding slots))``
  (their sum by default, ``step_time``). A request waits (FIFO, head-of-line) until a step boundary where
  its batch slots and its prompt's KV blocks are free; a decoding sequence takes a new block each time its
  tokens fill one, and when none is free the running request admitted last is preempted (freed, requeued at
  the front, re-prefilled later: ``vllm:num_preemptions_total``). The blocks are one pool per GPU: the prefix
  cache (:class:`simulation.kvcache.PrefixCache`) when there is one, else a
  :class:`simulation.kvcache.BlockPool` of as many blocks; ``vllm:kv_cache_usage_perc`` is its usage.
* **Prefill only.** A request with zero completion tokens (an embedding: vLLM runs pooling models as a
  prefill whose hidden states are pooled, with no decode) joins the batch like any other, is prefilled,
  emits no token and leaves the batch at the end of the step that completes its prefill.
* **Bounds.** At most ``max_batch`` batch slots run (vLLM ``--max-num-seqs``); a request with ``n`` parallel
  samples (OpenAI ``n``) takes ``n`` slots, shares one prefill, and is admitted whole. When more than
  ``max_queue`` requests would have to wait beyond the next step boundary for batch slots, a new request is
  refused (the server answers 503). A request whose blocks would not fit in the whole pool even alone is
  refused at once (vLLM refuses to start with a context longer than its KV cache).
* **KV budget.** :func:`kv_budget_tokens` estimates how many tokens of KV cache fit in the GPU's memory:
  the pool's blocks are that budget over the block size.
* **Prefix cache.** With a :class:`simulation.kvcache.PrefixCache` (vLLM's automatic prefix caching: that
  module has the rules), a request's prompt blocks are looked up when it is admitted and only the tokens not
  found are prefilled. Its blocks are pinned until it finishes, is cancelled or preempted. Without one (the
  default) every prompt token is prefilled.

:class:`BatchEngine` is the state machine of one server. It is driven by explicit timestamps (``now``), never
reads a clock, and jumps over runs of identical decode steps (in O(running requests x log(steps)): a run ends
at its first completion or at the first step whose new KV blocks do not fit), so the same code serves the
real-time aiohttp server (which wakes at every step to stream tokens) and a discrete-event simulation of a
large fleet (which only needs :meth:`BatchEngine.next_transition_time`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from inferlb.config.schema import Config, EndpointConfig
from simulation.kvcache import DEFAULT_BLOCK_SIZE, BlockPool, PrefixCache, PromptBlocks
from simulation.scheduler import (
    STEP_TIMES,
    DecodingSequence,
    KvPool,
    StepTime,
    blocks_for,
    prefill_chunks,
    step_seconds,
    steps_until_full,
)

#: Relative growth of the decode step time per extra running sequence (dimensionless); see the module doc.
BATCH_SLOWDOWN_PER_SEQUENCE = 0.02

#: KV-cache bytes per token of the reference model, a Llama-3.1-8B-class model in fp16:
#: 2 (K and V) x 32 layers x 8 KV heads (GQA) x 128 head dim x 2 bytes = 131,072 bytes.
#: Source: the Llama-3.1-8B config (num_hidden_layers 32, num_key_value_heads 8, head_dim 128).
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
#: Weights of the reference model: 8.0e9 parameters x 2 bytes (fp16), in GiB.
MODEL_WEIGHTS_GIB = 8.0e9 * 2 / 2**30
#: Fraction of GPU memory vLLM uses by default (``--gpu-memory-utilization 0.9``).
GPU_MEMORY_UTILIZATION = 0.9
#: Floor of the KV budget so that a small-memory profile still gives a usable (if saturating) estimate.
MIN_KV_BUDGET_TOKENS = 4096


def prefill_seconds(
    prompt_tokens: int, *, relative_capacity: float, prefill_tokens_per_s: float, slowdown: float = 1.0
) -> float:
    """Seconds to prefill ``prompt_tokens`` tokens: ``slowdown * P / (c * prefill_tokens_per_s)``.

    Args:
        prompt_tokens: prompt tokens (>= 0).
        relative_capacity: GPU capacity ``c`` (V100 = 1.0, > 0).
        prefill_tokens_per_s: prefill rate at ``c = 1.0`` (tokens/s, > 0).
        slowdown: speed divisor (1.0 normal, 2.0 = half speed; > 0).

    Raises:
        ValueError: a negative token count or a non-positive rate, capacity or slowdown.
    """
    _check_positive(
        relative_capacity=relative_capacity, prefill_tokens_per_s=prefill_tokens_per_s, slowdown=slowdown
    )
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    return slowdown * prompt_tokens / (relative_capacity * prefill_tokens_per_s)


def decode_step_seconds(
    running: int,
    *,
    relative_capacity: float,
    decode_tokens_per_s: float,
    batch_slowdown_per_sequence: float = BATCH_SLOWDOWN_PER_SEQUENCE,
    slowdown: float = 1.0,
) -> float:
    """Seconds of one decode step with ``running`` sequences (batch slots) in the batch; 0.0 when none run.

    ``slowdown * (1 + b * (running - 1)) / (c * decode_tokens_per_s)``: each running sequence emits one token
    per step, so a lone sequence decodes at ``c * decode_tokens_per_s / slowdown`` tokens/s.

    Raises:
        ValueError: negative ``running`` or ``batch_slowdown_per_sequence``, or a non-positive rate, capacity
            or slowdown.
    """
    _check_positive(
        relative_capacity=relative_capacity, decode_tokens_per_s=decode_tokens_per_s, slowdown=slowdown
    )
    if running < 0:
        raise ValueError(f"running must be >= 0, got {running}")
    if batch_slowdown_per_sequence < 0:
        raise ValueError(f"batch_slowdown_per_sequence must be >= 0, got {batch_slowdown_per_sequence}")
    if running == 0:
        return 0.0
    return (
        slowdown
        * (1.0 + batch_slowdown_per_sequence * (running - 1))
        / (relative_capacity * decode_tokens_per_s)
    )


def kv_budget_tokens(memory_gb: float, *, max_batch: int = 1) -> int:
    """Estimated KV-cache capacity (tokens) of one GPU serving the reference 8B model with vLLM.

    ``(memory_gb * GPU_MEMORY_UTILIZATION - MODEL_WEIGHTS_GIB) GiB / KV_BYTES_PER_TOKEN``, floored at
    ``max(MIN_KV_BUDGET_TOKENS, 256 * max_batch)``. ``memory_gb`` is read as GiB (GPU memory sizes are
    binary: an "80 GB" H100 has 80 GiB). A V100-32GB gives ~97k tokens, an 80 GB card ~458k.

    Raises:
        ValueError: ``memory_gb <= 0`` or ``max_batch < 1``.
    """
    if memory_gb <= 0:
        raise ValueError(f"memory_gb must be > 0, got {memory_gb}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    free_gib = memory_gb * GPU_MEMORY_UTILIZATION - MODEL_WEIGHTS_GIB
    tokens = math.floor(free_gib * 2**30 / KV_BYTES_PER_TOKEN) if free_gib > 0 else 0
    return max(tokens, MIN_KV_BUDGET_TOKENS, 256 * max_batch)


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0 or math.isinf(v):
            raise ValueError(f"{name} must be a finite number > 0, got {v}")


@dataclass(frozen=True, kw_only=True)
class TimingModel:
    """The timing parameters of one simulated server. Rates are for ``relative_capacity = 1.0``.

    Attributes:
        relative_capacity: GPU capacity ``c`` (V100 = 1.0), what the balancers weigh.
        prefill_tokens_per_s: prefill rate at ``c = 1.0`` (tokens/s).
        decode_tokens_per_s: decode rate of one lone sequence at ``c = 1.0`` (tokens/s).
        max_batch: batch slots that run at once (vLLM ``--max-num-seqs``).
        max_queue: requests allowed to wait beyond the next step boundary; more are refused.
        kv_budget_tokens: KV-cache capacity (tokens): the block pool's size when the engine builds its own.
        batch_slowdown_per_sequence: decode step growth per extra running sequence (see the module docstring).
        prefill_relative_capacity / decode_relative_capacity: the GPU's prefill (compute-bound) and decode
            (memory-bound) capacities, V100 = 1.0; None: ``relative_capacity``.
        max_num_batched_tokens: the token budget of a step (vLLM ``--max-num-batched-tokens``, chunked
            prefill); None: no budget, no chunking (every admitted prompt is prefilled whole in one step).
        step_time: how a step's prefill and decode parts combine (:func:`simulation.scheduler.step_seconds`).
        block_size: tokens per KV block of the pool the engine builds when it is given no prefix cache.

    Raises:
        ValueError: a non-positive capacity or rate, ``max_batch < 1``, ``max_queue < 0``,
            ``kv_budget_tokens < 1``, a budget below ``max_batch``, an unknown ``step_time`` or
            ``block_size < 1``.
    """

    relative_capacity: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    max_batch: int
    max_queue: int
    kv_budget_tokens: int
    batch_slowdown_per_sequence: float = BATCH_SLOWDOWN_PER_SEQUENCE
    prefill_relative_capacity: float | None = None
    decode_relative_capacity: float | None = None
    max_num_batched_tokens: int | None = None
    step_time: StepTime = "sum"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        _check_positive(
            relative_capacity=self.relative_capacity,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            prefill_relative_capacity=self.prefill_capacity,
            decode_relative_capacity=self.decode_capacity,
        )
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.kv_budget_tokens < 1:
            raise ValueError(f"kv_budget_tokens must be >= 1, got {self.kv_budget_tokens}")
        if self.batch_slowdown_per_sequence < 0:
            raise ValueError(
                f"batch_slowdown_per_sequence must be >= 0, got {self.batch_slowdown_per_sequence}"
            )
        # vLLM refuses max_num_batched_tokens < max_num_seqs: every decoding sequence needs its token
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_batch:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_batch ({self.max_batch}), "
                f"got {self.max_num_batched_tokens}"
            )
        if self.step_time not in STEP_TIMES:
            raise ValueError(f"step_time must be one of {STEP_TIMES}, got {self.step_time!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def prefill_capacity(self) -> float:
        """The prefill capacity ``c_p`` (``prefill_relative_capacity``, else ``relative_capacity``)."""
        c = self.prefill_relative_capacity
        return self.relative_capacity if c is None else c

    @property
    def decode_capacity(self) -> float:
        """The decode capacity ``c_d`` (``decode_relative_capacity``, else ``relative_capacity``)."""
        c = self.decode_relative_capacity
        return self.relative_capacity if c is None else c

    @classmethod
    def for_endpoint(cls, config: Config, endpoint: EndpointConfig) -> TimingModel:
        """The timing of ``endpoint``: its GPU profile's capacities and memory, ``config.simulation``'s rates,
        batch bounds, token budget, step time and block size.

        Raises:
            KeyError: the endpoint's GPU has no profile (config validation prevents this).
        """
        profile = config.gpu_profiles[endpoint.gpu]
        sim = config.simulation
        return cls(
            relative_capacity=profile.relative_capacity,
            prefill_relative_capacity=profile.prefill_relative_capacity,
            decode_relative_capacity=profile.decode_relative_capacity,
            prefill_tokens_per_s=sim.prefill_tokens_per_s,
            decode_tokens_per_s=sim.decode_tokens_per_s,
            max_batch=sim.max_batch,
            max_queue=sim.max_queue,
            kv_budget_tokens=kv_budget_tokens(profile.memory_gb, max_batch=sim.max_batch),
            max_num_batched_tokens=sim.max_num_batched_tokens,
            step_time=sim.step_time,
            block_size=sim.block_size,
        )

    def prefill_seconds(self, prompt_tokens: int, *, slowdown: float = 1.0) -> float:
        """:func:`prefill_seconds` with this model's prefill capacity and rate (seconds)."""
        return prefill_seconds(
            prompt_tokens,
            relative_capacity=self.prefill_capacity,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            slowdown=slowdown,
        )

    def decode_step_seconds(self, running: int, *, slowdown: float = 1.0) -> float:
        """:func:`decode_step_seconds` with this model's decode capacity, rate, batch slowdown (seconds)."""
        return decode_step_seconds(
            running,
            relative_capacity=self.decode_capacity,
            decode_tokens_per_s=self.decode_tokens_per_s,
            batch_slowdown_per_sequence=self.batch_slowdown_per_sequence,
            slowdown=slowdown,
        )

    def uncontended_latency(
        self, prompt_tokens: int, completion_tokens: int, *, width: int = 1, slowdown: float = 1.0
    ) -> RequestTiming:
        """Timing of one request alone on an idle server (no queueing, no other sequence in the batch).

        TTFT = ``prefill_seconds(P)``; end to end = TTFT + ``(C - 1) * decode_step_seconds(width)``: the
        prefill emits token 1, then one step per further token. With ``C = 0`` (an embedding) both are the
        prefill time.

        Raises:
            ValueError: ``completion_tokens < 0``, ``width < 1``, or as :func:`prefill_seconds`.
        """
        if completion_tokens < 0:
            raise ValueError(f"completion_tokens must be >= 0, got {completion_tokens}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        ttft = self.prefill_seconds(prompt_tokens, slowdown=slowdown)
        e2e = ttft + max(completion_tokens - 1, 0) * self.decode_step_seconds(width, slowdown=slowdown)
        return RequestTiming(queue_seconds=0.0, ttft_seconds=ttft, e2e_seconds=e2e)


@dataclass(frozen=True, kw_only=True)
class RequestTiming:
    """Timing of one request (seconds from arrival): queued, to first token, to last token."""

    queue_seconds: float
    ttft_seconds: float
    e2e_seconds: float


# -- events, admissions and stats (what the engine tells its driver) ----------------------------------------


@dataclass(frozen=True, kw_only=True)
class SequenceScheduled:
    """A request left the queue and joined the running batch at ``at`` (its prefill step starts)."""

    request_id: str
    at: float
    queued_seconds: float


@dataclass(frozen=True, kw_only=True)
class FirstTokenEmitted:
    """A request's prefill step ended at ``at``: its first token (per sample) is out. Not sent for a request
    of zero completion tokens (it emits none; its :class:`SequenceFinished` comes at the same time)."""

    request_id: str
    at: float


@dataclass(frozen=True, kw_only=True)
class SequenceFinished:
    """A request emitted its last token at ``at`` and left the batch. ``completion_tokens`` is per sample."""

    request_id: str
    at: float
    completion_tokens: int
    width: int


@dataclass(frozen=True, kw_only=True)
class SequencePreempted:
    """A running request was preempted at ``at`` (its KV blocks freed, back at the front of the queue, to be
    re-prefilled); ``emitted`` tokens per sample it had emitted stay emitted."""

    request_id: str
    at: float
    emitted: int


EngineEvent = SequenceScheduled | FirstTokenEmitted | SequenceFinished | SequencePreempted


@dataclass(frozen=True, kw_only=True)
class Admitted:
    """:meth:`BatchEngine.submit` accepted the request; ``running`` is True when it was scheduled at once."""

    request_id: str
    running: bool


@dataclass(frozen=True, kw_only=True)
class Refused:
    """:meth:`BatchEngine.submit` refused the request: the queue is full (``queue_full``, the server answers
    503), or the request's KV blocks exceed the whole pool (``exceeds_kv_cache``: it could never run; 400).

    ``retry_after_s`` estimates when a batch slot frees (seconds, >= 0; 0 for ``exceeds_kv_cache``).
    """

    request_id: str
    reason: Literal["queue_full", "exceeds_kv_cache"]
    retry_after_s: float


Admission = Admitted | Refused


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot of the engine at its clock.

    Attributes:
        running_requests / running_slots: requests in the batch, and the batch slots they take (``n`` each).
        waiting_requests: requests queued (FIFO) behind the batch.
        kv_tokens: KV-cache capacity held by running requests, in tokens (blocks in use x block size).
        kv_usage: blocks in use over the pool's blocks, 0..1 (vLLM's ``kv_cache_usage``).
        prompt_tokens_total: prompt tokens prefilled so far.
        generation_tokens_total: tokens emitted so far (all samples, finished, running and cancelled).
        prefix_cache_queries_total / prefix_cache_hits_total: prompt tokens looked up in the prefix cache,
            and those found (vLLM's ``vllm:prefix_cache_queries_total`` / ``_hits_total``); 0 without one.
        requests_finished_total / requests_refused_total / requests_cancelled_total: request outcomes.
        steps_total: engine steps completed.
        busy_seconds_total: time during which a step was running (GPU busy), for utilization telemetry.
        slowdown: the current slowdown factor.
        num_preemptions_total: running requests preempted for want of KV blocks
            (``vllm:num_preemptions_total``).
        kv_blocks_in_use / kv_blocks_total: the pool's blocks held by running requests, and all of them.
    """

    running_requests: int
    running_slots: int
    waiting_requests: int
    kv_tokens: int
    kv_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    requests_refused_total: int
    requests_cancelled_total: int
    steps_total: int
    busy_seconds_total: float
    slowdown: float
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_preemptions_total: int = 0
    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 0


@dataclass(kw_only=True, slots=True)
class _Sequence:
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    width: int
    arrived_at: float
    #: its prompts' blocks for the prefix cache (None: one prompt of no known blocks)
    prompts: tuple[PromptBlocks, ...] | None = None
    #: its prompts' full blocks and the tokens of their partial last blocks (in the pool's block size)
    full_blocks: int = 0
    tail_tokens: int = 0
    #: prompt tokens found in the prefix cache when it was last admitted (their prefill is skipped)
    cached_tokens: int = 0
    #: True from its admission until the step that completes its prefill (or recompute)
    prefilling: bool = False
    #: tokens of the prefill under way still to compute
    to_prefill: int = 0
    #: KV blocks it holds
    held: int = 0
    #: Tokens per sample emitted when it last started decoding, and ``steps_done`` then (-1 while not
    #: decoding): it has emitted ``emitted_base + steps_done - anchor`` once decoding.
    emitted_base: int = 0
    anchor: int = -1
    #: emitted tokens per sample already added to the engine's generated-token counter
    counted: int = 0
    #: while decoding: the ``steps_done`` at whose step it needs its next block (inf: none before it ends)
    grow_step: float = 0.0
    scheduled_once: bool = False
    first_token_sent: bool = False
    prompt_counted: bool = False

    @property
    def last_step(self) -> int:
        """While decoding: the value of ``steps_done`` at which it has emitted its last token."""
        return self.anchor + self.completion_tokens - self.emitted_base


@dataclass(kw_only=True)
class BatchEngine:
    """The continuous-batching state machine of one simulated GPU server, in simulated time (seconds).

    Drive it with non-decreasing timestamps: :meth:`submit`, :meth:`cancel`, :meth:`set_slowdown` and
    :meth:`advance` each first bring the engine to ``now`` (a ``now`` earlier than the engine's clock is
    treated as the clock: time never runs backwards). Events produced on the way are returned by the next
    :meth:`advance`, in time order. Event times are exact step boundaries computed from the model, not the
    times the driver happened to wake up.

    A real-time driver sleeps until :meth:`next_step_end` to stream each token; a discrete-event simulator
    needs only :meth:`next_transition_time` (the next admission, first token, completion or preemption),
    since runs of identical decode steps are skipped in O(running requests x log(steps)).

    ``trace_steps``: keep a :class:`StepRecord` of every step in :attr:`steps` (tests; off by default, since
    it holds one record per step).
    """

    model: TimingModel
    slowdown: float = 1.0
    #: the GPU's prefix cache (vLLM's automatic prefix caching), or None: every prompt token is prefilled
    #: and the engine counts its blocks in a :class:`simulation.kvcache.BlockPool` of the model's budget
    prefix_cache: PrefixCache | None = None
    trace_steps: bool = False
    #: the steps run so far, with ``trace_steps``
    steps: list[StepRecord] = field(default_factory=list)
    _pool: KvPool = field(init=False)
    _clock: float = 0.0
    _steps_done: int = 0
    _step_started_at: float | None = None
    _step_ends_at: float | None = None
    #: the prefill chunks of the step under way: (sequence, tokens)
    _step_chunks: list[tuple[_Sequence, int]] = field(default_factory=list)
    #: The run of identical decode-only steps under way: its batch key (slots, slowdown), its start, the
    #: length of each of its steps and the index of the current one. Step ``k`` of a run ends at
    #: ``start + (k + 1) * step`` whether the driver stepped to it or jumped over it, so the boundaries (and
    #: which side of one an arrival lands on) do not depend on how the engine is driven. None while the step
    #: under way prefills. ``_run_stop_at``: the ``steps_done`` at which the run changes the batch (its first
    #: completion, or the step whose new blocks no longer fit, which preempts); None when nothing decodes.
    _run_key: tuple[int, float] | None = None
    _run_started_at: float = 0.0
    _run_step: float = 0.0
    _run_index: int = 0
    _run_stop_at: int | None = None
    #: no decoding sequence needs a new block before this ``steps_done`` (a lower bound: exact after each
    #: growth, lowered when a sequence starts decoding)
    _next_growth: float = 0.0
    _running: dict[str, _Sequence] = field(default_factory=dict)  # in admission order
    _running_slots: int = 0
    _waiting: deque[_Sequence] = field(default_factory=deque)
    _waiting_ids: dict[str, _Sequence] = field(default_factory=dict)  # the queue's sequences by id
    _outbox: list[EngineEvent] = field(default_factory=list)
    _prompt_tokens_total: int = 0
    _generation_tokens_done: int = 0
    _finished_total: int = 0
    _refused_total: int = 0
    _cancelled_total: int = 0
    _preemptions_total: int = 0
    _busy_seconds_done: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(slowdown=self.slowdown)
        self._pool = (
            self.prefix_cache
            if self.prefix_cache is not None
            else BlockPool(
                num_blocks=max(1, self.model.kv_budget_tokens // self.model.block_size),
                block_size=self.model.block_size,
            )
        )

    # -- inputs ---------------------------------------------------------------------------------------------

    def submit(
        self,
        now: float,
        *,
        request_id: str,
        prompt_tokens: int,
        completion_tokens: int,
        width: int = 1,
        prompts: tuple[PromptBlocks, ...] | None = None,
    ) -> Admission:
        """A request arrives at ``now``: ``prompt_tokens`` to prefill, ``completion_tokens`` per sample to
        emit (0 for a prefill-only request such as an embedding), ``width`` samples (OpenAI ``n``, one batch
        slot each). ``prompts``: its prompts' blocks for the prefix cache (one per prompt, tokens adding up to
        ``prompt_tokens``); None is one prompt whose blocks are unknown (it takes blocks, hits none).

        Returns :class:`Admitted` (running at once when the server was idle, else queued until a step
        boundary where its slots and blocks are free) or :class:`Refused`: more than ``max_queue`` requests
        would wait beyond the next boundary, or its blocks exceed the whole pool.

        Raises:
            ValueError: ``prompt_tokens < 0``, ``completion_tokens < 0``, ``width`` outside
                ``[1, max_batch]``, ``prompts`` whose tokens do not add up to ``prompt_tokens``, or a
                ``request_id`` already in the engine.
        """
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        if prompts is not None and sum(p.tokens for p in prompts) != prompt_tokens:
            raise ValueError(
                f"prompts hold {sum(p.tokens for p in prompts)} tokens, prompt_tokens is {prompt_tokens}"
            )
        if completion_tokens < 0:
            raise ValueError(f"completion_tokens must be >= 0, got {completion_tokens}")
        if not 1 <= width <= self.model.max_batch:
            raise ValueError(f"width must be in [1, max_batch={self.model.max_batch}], got {width}")
        if request_id in self._running or request_id in self._waiting_ids:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        self._advance_to(now)
        bs = self._pool.block_size
        sizes = [p.tokens for p in prompts] if prompts is not None else [prompt_tokens]
        full, tail = sum(t // bs for t in sizes), sum(t % bs for t in sizes)
        if blocks_for(full, tail, max(completion_tokens - 1, 0) * width, bs) > self._pool.num_blocks:
            self._refused_total += 1
            return Refused(request_id=request_id, reason="exceeds_kv_cache", retry_after_s=0.0)
        if not self._fits_next_boundary(width) and self._blocked_waiting() >= self.model.max_queue:
            self._refused_total += 1
            return Refused(
                request_id=request_id, reason="queue_full", retry_after_s=self._seconds_to_free_slot()
            )
        seq = _Sequence(
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            width=width,
            arrived_at=self._clock,
            prompts=prompts,
            full_blocks=full,
            tail_tokens=tail,
        )
        self._waiting.append(seq)
        self._waiting_ids[request_id] = seq
        if self._step_ends_at is None:
            self._start_step(self._clock)
        return Admitted(request_id=request_id, running=request_id in self._running)

    def cancel(self, now: float, request_id: str) -> bool:
        """The client went away at ``now``: drop the request; its batch slots and blocks free at once (the
        step under way keeps its duration).

        Tokens it already emitted stay counted. Returns False when the engine does not hold ``request_id``
        (already finished, refused, or unknown).
        """
        self._advance_to(now)
        if request_id in self._waiting_ids:
            del self._waiting_ids[request_id]
            self._waiting = deque(s for s in self._waiting if s.request_id != request_id)
            self._cancelled_total += 1
            return True
        seq = self._running.pop(request_id, None)
        if seq is None:
            return False
        self._pool.free(request_id)
        self._running_slots -= seq.width
        self._count_generated(seq)
        self._step_chunks = [(s, n) for s, n in self._step_chunks if s is not seq]
        self._cancelled_total += 1
        return True

    def set_slowdown(self, now: float, factor: float) -> None:
        """From ``now`` on, steps take ``factor`` times as long (1.0 = normal; 2.0 = half speed, a throttled
        GPU). The step under way keeps its duration; the next one uses the new factor.

        Raises:
            ValueError: ``factor`` not a finite number > 0.
        """
        _check_positive(slowdown=factor)
        self._advance_to(now)
        self.slowdown = factor

    def advance(self, now: float) -> list[EngineEvent]:
        """Run the engine up to ``now``; return the events since the previous call, in time order."""
        self._advance_to(now)
        out, self._outbox = self._outbox, []
        return out

    # -- queries --------------------------------------------------------------------------------------------

    @property
    def clock(self) -> float:
        """The time the engine has been advanced to (seconds)."""
        return self._clock

    @property
    def pool(self) -> KvPool:
        """The KV-cache blocks: the prefix cache, else the engine's :class:`simulation.kvcache.BlockPool`."""
        return self._pool

    def next_step_end(self) -> float | None:
        """When the step under way ends (the next token boundary), or None when idle."""
        return self._step_ends_at

    def next_transition_time(self) -> float | None:
        """When the batch next changes with no new arrival (an admission, a first token, a completion or a
        preemption), or None when idle. A discrete-event simulator schedules its next engine event here."""
        if self._step_ends_at is None or self._step_started_at is None:
            return None
        if self._step_chunks or not self._in_steady_run():
            return self._step_ends_at
        stop = self._run_stop_at
        if stop is None:
            return self._step_ends_at
        return self._run_started_at + (self._run_index + max(stop - self._steps_done, 1)) * self._run_step

    def tokens_emitted(self, request_id: str) -> int:
        """Tokens (per sample) emitted so far by a running or waiting request (a preempted request keeps
        what it had emitted).

        Raises:
            KeyError: the engine does not hold ``request_id`` (finished requests have left; see
                :class:`SequenceFinished`).
        """
        seq = self._running.get(request_id)
        if seq is not None:
            return self._emitted(seq)
        waiting = self._waiting_ids.get(request_id)
        if waiting is not None:
            return waiting.emitted_base
        raise KeyError(request_id)

    def holds(self, request_id: str) -> bool:
        """True while ``request_id`` is waiting or running."""
        return request_id in self._running or request_id in self._waiting_ids

    def stats(self) -> EngineStats:
        """A snapshot at the engine's clock (O(running requests))."""
        emitted = sum((self._emitted(s) - s.counted) * s.width for s in self._running.values())
        busy = self._busy_seconds_done
        if self._step_started_at is not None:
            busy += self._clock - self._step_started_at
        pool = self._pool
        return EngineStats(
            running_requests=len(self._running),
            running_slots=self._running_slots,
            waiting_requests=len(self._waiting),
            kv_tokens=pool.blocks_in_use * pool.block_size,
            kv_usage=pool.usage,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_done + emitted,
            requests_finished_total=self._finished_total,
            requests_refused_total=self._refused_total,
            requests_cancelled_total=self._cancelled_total,
            steps_total=self._steps_done,
            busy_seconds_total=busy,
            slowdown=self.slowdown,
            prefix_cache_queries_total=0 if self.prefix_cache is None else self.prefix_cache.queries_total,
            prefix_cache_hits_total=0 if self.prefix_cache is None else self.prefix_cache.hits_total,
            num_preemptions_total=self._preemptions_total,
            kv_blocks_in_use=pool.blocks_in_use,
            kv_blocks_total=pool.num_blocks,
        )

    # -- the step machine -----------------------------------------------------------------------------------

    def _emitted(self, seq: _Sequence) -> int:
        if seq.anchor < 0:
            return seq.emitted_base
        return min(seq.emitted_base + self._steps_done - seq.anchor, seq.completion_tokens)

    def _count_generated(self, seq: _Sequence) -> None:
        """Add the tokens ``seq`` emitted since last counted to the generated-token counter."""
        e = self._emitted(seq)
        self._generation_tokens_done += (e - seq.counted) * seq.width
        seq.counted = e

    def _advance_to(self, now: float) -> None:
        now = max(now, self._clock)
        while self._step_ends_at is not None and self._step_ends_at <= now:
            self._finish_step()
            self._skip_steady_steps(now)
        self._clock = now

    def _finish_step(self) -> None:
        assert self._step_ends_at is not None
        assert self._step_started_at is not None
        t = self._step_ends_at
        self._busy_seconds_done += t - self._step_started_at
        self._steps_done += 1
        for seq, n in self._step_chunks:
            seq.to_prefill -= n
            if seq.to_prefill > 0:
                continue
            seq.prefilling = False
            seq.anchor = self._steps_done
            seq.grow_step = self._steps_done  # its first decode step may need a block
            self._next_growth = self._steps_done
            if not seq.prompt_counted:
                seq.prompt_counted = True
                self._prompt_tokens_total += seq.prompt_tokens
            if seq.emitted_base < seq.completion_tokens:
                seq.emitted_base += 1  # the prefill's forward pass samples a token
                if not seq.first_token_sent:
                    seq.first_token_sent = True
                    self._outbox.append(FirstTokenEmitted(request_id=seq.request_id, at=t))
        self._step_chunks = []
        sd = self._steps_done
        done = [
            s
            for s in self._running.values()
            if s.anchor >= 0 and s.anchor + s.completion_tokens - s.emitted_base <= sd
        ]
        for seq in done:
            del self._running[seq.request_id]
            self._pool.free(seq.request_id)
            self._running_slots -= seq.width
            self._count_generated(seq)
            self._finished_total += 1
            self._outbox.append(
                SequenceFinished(
                    request_id=seq.request_id, at=t, completion_tokens=seq.completion_tokens, width=seq.width
                )
            )
        self._start_step(t)

    def _decoding(self) -> list[_Sequence]:
        return [s for s in self._running.values() if s.anchor >= 0]

    def _grow_decode_blocks(self, t: float) -> bool:
        """Give every decoding sequence the blocks of the step starting at ``t`` (the KV of the token it
        feeds: :func:`simulation.scheduler.blocks_for`); while they do not fit, preempt the running sequence
        admitted last (:mod:`simulation.scheduler`). Returns True when it preempted."""
        if self._steps_done < self._next_growth:
            return False
        pool = self._pool
        bs = pool.block_size
        sd = self._steps_done
        preempted = False
        while True:
            needs: list[tuple[_Sequence, int]] = []
            total = 0
            for s in self._running.values():
                if s.anchor < 0 or s.grow_step > sd:
                    continue
                # a decoding sequence at a step start has emitted at most completion_tokens - 1
                e = s.emitted_base + sd - s.anchor
                n = s.full_blocks - (-(s.tail_tokens + e * s.width) // bs) - s.held
                if n > 0:
                    needs.append((s, n))
                    total += n
            if total <= pool.free_blocks or len(self._running) <= 1:
                break
            self._preempt(next(reversed(self._running.values())), t)
            preempted = True
        for s, n in needs:
            if pool.extend(s.request_id, n):
                s.held += n
        # when each next needs a block: at the emitted count whose fed token no longer fits its blocks
        nxt = math.inf
        for s in self._running.values():
            if s.anchor < 0:
                continue
            if s.grow_step <= sd:
                fits = ((s.held - s.full_blocks) * bs - s.tail_tokens) // s.width  # fed tokens that fit
                s.grow_step = (
                    s.anchor + fits + 1 - s.emitted_base if fits + 1 < s.completion_tokens else math.inf
                )
            nxt = min(nxt, s.grow_step)
        self._next_growth = nxt
        return preempted

    def _preempt(self, seq: _Sequence, t: float) -> None:
        """Free ``seq``'s blocks and slots, requeue it at the front (vLLM's recompute preemption)."""
        del self._running[seq.request_id]
        self._pool.free(seq.request_id)
        self._running_slots -= seq.width
        self._count_generated(seq)
        seq.emitted_base = seq.counted
        seq.anchor = -1
        seq.prefilling = False
        seq.to_prefill = 0
        seq.held = 0
        self._waiting.appendleft(seq)
        self._waiting_ids[seq.request_id] = seq
        self._preemptions_total += 1
        self._outbox.append(SequencePreempted(request_id=seq.request_id, at=t, emitted=seq.emitted_base))

    def _admit_head(self, t: float) -> _Sequence | None:
        """Move the head of the queue into the batch when its slots and blocks are free; None otherwise."""
        seq = self._waiting[0]
        if self._running_slots + seq.width > self.model.max_batch:
            return None
        prompts = seq.prompts if seq.prompts is not None else (PromptBlocks(tokens=seq.prompt_tokens),)
        recompute = seq.emitted_base * seq.width  # the tokens it had generated, recomputed after a preemption
        if self._pool.blocks_needed(prompts, decode_tokens=recompute) > self._pool.free_blocks:
            return None
        self._waiting.popleft()
        del self._waiting_ids[seq.request_id]
        alloc = self._pool.allocate(seq.request_id, prompts, decode_tokens=recompute)
        assert alloc.held
        seq.held = alloc.blocks
        seq.cached_tokens = alloc.hit_tokens
        seq.to_prefill = seq.prompt_tokens + recompute - alloc.hit_tokens
        seq.prefilling = True
        self._running[seq.request_id] = seq
        self._running_slots += seq.width
        if not seq.scheduled_once:
            seq.scheduled_once = True
            self._outbox.append(
                SequenceScheduled(request_id=seq.request_id, at=t, queued_seconds=t - seq.arrived_at)
            )
        return seq

    def _start_step(self, t: float) -> None:
        preempted = self._grow_decode_blocks(t)
        budget = self.model.max_num_batched_tokens
        decode_slots = 0
        pending: list[_Sequence] = []
        for s in self._running.values():
            if s.anchor >= 0:
                decode_slots += s.width
            elif s.prefilling:
                pending.append(s)
        sizes = prefill_chunks(budget, decode_slots, [s.to_prefill for s in pending])
        chunks = list(zip(pending[: len(sizes)], sizes, strict=True))
        left = None if budget is None else budget - decode_slots - sum(n for _, n in chunks)
        # no admission in a step that preempted (vLLM V1); a new sequence needs some budget left
        while not preempted and self._waiting and (left is None or left > 0):
            seq = self._admit_head(t)
            if seq is None:
                break
            n = seq.to_prefill if left is None else min(seq.to_prefill, left)
            chunks.append((seq, n))
            if left is not None:
                left -= n
        if not self._running:
            self._step_started_at = None
            self._step_ends_at = None
            self._step_chunks = []
            return
        self._step_started_at = t
        self._step_chunks = chunks
        if not chunks:
            if self._in_steady_run() and t == self._step_ends_at:
                self._run_index += 1
            else:
                self._run_key = (self._running_slots, self.slowdown)
                self._run_started_at = t
                self._run_step = self.model.decode_step_seconds(decode_slots, slowdown=self.slowdown)
                self._run_index = 0
                self._run_stop_at = self._run_stop()
            self._step_ends_at = self._run_started_at + (self._run_index + 1) * self._run_step
            self._record(t, self._step_ends_at, 0, decode_slots, 1)
            return
        self._run_key = None
        prefill_tokens = sum(n for _, n in chunks)
        duration = step_seconds(
            self.model.prefill_seconds(prefill_tokens, slowdown=self.slowdown),
            self.model.decode_step_seconds(decode_slots, slowdown=self.slowdown),
            self.model.step_time,
        )
        self._step_ends_at = t + duration
        self._record(t, self._step_ends_at, prefill_tokens, decode_slots, 1)

    def _record(self, start: float, end: float, prefill_tokens: int, decode_tokens: int, count: int) -> None:
        if self.trace_steps:
            self.steps.append(
                StepRecord(
                    start=start,
                    end=end,
                    prefill_tokens=prefill_tokens,
                    decode_tokens=decode_tokens,
                    count=count,
                    blocks_in_use=self._pool.blocks_in_use,
                    running_slots=self._running_slots,
                )
            )

    def _kv_full_step(self, decoding: list[_Sequence], first_done: int) -> int | None:
        """The ``steps_done`` whose step will not fit the ``decoding`` sequences' new blocks (it preempts),
        when that comes before ``first_done`` (the first completion); else None."""
        if self._next_growth >= first_done:
            return None
        horizon = first_done - self._steps_done - 1
        sd = self._steps_done
        k = steps_until_full(
            [
                DecodingSequence(
                    s.full_blocks,
                    s.tail_tokens,
                    s.emitted_base + sd - s.anchor,
                    s.width,
                    s.held,
                    s.completion_tokens,
                )
                for s in decoding
            ],
            self._pool.free_blocks,
            self._pool.block_size,
            horizon,
        )
        return None if k is None else self._steps_done + k

    def _run_stop(self) -> int | None:
        """For a new decode-only run: the ``steps_done`` at which it changes the batch (its first completion,
        or the step that preempts), or None when no sequence decodes."""
        decoding = self._decoding()
        if not decoding:
            return None
        stop = min(s.last_step for s in decoding)
        full = self._kv_full_step(decoding, stop)
        return stop if full is None else min(stop, full)

    def _in_steady_run(self) -> bool:
        """True when the step under way is decode-only and the batch and speed still match its run (no
        cancel or slowdown change since it started), so the next step continues the run."""
        return self._run_key == (self._running_slots, self.slowdown)

    def _skip_steady_steps(self, now: float) -> None:
        """Complete in one go the decode steps that end by ``now`` and change nothing (no admission, no first
        token, no completion, no preemption). Between such steps the batch is fixed, so every step lasts the
        same; the blocks the skipped steps' tokens took are given at the end (no lookup happens meanwhile, so
        the blocks evicted are the same ones)."""
        if (
            self._step_ends_at is None
            or self._step_started_at is None
            or self._step_chunks
            or not self._running
            or not self._in_steady_run()
        ):
            return
        step = self._run_step
        stop = self._run_stop_at
        if step <= 0 or stop is None:
            return
        # Steps that can complete before the one at whose end the batch changes.
        quiet = stop - self._steps_done - 1
        fit = math.floor((now - self._step_started_at) / step)
        # the division can round up by one step: skip only steps whose exact end is <= now
        while fit > 0 and self._run_started_at + (self._run_index + fit) * step > now:
            fit -= 1
        skip = min(quiet, fit)
        if skip <= 0:
            return
        self._steps_done += skip
        self._busy_seconds_done += skip * step
        self._run_index += skip
        self._step_started_at = self._run_started_at + self._run_index * step
        self._step_ends_at = self._run_started_at + (self._run_index + 1) * step
        preempted = self._grow_decode_blocks(self._step_started_at)
        assert not preempted
        if self.trace_steps:
            # the skipped steps, then the one now under way, as one record each
            last = self.steps[-1] if self.steps else None
            decode = last.decode_tokens if last is not None else 0
            self._record(self._step_started_at - skip * step, self._step_started_at, 0, decode, skip)
            self._record(self._step_started_at, self._step_ends_at, 0, decode, 1)

    def _fits_next_boundary(self, width: int) -> bool:
        """True when all waiting requests and one of ``width`` slots join the batch at the next boundary."""
        need = width + sum(s.width for s in self._waiting)
        return self._running_slots + need <= self.model.max_batch

    def _blocked_waiting(self) -> int:
        """Waiting requests that will not join the batch at the next step boundary for want of batch slots
        (FIFO, head-of-line)."""
        free = self.model.max_batch - self._running_slots
        joining = 0
        for seq in self._waiting:
            if seq.width > free:
                break
            free -= seq.width
            joining += 1
        return len(self._waiting) - joining

    def _seconds_to_free_slot(self) -> float:
        """Seconds until the first running request finishes, assuming the batch stays as it is (>= 0)."""
        decoding = self._decoding()
        if not decoding or self._step_ends_at is None:
            return 0.0 if self._step_ends_at is None else max(0.0, self._step_ends_at - self._clock)
        steps_to_finish = min(s.last_step for s in decoding) - self._steps_done
        step = self.model.decode_step_seconds(self._running_slots, slowdown=self.slowdown)
        return max(0.0, self._step_ends_at - self._clock + (max(steps_to_finish, 1) - 1) * step)


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """``count`` engine steps of ``[start, end)`` (seconds; ``count > 1``: a skipped run of identical
    decode steps, ``end - start`` their total), each of ``prefill_tokens`` prefill-chunk tokens and
    ``decode_tokens`` decode tokens, with ``blocks_in_use`` KV blocks held and ``running_slots`` batch slots
    taken at the step's start (after its admissions and preemptions)."""

    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int
    count: int
    blocks_in_use: int
    running_slots: int
