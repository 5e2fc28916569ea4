"""The inferlb config file: one YAML document, validated with pydantic v2.

Shape (see README "Config reference" and ``examples/local.yaml``)::

    gateway:    {listen, admin, max_request_body_bytes, ..., tls: {cert_file, key_file, client_ca_file},
                 upstream_tls: {cert_file, key_file, ca_file}, sds_dir}   # the Envoy side
    xds:        {listen, tls: {cert_file, key_file, client_ca_file, server_name}, push_debounce_ms,
                 push_max_delay_ms, api_listen, api_token, drain_period_ms, node_groups, state_file,
                 state_redis_url, ...}
    ext_proc:   {listen, tls: {...as xds.tls}, message_timeout_ms, failure_mode_allow, account_responses,
                 quota_backend, ...}
    gpu_profiles: {H100: {relative_capacity: 3.4, ...}, ...}
    models:     [{name, aliases, context_length, versions: [{name, traffic_percent}],
                  cluster: {lb_policy, ..., length_aware: {long_output_tokens, fast_min_relative_capacity,
                                 tiers: [{above_output_tokens, min_relative_capacity}],
                                 predict_output, capacity_guard_factor,
                                 learn_thresholds: true | {window, min_samples, rederive_every_s,
                                                           hysteresis, fraction, prompt_token_work}}},
                  endpoint_picking: {mode: off|load|approximate|precise, weights: {...}, block_size}}]
    endpoints:  [{address, model, version, gpu, region, zone, simulated,
                  kv_events: {endpoint, replay_endpoint, topic}}]   # kv_events: precise picking only
    discovery:  {kubernetes: {namespace, services, inference_pools, kubeconfig | in_cluster}}
    tenants:    [{name, api_keys | api_key_sha256 | api_key_file | api_key_env, priority,
                  requests_per_minute, tokens_per_minute,
                  max_concurrent_requests, daily_token_budget}]
    allow_empty: [models | endpoints | tenants]   # sections a run-time change may empty on purpose

Everything is frozen after validation; a new file gives a new :class:`Config`. Errors are raised as
:class:`inferlb.errors.ConfigError`, each naming the dotted field path and the source file.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import os
import re
import ssl
import stat
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from inferlb.errors import ConfigError

#: Relative throughput of common data-centre GPUs for LLM serving, V100 = 1.0.
#: A100 = 1.7 x V100 and H100 = 2.0 x A100 are the figures the project's brief takes from the field:
#: NVIDIA's A100 whitepaper (2020) gives ~1.7x V100 on BERT-large inference at equal precision, and
#: MLPerf Inference v3.0 (2023) Llama/GPT-J rows put H100 SXM at ~2x A100. L4 and A10G are ~0.7-0.8 x V100
#: on 7-8B decode (memory-bandwidth bound: 300 and 600 GB/s vs V100's 900 GB/s).
DEFAULT_GPU_CAPACITY: Mapping[str, float] = {
    "V100": 1.0,
    "A10G": 0.8,
    "L4": 0.7,
    "A100": 1.7,
    "H100": 3.4,
}

_HOSTPORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=True)


class HostPort(_Frozen):
    """A ``host:port`` socket address. IPv6 hosts are written in brackets (``[::1]:8000``)."""

    host: str
    port: Annotated[int, Field(strict=True, ge=1, le=65535)]

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, value: Any) -> Any:
        if isinstance(value, str):
            m = _HOSTPORT.match(value.strip())
            if not m:
                raise ValueError(f"expected 'host:port', got {value!r}")
            return {"host": m["host"].strip("[]"), "port": int(m["port"])}
        return value

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_ip(self) -> bool:
        """True when ``host`` is an IP literal (Envoy STATIC endpoints need one; names need STRICT_DNS)."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    @property
    def is_unspecified(self) -> bool:
        """True when ``host`` is the unspecified address (``0.0.0.0`` or ``::``): a bind address meaning every
        interface, which no client can dial (:rfc:`1122` 3.2.1.3, :rfc:`4291` 2.5.2)."""
        try:
            return ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            return False


def check_dialable(field: str, addr: HostPort, bind_field: str) -> None:
    """Refuse ``addr`` as the address something dials (``field``, e.g. ``xds.advertise``) when it is the
    unspecified address: a bind address (``bind_field``) of ``0.0.0.0`` or ``::`` needs an ``advertise``
    naming a reachable host (an IP, or a DNS name such as a Kubernetes Service's).

    Raises:
        ValueError: naming ``field``, and ``bind_field`` when ``addr`` came from it."""
    if addr.is_unspecified:
        raise ValueError(
            f"{field}: {addr} is the unspecified address, which Envoy cannot dial; set {field} to the host "
            f"Envoy reaches this service at (an IP or a DNS name; {bind_field} may stay {addr.host} to bind "
            "every interface)"
        )


#: Longest Unix domain socket path: ``sockaddr_un.sun_path`` holds 108 bytes on Linux, the last a NUL.
UNIX_PATH_MAX_BYTES = 107


def _check_unix_path(v: str) -> str:
    if not v.startswith("/"):
        raise ValueError(f"a Unix socket path must be absolute, got {v!r}")
    if v.endswith("/"):
        raise ValueError(f"a Unix socket path names a file, not a directory: {v!r}")
    if "\0" in v:
        raise ValueError("a Unix socket path cannot contain NUL")
    if len(v.encode()) > UNIX_PATH_MAX_BYTES:
        raise ValueError(
            f"a Unix socket path has at most {UNIX_PATH_MAX_BYTES} bytes (sun_path), got {len(v.encode())}: "
            f"{v!r}"
        )
    return v


class UnixSocket(_Frozen):
    """A Unix domain socket: an absolute file path. Written ``unix:PATH`` (gRPC's form)."""

    path: Annotated[str, AfterValidator(_check_unix_path)]

    def __str__(self) -> str:
        return f"unix:{self.path}"


#: Where a gRPC service of the stack listens (and Envoy dials it): TCP ``host:port`` or a Unix socket.
GrpcAddress = HostPort | UnixSocket


def _unix_socket(value: Any) -> Any:
    # checked here, so an error names the config field itself (``xds.listen_unix``), not ``.path``
    return UnixSocket(path=_check_unix_path(value.strip())) if isinstance(value, str) else value


#: A ``listen_unix`` field: an absolute path in the file, a :class:`UnixSocket` once validated.
UnixListen = Annotated[UnixSocket, BeforeValidator(_unix_socket)]


def check_advertise_flag(flag: HostPort, dialled: Sequence[GrpcAddress], field: str) -> None:
    """A service's ``--advertise HOST:PORT``: the address Envoy is to dial it at. Envoy's side is built
    from the config (its bootstrap, the xDS server's clusters), so the flag must be one of ``dialled``
    (the config's ``field`` addresses) and dialable: a wrong address then fails at start-up instead of
    Envoy dialling a process that is not there.

    Raises:
        ValueError: naming ``--advertise`` and ``field``."""
    check_dialable("--advertise", flag, "--listen")
    if str(flag) not in {str(a) for a in dialled}:
        raise ValueError(
            f"--advertise {flag}: Envoy dials {', '.join(map(str, dialled))} ({field} in the config); "
            f"set {field} to {flag} or drop --advertise"
        )


#: The config sections a run-time change may empty only when the file says so (``allow_empty``).
EmptiableSection = Literal["models", "endpoints", "tenants"]


class Priority(StrEnum):
    """Tenant priority. ``high`` rides Envoy's HIGH routing priority (its own circuit-breaker budget);
    ``default`` and ``low`` ride DEFAULT, and ``low`` is shed first under saturation: ext_proc (or ext_authz)
    refuses it
    once the cluster's DEFAULT-priority requests in flight reach
    ``cluster.low_priority_max_requests_percent`` of its DEFAULT ``max_requests``
    (:mod:`inferlb.policy.shedding`)."""

    HIGH = "high"
    DEFAULT = "default"
    LOW = "low"


class AccessLogConfig(_Frozen):
    """``gateway.access_log``: one JSON line per request from Envoy's own access logger
    (``envoy.access_loggers.stdout`` or ``envoy.access_loggers.file`` with ``log_format.json_format``; the
    fields are :data:`xds_server.resources.listener.ACCESS_LOG_FIELDS`, README "Access log")."""

    #: ``stdout`` (Envoy's standard output: ``inferlb up`` writes it to Envoy's log file) or an absolute
    #: file path Envoy appends to (reopened on ``/reopen_logs``).
    path: Annotated[str, Field(min_length=1, max_length=4096)] = "stdout"
    #: Only ``json`` (one object per line).
    format: Literal["json"] = "json"

    @field_validator("path")
    @classmethod
    def _stdout_or_absolute(cls, value: str) -> str:
        if value != "stdout" and not value.startswith("/"):
            raise ValueError(f"expected 'stdout' or an absolute file path, got {value!r}")
        if "\0" in value:
            raise ValueError("a file path holds no NUL byte")
        return value


#: Largest certificate, key or CA file read (bytes): a CA bundle of every public root is ~250 KB.
MAX_PEM_FILE_BYTES = 4 * 1024 * 1024


