"""Fair waiting under saturation (the EPP's flow control): when every eligible endpoint is saturated, a
request waits in the pool's :class:`~inferlb.policy.fair_queue.FairQueue` instead of an immediate 429, and is
admitted (picked, answered) when an endpoint has room again.

What a request brings (request headers the gateway forwards, names as the Gateway API Inference Extension's
``pkg/epp/metadata`` has them):

- **priority**: the ``x-gateway-inference-objective`` header names an InferenceObjective; ``--objective
  NAME=PRIORITY`` gives each known name its ``spec.priority`` (an unknown name counts as 0, as GIE does
  when no such objective exists). Without a known objective, the ``x-inferlb-priority`` header: an integer
  on the same scale, or inferlb's tenant priorities ``high`` (1), ``default`` (0), ``low`` (-1). Else 0.
  A higher priority is served first, strictly (the queue's band is ``-priority``); anything else in the
  header is a 400.
- **fairness id** (the tenant): the ``x-gateway-inference-fairness-id`` header, else GIE's shared
  ``default-flow``. Within one priority, fairness ids share admissions by tokens (start-time fair
  queueing, see :mod:`inferlb.policy.fair_queue`).
- **cost**: prompt tokens (cl100k, :func:`inferlb.request.tokens.count_prompt_tokens`; the floor of
  :func:`~inferlb.request.tokens.min_prompt_tokens` when counting passes :data:`COUNT_DEADLINE_S`) plus the
  completion budget (:meth:`~inferlb.request.parsing.InferenceRequest.output_token_cap` with
  ``default_max_tokens`` when the body sets no cap); a request the EPP does not parse costs
  ``default_max_tokens``.

Bounded waiting: ``max_queued`` waiters at most (the next is refused 429 ``queue_full`` at once), each at
most ``max_wait_s`` (then 429 ``queue_timeout``; GIE answers its queue TTL with 503 instead), both with
``retry-after``. A stream that ends while its request waits (the client went away, Envoy reset it) takes
the request out of the queue. The gateway's ext_proc ``message_timeout`` bounds how long Envoy waits for
the answer the waiting request holds back, so ``max_wait_s`` must stay below it, with room for the pick
and the answer's way back (the README's EPP section).

The state lives on the event loop (one owner, no locks); the decision what to admit is the picker's
(:meth:`epp.picking.EndpointPicker.dispatch`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import msgspec
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inferlb.errors import RequestError
from inferlb.policy.fair_queue import QueueFull
from inferlb.policy.fair_wait import FairWaiters, Waiter
from inferlb.request import headers as inferlb_headers
from inferlb.request.tokens import (
    CountingBudgetExceededError,
    count_prompt_tokens,
    default_counter,
    min_prompt_tokens,
)

if TYPE_CHECKING:
    from epp.metrics import EppMetrics
    from epp.picking import Refused, RequestSeen, Routed
    from inferlb.request.parsing import InferenceRequest

__all__ = ["FlowControl", "QueueFull", "QueueSettings", "Waiting"]

#: The fairness id header (GIE ``metadata.FlowFairnessIDKey``).
FAIRNESS_ID_HEADER: Final = "x-gateway-inference-fairness-id"
#: The InferenceObjective name header (GIE ``metadata.ObjectiveKey``).
OBJECTIVE_HEADER: Final = "x-gateway-inference-objective"
#: A plain priority header (inferlb's own; GIE has none: it reads priorities from InferenceObjectives).
PRIORITY_HEADER: Final = inferlb_headers.PRIORITY
#: The fairness id of a request without the header (GIE's default flow key, ``pkg/epp/handlers``).
DEFAULT_FAIRNESS_ID: Final = "default-flow"
#: Seconds a waiter may wait by default: half the 10 s ``message_timeout`` of GIE's gateway configs.
DEFAULT_MAX_WAIT_S: Final = 5.0
#: Completion budget of a request that sets no cap (tokens): the inferlb config's ``default_max_tokens``.
DEFAULT_MAX_TOKENS: Final = 256
#: Seconds the prompt count of one request may take before its floor stands in (the event loop's budget).
COUNT_DEADLINE_S: Final = 0.02
#: inferlb's tenant priority names on the objective priority scale.
PRIORITY_NAMES: Final[Mapping[str, int]] = {"high": 1, "default": 0, "low": -1}
#: Priorities are int32, as an InferenceObjective's ``spec.priority``.
_INT32: Final = (-(2**31), 2**31 - 1)


class QueueSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The flow control of one pool.

    Attributes:
        max_queued: requests waiting at most (>= 0; 0: no queue, every saturated request is a 429 at once).
        max_wait_s: seconds a request may wait (> 0).
        objectives: InferenceObjective name -> priority (int32).
        default_max_tokens: completion budget of a request that sets no cap (tokens, >= 1).

    Raises:
        ValueError: a field out of range, named as its flag.
    """

    max_queued: int = 0
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    objectives: dict[str, int] = msgspec.field(default_factory=dict)
    default_max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        if self.max_queued < 0:
            raise ValueError(f"--max-queued must be >= 0, got {self.max_queued}")
        if not self.max_wait_s > 0:
            raise ValueError(f"--max-wait must be > 0 seconds, got {self.max_wait_s}")
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {self.default_max_tokens}")
        for name, priority in self.objectives.items():
            if not _INT32[0] <= priority <= _INT32[1]:
                raise ValueError(f"--objective {name}: priority {priority} is not an int32")


