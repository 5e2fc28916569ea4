"""The grpcio aio adapter between Envoy's ext_proc stream and :mod:`ext_proc.handlers`.

One ``Process`` stream carries one HTTP request: request headers, then (BUFFERED) the whole body, then,
when ``ext_proc.account_responses`` is on, the response headers (SEND) and the response body: STREAMED
chunk by chunk for an SSE stream or a large or unsized answer, one BUFFERED message for a JSON answer that
fits Envoy's buffer, none for a non-2xx answer (``mode_override`` in the answer to the response headers),
and response trailers if Envoy is configured to send them. Each message gets exactly one answer: a
headers/body response that continues (with header or body mutations) or an ``ImmediateResponse``.

A request body message after the request body was answered (a repeated end-of-stream message, empty or
the same body again) is answered with a plain continue and logged once per stream: it is never parsed or
admitted again.

Quota accounting per stream: admission takes a reservation (and a concurrency lease) from the
:class:`~inferlb.policy.quota.QuotaStore`, within the body's budget (90% of Envoy's ``message_timeout``,
:data:`ext_proc.handlers.ADMIT_BUDGET_FRACTION`); a :class:`~inferlb.request.usage.ResponseMeter` follows the
response, and the reservation is settled with the real usage exactly once: at the end of the response body, at
the response trailers, or, when the stream ends first (client abort, upstream reset, Envoy timeout), with
what was produced so far. A settlement that has to wait for the store (Redis) after the stream was
cancelled runs as a tracked task (:meth:`ExternalProcessor.drain` waits for them), and so does a Redis
admission the cancellation cut: it runs on, and a lease it took is released at once. Every way a stream
ends (response end, client abort, gRPC cancel, an error) releases its lease; one lost anyway expires
after ``ext_proc.lease_ttl_ms``.

Low-priority shedding (:mod:`inferlb.policy.shedding`): before quota admission the request's version is
picked, and a ``default`` or ``low`` tenant's request enters the in-flight count of that version's cluster
(:attr:`ExtProcState.in_flight`) unless it is ``low`` and the count reached the cluster's limit (then 503
``overloaded``, :func:`ext_proc.handlers.shed_low_priority`); it leaves the count when its reservation is
settled, which every way a stream ends does exactly once (a quota refusal or a cancelled admission leaves at
once).

Endpoint picking with ``endpoint_picking.queue``: a request whose endpoints are all saturated waits in its
model's fair queue (:class:`~ext_proc.picking.PickQueue`) before quota admission, holding back its body's
answer (Envoy's ``message_timeout`` bounds it: ``max_wait_ms`` is at most half of it); the stream's end
takes it out of the queue.

Envoy resets the stream after the last message it needs; grpc aio turns that into a cancellation of this
coroutine, which is normal and not logged. After the answer Envoy needs last (the response's end, or an
immediate response) the stream neither reads nor ends: it waits for that reset (:data:`RESET_WAIT_S`), so
grpcio aio has no batch in flight to leak when it lands.

A bug in a handler answers 500 with an OpenAI ``server_error`` body rather than aborting the stream (which
Envoy would turn into a bare 500 without a body).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2

from ext_proc import handlers
from ext_proc.picking import PickWaiter, choose, wait_for_pick
from ext_proc.state import OFFLOAD_BODY_BYTES, ExtProcState
from inferlb.config.schema import GatewayConfig
from inferlb.policy.class_guard import ClassHold
from inferlb.policy.quota import Admitted, Refused
from inferlb.policy.settlement import COMPLETION_TOKENS_KEY, PROMPT_TOKENS_KEY, USAGE_NAMESPACE
from inferlb.policy.shedding import counted
from inferlb.request import headers as h
from inferlb.request.usage import ResponseMeter, Usage, UsageSource

log = logging.getLogger("ext_proc")


#: After answering the message Envoy needs last (the response's end, or an immediate response), a stream
#: waits this long for Envoy's reset before it ends itself with OK (seconds). Envoy resets the ext_proc
#: stream as soon as it has its last answer, and grpc aio then cancels the waiting coroutine: nothing more
#: is sent. Ending at once instead sends a final status that races the reset, and in grpcio aio a status
#: batch that loses (it fails on the reset stream) never frees its native op array: ~40 bytes of RSS per
#: request at 180 req/s (bench/soak.py, bench/extproc_stream_end.py). A client that half-closes and waits
#: for the status (not Envoy) gets it after this wait.
RESET_WAIT_S = 2.0

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

#: Room above the body limit for what a ``ProcessingRequest``/``ProcessingResponse`` carries besides the
#: body: the protobuf envelope, the response's header mutations and the few bytes the request body
#: rewrite adds (the canonical model name for an alias, ``include_usage``) (bytes). Headers travel in
#: their own message, bounded by Envoy's max_request_headers_kb (60 KiB by default), well inside this.
GRPC_ENVELOPE_HEADROOM_BYTES = 1024 * 1024


def _config_body_limit_max() -> int:
    # the schema's own upper bound for gateway.max_request_body_bytes, so the two never drift apart
    for item in GatewayConfig.model_fields["max_request_body_bytes"].metadata:
        le = getattr(item, "le", None)
        if isinstance(le, int):
            return le
    raise RuntimeError("gateway.max_request_body_bytes has no upper bound in the config schema")


#: The largest ``gateway.max_request_body_bytes`` a config may set (bytes, 64 MiB).
MAX_CONFIGURABLE_BODY_BYTES = _config_body_limit_max()


def grpc_message_limit_bytes(max_body_bytes: int = MAX_CONFIGURABLE_BODY_BYTES) -> int:
    """gRPC receive/send message limit (bytes) for a server that must carry ``max_body_bytes`` bodies.

    gRPC's default is 4 MiB each way, so a request body just under a 4 MiB ``max_request_body_bytes``
    plus its ``ProcessingRequest`` envelope was refused by grpc itself ("Received message larger than
    max") and Envoy answered a bare 500.
    """
    return max_body_bytes + GRPC_ENVELOPE_HEADROOM_BYTES


def make_server(max_body_bytes: int = MAX_CONFIGURABLE_BODY_BYTES) -> grpc.aio.Server:
    """A grpc aio server whose message limits fit ``max_body_bytes`` bodies (see
    :func:`grpc_message_limit_bytes`).

    The default sizes the server for the largest body any config may allow, so a config reload that raises
    ``gateway.max_request_body_bytes`` never outgrows the running server (the limit is a cap, not a buffer:
    nothing is allocated up front).
    """
    limit = grpc_message_limit_bytes(max_body_bytes)
    return grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
    )


# -- proto builders -------------------------------------------------------------------------------
def _header_option(name: str, value: str) -> base_pb2.HeaderValueOption:
    # Envoy >= 1.27 reads header values from raw_value (runtime guard send_header_raw_value)
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


#: Headers whose values come from the config (model, version, tenant, priority names) or a fixed set (the
#: length class), so the set of (name, value) pairs is bounded: their ``HeaderValueOption`` is built once
#: and copied into each response (a copy costs well under a third of building one from keyword arguments).
_CONFIG_VALUED_HEADERS: frozenset[str] = frozenset({h.MODEL, h.VERSION, h.TENANT, h.PRIORITY, h.LENGTH_CLASS})
#: Entries of the option cache before it is emptied (a reload that renames models and tenants many times
#: over must not grow it without bound).
_OPTION_CACHE_ENTRIES = 4096
_option_cache: dict[tuple[str, str], base_pb2.HeaderValueOption] = {}


def _header_options(pairs: tuple[tuple[str, str], ...]) -> list[base_pb2.HeaderValueOption]:
    out = []
    for name, value in pairs:
        if name in _CONFIG_VALUED_HEADERS:
            option = _option_cache.get((name, value))
            if option is None:
                if len(_option_cache) >= _OPTION_CACHE_ENTRIES:
                    _option_cache.clear()
                option = _option_cache[(name, value)] = _header_option(name, value)
            out.append(option)
        else:
            out.append(_header_option(name, value))
    return out


def immediate_response(reply: handlers.ImmediateReply) -> ep.ProcessingResponse:
    """The ``ProcessingResponse`` carrying ``reply`` as an ``ImmediateResponse``."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=ep.HeaderMutation(set_headers=[_header_option(k, v) for k, v in reply.headers]),
            body=reply.body,
            details=reply.details,
        )
    )


