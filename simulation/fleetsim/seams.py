"""The engine seams: what the fleet simulation needs of one GPU's serving engine, as ``typing.Protocol`` s.

The engines are injected by the caller of :func:`simulation.fleetsim.loop.simulate`:
``simulation.gpusim.engine`` satisfies every protocol here, and the fleet simulation never imports it.
Times are in seconds (simulated), sizes in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from simulation.kvcache import PromptBlocks


class EngineTiming(Protocol):
    """The timing model of one server (``simulation.gpusim.engine.TimingModel`` satisfies it). Seconds."""

    @property
    def max_batch(self) -> int: ...

    @property
    def relative_capacity(self) -> float: ...

    def prefill_seconds(self, prompt_tokens: int, *, slowdown: float = 1.0) -> float: ...

    def decode_step_seconds(self, running: int, *, slowdown: float = 1.0) -> float: ...


class EngineSnapshot(Protocol):
    """What :meth:`ServingEngine.stats` reports (``simulation.gpusim.engine.EngineStats`` satisfies it)."""

    @property
    def running_requests(self) -> int: ...

    @property
    def waiting_requests(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def generation_tokens_total(self) -> int: ...

    @property
    def prompt_tokens_total(self) -> int: ...

    @property
    def busy_seconds_total(self) -> float: ...

    @property
    def prefix_cache_queries_total(self) -> int: ...

    @property
    def prefix_cache_hits_total(self) -> int: ...

    @property
    def num_preemptions_total(self) -> int: ...


@runtime_checkable
class FirstTokenLike(Protocol):
    """An engine event: a request's first token at ``at`` (``simulation.gpusim.engine.FirstTokenEmitted``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def at(self) -> float: ...


@runtime_checkable
class FinishedLike(Protocol):
    """An engine event: a request's last token at ``at`` (``simulation.gpusim.engine.SequenceFinished``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def at(self) -> float: ...

    @property
    def completion_tokens(self) -> int: ...


@runtime_checkable
class ScheduledLike(Protocol):
    """An engine event: a request joined the batch (``simulation.gpusim.engine.SequenceScheduled``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def queued_seconds(self) -> float: ...


class ServingEngine(Protocol):
    """One GPU's model server in simulated time (``simulation.gpusim.engine.BatchEngine`` satisfies it).

    ``submit`` may refuse (queue full); the simulation learns which through :meth:`holds`. ``prompts``
    (:class:`simulation.kvcache.PromptBlocks`) is passed only for a request whose trace row has block ids;
    an engine with a prefix cache of the trace's block size looks them up.
    """

    @property
    def model(self) -> EngineTiming: ...

    # the signature of BatchEngine.submit, which a Protocol has to repeat
    def submit(
        self, now: float, *, request_id: str, prompt_tokens: int, completion_tokens: int, width: int = 1,
        prompts: tuple[PromptBlocks, ...] | None = None,
    ) -> object: ...  # fmt: skip

    def holds(self, request_id: str) -> bool: ...

    def advance(self, now: float) -> Sequence[object]: ...

    def next_transition_time(self) -> float | None: ...

    def set_slowdown(self, now: float, factor: float) -> None: ...

    def stats(self) -> EngineSnapshot: ...
