"""The xDS server's lifecycle: load the config, publish its snapshot, serve ADS, follow the config file.

The file is polled (``poll_interval_s``, 0.5 s by default) by content hash: a change that reads the same on
two consecutive polls (:class:`inferlb.config.changes.StableContent`: a file being written in place is not
taken half-done) is re-validated and, when good, published as a new snapshot, which every connected Envoy
receives without a restart. A bad file (or one Envoy could not take, or one that empties the running
config's models, endpoints or tenants without ``allow_empty``) is logged with the field named and the last
good snapshot keeps serving (fail fast at start-up, degrade at run time, as uvicorn does).

Three inputs feed the snapshot, each applied on top of the last good config file: the file itself, the
fleet API (:mod:`xds_server.fleet_state`: register, drain, deregister, weight pins) and telemetry weights
(:meth:`XdsServer.set_telemetry_weights`). Every change goes through one :class:`PushCoalescer`, so a
burst of changes within ``xds.push_debounce_ms`` is one push, never later than ``xds.push_max_delay_ms``
after its first change.

Fleet API changes are durable when a state file is configured (``xds.state_file`` or ``state_file``;
:mod:`xds_server.fleet_store`): each change is written to it (atomically, fsync'ed) before it is applied and
answered, and logged as one INFO line (``fleet api: who=... what=... endpoint=...``); at start the stored
state is restored on top of the config file: drains whose wall-clock end passed while the server was down
end at once, the others keep their end. Changes are serialized by one lock (a config reload, a drain's end
and API calls never interleave), so the stored state is always the served one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from aiohttp import web

from inferlb.adapters.unix_socket import bind_unix_socket
from inferlb.config.changes import StableContent, check_not_emptied
from inferlb.config.checks import (
    HostResolver,
    check_config,
    host_names,
    lookup_hosts,
    resolve_endpoint_hosts,
    system_resolve,
)
from inferlb.config.schema import Config, EndpointConfig, GrpcAddress, parse_config
from inferlb.errors import ConfigError
from xds_server.ads import AggregatedDiscoveryServicer, add_ads_to_server
from xds_server.cache import DEFAULT_GROUP, SnapshotCache, SnapshotInconsistentError
from xds_server.coalesce import PushCoalescer
from xds_server.config_source import ConfigSourceRewriter
from xds_server.fleet_state import (
    FleetState,
    UnknownEndpointError,
    effective_config,
    effective_overrides,
    known_keys,
)
from xds_server.fleet_store import FleetStateFile, StateFileError
from xds_server.http_api import HttpApi, utc_iso
from xds_server.metrics import XdsMetrics
from xds_server.per_type import add_per_type_services
from xds_server.resources.build import build_resources
from xds_server.resources.endpoints import LbEndpointCache, endpoint_key

log = logging.getLogger("xds_server")

#: How often the config file is checked for changes (s).
DEFAULT_POLL_INTERVAL_S = 0.5
#: Streams get this long to finish on shutdown before they are cancelled (s).
DEFAULT_GRACE_S = 2.0
#: The drain timer looks at the wall clock at least this often (s), so a clock step is noticed.
DRAIN_RECHECK_S = 1.0


@dataclass(frozen=True, kw_only=True)
class ConfigLoaded:
    """A config file was read, validated and published.

    Attributes:
        config: the validated config (the file's; fleet API changes apply on top of it).
        digest: sha256 hex of the file's bytes.

    The snapshot follows through the push coalescer (at once when ``xds.push_debounce_ms`` is 0).
    """

    config: Config
    digest: str


def parse_config_bytes(data: bytes, source: str) -> Config:
    """Validate the bytes of a YAML config file (the same errors as
    :func:`inferlb.config.schema.load_config`).

    Raises:
        ConfigError: not UTF-8, not YAML, or invalid (field named).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [("", f"not UTF-8: {exc}")]) from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [("", f"not valid YAML: {exc}")]) from None
    return parse_config(document, source)


