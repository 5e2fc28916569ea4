"""The step rules of vLLM's scheduler that placement results depend on. Pure: no I/O, no clock, no state.

Shared by the simulated GPU server's engine (:class:`simulation.gpusim.engine.BatchEngine`, which the
aiohttp server drives in real time and the fleet simulation :mod:`simulation.fleetsim` injects as its GPUs),
so that both apply the same rules, as :mod:`simulation.kvcache` is for the prefix cache. The rules:

* **Token budget per step** (vLLM's ``--max-num-batched-tokens``, chunked prefill): every step first gives
  each decoding sequence its token (one per sample), then prefill *chunks* fill what is left of the budget,
  to the sequences being prefilled in the order they joined the batch, then to new sequences from the queue:
  :func:`prefill_chunks`. A prompt longer than the budget is prefilled over several steps while the batch
  keeps decoding, instead of stalling it. That is vLLM V0's chunked-prefill policy ("decode first", vLLM
  docs, "Chunked Prefill"); V1 walks its running requests in admission order, which differs only when a
  prefill chunk would take budget ahead of a decode. ``None``: no budget, every admitted prompt is
  prefilled whole in one step (vLLM without chunked prefill).
* **Step time**: :func:`step_seconds` of the step's prefill tokens (compute-bound: a GPU's dense FLOPs) and
  its decode batch (memory-bound: HBM bandwidth, the weights read once per step). ``"sum"`` (the default)
  runs them one after the other; ``"max"`` lets them overlap fully, the roofline bound of a mixed batch
  (Agrawal et al., OSDI 2024, "Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve":
  decodes piggybacked on a prefill chunk cost little). The truth lies between; ``sum`` is the pessimistic
  end and was this simulator's model before chunking.
* **KV blocks** (vLLM's KV-cache manager, block size ``bs``): a sequence of prompt blocks ``full`` (sum of
  ``tokens // bs`` over its prompts) and partial tails ``tail`` holds :func:`blocks_for` ``(full, tail, d)``
  blocks once ``d`` tokens (all samples) beyond its prompts are in its KV cache. A decode step that feeds
  the ``e``-th emitted token of each of ``w`` samples needs ``blocks_for(full, tail, e * w)`` blocks.
* **Admission** of a queued sequence needs its prompt's blocks free (after prefix-cache hits); the queue is
  FIFO (head-of-line: a sequence that does not fit is not overtaken), at most ``max_num_seqs`` batch slots.
* **Preemption** (vLLM V1 ``Scheduler.schedule``, ``PreemptionMode.RECOMPUTE``; vLLM docs "Optimization
  and Tuning", "Preemption"): when the decoding sequences' new blocks do not fit in the free blocks, the
  running sequence admitted last is preempted, again until they fit: its blocks are freed, it goes
  back to the *front* of the queue, and when admitted again it re-prefills its prompt and the tokens it had
  generated (those not found in the prefix cache), then goes on decoding. No sequence is admitted in a step
  that preempted. Each one counts in ``vllm:num_preemptions_total``.
* **Steady runs**: between two changes of the batch, decode-only steps last alike; :func:`steps_until_full`
  tells after how many of them the blocks run out, so that an engine can jump over the run.

Not modelled: vLLM's ``long_prefill_token_threshold`` (a cap on one request's chunk), the per-sample split of
a request of ``n`` samples into ``n`` requests (here one sequence of ``n`` slots), attention cost growing with
the context length (the decode step grows with the batch only: its cost over context would make every step of
a run differ and rule out the jump), and CPU swap (vLLM V1 only recomputes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol

from simulation.kvcache import CacheAllocation, PromptBlocks

#: How a step's prefill and decode times combine (see the module doc).
StepTime = Literal["sum", "max"]
STEP_TIMES: tuple[StepTime, ...] = ("sum", "max")


class KvPool(Protocol):
    """The KV-cache blocks of one GPU as the engine uses them (:class:`simulation.kvcache.PrefixCache` and
    :class:`simulation.kvcache.BlockPool` satisfy it)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def blocks_in_use(self) -> int: ...

    @property
    def usage(self) -> float: ...

    @property
    def queries_total(self) -> int: ...

    @property
    def hits_total(self) -> int: ...

    def blocks_needed(self, prompts: Sequence[PromptBlocks], *, decode_tokens: int = 0) -> int: ...

    def allocate(
        self, seq_id: str, prompts: Sequence[PromptBlocks], *, decode_tokens: int = 0
    ) -> CacheAllocation: ...

    def extend(self, seq_id: str, blocks: int) -> bool: ...

    def free(self, seq_id: str) -> bool: ...