def parse_objective(text: str) -> tuple[str, int]:
    """``NAME=PRIORITY`` (an ``--objective`` value) as ``(name, priority)``.

    Raises:
        ValueError: no ``=``, an empty name, or a priority that is not an int32; the message names the flag.
    """
    name, sep, value = text.partition("=")
    name = name.strip()
    try:
        priority = int(value.strip())
    except ValueError:
        priority = None
    if not sep or not name or priority is None or not _INT32[0] <= priority <= _INT32[1]:
        raise ValueError(f"--objective {text!r} is not NAME=PRIORITY (an int32 priority)")
    return name, priority


def request_priority(seen: RequestSeen, objectives: Mapping[str, int]) -> int:
    """The request's priority (see the module doc): a known objective's, else the priority header's, else 0.

    Raises:
        RequestError: 400 ``invalid_request_error`` when the priority header is neither an int32 nor
            ``high``/``default``/``low``.
    """
    if seen.objective is not None and seen.objective in objectives:
        return objectives[seen.objective]
    text = (seen.priority or "").strip()
    if not text:
        return 0
    if text.lower() in PRIORITY_NAMES:
        return PRIORITY_NAMES[text.lower()]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not _INT32[0] <= value <= _INT32[1]:
        raise RequestError(
            400,
            f"The {PRIORITY_HEADER} header must be an integer priority or high/default/low, "
            f"got {text[:64]!r}.",
            type="invalid_request_error",
            code="invalid_priority",
        )
    return value


def fairness_id(seen: RequestSeen) -> str:
    """The request's fairness id: the header's value (stripped), else :data:`DEFAULT_FAIRNESS_ID`."""
    value = (seen.fairness_id or "").strip()
    return value or DEFAULT_FAIRNESS_ID


def request_cost(request: InferenceRequest | None, *, default_max_tokens: int) -> int:
    """Tokens a request will occupy a model server for: prompt tokens + completion budget (>= 1)."""
    if request is None:
        return max(1, default_max_tokens)
    counter = default_counter()
    try:
        prompt = count_prompt_tokens(request, counter, deadline=time.monotonic() + COUNT_DEADLINE_S)
    except CountingBudgetExceededError:
        prompt = sum(min_prompt_tokens(request, counter))
    return max(1, prompt + request.output_token_cap(default_max_tokens))


@dataclass(eq=False, slots=True, kw_only=True)
class Waiting(Waiter["Routed | Refused"]):
    """One request waiting for room (:class:`~inferlb.policy.fair_wait.Waiter`: its id, tenant, band
    ``-priority``, cost, arrival, outcome); :attr:`outcome` resolves to its decision (or is cancelled when
    its stream ends first).

    Attributes:
        priority: its priority (higher first).
        subset: the gateway's subset hint, re-read at admission.
        request: the parsed request (None when not parsed), for the pick.
    """

    priority: int
    subset: tuple[str, ...] | None
    request: InferenceRequest | None

    @property
    def fairness_id(self) -> str:
        """Its fairness id (the queue's tenant)."""
        return self.tenant