def _common(
    *,
    set_headers: tuple[tuple[str, str], ...] = (),
    remove: tuple[str, ...] = (),
    clear_route_cache: bool = False,
) -> ep.CommonResponse:
    if not (set_headers or remove):
        return ep.CommonResponse(clear_route_cache=clear_route_cache)
    return ep.CommonResponse(
        clear_route_cache=clear_route_cache,
        header_mutation=ep.HeaderMutation(set_headers=_header_options(set_headers), remove_headers=remove),
    )


# Answers that never vary are built once: grpc only serializes a response, it never changes it.
_HEADERS_CONTINUE = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=_common()))
_REQUEST_BODY_CONTINUE = ep.ProcessingResponse(request_body=ep.BodyResponse())
_RESPONSE_HEADERS_CONTINUE = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
_RESPONSE_HEADERS_KEEP_LENGTH = ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=_common()))
_RESPONSE_HEADERS_DROP_LENGTH = ep.ProcessingResponse(
    response_headers=ep.HeadersResponse(response=_common(remove=("content-length",)))
)
_RESPONSE_BODY_CONTINUE = ep.ProcessingResponse(response_body=ep.BodyResponse())
_REQUEST_TRAILERS_CONTINUE = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
_RESPONSE_TRAILERS_CONTINUE = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


