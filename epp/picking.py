"""The EPP's decision for one request, transport-free: parse the OpenAI body, pick endpoints from the
pool's live state, or refuse with the status the EPP protocol names.

Order of the checks (the Gateway API Inference Extension's endpoint-picker protocol, proposal 004):

1. A body on an OpenAI inference path (``POST /v1/chat/completions``, ``/v1/completions``,
   ``/v1/embeddings``, ``/v1/responses``) is parsed with :mod:`inferlb.request.parsing`; a bad one is
   refused 400 ``invalid_request_error`` naming the field. Other paths (``GET /v1/models``...) are picked
   by load alone.
2. The eligible endpoints are the healthy ones (:mod:`epp.pool`), within the subset hint when the gateway
   sent one. None: 503 (also for an empty hint, or one naming no endpoint of the pool).
3. Every eligible endpoint saturated (:func:`epp.pool.saturated`): 429 (shed). With a fair queue
   (:mod:`epp.flow`, ``QueueSettings.max_queued`` > 0) the request waits instead
   (:class:`epp.flow.Waiting`), and so does every request while others wait (no overtaking); saturation
   then reads :meth:`epp.pool.Pool.backlog` (the scrape plus what was sent and ended since).
   :meth:`EndpointPicker.dispatch` admits waiters in the queue's order while the head's eligible endpoints
   have one with room: when a request ends and after each scrape round. A waiter whose eligible endpoints
   are all gone is answered 503. The queue serves its head first: a head whose subset hint names only
   saturated endpoints holds the others back until it is admitted or expires.
4. Otherwise :func:`inferlb.policy.picker.pick` orders them (with a fair queue: the ones with room); the
   first choice enters the in-flight count until the stream ends, moved to the endpoint the gateway reports
   as having served it when that differs.

Prefix indexes (:func:`prefix_index`, ``--prefix-index``): with ``approximate`` or ``precise`` each parsed
request is keyed by :func:`inferlb.request.blocks.prompt_block_keys` (the request path's keys) and the pick
scores the leading blocks each endpoint holds. The approximate index records the keys on the first choice
at the pick and, when the gateway's ``x-gateway-destination-endpoint-served`` report names another
endpoint of the pool, on that one too; the precise one reads the endpoints' vLLM KV events instead (the
subscribers run in :mod:`epp.__main__`).

The model named in the body is not checked against the pool: the gateway's route chose the pool.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Final, Literal

import msgspec

from epp.flow import (
    FlowControl,
    QueueFull,
    QueueSettings,
    Waiting,
    fairness_id,
    request_cost,
    request_priority,
)
from epp.metrics import EppMetrics
from epp.pool import Pool, Saturation, saturated
from inferlb.errors import RequestError
from inferlb.policy.picker import EndpointState, NoPrefixIndex, PickerWeights, PrefixIndex, pick
from inferlb.policy.prefix_indexes import make_prefix_index
from inferlb.request.blocks import DEFAULT_BLOCK_SIZE, prompt_block_keys
from inferlb.request.parsing import INFERENCE_PATHS, InferenceRequest, parse_request

#: ``error.code`` of the 503 when no endpoint is eligible.
NO_ENDPOINT_CODE: Final = "no_endpoint_available"
#: ``error.code`` of the 429 when every eligible endpoint is saturated.
SATURATED_CODE: Final = "pool_saturated"
#: ``error.code`` of the 429 when the fair queue is full.
QUEUE_FULL_CODE: Final = "queue_full"
#: ``error.code`` of the 429 after the longest wait in the fair queue.
QUEUE_TIMEOUT_CODE: Final = "queue_timeout"
#: The picker's weights by default: the picker core's, with one host per pick, since an ORIGINAL_DST cluster
#: (the Gateway API Inference Extension's reference gateway config) takes exactly one ``ip:port`` from the
#: header (Envoy 1.40 answered a list with 503 "no healthy upstream"); a gateway that walks the list
#: (Envoy's ``override_host`` policy) can take more.
DEFAULT_EPP_WEIGHTS: Final = PickerWeights(max_hosts=1)
#: ``retry-after`` of a 429 shed (seconds): a couple of scrape intervals, when the queues may have drained.
SHED_RETRY_AFTER_S: Final = 1


#: The EPP's ``--prefix-index`` modes: none, learnt from its own picks, or rebuilt from KV events.
PrefixMode = Literal["off", "approximate", "precise"]
PREFIX_MODES: Final[tuple[PrefixMode, ...]] = ("off", "approximate", "precise")


def prefix_index(mode: PrefixMode = "off", *, block_size: int = DEFAULT_BLOCK_SIZE) -> PrefixIndex:
    """The prefix index the EPP's picks consult, built as the request path builds its own
    (:func:`inferlb.policy.prefix_indexes.make_prefix_index`): ``off``,
    :class:`~inferlb.policy.picker.NoPrefixIndex` (picks by load and KV usage alone); ``approximate``, an
    :class:`~inferlb.policy.prefix_index.ApproximatePrefixIndex` learnt from the EPP's own picks;
    ``precise``, an empty :class:`~inferlb.policy.kv_index.PreciseKvIndex` of ``block_size``-token blocks,
    which the KV-event subscribers of :mod:`epp.__main__` feed.

    Raises:
        ValueError: an unknown ``mode``, or ``block_size < 1``.
    """
    if mode not in PREFIX_MODES:
        raise ValueError(f"prefix index mode must be one of {PREFIX_MODES}, got {mode!r}")
    return make_prefix_index(mode, block_size=block_size)


def block_keys(request: InferenceRequest | None, *, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[int, ...]:
    """The request's prompt block keys for the prefix index: :func:`inferlb.request.blocks.prompt_block_keys`
    (the request path's keys, over the prompt's ids as gpusim lays them out) at ``block_size``; none for a
    request without a parsed body (``GET /v1/models``, a body the gateway does not show)."""
    if request is None:
        return ()
    return prompt_block_keys(request, block_size=block_size)


class RequestSeen(msgspec.Struct, frozen=True, kw_only=True):
    """What the EPP learnt of one request from its ext_proc stream.

    Attributes:
        method: ``:method``.
        path: ``:path`` without its query string.
        body: the whole request body (bytes; empty without one).
        subset: the gateway's subset hint (``ip:port`` values), None when it sent none.
        body_read: False when the gateway's processing mode shows the EPP no body before the pick
            (``NONE``, or ``STREAMED``, where the headers must be answered first): nothing is parsed.
        fairness_id: the ``x-gateway-inference-fairness-id`` header, None without one.
        objective: the ``x-gateway-inference-objective`` header, None without one.
        priority: the ``x-inferlb-priority`` header, None without one.
    """

    method: str
    path: str
    body: bytes = b""
    subset: tuple[str, ...] | None = None
    body_read: bool = True
    fairness_id: str | None = None
    objective: str | None = None
    priority: str | None = None


class Routed(msgspec.Struct, frozen=True, kw_only=True):
    """Send the request to ``endpoints`` (first choice first, then the fallback order).

    Attributes:
        endpoints: ``ip:port`` values, first choice first.
        keys: the prompt's block keys the pick matched (empty without a prefix index): recorded again on
            the endpoint the gateway reports as having served the request when that is another.
    """

    endpoints: tuple[str, ...]
    keys: tuple[int, ...] = ()

    @property
    def value(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: ``ip:port[,ip:port...]``."""
        return ",".join(self.endpoints)


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    """Answer the client now with an OpenAI-style error; nothing goes upstream.

    Attributes:
        status: HTTP status (400, 413, 429, 503, 500).
        body: the OpenAI error JSON.
        headers: response headers (``content-type``, ``retry-after``).
        details: Envoy's ``%RESPONSE_CODE_DETAILS%`` for its access log.
    """

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...]
    details: str