def _read_pem(field: str, path: str, what: str) -> bytes:
    """The bytes of the PEM file ``path`` (``field`` names it in errors): it must be a readable regular
    file of at most :data:`MAX_PEM_FILE_BYTES` and hold at least one ``-----BEGIN`` block. Opened without
    blocking, so a named pipe or a device (``/dev/zero``) is refused at once, not read for ever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path!r}: {e.strerror or type(e).__name__}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{field}: {path!r} is not a regular file (expected {what} in a PEM file)")
        if st.st_size > MAX_PEM_FILE_BYTES:
            raise ValueError(f"{field}: {path!r} is larger than {MAX_PEM_FILE_BYTES} bytes (expected {what})")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_PEM_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path!r}: {e.strerror or type(e).__name__}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_PEM_FILE_BYTES:
        raise ValueError(f"{field}: {path!r} is larger than {MAX_PEM_FILE_BYTES} bytes (expected {what})")
    if b"-----BEGIN " not in data:
        raise ValueError(f"{field}: {path!r} holds no PEM block (expected {what})")
    return data


def _check_absolute_file(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"expected an absolute file path (Envoy and each service read it), got {value!r}")
    if "\0" in value:
        raise ValueError("a file path holds no NUL byte")
    return value


#: A directory given as an absolute path.
AbsoluteDir = Annotated[str, Field(min_length=2, max_length=3900), AfterValidator(_check_absolute_file)]

#: A certificate, key or CA file: an absolute path (each process reads it from its own working directory).
PemFile = Annotated[str, Field(min_length=2, max_length=4096), AfterValidator(_check_absolute_file)]


#: The validation context key (``parse_config(..., check_tls_files=False)``) saying the TLS files were
#: already checked when this config was loaded, so re-validating it (a fleet change) does not read them.
_TLS_FILES_CHECKED = "tls_files_checked"


def _files_checked(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and bool(info.context.get(_TLS_FILES_CHECKED))


class TlsFiles(_Frozen):
    """A certificate chain and its private key, and the CA that signs the peers' certificates, as PEM files.

    Read when the config is loaded (at start and on each reload): a file that is missing, unreadable, holds
    no PEM, or a key that does not match its certificate is refused naming the field, and a reload keeps the
    last good config. The processes that use them (Envoy, the services) read them again themselves when
    they change (README "TLS and mutual TLS"), so a rotation needs no reload.
    """

    #: The certificate chain (leaf first), PEM.
    cert_file: PemFile
    #: The private key of ``cert_file``'s leaf, PEM (unencrypted).
    key_file: PemFile

    def _check_pair(self) -> None:
        # the chain alone first: a cert_file that holds no certificate is named, not its key_file
        self._check_ca("cert_file", self.cert_file, "a certificate chain")
        _read_pem("key_file", self.key_file, "a private key")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(
                f"key_file: {self.key_file!r} and cert_file {self.cert_file!r} do not load as a certificate "
                f"chain and its key ({getattr(e, 'reason', None) or e})"
            ) from None

    @staticmethod
    def _check_ca(field: str, path: str, what: str = "CA certificates") -> None:
        _read_pem(field, path, what)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_verify_locations(cafile=path)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(
                f"{field}: {path!r} does not load as {what} ({getattr(e, 'reason', None) or e})"
            ) from None


class GatewayTls(TlsFiles):
    """``gateway.tls``: TLS on the gateway listener (``gateway.listen``), the certificate Envoy presents to
    clients. Envoy reads the files itself (through the SDS files of
    :func:`~xds_server.resources.transport_sockets.sds_files`) and serves a rotated certificate on new
    connections without a restart."""

    #: Clients must present a certificate signed by one of these CAs (PEM); None: any client (no client
    #: certificate asked for).
    client_ca_file: PemFile | None = None

    @model_validator(mode="after")
    def _check_files(self, info: ValidationInfo) -> Self:
        if _files_checked(info):
            return self
        self._check_pair()
        if self.client_ca_file is not None:
            self._check_ca("client_ca_file", self.client_ca_file)
        return self


class ServiceTls(TlsFiles):
    """``xds.tls`` / ``ext_proc.tls``: mutual TLS between Envoy and one of inferlb's services. The service
    presents ``cert_file`` and refuses, in the handshake, every client without a certificate signed by
    ``client_ca_file`` (Envoy's is ``gateway.upstream_tls.cert_file``); Envoy checks that the service's
    certificate is signed by ``gateway.upstream_tls.ca_file`` and names ``server_name``. The service re-reads
    its files when they change (on the next handshake)."""

    #: CA(s) that sign the clients' (Envoy's) certificates, PEM.
    client_ca_file: PemFile
    #: The name Envoy expects in the service's certificate (a DNS subject alternative name; sent as SNI),
    #: e.g. a Kubernetes Service's DNS name. None: the host Envoy dials (``advertise``, else ``listen``),
    #: an IP then checked as an IP subject alternative name.
    server_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")] | None = None

    @model_validator(mode="after")
    def _check_files(self, info: ValidationInfo) -> Self:
        if _files_checked(info):
            return self
        self._check_pair()
        self._check_ca("client_ca_file", self.client_ca_file)
        return self


class UpstreamTls(TlsFiles):
    """``gateway.upstream_tls``: Envoy's side of the mutual TLS to inferlb's services (``xds.tls``,
    ``ext_proc.tls``): the client certificate Envoy presents and the CA it trusts for their certificates."""

    #: CA(s) that sign the services' certificates, PEM.
    ca_file: PemFile

    @model_validator(mode="after")
    def _check_files(self, info: ValidationInfo) -> Self:
        if _files_checked(info):
            return self
        self._check_pair()
        self._check_ca("ca_file", self.ca_file)
        return self


class GatewayConfig(_Frozen):
    """The Envoy side: the listener clients call and the admin interface."""

    listen: HostPort = HostPort(host="127.0.0.1", port=10000)
    admin: HostPort = HostPort(host="127.0.0.1", port=9901)
    #: Request bodies above this get 413 from Envoy's buffer limit, before ext_proc sees them (bytes).
    max_request_body_bytes: Annotated[int, Field(strict=True, ge=1024, le=64 * 1024 * 1024)] = 4 * 1024 * 1024
    #: Envoy route ``timeout`` (``RouteAction.timeout``, ms): one request's whole response, every retry
    #: included. 0 (default) disables it: a stream is bounded by the time to its first byte and between its
    #: chunks (``stream_*``), not by its length, and a non-streamed answer by ``per_try_timeout_ms``.
    request_timeout_ms: Annotated[int, Field(strict=True, ge=0)] = 0
    #: Non-streamed requests: Envoy ``RetryPolicy.per_try_timeout`` (ms), each attempt's time until the
    #: model server's response headers. A non-streamed answer's headers come with the whole generation
    #: (queueing included), so this must exceed the longest one; an attempt past it is reset and retried on
    #: another GPU. 0: none (the attempt may wait as long as ``request_timeout_ms``).
    per_try_timeout_ms: Annotated[int, Field(strict=True, ge=0, le=86_400_000)] = 300_000
    #: Streamed requests (``"stream": true``; ext_proc sets ``x-inferlb-stream``): Envoy
    #: ``RetryPolicy.per_try_idle_timeout`` (ms), the longest silence of the model server within one
    #: attempt: from the request to the first byte (its response headers, sent when it accepts the
    #: stream), from there to the first token (queueing and prefill), and between two chunks. Before the
    #: first byte the attempt is retried on another GPU (a hung server costs a new stream this long, not an
    #: error); after it Envoy cannot retry, and a stream that stops is cut after this long instead of being
    #: held. Never the stream's length. 0: none.
    stream_idle_timeout_ms: Annotated[int, Field(strict=True, ge=0, le=86_400_000)] = 60_000
    #: Downstream (client side) bounds, each on the gateway listener's HTTP connection manager. A client
    #: that sends its request headers slowly, or part of them and then nothing (slow loris), is answered
    #: 408 and disconnected this long after the first byte of its headers:
    #: ``HttpConnectionManager.request_headers_timeout`` (ms). Envoy's default is none. 0: none. (A
    #: connection that sends nothing at all is closed by ``downstream_idle_timeout_ms``.)
    request_headers_timeout_ms: Annotated[int, Field(strict=True, ge=0, le=3_600_000)] = 10_000
    #: ``RouteAction.idle_timeout`` of every route to a model (it overrides the HCM's
    #: ``stream_idle_timeout``, which stays at Envoy's 5 min for the other routes) (ms): the longest a
    #: request's stream may see no byte
    #: in either direction (a client that stops sending its body, a model server silent before its
    #: answer). It must exceed the longest silence of an accepted request, every retry included: a
    #: non-streamed answer's headers come with its last token, after up to ``per_try_timeout_ms`` per
    #: attempt (a hung server's attempt is retried on another GPU). None (default): derived by
    #: :meth:`downstream_stream_idle_ms`, ``(num_retries + 1) x max(per_try_timeout_ms,
    #: stream_idle_timeout_ms) + 10 s`` (910 s with the defaults; Envoy's own default of 5 min would cut a
    #: non-streamed request retried after a hung attempt). 0: none.
    downstream_stream_idle_timeout_ms: Annotated[int, Field(strict=True, ge=0, le=86_400_000)] | None = None
    #: ``HttpConnectionManager.common_http_protocol_options.idle_timeout`` (ms): a client connection with no
    #: request in flight is closed after this long (a stream in flight, however long, keeps it open).
    #: Envoy's default is 1 h. 0: none.
    downstream_idle_timeout_ms: Annotated[int, Field(strict=True, ge=0, le=86_400_000)] = 60_000
    #: ``HttpConnectionManager.request_timeout`` (ms): the time to receive the whole request (headers and
    #: body) from the client. Envoy disarms it once the request is complete (or the response has started),
    #: so it does not cut a long generation; but it also runs while ext_proc reads the buffered body, so a
    #: tight value turns a slow processor into 408s. 0 (default): none, as Envoy's default; a client's slow
    #: body is bounded by the stream idle timeout and its headers by ``request_headers_timeout_ms``.
    downstream_request_timeout_ms: Annotated[int, Field(strict=True, ge=0, le=86_400_000)] = 0
    #: Retries Envoy makes to another host (``previous_hosts``) on connect failure, refused stream, reset, a
    #: per-try timeout, or a ``retry_status_codes`` answer, while nothing of the response has reached the
    #: client.
    num_retries: Annotated[int, Field(strict=True, ge=0, le=10)] = 2
    #: HTTP statuses retried on another host (Envoy ``retriable-status-codes``): a model server's 503 (failed
    #: GPU, full queue) is retried when it is the first thing it answers, i.e. before any response byte
    #: reached the client. Empty: no status is retried.
    retry_status_codes: tuple[Annotated[int, Field(strict=True, ge=500, le=599)], ...] = (503,)
    #: ``retry-after`` (s) on Envoy's 503 when a model cluster's circuit breaker for the request's routing
    #: priority is full (response flag UO): DEFAULT traffic is shed this way before HIGH.
    overflow_retry_after_s: Annotated[int, Field(strict=True, ge=1, le=3600)] = 1
    #: Envoy worker threads (``--concurrency``); 0 lets Envoy use one per core.
    concurrency: Annotated[int, Field(strict=True, ge=0, le=256)] = 2
    #: Envoy node cluster name the xDS server groups snapshots by.
    node_cluster: str = "inferlb-gateway"
    #: Where the gateway's Envoys run: a model's ``cluster.failover`` puts endpoints of this region (and
    #: zone) at priority 0.
    region: str = "local"
    zone: str = "a"
    #: One JSON access-log line per request (:class:`AccessLogConfig`); none by default.
    access_log: AccessLogConfig | None = None
    #: TLS on ``listen`` (:class:`GatewayTls`: certificate, key, optional client CA); None: plain text.
    tls: GatewayTls | None = None
    #: Envoy's client certificate and trusted CA for the mutual TLS to inferlb's services
    #: (:class:`UpstreamTls`); needed when ``xds.tls`` or ``ext_proc.tls`` is set.
    upstream_tls: UpstreamTls | None = None
    #: A directory on Envoy's host holding Envoy's SDS files (needed with ``tls`` or ``upstream_tls``): small
    #: YAML files naming the certificate files, through which Envoy watches them and loads a rotated
    #: certificate without a restart (:func:`~xds_server.resources.transport_sockets.sds_files`).
    #: ``inferlb up`` writes them; for an Envoy elsewhere ``inferlb bootstrap --sds-dir DIR`` does. Each
    #: file's name carries a digest of its contents, so a changed certificate path is a new file, never a
    #: stale one.
    sds_dir: AbsoluteDir | None = None

    @model_validator(mode="after")
    def _check_sds_dir(self) -> Self:
        if self.sds_dir is None and (self.tls is not None or self.upstream_tls is not None):
            which = "tls" if self.tls is not None else "upstream_tls"
            raise ValueError(
                f"sds_dir: gateway.{which} needs a directory on Envoy's host for its SDS files (Envoy "
                "watches the certificate files through them); set gateway.sds_dir"
            )
        return self

    @model_validator(mode="after")
    def _check_downstream_idle_outlives_an_attempt(self) -> Self:
        idle = self.downstream_stream_idle_timeout_ms
        longest = max(self.per_try_timeout_ms, self.stream_idle_timeout_ms)
        if idle and (longest == 0 or idle <= longest):
            bound = "none" if longest == 0 else f"{longest} ms"
            raise ValueError(
                f"gateway.downstream_stream_idle_timeout_ms: {idle} ms does not outlive one attempt's "
                f"longest silence (per_try_timeout_ms / stream_idle_timeout_ms: {bound}): Envoy would cut "
                "requests a model server is still answering; raise it, set 0 (none) or leave it unset"
            )
        return self

    def downstream_stream_idle_ms(self) -> int:
        """The model routes' ``idle_timeout`` (ms): ``downstream_stream_idle_timeout_ms``, else
        ``(num_retries + 1) x max(per_try_timeout_ms, stream_idle_timeout_ms) + 10 s``, or 0 (none) when an
        attempt is not bounded at all (both per-try bounds 0)."""
        if self.downstream_stream_idle_timeout_ms is not None:
            return self.downstream_stream_idle_timeout_ms
        longest = max(self.per_try_timeout_ms, self.stream_idle_timeout_ms)
        return 0 if longest == 0 else (self.num_retries + 1) * longest + 10_000


class NodeGroup(_Frozen):
    """Where the Envoys of one node group (one ``node.cluster``) run."""

    region: str
    zone: str


def _check_advertise_not_unix(advertise: HostPort | None, listen_unix: UnixSocket | None) -> None:
    if advertise is not None and listen_unix is not None:
        raise ValueError("advertise: cannot be combined with listen_unix (Envoy dials the socket); drop one")


class XdsConfig(_Frozen):
    """Our xDS control server."""

    listen: HostPort = HostPort(host="127.0.0.1", port=18000)
    #: Serve xDS on this Unix domain socket (an absolute path) instead of ``listen``, the socket file mode
    #: 0600 (only the user running the xDS server, and so Envoy run as that user, may connect); Envoy's
    #: bootstrap then dials it as a ``pipe`` address. None: TCP on ``listen``.
    listen_unix: UnixListen | None = None
    #: Mutual TLS on ``listen`` (:class:`ServiceTls`): the xDS server presents ``cert_file`` and takes only
    #: clients with a certificate signed by ``client_ca_file``; the bootstrap's ``inferlb_xds`` cluster
    #: dials it with ``gateway.upstream_tls``. None: plain text. Not with ``listen_unix``. On restart.
    tls: ServiceTls | None = None
    #: Where Envoy dials the xDS server (its bootstrap's ``inferlb_xds`` cluster, and so every xDS stream):
    #: ``host:port``, a DNS name allowed (a Kubernetes Service: ``xds.inferlb.svc.cluster.local:18000``).
    #: None: ``listen`` itself (or ``listen_unix``'s socket). Lets ``listen`` bind ``0.0.0.0``, which cannot
    #: be advertised. Not with ``listen_unix``.
    advertise: HostPort | None = None
    #: Changes within this window are coalesced into one push (ms).
    push_debounce_ms: Annotated[int, Field(strict=True, ge=0, le=60_000)] = 100
    #: Bound on staleness: a burst of changes is pushed at most this long after its first change (ms),
    #: even while changes keep arriving within ``push_debounce_ms`` of each other.
    push_max_delay_ms: Annotated[int, Field(strict=True, ge=0, le=600_000)] = 1_000
    #: HTTP address of the xDS server's fleet API, ``/metrics`` and client list; None: no HTTP API.
    api_listen: HostPort | None = HostPort(host="127.0.0.1", port=18001)
    #: Where the request-path processes (the endpoint-state poll of ``endpoint_picking``) and ``inferlb xds``
    #: dial the fleet API: ``host:port``, a DNS name allowed. None: ``api_listen`` itself.
    api_advertise: HostPort | None = None
    #: Bearer token the fleet API requires (``Authorization: Bearer <token>``). The env variable
    #: ``INFERLB_XDS_API_TOKEN`` overrides it; with neither set, the fleet API refuses every change.
    api_token: Annotated[str, Field(min_length=16, max_length=512)] | None = None
    #: How long a drained endpoint stays in its cluster as DRAINING (no new requests, in-flight ones
    #: finish) before it is removed (ms).
    drain_period_ms: Annotated[int, Field(strict=True, ge=0, le=3_600_000)] = 30_000
    #: How often endpoint host names are resolved again (ms); a changed address is pushed like any other
    #: change, a name that stops resolving keeps its last address (logged). 0: only at load/registration.
    resolve_interval_ms: Annotated[int, Field(strict=True, ge=0, le=86_400_000)] = 30_000
    #: Envoy's backoff when its xDS stream to this server breaks (bootstrap ``EnvoyGrpc.retry_policy
    #: .retry_back_off``, ms): the first reconnect after ``reconnect_base_ms``, doubling (jittered) up to
    #: ``reconnect_max_ms``. Envoy's default (1 s doubling to 10 s) left a restarted server's Envoys away for
    #: ~18 s; these resync within about a second of its return. Raise both for very large fleets.
    reconnect_base_ms: Annotated[int, Field(strict=True, ge=10, le=60_000)] = 250
    reconnect_max_ms: Annotated[int, Field(strict=True, ge=10, le=600_000)] = 1_000
    #: Snapshots per node group: Envoys whose ``node.cluster`` is a key here run in that locality and get
    #: their own snapshot, with each model's ``cluster.failover`` priorities relative to it; other Envoys
    #: get the default snapshot (relative to ``gateway.region``/``gateway.zone``).
    node_groups: dict[str, NodeGroup] = {}
    #: Where the fleet API's changes (registrations, drains with their wall-clock end, deregistrations,
    #: weight pins) are stored so that a restart keeps them (a JSON file replaced atomically on every
    #: change, see xds_server/fleet_store.py); a relative path is relative to the config file's directory.
    #: None: the changes live in memory only and a restart forgets them. Read at start-up only.
    state_file: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    #: redis-py URL (``redis://``, ``rediss://`` or ``unix://``) of a fleet store several xDS servers share
    #: instead of ``state_file`` (xds_server/fleet_store.py): each change is a compare-and-set on one
    #: versioned document, announced to every server, which all serve it. None: ``state_file`` (or memory).
    #: Read at start-up only; Redis must persist it (``appendonly yes``).
    state_redis_url: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    #: The Redis key of the shared fleet document (a hash; announcements on ``<key>:changed``). Servers
    #: that serve the same Envoy fleet use the same key.
    state_redis_key: Annotated[str, Field(min_length=1, max_length=128)] = "inferlb:fleet"
    #: Timeout of one command to the fleet store, and of opening a connection to it (ms): slower counts as
    #: the store being down (fleet changes answer 503, the last state keeps serving).
    state_redis_timeout_ms: Annotated[int, Field(strict=True, ge=1, le=60_000)] = 1_000
    #: How often each server reads the store's version besides listening for announcements (which a
    #: reconnecting subscriber can miss), and retries a store that is down (ms).
    state_redis_poll_ms: Annotated[int, Field(strict=True, ge=10, le=60_000)] = 500

    @field_validator("state_redis_url")
    @classmethod
    def _check_state_redis_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"expected a redis://, rediss:// or unix:// URL, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_one_state_store(self) -> Self:
        if self.state_file is not None and self.state_redis_url is not None:
            raise ValueError(
                "state_file and state_redis_url are both set: the fleet API's changes go to one store, "
                "the file (one server) or Redis (shared by several servers); drop one"
            )
        return self

    @model_validator(mode="after")
    def _check_reconnect(self) -> Self:
        if self.reconnect_max_ms < self.reconnect_base_ms:
            raise ValueError(
                f"reconnect_max_ms: {self.reconnect_max_ms} is below reconnect_base_ms "
                f"({self.reconnect_base_ms}); Envoy needs max >= base"
            )
        return self

    @model_validator(mode="after")
    def _check_advertise(self) -> Self:
        _check_advertise_not_unix(self.advertise, self.listen_unix)
        if self.listen_unix is None:
            check_dialable("xds.advertise", self.advertise or self.listen, "xds.listen")
        if self.api_advertise is not None:
            check_dialable("xds.api_advertise", self.api_advertise, "xds.api_listen")
        return self

    def grpc_address(self) -> GrpcAddress:
        """Where the xDS gRPC server listens (binds): ``listen_unix`` when set, else ``listen``."""
        return self.listen_unix or self.listen

    def dial_address(self) -> GrpcAddress:
        """Where Envoy dials the xDS server: ``advertise``, else ``listen_unix``, else ``listen``."""
        return self.advertise or self.grpc_address()

    def api_dial_address(self) -> HostPort | None:
        """Where clients dial the fleet API: ``api_advertise``, else ``api_listen`` (None: no API)."""
        if self.api_listen is None:
            return None
        return self.api_advertise or self.api_listen


class ExtProcConfig(_Frozen):
    """Our request-path service (quota, routing headers) and how Envoy calls it."""

    #: How Envoy calls the request-path service: ``ext_authz`` (the default: ``envoy.filters.http.ext_authz``
    #: in HTTP-service mode, one HTTP/1.1 check per request with the buffered body; ``python -m ext_authz``)
    #: or ``ext_proc`` (``envoy.filters.http.ext_proc``, a gRPC stream per request; ``python -m ext_proc``).
    #: Both serve the same decisions (:mod:`ext_proc.handlers`) on the addresses below. ``ext_authz`` meters
    #: responses in Envoy (a Lua filter reads the usage, the gRPC access log brings it to ``meter_listen``, or
    #: to the ``extra_meter_listen`` address of the ``extra_listen`` process that admitted the request).
    protocol: Literal["ext_proc", "ext_authz"] = "ext_authz"
    listen: HostPort = HostPort(host="127.0.0.1", port=18080)
    #: Serve ext_proc (ext_authz's HTTP service with ``protocol: ext_authz``) on this Unix domain socket (an
    #: absolute path) instead of ``listen``, the socket file mode 0600 (only the user running the service,
    #: and so Envoy run as that user, may connect); the ``inferlb_ext_proc`` (``inferlb_ext_authz``) cluster
    #: then dials it as a ``pipe`` address. None: TCP on ``listen``. Not with
    #: ``extra_listen`` (one process serves the socket).
    listen_unix: UnixListen | None = None
    #: Where Envoy dials the (first) request-path process: the endpoint of the ``inferlb_ext_proc``
    #: (``inferlb_ext_authz``) cluster. ``host:port``, a DNS name allowed (e.g. a headless Kubernetes
    #: Service, whose every pod address becomes an endpoint). None: ``listen`` itself (or ``listen_unix``'s
    #: socket). Lets ``listen`` bind ``0.0.0.0``. Not with ``listen_unix``. The ``extra_listen`` addresses
    #: are both bound and dialled.
    advertise: HostPort | None = None
    #: More ext_proc processes, each serving on its own address (``python -m ext_proc --listen ADDR``): every
    #: address is its own endpoint of the ``inferlb_ext_proc`` cluster. Envoy opens one HTTP/2 connection per
    #: endpoint per worker, so processes behind one SO_REUSEPORT address would not share the load.
    extra_listen: tuple[HostPort, ...] = ()
    #: Mutual TLS on every request-path address (:class:`ServiceTls`): ``listen`` and ``extra_listen``
    #: (ext_proc's gRPC, or ext_authz's HTTP service) and the settlers' ``meter_listen`` addresses, each
    #: presenting ``cert_file`` and taking only clients with a certificate signed by ``client_ca_file``;
    #: the ``inferlb_ext_proc`` / ``inferlb_ext_authz`` / ``inferlb_meter*`` clusters dial them with
    #: ``gateway.upstream_tls``. None: plain text. Not with ``listen_unix``. On restart.
    tls: ServiceTls | None = None
    #: Envoy ``message_timeout`` per ext_proc message (ms). Envoy's 200 ms default breaks big bodies.
    message_timeout_ms: Annotated[int, Field(strict=True, ge=10, le=60_000)] = 5_000
    #: Envoy ``failure_mode_allow``: on an ext_proc failure (process down, gRPC error, ``message_timeout``),
    #: forward unprocessed (True, "fail open") or answer 5xx JSON (False, "fail closed"). The default for
    #: every path; ``path_failure_modes`` overrides it per path.
    failure_mode_allow: bool = False
    #: Per-path failure mode, ``{path: open|closed}`` (e.g. ``{/v1/embeddings: open}``): each OpenAI inference
    #: path (and each path named here) gets its own Envoy route whose ``ExtProcPerRoute`` sets
    #: ``failure_mode_allow`` explicitly (``protocol: ext_authz``: which of two ext_authz filters, one per
    #: mode, the route enables). Paths match exactly, query string excluded.
    path_failure_modes: dict[
        Annotated[str, Field(pattern=r"^/[A-Za-z0-9._~/-]{0,255}$")], Literal["open", "closed"]
    ] = {}
    #: A failed-open request (ext_proc did not answer) is routed by Envoy on its body's ``model`` (name or
    #: alias) to that model's main version, with its API key checked by Envoy. This model (name or alias)
    #: takes the failed-open requests whose body names no model Envoy can read (not JSON, no ``model``):
    #: its main version (largest ``traffic_percent``), its name merged into a JSON body. None: those get
    #: 400 JSON "you must provide a model parameter".
    fail_open_model: str | None = None
    #: Settle each request's quota reservation with the real usage of its response (and hold its
    #: concurrency slot until the response ends). ``protocol: ext_proc``: Envoy sends response headers
    #: (SEND) and bodies (STREAMED) to ext_proc (the xDS server derives ``processing_mode`` from this
    #: field). ``protocol: ext_authz``: Envoy's response Lua filter reads the usage and its gRPC access log
    #: brings it to ``meter_listen``, up to ``meter_flush_interval_ms`` late; an entry that never comes
    #: settles at the reservation after ``lease_ttl_ms``. False: the reservation (prompt + output cap) is
    #: the charge and the concurrency slot is released at admission.
    account_responses: bool = True
    #: ``protocol: ext_authz`` with ``account_responses``: where the ext_authz process serves Envoy's gRPC
    #: access-log service (the settler). Unused otherwise. (Its default port sits below ``listen``: the
    #: ports above ``metrics_listen`` are the derived ``extra_metrics_listen``.)
    meter_listen: HostPort = HostPort(host="127.0.0.1", port=18079)
    #: Where Envoy's access log dials the first process's settler (the ``inferlb_meter`` cluster):
    #: ``host:port``, a DNS name allowed. None: ``meter_listen`` itself.
    meter_advertise: HostPort | None = None
    #: ``protocol: ext_authz`` with ``account_responses``: the settler address of each ``extra_listen``
    #: process, in the same order (each process settles the reservations it made; Envoy's access log sends
    #: each entry to its owner, :func:`xds_server.resources.listener.build_meter_access_logs`). Empty:
    #: derived as ``meter_listen``'s host with its port - 1, - 2, ... (:meth:`meter_addresses`; below it,
    #: as the port above ``meter_listen`` is ``listen``'s by default).
    extra_meter_listen: tuple[HostPort, ...] = ()
    #: Envoy's gRPC access log ``buffer_flush_interval`` (ms): the most an entry waits in Envoy before it is
    #: sent, so the most a settlement is late (plus the settler's own time); also what a clean Envoy stop
    #: must wait after the last request (Envoy does not flush the buffer when it exits).
    meter_flush_interval_ms: Annotated[int, Field(strict=True, ge=10, le=60_000)] = 1_000
    #: Envoy's gRPC access log ``buffer_size_bytes``: a worker's buffer is sent once it holds this much
    #: (bytes; ~30 entries of the gateway's at 16 KiB).
    meter_buffer_bytes: Annotated[int, Field(strict=True, ge=1_024, le=4 * 1024 * 1024)] = 16_384
    #: Where quota state lives: ``memory`` (this process) or ``redis`` (shared by several replicas).
    quota_backend: Literal["memory", "redis"] = "memory"
    #: redis-py URL of the shared quota state (``quota_backend: redis``).
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Prefix of every Redis key inferlb writes.
    redis_key_prefix: Annotated[str, Field(min_length=1, max_length=64)] = "inferlb:quota"
    #: Timeout of one Redis command on an open connection (ms); a slower command counts as Redis failing.
    #: Opening a connection has its own timeout (``redis_connect_timeout_ms``) and waiting for a free one
    #: is bounded by the request's budget instead (:mod:`inferlb.adapters.quota_redis`).
    redis_timeout_ms: Annotated[int, Field(strict=True, ge=1, le=10_000)] = 100
    #: Timeout of opening one Redis connection, TCP connect and handshake (ms); slower counts as Redis
    #: unreachable. Connections open at start-up (all ``redis_pool_size``) and again only after one broke.
    redis_connect_timeout_ms: Annotated[int, Field(strict=True, ge=1, le=60_000)] = 1_000
    #: Redis connections per ext_proc process, all opened at start-up; at most this many quota calls run at
    #: once, the others wait for a free connection (within 90% of ``message_timeout_ms`` from the body's
    #: arrival, then 503 ``quota_backend_busy``, never admitted unchecked).
    redis_pool_size: Annotated[int, Field(strict=True, ge=1, le=1_024)] = 16
    #: When Redis is unreachable: ``open`` admits the request unchecked, ``closed`` answers 503.
    redis_failure_mode: Literal["open", "closed"] = "open"
    #: Lifetime of a concurrency lease that is never released (ms): its ext_proc replica died holding it
    #: (Redis), or its stream's end went unseen. After it the slot counts no more. None: the route timeout
    #: (``gateway.request_timeout_ms``) + 60 s, or 1 h when the route timeout is off
    #: (:func:`inferlb.policy.quota.lease_ttl_s`). Must exceed the route timeout, or a running request
    #: could lose its slot.
    lease_ttl_ms: Annotated[int, Field(strict=True, ge=1_000, le=7 * 86_400_000)] | None = None
    #: A request header carrying the client's session id (e.g. ``x-session-id``): its value, when sent,
    #: makes the session affinity key instead of the request's ``user`` field
    #: (:mod:`inferlb.policy.affinity`).
    session_header: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,63}$")] | None = None
    #: HTTP address of ext_proc's Prometheus ``/metrics``.
    metrics_listen: HostPort = HostPort(host="127.0.0.1", port=18081)
    #: ``/metrics`` address of each ``extra_listen`` process, in the same order. Empty: derived as
    #: ``metrics_listen``'s host with its port + 1, + 2, ... (:meth:`extra_metrics_addresses`).
    extra_metrics_listen: tuple[HostPort, ...] = ()
    #: Requests to paths that are not OpenAI inference or ``/v1/models``: ``deny`` answers 404
    #: ``unknown_url`` in ext_proc; ``allow`` lets them through unexamined (API key still checked,
    #: ``x-inferlb-*`` headers still stripped) to whatever route Envoy has for them.
    non_inference_paths: Literal["deny", "allow"] = "deny"
    #: Models with ``endpoint_picking``: how often each request-path process reads the live endpoint state
    #: (endpoints, health, weights, queue and KV telemetry) from the xDS server's ``GET /v1/picking`` (ms).
    #: A failed read keeps the last state serving (see :mod:`ext_proc.picking`).
    endpoint_state_poll_ms: Annotated[int, Field(strict=True, ge=50, le=60_000)] = 250

    @model_validator(mode="after")
    def _check_extra_metrics(self) -> Self:
        if self.listen_unix is not None and self.extra_listen:
            raise ValueError(
                "listen_unix: cannot be combined with extra_listen (one ext_proc process serves the Unix "
                "socket); drop extra_listen or listen_unix"
            )
        n, m = len(self.extra_listen), len(self.extra_metrics_listen)
        if m and m != n:
            raise ValueError(
                f"extra_metrics_listen: {m} addresses for {n} extra_listen processes; give one each"
            )
        if not m and n and self.metrics_listen.port + n > 65535:
            raise ValueError("extra_metrics_listen: metrics_listen's port + extra processes passes 65535")
        k = len(self.extra_meter_listen)
        if k and k != n:
            raise ValueError(
                f"extra_meter_listen: {k} addresses for {n} extra_listen processes; give one each"
            )
        if not k and n and self.meters_access_log() and self.meter_listen.port - n < 1:
            raise ValueError(
                "extra_meter_listen: meter_listen's port - extra processes goes below 1; give the addresses"
            )
        return self

    @model_validator(mode="after")
    def _check_advertise(self) -> Self:
        _check_advertise_not_unix(self.advertise, self.listen_unix)
        if self.listen_unix is None:
            check_dialable("ext_proc.advertise", self.advertise or self.listen, "ext_proc.listen")
        for i, hp in enumerate(self.extra_listen):
            check_dialable(f"ext_proc.extra_listen[{i}]", hp, f"ext_proc.extra_listen[{i}]")
        if self.meters_access_log():
            first = self.meter_dial_addresses()[0]
            check_dialable("ext_proc.meter_advertise", first, "ext_proc.meter_listen")
        return self

    def dial_addresses(self) -> tuple[GrpcAddress, ...]:
        """Where Envoy dials each request-path process, process 0 first: ``advertise`` (else ``listen_unix``,
        else ``listen``), then each ``extra_listen`` address."""
        return (self.advertise or self.grpc_address(), *self.extra_listen)

    def meter_dial_addresses(self) -> tuple[HostPort, ...]:
        """Where Envoy's access log dials each process's settler: :meth:`meter_addresses` with process 0's
        ``meter_advertise`` when set."""
        first, *rest = self.meter_addresses()
        return (self.meter_advertise or first, *rest)

    def meters_access_log(self) -> bool:
        """True when responses are metered through Envoy's access log: ``protocol: ext_authz`` with
        ``account_responses`` (the settler serves on ``meter_listen``)."""
        return self.protocol == "ext_authz" and self.account_responses

    def grpc_address(self) -> GrpcAddress:
        """Where the (first) ext_proc process serves gRPC: ``listen_unix`` when set, else ``listen``."""
        return self.listen_unix or self.listen

    def meter_addresses(self) -> tuple[HostPort, ...]:
        """The settler address of each request-path process, process 0 (``listen``) first, then each
        ``extra_listen`` process: ``meter_listen``, then ``extra_meter_listen`` or ``meter_listen``'s port
        - 1, - 2, ... on its host."""
        if self.extra_meter_listen:
            return (self.meter_listen, *self.extra_meter_listen)
        mh = self.meter_listen
        extra = tuple(HostPort(host=mh.host, port=mh.port - i - 1) for i in range(len(self.extra_listen)))
        return (mh, *extra)

    def process_index(self, listen: GrpcAddress) -> int | None:
        """Which request-path process serves on ``listen``: 0 for ``listen`` (or ``listen_unix``), ``i + 1``
        for ``extra_listen[i]``; None when the config names no such address."""
        for i, addr in enumerate((self.grpc_address(), *self.extra_listen)):
            if str(addr) == str(listen):
                return i
        return None

    def extra_metrics_addresses(self) -> tuple[HostPort, ...]:
        """The ``/metrics`` address of each ``extra_listen`` process: ``extra_metrics_listen``, or
        ``metrics_listen``'s port + 1, + 2, ... on its host."""
        if self.extra_metrics_listen:
            return self.extra_metrics_listen
        mh = self.metrics_listen
        return tuple(HostPort(host=mh.host, port=mh.port + i + 1) for i in range(len(self.extra_listen)))


class GpuProfile(_Frozen):
    """One GPU type. ``relative_capacity`` is its LLM serving throughput relative to a V100 (= 1.0);
    the endpoint weight Envoy receives is proportional to it (see
    :func:`inferlb.policy.capacity.capacity_weight`)."""

    relative_capacity: Annotated[float, Field(strict=True, gt=0, le=100)]
    memory_gb: Annotated[float, Field(strict=True, gt=0)] = 80.0
    #: Prefill (compute-bound, scales with dense FLOPs) and decode (memory-bound, scales with HBM bandwidth)
    #: speed relative to a V100; unset: ``relative_capacity``. The simulated servers run at these speeds (see
    #: ``simulation.gpusim.engine``; the bundled configs give datasheet-derived values and their sources);
    #: the endpoint picker divides the prompt tokens an endpoint must prefill by its prefill capacity
    #: (:mod:`inferlb.policy.picker`).
    prefill_relative_capacity: Annotated[float | None, Field(strict=True, gt=0, le=1000)] = None
    decode_relative_capacity: Annotated[float | None, Field(strict=True, gt=0, le=1000)] = None


class Simulation(_Frozen):
    """Timing of the simulated GPU model servers (``gpusim``), for a GPU of relative capacity 1.0.

    A GPU of capacity ``c`` prefills ``c * prefill_tokens_per_s`` and decodes ``c * decode_tokens_per_s``
    per running sequence; at most ``max_batch`` sequences run at once, the rest queue (FIFO).
    Defaults are of the order of a 7-8B model on a V100 in vLLM (prefill a few thousand tokens/s,
    ~30 tokens/s per sequence decode).
    """

    prefill_tokens_per_s: Annotated[float, Field(strict=True, gt=0)] = 4000.0
    decode_tokens_per_s: Annotated[float, Field(strict=True, gt=0)] = 30.0
    max_batch: Annotated[int, Field(strict=True, ge=1, le=4096)] = 16
    #: Queue bound behind the batch; beyond it the simulated server answers 503 (as vLLM does when full).
    max_queue: Annotated[int, Field(strict=True, ge=0, le=100_000)] = 256
    #: Automatic prefix caching (``simulation.kvcache``): prompt blocks found cached are not prefilled. On by
    #: default, as in vLLM's V1 engine (``--enable-prefix-caching``).
    prefix_caching: Annotated[bool, Field(strict=True)] = True
    #: Tokens per KV-cache block (vLLM's ``--block-size``, default 16).
    block_size: Annotated[int, Field(strict=True, ge=1, le=1024)] = 16
    #: Token budget of one engine step (vLLM's ``--max-num-batched-tokens`` with chunked prefill, 8192 for
    #: vLLM V1's OpenAI server): decode tokens first, then prefill chunks fill the rest; ``null``: no
    #: chunking (every admitted prompt is prefilled whole, stalling the batch). At least ``max_batch``.
    max_num_batched_tokens: Annotated[int | None, Field(strict=True, ge=1, le=1_048_576)] = 8192
    #: How a step's prefill and decode times combine: ``sum`` (one after the other) or ``max`` (overlapped;
    #: ``simulation.scheduler.step_seconds``).
    step_time: Literal["sum", "max"] = "sum"

    @model_validator(mode="after")
    def _budget_holds_batch(self) -> Self:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_batch:
            raise ValueError(
                f"max_num_batched_tokens: must be >= max_batch ({self.max_batch}), got "
                f"{self.max_num_batched_tokens}: every decoding sequence takes one token of a step"
            )
        return self


class WeightsConfig(_Frozen):
    """How telemetry turns into Envoy endpoint weights (:mod:`inferlb.policy.weights` has the formula and
    sources).

    The weight of an endpoint with fresh telemetry is ``scale * relative_capacity * performance * load *
    kv * errors``, smoothed with an EWMA of time constant ``smoothing_tau_ms``, pushed only when it moves by
    at least ``hysteresis_percent``, ramped in over ``slow_start_ms`` for a new endpoint, bounded to
    ``[1, max_weight]``. Telemetry older than ``stale_after_ms`` is ignored and the endpoint gets its
    profile weight (``scale * relative_capacity``).
    """

    #: ``static``: Envoy gets each endpoint's capacity weight (``inferlb.policy.capacity.capacity_weight``, 10
    #: per unit of relative capacity). ``telemetry``: the xDS server computes every endpoint's weight from its
    #: telemetry with this section's policy (``scale`` per unit of capacity) and pushes it. A model whose
    #: ``cluster.slow_start_window_ms`` is set keeps Envoy's slow start and skips ``slow_start_ms``.
    mode: Literal["static", "telemetry"] = "static"
    #: Weight units per unit of relative capacity (V100 = 1.0 -> 100). Finer than the static
    #: ``inferlb.policy.capacity.WEIGHT_SCALE`` (10) so that a few percent of load shows in Envoy's integer
    #: weights.
    scale: Annotated[float, Field(strict=True, gt=0, le=10_000)] = 100.0
    #: Upper bound of a pushed weight (Envoy caps the sum per locality at 2^32-1).
    max_weight: Annotated[int, Field(strict=True, ge=1, le=1_000_000)] = 10_000
    #: EWMA time constant (ms): after a step change of the inputs, 63% of the change is applied after
    #: one time constant, 90% after 2.3.
    smoothing_tau_ms: Annotated[int, Field(strict=True, ge=0, le=600_000)] = 1_000
    #: A new weight is pushed only when it differs from the pushed one by at least this much (%).
    hysteresis_percent: Annotated[float, Field(strict=True, ge=0, le=100)] = 10.0
    #: A new endpoint's weight ramps linearly from ``slow_start_min_percent`` to 100% over this time (ms).
    slow_start_ms: Annotated[int, Field(strict=True, ge=0, le=3_600_000)] = 10_000
    slow_start_min_percent: Annotated[float, Field(strict=True, gt=0, le=100)] = 10.0
    #: Telemetry older than this (ms) is ignored: the endpoint falls back to its profile weight.
    stale_after_ms: Annotated[int, Field(strict=True, ge=1, le=3_600_000)] = 5_000
    #: Weight lost per waiting request, relative to the batch size: ``load = 1 / (1 + q * waiting / batch
    #: + r * running / batch)`` with ``q = queue_penalty`` and ``r = running_penalty``.
    queue_penalty: Annotated[float, Field(strict=True, ge=0, le=100)] = 1.0
    running_penalty: Annotated[float, Field(strict=True, ge=0, le=100)] = 0.25
    #: KV-cache usage (0..1) above which the weight falls linearly, to ``kv_floor`` at a full cache.
    kv_knee: Annotated[float, Field(strict=True, ge=0, lt=1)] = 0.8
    kv_floor: Annotated[float, Field(strict=True, gt=0, le=1)] = 0.2
    #: Factor applied when a thermal or power throttle reason is set and no clock ratio is known.
    throttle_factor: Annotated[float, Field(strict=True, gt=0, le=1)] = 0.5
    #: ``errors = max(error_floor, 1 - error_penalty * error_rate)``.
    error_penalty: Annotated[float, Field(strict=True, ge=0, le=100)] = 2.0
    error_floor: Annotated[float, Field(strict=True, gt=0, le=1)] = 0.05


class TelemetryConfig(_Frozen):
    """Where and how often telemetry is gathered: the model-server ``/metrics`` scrape and the GPU agents."""

    #: Period of the model-server ``/metrics`` scrape (ms).
    scrape_interval_ms: Annotated[int, Field(strict=True, ge=50, le=600_000)] = 500
    #: Timeout of one scrape (ms); a timed-out scrape keeps the last sample, which then ages.
    scrape_timeout_ms: Annotated[int, Field(strict=True, ge=10, le=60_000)] = 1_000
    #: Period at which ``inferlb agent`` reads NVML and reports (ms).
    agent_interval_ms: Annotated[int, Field(strict=True, ge=50, le=600_000)] = 1_000


class OutlierDetection(_Frozen):
    """Envoy ``outlier_detection`` for a model's clusters. Envoy defaults differ (gateway-failure and
    failure-percentage enforcement default to 0%, i.e. off): every field is sent explicitly."""

    consecutive_5xx: Annotated[int, Field(strict=True, ge=1)] = 5
    consecutive_gateway_failure: Annotated[int, Field(strict=True, ge=1)] = 3
    enforcing_consecutive_gateway_failure: Annotated[int, Field(strict=True, ge=0, le=100)] = 100
    interval_ms: Annotated[int, Field(strict=True, ge=100)] = 5_000
    base_ejection_time_ms: Annotated[int, Field(strict=True, ge=100)] = 15_000
    max_ejection_percent: Annotated[int, Field(strict=True, ge=0, le=100)] = 50
    #: Failure-percentage ejection: a host whose error rate is at least this (%) over an interval is
    #: ejected, when the cluster has ``failure_percentage_minimum_hosts`` hosts and the host served
    #: ``failure_percentage_request_volume`` requests. Enforcement defaults to 0 (off), as in Envoy.
    failure_percentage_threshold: Annotated[int, Field(strict=True, ge=0, le=100)] = 85
    enforcing_failure_percentage: Annotated[int, Field(strict=True, ge=0, le=100)] = 0
    failure_percentage_minimum_hosts: Annotated[int, Field(strict=True, ge=0)] = 5
    failure_percentage_request_volume: Annotated[int, Field(strict=True, ge=0)] = 50


class CircuitBreaker(_Frozen):
    """Envoy ``circuit_breakers.thresholds`` for one routing priority."""

    max_connections: Annotated[int, Field(strict=True, ge=1)] = 4096
    max_pending_requests: Annotated[int, Field(strict=True, ge=1)] = 1024
    max_requests: Annotated[int, Field(strict=True, ge=1)] = 4096
    max_retries: Annotated[int, Field(strict=True, ge=0)] = 16


class HealthCheck(_Frozen):
    """Envoy active HTTP health checking of a model's endpoints (``GET path`` must answer 200).

    An endpoint failing ``unhealthy_threshold`` checks in a row is taken out of balancing until it passes
    ``healthy_threshold`` in a row; Envoy checks every ``interval_ms`` (with up to ``interval_jitter_ms``
    added), the next check starting that long after the previous one answered or timed out. With the
    defaults a server whose ``/health`` answers 503 is out after ~1-2 s and one that hangs (no answer:
    each check times out after ``timeout_ms``) after ~3 s, whatever traffic it gets; a recovered one is
    back after two passing checks (~2 s). One check per second per endpoint per Envoy.
    """

    #: The model server's health path (vLLM, SGLang, TGI and gpusim serve ``/health``).
    path: Annotated[str, Field(pattern=r"^/")] = "/health"
    interval_ms: Annotated[int, Field(strict=True, ge=100, le=600_000)] = 1_000
    interval_jitter_ms: Annotated[int, Field(strict=True, ge=0, le=600_000)] = 100
    timeout_ms: Annotated[int, Field(strict=True, ge=10, le=60_000)] = 1_000
    unhealthy_threshold: Annotated[int, Field(strict=True, ge=1, le=100)] = 2
    healthy_threshold: Annotated[int, Field(strict=True, ge=1, le=100)] = 2
    #: Check interval while the cluster has had no traffic (ms): Envoy's ``no_traffic_interval``, whose
    #: default (60 s) would make an idle model's recovered GPU wait a minute to come back.
    no_traffic_interval_ms: Annotated[int, Field(strict=True, ge=100, le=600_000)] = 5_000


class LengthTier(_Frozen):
    """One confined length class of tiered placement (:attr:`LengthAwareRouting.tiers`)."""

    #: Requests whose output cap exceeds this (tokens), and no higher class's, are of this class.
    above_output_tokens: Annotated[int, Field(strict=True, ge=0, le=10_000_000)]
    #: They are balanced among the GPUs whose profile's ``relative_capacity`` is at least this (V100 = 1.0).
    min_relative_capacity: Annotated[float, Field(strict=True, gt=0, le=100)]


class LearnedThresholds(_Frozen):
    """Length-class thresholds learnt from the output caps the request path sees
    (:class:`inferlb.policy.threshold_learner.ThresholdLearner`), per request-path process: the tiered
    threshold rule (:func:`inferlb.policy.length_aware.tier_thresholds`) over the last ``window`` requests of
    the cluster, re-derived every ``rederive_every_s`` at most, replaced only past the ``hysteresis``. The
    static thresholds (``long_output_tokens``, or each tier's ``above_output_tokens``) serve until
    ``min_samples`` requests were seen. Defaults are the learner's (:data:`~inferlb.policy.threshold_learner.
    DEFAULT_WINDOW` and the others, where each is explained)."""

    #: Requests the thresholds are derived from, the most recent.
    window: Annotated[int, Field(strict=True, ge=16, le=1_000_000)] = 4096
    #: Requests seen before the learnt thresholds replace the static ones (at most ``window``); None
    #: (default): 256 or the window, the smaller (:attr:`samples_before_use`).
    min_samples: Annotated[int, Field(strict=True, ge=1, le=1_000_000)] | None = None
    #: Least seconds between two derivations (0: at every request; for tests).
    rederive_every_s: Annotated[float, Field(strict=True, ge=0, le=86_400)] = 10.0
    #: The least change of a class's confined work share (of the window's work) that replaces the
    #: thresholds in use (0: every derivation does).
    hysteresis: Annotated[float, Field(strict=True, ge=0, lt=1)] = 0.05
    #: The share of a class's GPU set capacity its confined requests may take
    #: (:data:`~inferlb.policy.length_aware.DEFAULT_TIER_WORK_FRACTION`).
    fraction: Annotated[float, Field(strict=True, gt=0, le=1)] = 0.75
    #: GPU work of one prompt token relative to one generated token
    #: (:data:`~inferlb.policy.threshold_learner.DEFAULT_PROMPT_TOKEN_WORK`).
    prompt_token_work: Annotated[float, Field(strict=True, ge=0, le=100)] = 0.12

    @property
    def samples_before_use(self) -> int:
        """``min_samples``, else the smaller of 256 (the learner's ``DEFAULT_MIN_SAMPLES``) and ``window``."""
        return self.min_samples if self.min_samples is not None else min(256, self.window)

    @model_validator(mode="after")
    def _check_min_samples(self) -> Self:
        if self.min_samples is not None and self.min_samples > self.window:
            raise ValueError(
                f"min_samples ({self.min_samples}) must not exceed window ({self.window}): the window never "
                "holds more"
            )
        return self


class LengthAwareRouting(_Frozen):
    """Length-aware placement for one model (:mod:`inferlb.policy.length_aware`), in one of two forms.

    Two tiers (the default form): a request whose output cap (``max_completion_tokens``/``max_tokens``/
    ``max_output_tokens``, else ``default_max_tokens``, x ``n``) exceeds ``long_output_tokens`` is balanced
    among the model's fast GPUs only (``relative_capacity >= fast_min_relative_capacity``; Envoy subset
    load balancing on GPU-class endpoint metadata); other requests are balanced over every GPU. The
    defaults come from the 1,000-GPU simulation (bench/fleet_sim.py, Azure 2023 conversation trace): 384
    tokens is that trace's 70th percentile of completion lengths, and 1.5 puts A100s (1.7) and H100s (3.4)
    in the fast tier and V100s (1.0) outside it.

    Tiered (``tiers`` given, longest class first): a request belongs to the first tier whose
    ``above_output_tokens`` its cap exceeds and is balanced among that tier's GPUs; a request below every
    tier runs anywhere. Both lists must fall: a longer class on faster GPUs. The thresholds should come
    from a rule over a training window, :func:`inferlb.policy.length_aware.tier_thresholds`
    (bench/fleet_sim.py prints them), not from tuning on the traffic they are judged on.
    """

    #: Output caps above this are long (tokens). Two-tier form only.
    long_output_tokens: Annotated[int, Field(strict=True, ge=1, le=10_000_000)] = 384
    #: GPUs whose profile's ``relative_capacity`` is at least this form the fast tier (V100 = 1.0).
    #: Two-tier form only.
    fast_min_relative_capacity: Annotated[float, Field(strict=True, gt=0, le=100)] = 1.5
    #: Tiered form: the confined length classes, longest first (1 to 8); None: the two-tier form.
    tiers: Annotated[tuple[LengthTier, ...], Field(min_length=1, max_length=8)] | None = None
    #: Class a request whose cap is uninformative (none set, the model's default, or one fixed value while
    #: the answers vary) by a prediction learnt from the metered ``completion_tokens`` of earlier answers
    #: (per tenant, model and endpoint kind; per conversation), not by the cap
    #: (:mod:`inferlb.policy.output_predictor`). The reservation stays the cap. Needs
    #: ``ext_proc.account_responses``. Off by default: it changes where the model's requests go, learnt
    #: from traffic, which a deployment should turn on knowingly.
    predict_output: bool = False
    #: The live capacity guard (:mod:`inferlb.policy.class_guard`): a confined class whose GPU set holds
    #: more than this multiple of the fleet's in-flight requests per unit of capacity spills to the next
    #: wider set (> 1; 1.5 is a reasonable start). None (default): off, classes are always confined. Needs
    #: ``ext_proc.account_responses`` (the count ends with the response).
    capacity_guard_factor: Annotated[float, Field(strict=True, gt=1, le=100)] | None = None
    #: Learn the thresholds from the output caps this model's requests declare (:class:`LearnedThresholds`;
    #: ``true`` for the defaults), both forms: the static thresholds are the start and the fallback. None
    #: (default): the static thresholds, checked against the caps seen (a class whose caps carry more work
    #: than its GPU set's capacity share is logged and counted).
    learn_thresholds: LearnedThresholds | None = None

    @field_validator("learn_thresholds", mode="before")
    @classmethod
    def _learn_thresholds_shorthand(cls, value: object) -> object:
        # ``learn_thresholds: true`` asks for the defaults, ``false`` for none
        if value is True:
            return {}
        if value is False:
            return None
        return value

    @field_validator("tiers")
    @classmethod
    def _check_tiers_fall(cls, tiers: tuple[LengthTier, ...] | None) -> tuple[LengthTier, ...] | None:
        if tiers is None:
            return tiers
        # both lists must fall, tier after tier: a longer class on faster GPUs
        rules = (
            ("above_output_tokens", "longest class first"),
            ("min_relative_capacity", "faster GPUs first"),
        )
        for i, (a, b) in enumerate(itertools.pairwise(tiers), start=1):
            for name, why in rules:
                mine, before = getattr(b, name), getattr(a, name)
                if not mine < before:
                    raise ValueError(
                        f"tiers[{i}].{name} ({mine:g}) must be below tiers[{i - 1}]'s ({before:g}): {why}"
                    )
        return tiers

    @model_validator(mode="after")
    def _check_one_form(self) -> Self:
        # a tiered block that also sets a two-tier field would silently ignore it: refuse instead
        mixed = sorted({"long_output_tokens", "fast_min_relative_capacity"} & self.model_fields_set)
        if mixed and self.tiers is not None:
            named = " and ".join(mixed)
            raise ValueError(f"tiers: give either tiers or {named} (the two-tier form), not both")
        return self


class ClusterPolicy(_Frozen):
    """How Envoy balances and protects one model's clusters."""

    lb_policy: Literal["least_request", "round_robin", "ring_hash", "maglev"] = "least_request"
    #: ``ring_hash``/``maglev`` only: Envoy ``consistent_hashing_lb_config.hash_balance_factor``, the bounded
    #: load of consistent hashing (%): a host takes at most this share of the average load before a key
    #: spills to the next host (150 = 1.5 x average; Envoy's minimum is 100).
    hash_balance_factor: Annotated[int, Field(strict=True, ge=100, le=100_000)] = 150
    #: Envoy ``least_request_lb_config.active_request_bias`` (1.0 = Envoy default).
    active_request_bias: Annotated[float, Field(strict=True, ge=0, le=10)] = 1.0
    #: Envoy ``common_lb_config.healthy_panic_threshold`` (%). Envoy's default is 50.
    healthy_panic_threshold: Annotated[float, Field(strict=True, ge=0, le=100)] = 25.0
    connect_timeout_ms: Annotated[int, Field(strict=True, ge=1)] = 2_000
    outlier_detection: OutlierDetection = OutlierDetection()
    circuit_breaker_default: CircuitBreaker = CircuitBreaker()
    circuit_breaker_high: CircuitBreaker = CircuitBreaker(
        max_connections=8192, max_pending_requests=2048, max_requests=8192, max_retries=32
    )
    #: ``priority: low`` tenants are refused by ext_proc or ext_authz (503 ``overloaded``, ``retry-after`` =
    #: ``gateway.overflow_retry_after_s``) once the requests at DEFAULT routing priority (``default`` and
    #: ``low`` tenants) in flight on one of this model's clusters reach this share (%) of
    #: ``circuit_breaker_default.max_requests``, so default traffic keeps the rest of Envoy's DEFAULT budget
    #: (see :mod:`inferlb.policy.shedding`). 100: low is shed only with default, by Envoy's breaker. Needs
    #: ``ext_proc.account_responses`` (the count ends with the response: ext_proc's stream, or in ext_authz
    #: mode the access-log entry that settles the request).
    low_priority_max_requests_percent: Annotated[int, Field(strict=True, ge=1, le=100)] = 50
    #: Active HTTP health checks against each endpoint (on by default: outlier detection alone never
    #: ejects a server that hangs, since it sees no errors); ``null`` turns them off (outlier detection
    #: only).
    health_check: HealthCheck | None = HealthCheck()
    #: Envoy ``common_lb_config.update_merge_window`` (ms): health, weight and metadata changes within this
    #: window are applied together at its end. Envoy's default (1 s) keeps a host that outlier detection or
    #: a health check just took out in the balancer for up to that long (a burst of errors each time a
    #: failing GPU returns from ejection); 0 (default) applies every change at once, at the cost of one
    #: load-balancer rebuild per change (raise it for clusters of thousands of endpoints).
    update_merge_window_ms: Annotated[int, Field(strict=True, ge=0, le=60_000)] = 0
    #: Envoy ``slow_start_config``: a new endpoint's share ramps up over this window (ms); 0 = off.
    #: Needs ``least_request`` or ``round_robin``.
    slow_start_window_ms: Annotated[int, Field(strict=True, ge=0, le=3_600_000)] = 0
    #: Slow-start curve: weight factor ``time_fraction ** (1 / aggression)`` (1.0 = linear).
    slow_start_aggression: Annotated[float, Field(strict=True, gt=0, le=100)] = 1.0
    #: Slow-start floor: a new endpoint gets at least this share of its weight (%).
    slow_start_min_weight_percent: Annotated[float, Field(strict=True, ge=0, le=100)] = 10.0
    #: Envoy ``locality_weighted_lb_config``: pick a locality (region/zone) by its weight first, then an
    #: endpoint in it. A locality's weight is ``locality_weights["region/zone"]``, else the sum of its
    #: endpoints' weights.
    locality_weighted: bool = False
    locality_weights: dict[str, Annotated[int, Field(strict=True, ge=1)]] = {}
    #: Priorities relative to the gateway's locality (``gateway.region``/``gateway.zone``): ``zone``: its own
    #: zone is priority 0, the region's other zones 1, other regions 2; ``region``: its own region 0, other
    #: regions 1; ``off``: every endpoint priority 0. Envoy spills to the next priority as the healthy
    #: share of one drops below 100% / ``overprovisioning_factor``.
    failover: Literal["off", "zone", "region"] = "off"
    #: Envoy ``ClusterLoadAssignment.policy.overprovisioning_factor`` (%; Envoy's default 140).
    overprovisioning_factor: Annotated[int, Field(strict=True, ge=100, le=1000)] = 140
    #: Long generations to the fast GPUs (:class:`LengthAwareRouting`); None (default): every request is
    #: balanced over every endpoint. Needs ``least_request`` or ``round_robin``.
    length_aware: LengthAwareRouting | None = None

    @model_validator(mode="after")
    def _check_slow_start(self) -> Self:
        if self.slow_start_window_ms and self.lb_policy not in ("least_request", "round_robin"):
            raise ValueError(
                f"slow_start_window_ms: slow start needs lb_policy least_request or round_robin, "
                f"not {self.lb_policy}"
            )
        return self

    @model_validator(mode="after")
    def _check_length_aware(self) -> Self:
        # ring_hash/maglev place a request by its affinity key; a length subset would break that affinity
        if self.length_aware is not None and self.lb_policy not in ("least_request", "round_robin"):
            raise ValueError(
                f"length_aware: length-aware placement needs lb_policy least_request or round_robin, "
                f"not {self.lb_policy} (its affinity keys pick the GPU)"
            )
        return self


class PickerWeightsConfig(_Frozen):
    """The weights of the endpoint picker's score and its load guard
    (:class:`inferlb.policy.picker.PickerWeights`, whose docstring gives the formula); the defaults are its
    defaults."""

    #: Weight of the share of the prompt's blocks an endpoint caches (0..1).
    prefix: Annotated[float, Field(strict=True, ge=0, le=1_000)] = 2.0
    #: Weight of an endpoint's load relative to the fleet's mean.
    load: Annotated[float, Field(strict=True, ge=0, le=1_000)] = 1.0
    #: Weight of an endpoint's KV-cache usage (0..1).
    kv: Annotated[float, Field(strict=True, ge=0, le=1_000)] = 0.5
    #: Weight of an endpoint's prefill load: the request's uncached prompt tokens per unit of the endpoint's
    #: prefill capacity (its served weight times its GPU profile's ``prefill_relative_capacity /
    #: relative_capacity``), against the request's whole prompt.
    tokens: Annotated[float, Field(strict=True, ge=0, le=1_000)] = 1.0
    #: The load guard's bound, a multiple of the mean load (> 1; Mirrokni et al.'s bounded-load hashing).
    load_factor: Annotated[float, Field(strict=True, gt=1, le=100)] = 2.0
    #: Endpoints listed per pick (the first is the choice, the rest Envoy's fallback order for retries).
    max_hosts: Annotated[int, Field(strict=True, ge=1, le=16)] = 3


class PickingQueue(_Frozen):
    """Fair waiting when every eligible endpoint of a picking model is saturated
    (:mod:`ext_proc.queueing`): instead of the immediate 503/429, the request waits in the model's fair
    queue (priority band first, then tenants fairly by tokens, :mod:`inferlb.policy.fair_queue`) until an
    endpoint has room or ``max_wait_ms`` passed (then 429 ``queue_timeout`` with ``retry-after``).

    An endpoint is **saturated** when this process's in-flight count on it (the picker's own count: picks
    entered, left at the request's end) reached ``max_in_flight``; the bound is per request-path process.
    """

    #: Requests waiting per model at most (one more: 429 ``queue_full``); 0 (the default): no queue, no
    #: saturation check (the picker always picks).
    max_queued: Annotated[int, Field(strict=True, ge=0, le=100_000)] = 0
    #: Longest wait in the queue (ms); must stay within half of ``ext_proc.message_timeout_ms`` (Envoy
    #: waits that long for the answer the queue holds back).
    max_wait_ms: Annotated[int, Field(strict=True, ge=1, le=30_000)] = 2_000
    #: Requests in flight from this process on one endpoint at which it is saturated.
    max_in_flight: Annotated[int, Field(strict=True, ge=1, le=100_000)] = 32

    @property
    def enabled(self) -> bool:
        """True when requests may wait (``max_queued`` > 0)."""
        return self.max_queued > 0


class EndpointPicking(_Frozen):
    """Endpoint picking for one model: the request path picks the endpoint of each request (cache- and
    load-aware, :mod:`inferlb.policy.picker`) and hands Envoy an ordered list of hosts, as the Gateway API
    Inference Extension's endpoint-picker protocol does (``x-gateway-destination-endpoint``); the model's
    clusters run Envoy's ``override_host`` load-balancing policy, which sends the request to the first
    listed host, the next ones on retries, and falls back to the cluster's own ``lb_policy`` when none is
    usable (:func:`xds_server.resources.clusters.override_host_policy`).

    Modes: ``off`` (default: Envoy balances alone); ``load`` (the picker scores load and KV usage only);
    ``approximate`` (plus the prefix cache each endpoint is believed to hold, learnt from the gateway's
    own picks); ``precise`` (plus the prefix cache each endpoint reports in its KV events).
    """

    mode: Literal["off", "load", "approximate", "precise"] = "off"
    weights: PickerWeightsConfig = PickerWeightsConfig()
    #: Tokens per prompt block of the prefix indexes (vLLM's ``--block-size``, default 16); ``approximate``
    #: and ``precise`` only.
    block_size: Annotated[int, Field(strict=True, ge=1, le=1_024)] = 16
    #: Fair waiting when every eligible endpoint is saturated (:class:`PickingQueue`); off by default.
    queue: PickingQueue = PickingQueue()

    @property
    def enabled(self) -> bool:
        """True unless ``mode`` is ``off``."""
        return self.mode != "off"


class ModelVersion(_Frozen):
    """One deployed version of a model and its share of the model's traffic (a canary is a small share)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
    traffic_percent: Annotated[float, Field(strict=True, ge=0, le=100)] = 100.0


_MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,127}$"


class ModelConfig(_Frozen):
    """A model the gateway serves, under its name and any aliases clients may use."""

    name: Annotated[str, Field(pattern=_MODEL_NAME)]
    aliases: tuple[Annotated[str, Field(pattern=_MODEL_NAME)], ...] = ()
    #: Context window (tokens); prompt + requested output above it is refused.
    context_length: Annotated[int, Field(strict=True, ge=16)] = 32_768
    #: Completion tokens assumed when a request sets no ``max_tokens``/``max_completion_tokens``: what
    #: quota admission reserves and what the simulated servers generate (tokens).
    default_max_tokens: Annotated[int, Field(strict=True, ge=1)] = 256
    #: How prompts are counted: ``tiktoken:<encoding>`` (bundled offline encodings: ``cl100k_base``),
    #: ``hf:<path to tokenizer.json>`` (HF ``tokenizers``), or ``estimate`` (UTF-8 bytes: never fewer than
    #: a byte-level BPE tokenizer counts). See :func:`inferlb.request.tokens.make_counter`.
    tokenizer: Annotated[str, Field(pattern=r"^(estimate|tiktoken:[A-Za-z0-9_]+|hf:.+)$")] = (
        "tiktoken:cl100k_base"
    )
    #: Prompt tokens charged per image part; None: OpenAI's vision pricing (85 at ``detail: low``, else 765).
    image_tokens: Annotated[int, Field(strict=True, ge=0, le=1_000_000)] | None = None
    versions: tuple[ModelVersion, ...] = (ModelVersion(name="v1"),)
    cluster: ClusterPolicy = ClusterPolicy()
    #: The request path picks each request's endpoint (:class:`EndpointPicking`); off by default.
    endpoint_picking: EndpointPicking = EndpointPicking()

    @model_validator(mode="after")
    def _check_endpoint_picking(self) -> Self:
        # the picker chooses among a cluster's endpoints (a length-aware model's: among its length class's)
        # and Envoy falls back to the cluster's own policy: settings that order the hosts some other way
        # would fight it
        picking = self.endpoint_picking
        if not picking.enabled:
            return self
        c = self.cluster
        why = ""
        if c.lb_policy not in ("least_request", "round_robin"):
            why = (
                f"cluster.lb_policy {c.lb_policy} hashes each request to its host, which the picker "
                "replaces; use least_request or round_robin (Envoy's fallback when no picked host is usable)"
            )
        elif c.failover != "off":
            why = (
                f"cluster.failover {c.failover} orders hosts by locality priority, which Envoy's "
                "override_host ignores (it looks a picked host up across priorities); use failover: off"
            )
        if why:
            raise ValueError(f"endpoint_picking.mode: {picking.mode} cannot be combined with {why}")
        return self

    @model_validator(mode="after")
    def _check_versions(self) -> Self:
        if not self.versions:
            raise ValueError("versions: a model needs at least one version")
        names = [v.name for v in self.versions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"versions: duplicate version names {dup}")
        total = sum(v.traffic_percent for v in self.versions)
        if abs(total - 100.0) > 1e-6:
            raise ValueError(f"versions: traffic_percent must add up to 100, got {total:g}")
        return self

    def cluster_name(self, version: str) -> str:
        """The Envoy cluster name for one version of this model (unique, stable, DNS-safe)."""
        return cluster_name(self.name, version)


def cluster_name(model: str, version: str) -> str:
    """Envoy cluster name ``model--version`` with characters Envoy stats dislike replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model}--{version}")