_Mode = processing_mode_pb2.ProcessingMode


def _override(
    *, request_body: int, response_headers: int, response_body: int
) -> processing_mode_pb2.ProcessingMode:
    """A ``mode_override``: request headers SEND and trailers SKIP (as the gateway configures), the rest
    as given."""
    return processing_mode_pb2.ProcessingMode(
        request_header_mode=_Mode.SEND,
        response_header_mode=response_headers,
        request_body_mode=request_body,
        response_body_mode=response_body,
        request_trailer_mode=_Mode.SKIP,
        response_trailer_mode=_Mode.SKIP,
    )


#: ``mode_override`` for a request ext_proc lets through untouched (not an inference path): Envoy sends no
#: request body and no response phases for it (honoured only with the filter's ``allow_mode_override``,
#: which :func:`xds_server.resources.listener.build_listener` sets; Envoy applies an override sent in answer
#: to a headers message and ignores one sent with a body answer).
PASSTHROUGH_MODE = _override(request_body=_Mode.NONE, response_headers=_Mode.SKIP, response_body=_Mode.NONE)
#: ``mode_override`` in the answer to the response headers of a 2xx JSON response whose ``content-length``
#: fits Envoy's buffer (the gateway's ``max_request_body_bytes``, which is also the listener's
#: per-connection buffer limit): Envoy sends its whole body as one message, instead of the body and then an
#: empty end-of-stream chunk as it streams an HTTP/1.1 upstream's body (measured on Envoy 1.40).
BUFFERED_RESPONSE_BODY_MODE = _override(
    request_body=_Mode.BUFFERED, response_headers=_Mode.SEND, response_body=_Mode.BUFFERED
)
#: ``mode_override`` in the answer to the response headers of a response that is charged nothing (a
#: non-2xx status): Envoy sends none of its body, saving a message per body chunk.
NO_RESPONSE_BODY_MODE = _override(
    request_body=_Mode.BUFFERED, response_headers=_Mode.SEND, response_body=_Mode.NONE
)
_RESPONSE_HEADERS_BUFFER_BODY = ep.ProcessingResponse(
    response_headers=ep.HeadersResponse(response=_common()), mode_override=BUFFERED_RESPONSE_BODY_MODE
)
_PASSTHROUGH_CONTINUE = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(response=_common()), mode_override=PASSTHROUGH_MODE
)


def headers_continue(remove: tuple[str, ...]) -> ep.ProcessingResponse:
    """Continue after the request headers, removing the named headers."""
    if not remove:
        return _HEADERS_CONTINUE
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=_common(remove=remove)))


def body_continue(decision: handlers.ContinueRequest) -> ep.ProcessingResponse:
    """Continue after the request body with the decision's header changes, route-cache clearing and, when
    the body was rewritten, the new body (its ``content-length`` is among the header changes)."""
    common = _common(
        set_headers=decision.set_headers,
        remove=decision.remove_headers,
        clear_route_cache=decision.clear_route_cache,
    )
    if decision.body is not None:
        common.body_mutation.CopyFrom(ep.BodyMutation(body=decision.body))
    out = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
    if decision.destination is not None:
        # the endpoint-picker protocol's metadata, beside its header: Envoy's override_host reads either
        # (the ext_proc filter accepts this namespace: listener metadata_options.receiving_namespaces)
        out.dynamic_metadata.update(
            {h.DESTINATION_ENDPOINT_NAMESPACE: {h.DESTINATION_ENDPOINT: decision.destination}}
        )
    return out


