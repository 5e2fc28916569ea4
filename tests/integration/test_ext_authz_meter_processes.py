"""Two ext_authz processes that meter, in-process over real gRPC, sharing a real Redis quota store: each
process's checks make meter ids with its own prefix, its settler settles only its own reservations, and
entries are delivered as Envoy's per-process access loggers deliver them (by the id's prefix, the rule of
:func:`xds_server.resources.listener.build_meter_access_logs`; ``tests/e2e`` checks Envoy itself does so).
The concurrency slot is shared through Redis; an entry at the other process's settler is an unknown id
there and settles nothing; a process that dies holding a reservation leaves its concurrency lease to expire
by its TTL, and the survivor settles none of it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc

from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from ext_authz.meter import Meter
from ext_proc.access_log import serve_access_log
from ext_proc.metrics import ExtProcMetrics
from ext_proc.state import ExtProcState
from ext_proc.stores import make_quota_store
from inferlb.adapters.quota_redis import RedisQuotaStore
from inferlb.config.schema import Config, parse_config
from inferlb.ops.stack import describe, free_ports
from inferlb.policy.settlement import AUTHZ_NAMESPACE, meter_id_prefix
from inferlb.request import headers as h
from tests.conftest import redis_or_skip, write_config
from tests.integration.test_ext_authz_meter import BODY, log_entry, send

LEASE_TTL_MS = 2_000
TENANT = "gold"
USAGE = {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_or_skip(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


def config_of(redis_url: str) -> Config:
    return parse_config(
        {
            "ext_proc": {
                "protocol": "ext_authz",
                "quota_backend": "redis",
                "redis_url": redis_url,
                "redis_key_prefix": f"t{time.monotonic_ns()}",  # one namespace per test
                "extra_listen": ["127.0.0.1:18095"],
                "lease_ttl_ms": LEASE_TTL_MS,
            },
            "gateway": {"request_timeout_ms": 1_000},
            "models": [{"name": "llama-3.1-8b-instruct", "default_max_tokens": 100}],
            "tenants": [
                {
                    "name": TENANT,
                    "api_keys": ["sk-gold-0001"],
                    "tokens_per_minute": 1_000,
                    "max_concurrent_requests": 1,
                }
            ],
        }
    )


@dataclass
class Process:
    """One ext_authz process: its checks, its settler and a stub of its access-log service."""

    service: CheckService
    meter: Meter
    server: grpc.aio.Server
    channel: grpc.aio.Channel
    stub: als_pb2_grpc.AccessLogServiceStub

    @property
    def state(self) -> ExtProcState:
        return self.service.state

    async def check(self) -> CheckAnswer:
        out = self.service.check(
            CheckRequest(
                method="POST",
                path="/v1/chat/completions",
                headers={"authorization": "Bearer sk-gold-0001", "content-type": "application/json"},
                body=BODY,
            )
        )
        return out if isinstance(out, CheckAnswer) else await out

    def count(self, name: str, **labels: str) -> float:
        return self.state.metrics.registry.get_sample_value(name, labels) or 0.0

    async def close(self) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.meter.aclose()
        await self.state.quotas.aclose()


async def start_process(config: Config, index: int) -> Process:
    metrics = ExtProcMetrics()
    quotas = make_quota_store(config, metrics)
    await quotas.start()
    state = ExtProcState(config, quotas=quotas, metrics=metrics)
    meter = Meter(state, process=index)
    server, port = await serve_access_log("127.0.0.1", 0, meter.on_entries)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Process(
        CheckService(state, meter=meter), meter, server, channel, als_pb2_grpc.AccessLogServiceStub(channel)
    )


@pytest.fixture
async def processes(redis_url: str) -> AsyncIterator[list[Process]]:
    config = config_of(redis_url)
    out = [await start_process(config, i) for i in range(len(config.ext_proc.meter_addresses()))]
    try:
        yield out
    finally:
        for p in out:
            await p.close()


def meter_id_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> str:
    return str(entry.common_properties.metadata.filter_metadata[AUTHZ_NAMESPACE].fields[h.METER].string_value)


async def deliver(processes: list[Process], entries: list[accesslog_pb2.HTTPAccessLogEntry]) -> None:
    """Send each entry to the settler whose prefix its meter id has, as Envoy's loggers do."""
    for i, p in enumerate(processes):
        mine = [e for e in entries if meter_id_of(e).startswith(meter_id_prefix(i))]
        if mine:
            await send(p.stub, mine)


