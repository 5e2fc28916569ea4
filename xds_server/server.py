"""The xDS server's lifecycle: load the config, publish its snapshot, serve ADS, follow the config file.

The file is polled (``poll_interval_s``, 0.5 s by default) by content hash: a change is re-validated and,
when good, published as a new snapshot, which every connected Envoy receives without a restart. A bad file
(or one Envoy could not take) is logged with the field named and the last good snapshot keeps serving
(shared/STYLE.md, item 5: fail fast at start-up, degrade at run time).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from envoy.service.discovery.v3 import ads_pb2_grpc

from inferlb.config import Config, HostPort, parse_config
from inferlb.errors import ConfigError
from xds_server.ads import AggregatedDiscoveryServicer
from xds_server.cache import DEFAULT_GROUP, Snapshot, SnapshotCache, SnapshotInconsistentError
from xds_server.resources import build_resources

log = logging.getLogger("xds_server")

#: How often the config file is checked for changes (s).
DEFAULT_POLL_INTERVAL_S = 0.5
#: Streams get this long to finish on shutdown before they are cancelled (s).
DEFAULT_GRACE_S = 2.0


@dataclass(frozen=True, kw_only=True)
class ConfigLoaded:
    """A config file was read, validated and published.

    Attributes:
        config: the validated config.
        snapshot: the snapshot now serving (the previous one when the file changed only in ways that
            do not change any resource, e.g. tenants or comments).
        digest: sha256 hex of the file's bytes.
    """

    config: Config
    snapshot: Snapshot
    digest: str


def parse_config_bytes(data: bytes, source: str) -> Config:
    """Validate the bytes of a YAML config file (the same errors as :func:`inferlb.config.load_config`).

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


async def resolve_endpoint_hosts(config: Config, source: str) -> dict[str, str]:
    """Resolve every endpoint host name of a config to one IP address (EDS endpoints must be IPs).

    Uses the event loop's ``getaddrinfo`` (the system resolver: /etc/hosts, DNS, a container network's
    service names). An IPv4 answer is preferred, since Envoy's default listeners and most fleets are IPv4.
    IP literals are left alone and not looked up.

    Returns:
        ``{host name: IP literal}`` for every distinct host name among ``config.endpoints``.

    Raises:
        ConfigError: naming ``endpoints[i].address`` for each endpoint whose host name does not resolve.
    """
    loop = asyncio.get_running_loop()
    names = sorted({e.address.host for e in config.endpoints if not e.address.is_ip})
    answers = await asyncio.gather(
        *(loop.getaddrinfo(n, None, type=socket.SOCK_STREAM) for n in names), return_exceptions=True
    )
    resolved: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name, answer in zip(names, answers, strict=True):
        if isinstance(answer, BaseException):
            failed[name] = str(answer)
            continue
        ipv4 = [a for a in answer if a[0] == socket.AF_INET]
        chosen = (ipv4 or answer)[0] if answer else None
        if chosen is None:
            failed[name] = "no address"
        else:
            resolved[name] = str(chosen[4][0])
    problems = [
        (
            f"endpoints[{i}].address",
            f"host name {e.address.host!r} does not resolve: {failed[e.address.host]}",
        )
        for i, e in enumerate(config.endpoints)
        if e.address.host in failed
    ]
    if problems:
        raise ConfigError(source, problems)
    return resolved