def passthrough_continue(remove: tuple[str, ...]) -> ep.ProcessingResponse:
    """Continue after the request headers of a request let through untouched, removing the named headers,
    with :data:`PASSTHROUGH_MODE` so Envoy sends nothing more of this request or its response."""
    if not remove:
        return _PASSTHROUGH_CONTINUE
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=_common(remove=remove)), mode_override=PASSTHROUGH_MODE
    )


_RESPONSE_HEADERS_NO_BODY = ep.ProcessingResponse(
    response_headers=ep.HeadersResponse(response=_common()), mode_override=NO_RESPONSE_BODY_MODE
)


def response_headers_continue(*, remove_content_length: bool) -> ep.ProcessingResponse:
    """Continue after the response headers; drop ``content-length`` when the body will be rewritten."""
    return _RESPONSE_HEADERS_DROP_LENGTH if remove_content_length else _RESPONSE_HEADERS_KEEP_LENGTH


def response_body_continue(chunk: bytes, out: bytes) -> ep.ProcessingResponse:
    """Continue after one response body chunk, replacing it with ``out`` when it differs."""
    if out == chunk:
        return _RESPONSE_BODY_CONTINUE
    common = ep.CommonResponse()
    common.body_mutation.CopyFrom(ep.BodyMutation(body=out))
    return ep.ProcessingResponse(response_body=ep.BodyResponse(response=common))


def with_usage_metadata(reply: ep.ProcessingResponse, usage: Usage) -> ep.ProcessingResponse:
    """A copy of ``reply`` carrying the answer's reported usage as dynamic metadata ``inferlb.meter`` /
    ``prompt_tokens``, ``completion_tokens`` (numbers), the keys Envoy's metering Lua filter writes in
    ext_authz mode, for the gateway's JSON access log (``gateway.access_log``; the listener's ext_proc
    filter accepts the namespace: ``metadata_options.receiving_namespaces``)."""
    out = ep.ProcessingResponse()
    out.CopyFrom(reply)
    out.dynamic_metadata.update(
        {
            USAGE_NAMESPACE: {
                PROMPT_TOKENS_KEY: usage.prompt_tokens,
                COMPLETION_TOKENS_KEY: usage.completion_tokens,
            }
        }
    )
    return out


def header_map(msg: ep.HttpHeaders) -> dict[str, str]:
    """Envoy's header list as a dict of lower-case name -> value (``raw_value`` preferred; for a repeated
    name the last value wins, which is enough for the single-valued headers read here)."""
    out: dict[str, str] = {}
    for hv in msg.headers.headers:
        raw = hv.raw_value
        out[hv.key.lower()] = raw.decode("utf-8", "replace") if raw else hv.value
    return out


def response_status_and_type(msg: ep.HttpHeaders) -> tuple[str, str, str]:
    """The ``:status``, ``content-type`` and ``content-length`` values of a response header list, read as
    :func:`header_map` reads them (names case-insensitive, ``raw_value`` preferred, last value wins; "" when
    absent) without decoding the other headers."""
    status = content_type = content_length = ""
    for hv in msg.headers.headers:
        name = hv.key.lower()
        if name in _RESPONSE_HEADERS_READ:
            raw = hv.raw_value
            value = raw.decode("utf-8", "replace") if raw else hv.value
            if name == ":status":
                status = value
            elif name == "content-type":
                content_type = value
            else:
                content_length = value
    return status, content_type, content_length


_RESPONSE_HEADERS_READ: frozenset[str] = frozenset({":status", "content-type", "content-length"})


