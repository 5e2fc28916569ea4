"""The ext_authz settler in-process over real gRPC with Envoy's own access-log protos: a check admits and
answers a meter id, an ``envoy.service.accesslog.v3`` stream brings entries (Envoy's message shape: the
identifier first, HTTP entries with dynamic metadata and the response code) to the receiver, and the
reservation is settled once with the usage: tokens freed in the window, the concurrency slot released,
the metrics counted; duplicates and unknown ids settle nothing; a missing entry settles at the reservation
after the TTL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import struct_pb2, wrappers_pb2

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from ext_authz.meter import Meter
from ext_proc.access_log import meter_entry, serve_access_log
from ext_proc.state import ExtProcState
from inferlb.config.schema import parse_config
from inferlb.policy.quota import MemoryQuotaStore, QuotaBook
from inferlb.policy.settlement import AUTHZ_NAMESPACE, PRODUCED_KEY, USAGE_KEY, USAGE_NAMESPACE, MeterEntry
from inferlb.request import headers as h

CONFIG: dict[str, Any] = {
    "ext_proc": {"protocol": "ext_authz", "lease_ttl_ms": 2_000},
    "gateway": {"request_timeout_ms": 1_000},
    "models": [{"name": "llama-3.1-8b-instruct", "default_max_tokens": 100}],
    "tenants": [
        {
            "name": "gold",
            "api_keys": ["sk-gold-0001"],
            "tokens_per_minute": 1_000,
            "max_concurrent_requests": 1,
        }
    ],
}
BODY = json.dumps(
    {"model": "llama-3.1-8b-instruct", "messages": [{"role": "user", "content": "hi"}]}
).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def check(service: CheckService) -> CheckAnswer:
    out = service.check(
        CheckRequest(
            method="POST",
            path="/v1/chat/completions",
            headers={"authorization": "Bearer sk-gold-0001", "content-type": "application/json"},
            body=BODY,
        )
    )
    assert isinstance(out, CheckAnswer)
    return out


def log_entry(meter_id: str, status: int, usage: dict[str, Any] | None) -> accesslog_pb2.HTTPAccessLogEntry:
    """An entry as Envoy's http_grpc logger writes it for a metered request."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    md = entry.common_properties.metadata.filter_metadata
    authz = struct_pb2.Struct()
    authz.update({h.METER: meter_id, "ext_authz_duration": 1.0})
    md[AUTHZ_NAMESPACE].CopyFrom(authz)
    if usage is not None:
        found = struct_pb2.Struct()
        found.update({USAGE_KEY: json.dumps(usage)})
        md[USAGE_NAMESPACE].CopyFrom(found)
    entry.response.response_code.CopyFrom(wrappers_pb2.UInt32Value(value=status))
    return entry


def messages(*batches: list[accesslog_pb2.HTTPAccessLogEntry]) -> list[als_pb2.StreamAccessLogsMessage]:
    first = als_pb2.StreamAccessLogsMessage(
        identifier=als_pb2.StreamAccessLogsMessage.Identifier(
            node=base_pb2.Node(id="envoy"), log_name="meter"
        )
    )
    out = []
    for i, batch in enumerate(batches):
        msg = als_pb2.StreamAccessLogsMessage()
        if i == 0:
            msg.CopyFrom(first)
        msg.http_logs.log_entry.extend(batch)
        out.append(msg)
    return out


@pytest.fixture
async def settler() -> AsyncIterator[tuple[CheckService, Meter, Clock, als_pb2_grpc.AccessLogServiceStub]]:
    clock = Clock()
    config = parse_config(CONFIG)
    state = ExtProcState(config, clock=clock)
    meter = Meter(state, clock=clock)
    server, port = await serve_access_log("127.0.0.1", 0, meter.on_entries)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield CheckService(state, meter=meter), meter, clock, als_pb2_grpc.AccessLogServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
        await meter.aclose()


async def send(
    stub: als_pb2_grpc.AccessLogServiceStub, *batches: list[accesslog_pb2.HTTPAccessLogEntry]
) -> None:
    async def gen() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        for m in messages(*batches):
            yield m

    await asyncio.wait_for(stub.StreamAccessLogs(gen()), 5)