class XdsServer:
    """ADS on ``config.xds.listen`` (or ``bind``), or on the Unix socket ``xds.listen_unix`` (mode 0600) when
    set and no ``bind`` is given, fed from a config file that it keeps following.

    Args:
        config_path: the YAML config file.
        cache: the snapshot cache (a fresh one, so a fresh version prefix, by default).
        bind: ``(host, port)`` to listen on instead of the config's ``xds.listen``; port 0 picks a free one.
        poll_interval_s: seconds between config file checks.
        api_bind: ``(host, port)`` for the HTTP API instead of ``xds.api_listen`` (port 0: a free one).
        api_token: the fleet API bearer token, overriding ``xds.api_token`` (``__main__`` passes
            ``INFERLB_XDS_API_TOKEN`` here).
        api_routes: more aiohttp routes for the HTTP API (e.g. a telemetry intake that calls
            :meth:`set_telemetry_weights`); routes under ``/v1/`` get the same bearer-token check.
        resolve: how endpoint host names become IPs (:func:`system_resolve` by default); they are
            resolved at load and registration, and again every ``xds.resolve_interval_ms``.
        state_file: where fleet API changes are stored, overriding ``xds.state_file`` (``__main__``'s
            ``--state-file``); None: the config's (a relative path there is relative to the config file's
            directory), or nowhere when it sets none.

    Attributes:
        cache, servicer: the snapshot cache and the ADS servicer (its ``stats`` and ``clients``).
        metrics: the Prometheus metrics (:class:`~xds_server.metrics.XdsMetrics`).
        config: the last good config file (None before :meth:`start`); fleet changes apply on top.
        effective: what is served: ``config`` with the fleet API's endpoint changes (None before start).
        fleet: the fleet API's changes (:class:`~xds_server.fleet_state.FleetState`).
        state_path: the state file in use (None: changes are not stored), set by :meth:`start`.
        resolved_hosts: ``{host name: IP}`` of the endpoints written with a host name.
        port: the bound ADS port (0 before :meth:`start`, and on a Unix socket); ``api_port``: the HTTP
            API's (0 when off).
        unix_path: the Unix socket ADS listens on (``xds.listen_unix``), or None on TCP.
        reload_errors: how many times a changed file was refused; ``publish_errors``: failed publishes.
        coalescer: the :class:`~xds_server.coalesce.PushCoalescer` every change goes through.
    """

    def __init__(
        self,
        config_path: str | Path,
        *,
        cache: SnapshotCache | None = None,
        bind: tuple[str, int] | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        api_bind: tuple[str, int] | None = None,
        api_token: str | None = None,
        api_routes: Sequence[web.RouteDef] = (),
        resolve: HostResolver = system_resolve,
        state_file: str | Path | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self.state_path: Path | None = None
        self._state_file = Path(state_file) if state_file is not None else None
        self._store: FleetStateFile | None = None
        self._fleet_lock = asyncio.Lock()
        self._stable = StableContent()
        self.cache = cache or SnapshotCache()
        self.metrics = XdsMetrics(self)
        self.servicer = AggregatedDiscoveryServicer(self.cache, on_push=self.metrics.observe_push)
        self.config: Config | None = None
        self.effective: Config | None = None
        self.fleet = FleetState()
        self.resolved_hosts: Mapping[str, str] = {}
        self.telemetry_weights: Mapping[str, int] = {}
        self.telemetry_classes: Mapping[str, tuple[str, ...]] = {}
        self.port = 0
        self.host = ""
        self.unix_path: str | None = None
        self.api_port = 0
        self.reload_errors = 0
        self.publish_errors = 0
        self.coalescer: PushCoalescer | None = None
        self._bind = bind
        self._api_bind = api_bind
        self._api_token = api_token
        self._api_routes = tuple(api_routes)
        self._poll_interval_s = poll_interval_s
        self._resolve = resolve
        self._resolver: asyncio.Task[None] | None = None
        self._digest = ""
        self._server: grpc.aio.Server | None = None
        self._poller: asyncio.Task[None] | None = None
        self._drainer: asyncio.Task[None] | None = None
        self._drain_wake = asyncio.Event()
        self._started_listen: GrpcAddress | None = None
        self._api: Any = None
        self._groups: dict[str, tuple[Config, LbEndpointCache]] = {}
        self._groups_owner: Config | None = None
        #: per group: the per-type services' variant (EDS and RDS over those services, not ADS)
        self._per_type_sources: dict[str, ConfigSourceRewriter] = {}
        self._known_keys: set[str] = set()
        self._known_owner: Config | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load and publish the config, bind and start the gRPC server (and the HTTP API when
        ``xds.api_listen`` is set), start following the file.

        Raises:
            ConfigError: the config file is missing or invalid, or the stored fleet changes do not fit it
                (start-up fails fast; the source names the state file too).
            StateFileError: the state file is in use by another server, unreadable, corrupt or cannot be
                written.
            SnapshotInconsistentError: the config yields resources Envoy would reject.
            RuntimeError: a listen address cannot be bound.
        """
        try:
            data = await asyncio.to_thread(self.config_path.read_bytes)
        except OSError as exc:
            raise ConfigError(str(self.config_path), [("", f"cannot read: {exc.strerror or exc}")]) from None
        try:
            config = await self._restore_and_accept(data)
        except BaseException:
            if self._store is not None:
                self._store.close()
                self._store = None
            raise
        # the first snapshot goes out at once: Envoy must not wait a debounce to start
        self._publish_now(time.monotonic(), raise_errors=True)
        self.coalescer = PushCoalescer(
            self._publish_now,
            debounce_s=config.xds.push_debounce_ms / 1000,
            max_delay_s=config.xds.push_max_delay_ms / 1000,
        )
        self._started_listen = config.xds.grpc_address()
        server = grpc.aio.server()
        add_ads_to_server(self.servicer, server)
        add_per_type_services(server, self.servicer, self.cache)
        unix = config.xds.listen_unix if self._bind is None else None
        if unix is not None:
            bind_unix_socket(unix.path, "xds.listen_unix", server.add_insecure_port)
            host, bound, address = "", 0, str(unix)
            self.unix_path = unix.path
        else:
            host, port = self._bind or (config.xds.listen.host, config.xds.listen.port)
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                bound = server.add_insecure_port(address)
            except RuntimeError as exc:
                raise RuntimeError(f"cannot listen on {address}: {exc}") from None
            if bound == 0:  # older grpcio reports a failed bind as port 0
                raise RuntimeError(f"cannot listen on {address}")
            address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        await server.start()
        self._server, self.host, self.port = server, host, bound
        await self._start_api(config)
        self._poller = asyncio.create_task(self._follow_config(), name="xds-config-poller")
        self._drainer = asyncio.create_task(self._expire_drains(), name="xds-drain-timer")
        self._resolver = asyncio.create_task(self._follow_dns(), name="xds-host-resolver")
        log.info("xds_server ready on %s", address)

    async def _start_api(self, config: Config) -> None:
        listen = config.xds.api_listen
        if self._api_bind is None and listen is None:
            return
        host, port = self._api_bind or (listen.host, listen.port)  # type: ignore[union-attr]
        token = self._api_token or config.xds.api_token
        api = HttpApi(self, token=token, routes=self._api_routes)
        self.api_port = await api.start(host, port)
        self._api = api

    async def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Stop following the file, the timers and the HTTP API, and stop the gRPC server, giving
        streams ``grace_s`` seconds."""
        for task in (self._poller, self._drainer, self._resolver):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._poller = self._drainer = self._resolver = None
        if self.coalescer is not None:
            await self.coalescer.close()
        if self._api is not None:
            await self._api.stop()
            self._api = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._store is not None:
            self._store.close()
            self._store = None

    async def wait_for_termination(self) -> None:
        """Wait until the gRPC server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- the state file -------------------------------------------------------------------------------
    def _state_path_for(self, config: Config) -> Path | None:
        if self._state_file is not None:
            return self._state_file
        if config.xds.state_file is None:
            return None
        path = Path(config.xds.state_file)
        return path if path.is_absolute() else self.config_path.parent / path

    async def _restore_and_accept(self, data: bytes) -> Config:
        """Start-up: lock and read the state file (when one is configured), end the drains whose time
        passed, then accept the config file with the restored changes on top and store the result."""
        source = str(self.config_path)
        config = parse_config_bytes(data, source)
        path = self._state_path_for(config)
        fleet_source = source
        if path is not None:
            store = FleetStateFile(path)
            store.lock()
            self._store, self.state_path = store, path
            restored = await asyncio.to_thread(store.load)
            if restored is None:
                log.info("fleet state file %s does not exist yet: starting with no fleet API changes", path)
                restored = FleetState()
            now = time.time()
            ended = sorted(k for k, until in restored.draining.items() if until <= now)
            self.fleet = restored.expire(now)
            if ended:
                log.info("fleet state: drains that ended while the server was down, removing %s", ended)
            fleet_source = f"{source} with the fleet API changes stored in {path}"
        else:
            log.info("no xds.state_file: fleet API changes are kept in memory only (a restart forgets them)")
        await self._accept_file(data, config=config, fleet_source=fleet_source)
        if self._store is not None:
            await asyncio.to_thread(self._store.save, self.fleet)  # fails fast when it cannot be written
            f = self.fleet
            log.info(
                "fleet state restored from %s: %d registered, %d draining, %d deregistered, %d weight pins",
                self.state_path, len(f.registered), len(f.draining), len(f.hidden), len(f.weight_overrides),
            )  # fmt: skip
        self._stable = StableContent(taken=self._digest)
        return config

    async def _store_fleet(self, fleet: FleetState) -> None:
        """Write ``fleet`` to the state file (when there is one; the caller holds the fleet lock).

        Raises:
            StateFileError: it cannot be written.
        """
        if self._store is not None:
            await asyncio.to_thread(self._store.save, fleet)

    async def _store_derived(self, fleet: FleetState) -> None:
        """Store a state derived from the stored one and the config or the clock (a reload's
        reconciliation, a drain's end): a restart derives it again, so a failed write is logged, not
        raised."""
        try:
            await self._store_fleet(fleet)
        except StateFileError as exc:
            log.error("%s (the next change retries)", exc)

    # -- the config file ------------------------------------------------------------------------------
    async def _accept_file(
        self, data: bytes, *, config: Config | None = None, fleet_source: str | None = None
    ) -> ConfigLoaded:
        """Validate a file's bytes (``config``: already parsed from them) with the current fleet changes on
        top; on success make it current. ``fleet_source`` names the combination in errors."""
        digest = hashlib.sha256(data).hexdigest()
        source = str(self.config_path)
        if config is None:
            config = parse_config_bytes(data, source)
        # the checks ext_proc runs too (no emptied section, tokenizers, host names), so both serve this file
        # or neither does
        check_not_emptied(self.config, config, source)
        checked = await check_config(config, source, resolve=self._resolve)
        fleet = self.fleet.reconcile(config)
        effective = effective_config(config, fleet, fleet_source or source)
        # endpoints registered through the fleet API are not in the file: resolve those too
        resolved: Mapping[str, str] = await resolve_endpoint_hosts(
            effective, source, self._resolve, known=checked.resolved_hosts
        )
        # build once to refuse anything Envoy could not take before it replaces the last good file
        build_resources(effective, source, resolved_hosts=resolved)
        self.config, self.effective, self.fleet = config, effective, fleet
        self.resolved_hosts, self._digest = resolved, digest
        return ConfigLoaded(config=config, digest=digest)

    async def reload_if_changed(self) -> ConfigLoaded | None:
        """Check the config file once; when its bytes changed, read the same on the previous check too
        (:class:`~inferlb.config.changes.StableContent`) and are good, make it current and push.

        Returns:
            what was accepted, or None when the file is unchanged, changed but not yet stable, unreadable
            or refused (logged; the last good snapshot keeps serving).
        """
        try:
            data = await asyncio.to_thread(self.config_path.read_bytes)
        except OSError as exc:
            # an editor replacing the file can make it vanish for a moment: keep serving, retry next poll
            log.warning("config %s unreadable, keeping the last good config: %s", self.config_path, exc)
            return None
        # taken only once two polls in a row read the same bytes: never a file caught mid-write; a refused
        # content is reported once, not every poll
        self._stable, take = self._stable.observe(hashlib.sha256(data).hexdigest())
        if not take:
            return None
        async with self._fleet_lock:
            before = self.fleet
            try:
                loaded = await self._accept_file(data)
            except ConfigError as exc:
                self.reload_errors += 1
                log.error("config change refused, the last good config keeps serving: %s", exc)
                return None
            if self.fleet != before:
                await self._store_derived(self.fleet)
        if self._state_path_for(loaded.config) != self.state_path:
            log.warning("xds.state_file changed: takes effect on restart (still: %s)", self.state_path)
        if (
            self._bind is None
            and self._started_listen is not None
            and loaded.config.xds.grpc_address() != self._started_listen
        ):
            log.warning(
                "xds.listen/listen_unix changed to %s: takes effect on restart",
                loaded.config.xds.grpc_address(),
            )
        log.info("config %s accepted", self.config_path)
        self._changed()
        return loaded

    async def _follow_config(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.reload_if_changed()

    # -- host names ---------------------------------------------------------------------------------
    async def refresh_host_addresses(self) -> dict[str, str]:
        """Resolve the served endpoints' host names again and push when an address changed (a model server
        rescheduled behind a DNS name). A name that no longer resolves keeps its last address (logged):
        one failed lookup must not empty a cluster.

        Returns:
            ``{host name: new IP}`` of the names whose address changed (empty: nothing pushed).
        """
        assert self.effective is not None
        names = host_names(self.effective)
        if not names:
            return {}
        resolved, failed = await lookup_hosts(names, self._resolve)
        for name, why in failed.items():
            log.warning("host name %r does not resolve now (%s): keeping %s", name, why,
                        self.resolved_hosts.get(name, "<none>"))  # fmt: skip
        # names may have come or gone while resolving (reload, registration): only update what is still
        # served, on top of the current map
        served = set(host_names(self.effective))
        changed = {n: ip for n, ip in resolved.items() if n in served and self.resolved_hosts.get(n) != ip}
        if changed:
            log.info("endpoint host addresses changed: %s", changed)
            self.resolved_hosts = {**self.resolved_hosts, **changed}
            self._changed()
        return changed

    async def _follow_dns(self) -> None:
        while True:
            assert self.config is not None
            interval_ms = self.config.xds.resolve_interval_ms
            if interval_ms == 0:
                # off: look again now and then in case a reload turns it on
                await asyncio.sleep(self._poll_interval_s)
                continue
            await asyncio.sleep(interval_ms / 1000)
            await self.refresh_host_addresses()

    # -- publishing -----------------------------------------------------------------------------------
    def _changed(self) -> None:
        if self.coalescer is None:
            self._publish_now(time.monotonic())
        else:
            self.coalescer.changed()

    def _group_configs(self) -> dict[str, tuple[Config, LbEndpointCache]]:
        """Per snapshot group: the config it is built from and its memo. The default group is the effective
        config; each ``xds.node_groups`` entry is that config with the gateway moved to the group's
        locality. Rebuilt (memos emptied) when the effective config changes; memos are bounded so a stream
        of telemetry weights cannot grow them forever."""
        eff = self.effective
        assert eff is not None
        bound = 4 * len(eff.endpoints) + 1024
        if self._groups_owner is not eff or any(len(m) > bound for _, m in self._groups.values()):
            groups = {DEFAULT_GROUP: (eff, LbEndpointCache())}
            for name, g in eff.xds.node_groups.items():
                # model_copy shares the endpoint objects, so the memo keys (object ids) stay valid
                gateway = eff.gateway.model_copy(update={"region": g.region, "zone": g.zone})
                groups[name] = (eff.model_copy(update={"gateway": gateway}), LbEndpointCache())
            reconnect = (eff.xds.reconnect_base_ms, eff.xds.reconnect_max_ms)
            kept = {g: r for g, r in self._per_type_sources.items() if r.reconnect_ms == reconnect}
            self._per_type_sources = {g: kept.get(g) or ConfigSourceRewriter(reconnect) for g in groups}
            self._groups, self._groups_owner = groups, eff
        return self._groups

    def _publish_now(self, changed_at: float, *, raise_errors: bool = False) -> None:
        """Build the snapshots of the current inputs (the default group and each ``xds.node_groups``
        group) and publish them (the coalescer's publish callback)."""
        assert self.effective is not None
        source = str(self.config_path)
        overrides = effective_overrides(self.fleet, self.telemetry_weights, self.telemetry_classes)
        groups = self._group_configs()
        try:
            built = {
                group: build_resources(
                    config, source, resolved_hosts=self.resolved_hosts, overrides=overrides, lb_cache=memo
                )
                for group, (config, memo) in groups.items()
            }
            for group, resources in built.items():
                # the per-type services' variant points EDS and RDS at themselves instead of ADS
                per_type = self._per_type_sources[group].apply(resources)
                self.cache.set_resources(resources, group=group, changed_at=changed_at, per_type=per_type)
        except (ConfigError, SnapshotInconsistentError) as exc:
            if raise_errors:
                raise
            self.publish_errors += 1
            log.error("snapshot refused, the last good one keeps serving: %s", exc)
            return
        for stale in set(self.cache.groups()) - set(groups):
            self.cache.drop(stale)  # a node group left the config: its Envoys fall back to the default
        snapshot = self.cache.snapshot()
        assert snapshot is not None
        versions = ", ".join(f"{t.rsplit('.', 1)[-1]}={v}" for t, v in snapshot.versions.items())
        log.info("snapshot published (%d groups): %s", len(groups), versions)

    # -- telemetry weights ----------------------------------------------------------------------------
    def set_telemetry_weights(
        self, weights: Mapping[str, int], length_classes: Mapping[str, tuple[str, ...]] | None = None
    ) -> None:
        """Replace the telemetry weights: ``{endpoint_key: Envoy weight}`` (``host:port`` as in the config;
        weights below 1 are sent as 1). Endpoints not named get their capacity weight; a fleet API weight
        pin wins over a telemetry weight. ``length_classes``: ``{endpoint_key: the confined length classes
        it may serve}`` for the length-aware endpoints whose live classes differ from their profile's
        (:func:`inferlb.policy.length_aware.live_class_sets`); None or not named: the profile's. The push is
        coalesced with every other change."""
        clean = {k: max(1, int(w)) for k, w in weights.items()}
        classes = {k: tuple(v) for k, v in (length_classes or {}).items()}
        if clean == self.telemetry_weights and classes == self.telemetry_classes:
            return
        self.telemetry_weights = clean
        self.telemetry_classes = classes
        self._changed()

    # -- the fleet API --------------------------------------------------------------------------------
    def _known(self) -> set[str]:
        """The endpoint keys of what is served now, computed once per effective config."""
        assert self.config is not None and self.effective is not None
        if self._known_owner is not self.effective:
            self._known_keys = known_keys(self.config, self.fleet)
            self._known_owner = self.effective
        return self._known_keys

    def _require_known(self, key: str) -> None:
        if key not in self._known():
            raise UnknownEndpointError(key)

    def _apply_fleet(self, fleet: FleetState) -> None:
        """Adopt a fleet state that adds no new host name (removals, drains, pins): no resolution."""
        assert self.config is not None
        # re-validating the whole fleet costs ~0.5 s at 10,000 endpoints: only when its list changed
        if fleet.registered != self.fleet.registered or fleet.hidden != self.fleet.hidden:
            self.effective = effective_config(self.config, fleet, "<fleet api>")
        self.fleet = fleet
        self._drain_wake.set()
        self._changed()

    async def _commit(self, fleet: FleetState, actor: str, what: str) -> None:
        """Store, apply and log one fleet API change (the caller holds the fleet lock and has validated
        it): stored first, so a change is applied only once it is durable.

        Raises:
            StateFileError: it cannot be stored; nothing changes.
        """
        await self._store_fleet(fleet)
        self._apply_fleet(fleet)
        stored = "stored" if self.state_path is not None else "not stored (no xds.state_file)"
        log.info("fleet api: who=%s what=%s %s", actor, what, stored)

    async def register_endpoint(self, endpoint: EndpointConfig, *, actor: str = "-") -> None:
        """Add an endpoint (or replace the one at its address, cancelling its drain and weight pin), store
        and push. ``actor``: who asked, for the log line.

        Raises:
            ConfigError: the fleet with it is invalid (unknown model, version or GPU type, an address
                already taken by another socket, a host name that does not resolve); nothing changes.
            StateFileError: it cannot be stored; nothing changes.
        """
        async with self._fleet_lock:
            assert self.config is not None
            fleet = self.fleet.register(endpoint)
            effective = effective_config(self.config, fleet, "<fleet api>")
            resolved = await resolve_endpoint_hosts(effective, "<fleet api>", self._resolve)
            what = (
                f"register endpoint={endpoint_key(endpoint)} model={endpoint.model} "
                f"version={endpoint.version or '-'} gpu={endpoint.gpu} name={endpoint.display_name}"
            )
            previous, self.resolved_hosts = self.resolved_hosts, resolved
            try:
                await self._commit(fleet, actor, what)
            except StateFileError:
                self.resolved_hosts = previous
                raise

    async def drain_endpoint(self, key: str, drain_ms: int | None = None, *, actor: str = "-") -> float:
        """Send an endpoint as DRAINING now and remove it after ``drain_ms`` (``xds.drain_period_ms`` by
        default); draining it again keeps the earlier end. Returns its removal time (Unix s, wall clock:
        a restart keeps it).

        Raises:
            UnknownEndpointError: no such endpoint.
            StateFileError: it cannot be stored; nothing changes.
        """
        async with self._fleet_lock:
            assert self.config is not None
            self._require_known(key)
            period = self.config.xds.drain_period_ms if drain_ms is None else drain_ms
            fleet = self.fleet.drain(key, time.time() + period / 1000)
            until = fleet.draining[key]
            await self._commit(fleet, actor, f"drain endpoint={key} drain_ms={period} until={utc_iso(until)}")
        return until

    async def undrain_endpoint(self, key: str, *, actor: str = "-") -> bool:
        """Cancel the drain of an endpoint still draining: it is served again as before. Returns whether
        it was draining (False: nothing changed, nothing logged).

        Raises:
            UnknownEndpointError: no such endpoint (one whose drain already ended was removed: register
                it again).
            StateFileError: it cannot be stored; nothing changes.
        """
        async with self._fleet_lock:
            self._require_known(key)
            if key not in self.fleet.draining:
                return False
            await self._commit(self.fleet.undrain(key), actor, f"undrain endpoint={key}")
        return True

    async def deregister_endpoint(self, key: str, *, actor: str = "-") -> None:
        """Remove an endpoint now (no drain).

        Raises:
            UnknownEndpointError: no such endpoint.
            StateFileError: it cannot be stored; nothing changes.
        """
        async with self._fleet_lock:
            self._require_known(key)
            await self._commit(self.fleet.deregister(key), actor, f"deregister endpoint={key}")

    async def override_weight(self, key: str, weight: int | None, *, actor: str = "-") -> None:
        """Pin an endpoint's Envoy weight (>= 1), or clear the pin with None.

        Raises:
            UnknownEndpointError: no such endpoint.
            ValueError: weight below 1.
            StateFileError: it cannot be stored; nothing changes.
        """
        async with self._fleet_lock:
            self._require_known(key)
            fleet = self.fleet.override_weight(key, weight)
            await self._commit(fleet, actor, f"weight endpoint={key} weight={_weight_text(weight)}")

    async def override_weights(self, weights: Mapping[str, int | None], *, actor: str = "-") -> None:
        """Pin (or with None clear) the Envoy weights of many endpoints in one change (one push, one
        write, one log line).

        Raises:
            UnknownEndpointError: one of the keys names no endpoint (nothing changes).
            ValueError: a weight below 1 (nothing changes).
            StateFileError: it cannot be stored; nothing changes.
        """
        async with self._fleet_lock:
            known = self._known()
            fleet = self.fleet
            for key, weight in weights.items():
                if key not in known:
                    raise UnknownEndpointError(key)
                fleet = fleet.override_weight(key, weight)
            pins = ",".join(f"{k}={_weight_text(w)}" for k, w in weights.items())
            await self._commit(fleet, actor, f"weights endpoints={pins or '-'}")

    async def _expire_drains(self) -> None:
        while True:
            self._drain_wake.clear()
            due = self.fleet.next_expiry()
            if due is None:
                await self._drain_wake.wait()
                continue
            delay = due - time.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drain_wake.wait(), min(delay, DRAIN_RECHECK_S))
                continue
            async with self._fleet_lock:
                expired = self.fleet.expire(time.time())
                gone = sorted(set(self.fleet.draining) - set(expired.draining))
                if not gone:
                    continue
                log.info("drain period over, removing %s", gone)
                await self._store_derived(expired)
                self._apply_fleet(expired)


def _weight_text(weight: int | None) -> str:
    return "null" if weight is None else str(weight)
