"""The endpoint pool the EPP picks from and its live state: each endpoint's queue and KV-cache usage from
its own ``/metrics`` (scraped on an interval), and the requests this EPP sent it that have not ended.

The state is plain values behind one owner (:class:`Pool`, mutated only from the event loop); the scrape
loop (:class:`Scraper`, aiohttp) is the only I/O, and a failed scrape keeps the last good values and counts
the error. What the picker reads is a :meth:`Pool.snapshot`: one
:class:`~inferlb.policy.picker.EndpointState` per endpoint.

**Healthy** endpoint: its last good scrape is at most ``stale_after_s`` old (a model server that stops
answering ``/metrics`` stops being picked after that; one that was never scraped is not picked).

**Saturated** endpoint (:func:`saturated`): its waiting queue reached ``queue_depth`` requests
(``vllm:num_requests_waiting``, the server's own count plus none of ours) or its KV-cache usage reached
``kv_usage`` (0..1, ``vllm:kv_cache_usage_perc``). The defaults are the Gateway API Inference Extension's
saturation detector's (``queueDepthThreshold`` 5, ``kvCacheUtilThreshold`` 0.8). When every eligible
endpoint is saturated the EPP sheds the request (429), as the EPP protocol says for a request "dropped
because the servers are under heavy load".
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import aiohttp
import msgspec

from inferlb.errors import InferlbError
from inferlb.policy.picker import EndpointState
from inferlb.policy.telemetry import ServerMetrics, TelemetryParseError, parse_server_metrics

log = logging.getLogger("epp")

#: Seconds between two scrapes of every endpoint's ``/metrics``.
DEFAULT_SCRAPE_INTERVAL_S: Final = 0.5
#: A scrape slower than this (seconds) counts as failed.
DEFAULT_SCRAPE_TIMEOUT_S: Final = 2.0


class PoolError(InferlbError):
    """The pool as given was refused.

    Attributes:
        field: the flag or config field at fault (``--endpoint``, ``endpoints[3].address``, ``--model``).
        message: what is wrong with it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PoolEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One endpoint of the pool as configured.

    Attributes:
        address: ``ip:port`` (an IP literal: Envoy's ORIGINAL_DST cluster connects to the header's value as
            is, without resolving a name).
        weight: relative capacity (> 0; a V100 is 1.0 in the config's GPU profiles).
        prefill_weight: relative prefill capacity in ``weight``'s unit (> 0; the GPU profile's
            ``prefill_relative_capacity``, scaled as ``weight``), what the picker divides prefill tokens by;
            None: ``weight``.
    """

    address: str
    weight: float = 1.0
    prefill_weight: float | None = None

    def __post_init__(self) -> None:
        if self.prefill_weight is not None and not self.prefill_weight > 0:
            raise ValueError(f"prefill_weight must be > 0, got {self.prefill_weight}")


def parse_address(text: str, *, field: str) -> str:
    """``text`` as a canonical ``ip:port`` (IPv6 as ``[ip]:port``).

    Raises:
        PoolError: not an IP literal with a port 1..65535; the message names ``field``.
    """
    host, sep, port = text.strip().rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        number = int(port)
    except ValueError:
        raise PoolError(field, f"{text!r} is not ip:port (an IP literal and a port)") from None
    if not sep or not 1 <= number <= 65535:
        raise PoolError(field, f"{text!r} is not ip:port (port 1..65535)")
    return f"[{ip}]:{number}" if ip.version == 6 else f"{ip}:{number}"


class Saturation(msgspec.Struct, frozen=True, kw_only=True):
    """When an endpoint counts as saturated (see the module doc).

    Attributes:
        queue_depth: waiting requests at which it is saturated (> 0).
        kv_usage: KV-cache usage (0..1] at which it is saturated.
    """

    queue_depth: float = 5.0
    kv_usage: float = 0.8

    def __post_init__(self) -> None:
        if self.queue_depth <= 0:
            raise ValueError(f"queue_depth must be > 0, got {self.queue_depth}")
        if not 0 < self.kv_usage <= 1:
            raise ValueError(f"kv_usage must be in (0, 1], got {self.kv_usage}")


def saturated(state: EndpointState, limits: Saturation, *, waiting: float | None = None) -> bool:
    """True when ``state``'s waiting queue (``waiting`` instead, when given: :meth:`Pool.backlog`) or its
    KV-cache usage reached ``limits``."""
    queue = state.waiting if waiting is None else waiting
    return queue >= limits.queue_depth or state.kv_usage >= limits.kv_usage


class _Live:
    __slots__ = (
        "address",
        "in_flight",
        "kv_usage",
        "last_ok",
        "prefill_weight",
        "scraped",
        "since_scrape",
        "waiting",
        "weight",
    )

    def __init__(self, endpoint: PoolEndpoint) -> None:
        self.address = endpoint.address
        self.weight = endpoint.weight
        self.prefill_weight = endpoint.prefill_weight
        self.in_flight = 0
        self.waiting = 0.0
        self.kv_usage = 0.0
        #: requests sent to it since its last good scrape less those that ended since (see Pool.backlog)
        self.since_scrape = 0
        #: monotonic seconds of the last good scrape; None before the first
        self.last_ok: float | None = None
        #: a scrape finished (good or not): the pool is synced once every endpoint has one
        self.scraped = False


class Pool:
    """The live state of a fixed set of endpoints.

    Args:
        endpoints: the pool (addresses unique).
        stale_after_s: an endpoint whose last good scrape is older than this (seconds) is unhealthy.
        clock: monotonic seconds (injected in tests).

    Raises:
        PoolError: no endpoint, or an address listed twice.
    """

    def __init__(
        self,
        endpoints: Sequence[PoolEndpoint],
        *,
        stale_after_s: float = 3 * DEFAULT_SCRAPE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not endpoints:
            raise PoolError("endpoints", "the pool has no endpoint")
        self._live = {e.address: _Live(e) for e in endpoints}
        if len(self._live) != len(endpoints):
            raise PoolError("endpoints", "the pool lists an endpoint address twice")
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._addresses = tuple(self._live)

    @property
    def clock(self) -> Callable[[], float]:
        """The pool's monotonic clock (seconds); the fair queue's too."""
        return self._clock

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every endpoint's address, in configured order."""
        return self._addresses

    def __contains__(self, address: object) -> bool:
        """True when ``address`` is one of the pool's endpoints."""
        return address in self._live

    @property
    def synced(self) -> bool:
        """Every endpoint was scraped at least once (well or not): the readiness of the EPP."""
        return all(e.scraped for e in self._live.values())

    def snapshot(self) -> list[EndpointState]:
        """What the picker knows of each endpoint now."""
        now = self._clock()
        return [
            EndpointState(
                address=e.address,
                weight=e.weight,
                prefill_weight=e.prefill_weight,
                healthy=e.last_ok is not None and now - e.last_ok <= self.stale_after_s,
                in_flight=e.in_flight,
                waiting=e.waiting,
                kv_usage=e.kv_usage,
            )
            for e in self._live.values()
        ]

    def observed(self, address: str, metrics: ServerMetrics) -> None:
        """A good scrape of ``address``: its queue and KV usage (0 where the server exports none)."""
        e = self._live[address]
        e.waiting = metrics.waiting_requests or 0.0
        e.kv_usage = min(max(metrics.kv_cache_usage or 0.0, 0.0), 1.0)
        e.last_ok = self._clock()
        e.scraped = True
        e.since_scrape = 0

    def scrape_failed(self, address: str) -> None:
        """A failed scrape of ``address``: the last good values stay until they go stale."""
        self._live[address].scraped = True

    def enter(self, address: str) -> None:
        """A request was sent to ``address`` (it counts in its in-flight requests until :meth:`leave`)."""
        live = self._live.get(address)
        if live is not None:
            live.in_flight += 1
            live.since_scrape += 1

    def leave(self, address: str) -> None:
        """A request :meth:`enter` counted on ``address`` ended."""
        live = self._live.get(address)
        if live is not None and live.in_flight > 0:
            live.in_flight -= 1
            live.since_scrape -= 1

    def backlog(self, address: str) -> float:
        """``address``'s waiting queue as estimated now (requests): the last scrape's
        ``vllm:num_requests_waiting`` plus the requests this EPP sent it since that scrape, less those that
        ended since (each end lets one waiting request start), at least 0.

        What the fair queue's admission reads: the scrape alone is up to an interval old, and between two
        scrapes an admission loop would send every waiting request to an endpoint the last scrape showed
        with room (llm-d's flow controller overshot its saturation gate that way until it counted the
        dispatches the scraped metrics had not seen yet).
        """
        e = self._live[address]
        return max(0.0, e.waiting + e.since_scrape)

    def in_flight(self) -> dict[str, int]:
        """Address -> requests in flight (counted from this EPP's streams)."""
        return {a: e.in_flight for a, e in self._live.items()}


