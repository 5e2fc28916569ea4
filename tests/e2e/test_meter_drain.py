"""ext_authz mode's metering through a real Envoy when Envoy stops, with one ext_authz process and with two
(``extra_listen``, Redis quotas, each process its own settler): Envoy does not flush its gRPC access-log
buffers when it exits, so the stack drains it first (:meth:`inferlb.ops.stack.Stack.drain_envoy`: listeners
drained, requests in flight ended, one flush interval waited). After a burst and that drain, every
request's entry has reached the settler that admitted it before Envoy gets SIGTERM: none is lost, none
waits for the TTL, none reaches the other process.

And when one of two processes is killed (SIGKILL) with entries of its own still in Envoy's buffer, the
other settles all of its own at their usage and sees none of the dead one's; the dead one's concurrency
lease, held in Redis, frees its slot once ``lease_ttl_ms`` passes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from inferlb.config.schema import Config, HostPort
from inferlb.ops.stack import admin_get, free_ports, on_free_ports
from tests.conftest import make_config_doc, redis_or_skip
from tests.e2e.conftest import RunningStack, chat_body, http_request, in_mode, started_stack
from tests.e2e.test_extproc_accounting import process_samples, settlements

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
BURST = 60
#: The kill test's concurrency lease TTL (ms): above its route timeout, short enough to wait out.
LEASE_TTL_MS = 4_000
#: The tenant of the kill test: one request in flight at a time.
SOLO_KEY = "sk-solo-key"


def metered_doc(processes: int, redis_url: str | None) -> dict[str, Any]:
    """The default fleet in ext_authz mode with response accounting (the default), with ``processes``
    ext_authz processes (more than one share ``redis_url``'s quotas)."""
    doc = in_mode(make_config_doc(), "ext_authz")
    # the default flush (the fast test config's is shorter): entries wait in Envoy's buffer as long as in
    # production, which is what the drain must wait out
    doc["ext_proc"]["meter_flush_interval_ms"] = 1_000
    extra = processes - 1
    if extra:
        assert redis_url is not None
        ports = free_ports(3 * extra)
        doc["ext_proc"].update(
            quota_backend="redis",
            redis_url=redis_url,
            extra_listen=[f"127.0.0.1:{p}" for p in ports[:extra]],
            extra_metrics_listen=[f"127.0.0.1:{p}" for p in ports[extra : 2 * extra]],
            extra_meter_listen=[f"127.0.0.1:{p}" for p in ports[2 * extra :]],
        )
        on_free_ports(doc)  # every port again in one batch: two separate batches may share a port
    return doc


@contextlib.contextmanager
def metered_stack(
    tmp_path_factory: pytest.TempPathFactory,
    processes: int,
    gateway: dict[str, Any] | None = None,
    **ext_proc: Any,
) -> Iterator[RunningStack]:
    """A started :func:`metered_doc` stack with ``gateway`` and ``ext_proc`` fields set, and tenant
    ``solo`` (one request at a time, :data:`SOLO_KEY`)."""
    with contextlib.ExitStack() as stack:
        url = None
        if processes > 1:
            url = stack.enter_context(redis_or_skip(tmp_path_factory.mktemp("redis"))).url
        doc = metered_doc(processes, url)
        doc["ext_proc"].update(ext_proc)
        doc["gateway"].update(gateway or {})
        doc["simulation"]["decode_tokens_per_s"] = 2_000  # a 2,000-token stream lasts about a second
        doc["tenants"].append({"name": "solo", "api_keys": [SOLO_KEY], "max_concurrent_requests": 1})
        rs = stack.enter_context(started_stack(tmp_path_factory.mktemp("drain"), doc))
        assert rs.config.ext_proc.meters_access_log()
        assert len(rs.config.ext_proc.meter_addresses()) == processes
        yield rs


def metrics_addresses(config: Config) -> tuple[HostPort, ...]:
    """Each ext_authz process's ``/metrics`` address, process 0 first."""
    return (config.ext_proc.metrics_listen, *config.ext_proc.extra_metrics_addresses())


def admitted(addr: HostPort, tenant: str | None = None) -> int:
    """Requests one process admitted and sent upstream (each metered), of ``tenant`` or of every tenant."""
    text = http_request(str(addr), "GET", "/metrics").body.decode()
    return int(
        sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "inferlb_requests_total"
            and s.labels["status"] == "forwarded"
            and tenant in (None, s.labels["tenant"])
        )
    )


def logs_written(config: Config) -> int:
    """Entries Envoy's gRPC access loggers have written, all loggers together (Envoy's stat
    ``access_logs.grpc_access_log.logs_written``)."""
    text = admin_get(config, "/stats?filter=grpc_access_log.logs_written$").decode()
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())


