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

Endpoints discovered in Kubernetes (``discovery.kubernetes``; :mod:`xds_server.k8s_discovery`) are added
to the file's ``endpoints`` as they change (the file's entry wins at a shared address, the fleet API's
changes apply on top of both, a terminating or not-ready one is sent DRAINING); they are not stored, since
a restart lists them again. Those the config cannot serve (unknown model, version or GPU profile) are
logged and left out, and a config reload fits them to the new file.

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
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from inferlb.adapters.state_redis import RedisDocument, SharedStateUnavailableError
from inferlb.adapters.tls import PemFiles, Reloader, pem_reloader
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
from inferlb.config.schema import (
    Config,
    EndpointConfig,
    GrpcAddress,
    KubernetesDiscovery,
    ServiceTls,
    parse_config_yaml,
)
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
from xds_server.fleet_store import FileFleetStore, FleetChange, FleetStore, FleetStoreError, RedisFleetStore
from xds_server.http_api import HttpApi, utc_iso
from xds_server.k8s_api import KubeApi, KubeUnavailable, LightkubeApi, kube_config
from xds_server.k8s_discovery import Discovery
from xds_server.k8s_mapping import Mapped, fit_to_config
from xds_server.metrics import XdsMetrics
from xds_server.per_type import add_per_type_services
from xds_server.resources.build import build_resources
from xds_server.resources.endpoints import EndpointOverride, LbEndpointCache, endpoint_key

log = logging.getLogger("xds_server")

#: How often the config file is checked for changes (s).
DEFAULT_POLL_INTERVAL_S = 0.5
#: Streams get this long to finish on shutdown before they are cancelled (s).
DEFAULT_GRACE_S = 2.0
#: The longest one step of :meth:`XdsServer.stop` may take beyond its grace (s): closing the fleet store's
#: connections, the HTTP API, the gRPC server. A step that runs past it is logged and left behind, so a
#: stop never hangs on a connection a dead peer (a restarted Redis) leaves half-open.
STOP_STEP_TIMEOUT_S = 10.0
#: The drain timer looks at the wall clock at least this often (s), so a clock step is noticed.
DRAIN_RECHECK_S = 1.0


def _certificate_configuration(pem: PemFiles) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(pem.private_key, pem.cert_chain)], root_certificates=pem.client_ca
    )