class Scraper:
    """Scrapes every endpoint's ``http://address/metrics`` each ``interval_s`` seconds into ``pool``.

    Args:
        pool: where the values go.
        interval_s: seconds between the starts of two rounds.
        timeout_s: a scrape slower than this (seconds) failed.
        on_error: called with the address of each failed scrape (a metric counter).
        on_round: called after each round (the fair queue admits what the fresh values make room for).
    """

    def __init__(
        self,
        pool: Pool,
        *,
        interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
        timeout_s: float = DEFAULT_SCRAPE_TIMEOUT_S,
        on_error: Callable[[str], None] = lambda address: None,
        on_round: Callable[[], None] = lambda: None,
    ) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.on_round = on_round
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._failed_logged: set[str] = set()

    async def scrape_once(self, addresses: Iterable[str] | None = None) -> None:
        """One round over ``addresses`` (all by default), concurrently."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        await asyncio.gather(*(self._scrape(a) for a in (addresses or self.pool.addresses)))
        self.on_round()

    async def _scrape(self, address: str) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"http://{address}/metrics") as resp:
                if resp.status != 200:
                    raise TelemetryParseError(f"/metrics answered {resp.status}")
                metrics = parse_server_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, TelemetryParseError, UnicodeDecodeError) as exc:
            self.pool.scrape_failed(address)
            self.on_error(address)
            if address not in self._failed_logged:
                self._failed_logged.add(address)
                log.warning("scraping %s/metrics failed (%s); logged once until it recovers", address, exc)
            return
        self._failed_logged.discard(address)
        self.pool.observed(address, metrics)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.scrape_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        """Start the loop as a task of the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop the loop and close its HTTP session."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()