async def burst(gateway: str, n: int) -> list[int]:
    """``n`` concurrent small chat requests (half streamed with usage asked for); their statuses."""

    async def one(http: aiohttp.ClientSession, i: int) -> int:
        body = chat_body(QWEN, max_tokens=4, stream=i % 2 == 1)
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        async with http.post(
            f"http://{gateway}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-demo-a"}
        ) as resp:
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        return await asyncio.gather(*(one(http, i) for i in range(n)))


@pytest.mark.parametrize("processes", [1, 2])
def test_a_drained_envoy_stop_loses_no_settlement(
    tmp_path_factory: pytest.TempPathFactory, processes: int
) -> None:
    with metered_stack(tmp_path_factory, processes) as rs:
        before = sum(settlements(rs.config).values())
        written = logs_written(rs.config)
        # requests that are not metered (a wrong key, the model list) are logged to no settler
        bad_key = {"Authorization": "Bearer sk-not-a-key"}
        for _ in range(5):
            assert (
                http_request(rs.gateway, "POST", "/v1/chat/completions", chat_body(QWEN), bad_key).status
                == 401
            )
            assert (
                http_request(
                    rs.gateway, "GET", "/v1/models", None, {"Authorization": "Bearer sk-demo-a"}
                ).status
                == 200
            )
        statuses = asyncio.run(burst(rs.gateway, BURST))
        assert statuses == [200] * BURST
        assert rs.stack.drain_envoy()
        # Envoy wrote one entry per metered request, to one logger each: none for the others
        assert logs_written(rs.config) - written == BURST
        rs.stack.child("envoy").stop()  # SIGTERM, as the stack's own stop does after the drain
        got = settlements(rs.config)
        assert sum(got.values()) - before == BURST
        assert got.get("expired", 0) == 0 and got.get("unmetered", 0) == 0  # every one at its usage
        per_process = [
            process_samples(a, "inferlb_meter_settlements_total") for a in metrics_addresses(rs.config)
        ]
        # each process settled what it admitted (Envoy spread the checks), nothing at another's settler
        assert [int(s.get("metered", 0)) for s in per_process] == [
            admitted(a) for a in metrics_addresses(rs.config)
        ]
        assert all(n > 0 for n in (admitted(a) for a in metrics_addresses(rs.config)))
        ignored = [
            process_samples(a, "inferlb_meter_entries_ignored_total") for a in metrics_addresses(rs.config)
        ]
        assert all(not any(i.values()) for i in ignored), ignored


def test_a_killed_process_loses_only_its_own_unsettled_ids(tmp_path_factory: pytest.TempPathFactory) -> None:
    # the route timeout bounds a request, so a short lease TTL (above it) frees a dead process's slot
    # within the test
    with metered_stack(tmp_path_factory, 2, {"request_timeout_ms": 2_000}, lease_ttl_ms=LEASE_TTL_MS) as rs:
        addresses = metrics_addresses(rs.config)
        solo = {"Authorization": f"Bearer {SOLO_KEY}"}
        # a stream holds solo's one slot; the process that admitted it dies while it streams
        body = chat_body(QWEN, max_tokens=2_000, stream=True)
        url = f"http://{rs.gateway}/v1/chat/completions"
        with requests.post(url, json=body, headers=solo, stream=True, timeout=30) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(lines)  # admitted and streaming: its slot is held
            admitted_at = time.monotonic()
            [owner] = [i for i, a in enumerate(addresses) if admitted(a, "solo")]
            killed = rs.stack.child("ext_authz" if owner == 0 else "ext_authz-2")
            assert killed.proc is not None
            os.killpg(killed.proc.pid, signal.SIGKILL)
            killed.proc.wait(timeout=10)
            for _ in lines:  # the response goes on: Envoy, not the dead process, carries it
                pass
        survivor = addresses[1 - owner]
        # the stream's entry went to the dead settler's cluster and was lost: the slot stays held in Redis
        # (429 from the survivor; checks sent to the dead process fail closed, 503) until its lease expires
        seen: list[int] = []
        while (
            status := http_request(rs.gateway, "POST", "/v1/chat/completions", chat_body(QWEN), solo).status
        ) != 200:
            assert status in (429, 503), status
            seen.append(status)
            assert time.monotonic() < admitted_at + LEASE_TTL_MS / 1000 + 10, (
                "the dead process's slot never expired"
            )
            time.sleep(0.1)
        assert 429 in seen
        assert time.monotonic() >= admitted_at + LEASE_TTL_MS / 1000 - 1.0  # not before its lease expired
        # the survivor settles every request it admits at its usage and never sees the dead one's ids
        statuses = asyncio.run(burst(rs.gateway, BURST))
        assert set(statuses) <= {200, 503} and 200 in statuses, statuses
        assert rs.stack.drain_envoy()
        mine = process_samples(survivor, "inferlb_meter_settlements_total")
        assert int(mine.get("metered", 0)) == admitted(survivor)
        assert mine.get("expired", 0) == 0
        assert not any(process_samples(survivor, "inferlb_meter_entries_ignored_total").values())