def step_seconds(prefill_seconds: float, decode_seconds: float, mode: StepTime = "sum") -> float:
    """One step's duration (seconds) from its prefill part and its decode part: their sum or their max.

    Raises:
        ValueError: a negative time or an unknown ``mode``.
    """
    if prefill_seconds < 0 or decode_seconds < 0:
        raise ValueError("step parts must be >= 0 seconds")
    if mode == "sum":
        return prefill_seconds + decode_seconds
    if mode == "max":
        return max(prefill_seconds, decode_seconds)
    raise ValueError(f"step time must be one of {STEP_TIMES}, got {mode!r}")


def blocks_for(full_blocks: int, tail_tokens: int, decoded_tokens: int, block_size: int) -> int:
    """Blocks of a sequence with ``full_blocks`` full prompt blocks, ``tail_tokens`` tokens in its prompts'
    partial last blocks and ``decoded_tokens`` tokens (all samples) in its KV cache beyond its prompts:
    ``full_blocks + ceil((tail_tokens + decoded_tokens) / block_size)``.

    Raises:
        ValueError: a negative count or ``block_size < 1``.
    """
    if min(full_blocks, tail_tokens, decoded_tokens) < 0 or block_size < 1:
        raise ValueError("counts must be >= 0 and block_size >= 1")
    return full_blocks + -(-(tail_tokens + decoded_tokens) // block_size)


def prefill_chunks(budget: int | None, decode_tokens: int, remaining: Sequence[int]) -> list[int]:
    """The prefill chunk (tokens) of each sequence waiting for prefill, in order, in a step whose decoding
    sequences take ``decode_tokens``: what is left of ``budget`` goes to each in turn, ``min(left, its
    remaining tokens)``, until one is cut or nothing is left (a sequence with nothing left to compute, a
    prompt of 0 tokens, still gets its chunk of 0 then). ``budget`` None: every sequence whole.

    Returns as many chunks as sequences served (a prefix of ``remaining``); the chunks and ``decode_tokens``
    add up to at most ``budget``.

    Raises:
        ValueError: a negative count, or ``decode_tokens`` over ``budget``.
    """
    if decode_tokens < 0 or any(r < 0 for r in remaining):
        raise ValueError("token counts must be >= 0")
    if budget is None:
        return list(remaining)
    if decode_tokens > budget:
        raise ValueError(f"{decode_tokens} decode tokens exceed the step budget of {budget}")
    left = budget - decode_tokens
    out: list[int] = []
    for r in remaining:
        if r > 0 and left <= 0:
            break
        n = min(r, left)
        out.append(n)
        left -= n
        if n < r:  # cut: the sequences behind it wait for the next step
            break
    return out


class DecodingSequence(NamedTuple):
    """A decoding sequence as the block rules see it (a tuple: an engine builds many).

    Attributes:
        full_blocks / tail_tokens: its prompts' full blocks and partial-block tokens (see :func:`blocks_for`).
        emitted: tokens emitted per sample so far (>= 1 while decoding).
        width: samples (OpenAI ``n``).
        held: blocks it holds.
        last: emitted count per sample at which it finishes (its completion tokens).
    """

    full_blocks: int
    tail_tokens: int
    emitted: int
    width: int
    held: int
    last: int


def growth_blocks(seqs: Sequence[DecodingSequence], steps: int, block_size: int) -> int:
    """New blocks the decoding ``seqs`` need for the step that starts ``steps`` steps from now (0: the next
    one): ``sum(blocks_for(full, tail, (emitted + steps) * width) - held)``, a sequence's emitted count
    capped at its last step's feed (``last - 1``)."""
    total = 0
    for s in seqs:
        e = min(s.emitted + steps, max(s.last - 1, 0))
        total += max(0, blocks_for(s.full_blocks, s.tail_tokens, e * s.width, block_size) - s.held)
    return total


def steps_until_full(
    seqs: Sequence[DecodingSequence], free_blocks: int, block_size: int, horizon: int
) -> int | None:
    """The smallest ``k`` in ``[1, horizon]`` such that the step starting ``k`` steps from now needs more new
    blocks than ``free_blocks`` (the step then preempts), or None when none does. ``growth_blocks`` grows with
    ``k``, so a binary search: O(len(seqs) * log(horizon)).

    Raises:
        ValueError: ``free_blocks < 0``.
    """
    if free_blocks < 0:
        raise ValueError(f"free_blocks must be >= 0, got {free_blocks}")
    if horizon < 1 or growth_blocks(seqs, horizon, block_size) <= free_blocks:
        return None
    lo, hi = 1, horizon  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if growth_blocks(seqs, mid, block_size) > free_blocks:
            hi = mid
        else:
            lo = mid + 1
    return lo