class FlowControl(Collector):
    """The waiters of one pool: :class:`~inferlb.policy.fair_wait.FairWaiters` over a
    :class:`~inferlb.policy.fair_queue.FairQueue` (bands ``-priority``), counted in the EPP's metrics.

    Args:
        settings: bounds and objectives (``max_queued`` > 0).
        metrics: where waits and expiries are counted; the queue lengths are registered on its registry.
        on_expired: the reply of a request that waited ``max_wait_s`` (counted by the caller).
        clock: monotonic seconds (the event loop's timers run on :func:`time.monotonic` too).

    Must be used from the event loop that serves the streams (timers, futures).
    """

    def __init__(
        self,
        settings: QueueSettings,
        metrics: EppMetrics,
        *,
        on_expired: Callable[[], Refused],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if settings.max_queued < 1:
            raise ValueError("flow control needs max_queued >= 1")
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._on_expired = on_expired
        self.waiters: FairWaiters[Waiting, Routed | Refused] = FairWaiters(
            max_queued=settings.max_queued,
            max_wait_s=settings.max_wait_s,
            on_expired=self._expired,
            on_left=self._left,
            clock=clock,
        )
        self.queue = self.waiters.queue
        metrics.registry.register(self)

    def __len__(self) -> int:
        return len(self.waiters)

    def enqueue(
        self,
        *,
        priority: int,
        fairness_id: str,
        cost_tokens: int,
        subset: tuple[str, ...] | None,
        request: InferenceRequest | None,
    ) -> Waiting:
        """Queue a request; it expires after ``max_wait_s``.

        Raises:
            QueueFull: ``max_queued`` requests wait already.
        """
        waiting = Waiting(
            request_id=self.waiters.new_id(),
            tenant=fairness_id,
            band=-priority,
            cost_tokens=cost_tokens,
            enqueued_at=self.clock(),
            outcome=asyncio.get_running_loop().create_future(),
            priority=priority,
            subset=subset,
            request=request,
        )
        return self.waiters.enqueue(waiting)

    def head(self) -> Waiting | None:
        """The waiter the queue serves next (bands strictly, then fair within the band), left waiting; waiters
        whose stream went away in the meantime are dropped on the way."""
        return self.waiters.head()

    def take_head(self, decision: Routed | Refused, outcome: str) -> Waiting:
        """Answer the :meth:`head` waiter with ``decision`` (``outcome``: ``admitted`` or ``unavailable``).

        Raises:
            LookupError: nothing waits.
        """
        return self.waiters.take_head(decision, outcome)

    def abandon(self, waiting: Waiting) -> Routed | Refused | None:
        """``waiting``'s stream ended: out of the queue if it still waits. Returns the decision when one was
        made before (the caller releases what it holds), else None."""
        return self.waiters.abandon(waiting)

    def expire_due(self, waiting: Waiting | None = None) -> None:
        """Answer every waiter past ``max_wait_s`` with the ``on_expired`` reply (``waiting``'s timer calls
        this; it is armed again when the clock has not quite reached its deadline yet)."""
        self.waiters.expire_due(waiting)

    def _expired(self, waiting: Waiting) -> Refused:
        self.metrics.queue_expired.inc()
        return self._on_expired()

    def _left(self, waiting: Waiting, outcome: str, waited_s: float) -> None:
        self.metrics.queue_wait.labels(outcome).observe(waited_s)

    def waiting(self) -> dict[int, int]:
        """Priority -> requests waiting (priorities with none left out)."""
        return {-band: n for band, n in self.waiters.waiting().items()}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """``inferlb_epp_queue_length{priority}``: the requests waiting now per priority (0 for the default
        priority and each configured objective's, so the series exist before a request waits)."""
        family = GaugeMetricFamily(
            "inferlb_epp_queue_length", "Requests waiting for room, by priority", labels=("priority",)
        )
        counts = {0: 0, **dict.fromkeys(self.settings.objectives.values(), 0), **self.waiting()}
        for priority in sorted(counts, reverse=True):
            family.add_metric((str(priority),), float(counts[priority]))
        yield family