def _reloading_credentials(reloader: Reloader[PemFiles]) -> grpc.ServerCredentials:
    """``xds.tls``: mutual TLS server credentials whose files grpc fetches again before each new connection's
    handshake, used when they changed (as :func:`ext_proc.grpc_tls.grpc_server_credentials`, which a service
    layer apart from this one may not import)."""

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        changed = reloader.poll()
        return None if changed is None else _certificate_configuration(changed)

    return grpc.dynamic_ssl_server_credentials(
        _certificate_configuration(reloader.current), fetch, require_client_authentication=True
    )


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
    """Validate the bytes of a YAML config file (:func:`inferlb.config.schema.parse_config_yaml`: the same
    errors as :func:`inferlb.config.schema.load_config` and ext_proc's reload).

    Raises:
        ConfigError: not UTF-8, not YAML (a repeated key, hostile aliases included), or invalid (field
            named).
    """
    return parse_config_yaml(data, source)


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
        state_redis_url: a Redis fleet store shared with other servers, overriding the config's
            (``xds.state_redis_url``; ``__main__``'s ``--state-redis-url``); its key, timeout and poll
            interval are the config's. Not with ``state_file``.
        kube_api: makes the Kubernetes API client from ``discovery.kubernetes`` (default:
            :class:`~xds_server.k8s_api.LightkubeApi` with :func:`~xds_server.k8s_api.kube_config`).

    Raises:
        ValueError: both ``state_file`` and ``state_redis_url`` given.

    Attributes:
        cache, servicer: the snapshot cache and the ADS servicer (its ``stats`` and ``clients``).
        metrics: the Prometheus metrics (:class:`~xds_server.metrics.XdsMetrics`).
        config: the last good config file (None before :meth:`start`); fleet changes apply on top.
        effective: what is served: ``config`` with the fleet API's endpoint changes (None before start).
        fleet: the fleet API's changes (:class:`~xds_server.fleet_state.FleetState`).
        state_path: the state file in use (None: changes are not stored in a file), set by :meth:`start`.
        state_store: the fleet store in use, as logs name it (the file, or ``redis://host:port/db key K``);
            None: changes are not stored.
        store_errors: failed calls to the store (unreachable, a state this config cannot serve);
            ``store_reachable``: whether the last call to a shared store got an answer.
        resolved_hosts: ``{host name: IP}`` of the endpoints written with a host name.
        port: the bound ADS port (0 before :meth:`start`, and on a Unix socket); ``api_port``: the HTTP
            API's (0 when off).
        unix_path: the Unix socket ADS listens on (``xds.listen_unix``), or None on TCP.
        reload_errors: how many times a changed file was refused; ``publish_errors``: failed publishes.
        coalescer: the :class:`~xds_server.coalesce.PushCoalescer` every change goes through.
        file_config: the last good config file as written (``config`` adds the discovered endpoints).
        discovery: the Kubernetes discovery (None when ``discovery.kubernetes`` is not set);
            ``discovered``: its endpoints that this config serves (the others' problems in it too).
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
        state_redis_url: str | None = None,
        kube_api: Callable[[KubernetesDiscovery], KubeApi] | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self.state_path: Path | None = None
        self._state_file = Path(state_file) if state_file is not None else None
        self._state_redis_url = state_redis_url
        if state_file is not None and state_redis_url is not None:
            raise ValueError("state_file and state_redis_url: give one (the file, or the shared Redis store)")
        self._store: FleetStore | None = None
        self.state_store: str | None = None
        self.store_errors = 0
        self.store_reachable = True
        self._follower: asyncio.Task[None] | None = None
        #: the last fleet :meth:`_validate` checked, with its effective config and resolved hosts
        self._validated: tuple[FleetState, Config, Mapping[str, str]] | None = None
        self._started_store: tuple[str | None, ...] = ()
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
        #: ``xds.tls``: the certificate files' reloader (its ``reloads``/``failures`` counters); else None.
        self.tls_reloader: Reloader[PemFiles] | None = None
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
        self._started_tls: ServiceTls | None = None
        self._api: Any = None
        self._groups: dict[str, tuple[Config, LbEndpointCache]] = {}
        self._groups_owner: Config | None = None
        #: per group: the per-type services' variant (EDS and RDS over those services, not ADS)
        self._per_type_sources: dict[str, ConfigSourceRewriter] = {}
        self._known_keys: set[str] = set()
        self._known_owner: Config | None = None
        self.file_config: Config | None = None
        self.discovery: Discovery | None = None
        self.discovered = Mapped()
        self._discovery_seen: Mapped | None = None
        self._discovery_wake = asyncio.Event()
        self._discoverer: asyncio.Task[None] | None = None
        self._kube_api = kube_api or (lambda settings: LightkubeApi(kube_config(settings)))

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load and publish the config, bind and start the gRPC server (and the HTTP API when
        ``xds.api_listen`` is set), start following the file.

        Raises:
            ConfigError: the config file is missing or invalid, or the stored fleet changes do not fit it
                (start-up fails fast; the source names the state file too).
            FleetStoreError: the state file is in use by another server, unreadable, corrupt or cannot be
                written, or the Redis store holds something that is not a fleet state (the store named).
            SharedStateUnavailableError: the Redis store cannot be reached.
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
                await self._store.close()
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
        self._started_tls = config.xds.tls
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
                if config.xds.tls is not None:  # mutual TLS, files read again when they change
                    self.tls_reloader = pem_reloader(config.xds.tls, "xds.tls")
                    credentials = _reloading_credentials(self.tls_reloader)
                    bound = server.add_secure_port(address, credentials)
                else:
                    bound = server.add_insecure_port(address)
            except (OSError, ssl.SSLError) as exc:
                raise RuntimeError(f"xds.tls: cannot load the certificate files: {exc}") from None
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
        if isinstance(self._store, RedisFleetStore):
            self._follower = asyncio.create_task(self._follow_store(self._store), name="xds-fleet-store")
        await self._start_discovery(config)
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
        streams ``grace_s`` seconds; every step is bounded (:data:`STOP_STEP_TIMEOUT_S` past the grace),
        so the stop ends in bounded time."""
        discovery, self.discovery = self.discovery, None
        if discovery is not None:
            await _bounded(discovery.stop(), "the Kubernetes watches")
        for task in (self._poller, self._drainer, self._resolver, self._follower, self._discoverer):
            if task is not None:
                task.cancel()
                await _bounded(asyncio.gather(task, return_exceptions=True), "a follower task")
        self._poller = self._drainer = self._resolver = self._follower = self._discoverer = None
        if self.coalescer is not None:
            await _bounded(self.coalescer.close(), "the push coalescer")
        api, self._api = self._api, None
        if api is not None:
            await _bounded(api.stop(), "the fleet HTTP API")
        server, self._server = self._server, None
        if server is not None:
            await _bounded(server.stop(grace_s), "the gRPC server", grace_s)
        store, self._store = self._store, None
        if store is not None:
            await _bounded(store.close(), "the fleet store's connections")

    async def wait_for_termination(self) -> None:
        """Wait until the gRPC server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- the fleet store ------------------------------------------------------------------------------
    def _state_path_for(self, config: Config) -> Path | None:
        if self._state_file is not None:
            return self._state_file
        if self._state_redis_url is not None or config.xds.state_file is None:
            return None
        path = Path(config.xds.state_file)
        return path if path.is_absolute() else self.config_path.parent / path

    def _store_for(self, config: Config) -> FleetStore | None:
        """The store the arguments or the config name: a file, a shared Redis document, or none."""
        path = self._state_path_for(config)
        if path is not None:
            self.state_path = path
            return FileFleetStore(path)
        url = self._state_redis_url or (None if self._state_file is not None else config.xds.state_redis_url)
        if url is None:
            return None
        x = config.xds
        timeout_s = x.state_redis_timeout_ms / 1000
        doc = RedisDocument.from_url(url, x.state_redis_key, timeout_s=timeout_s, connect_timeout_s=timeout_s)
        return RedisFleetStore(doc)

    async def _restore_and_accept(self, data: bytes) -> Config:
        """Start-up: take and read the fleet store (when one is configured), end the drains whose time
        passed, then accept the config file with the restored changes on top and store the result (with a
        shared store, on top of whatever other servers stored meanwhile)."""
        source = str(self.config_path)
        config = parse_config_bytes(data, source)
        store = self._store_for(config)
        self._started_store = _store_fields(config)
        fleet_source = source
        if store is not None:
            self._store, self.state_store = store, store.where
            restored = await store.open()
            if restored is None:
                log.info("fleet store %s holds nothing yet: starting with no fleet API changes", store.where)
                restored = FleetState()
            now = time.time()
            ended = sorted(k for k, until in restored.draining.items() if until <= now)
            self.fleet = restored.expire(now)
            if ended:
                log.info("fleet state: drains that ended while the server was down, removing %s", ended)
            fleet_source = f"{source} with the fleet API changes stored in {store.where}"
        else:
            log.info("no xds.state_file or xds.state_redis_url: fleet API changes are kept in memory only "
                     "(a restart forgets them)")  # fmt: skip
        await self._accept_file(data, config=config, fleet_source=fleet_source)
        if store is not None:
            now = time.time()

            async def derive(base: FleetState) -> FleetState:
                fleet = base.reconcile(config).expire(now)
                await self._validate(fleet, fleet_source)
                return fleet

            # the file is written even when nothing changed, so a file that cannot be written fails now
            try:
                fleet = await store.update(derive, self.fleet, always=not store.shared)
                await self._adopt(fleet, fleet_source)
            finally:
                self._validated = None
            f = self.fleet
            log.info(
                "fleet state restored from %s: %d registered, %d draining, %d deregistered, %d weight pins",
                store.where, len(f.registered), len(f.draining), len(f.hidden), len(f.weight_overrides),
            )  # fmt: skip
        self._stable = StableContent(taken=self._digest)
        return config

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
        file_config = config
        config, discovered = self._with_discovered(file_config)
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
        self.file_config, self.discovered = file_config, discovered
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
                config, reconciled = loaded.config, self.fleet

                async def change(base: FleetState) -> FleetState:
                    fleet = base.reconcile(config)
                    await self._validate(fleet, "<config reload>")
                    return fleet

                await self._adopt_derived(await self._store_derived(change, reconciled), reconciled)
        if _store_fields(loaded.config) != self._started_store:
            log.warning("xds.state_file/state_redis_url changed: takes effect on restart (still: %s)",
                        self.state_store or "none")  # fmt: skip
        if (
            self._bind is None
            and self._started_listen is not None
            and loaded.config.xds.grpc_address() != self._started_listen
        ):
            log.warning(
                "xds.listen/listen_unix changed to %s: takes effect on restart",
                loaded.config.xds.grpc_address(),
            )
        if self._started_listen is not None and loaded.config.xds.tls != self._started_tls:
            # the socket's credentials are made at start; a rotation of the same files needs nothing
            log.warning("xds.tls changed: takes effect on restart (the port keeps the one it started with)")
        log.info("config %s accepted", self.config_path)
        self._changed()
        return loaded

    async def _follow_config(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.reload_if_changed()

    # -- Kubernetes discovery -----------------------------------------------------------------------
    async def _start_discovery(self, config: Config) -> None:
        """Start following ``discovery.kubernetes`` (read at start only). Its endpoints arrive once every
        followed collection has listed; until then the file's endpoints serve alone."""
        settings = config.discovery.kubernetes
        if settings is None:
            return
        try:
            api = self._kube_api(settings)
        except KubeUnavailable as exc:
            field = "in_cluster" if settings.in_cluster else "kubeconfig"
            raise ConfigError(str(self.config_path), [(f"discovery.kubernetes.{field}", str(exc))]) from None
        self.discovery = Discovery(settings, api, self._discovery_changed)
        self._discoverer = asyncio.create_task(self._follow_discovery(), name="xds-k8s-discovery")
        await self.discovery.start()
        log.info("kubernetes discovery: namespace %s, services %s, inference pools %s", settings.namespace,
                 list(settings.services), list(settings.inference_pools))  # fmt: skip

    def _discovery_changed(self, mapped: Mapped) -> None:
        self._discovery_seen = mapped
        self._discovery_wake.set()

    def _with_discovered(self, file_config: Config) -> tuple[Config, Mapped]:
        """``file_config`` with the discovered endpoints it can serve appended, and those endpoints
        (:func:`fit_to_config`: for :attr:`discovered` once the caller made the config current); logs the
        endpoints newly left out."""
        seen = self._discovery_seen
        if seen is None:
            return file_config, Mapped()
        fitted = fit_to_config(seen, file_config)
        # the mapping's own problems are logged by the discovery; these are the config's
        for p in sorted(set(fitted.problems) - set(self.discovered.problems) - set(seen.problems)):
            log.warning("kubernetes discovery: %s (left out)", p)
        if not fitted.endpoints:
            return file_config, fitted
        endpoints = (*file_config.endpoints, *(d.endpoint for d in fitted.endpoints))
        # fit_to_config did the per-endpoint checks the schema's cross-check would
        return file_config.model_copy(update={"endpoints": endpoints}), fitted

    async def _follow_discovery(self) -> None:
        """Apply the latest discovered endpoints after each change (the changes within
        ``xds.push_debounce_ms`` of the first are one apply; the push after it goes through the
        coalescer)."""
        while True:
            await self._discovery_wake.wait()
            if self.config is not None and self.config.xds.push_debounce_ms:
                # a rollout is a burst of watch events: gather what arrives within one debounce
                await asyncio.sleep(self.config.xds.push_debounce_ms / 1000)
            self._discovery_wake.clear()
            try:
                await self.apply_discovered()
            except ConfigError as exc:
                log.error("kubernetes discovery: endpoints refused, the last good ones keep serving: %s", exc)
            except Exception:  # never let it die: a server that stops following serves stale endpoints
                log.exception("kubernetes discovery: applying endpoints failed; the last good ones serve")

    async def apply_discovered(self) -> None:
        """Serve the discovered endpoints seen last on top of the last good config file, with the fleet
        API's changes on top (reconciled: drains and pins of endpoints gone are forgotten).

        Raises:
            ConfigError: the result cannot be served (logged by the caller; the last good one keeps
                serving).
        """
        async with self._fleet_lock:
            if self.file_config is None:
                return
            source = f"{self.config_path} with endpoints discovered in Kubernetes"
            config, discovered = self._with_discovered(self.file_config)
            fleet = self.fleet.reconcile(config)
            effective = effective_config(config, fleet, source)
            resolved = await resolve_endpoint_hosts(
                effective, source, self._resolve, known=self.resolved_hosts
            )
            build_resources(effective, source, resolved_hosts=resolved)
            reconciled, changed = fleet, fleet != self.fleet
            self.config, self.effective, self.resolved_hosts = config, effective, resolved
            self.discovered = discovered
            if changed:

                async def change(base: FleetState) -> FleetState:
                    derived = base.reconcile(config)
                    await self._validate(derived, source)
                    return derived

                await self._adopt_derived(await self._store_derived(change, reconciled), reconciled)
            n = len(self.discovered.endpoints)
            draining = sum(d.draining for d in self.discovered.endpoints)
            log.info("kubernetes discovery: serving %d endpoints (%d draining)", n, draining)
            self._changed()

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
        for d in self.discovered.endpoints:
            if d.draining:
                o = overrides.get(d.key, EndpointOverride())
                overrides[d.key] = EndpointOverride(
                    weight=o.weight, draining=True, length_classes=o.length_classes
                )
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

    def _require_known(self, key: str, base: FleetState) -> None:
        """Refuse a change of ``key`` unless ``base`` (the state the change runs on) serves it."""
        assert self.config is not None
        known = self._known() if base is self.fleet else known_keys(self.config, base)
        if key not in known:
            raise UnknownEndpointError(key)

    async def _validate(self, fleet: FleetState, source: str, *, fresh: bool = False) -> None:
        """Check that this server can serve ``fleet``: when its endpoint list differs from the served one
        (or ``fresh``), the effective config is validated and its host names resolved (``fresh``: every
        name looked up again), and kept for :meth:`_adopt`.

        Raises:
            ConfigError: the fleet is invalid with this config (fields named), or a host name does not
                resolve.
        """
        assert self.config is not None
        if not fresh and fleet.registered == self.fleet.registered and fleet.hidden == self.fleet.hidden:
            return
        effective = effective_config(self.config, fleet, source)
        known = None if fresh else self.resolved_hosts
        resolved = await resolve_endpoint_hosts(effective, source, self._resolve, known=known)
        self._validated = (fleet, effective, resolved)

    async def _adopt(self, fleet: FleetState, source: str) -> None:
        """Serve ``fleet`` (the caller holds the fleet lock): re-validate the effective config only when its
        endpoint list changed (~0.5 s at 10,000 endpoints), unless :meth:`_validate` just did, and push.

        Raises:
            ConfigError: the fleet is invalid with this config; nothing changes.
        """
        assert self.config is not None
        if fleet.registered != self.fleet.registered or fleet.hidden != self.fleet.hidden:
            memo = self._validated
            if memo is None or memo[0] is not fleet:
                await self._validate(fleet, source)
                memo = self._validated
            assert memo is not None and memo[0] is fleet
            self.effective, self.resolved_hosts = memo[1], memo[2]
        self._validated = None
        self.fleet = fleet
        self._drain_wake.set()
        self._changed()

    async def _commit(
        self, change: FleetChange, actor: str, what: str, *, logged: Callable[[], bool] | None = None
    ) -> FleetState:
        """Run one fleet API change on the stored state (the caller holds the fleet lock; ``change``
        validates), store the result and only then serve it and log it (unless ``logged()`` says it
        changed nothing); returns it.

        Raises:
            whatever ``change`` raises; FleetStoreError, SharedStateUnavailableError: it cannot be stored;
            nothing changes (unless the error's ``maybe_applied``: the follower adopts it if it landed).
        """
        self._validated = None
        try:
            fleet = (
                await change(self.fleet)
                if self._store is None
                else await self._store.update(change, self.fleet)
            )
            await self._adopt(fleet, "<fleet api>")
        finally:
            self._validated = None
        if logged is not None and not logged():
            return fleet
        if self._store is None:
            stored = "not stored (no xds.state_file or xds.state_redis_url)"
        else:
            stored = "stored" if not self._store.shared else f"stored (version {self.store_version()})"
        log.info("fleet api: who=%s what=%s %s", actor, what, stored)
        return fleet

    async def _store_derived(self, change: FleetChange, fallback: FleetState) -> FleetState:
        """Store a state derived from the stored one and the config or the clock (a reload's
        reconciliation, a drain's end; ``change`` derives it): every server, and this one after a restart,
        derives it again, so a failure is logged and ``fallback`` (derived from this server's view) is
        served meanwhile."""
        if self._store is None:
            return fallback
        self._validated = None
        try:
            return await self._store.update(change, self.fleet)
        except (FleetStoreError, SharedStateUnavailableError, ConfigError) as exc:
            self.store_errors += 1
            log.error("%s (the next change retries)", exc)
            self._validated = None
            return fallback

    def store_version(self) -> int | None:
        """The shared store's version this server last read or wrote (None: no shared store)."""
        store = self._store
        return store.seen.version if isinstance(store, RedisFleetStore) else None

    async def register_endpoint(self, endpoint: EndpointConfig, *, actor: str = "-") -> None:
        """Add an endpoint (or replace the one at its address, cancelling its drain and weight pin), store
        and push. ``actor``: who asked, for the log line.

        Raises:
            ConfigError: the fleet with it is invalid (unknown model, version or GPU type, an address
                already taken by another socket, a host name that does not resolve); nothing changes.
            FleetStoreError, SharedStateUnavailableError: it cannot be stored; nothing changes.
        """

        async def change(base: FleetState) -> FleetState:
            fleet = base.register(endpoint)
            await self._validate(fleet, "<fleet api>", fresh=True)
            return fleet

        what = (
            f"register endpoint={endpoint_key(endpoint)} model={endpoint.model} "
            f"version={endpoint.version or '-'} gpu={endpoint.gpu} name={endpoint.display_name}"
        )
        async with self._fleet_lock:
            await self._commit(change, actor, what)

    async def drain_endpoint(self, key: str, drain_ms: int | None = None, *, actor: str = "-") -> float:
        """Send an endpoint as DRAINING now and remove it after ``drain_ms`` (``xds.drain_period_ms`` by
        default); draining it again keeps the earlier end. Returns its removal time (Unix s, wall clock:
        a restart keeps it).

        Raises:
            UnknownEndpointError: no such endpoint.
            FleetStoreError, SharedStateUnavailableError: it cannot be stored; nothing changes.
        """
        async with self._fleet_lock:
            assert self.config is not None
            period = self.config.xds.drain_period_ms if drain_ms is None else drain_ms
            remove_at = time.time() + period / 1000

            async def change(base: FleetState) -> FleetState:
                self._require_known(key, base)
                fleet = base.drain(key, remove_at)
                await self._validate(fleet, "<fleet api>")
                return fleet

            what = f"drain endpoint={key} drain_ms={period} until={utc_iso(remove_at)}"
            fleet = await self._commit(change, actor, what)
        return fleet.draining.get(key, remove_at)

    async def undrain_endpoint(self, key: str, *, actor: str = "-") -> bool:
        """Cancel the drain of an endpoint still draining: it is served again as before. Returns whether
        it was draining (False: nothing changed, nothing logged).

        Raises:
            UnknownEndpointError: no such endpoint (one whose drain already ended was removed: register
                it again).
            FleetStoreError, SharedStateUnavailableError: it cannot be stored; nothing changes.
        """
        was = False

        async def change(base: FleetState) -> FleetState:
            nonlocal was
            self._require_known(key, base)
            was = key in base.draining
            if not was:
                return base  # nothing to store
            fleet = base.undrain(key)
            await self._validate(fleet, "<fleet api>")
            return fleet

        async with self._fleet_lock:
            if self._store is None or not self._store.shared:
                # this server's view is the stored state: nothing to cancel, nothing to store or log
                self._require_known(key, self.fleet)
                if key not in self.fleet.draining:
                    return False
            await self._commit(change, actor, f"undrain endpoint={key}", logged=lambda: was)
        return was

    async def deregister_endpoint(self, key: str, *, actor: str = "-") -> None:
        """Remove an endpoint now (no drain).

        Raises:
            UnknownEndpointError: no such endpoint.
            FleetStoreError, SharedStateUnavailableError: it cannot be stored; nothing changes.
        """

        async def change(base: FleetState) -> FleetState:
            self._require_known(key, base)
            fleet = base.deregister(key)
            await self._validate(fleet, "<fleet api>")
            return fleet

        async with self._fleet_lock:
            await self._commit(change, actor, f"deregister endpoint={key}")

    async def override_weight(self, key: str, weight: int | None, *, actor: str = "-") -> None:
        """Pin an endpoint's Envoy weight (>= 1), or clear the pin with None.

        Raises:
            UnknownEndpointError: no such endpoint.
            ValueError: weight below 1.
            FleetStoreError, SharedStateUnavailableError: it cannot be stored; nothing changes.
        """
        await self.override_weights(
            {key: weight}, actor=actor, what=f"weight endpoint={key} weight={_weight_text(weight)}"
        )

    async def override_weights(
        self, weights: Mapping[str, int | None], *, actor: str = "-", what: str | None = None
    ) -> None:
        """Pin (or with None clear) the Envoy weights of many endpoints in one change (one push, one
        write, one log line; ``what`` overrides the line's description).

        Raises:
            UnknownEndpointError: one of the keys names no endpoint (nothing changes).
            ValueError: a weight below 1 (nothing changes).
            FleetStoreError, SharedStateUnavailableError: it cannot be stored; nothing changes.
        """

        async def change(base: FleetState) -> FleetState:
            fleet = base
            for key, weight in weights.items():
                self._require_known(key, base)
                fleet = fleet.override_weight(key, weight)
            await self._validate(fleet, "<fleet api>")
            return fleet

        pins = ",".join(f"{k}={_weight_text(w)}" for k, w in weights.items())
        async with self._fleet_lock:
            await self._commit(change, actor, what or f"weights endpoints={pins or '-'}")

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
                now = time.time()
                expired = self.fleet.expire(now)
                gone = sorted(set(self.fleet.draining) - set(expired.draining))
                if not gone:
                    continue
                log.info("drain period over, removing %s", gone)

                async def change(base: FleetState, now: float = now) -> FleetState:
                    fleet = base.expire(now)
                    await self._validate(fleet, "<drain end>")
                    return fleet

                await self._adopt_derived(await self._store_derived(change, expired), expired)

    async def _adopt_derived(self, fleet: FleetState, fallback: FleetState) -> None:
        """Serve a derived state; one that this config cannot serve (another server's registration of a
        model this config lacks) is logged and ``fallback`` (a subset of this server's view) served."""
        try:
            await self._adopt(fleet, "<fleet store>")
        except ConfigError as exc:
            self.store_errors += 1
            log.error("fleet state from %s does not fit this config, serving this server's own: %s",
                      self.state_store, exc)  # fmt: skip
            self._validated = None
            await self._adopt(fallback, "<fleet store>")

    # -- following a shared store ---------------------------------------------------------------------
    async def _follow_store(self, store: RedisFleetStore) -> None:
        """Adopt every state another server stores: wait for an announcement (or the poll interval), read
        the version, adopt a new state. A store that is down is retried every poll (logged once when it
        goes, once when it is back); meanwhile the last adopted state keeps serving."""
        down = False
        while True:
            assert self.config is not None
            poll_s = self.config.xds.state_redis_poll_ms / 1000
            try:
                await store.wait_for_change(poll_s)
                async with self._fleet_lock:
                    stored = await store.changed(self.fleet)
                    if stored is not None:
                        await self._adopt_stored(store, stored)
            except SharedStateUnavailableError as exc:
                self.store_errors += 1
                self.store_reachable = False
                await store.resubscribe()  # its connection is as broken as the one that failed
                if not down:
                    log.error("%s: fleet API changes are refused (503) and the last state keeps serving; "
                              "retrying every %d ms", exc, self.config.xds.state_redis_poll_ms)  # fmt: skip
                down = True
                await asyncio.sleep(poll_s)
                continue
            except (FleetStoreError, ValueError, OSError) as exc:
                # never let the follower die: a server that stops following serves stale state silently
                self.store_errors += 1
                log.error("fleet store %s: following it failed, retrying: %s", store.where, exc)
                await asyncio.sleep(poll_s)
                continue
            self.store_reachable = True
            if down:
                log.info("fleet store %s reachable again (version %d)", store.where, store.seen.version)
                down = False

    async def _adopt_stored(self, store: RedisFleetStore, stored: FleetState) -> None:
        """Serve a state another server stored (the caller holds the fleet lock), on top of this config:
        reconciled with it and its ended drains removed (both stored back when they change it)."""
        assert self.config is not None
        config, now = self.config, time.time()
        fleet = stored.reconcile(config).expire(now)
        try:
            await self._adopt(fleet, f"the fleet state in {store.where}")
        except ConfigError as exc:
            self.store_errors += 1
            self._validated = None
            log.error("fleet state version %d in %s does not fit this server's config, the last good state "
                      "keeps serving: %s", store.seen.version, store.where, exc)  # fmt: skip
            return
        f = fleet
        log.info(
            "fleet state version %d from %s applied: %d registered, %d draining, %d deregistered, "
            "%d weight pins",
            store.seen.version, store.where, len(f.registered), len(f.draining), len(f.hidden),
            len(f.weight_overrides),
        )  # fmt: skip
        if fleet.draining != stored.draining:

            async def change(base: FleetState) -> FleetState:
                derived = base.expire(now)
                await self._validate(derived, "<drain end>")
                return derived

            await self._adopt_derived(await self._store_derived(change, fleet), fleet)


async def _bounded(step: Awaitable[object], what: str, grace_s: float = 0.0) -> None:
    """Await one step of a stop for at most ``grace_s`` + :data:`STOP_STEP_TIMEOUT_S` seconds; past that
    it is logged and cancelled."""
    try:
        await asyncio.wait_for(step, grace_s + STOP_STEP_TIMEOUT_S)
    except TimeoutError:
        log.error("stopping %s took over %.0f s; left behind", what, grace_s + STOP_STEP_TIMEOUT_S)


def _store_fields(config: Config) -> tuple[str | None, ...]:
    """The config fields that choose the fleet store (read at start only)."""
    x = config.xds
    return (x.state_file, x.state_redis_url, x.state_redis_key)


def _weight_text(weight: int | None) -> str:
    return "null" if weight is None else str(weight)
