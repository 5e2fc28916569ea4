"""The EPP's gRPC server (grpcio aio): ``envoy.service.ext_proc.v3.ExternalProcessor`` over
:class:`epp.exchange.Exchange`, and the gRPC health services the endpoint-picker protocol requires.

Health (gRPC Health Checking Protocol, ``grpc.health.v1.Health``): ``liveness`` is SERVING while the
process answers; ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` (and the overall
``""`` service) are SERVING once every endpoint of the pool was scraped once (:attr:`epp.pool.Pool.synced`),
NOT_SERVING before, and NOT_SERVING again from the start of a shutdown.

Streams: one ``Process`` stream per HTTP request. Each message gets its answers in order; after the answer
Envoy needs last (an immediate response, or the response's end) the stream waits for Envoy's reset
(:data:`RESET_WAIT_S`) instead of ending itself, as :mod:`ext_proc.servicer` does: grpcio aio leaks a status
batch that races the reset. However the stream ends (response end, client abort, cancellation) the
request leaves the in-flight count exactly once, and a pick never reported as served is counted
``unreported``. A request that waits in the fair queue (:mod:`epp.flow`) holds its stream's answer until
its admission or refusal; a stream cancelled meanwhile takes it out of the queue (and releases the pick
when its admission came first). A bug while answering a message answers 500 with an OpenAI
``server_error`` body rather than aborting the stream (Envoy would answer a bare 500).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Final

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp.exchange import Exchange, immediate_response
from epp.picking import EndpointPicker, Routed, internal_error

log = logging.getLogger("epp")

#: Seconds a stream waits for Envoy's reset after its last answer (see the module doc).
RESET_WAIT_S: Final = 2.0
#: gRPC message limit each way (bytes): Envoy streams the body in chunks of its buffer size, far under it.
GRPC_MESSAGE_LIMIT_BYTES: Final = 8 * 1024 * 1024
#: The health services the endpoint-picker protocol names; ``""`` is the server as a whole.
READINESS_SERVICES: Final = ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "")
LIVENESS_SERVICE: Final = "liveness"


def make_server() -> grpc.aio.Server:
    """A grpc aio server with :data:`GRPC_MESSAGE_LIMIT_BYTES` message limits."""
    return grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT_BYTES),
            ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT_BYTES),
        ]
    )


class EndpointPickerProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # generated, untyped
    """``envoy.service.ext_proc.v3.ExternalProcessor`` answering as the endpoint picker.

    Args:
        picker: the decisions and the pool's live state.
        max_body_bytes: request bodies over this are refused 413 (bytes).
        reset_wait_s: after its last answer, how long a stream waits for Envoy's reset (seconds).
    """

    def __init__(
        self, picker: EndpointPicker, *, max_body_bytes: int, reset_wait_s: float = RESET_WAIT_S
    ) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes
        self.reset_wait_s = reset_wait_s

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[ep.ProcessingRequest, ep.ProcessingResponse],
    ) -> None:
        """Answer each ``ProcessingRequest`` of one HTTP request's stream (see the module doc)."""
        picker = self.picker
        counted: str | None = None
        released = False

        def on_served(routed: Routed, served: str | None) -> None:
            nonlocal counted
            counted = picker.served(routed, served)

        def release() -> None:
            # the request's end, once: an unreported pick counted as such, the in-flight count left
            nonlocal counted, released
            if released:
                return
            released = True
            if ex.routed is not None and not ex.served_reported:
                ex.served_reported = True
                counted = picker.served(ex.routed, None)
            if counted is not None:
                picker.finished(counted)

        ex = Exchange(
            picker.decide,
            on_served=on_served,
            on_refused=picker.count_refusal,
            max_body_bytes=self.max_body_bytes,
        )
        processing = picker.metrics.processing
        read, write = context.read, context.write
        try:
            while (req := await read()) is not grpc.aio.EOF:
                started = time.perf_counter()
                phase = req.WhichOneof("request") or "unknown"
                try:
                    out = ex.on_message(req)
                except Exception:
                    log.exception("the endpoint picker failed on a %s message; answering 500", phase)
                    reply = internal_error()
                    picker.count_refusal(reply)
                    out = [immediate_response(reply)]
                    ex.done = True
                if ex.routed is not None and counted is None:
                    counted = ex.routed.endpoints[0]
                processing.labels(phase).observe(time.perf_counter() - started)
                if ex.waiting is not None:
                    out = await self._wait(ex)
                    if ex.routed is not None and counted is None:
                        counted = ex.routed.endpoints[0]
                if not ex.done:
                    for answer in out:
                        await write(answer)
                    continue
                # the request ends with this answer: leave the count before the client can see the end
                release()
                for answer in out[:-1]:
                    await write(answer)
                if out:
                    # Envoy resets the stream once this answer reaches it; a write whose awaiter is cancelled
                    # never frees its native batch in grpcio aio, so the last write runs shielded
                    await asyncio.shield(write(out[-1]))
                await asyncio.sleep(self.reset_wait_s)
                return
        finally:
            release()

    async def _wait(self, ex: Exchange) -> list[ep.ProcessingResponse]:
        """Wait for the decision on ``ex``'s queued request; the answers it gives."""
        waiting = ex.waiting
        assert waiting is not None
        try:
            decision = await waiting.outcome
        except asyncio.CancelledError:
            late = self.picker.abandon(waiting)
            if late is not None:
                ex.resume(late)  # an admission that came first: the stream's end releases its pick
            raise
        return ex.resume(decision)


class Health:
    """The gRPC health services of the EPP over grpcio-health-checking's aio servicer."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def alive(self) -> None:
        """``liveness`` SERVING; the readiness services NOT_SERVING until :meth:`ready`."""
        await self.servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        for name in READINESS_SERVICES:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def ready(self) -> None:
        """The readiness services SERVING."""
        for name in READINESS_SERVICES:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def shutting_down(self) -> None:
        """Every service NOT_SERVING (and stays so)."""
        await self.servicer.enter_graceful_shutdown()


def add_to_server(
    server: grpc.aio.Server,
    picker: EndpointPicker,
    *,
    max_body_bytes: int,
    reset_wait_s: float = RESET_WAIT_S,
) -> tuple[EndpointPickerProcessor, Health]:
    """Register the ext_proc servicer and the health services on ``server``."""
    processor = EndpointPickerProcessor(picker, max_body_bytes=max_body_bytes, reset_wait_s=reset_wait_s)
    ep_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    checks = Health()
    health_pb2_grpc.add_HealthServicer_to_server(checks.servicer, server)
    return processor, checks