class XdsServer:
    """ADS on ``config.xds.listen`` (or ``bind``), fed from a config file that it keeps following.

    Args:
        config_path: the YAML config file.
        cache: the snapshot cache (a fresh one, so a fresh version prefix, by default).
        bind: ``(host, port)`` to listen on instead of the config's ``xds.listen``; port 0 picks a free one.
        poll_interval_s: seconds between config file checks.

    Attributes:
        cache, servicer: the snapshot cache and the ADS servicer (its ``stats``).
        config: the last good config (None before :meth:`start`).
        port: the bound port (0 before :meth:`start`).
        reload_errors: how many times a changed file was refused.
    """

    def __init__(
        self,
        config_path: str | Path,
        *,
        cache: SnapshotCache | None = None,
        bind: tuple[str, int] | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        self.config_path = Path(config_path)
        self.cache = cache or SnapshotCache()
        self.servicer = AggregatedDiscoveryServicer(self.cache)
        self.config: Config | None = None
        self.resolved_hosts: Mapping[str, str] = {}
        self.port = 0
        self.host = ""
        self.reload_errors = 0
        self._bind = bind
        self._poll_interval_s = poll_interval_s
        self._digest = ""
        self._server: grpc.aio.Server | None = None
        self._poller: asyncio.Task[None] | None = None
        self._started_listen: HostPort | None = None

    async def start(self) -> None:
        """Load and publish the config, bind and start the gRPC server, start following the file.

        Raises:
            ConfigError: the config file is missing or invalid (start-up fails fast).
            SnapshotInconsistentError: the config yields resources Envoy would reject.
            RuntimeError: the listen address cannot be bound.
        """
        try:
            data = await asyncio.to_thread(self.config_path.read_bytes)
        except OSError as exc:
            raise ConfigError(str(self.config_path), [("", f"cannot read: {exc.strerror or exc}")]) from None
        loaded = await self._publish(data)
        config = loaded.config
        self._started_listen = config.xds.listen
        host, port = self._bind or (config.xds.listen.host, config.xds.listen.port)
        server = grpc.aio.server()
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.servicer, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {address}: {exc}") from None
        if bound == 0:  # older grpcio reports a failed bind as port 0
            raise RuntimeError(f"cannot listen on {address}")
        await server.start()
        self._server, self.host, self.port = server, host, bound
        self._poller = asyncio.create_task(self._follow_config(), name="xds-config-poller")
        log.info("xds_server ready on %s:%d", host, bound)

    async def _publish(self, data: bytes) -> ConfigLoaded:
        digest = hashlib.sha256(data).hexdigest()
        source = str(self.config_path)
        config = parse_config_bytes(data, source)
        resolved: Mapping[str, str] = await resolve_endpoint_hosts(config, source)
        resources = build_resources(config, source, resolved_hosts=resolved)
        snapshot = self.cache.set_resources(resources, group=DEFAULT_GROUP)
        self.config, self.resolved_hosts, self._digest = config, resolved, digest
        return ConfigLoaded(config=config, snapshot=snapshot, digest=digest)

    async def reload_if_changed(self) -> ConfigLoaded | None:
        """Check the config file once; publish it when its bytes changed and it is good.

        Returns:
            what was published, or None when the file is unchanged, unreadable or refused (all logged;
            the last good snapshot keeps serving).
        """
        try:
            data = await asyncio.to_thread(self.config_path.read_bytes)
        except OSError as exc:
            # an editor replacing the file can make it vanish for a moment: keep serving, retry next poll
            log.warning("config %s unreadable, keeping the last good config: %s", self.config_path, exc)
            return None
        digest = hashlib.sha256(data).hexdigest()
        if digest == self._digest:
            return None
        try:
            loaded = await self._publish(data)
        except (ConfigError, SnapshotInconsistentError) as exc:
            self._digest = digest  # report a bad file once, not every poll
            self.reload_errors += 1
            log.error("config change refused, the last good config keeps serving: %s", exc)
            return None
        if (
            self._bind is None
            and self._started_listen is not None
            and loaded.config.xds.listen != self._started_listen
        ):
            log.warning("xds.listen changed to %s: takes effect on restart", loaded.config.xds.listen)
        versions = ", ".join(f"{t.rsplit('.', 1)[-1]}={v}" for t, v in loaded.snapshot.versions.items())
        log.info("config %s reloaded: %s", self.config_path, versions)
        return loaded

    async def _follow_config(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.reload_if_changed()

    async def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Stop following the file and stop the gRPC server, giving streams ``grace_s`` seconds."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    async def wait_for_termination(self) -> None:
        """Wait until the gRPC server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()
