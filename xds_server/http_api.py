"""The xDS server's HTTP API (aiohttp): fleet changes, connected Envoys, Prometheus metrics.

Routes (JSON in and out; errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}``):

- ``GET /healthz``: 200 ``ok`` (no auth).
- ``GET /metrics``: Prometheus text exposition (no auth, as scrapers expect).
- ``GET /v1/endpoints``: the served fleet: every endpoint with its source (``config``/``api``/
  ``kubernetes``; ``discovered_from``: the Kubernetes object), weight pin and drain state (``draining``,
  ``drain_ends_at`` ISO 8601 UTC, ``removed_in_ms``; a discovered endpoint that is terminating or not ready
  drains with no end: ``drain_ends_at`` null until Kubernetes removes it); ``deregistered``: the
  config-file endpoints the API removed (registering one brings it back); ``state_file``: the state file
  (null: none); ``state_store``: where changes are stored, ``{"where", "shared", "version", "reachable"}``
  (null: nowhere; ``version`` the shared store's last version this server adopted).
- ``POST /v1/endpoints``: register an endpoint (the config file's endpoint shape); 201. Registering an
  address again replaces the endpoint and cancels its drain and weight pin.
- ``POST /v1/endpoints/{key}/drain``: send it as DRAINING, remove it after ``drain_ms`` (body, optional;
  ``xds.drain_period_ms`` by default); 202. Draining it again keeps the earlier end.
- ``DELETE /v1/endpoints/{key}/drain``: cancel a drain that has not ended (served again as before); 200 with
  ``was_draining``. An endpoint whose drain ended is gone (404): register it again.
- ``DELETE /v1/endpoints/{key}``: remove it now; 200.
- ``PUT /v1/endpoints/{key}/weight``: ``{"weight": N}`` pins Envoy's weight (N >= 1), ``{"weight": null}``
  clears the pin; 200.
- ``PUT /v1/weights``: ``{"weights": {key: N or null, ...}}`` pins (or clears) many weights in one change
  (an autoscaler or a telemetry loop re-weighting a fleet); 200, or 400/404 and nothing changes.
- ``GET /v1/clients``: each connected Envoy (node id, cluster, mode, ACKed version per type, last NACK).

Every ``/v1`` route needs ``Authorization: Bearer <token>`` (compared in constant time); with no token
configured, every ``/v1`` route answers 503 so an unconfigured server is never open. ``{key}`` is the
endpoint's ``host:port`` as written in the config (:func:`xds_server.resources.endpoints.endpoint_key`).

Each change is answered only once it is stored (when the server has a fleet store) and logged as one INFO
line naming who (the peer address and its ``User-Agent``), what and the endpoint. A change the server
cannot store answers 500 ``fleet_state_not_stored`` and changes nothing; with a shared (Redis) store that
cannot be reached, 503 ``fleet_store_unavailable`` naming the store, with ``retry-after`` (nothing changed,
or, for a write that timed out, the message says it may have landed), and 503 ``fleet_store_busy`` when
other servers' changes kept winning the write race.

The server is known by what the routes need of it (:class:`FleetApiServer`), not by its class:
:class:`xds_server.server.XdsServer` imports this module, not the other way round.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from inferlb.adapters.state_redis import SharedStateUnavailableError
from inferlb.config.schema import Config, EndpointConfig
from inferlb.errors import ConfigError, RequestError
from xds_server.fleet_state import FleetState, UnknownEndpointError, parse_endpoint
from xds_server.fleet_store import FleetStoreBusyError, FleetStoreError
from xds_server.k8s_mapping import Mapped
from xds_server.metrics import HasMetrics, render_metrics
from xds_server.resources.endpoints import endpoint_key

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ClientList(Protocol):
    """The ADS servicer as ``GET /v1/clients`` sees it."""

    def clients_json(self) -> list[dict[str, Any]]:
        """Every open stream (node, mode, ACKed versions, last NACK)."""
        ...


class FleetApiServer(HasMetrics, Protocol):
    """What the HTTP API needs of the server (:class:`xds_server.server.XdsServer` is one): the served
    config, fleet changes and telemetry weights to list endpoints, the fleet changes themselves, the
    connected clients and (:class:`~xds_server.metrics.HasMetrics`) the metrics to render."""

    @property
    def effective(self) -> Config | None: ...
    @property
    def state_path(self) -> Path | None: ...
    @property
    def state_store(self) -> str | None: ...
    @property
    def store_reachable(self) -> bool: ...
    def store_version(self) -> int | None: ...
    @property
    def fleet(self) -> FleetState: ...
    @property
    def discovered(self) -> Mapped: ...
    @property
    def telemetry_weights(self) -> Mapping[str, int]: ...
    @property
    def servicer(self) -> ClientList: ...
    async def register_endpoint(self, endpoint: EndpointConfig, *, actor: str = "-") -> None: ...
    async def drain_endpoint(self, key: str, drain_ms: int | None = None, *, actor: str = "-") -> float: ...
    async def undrain_endpoint(self, key: str, *, actor: str = "-") -> bool: ...
    async def deregister_endpoint(self, key: str, *, actor: str = "-") -> None: ...
    async def override_weight(self, key: str, weight: int | None, *, actor: str = "-") -> None: ...
    async def override_weights(self, weights: Mapping[str, int | None], *, actor: str = "-") -> None: ...


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    err = RequestError(status, message, type="invalid_request_error", code=code, param=param)
    return web.json_response(err.to_openai_json(), status=status)


#: The errors of a change that could not be stored (:func:`_not_stored` answers them).
STORE_ERRORS = (FleetStoreError, SharedStateUnavailableError)

#: ``retry-after`` (s) of the 503s a shared store's outage or write races give.
STORE_RETRY_AFTER_S = 1


def _not_stored(exc: FleetStoreError | SharedStateUnavailableError) -> web.Response:
    """500 ``fleet_state_not_stored`` (the store refused the write); 503 ``fleet_store_unavailable`` (a
    shared store unreachable) or ``fleet_store_busy`` (write races lost), with ``retry-after``."""
    if isinstance(exc, SharedStateUnavailableError):
        outcome = (
            "the write was sent but not answered: it may have been stored (GET /v1/endpoints shows it once "
            "the store answers)"
            if exc.maybe_applied
            else "nothing changed"
        )
        status, code = 503, "fleet_store_unavailable"
        message = f"fleet store {exc.where} unavailable ({exc.operation}: {exc.reason}); {outcome}; the last "
        message += "known fleet keeps serving, try again shortly"
    elif isinstance(exc, FleetStoreBusyError):
        status, code, message = 503, "fleet_store_busy", f"{exc}; nothing changed"
    else:
        status, code, message = 500, "fleet_state_not_stored", f"{exc}; nothing changed"
    body = RequestError(status, message, type="server_error", code=code).to_openai_json()
    headers = {"Retry-After": str(STORE_RETRY_AFTER_S)} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)


#: Characters of a client's ``User-Agent`` kept in the change log line.
AGENT_CHARS = 80


def actor(request: web.Request) -> str:
    """Who made a change, for its log line: the peer address and its ``User-Agent`` (quoted, cut to
    :data:`AGENT_CHARS`): ``127.0.0.1 agent='curl/8.5.0'``."""
    agent = request.headers.get("User-Agent", "-")[:AGENT_CHARS]
    return f"{request.remote or '-'} agent={agent!r}"


def utc_iso(t: float) -> str:
    """Unix seconds as an ISO 8601 UTC time with milliseconds (``2026-11-29T20:41:07.123Z``)."""
    ms = round(t * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def _config_error(exc: ConfigError) -> web.Response:
    field = exc.problems[0][0] if exc.problems else None
    detail = "; ".join(f"{f}: {m}" if f else m for f, m in exc.problems)
    return _error(400, detail, "invalid_endpoint", param=field)


class HttpApi:
    """The aiohttp application over one xDS server (:class:`FleetApiServer`).

    Args:
        server: the xDS server whose fleet it changes and whose streams it reports.
        token: the bearer token ``/v1`` routes require; None refuses them all (503).
        routes: extra routes (the ``/v1/`` ones behind the same token check).
    """

    def __init__(
        self, server: FleetApiServer, *, token: str | None, routes: Sequence[web.RouteDef] = ()
    ) -> None:
        self._server = server
        self._token = token.encode() if token else None
        self._runner: web.AppRunner | None = None
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/endpoints", self._list_endpoints)
        app.router.add_post("/v1/endpoints", self._register)
        app.router.add_post("/v1/endpoints/{key}/drain", self._drain)
        app.router.add_delete("/v1/endpoints/{key}/drain", self._undrain)
        app.router.add_delete("/v1/endpoints/{key}", self._deregister)
        app.router.add_put("/v1/endpoints/{key}/weight", self._weight)
        app.router.add_put("/v1/weights", self._weights)
        app.router.add_get("/v1/clients", self._clients)
        app.router.add_routes(routes)
        self.app = app

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the bound port.

        Raises:
            RuntimeError: the address cannot be bound.
        """
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise RuntimeError(f"cannot listen on {host}:{port} (xds.api_listen): {exc}") from None
        self._runner = runner
        server = site._server  # aiohttp exposes the bound socket only here
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self) -> None:
        """Close the listener and open connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        if self._token is None:
            return _error(503, "the fleet API has no token configured (xds.api_token)", "api_disabled")
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
            return _error(401, "missing or wrong bearer token", "invalid_api_key")
        return await handler(request)

    async def _json_body(self, request: web.Request) -> Any:
        if not request.can_read_body:
            return {}
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise web.HTTPBadRequest(
                text=json.dumps(
                    RequestError(
                        400, f"body is not JSON: {exc}", type="invalid_request_error"
                    ).to_openai_json()
                ),
                content_type="application/json",
            ) from None

    # -- routes ---------------------------------------------------------------------------------------
    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        body, content_type = render_metrics(self._server)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _list_endpoints(self, _request: web.Request) -> web.Response:
        srv = self._server
        assert srv.effective is not None
        fleet = srv.fleet
        now = time.time()
        discovered = {d.key: d for d in srv.discovered.endpoints}
        rows = []
        for e in srv.effective.endpoints:
            key = endpoint_key(e)
            until = fleet.draining.get(key)
            found = discovered.get(key) if key not in fleet.registered else None
            rows.append(
                {
                    "key": key,
                    "name": e.display_name,
                    "model": e.model,
                    "version": srv.effective.endpoint_version(e),
                    "gpu": e.gpu,
                    "region": e.region,
                    "zone": e.zone,
                    "source": "api" if key in fleet.registered else "kubernetes" if found else "config",
                    "discovered_from": found.source if found else None,
                    "weight_override": fleet.weight_overrides.get(key),
                    "telemetry_weight": srv.telemetry_weights.get(key),
                    "draining": until is not None or (found is not None and found.draining),
                    "drain_ends_at": None if until is None else utc_iso(until),
                    "removed_in_ms": None if until is None else max(0, round((until - now) * 1000)),
                }
            )
        state = None if srv.state_path is None else str(srv.state_path)
        store = None
        if srv.state_store is not None:
            version = srv.store_version()
            store = {"where": srv.state_store, "shared": version is not None, "version": version,
                     "reachable": srv.store_reachable}  # fmt: skip
        listing = {"endpoints": rows, "deregistered": sorted(fleet.hidden), "state_file": state}
        return web.json_response({**listing, "state_store": store})

    async def _register(self, request: web.Request) -> web.Response:
        data = await self._json_body(request)
        try:
            endpoint = parse_endpoint(data)
            await self._server.register_endpoint(endpoint, actor=actor(request))
        except ConfigError as exc:
            return _config_error(exc)
        except STORE_ERRORS as exc:
            return _not_stored(exc)
        return web.json_response({"endpoint": endpoint_key(endpoint)}, status=201)

    async def _drain(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        data = await self._json_body(request)
        drain_ms = data.get("drain_ms") if isinstance(data, dict) else None
        if drain_ms is not None and (
            not isinstance(drain_ms, int) or isinstance(drain_ms, bool) or drain_ms < 0
        ):
            return _error(400, "drain_ms must be a non-negative integer (ms)", "invalid_drain_ms", "drain_ms")
        try:
            remove_at = await self._server.drain_endpoint(key, drain_ms, actor=actor(request))
        except UnknownEndpointError as exc:
            return _error(404, str(exc), "unknown_endpoint")
        except STORE_ERRORS as exc:
            return _not_stored(exc)
        left = max(0, round((remove_at - time.time()) * 1000))
        return web.json_response(
            {"endpoint": key, "draining": True, "drain_ends_at": utc_iso(remove_at), "removed_in_ms": left},
            status=202,
        )

    async def _undrain(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        try:
            was = await self._server.undrain_endpoint(key, actor=actor(request))
        except UnknownEndpointError as exc:
            hint = "an endpoint whose drain ended was removed: register it again"
            return _error(404, f"{exc} ({hint})", "unknown_endpoint")
        except STORE_ERRORS as exc:
            return _not_stored(exc)
        return web.json_response({"endpoint": key, "draining": False, "was_draining": was})

    async def _deregister(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        try:
            await self._server.deregister_endpoint(key, actor=actor(request))
        except UnknownEndpointError as exc:
            return _error(404, str(exc), "unknown_endpoint")
        except STORE_ERRORS as exc:
            return _not_stored(exc)
        return web.json_response({"endpoint": key, "removed": True})

    async def _weight(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        data = await self._json_body(request)
        if not isinstance(data, dict) or "weight" not in data:
            return _error(400, 'expected {"weight": N} or {"weight": null}', "invalid_weight", "weight")
        weight = data["weight"]
        if weight is not None and (type(weight) is not int or weight < 1):
            return _error(400, "weight must be an integer >= 1 (Envoy rejects 0)", "invalid_weight", "weight")
        try:
            await self._server.override_weight(key, weight, actor=actor(request))
        except UnknownEndpointError as exc:
            return _error(404, str(exc), "unknown_endpoint")
        except STORE_ERRORS as exc:
            return _not_stored(exc)
        return web.json_response({"endpoint": key, "weight_override": weight})

    async def _weights(self, request: web.Request) -> web.Response:
        data = await self._json_body(request)
        weights = data.get("weights") if isinstance(data, dict) else None
        if not isinstance(weights, dict) or not all(
            w is None or (type(w) is int and w >= 1) for w in weights.values()
        ):
            return _error(
                400, 'expected {"weights": {"host:port": N >= 1 or null, ...}}', "invalid_weight", "weights"
            )
        try:
            await self._server.override_weights(weights, actor=actor(request))
        except UnknownEndpointError as exc:
            return _error(404, str(exc), "unknown_endpoint")
        except STORE_ERRORS as exc:
            return _not_stored(exc)
        return web.json_response({"updated": len(weights)})

    async def _clients(self, _request: web.Request) -> web.Response:
        return web.json_response({"clients": self._server.servicer.clients_json()})