def refused(err: RequestError, details: str) -> Refused:
    """``err`` as a :class:`Refused` (its status, OpenAI JSON body, ``retry-after`` when it carries one)."""
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
    if err.retry_after_s is not None:
        headers = (*headers, ("retry-after", str(max(1, round(err.retry_after_s)))))
    return Refused(
        status=err.status, body=msgspec.json.encode(err.to_openai_json()), headers=headers, details=details
    )


def internal_error() -> Refused:
    """The 500 answered when the EPP itself failed on a message (never a bare stream abort)."""
    return refused(
        RequestError(
            500, "The endpoint picker failed to process the request; it was not sent.", type="server_error"
        ),
        "inferlb_epp_internal_error",
    )


def body_too_large(limit: int) -> Refused:
    """The 413 of a request body over ``limit`` bytes."""
    return refused(
        RequestError(
            413,
            f"The request body is larger than the endpoint picker accepts ({limit} bytes).",
            type="invalid_request_error",
            code="request_too_large",
        ),
        "inferlb_epp_body_too_large",
    )


class EndpointPicker:
    """Decides requests over ``pool``'s live state.

    Args:
        pool: the endpoints and their live state.
        metrics: where picks, outcomes and served reports are counted.
        weights: :func:`~inferlb.policy.picker.pick`'s score weights and load guard
            (:data:`DEFAULT_EPP_WEIGHTS`).
        saturation: when an endpoint counts as saturated (429 when all eligible ones are).
        index: the prefix index (:func:`prefix_index`; default ``off``, no index).
        block_size: tokens per prompt block of the index's keys (vLLM's ``--block-size``; >= 1).
        salt: tie-break salt (a per-process random value by default, so replicas do not herd).
        queue: the fair queue's settings; None or ``max_queued`` 0: no queue (429 at once when saturated).
            With one, the picker must be used from the event loop serving the streams.
    """

    def __init__(
        self,
        pool: Pool,
        metrics: EppMetrics,
        *,
        weights: PickerWeights = DEFAULT_EPP_WEIGHTS,
        saturation: Saturation | None = None,
        index: PrefixIndex | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        salt: bytes | None = None,
        queue: QueueSettings | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.metrics = metrics
        self.weights = weights
        self.saturation = saturation if saturation is not None else Saturation()
        self.index = index if index is not None else prefix_index()
        self.block_size = block_size
        #: False with no index: no request is keyed (the keys would match nothing)
        self.keyed = not isinstance(self.index, NoPrefixIndex)
        self.salt = salt if salt is not None else os.urandom(16)
        self.flow: FlowControl | None = None
        if queue is not None and queue.max_queued > 0:
            self.flow = FlowControl(queue, metrics, on_expired=self._expired, clock=pool.clock)

    def decide(self, seen: RequestSeen) -> Routed | Refused | Waiting:
        """Route ``seen``, refuse it, or (with a fair queue) let it wait (see the module doc); a routed
        request is counted in flight on its first choice until :meth:`finished`."""
        request: InferenceRequest | None = None
        kind = INFERENCE_PATHS.get(seen.path)
        if kind is not None and seen.method == "POST" and seen.body_read:
            try:
                request = parse_request(kind, seen.body)
            except RequestError as err:
                return self._refuse(refused(err, "inferlb_epp_bad_request"))
        flow = self.flow
        priority = 0
        if flow is not None:
            try:
                priority = request_priority(seen, flow.settings.objectives)
            except RequestError as err:
                return self._refuse(refused(err, "inferlb_epp_bad_priority"))
        eligible = self._eligible(seen.subset)
        if not eligible:
            return self._refuse(self._no_endpoint(seen.subset))
        if flow is not None:
            if not len(flow):
                room = self._room(eligible)
                if room:
                    return self._route(request, room)
            try:
                waiting = flow.enqueue(
                    priority=priority,
                    fairness_id=fairness_id(seen),
                    cost_tokens=request_cost(request, default_max_tokens=flow.settings.default_max_tokens),
                    subset=seen.subset,
                    request=request,
                )
            except QueueFull:
                self.metrics.queue_full.inc()
                return self._refuse(
                    refused(
                        RequestError(
                            429,
                            "Every model server endpoint that could take the request is saturated and "
                            f"{flow.settings.max_queued} requests already wait; retry later.",
                            type="rate_limit_error",
                            code=QUEUE_FULL_CODE,
                            retry_after_s=SHED_RETRY_AFTER_S,
                        ),
                        "inferlb_epp_queue_full",
                    )
                )
            self.dispatch()
            return waiting
        if all(saturated(s, self.saturation) for s in eligible):
            return self._refuse(
                refused(
                    RequestError(
                        429,
                        "Every model server endpoint that could take the request is saturated; retry later.",
                        type="rate_limit_error",
                        code=SATURATED_CODE,
                        retry_after_s=SHED_RETRY_AFTER_S,
                    ),
                    "inferlb_epp_shed",
                )
            )
        return self._route(request, eligible)

    def _eligible(self, hint: tuple[str, ...] | None) -> list[EndpointState]:
        subset: Collection[str] | None = None if hint is None else frozenset(hint)
        return [s for s in self.pool.snapshot() if s.healthy and (subset is None or s.address in subset)]

    def _no_endpoint(self, hint: tuple[str, ...] | None) -> Refused:
        where = " in the gateway's subset hint" if hint is not None else ""
        return refused(
            RequestError(
                503,
                f"No model server endpoint{where} is ready to take the request.",
                type="server_error",
                code=NO_ENDPOINT_CODE,
            ),
            "inferlb_epp_no_endpoint",
        )

    def _room(self, eligible: list[EndpointState]) -> list[EndpointState]:
        backlog = self.pool.backlog
        return [s for s in eligible if not saturated(s, self.saturation, waiting=backlog(s.address))]

    def _expired(self) -> Refused:
        assert self.flow is not None
        return self._refuse(
            refused(
                RequestError(
                    429,
                    f"The request waited {self.flow.settings.max_wait_s:g} s for a model server endpoint "
                    "with room and none had any; retry later.",
                    type="rate_limit_error",
                    code=QUEUE_TIMEOUT_CODE,
                    retry_after_s=SHED_RETRY_AFTER_S,
                ),
                "inferlb_epp_queue_timeout",
            )
        )

    def dispatch(self) -> None:
        """Admit waiting requests in the fair queue's order while the head's eligible endpoints have one with
        room (:meth:`epp.pool.Pool.backlog`); a head with no eligible endpoint left is answered 503. A no-op
        without a queue. Called when a request ends, after each scrape round and after each enqueue."""
        flow = self.flow
        if flow is None:
            return
        while (head := flow.head()) is not None:
            eligible = self._eligible(head.subset)
            if not eligible:
                flow.take_head(self._refuse(self._no_endpoint(head.subset)), "unavailable")
                continue
            room = self._room(eligible)
            if not room:
                return
            flow.take_head(self._route(head.request, room), "admitted")

    def abandon(self, waiting: Waiting) -> Routed | Refused | None:
        """``waiting``'s stream ended before its answer went: it leaves the queue. Returns the decision when
        one was made already (a routed one holds an in-flight count the caller releases)."""
        return self.flow.abandon(waiting) if self.flow is not None else None

    def _route(self, request: InferenceRequest | None, eligible: list[EndpointState]) -> Routed:
        keys = block_keys(request, block_size=self.block_size) if self.keyed else ()
        matched: Mapping[str, int] = (
            self.index.matched_blocks(keys, [s.address for s in eligible]) if keys else {}
        )
        chosen = pick(
            eligible,
            prompt_blocks=len(keys),
            matched_blocks=matched,
            weights=self.weights,
            salt=self.salt,
            # a miss priced in tokens to prefill: the keyed blocks' tokens (the prompt less its partial
            # last block; the EPP counts no tokens on its path)
            prompt_tokens=len(keys) * self.block_size,
            block_tokens=self.block_size,
        )
        first = chosen[0]
        if keys:
            # recorded at the pick, so a repeat arriving before this one's answer finds it
            self.index.record_pick(first, keys)
        self.pool.enter(first)
        self.metrics.picks.labels(first).inc()
        self.metrics.requests.labels("routed").inc()
        return Routed(endpoints=chosen, keys=keys)

    def _refuse(self, reply: Refused) -> Refused:
        self.metrics.requests.labels(str(reply.status)).inc()
        return reply

    def count_refusal(self, reply: Refused) -> None:
        """Count a refusal decided outside :meth:`decide` (413, 500)."""
        self._refuse(reply)

    def served(self, routed: Routed, served: str | None) -> str:
        """The gateway reported ``served`` (None: it reported nothing) for ``routed``: counted by how it
        compares with the pick (``first``, ``fallback``, ``other``, ``unreported``), and the in-flight
        count moved to ``served`` when that is another endpoint of the pool, and the prompt's block keys
        recorded there too (an approximate index learns where the prompt was cached; the first choice's
        record, made at the pick, stays until evicted). Returns the address now holding the request's
        in-flight count (pass it to :meth:`finished`)."""
        first = routed.endpoints[0]
        if served is None:
            match = "unreported"
        elif served == first:
            match = "first"
        elif served in routed.endpoints:
            match = "fallback"
        else:
            match = "other"
        in_pool = served is not None and served in self.pool
        self.metrics.served.labels(served if in_pool else first, match).inc()
        if served is not None and in_pool and served != first:
            if routed.keys:
                self.index.record_pick(served, routed.keys)
            self.pool.leave(first)
            self.pool.enter(served)
            self.dispatch()  # the pick's room on the first choice is free again
            return served
        return first

    def finished(self, address: str) -> None:
        """The request counted in flight on ``address`` ended (its room goes to the fair queue's head)."""
        self.pool.leave(address)
        self.dispatch()