_ZMQ_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})|ipc:///?[^\s]+)$")


def _zmq_endpoint(value: str, field: str) -> str:
    m = _ZMQ_ENDPOINT.match(value)
    if m is None or (m[3] is not None and not 1 <= int(m[3]) <= 65535):
        raise ValueError(
            f"{field}: expected 'tcp://host:port' (the model server's publisher, connected to; not a "
            f"wildcard such as tcp://*:5557) or 'ipc:///path', got {value!r}"
        )
    return value


class KvEventsSource(_Frozen):
    """Where a model server publishes its KV events (vLLM's ``--kv-events-config``), as the request path
    connects to them: ``endpoint`` is the PUB socket (vLLM's ``endpoint``, which the server binds as
    ``tcp://*:5557`` by default: here the address it is reached at, ``tcp://10.0.0.7:5557``), and
    ``replay_endpoint`` its optional ROUTER socket for replaying missed batches (vLLM's
    ``replay_endpoint``). A bare string is ``endpoint`` alone."""

    endpoint: str
    replay_endpoint: str | None = None
    #: vLLM's ``topic``: the prefix subscribed to ("" is every topic).
    topic: Annotated[str, Field(max_length=256)] = ""

    @model_validator(mode="before")
    @classmethod
    def _bare(cls, value: Any) -> Any:
        return {"endpoint": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Self:
        _zmq_endpoint(self.endpoint, "endpoint")
        if self.replay_endpoint is not None:
            _zmq_endpoint(self.replay_endpoint, "replay_endpoint")
            if self.replay_endpoint == self.endpoint:
                raise ValueError("replay_endpoint: must differ from endpoint")
        return self


class EndpointConfig(_Frozen):
    """One model server (one GPU or one tensor-parallel group) serving one model version."""

    address: HostPort
    model: str
    version: str | None = None
    gpu: str
    region: str = "local"
    zone: str = "a"
    #: True: ``inferlb up`` starts a simulated GPU server on this address.
    simulated: bool = False
    #: Optional name shown in status tables and response headers; defaults to ``address``.
    name: str | None = None
    #: Which GPU's telemetry (``POST /v1/telemetry/gpu`` from ``inferlb agent``) is this endpoint's:
    #: ``gpu_uuid`` (NVML UUID) when set, else the GPU ``gpu_index`` (default 0) of node ``gpu_node``
    #: (default: the address's host). See xds_server/collector.py.
    gpu_node: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    gpu_index: Annotated[int, Field(strict=True, ge=0, le=1023)] | None = None
    gpu_uuid: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    #: Where this server publishes its KV events (:class:`KvEventsSource`), for a model whose
    #: ``endpoint_picking.mode`` is ``precise`` only: the request path rebuilds its prefix cache from them.
    kv_events: KvEventsSource | None = None

    @property
    def display_name(self) -> str:
        """The name used in tables and in the ``x-inferlb-endpoint`` response header (the gateway's, and
        the simulator's own)."""
        return self.name or str(self.address)


def hash_api_key(key: str) -> bytes:
    """The SHA-256 digest (32 bytes) of an API key's UTF-8 bytes; ``.hex()`` of it is what
    ``api_key_sha256`` holds and ``inferlb hash-key`` prints."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def checked_api_key(field: str, key: str) -> str:
    """``key`` if it is a usable API key (8..256 characters, no white space).

    Raises:
        ValueError: naming ``field``, never the key.
    """
    if not 8 <= len(key) <= 256:
        raise ValueError(f"{field}: an API key has 8 to 256 characters (this one has {len(key)})")
    if any(c.isspace() for c in key):
        raise ValueError(f"{field}: API keys cannot contain white space")
    return key


_TENANT_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "daily_token_budget")


class TenantConfig(_Frozen):
    """A tenant: its API keys, priority and quotas. ``None`` means unlimited.

    A key comes from any of: ``api_keys`` (plain text in the file), ``api_key_sha256`` (the lower-case hex
    SHA-256 of a key, as ``inferlb hash-key`` prints it), ``api_key_file`` (a file holding one key, as a
    Kubernetes Secret volume mounts it; surrounding white space dropped) or ``api_key_env`` (an environment
    variable's value). A tenant needs at least one. Keys never appear in ``repr``, logs or errors.
    """

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    api_keys: tuple[Annotated[str, Field(min_length=8, max_length=256)], ...] = Field(default=(), repr=False)
    api_key_sha256: Annotated[
        tuple[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")], ...],
        BeforeValidator(lambda v: (v,) if isinstance(v, str) else v),
    ] = ()
    api_key_file: Path | None = None
    api_key_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    _secret_keys: tuple[str, ...] = PrivateAttr(default=())
    priority: Priority = Priority.DEFAULT
    #: Requests admitted in any 60 s: a sliding window of whole seconds that never overshoots
    #: (inferlb/policy/quota.py).
    requests_per_minute: Annotated[int, Field(strict=True, ge=1)] | None = None
    #: Prompt + completion tokens admitted in any 60 s (the same window; reservations settled with the
    #: real usage).
    tokens_per_minute: Annotated[int, Field(strict=True, ge=1)] | None = None
    #: Requests in flight at once, from admission to the end of the response (or the client's abort).
    max_concurrent_requests: Annotated[int, Field(strict=True, ge=1)] | None = None
    #: Prompt + completion tokens per UTC calendar day; a request is admitted only if its reservation
    #: (prompt + largest output cap x n) still fits today's remainder.
    daily_token_budget: Annotated[int, Field(strict=True, ge=1)] | None = None

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(any(c.isspace() for c in k) for k in v):
            raise ValueError("API keys cannot contain white space")
        return v

    @model_validator(mode="after")
    def _key_sources(self) -> Self:
        # read once here, when main() loads the config; the key itself never enters a message
        secret: list[str] = []
        if self.api_key_file is not None:
            try:
                text = self.api_key_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                why = getattr(e, "strerror", None) or type(e).__name__
                raise ValueError(f"api_key_file: cannot read {str(self.api_key_file)!r}: {why}") from None
            secret.append(checked_api_key("api_key_file", text.strip()))
        if self.api_key_env is not None:
            value = os.environ.get(self.api_key_env)
            if value is None:
                raise ValueError(f"api_key_env: environment variable {self.api_key_env!r} is not set")
            secret.append(checked_api_key("api_key_env", value.strip()))
        self._secret_keys = tuple(secret)
        if not (self.api_keys or self.api_key_sha256 or secret):
            raise ValueError(
                "api_keys: a tenant needs at least one API key"
                " (api_keys, api_key_sha256, api_key_file or api_key_env)"
            )
        return self

    def plaintext_keys(self) -> tuple[str, ...]:
        """The keys known in plain text: ``api_keys``, then the ones read from ``api_key_file`` and
        ``api_key_env`` (not ``api_key_sha256``, which cannot be inverted)."""
        return self.api_keys + self._secret_keys

    def key_digests(self) -> tuple[bytes, ...]:
        """SHA-256 digests (32 bytes each) of every key of this tenant, from all four sources."""
        return tuple(hash_api_key(k) for k in self.plaintext_keys()) + tuple(
            bytes.fromhex(h) for h in self.api_key_sha256
        )

    def limits_set(self) -> tuple[str, ...]:
        """The names of the limits this tenant sets, of ``requests_per_minute``, ``tokens_per_minute``,
        ``max_concurrent_requests``, ``daily_token_budget`` (in that order); empty when unlimited."""
        return tuple(f for f in _TENANT_LIMITS if getattr(self, f) is not None)


_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


class KubernetesDiscovery(_Frozen):
    """Endpoints discovered from a Kubernetes API server (README "Kubernetes discovery";
    :mod:`xds_server.k8s_discovery`), beside the config file's ``endpoints`` and the fleet API.

    ``services``: Services whose EndpointSlices (``discovery.k8s.io/v1``) are followed; ``inference_pools``:
    Gateway API Inference Extension ``InferencePool`` objects (``inference.networking.k8s.io/v1``) whose
    ``spec.selector`` picks pods. Credentials: ``kubeconfig`` (a file; ``~`` expanded), or ``in_cluster``
    (the pod's service account), or neither: ``$KUBECONFIG``, else ``~/.kube/config``. A watch that fails
    is retried after ``backoff_base_ms``, doubling up to ``backoff_max_ms``. Read at start only.
    """

    namespace: Annotated[str, Field(pattern=_DNS_LABEL)] = "default"
    services: tuple[Annotated[str, Field(pattern=_DNS_LABEL)], ...] = ()
    inference_pools: tuple[Annotated[str, Field(pattern=_DNS_SUBDOMAIN)], ...] = ()
    kubeconfig: Annotated[str, Field(min_length=1)] | None = None
    in_cluster: bool = False
    backoff_base_ms: Annotated[int, Field(strict=True, ge=1, le=60_000)] = 200
    backoff_max_ms: Annotated[int, Field(strict=True, ge=1, le=600_000)] = 10_000

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.kubeconfig is not None and self.in_cluster:
            raise ValueError("kubeconfig and in_cluster: give one (a kubeconfig file, or the pod's account)")
        if not self.services and not self.inference_pools:
            raise ValueError("services, inference_pools: name at least one Service or InferencePool")
        for field in ("services", "inference_pools"):
            names: tuple[str, ...] = getattr(self, field)
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"{field}: listed twice: {twice}")
        if self.backoff_max_ms < self.backoff_base_ms:
            raise ValueError("backoff_max_ms: must be at least backoff_base_ms")
        return self


class DiscoveryConfig(_Frozen):
    """Where endpoints come from besides the config file and the fleet API."""

    kubernetes: KubernetesDiscovery | None = None


class Config(_Frozen):
    """The whole inferlb config. Build it with :func:`load_config` or :func:`parse_config`."""

    gateway: GatewayConfig = GatewayConfig()
    xds: XdsConfig = XdsConfig()
    ext_proc: ExtProcConfig = ExtProcConfig()
    simulation: Simulation = Simulation()
    gpu_profiles: dict[str, GpuProfile] = Field(
        default_factory=lambda: {k: GpuProfile(relative_capacity=v) for k, v in DEFAULT_GPU_CAPACITY.items()}
    )
    models: tuple[ModelConfig, ...]
    endpoints: tuple[EndpointConfig, ...] = ()
    #: Endpoints discovered at run time (:class:`DiscoveryConfig`), added to ``endpoints``.
    discovery: DiscoveryConfig = DiscoveryConfig()
    tenants: tuple[TenantConfig, ...] = ()
    weights: WeightsConfig = WeightsConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    #: Sections this file may leave empty although the running config has entries there: a changed file
    #: with no models, no endpoints or no tenants where the running one has some is refused at run time
    #: unless it names the section here (a file cut short mid-write reads as valid YAML with the sections
    #: after the cut missing; see :mod:`inferlb.config.changes`). Not checked at start-up.
    allow_empty: tuple[EmptiableSection, ...] = ()

    @field_validator("gpu_profiles", mode="before")
    @classmethod
    def _merge_default_profiles(cls, v: Any) -> Any:
        # A file that defines some profiles keeps the built-in ones for the others.
        if isinstance(v, dict):
            merged: dict[str, Any] = {k: {"relative_capacity": c} for k, c in DEFAULT_GPU_CAPACITY.items()}
            merged.update(v)
            return merged
        return v

    @model_validator(mode="after")
    def _cross_check(self) -> Self:
        problems: list[str] = []
        seen: dict[str, str] = {}
        for m in self.models:
            for n in (m.name, *m.aliases):
                if n in seen:
                    problems.append(f"models: name or alias {n!r} is used by both {seen[n]!r} and {m.name!r}")
                seen[n] = m.name
        by_name = {m.name: m for m in self.models}
        kv_sockets: dict[str, str] = {}
        for i, e in enumerate(self.endpoints):
            where = f"endpoints[{i}]"
            model = by_name.get(e.model)
            if model is None:
                problems.append(f"{where}.model: unknown model {e.model!r} (known: {sorted(by_name)})")
            elif e.version is not None and e.version not in {v.name for v in model.versions}:
                problems.append(
                    f"{where}.version: model {e.model!r} has no version {e.version!r} "
                    f"(known: {[v.name for v in model.versions]})"
                )
            elif e.version is None and len(model.versions) > 1:
                problems.append(f"{where}.version: model {e.model!r} has several versions; name one")
            if e.kv_events is not None and model is not None and model.endpoint_picking.mode != "precise":
                problems.append(
                    f"{where}.kv_events: model {e.model!r} has endpoint_picking.mode "
                    f"{model.endpoint_picking.mode}, and KV events feed only mode precise (set it, or drop "
                    "kv_events)"
                )
            if e.kv_events is not None:
                for sock in (e.kv_events.endpoint, e.kv_events.replay_endpoint):
                    if sock is not None and sock in kv_sockets:
                        problems.append(f"{where}.kv_events: {sock} is already used by {kv_sockets[sock]}")
                    elif sock is not None:
                        kv_sockets[sock] = f"{where}.kv_events"
            if e.gpu not in self.gpu_profiles:
                problems.append(
                    f"{where}.gpu: unknown GPU type {e.gpu!r} (known: {sorted(self.gpu_profiles)})"
                )
        keys: dict[bytes, str] = {}
        names: set[str] = set()
        for i, t in enumerate(self.tenants):
            if t.name in names:
                problems.append(f"tenants[{i}].name: duplicate tenant {t.name!r}")
            names.add(t.name)
            for k in t.key_digests():
                if k in keys:
                    problems.append(f"tenants[{i}].api_keys: a key is shared with tenant {keys[k]!r}")
                keys[k] = t.name
        fail_open = self.ext_proc.fail_open_model
        if fail_open is not None and fail_open not in seen:  # a name or an alias
            problems.append(
                f"ext_proc.fail_open_model: unknown model {fail_open!r} (known: {sorted(by_name)})"
            )
        # every socket inferlb binds or Envoy dials must be distinct
        if self.xds.listen_unix is not None and self.xds.listen_unix == self.ext_proc.listen_unix:
            problems.append(
                f"ext_proc.listen_unix: {self.ext_proc.listen_unix.path} is already used by xds.listen_unix"
            )
        taken: dict[str, str] = {}
        for field, hp in self.listen_sockets():
            if str(hp) in taken:
                problems.append(f"{field}: {hp} is already used by {taken[str(hp)]}")
            else:
                taken[str(hp)] = field
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _check_tls(self) -> Self:
        # Envoy's client certificate is what the services' mutual TLS checks; a Unix socket is already
        # private to its user (and Envoy's pipe addresses carry no TLS here)
        problems = []
        for section, tls, unix in (
            ("xds", self.xds.tls, self.xds.listen_unix),
            ("ext_proc", self.ext_proc.tls, self.ext_proc.listen_unix),
        ):
            if tls is None:
                continue
            if unix is not None:
                problems.append(
                    f"{section}.tls: cannot be combined with {section}.listen_unix (a Unix socket is already "
                    "private to its user), drop one"
                )
            if self.gateway.upstream_tls is None:
                problems.append(
                    f"gateway.upstream_tls: {section}.tls asks Envoy for a client certificate, so set "
                    "gateway.upstream_tls (Envoy's cert_file and key_file, and the services' ca_file)"
                )
        if problems:
            raise ValueError("; ".join(dict.fromkeys(problems)))
        return self

    @model_validator(mode="after")
    def _check_lease_outlives_the_route_timeout(self) -> Self:
        # with no route timeout, a non-streamed request is still bounded by its tries (per-try timeout x
        # (retries + 1)); a stream is not, so a lease shorter than a long stream frees its slot early
        gw = self.gateway
        ttl, timeout = self.ext_proc.lease_ttl_ms, gw.request_timeout_ms
        bound = timeout or gw.per_try_timeout_ms * (gw.num_retries + 1)
        if ttl is not None and ttl <= bound:
            what = (
                f"the route timeout (gateway.request_timeout_ms {timeout} ms)"
                if timeout
                else "a non-streamed request's tries (gateway.per_try_timeout_ms x (num_retries + 1): "
                f"{bound} ms)"
            )
            raise ValueError(
                f"ext_proc.lease_ttl_ms: {ttl} ms does not outlive {what}: a running request's concurrency "
                "lease would expire and its slot be given away; raise it or leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _check_ext_authz_can_honour_the_config(self) -> Self:
        # ext_authz sees a request once, before it goes upstream: nothing of the response reaches the
        # gateway's Python side, so what needs the response's end or usage cannot be honoured yet
        ep = self.ext_proc
        if ep.protocol != "ext_authz":
            return self
        problems: list[str] = []
        problems += [
            f"tenants[{i}].max_concurrent_requests: protocol ext_authz without account_responses never "
            "learns that a response ended and cannot hold a concurrency slot for the request's life, so "
            "turn account_responses on, drop the limit or use protocol ext_proc"
            for i, t in enumerate(self.tenants)
            if t.max_concurrent_requests is not None and not ep.account_responses
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _check_length_aware_inputs(self) -> Self:
        # the predictor learns from each answer's metered usage and the guard counts each request until
        # its answer ends: without response accounting neither ever hears of an answer
        if self.ext_proc.account_responses:
            return self
        problems = [
            f"models[{i}].cluster.length_aware.{name}: needs ext_proc.account_responses ({why})"
            for i, m in enumerate(self.models)
            if (la := m.cluster.length_aware) is not None
            for name, on, why in (
                ("predict_output", la.predict_output, "it learns from each answer's metered usage"),
                (
                    "capacity_guard_factor",
                    la.capacity_guard_factor is not None,
                    "it counts each request in flight until its answer ends",
                ),
            )
            if on
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _check_endpoint_picking_inputs(self) -> Self:
        # the picker needs the live endpoint state (the xDS server's HTTP API) and each request's end (its
        # in-flight count): without them it would pick blind
        picking = [(i, m) for i, m in enumerate(self.models) if m.endpoint_picking.enabled]
        problems = []
        for i, m in picking:
            field = f"models[{i}].endpoint_picking.mode"
            if self.xds.api_listen is None:
                problems.append(
                    f"{field}: {m.endpoint_picking.mode} needs xds.api_listen (the request path reads the "
                    "live endpoint state from the xDS server's GET /v1/picking)"
                )
            if not self.ext_proc.account_responses:
                problems.append(
                    f"{field}: {m.endpoint_picking.mode} needs ext_proc.account_responses (the picker counts "
                    "each endpoint's requests in flight until their response ends)"
                )
            q = m.endpoint_picking.queue
            if q.enabled and 2 * q.max_wait_ms > self.ext_proc.message_timeout_ms:
                problems.append(
                    f"models[{i}].endpoint_picking.queue.max_wait_ms: {q.max_wait_ms} ms is more than half "
                    f"of ext_proc.message_timeout_ms ({self.ext_proc.message_timeout_ms} ms), which bounds "
                    "how long Envoy waits for the answer a waiting request holds back (with room for the "
                    "quota admission after it); lower it or raise message_timeout_ms"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _check_quota_shared_by_extra_processes(self) -> Self:
        # Envoy spreads requests over every ext_proc process; with quota_backend memory each keeps its
        # own windows, concurrency slots and daily budgets, so N processes admit N x every limit.
        processes = 1 + len(self.ext_proc.extra_listen)
        if processes == 1 or self.ext_proc.quota_backend != "memory":
            return self
        limited = [(t.name, fields) for t in self.tenants if (fields := t.limits_set())]
        if limited:
            name, fields = limited[0]
            raise ValueError(
                f"ext_proc.extra_listen: {processes} ext_proc processes with quota_backend memory would "
                f"each enforce every tenant's limits on their own share (limits x {processes}, e.g. tenant "
                f"{name!r} sets {', '.join(fields)}): use quota_backend: redis, or drop extra_listen, "
                "or give no tenant a limit"
            )
        return self

    # -- lookups used by the services -------------------------------------------------------------
    def listen_sockets(self, *, simulated_only: bool = False) -> list[tuple[str, HostPort]]:
        """``(config field, address)`` of every TCP socket the stack listens on: Envoy's listener and admin,
        the xDS server's gRPC (unless on ``xds.listen_unix``) and HTTP API, ext_proc's gRPC (unless on
        ``ext_proc.listen_unix``) and metrics, and the endpoints (only the simulated ones with
        ``simulated_only``: the others are not ours to start)."""
        out = [("gateway.listen", self.gateway.listen), ("gateway.admin", self.gateway.admin)]
        if self.xds.listen_unix is None:
            out.append(("xds.listen", self.xds.listen))
        if self.ext_proc.listen_unix is None:
            out.append(("ext_proc.listen", self.ext_proc.listen))
        out.append(("ext_proc.metrics_listen", self.ext_proc.metrics_listen))
        if self.ext_proc.meters_access_log():
            meters = self.ext_proc.meter_addresses()
            out.append(("ext_proc.meter_listen", meters[0]))
            out += [(f"ext_proc.extra_meter_listen[{i}]", hp) for i, hp in enumerate(meters[1:])]
        out += [(f"ext_proc.extra_listen[{i}]", hp) for i, hp in enumerate(self.ext_proc.extra_listen)]
        out += [
            (f"ext_proc.extra_metrics_listen[{i}]", hp)
            for i, hp in enumerate(self.ext_proc.extra_metrics_addresses())
        ]
        if self.xds.api_listen is not None:
            out.append(("xds.api_listen", self.xds.api_listen))
        out += [
            (f"endpoints[{i}].address", e.address)
            for i, e in enumerate(self.endpoints)
            if e.simulated or not simulated_only
        ]
        return out

    def model_by_name(self) -> dict[str, ModelConfig]:
        """Every name and alias -> its model."""
        out: dict[str, ModelConfig] = {}
        for m in self.models:
            for n in (m.name, *m.aliases):
                out[n] = m
        return out

    def endpoint_version(self, e: EndpointConfig) -> str:
        """The version an endpoint serves (its own, or its model's only version)."""
        if e.version is not None:
            return e.version
        return next(m for m in self.models if m.name == e.model).versions[0].name


_SUBFIELD = re.compile(
    r"^(?P<field>[a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*): (?P<msg>.+)$", re.S
)


def _loc_to_field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after[_parse(), HostPort]",):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_config(data: Any, source: str = "<string>", *, check_tls_files: bool = True) -> Config:
    """Validate a parsed YAML/JSON document into a :class:`Config`.

    Args:
        check_tls_files: read and check the TLS sections' certificate, key and CA files (a config load);
            False re-validates a config whose files were checked when it was loaded (a fleet change:
            mid-rotation the files may not load as a pair for a moment, which is no fault of the change).

    Raises:
        ConfigError: with one ``(field, message)`` per problem, fields as dotted paths.
    """
    if not isinstance(data, dict):
        raise ConfigError(source, [("", f"expected a mapping at the top level, got {type(data).__name__}")])
    try:
        context = None if check_tls_files else {_TLS_FILES_CHECKED: True}
        return Config.model_validate(data, context=context)
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        for err in exc.errors(include_url=False):
            msg = str(err["msg"]).removeprefix("Value error, ")
            field = _loc_to_field(tuple(err["loc"]))
            # cross-field checks report "field: message; field: message" from the model validator
            if not field and ": " in msg:
                for piece in msg.split("; "):
                    f, _, m = piece.partition(": ")
                    problems.append((f, m))
                continue
            # a model validator may prefix its message with the sub-field at fault ("versions: ...")
            sub = _SUBFIELD.match(msg)
            if sub:
                problems.append((f"{field}.{sub['field']}", sub["msg"]))
            else:
                problems.append((field, msg))
        raise ConfigError(source, problems) from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 YAML, or fails validation (field named).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(str(p), [("", f"cannot read: {exc.strerror or exc}")]) from None
    return parse_config_yaml(raw, str(p))


#: Most YAML nodes a config document may stand for with its aliases followed. A real config is thousands
#: (ten thousand endpoints are ~100,000); a few lines of nested aliases ("billion laughs") stand for
#: hundreds of millions, which would hold a reload for minutes and fill the memory.
MAX_CONFIG_NODES = 1_000_000


def parse_config_yaml(raw: bytes, source: str = "<string>") -> Config:
    """Validate the bytes of a YAML config file: what every reader of a config file (start-up, the xDS
    server's and ext_proc's reloads) calls, so each refuses the same files with the same errors.

    Raises:
        ConfigError: not UTF-8; not YAML; a key given twice in a mapping; an alias that refers to a node
            containing it, or aliases standing for more than :data:`MAX_CONFIG_NODES` nodes; nesting past
            the parser's recursion limit; or invalid (field named).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [("", f"not UTF-8: {exc}")]) from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        _check_yaml_shape(node)
        data = None if node is None else loader.construct_document(node)
    except DuplicateKeyError as exc:
        raise ConfigError(source, [(exc.field, str(exc))]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [("", f"not valid YAML: {exc}")]) from None
    except RecursionError:
        raise ConfigError(source, [("", "not valid YAML: nested too deeply to read")]) from None
    finally:
        loader.dispose()
    return parse_config(data, source)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice. PyYAML keeps the last value silently; a config that says
    ``num_retries`` twice is a mistake to report, not to guess at.

    Attributes:
        field: dotted path of the repeated key (``gateway.num_retries``, ``models[0].context_length``).
    """

    def __init__(self, field: str, line: int) -> None:
        self.field = field
        super().__init__(f"duplicate key (again on line {line}); each key may appear once")


def _check_yaml_shape(root: yaml.Node | None) -> None:
    """Walk a composed YAML node graph (an alias is the same node object again), each node once: raise
    :class:`DuplicateKeyError` at the first repeated key, and ``yaml.YAMLError`` for an alias that refers
    to a node containing it or a document standing for more than :data:`MAX_CONFIG_NODES` nodes.

    Raises:
        RecursionError: nested past the interpreter's recursion limit."""
    sizes: dict[int, int] = {}
    walking: set[int] = set()

    def size(node: yaml.Node, path: str) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in walking:
            raise yaml.YAMLError(
                f"{path or '<document>'}: an alias refers to a node that contains it (a recursive document)"
            )
        walking.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                name = str(key_node.value)
                where = f"{path}.{name}" if path else name
                if name in seen:
                    raise DuplicateKeyError(where, key_node.start_mark.line + 1)
                seen.add(name)
                total += size(key_node, where) + size(value_node, where)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += size(item, f"{path}[{i}]")
        if total > MAX_CONFIG_NODES:
            raise yaml.YAMLError(
                f"{path or '<document>'}: its aliases stand for more than {MAX_CONFIG_NODES:,} nodes"
            )
        walking.discard(key)
        sizes[key] = total
        return total

    if root is not None:
        size(root, "")


def default_config_path() -> Path:
    """The embedded default config (``examples/local.yaml``, packaged as ``inferlb/data/local.yaml``)."""
    return Path(__file__).parents[1] / "data" / "local.yaml"