_INTERNAL_ERROR = handlers.ImmediateReply(
    status=500,
    body=json.dumps(
        {
            "error": {
                "message": "The gateway failed to process the request; it was not sent to a model server.",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    ).encode(),
    headers=(("content-type", "application/json"),),
    details="inferlb_ext_proc_internal_error",
)


class RateLimitedLog:
    """Emit at most one log record per ``interval_s`` (seconds); the records held back in between are
    counted and reported with the next one, so a burst of timeouts cannot flood the log.

    Args:
        logger: where records go.
        interval_s: least seconds between two records.
        clock: monotonic seconds (injected for tests).
    """

    def __init__(
        self, logger: logging.Logger, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self._held = 0

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless one was logged less than ``interval_s`` ago; returns True
        when it was logged."""
        now = self._clock()
        if now < self._next:
            self._held += 1
            return False
        held, self._held = self._held, 0
        self._next = now + self._interval_s
        suffix = f" (+{held} more like it not logged)" if held else ""
        self._log.log(level, msg + suffix, *args)
        return True


class _Exchange:
    """Per-stream state: what the headers phase learned, and the admitted request's meter."""

    __slots__ = (
        "admitted",
        "body_seen",
        "decided",
        "in_flight",
        "late_body_logged",
        "length",
        "meter",
        "model",
        "passthrough",
        "pending",
        "picked",
        "settled",
        "started",
    )

    def __init__(self) -> None:
        #: monotonic seconds when the request headers arrived
        self.started = 0.0
        #: the request phases are answered (continued upstream or refused)
        self.decided = False
        #: a non-inference path let through: later request messages get a plain continue
        self.passthrough = False
        self.pending: handlers.PendingRequest | None = None
        self.admitted: Admitted | None = None
        self.meter: ResponseMeter | None = None
        self.model = ""
        self.settled = False
        #: the cluster whose in-flight count this request holds until it is settled, or None
        self.in_flight: str | None = None
        #: the endpoint whose in-flight count of endpoint picking this request holds until it is settled
        self.picked: str | None = None
        #: the length class's in-flight hold of a length-aware model's request, released at its settlement
        self.length: ClassHold | None = None
        #: the request body was answered: a body message after it is late (ignored, never re-admitted)
        self.body_seen = False
        self.late_body_logged = False


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # generated, untyped
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over :mod:`ext_proc.handlers`.

    Args:
        state: what the streams are served from.
        offload_body_bytes: request bodies at least this large (bytes) are parsed and counted in a worker
            thread.
        reset_wait_s: after the answer Envoy needs last, how long a stream waits for Envoy's reset before
            it ends itself with OK (seconds; :data:`RESET_WAIT_S`).
    """

    def __init__(
        self,
        state: ExtProcState,
        *,
        offload_body_bytes: int = OFFLOAD_BODY_BYTES,
        reset_wait_s: float = RESET_WAIT_S,
    ) -> None:
        self.state = state
        self.offload_body_bytes = offload_body_bytes
        self.reset_wait_s = reset_wait_s
        self._settling: set[asyncio.Future[Any]] = set()
        self._gave_up_log = RateLimitedLog(log)
        self._budget_log = RateLimitedLog(log)
        self._unknown_log = RateLimitedLog(log)

    async def drain(self) -> None:
        """Wait for settlements (and admissions cut by a cancelled stream) still running after their streams
        ended."""
        while self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    async def _await_reset(self) -> None:
        # no read, no write and no status in flight: grpc aio cancels this coroutine when Envoy's reset
        # arrives, and the stream ends without sending anything (RESET_WAIT_S says why)
        await asyncio.sleep(self.reset_wait_s)

    def _track(self, work: Coroutine[Any, Any, Any] | asyncio.Future[Any]) -> asyncio.Future[Any]:
        """Run ``work`` to its end whatever happens to the stream that started it; :meth:`drain` waits."""
        task = asyncio.ensure_future(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[ep.ProcessingRequest, ep.ProcessingResponse],
    ) -> None:
        """Answer each ``ProcessingRequest`` of one HTTP request's stream, in order.

        Written against the servicer context's ``read()``/``write()`` rather than as an async generator over
        ``request_iterator``: grpc aio then skips its two async-generator layers per message (one for the
        requests, one for the responses), which were a measurable part of the per-message cost
        (bench/extproc_cpu.py).
        """
        ex = _Exchange()
        metrics = self.state.metrics
        read, write = context.read, context.write
        try:
            while True:
                req = await read()
                if req is grpc.aio.EOF:
                    return
                phase = req.WhichOneof("request")
                started = time.perf_counter()
                try:
                    if phase == "request_headers":
                        out = self._on_headers(ex, req.request_headers)
                    elif phase == "request_body":
                        out = await self._on_body(ex, req.request_body)
                    elif phase == "response_headers":
                        out = self._on_response_headers(ex, req.response_headers)
                        if out is _RESPONSE_HEADERS_NO_BODY:
                            # a non-2xx response is charged nothing whatever its body says
                            # (inferlb.request.usage.ResponseMeter.finish): settle now, no body will come
                            await self._finish(ex, aborted=False)
                    elif phase == "response_body":
                        out = await self._on_response_body(ex, req.response_body)
                    elif phase == "request_trailers":
                        out = _REQUEST_TRAILERS_CONTINUE
                    elif phase == "response_trailers":
                        await self._finish(ex, aborted=False)
                        out = _RESPONSE_TRAILERS_CONTINUE
                    else:
                        log.warning("ext_proc message without a known phase (%r); ignoring it", phase)
                        continue
                except Exception:
                    log.exception("ext_proc failed on a %s message; answering 500", phase)
                    out = immediate_response(_INTERNAL_ERROR)
                metrics.processed(phase, time.perf_counter() - started)
                immediate = out.HasField("immediate_response")
                if immediate or phase == "request_body":
                    ex.decided = True
                last = phase == "response_trailers" or (
                    phase == "response_body" and req.response_body.end_of_stream
                )
                if not (last or immediate):
                    await write(out)
                    continue
                # Envoy resets the stream as soon as this answer reaches it, and the reset can cancel this
                # coroutine before grpc aio hands it the write's completion: a write whose awaiter is
                # cancelled never frees its native batch, so the write runs in a task of its own
                await asyncio.shield(write(out))
                if last:
                    # the exchange's last message (trailers are never sent with the gateway's processing
                    # mode): read no more (a read in flight when Envoy's reset lands leaks in grpcio aio)
                    await self._await_reset()
                    return
                if immediate:
                    if ex.admitted is not None and not ex.settled:
                        # refused after admission (an internal error): nothing went upstream
                        ex.meter = None
                        await self._settle(ex, None, status="500")
                    await self._await_reset()
                    return
        finally:
            if ex.pending is not None and not ex.decided:
                # Envoy gave up on the stream (message_timeout, client gone) before we answered the body
                self._gave_up_log.log(
                    logging.INFO,
                    "ext_proc stream ended before admission finished: tenant %s, %s, %.0f ms after its "
                    "headers",
                    ex.pending.tenant.name,
                    ex.pending.path,
                    (time.monotonic() - ex.started) * 1000,
                )
            if ex.admitted is not None and not ex.settled:
                # the stream ended before the response did (EOF, client abort, gRPC cancel, an error while
                # writing): charge what was produced, release the lease
                self._track(self._finish(ex, aborted=True))

    def _on_headers(self, ex: _Exchange, msg: ep.HttpHeaders) -> ep.ProcessingResponse:
        decision = handlers.on_request_headers(
            self.state.gateway, header_map(msg), end_of_stream=msg.end_of_stream
        )
        if isinstance(decision, handlers.ImmediateReply):
            self._count_reply(decision, tenant="", model="")
            return immediate_response(decision)
        if isinstance(decision, handlers.PassThrough):
            ex.passthrough = ex.decided = True
            return passthrough_continue(decision.remove_headers)
        ex.pending = decision.pending
        ex.started = time.monotonic()
        return headers_continue(decision.remove_headers)

    def _count_reply(self, reply: handlers.ImmediateReply, *, tenant: str, model: str) -> None:
        self.state.metrics.request_ended(tenant, model, str(reply.status))

    async def _on_body(self, ex: _Exchange, msg: ep.HttpBody) -> ep.ProcessingResponse:
        if ex.passthrough:
            return _REQUEST_BODY_CONTINUE
        if ex.body_seen:
            # Envoy sends a BUFFERED body once; another body message after it (an empty end_of_stream one,
            # or the same body again) is not a new request: never parse or admit it again, which refused
            # a valid request 400 or took a second lease that nothing released
            if not ex.late_body_logged and ex.pending is not None:
                ex.late_body_logged = True
                log.warning(
                    "ignoring a request body message after the request body was answered (tenant %s, %s, "
                    "%d bytes, end_of_stream %s); logged once per stream",
                    ex.pending.tenant.name,
                    ex.pending.path,
                    len(msg.body),
                    msg.end_of_stream,
                )
            return _REQUEST_BODY_CONTINUE
        pending = ex.pending
        if pending is None:
            # a body without an accepted headers phase: Envoy is configured to skip headers, which breaks
            # routing (measured on Envoy 1.40); refuse rather than forward unrouted
            log.error("request body received without a request headers phase; check processing_mode")
            return immediate_response(_INTERNAL_ERROR)
        ex.body_seen = True
        state = self.state
        gateway = state.gateway
        body = msg.body
        arrived = time.monotonic()
        # counting stops at the deadline (checked between text segments, also in a queued worker thread)
        deadline = arrived + gateway.counting_budget_s
        if len(body) >= self.offload_body_bytes:
            prepared = await asyncio.to_thread(
                handlers.prepare_body,
                gateway,
                pending,
                body,
                end_of_stream=msg.end_of_stream,
                deadline=deadline,
            )
        else:
            prepared = handlers.prepare_body(
                gateway, pending, body, end_of_stream=msg.end_of_stream, deadline=deadline
            )
        tenant = pending.tenant.name
        if isinstance(prepared, handlers.ImmediateReply):
            if prepared.details == handlers.COUNTING_BUDGET_DETAILS:
                self._budget_log.log(
                    logging.WARNING,
                    "refused a request of tenant %s (%d body bytes): token counting exceeded its %.0f ms "
                    "budget after %.0f ms",
                    tenant,
                    len(body),
                    gateway.counting_budget_s * 1000,
                    (time.monotonic() - arrived) * 1000,
                )
            self._count_reply(prepared, tenant=tenant, model="")
            return immediate_response(prepared)
        if prepared.request.unknown_parts:
            self._unknown_log.log(
                logging.INFO,
                "counted unknown content part types %s by their JSON (tenant %s, %s)",
                ",".join(sorted(set(prepared.request.unknown_parts))),
                tenant,
                pending.path,
            )
        version = handlers.pick_version(gateway, prepared, state.rng)
        cluster = prepared.model.cluster_name(version)
        prepared = state.length.decide(gateway.config, prepared, version)
        held: str | None = None
        if cluster in gateway.low_priority_limits and counted(pending.tenant.priority):
            shed = handlers.shed_low_priority(gateway, prepared, cluster, state.in_flight.get(cluster))
            if shed is not None:
                state.metrics.low_priority_shed.labels(tenant, prepared.model.name).inc()
                self._count_reply(shed, tenant=tenant, model=prepared.model.name)
                return immediate_response(shed)
            # counted before the quota call, so requests admitted meanwhile see this one
            state.in_flight.enter(cluster)
            held = cluster
        picked = choose(state.picking, prepared, cluster, state.metrics, now=time.monotonic())
        if isinstance(picked, PickWaiter):
            # every endpoint saturated: wait in the model's fair queue (the stream's end cancels the wait)
            try:
                picked = await wait_for_pick(picked)
            except BaseException:
                if held is not None:
                    state.in_flight.leave(held)
                raise
        if isinstance(picked, handlers.ImmediateReply):
            if held is not None:
                state.in_flight.leave(held)
            self._count_reply(picked, tenant=tenant, model=prepared.model.name)
            return immediate_response(picked)
        deadline = arrived + gateway.admit_budget_s
        try:
            decision = await self._admit(ex, tenant, prepared.reserved_tokens, deadline=deadline)
        except BaseException:
            if held is not None:
                state.in_flight.leave(held)
            if picked is not None:
                state.picking.leave(picked.held)
            raise
        if isinstance(decision, Refused):
            if held is not None:
                state.in_flight.leave(held)
            if picked is not None:
                state.picking.leave(picked.held)
            reply = handlers.quota_refusal(decision)
            state.metrics.quota_rejections.labels(tenant, decision.limit.value).inc()
            self._count_reply(reply, tenant=tenant, model=prepared.model.name)
            return immediate_response(reply)
        ex.admitted = decision
        ex.in_flight = held
        ex.picked = None if picked is None else picked.held
        ex.model = prepared.model.name
        ex.length = state.length.hold(prepared, cluster)
        cont = handlers.route(
            gateway,
            prepared,
            decision,
            rng=state.rng,
            version=version,
            destination=None if picked is None else picked.header_value,
        )
        if gateway.account_responses and cont.reservation is not None:
            ex.meter = ResponseMeter(cont.reservation, gateway.counters.get(ex.model, gateway.counter))
        else:
            # no response phases will come: the reservation is the charge, the lease ends now
            await self._settle(ex, None, status="forwarded")
        return body_continue(cont)

    async def _admit(self, ex: _Exchange, tenant: str, tokens: int, *, deadline: float) -> Admitted | Refused:
        """``quotas.admit``, shielded from the stream's cancellation: a Redis admission cut mid-call may
        still have taken a lease (the script ran, its answer was still on the way), so when the stream is
        cancelled meanwhile the call runs on (tracked) and an admission it returns is settled at once with
        its reservation (nothing went upstream). An in-process store cannot be cut (``cancel_safe``)."""
        quotas = self.state.quotas
        if quotas.cancel_safe:
            return await quotas.admit(tenant, tokens, deadline=deadline)
        call = self._track(quotas.admit(tenant, tokens, deadline=deadline))
        try:
            decision: Admitted | Refused = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._release_orphan(ex, done))
            raise
        return decision

    def _release_orphan(self, ex: _Exchange, done: asyncio.Future[Any]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        decision = done.result()
        if isinstance(decision, Admitted) and ex.admitted is None:
            ex.admitted = decision
            self._track(self._settle(ex, None, status="aborted"))

    def _on_response_headers(self, ex: _Exchange, msg: ep.HttpHeaders) -> ep.ProcessingResponse:
        meter = ex.meter
        if meter is None or ex.settled:
            return _RESPONSE_HEADERS_CONTINUE
        status_text, content_type, length_text = response_status_and_type(msg)
        try:
            status = int(status_text or "0")
        except ValueError:
            status = 0
        meter.on_headers(status, content_type)
        if not 200 <= status < 300:
            # tell Envoy not to send the body (Process settles the stream on this answer)
            return _RESPONSE_HEADERS_NO_BODY
        if (
            not meter.streaming
            and length_text.isdigit()
            and int(length_text) < self.state.gateway.max_body_bytes
        ):
            # a JSON answer that fits Envoy's buffer: one body message instead of body + empty end chunk
            return _RESPONSE_HEADERS_BUFFER_BODY
        return response_headers_continue(remove_content_length=meter.rewrites_body)

    async def _on_response_body(self, ex: _Exchange, msg: ep.HttpBody) -> ep.ProcessingResponse:
        meter = ex.meter
        if meter is None or ex.settled:
            return _RESPONSE_BODY_CONTINUE
        out = meter.on_body(msg.body, end_of_stream=msg.end_of_stream)
        usage = None
        if msg.end_of_stream or meter.complete:
            usage = await self._finish(ex, aborted=False)
        reply = response_body_continue(msg.body, out)
        if (
            usage is not None
            and usage.source is UsageSource.REPORTED
            and self.state.gateway.config.gateway.access_log is not None
        ):
            reply = with_usage_metadata(reply, usage)
        return reply

    async def _finish(self, ex: _Exchange, *, aborted: bool) -> Usage | None:
        """Settle the stream from its meter (or its reservation); returns the usage settled, if any."""
        meter = ex.meter
        if ex.settled or meter is None:
            if ex.admitted is not None and not ex.settled:
                await self._settle(ex, None, status="aborted" if aborted else "forwarded")
            return None
        usage = meter.finish(aborted=aborted)
        if usage is None:
            return None
        status = "aborted" if usage.aborted or meter.status is None else str(meter.status)
        await self._settle(ex, usage, status=status)
        return usage

    async def _settle(self, ex: _Exchange, usage: Usage | None, *, status: str) -> None:
        """Settle the stream's reservation once: ``usage`` tokens, or the reservation itself when None."""
        admitted = ex.admitted
        if admitted is None or ex.settled:
            return
        ex.settled = True
        if ex.in_flight is not None:
            self.state.in_flight.leave(ex.in_flight)
            ex.in_flight = None
        if ex.picked is not None:
            self.state.picking.leave(ex.picked)
            ex.picked = None
        if ex.length is not None:
            # only a reported usage teaches the predictor: a count or the reservation is not the answer's
            reported = usage if usage is not None and usage.source is UsageSource.REPORTED else None
            self.state.length.release(ex.length, None if reported is None else reported.completion_tokens)
            ex.length = None
        used = admitted.tokens if usage is None else usage.total_tokens
        metrics = self.state.metrics
        tenant, model = admitted.tenant, ex.model
        metrics.request_ended(tenant, model, status)
        if usage is not None:
            metrics.usage_settled.labels(usage.source.value).inc()
            metrics.tokens_charged(tenant, model, usage.prompt_tokens, usage.completion_tokens)
        try:
            await self.state.quotas.settle(admitted, used)
        except Exception:
            log.exception("settling the quota of tenant %r failed", tenant)


def add_to_server(
    server: grpc.aio.Server, state: ExtProcState, *, reset_wait_s: float = RESET_WAIT_S
) -> ExternalProcessor:
    """Register an :class:`ExternalProcessor` over ``state`` on ``server`` and return it (``reset_wait_s``:
    see :class:`ExternalProcessor`)."""
    servicer = ExternalProcessor(state, reset_wait_s=reset_wait_s)
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    return servicer
