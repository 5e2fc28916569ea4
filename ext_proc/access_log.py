"""The settler's receiver: Envoy's gRPC access-log service (``envoy.service.accesslog.v3.AccessLogService``,
``StreamAccessLogs``) turned into :class:`~inferlb.policy.settlement.MeterEntry` values, handed in batches
to a sink (``ext_proc.protocol: ext_authz`` with ``account_responses``; :mod:`ext_authz.meter` settles).

What an entry carries (Envoy docs, ``envoy.data.accesslog.v3.HTTPAccessLogEntry``):
``common_properties.metadata.filter_metadata`` is the stream's dynamic metadata: the meter id under
:data:`AUTHZ_NAMESPACE` (the ext_authz answer's :data:`~inferlb.request.headers.METER` header, by
``dynamic_metadata_from_headers``) and the usage object text under :data:`USAGE_NAMESPACE` / :data:`USAGE_KEY`
(written by the gateway's response Lua filter, :data:`xds_server.resources.listener.METER_LUA`), and for an
SSE answer its generated-text bytes so far under :data:`PRODUCED_KEY` (a number);
``response.response_code`` the status sent downstream (0 when none was). Envoy batches entries per worker
(``buffer_flush_interval``, ``buffer_size_bytes``) into one stream message and never retries a message, so
the receiver only ever sees an entry once unless Envoy logs it twice; the settler's ledger ignores repeats.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from inferlb.policy.settlement import AUTHZ_NAMESPACE, PRODUCED_KEY, USAGE_KEY, USAGE_NAMESPACE, MeterEntry
from inferlb.request import headers as h
from inferlb.request.usage import usage_counts

log = logging.getLogger("ext_proc.access_log")

#: Longest usage text read (bytes); the Lua filter caps what it keeps well below this.
MAX_USAGE_TEXT: Final = 16 * 1024

Sink = Callable[[list[MeterEntry]], Awaitable[None]]


def meter_entry(entry: accesslog_pb2.HTTPAccessLogEntry) -> MeterEntry | None:
    """The :class:`MeterEntry` of one access-log entry, or None when it carries no meter id (a request
    the gateway did not meter: refused, let through unexamined, failed open). A usage text that is not a
    JSON usage object counts as no usage."""
    md = entry.common_properties.metadata.filter_metadata
    authz = md.get(AUTHZ_NAMESPACE)
    if authz is None or h.METER not in authz.fields:
        return None
    meter_id = authz.fields[h.METER].string_value
    if not meter_id:
        return None
    usage: tuple[int, int] | None = None
    found = md.get(USAGE_NAMESPACE)
    if found is not None and USAGE_KEY in found.fields:
        text = found.fields[USAGE_KEY].string_value
        if len(text) <= MAX_USAGE_TEXT:
            try:
                usage = usage_counts(json.loads(text))
            except ValueError:
                usage = None
    produced: int | None = None
    if found is not None and PRODUCED_KEY in found.fields:
        value = found.fields[PRODUCED_KEY]
        if value.WhichOneof("kind") == "number_value" and 0 <= value.number_value < 2**53:
            produced = int(value.number_value)
    status = entry.response.response_code.value if entry.response.HasField("response_code") else 0
    return MeterEntry(meter_id=meter_id, status=status, usage=usage, produced=produced)


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]  # generated, untyped
    """``StreamAccessLogs``: each message's HTTP entries -> :func:`meter_entry` -> ``sink`` (awaited
    before the next message is read, so entries are settled in the order Envoy sent them). A sink that
    raises is logged and the stream goes on (one bad batch must not lose the next ones).

    Args:
        sink: settles one batch of entries.
    """

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self.messages = 0

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[als_pb2.StreamAccessLogsMessage, als_pb2.StreamAccessLogsResponse],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            self.messages += 1
            entries = [e for e in map(meter_entry, message.http_logs.log_entry) if e is not None]
            if not entries:
                continue
            try:
                await self._sink(entries)
            except Exception:
                log.exception("settling %d access-log entries failed", len(entries))
        return als_pb2.StreamAccessLogsResponse()


async def serve_access_log(
    host: str, port: int, sink: Sink, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start a gRPC server for the access-log service on ``host:port`` (port 0: a free one) and return it
    with its bound port; with ``credentials`` (``ext_proc.tls``'s,
    :func:`inferlb.adapters.tls_grpc.grpc_server_credentials`) over mutual TLS.

    Raises:
        OSError: the address cannot be bound (grpc reports it as a RuntimeError; re-raised as OSError).
    """
    server = grpc.aio.server()
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogReceiver(sink), server)
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is not None:
            port = server.add_secure_port(listen, credentials)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    await server.start()
    return server, port
