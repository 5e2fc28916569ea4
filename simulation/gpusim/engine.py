"""Timing model of one simulated GPU model server doing continuous batching. Pure: no I/O, no clock.

The model (all times in seconds, all rates in tokens/s, for one model replica on one GPU):

* **Capacity.** A GPU of relative capacity ``c`` (``config.gpu_profiles[gpu].relative_capacity``, V100 = 1.0)
  runs ``c`` times faster than the reference rates of ``config.simulation``, which are given for ``c = 1.0``.
  A *slowdown* factor ``s`` (1.0 normally; > 1.0 for a throttled GPU) divides the speed again.
* **Prefill.** ``prefill_seconds(P) = s * P / (c * prefill_tokens_per_s)`` for ``P`` prompt tokens. The
  prefill of a request produces its first output token (in vLLM the prefill forward pass samples token 1).
* **Decode.** Iteration-level scheduling as in Orca (Yu et al., OSDI 2022, "Orca: A Distributed Serving
  System for Transformer-Based Generative Models", section 3.1) and vLLM (Kwon et al., SOSP 2023, "Efficient
  Memory Management for Large Language Model Serving with PagedAttention"): the engine runs *steps*; every
  sequence in the running batch emits one token per step, so each decodes at one token per step time::

      decode_step_seconds(n) = s * (1 + b * (n - 1)) / (c * decode_tokens_per_s)

  for ``n`` running sequences (batch slots). ``b`` (:data:`BATCH_SLOWDOWN_PER_SEQUENCE`, 0.02) makes a step
  mildly slower as the batch fills: decode is memory-bandwidth bound, the weights are read once per step
  whatever the batch size, but every sequence adds its own KV-cache reads and attention work (both papers
  describe decode as memory-bound, its per-step latency growing slowly with batch size). 2% per extra
  sequence is an assumption chosen to be mild (a full batch of 16 runs each step 1.3x slower while producing
  16x the tokens), not a measurement.
* **Mixed steps.** A step that admits new sequences runs their prefill and one decode iteration of the
  sequences already running, one after the other (``step = prefill_seconds(sum of new prompts) +
  decode_step_seconds(already running)``): prefill stalls decode, as it does in vLLM without chunked prefill.
  New sequences are admitted only at step boundaries (vLLM's scheduler runs once per step).
* **Prefill only.** A request with zero completion tokens (an embedding: vLLM runs pooling models as a
  prefill whose hidden states are pooled, with no decode) joins the batch like any other, takes part in one
  mixed step (its prefill), emits no token and leaves the batch at the end of that step.
* **Bounds.** At most ``max_batch`` batch slots run (vLLM ``--max-num-seqs``); a request with ``n`` parallel
  samples (OpenAI ``n``) takes ``n`` slots, shares one prefill, and is admitted whole. Other requests wait in
  FIFO order (head-of-line: a wide request is not overtaken). When more than ``max_queue`` requests would have
  to wait beyond the next step boundary, a new request is refused (the server answers 503).
* **KV cache.** :func:`kv_budget_tokens` estimates how many tokens of KV cache fit in the GPU's memory;
  the usage reported (``vllm:kv_cache_usage_perc``) is the tokens held by running sequences over that budget.
  It is an estimate shown to scrapers; admission is bounded by ``max_batch`` only.
* **Prefix cache.** With a :class:`simulation.kvcache.PrefixCache` (vLLM's automatic prefix caching: that
  module has the rules), a request's prompt blocks are looked up when it is scheduled and only the tokens
  not found are prefilled: the step's prefill is ``prefill_seconds(sum of uncached prompt tokens)``. Its
  blocks are pinned until it finishes or is cancelled. Without one (the default) every prompt token is
  prefilled, as before.

:class:`BatchEngine` is the state machine of one server. It is driven by explicit timestamps (``now``), never
reads a clock, and jumps over runs of identical decode steps in O(1), so the same code serves the real-time
aiohttp server (which wakes at every step to stream tokens) and a discrete-event simulation of a large fleet
(which only needs :meth:`BatchEngine.next_transition_time`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from inferlb.config.schema import Config, EndpointConfig
from simulation.kvcache import PrefixCache, PromptBlocks

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
        relative_capacity: GPU capacity ``c`` (V100 = 1.0).
        prefill_tokens_per_s: prefill rate at ``c = 1.0`` (tokens/s).
        decode_tokens_per_s: decode rate of one lone sequence at ``c = 1.0`` (tokens/s).
        max_batch: batch slots that run at once (vLLM ``--max-num-seqs``).
        max_queue: requests allowed to wait beyond the next step boundary; more are refused.
        kv_budget_tokens: KV-cache capacity (tokens), for the usage estimate.
        batch_slowdown_per_sequence: decode step growth per extra running sequence (see the module docstring).

    Raises:
        ValueError: a non-positive capacity or rate, ``max_batch < 1``, ``max_queue < 0`` or
            ``kv_budget_tokens < 1``.
    """

    relative_capacity: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    max_batch: int
    max_queue: int
    kv_budget_tokens: int
    batch_slowdown_per_sequence: float = BATCH_SLOWDOWN_PER_SEQUENCE

    def __post_init__(self) -> None:
        _check_positive(
            relative_capacity=self.relative_capacity,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
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

    @classmethod
    def for_endpoint(cls, config: Config, endpoint: EndpointConfig) -> TimingModel:
        """The timing of ``endpoint``: its GPU profile's capacity and memory, ``config.simulation``'s rates.

        Raises:
            KeyError: the endpoint's GPU has no profile (config validation prevents this).
        """
        profile = config.gpu_profiles[endpoint.gpu]
        sim = config.simulation
        return cls(
            relative_capacity=profile.relative_capacity,
            prefill_tokens_per_s=sim.prefill_tokens_per_s,
            decode_tokens_per_s=sim.decode_tokens_per_s,
            max_batch=sim.max_batch,
            max_queue=sim.max_queue,
            kv_budget_tokens=kv_budget_tokens(profile.memory_gb, max_batch=sim.max_batch),
        )

    def prefill_seconds(self, prompt_tokens: int, *, slowdown: float = 1.0) -> float:
        """:func:`prefill_seconds` with this model's capacity and rate (seconds)."""
        return prefill_seconds(
            prompt_tokens,
            relative_capacity=self.relative_capacity,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            slowdown=slowdown,
        )

    def decode_step_seconds(self, running: int, *, slowdown: float = 1.0) -> float:
        """:func:`decode_step_seconds` with this model's capacity, rate and batch slowdown (seconds)."""
        return decode_step_seconds(
            running,
            relative_capacity=self.relative_capacity,
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


EngineEvent = SequenceScheduled | FirstTokenEmitted | SequenceFinished


@dataclass(frozen=True, kw_only=True)
class Admitted:
    """:meth:`BatchEngine.submit` accepted the request; ``running`` is True when it was scheduled at once."""

    request_id: str
    running: bool


@dataclass(frozen=True, kw_only=True)
class Refused:
    """:meth:`BatchEngine.submit` refused the request: the queue is full (the server answers 503).

    ``retry_after_s`` estimates when a batch slot frees (seconds, >= 0).
    """

    request_id: str
    reason: Literal["queue_full"]
    retry_after_s: float


Admission = Admitted | Refused


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot of the engine at its clock.

    Attributes:
        running_requests / running_slots: requests in the batch, and the batch slots they take (``n`` each).
        waiting_requests: requests queued (FIFO) behind the batch.
        kv_tokens: tokens whose KV cache is held by running requests (prompt + emitted tokens per sample).
        kv_usage: ``kv_tokens / kv_budget_tokens``, clamped to [0, 1].
        prompt_tokens_total: prompt tokens prefilled so far.
        generation_tokens_total: tokens emitted so far (all samples, finished, running and cancelled).
        prefix_cache_queries_total / prefix_cache_hits_total: prompt tokens looked up in the prefix cache,
            and those found (vLLM's ``vllm:prefix_cache_queries_total`` / ``_hits_total``); 0 without one.
        requests_finished_total / requests_refused_total / requests_cancelled_total: request outcomes.
        steps_total: engine steps completed.
        busy_seconds_total: time during which a step was running (GPU busy), for utilization telemetry.
        slowdown: the current slowdown factor.
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


@dataclass(kw_only=True, slots=True)
class _Sequence:
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    width: int
    arrived_at: float
    #: its prompts' blocks for the prefix cache (None: one prompt of no known blocks)
    prompts: tuple[PromptBlocks, ...] | None = None
    #: prompt tokens found in the prefix cache when it was scheduled (their prefill is skipped)
    cached_tokens: int = 0
    #: Global index of the step that prefills it (-1 while waiting). It has emitted
    #: ``steps_done - first_step`` tokens per sample once that step completed.
    first_step: int = -1

    @property
    def last_step(self) -> int:
        """The value of ``steps_done`` at which it has emitted its last token."""
        return self.first_step + self.completion_tokens


@dataclass(kw_only=True)
class BatchEngine:
    """The continuous-batching state machine of one simulated GPU server, in simulated time (seconds).

    Drive it with non-decreasing timestamps: :meth:`submit`, :meth:`cancel`, :meth:`set_slowdown` and
    :meth:`advance` each first bring the engine to ``now`` (a ``now`` earlier than the engine's clock is
    treated as the clock: time never runs backwards). Events produced on the way are returned by the next
    :meth:`advance`, in time order. Event times are exact step boundaries computed from the model, not the
    times the driver happened to wake up.

    A real-time driver sleeps until :meth:`next_step_end` to stream each token; a discrete-event simulator
    needs only :meth:`next_transition_time` (the next admission, first token or completion), since runs of
    identical decode steps are skipped in O(1).
    """

    model: TimingModel
    slowdown: float = 1.0
    #: the GPU's prefix cache (vLLM's automatic prefix caching), or None: every prompt token is prefilled
    prefix_cache: PrefixCache | None = None
    _clock: float = 0.0
    _steps_done: int = 0
    _step_started_at: float | None = None
    _step_ends_at: float | None = None
    _step_admitted: list[_Sequence] = field(default_factory=list)
    #: The run of identical decode-only steps under way: its batch key (slots, slowdown), its start, the
    #: length of each of its steps and the index of the current one. Step ``k`` of a run ends at
    #: ``start + (k + 1) * step`` whether the driver stepped to it or jumped over it, so the boundaries (and
    #: which side of one an arrival lands on) do not depend on how the engine is driven. None while the step
    #: under way admits (prefills) requests.
    _run_key: tuple[int, float] | None = None
    _run_started_at: float = 0.0
    _run_step: float = 0.0
    _run_index: int = 0
    _running: dict[str, _Sequence] = field(default_factory=dict)
    _running_slots: int = 0
    _waiting: deque[_Sequence] = field(default_factory=deque)
    _waiting_ids: set[str] = field(default_factory=set)
    _outbox: list[EngineEvent] = field(default_factory=list)
    _prompt_tokens_total: int = 0
    _generation_tokens_done: int = 0
    _finished_total: int = 0
    _refused_total: int = 0
    _cancelled_total: int = 0
    _busy_seconds_done: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(slowdown=self.slowdown)

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
        ``prompt_tokens``); None is one prompt whose blocks are unknown (it takes blocks, hits none). Ignored
        without a prefix cache.

        Returns :class:`Admitted` (running at once when the server was idle, else queued until the next step
        boundary) or :class:`Refused` when more than ``max_queue`` requests would wait beyond that boundary.

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
        )
        self._waiting.append(seq)
        self._waiting_ids.add(request_id)
        if self._step_ends_at is None:
            self._start_step(self._clock)
        return Admitted(request_id=request_id, running=request_id in self._running)

    def cancel(self, now: float, request_id: str) -> bool:
        """The client went away at ``now``: drop the request; its batch slots free at the next step boundary.

        Tokens it already emitted stay counted. Returns False when the engine does not hold ``request_id``
        (already finished, refused, or unknown).
        """
        self._advance_to(now)
        if request_id in self._waiting_ids:
            self._waiting_ids.discard(request_id)
            self._waiting = deque(s for s in self._waiting if s.request_id != request_id)
            self._cancelled_total += 1
            return True
        seq = self._running.pop(request_id, None)
        if seq is None:
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.free(request_id)
        self._running_slots -= seq.width
        self._generation_tokens_done += self._emitted(seq) * seq.width
        if seq in self._step_admitted:
            self._step_admitted.remove(seq)
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

    def next_step_end(self) -> float | None:
        """When the step under way ends (the next token boundary), or None when idle."""
        return self._step_ends_at

    def next_transition_time(self) -> float | None:
        """When the batch next changes with no new arrival (an admission, a first token or a completion), or
        None when idle. A discrete-event simulator schedules its next engine event here."""
        if self._step_ends_at is None or self._step_started_at is None:
            return None
        if self._step_admitted or not self._running or not self._in_steady_run():
            return self._step_ends_at
        steps_to_finish = min(s.last_step for s in self._running.values()) - self._steps_done
        return self._run_started_at + (self._run_index + max(steps_to_finish, 1)) * self._run_step

    def tokens_emitted(self, request_id: str) -> int:
        """Tokens (per sample) emitted so far by a running or waiting request.

        Raises:
            KeyError: the engine does not hold ``request_id`` (finished requests have left; see
                :class:`SequenceFinished`).
        """
        seq = self._running.get(request_id)
        if seq is not None:
            return self._emitted(seq)
        if request_id in self._waiting_ids:
            return 0
        raise KeyError(request_id)

    def holds(self, request_id: str) -> bool:
        """True while ``request_id`` is waiting or running."""
        return request_id in self._running or request_id in self._waiting_ids

    def stats(self) -> EngineStats:
        """A snapshot at the engine's clock (O(running requests))."""
        kv = 0
        emitted = 0
        for s in self._running.values():
            e = self._emitted(s)
            kv += s.prompt_tokens + e * s.width
            emitted += e * s.width
        busy = self._busy_seconds_done
        if self._step_started_at is not None:
            busy += self._clock - self._step_started_at
        return EngineStats(
            running_requests=len(self._running),
            running_slots=self._running_slots,
            waiting_requests=len(self._waiting),
            kv_tokens=kv,
            kv_usage=min(1.0, kv / self.model.kv_budget_tokens),
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
        )

    # -- the step machine -----------------------------------------------------------------------------------

    def _emitted(self, seq: _Sequence) -> int:
        return max(0, min(self._steps_done - seq.first_step, seq.completion_tokens))

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
        for seq in self._step_admitted:
            self._prompt_tokens_total += seq.prompt_tokens
            if seq.completion_tokens > 0:
                self._outbox.append(FirstTokenEmitted(request_id=seq.request_id, at=t))
        self._step_admitted = []
        done = [s for s in self._running.values() if s.last_step <= self._steps_done]
        for seq in done:
            del self._running[seq.request_id]
            if self.prefix_cache is not None:
                self.prefix_cache.free(seq.request_id)
            self._running_slots -= seq.width
            self._generation_tokens_done += seq.completion_tokens * seq.width
            self._finished_total += 1
            self._outbox.append(
                SequenceFinished(
                    request_id=seq.request_id, at=t, completion_tokens=seq.completion_tokens, width=seq.width
                )
            )
        self._start_step(t)

    def _start_step(self, t: float) -> None:
        admitted: list[_Sequence] = []
        while self._waiting and self._running_slots + self._waiting[0].width <= self.model.max_batch:
            seq = self._waiting.popleft()
            self._waiting_ids.discard(seq.request_id)
            seq.first_step = self._steps_done
            self._running[seq.request_id] = seq
            self._running_slots += seq.width
            admitted.append(seq)
            if self.prefix_cache is not None:
                prompts = (
                    seq.prompts if seq.prompts is not None else (PromptBlocks(tokens=seq.prompt_tokens),)
                )
                alloc = self.prefix_cache.allocate(
                    seq.request_id, prompts, decode_tokens=seq.completion_tokens * seq.width
                )
                seq.cached_tokens = alloc.hit_tokens
            self._outbox.append(
                SequenceScheduled(request_id=seq.request_id, at=t, queued_seconds=t - seq.arrived_at)
            )
        if not self._running:
            self._step_started_at = None
            self._step_ends_at = None
            self._step_admitted = []
            return
        self._step_started_at = t
        self._step_admitted = admitted
        if not admitted:
            if self._in_steady_run() and t == self._step_ends_at:
                self._run_index += 1
            else:
                self._run_key = (self._running_slots, self.slowdown)
                self._run_started_at = t
                self._run_step = self.model.decode_step_seconds(self._running_slots, slowdown=self.slowdown)
                self._run_index = 0
            self._step_ends_at = self._run_started_at + (self._run_index + 1) * self._run_step
            return
        self._run_key = None
        decoding = self._running_slots - sum(s.width for s in admitted)
        computed = sum(s.prompt_tokens - s.cached_tokens for s in admitted)
        duration = self.model.prefill_seconds(computed, slowdown=self.slowdown)
        duration += self.model.decode_step_seconds(decoding, slowdown=self.slowdown)
        self._step_ends_at = t + duration

    def _in_steady_run(self) -> bool:
        """True when the step under way is decode-only and the batch and speed still match its run (no
        cancel or slowdown change since it started), so the next step continues the run."""
        return self._run_key == (self._running_slots, self.slowdown)

    def _skip_steady_steps(self, now: float) -> None:
        """Complete in one go the decode steps that end by ``now`` and change nothing (no admission, no first
        token, no completion). Between such steps the batch is fixed, so every step lasts the same."""
        if (
            self._step_ends_at is None
            or self._step_started_at is None
            or self._step_admitted
            or not self._running
            or not self._in_steady_run()
        ):
            return
        step = self._run_step
        if step <= 0:
            return
        # Steps that can complete before the one at whose end the first running sequence finishes.
        quiet = min(s.last_step for s in self._running.values()) - self._steps_done - 1
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

    def _fits_next_boundary(self, width: int) -> bool:
        """True when all waiting requests and one of ``width`` slots join the batch at the next boundary."""
        need = width + sum(s.width for s in self._waiting)
        return self._running_slots + need <= self.model.max_batch

    def _blocked_waiting(self) -> int:
        """Waiting requests that will not join the batch at the next step boundary (FIFO, head-of-line)."""
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
        if not self._running or self._step_ends_at is None:
            return 0.0
        steps_to_finish = min(s.last_step for s in self._running.values()) - self._steps_done
        step = self.model.decode_step_seconds(self._running_slots, slowdown=self.slowdown)
        return max(0.0, self._step_ends_at - self._clock + (max(steps_to_finish, 1) - 1) * step)