def book_of(state: ExtProcState) -> QuotaBook:
    """The in-process quota book behind ``state``."""
    assert isinstance(state.quotas, MemoryQuotaStore)
    return state.quotas.book


def settled(state: ExtProcState, outcome: str) -> float:
    value = state.metrics.registry.get_sample_value("inferlb_meter_settlements_total", {"outcome": outcome})
    return value or 0.0


async def test_an_entry_settles_its_reservation_once_with_the_usage(
    settler: tuple[CheckService, Meter, Clock, als_pb2_grpc.AccessLogServiceStub],
) -> None:
    service, meter, _, stub = settler
    state = service.state
    book = book_of(state)
    answer = check(service)
    meter_id = dict(answer.headers)[h.METER]
    assert answer.status == 200 and meter.ledger.pending == 1
    # the slot is held until the entry: a second request is over max_concurrent_requests
    assert check(service).status == 429
    _, tokens_left = book.available("gold", 1_000.0)
    assert tokens_left is not None and tokens_left <= 1_000 - 100  # the reservation counts
    entry = log_entry(meter_id, 200, {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13})
    await send(stub, [entry], [entry, log_entry("unknown-1", 200, None)])  # a repeat, an id never made here
    assert meter.ledger.pending == 0
    assert book.available("gold", 1_000.0)[1] == 1_000 - 13  # settled at the usage, once
    assert book.in_flight("gold") == 0
    assert settled(state, "metered") == 1
    ignored = state.metrics.registry.get_sample_value
    assert ignored("inferlb_meter_entries_ignored_total", {"reason": "duplicate"}) == 1
    assert ignored("inferlb_meter_entries_ignored_total", {"reason": "unknown"}) == 1
    assert ignored("inferlb_prompt_tokens_total", {"tenant": "gold", "model": "llama-3.1-8b-instruct"}) == 8
    assert check(service).status == 200  # the slot is free again


async def test_a_missing_entry_settles_at_the_reservation_after_the_ttl(
    settler: tuple[CheckService, Meter, Clock, als_pb2_grpc.AccessLogServiceStub],
) -> None:
    service, meter, clock, stub = settler
    meter_id = dict(check(service).headers)[h.METER]
    state = service.state
    book = book_of(state)
    before = book.available("gold", clock.now)[1]
    clock.now += 0.5
    assert await meter.sweep() == 0
    clock.now += meter.ledger.ttl_s
    assert await meter.sweep() == 1
    assert settled(state, "expired") == 1
    assert book.available("gold", clock.now)[1] == before  # the reservation stands
    assert book.in_flight("gold", clock.now) == 0
    # the entry after the TTL changes nothing
    await send(stub, [log_entry(meter_id, 200, {"prompt_tokens": 1, "completion_tokens": 1})])
    assert book.available("gold", clock.now)[1] == before
    value = state.metrics.registry.get_sample_value("inferlb_meter_entries_ignored_total", {"reason": "late"})
    assert value == 1


@pytest.mark.parametrize(
    ("status", "usage", "expected"),
    [
        (200, {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}, (3, 4)),  # Responses API terms
        (200, None, None),
        (503, None, None),
        (200, "not json", None),
    ],
)
def test_an_entry_is_read_from_envoys_shape(
    status: int, usage: Any, expected: tuple[int, int] | None
) -> None:
    entry = log_entry("m-1", status, usage if isinstance(usage, dict) else None)
    if isinstance(usage, str):
        entry.common_properties.metadata.filter_metadata[USAGE_NAMESPACE].update({USAGE_KEY: usage})
    assert meter_entry(entry) == MeterEntry(meter_id="m-1", status=status, usage=expected)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (1234, 1234), (-1, None), ("12", None), (2.0**60, None)],
)
def test_a_streams_produced_bytes_are_read_only_as_a_count(value: Any, expected: int | None) -> None:
    entry = log_entry("m-1", 200, None)
    entry.common_properties.metadata.filter_metadata[USAGE_NAMESPACE].update({PRODUCED_KEY: value})
    assert meter_entry(entry) == MeterEntry(meter_id="m-1", status=200, usage=None, produced=expected)


def test_an_entry_without_a_meter_id_is_not_metered() -> None:
    assert meter_entry(accesslog_pb2.HTTPAccessLogEntry()) is None
