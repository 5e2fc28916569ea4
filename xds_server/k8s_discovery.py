"""Kubernetes discovery: follow EndpointSlices, pods and ``InferencePool`` objects and hand the endpoints
they map to (:mod:`xds_server.k8s_mapping`) to the xDS server.

Each followed collection is a :class:`Reflector` (client-go's name for the same loop): list, then watch
from the list's ``resourceVersion``; every event moves its in-memory copy and the version on. A watch
that ends or fails is resumed from the last version seen; a 410 Gone (that version is compacted away)
lists again; an API server that is down (refused, reset, 5xx) is retried after a backoff that doubles from
``backoff_base_ms`` to ``backoff_max_ms`` and is reset by the first event or list that succeeds, so a
restarted API server is picked up again without restarting inferlb. Meanwhile the last known endpoints
keep serving.

Followed collections (``discovery.kubernetes``): per Service, its EndpointSlices (label selector
``kubernetes.io/service-name=NAME``); when ``inference_pools`` is set, every ``InferencePool`` and every
pod of the namespace (pools are matched by name, pods by each pool's ``spec.selector``, locally, so a pool
changing its selector needs no new watch). RBAC: ``list`` and ``watch`` on ``endpointslices``
(discovery.k8s.io), ``pods`` (core) and ``inferencepools`` (inference.networking.k8s.io).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inferlb.config.schema import KubernetesDiscovery
from xds_server.k8s_api import (
    ENDPOINT_SLICES,
    INFERENCE_POOLS,
    PODS,
    Kind,
    KubeApi,
    KubeUnavailable,
    WatchGone,
)
from xds_server.k8s_mapping import (
    SERVICE_NAME_LABEL,
    Mapped,
    endpoints_from_pool,
    endpoints_from_slices,
    merge,
)

log = logging.getLogger("xds_server.k8s")

#: How long one watch request may last before it is made again from its last version (s). client-go's
#: reflectors pick 5-10 min (``minWatchTimeout``); the API server itself ends watches after 30-60 min.
WATCH_RESTART_S = 300.0


@dataclass
class ReflectorStats:
    """Counters of one reflector: ``lists`` (1 at start, +1 per 410), ``watches`` (watch requests),
    ``gone`` (410s), ``failures`` (other errors: connection refused or dropped, 5xx)."""

    lists: int = 0
    watches: int = 0
    gone: int = 0
    failures: int = 0


@dataclass
class Reflector:
    """An in-memory copy of one collection, kept by list + watch.

    Attributes:
        objects: ``{namespace/name: object JSON}``.
        resource_version: the last version seen (None before the first list).
        synced: True once the first list landed.
        watch_restart_s: each watch request is ended after this long and made again from the last
            version (:data:`WATCH_RESTART_S` by default): a connection left half-open by an API server
            that vanished without a reset sends nothing and would otherwise hang the watch forever.
    """

    def __post_init__(self) -> None:
        if self.watch_restart_s <= 0:
            self.watch_restart_s = WATCH_RESTART_S

    api: KubeApi
    kind: Kind
    namespace: str
    label_selector: str | None
    on_change: Callable[[], None]
    backoff_base_s: float
    backoff_max_s: float
    watch_restart_s: float = 0.0
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    resource_version: str | None = None
    synced: bool = False
    stats: ReflectorStats = field(default_factory=ReflectorStats)

    @property
    def what(self) -> str:
        """The collection, for logs: ``endpointslices in default (kubernetes.io/service-name=x)``."""
        sel = f" ({self.label_selector})" if self.label_selector else ""
        return f"{self.kind.plural} in {self.namespace}{sel}"

    async def relist(self) -> None:
        """List the collection and replace the copy (an object gone while no watch ran is dropped)."""
        self.stats.lists += 1
        items, version = await self.api.list(self.kind, self.namespace, self.label_selector)
        self.objects = {_key(o): o for o in items}
        self.resource_version = version
        self.synced = True
        self.on_change()

    def apply(self, event_type: str, obj: dict[str, Any]) -> None:
        """Apply one watch event (``ADDED``/``MODIFIED`` put, ``DELETED`` drop, ``BOOKMARK`` only moves the
        version); the version follows ``obj.metadata.resourceVersion``."""
        meta = obj.get("metadata") or {}
        version = meta.get("resourceVersion")
        if version:
            self.resource_version = str(version)
        if event_type in ("ADDED", "MODIFIED"):
            self.objects[_key(obj)] = obj
        elif event_type == "DELETED":
            self.objects.pop(_key(obj), None)
        else:
            return
        self.on_change()

    async def run(self) -> None:
        """List, then watch forever (module docstring); cancel to stop."""
        delay = self.backoff_base_s
        while True:
            try:
                if self.resource_version is None:
                    await self.relist()
                    delay = self.backoff_base_s
                self.stats.watches += 1
                assert self.resource_version is not None
                stream = self.api.watch(self.kind, self.namespace, self.resource_version, self.label_selector)
                with contextlib.suppress(TimeoutError):
                    async with contextlib.aclosing(stream), asyncio.timeout(self.watch_restart_s):
                        async for event_type, obj in stream:
                            self.apply(event_type, obj)
                            delay = self.backoff_base_s
                continue  # a clean end of the stream, or its time is up: resume from the last version
            except WatchGone:
                self.stats.gone += 1
                listing = self.resource_version is None
                log.info("%s: resourceVersion %s is gone (410), listing again", self.what,
                         self.resource_version)  # fmt: skip
                self.resource_version = None
                if not listing:
                    continue  # else a list answered 410 itself: back off before the next one
            except KubeUnavailable as exc:
                self.stats.failures += 1
                log.warning("%s: %s; retrying in %.1f s (resuming from resourceVersion %s)", self.what, exc,
                            delay, self.resource_version)  # fmt: skip
            except Exception:  # an answer the client could not read: never let the watch die
                self.stats.failures += 1
                log.exception("%s: unexpected failure; retrying in %.1f s", self.what, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


class Discovery:
    """Follows what ``discovery.kubernetes`` names and calls ``on_endpoints`` with the mapped endpoints
    after every change (from the event loop; the callback should be cheap, e.g. schedule a push).

    Args:
        settings: the config's ``discovery.kubernetes``.
        api: the API server seam (:class:`~xds_server.k8s_api.LightkubeApi` in production).
        on_endpoints: called with a :class:`~xds_server.k8s_mapping.Mapped` once every collection has
            listed, and then after changes that alter the result (the events handled in one turn of the
            event loop are one call).
        watch_restart_s: :attr:`Reflector.watch_restart_s`.

    Attributes:
        reflectors: one per followed collection. ``current``: the last mapped result (None before sync).
    """

    def __init__(
        self,
        settings: KubernetesDiscovery,
        api: KubeApi,
        on_endpoints: Callable[[Mapped], None],
        *,
        watch_restart_s: float = WATCH_RESTART_S,
    ) -> None:
        self.settings = settings
        self.api = api
        self._on_endpoints = on_endpoints
        self.current: Mapped | None = None
        self._scheduled = False
        #: per object key: (the object it was mapped from, its mapping); objects are replaced, never
        #: changed in place, so identity says whether it is still current
        self._slice_memo: dict[str, tuple[dict[str, Any], Mapped]] = {}
        self._pod_memo: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any], Mapped]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        ns = settings.namespace
        base, top = settings.backoff_base_ms / 1000, settings.backoff_max_ms / 1000

        def reflector(kind: Kind, selector: str | None) -> Reflector:
            return Reflector(api, kind, ns, selector, self._changed, base, top, watch_restart_s)

        self.slices = {
            svc: reflector(ENDPOINT_SLICES, f"{SERVICE_NAME_LABEL}={svc}") for svc in settings.services
        }
        self.pools = reflector(INFERENCE_POOLS, None) if settings.inference_pools else None
        self.pods = reflector(PODS, None) if settings.inference_pools else None
        self.reflectors: list[Reflector] = [*self.slices.values()]
        if self.pools is not None and self.pods is not None:
            self.reflectors += [self.pools, self.pods]

    def mapped(self) -> Mapped:
        """The endpoints of what the reflectors hold now (pure mapping), with a problem per named
        InferencePool that does not exist (yet)."""
        parts: list[Mapped] = []
        slice_memo: dict[str, tuple[dict[str, Any], Mapped]] = {}
        for r in self.slices.values():
            for key, obj in r.objects.items():
                hit = self._slice_memo.get(key)
                slice_memo[key] = (
                    hit if hit is not None and hit[0] is obj else (obj, endpoints_from_slices([obj]))
                )
                parts.append(slice_memo[key][1])
        self._slice_memo = slice_memo
        if self.pools is not None and self.pods is not None:
            by_name = {o.get("metadata", {}).get("name"): o for o in self.pools.objects.values()}
            pod_memo: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any], Mapped]] = {}
            for name in self.settings.inference_pools:
                pool = by_name.get(name)
                if pool is None:
                    ns = self.settings.namespace
                    parts.append(Mapped(problems=(f"InferencePool {ns}/{name}: not found",)))
                    continue
                spec_problems = endpoints_from_pool(pool, ())  # the pool's own problems, if any
                if spec_problems.problems:
                    parts.append(spec_problems)
                    continue
                for key, pod in self.pods.objects.items():
                    pod_hit = self._pod_memo.get((name, key))
                    fresh = pod_hit is not None and pod_hit[0] is pool and pod_hit[1] is pod
                    pod_memo[name, key] = (
                        pod_hit
                        if pod_hit is not None and fresh
                        else (pool, pod, endpoints_from_pool(pool, [pod]))
                    )
                    parts.append(pod_memo[name, key][2])
            self._pod_memo = pod_memo
        return merge(parts)

    def _changed(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if not all(r.synced for r in self.reflectors):
            return
        result = self.mapped()
        if result == self.current:
            return
        new_problems = set(result.problems) - set(self.current.problems if self.current else ())
        for p in sorted(new_problems):
            log.warning("kubernetes discovery: %s (left out)", p)
        self.current = result
        self._on_endpoints(result)

    async def start(self) -> None:
        """Start one task per reflector (they list, then watch)."""
        for r in self.reflectors:
            self._tasks.append(asyncio.create_task(r.run(), name=f"k8s-{r.kind.plural}"))

    async def stop(self) -> None:
        """Cancel the watches and close the API client."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        await self.api.close()
