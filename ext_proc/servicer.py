"""The grpcio aio adapter between Envoy's ext_proc stream and :mod:`ext_proc.handlers`.

One ``Process`` stream carries one HTTP request: request headers, then (BUFFERED) the whole body. Each
message gets exactly one answer: a headers/body response that continues (with header mutations) or an
``ImmediateResponse``. Response-side messages, which the filter config does not ask for today, are answered
with a plain CONTINUE so a config that sends them never stalls a request.

Envoy resets the stream after the last message it needs; grpc aio turns that into a cancellation of this
coroutine, which is normal and not logged. A bug in a handler answers 500 with an OpenAI ``server_error``
body rather than aborting the stream (which Envoy would turn into a bare 500 without a body).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2

from ext_proc import handlers
from inferlb.config import Config
from inferlb.quota import QuotaBook, limits_from_config

log = logging.getLogger("ext_proc")

#: Bodies at least this large are parsed and counted in a worker thread (tiktoken releases the GIL), so
#: a 4 MB prompt (~0.3-2.5 s of BPE work measured here) does not stall every other stream on the loop.
OFFLOAD_BODY_BYTES = 128 * 1024

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


class ExtProcState:
    """The mutable state one ext_proc process serves from: the current :class:`handlers.Gateway` and the
    tenants' :class:`~inferlb.quota.QuotaBook`.

    Args:
        config: the initial config.
        clock: monotonic seconds (injected for tests).
        rng: randomness for version choice when a request names no user.
    """

    def __init__(
        self,
        config: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.clock = clock
        self.rng = rng or random.Random()
        self.gateway = handlers.Gateway.from_config(config)
        self.quotas = QuotaBook(limits_from_config(config), clock())

    def apply_config(self, config: Config) -> None:
        """Serve ``config`` from now on; quota state of tenants whose limits did not change is kept.

        Streams already past their headers phase finish with the tenant they authenticated as.
        """
        gateway = handlers.Gateway.from_config(config, self.gateway.counter)
        self.quotas.update_limits(limits_from_config(config), self.clock())
        self.gateway = gateway


# -- proto builders -------------------------------------------------------------------------------
def _header_option(name: str, value: str) -> base_pb2.HeaderValueOption:
    # Envoy >= 1.27 reads header values from raw_value (runtime guard send_header_raw_value)
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


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
    common = ep.CommonResponse(clear_route_cache=clear_route_cache)
    if set_headers or remove:
        common.header_mutation.CopyFrom(
            ep.HeaderMutation(
                set_headers=[_header_option(k, v) for k, v in set_headers], remove_headers=list(remove)
            )
        )
    return common


def headers_continue(remove: tuple[str, ...]) -> ep.ProcessingResponse:
    """Continue after the request headers, removing the named headers."""
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=_common(remove=remove)))


def body_continue(decision: handlers.ContinueRequest) -> ep.ProcessingResponse:
    """Continue after the request body with the decision's header changes and route-cache clearing."""
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=_common(
                set_headers=decision.set_headers,
                remove=decision.remove_headers,
                clear_route_cache=decision.clear_route_cache,
            )
        )
    )


def header_map(msg: ep.HttpHeaders) -> dict[str, str]:
    """Envoy's header list as a dict of lower-case name -> value (``raw_value`` preferred; for a repeated
    name the last value wins, which is enough for the single-valued headers read here)."""
    out: dict[str, str] = {}
    for hv in msg.headers.headers:
        raw = hv.raw_value
        out[hv.key.lower()] = raw.decode("utf-8", "replace") if raw else hv.value
    return out


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


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # generated, untyped
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over :mod:`ext_proc.handlers`."""

    def __init__(self, state: ExtProcState, *, offload_body_bytes: int = OFFLOAD_BODY_BYTES) -> None:
        self.state = state
        self.offload_body_bytes = offload_body_bytes

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[ep.ProcessingRequest, ep.ProcessingResponse],
    ) -> AsyncIterator[ep.ProcessingResponse]:
        """Answer each ``ProcessingRequest`` of one HTTP request's stream, in order."""
        pending: handlers.PendingRequest | None = None
        async for req in request_iterator:
            phase = req.WhichOneof("request")
            try:
                if phase == "request_headers":
                    out, pending = self._on_headers(req.request_headers)
                elif phase == "request_body":
                    out = await self._on_body(pending, req.request_body)
                elif phase == "response_headers":
                    out = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif phase == "response_body":
                    out = ep.ProcessingResponse(response_body=ep.BodyResponse())
                elif phase == "request_trailers":
                    out = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif phase == "response_trailers":
                    out = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
                else:
                    log.warning("ext_proc message without a known phase (%r); ignoring it", phase)
                    continue
            except Exception:
                log.exception("ext_proc failed on a %s message; answering 500", phase)
                out = immediate_response(_INTERNAL_ERROR)
            yield out
            if out.HasField("immediate_response"):
                return

    def _on_headers(
        self, msg: ep.HttpHeaders
    ) -> tuple[ep.ProcessingResponse, handlers.PendingRequest | None]:
        decision = handlers.on_request_headers(
            self.state.gateway, header_map(msg), end_of_stream=msg.end_of_stream
        )
        if isinstance(decision, handlers.ImmediateReply):
            return immediate_response(decision), None
        return headers_continue(decision.remove_headers), decision.pending

    async def _on_body(
        self, pending: handlers.PendingRequest | None, msg: ep.HttpBody
    ) -> ep.ProcessingResponse:
        if pending is None:
            # a body without an accepted headers phase: Envoy is configured to skip headers, which breaks
            # routing (shared/DESIGN.md); refuse rather than forward unrouted
            log.error("request body received without a request headers phase; check processing_mode")
            return immediate_response(_INTERNAL_ERROR)
        state = self.state
        gateway = state.gateway
        body = msg.body
        if len(body) >= self.offload_body_bytes:
            prepared = await asyncio.to_thread(
                handlers.prepare_body, gateway, pending, body, end_of_stream=msg.end_of_stream
            )
        else:
            prepared = handlers.prepare_body(gateway, pending, body, end_of_stream=msg.end_of_stream)
        if isinstance(prepared, handlers.ImmediateReply):
            return immediate_response(prepared)
        decision = handlers.admit(gateway, state.quotas, prepared, now=state.clock(), rng=state.rng)
        if isinstance(decision, handlers.ImmediateReply):
            return immediate_response(decision)
        return body_continue(decision)


def add_to_server(server: grpc.aio.Server, state: ExtProcState) -> ExternalProcessor:
    """Register an :class:`ExternalProcessor` over ``state`` on ``server`` and return it."""
    servicer = ExternalProcessor(state)
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    return servicer