async def in_flight(p: Process) -> int:
    quotas = p.state.quotas
    assert isinstance(quotas, RedisQuotaStore)
    return await quotas.in_flight(TENANT)


async def test_each_process_settles_its_own_reservations_in_the_shared_store(
    processes: list[Process],
) -> None:
    a, b = processes
    first = await a.check()
    assert first.status == 200
    first_id = dict(first.headers)[h.METER]
    assert first_id.startswith(meter_id_prefix(0))
    # one slot for the tenant across both processes (Redis)
    assert (await b.check()).status == 429
    await deliver(processes, [log_entry(first_id, 200, USAGE)])
    assert a.meter.ledger.pending == 0 and await in_flight(b) == 0
    second = await b.check()
    assert second.status == 200
    second_id = dict(second.headers)[h.METER]
    assert second_id.startswith(meter_id_prefix(1))
    await deliver(processes, [log_entry(second_id, 200, USAGE), log_entry(first_id, 200, USAGE)])
    assert b.meter.ledger.pending == 0 and await in_flight(a) == 0
    for p in processes:
        assert p.count("inferlb_meter_settlements_total", outcome="metered") == 1
        assert p.count("inferlb_meter_entries_ignored_total", reason="unknown") == 0
    assert a.count("inferlb_meter_entries_ignored_total", reason="duplicate") == 1  # the repeat, at its owner


async def test_an_entry_at_the_other_processs_settler_settles_nothing(processes: list[Process]) -> None:
    a, b = processes
    meter_id = dict((await a.check()).headers)[h.METER]
    await send(b.stub, [log_entry(meter_id, 200, USAGE)])  # misrouted
    assert b.count("inferlb_meter_entries_ignored_total", reason="unknown") == 1
    assert a.meter.ledger.pending == 1 and await in_flight(a) == 1  # still held by its owner
    await deliver(processes, [log_entry(meter_id, 200, USAGE)])
    assert a.meter.ledger.pending == 0 and await in_flight(a) == 0


async def test_a_dead_processs_reservations_stay_charged_and_its_lease_expires(redis_url: str) -> None:
    config = config_of(redis_url)
    a, b = [await start_process(config, i) for i in range(2)]
    try:
        meter_id = dict((await a.check()).headers)[h.METER]
        assert meter_id.startswith(meter_id_prefix(0))
        # it dies before its entry comes (Envoy's logger to it fails; none goes to the survivor)
        await a.close()
        assert (await b.check()).status == 429  # the dead process's slot is held in Redis ...
        deadline = time.monotonic() + LEASE_TTL_MS / 1000 + 5
        while (answer := await b.check()).status == 429:  # ... until its lease's TTL
            assert time.monotonic() < deadline, "the dead process's lease never expired"
            await asyncio.sleep(0.1)
        assert answer.status == 200
        assert b.count("inferlb_meter_entries_ignored_total", reason="unknown") == 0
        assert b.count("inferlb_meter_settlements_total", outcome="expired") == 0  # not b's to settle
    finally:
        await b.close()


def test_a_metering_process_on_an_address_the_config_does_not_name_will_not_start(
    tmp_path: Path, redis_url: str
) -> None:
    # its ids would match none of Envoy's access loggers: no entry would ever reach its settler
    doc = yaml.safe_load(config_of(redis_url).model_dump_json())
    path = write_config(tmp_path / "c.yaml", doc)
    (port,) = free_ports(1)
    proc = subprocess.run(
        [sys.executable, "-m", "ext_authz", "--config", str(path), "--listen", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"127.0.0.1:{port} is neither ext_proc.listen nor one of extra_listen" in proc.stderr


def test_inferlb_up_names_each_processs_settler(redis_url: str) -> None:
    config = config_of(redis_url)
    [line] = [x for x in describe(config) if x.startswith("settlers")]
    assert all(str(a) in line for a in config.ext_proc.meter_addresses())
    assert len(config.ext_proc.meter_addresses()) == 2
