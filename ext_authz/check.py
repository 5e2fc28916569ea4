"""One ext_authz check: Envoy's HTTP authorization request (the client's method, path, allowed headers and
buffered body) -> :mod:`ext_proc.handlers` -> the HTTP answer Envoy acts on. No sockets here:
:mod:`ext_authz.server` parses the bytes and writes the answer.

Envoy's HTTP-service protocol (Envoy docs, "External Authorization", ``HttpService``): a 200 answer lets the
request go upstream with the answer's headers listed in ``authorization_response.allowed_upstream_headers``
set on it (``x-envoy-auth-headers-to-remove`` names request headers to drop); any other status is a denial
sent to the client with the answer's body and its ``allowed_client_headers``. A 5xx is not a denial but an
error, which Envoy answers with ``status_on_error`` and an empty body (measured on Envoy 1.40), so a 5xx
refusal (503 ``quota_backend_unavailable``, 500 internal) is sent as 403 with
:data:`~inferlb.request.headers.STATUS` naming its status; the gateway's local-reply mapper restores it
(:func:`xds_server.resources.listener.build_local_reply_config`).

What each decision becomes:

- :class:`~ext_proc.handlers.ContinueRequest` -> 200 with the routing headers; when the body is rewritten
  (an alias renamed to the canonical model, ``stream_options.include_usage`` added to a metered stream) also
  :data:`~inferlb.request.headers.BODY_SPLICE`, the splices Envoy's Lua filter applies after ext_authz
  (ext_authz cannot change a body), and with ``include_usage`` added
  :data:`~inferlb.request.headers.USAGE_ADDED`, so the Lua filter hides the usage chunk from the client.
- :class:`~ext_proc.handlers.PassThrough` -> 200 (``x-envoy-auth-headers-to-remove`` for the headers to drop).
- :class:`~ext_proc.handlers.ImmediateReply` with status 200 (the ``/v1/models`` answers) -> 200 with no
  headers: the request goes on to the route that answers it (the xDS server builds those direct responses
  from the same config).
- any other :class:`~ext_proc.handlers.ImmediateReply` -> its status (5xx as above), headers and JSON body.

Quota: admission reserves prompt + output cap. With ``ext_proc.account_responses`` (and a
:class:`~ext_authz.meter.Meter`) the 200 answer also carries the request's meter id
(:data:`~inferlb.request.headers.METER`, dynamic metadata in Envoy, never sent upstream) and the reservation
and its concurrency lease wait for Envoy's access-log entry (:mod:`ext_authz.meter`); without it the
reservation is settled at once as the charge (configs that set ``max_concurrent_requests`` are then refused).

Low-priority shedding (:mod:`inferlb.policy.shedding`) as in ext_proc mode, with the metering: before
admission the request's version is picked and a ``default`` or ``low`` request enters the in-flight count
of its cluster (or a ``low`` one is refused 503 ``overloaded`` once the count reached the limit); the
settlement of its reservation leaves the count (:mod:`ext_authz.meter`), and a request that is not metered
(refused, or answered without a meter id) leaves it at once. Without ``account_responses`` nothing is
counted and ``low`` is shed only by Envoy's circuit breaker, as in ext_proc mode.

Endpoint picking (:mod:`ext_proc.picking`), for a model with ``endpoint_picking``: after shedding and
before admission the picker orders the version's endpoints, the first entering this process's in-flight
count of it (left at the settlement, as the shedding count); the 200 answer carries
:data:`~inferlb.request.headers.DESTINATION_ENDPOINT` (in ``allowed_upstream_headers``), which Envoy's
``override_host`` policy reads. No eligible endpoint: 503 ``no_eligible_endpoint`` (as 403 +
``x-inferlb-status``). With the model's ``endpoint_picking.queue`` on, a request whose endpoints are all
saturated waits in the model's fair queue (:class:`~ext_proc.picking.PickQueue`) before its quota
admission, and is answered once picked, or 429 ``queue_timeout`` / ``queue_full`` with ``retry-after``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from typing import Any, Final

import msgspec

from ext_authz.meter import Meter
from ext_proc import handlers
from ext_proc.picking import Picked, PickWaiter, choose, wait_for_pick
from ext_proc.state import OFFLOAD_BODY_BYTES, ExtProcState
from inferlb.errors import RequestError
from inferlb.policy.quota import Admitted, MemoryQuotaStore, Refused
from inferlb.policy.shedding import counted
from inferlb.request import headers as h
from inferlb.request.rewrite import encode_splices

log = logging.getLogger("ext_authz")

#: Envoy's HTTP authorization answer header naming request headers to remove before the upstream (Envoy
#: docs, ext_authz ``HttpService``; comma-separated).
HEADERS_TO_REMOVE: Final = "x-envoy-auth-headers-to-remove"
#: Longest :data:`~inferlb.request.headers.BODY_SPLICE` value sent (bytes); a longer one (an enormous
#: rewrite) is refused 400 rather than sent in a header Envoy may refuse.
MAX_SPLICE_HEADER_BYTES: Final = 8192
_JSON: Final = (("content-type", "application/json"),)


class CheckRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Envoy's authorization request.

    Attributes:
        method: the client request's method (Envoy sends the check with it).
        path: the client request's path with its query string (no ``path_prefix`` configured).
        headers: the allowed headers, lower-case names (the last of a repeated name).
        body: the client's buffered body (``with_request_body``; empty when it had none).
    """

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes


class CheckAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The HTTP answer to one check: 200 lets the request through with ``headers`` set upstream; any
    other status refuses it, and Envoy sends ``status``, ``headers`` and ``body`` to the client.

    Attributes:
        status: HTTP status (never 5xx: see the module docstring).
        headers: response headers.
        body: response body (OpenAI JSON on a refusal, empty on 200).
        details: the reason token of a refusal (:attr:`ext_proc.handlers.ImmediateReply.details`), "" else.
    """

    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    details: str = ""


ALLOWED: Final = CheckAnswer(status=200)

INTERNAL_ERROR: Final = handlers.refusal(
    RequestError(
        500,
        "The gateway failed to process the request; it was not sent to a model server.",
        type="server_error",
    ),
    "inferlb_ext_authz_internal_error",
)


def refused(reply: handlers.ImmediateReply) -> CheckAnswer:
    """The answer refusing the request with ``reply``: its status, headers and body, or, for a 5xx, 403
    with :data:`~inferlb.request.headers.STATUS` carrying the real status."""
    if reply.status >= 500:
        return CheckAnswer(
            status=403, headers=(*reply.headers, (h.STATUS, str(reply.status))), body=reply.body,
            details=reply.details,
        )  # fmt: skip
    return CheckAnswer(status=reply.status, headers=reply.headers, body=reply.body, details=reply.details)


def _unsplicable() -> handlers.ImmediateReply:
    return handlers.refusal(
        RequestError(
            400,
            "The gateway must rewrite this request body (its model is an alias) and can do so only for a "
            "UTF-8 JSON body of ordinary size; send the body in UTF-8, or name the model by its canonical "
            "name.",
            type="invalid_request_error",
            code="unsupported_request_body",
        ),
        "inferlb_unsplicable_body",
    )


def allowed(decision: handlers.ContinueRequest, body_length: int) -> CheckAnswer:
    """The 200 answer of an admitted request: its routing headers (never ``content-length``: Envoy's Lua
    filter fixes that when it applies the body splices) and, for a rewritten body, the splices (and
    :data:`~inferlb.request.headers.USAGE_ADDED` when the rewrite added ``include_usage``).

    Raises:
        ValueError: the body is rewritten but has no splices (not UTF-8) or they do not fit
            :data:`MAX_SPLICE_HEADER_BYTES`; the caller refuses the request (400).
    """
    out = [(k, v) for k, v in decision.set_headers if k != "content-length"]
    if decision.body is not None:
        if decision.body_splices is None:
            raise ValueError("the rewritten body has no splices (not UTF-8)")
        value = encode_splices(body_length, decision.body_splices)
        if len(value) > MAX_SPLICE_HEADER_BYTES:
            raise ValueError(f"the body splices take {len(value)} bytes")
        out.append((h.BODY_SPLICE, value))
        if decision.reservation is not None and decision.reservation.strip_usage_event:
            out.append((h.USAGE_ADDED, "1"))
    if decision.remove_headers:
        out.append((HEADERS_TO_REMOVE, ",".join(decision.remove_headers)))
    return CheckAnswer(status=200, headers=tuple(out))


class CheckService:
    """Answers checks from an :class:`~ext_proc.state.ExtProcState` (swap its config with
    ``state.apply_config``).

    :meth:`check` answers synchronously when it can: with the in-process quota store and a body below
    :data:`~ext_proc.state.OFFLOAD_BODY_BYTES` nothing awaits, and the HTTP protocol writes the answer
    without a task. Otherwise it returns a future (Redis, or a big body counted in a worker thread).
    A check whose client connection is gone still runs to its end (its reservation is settled the same);
    :meth:`drain` waits for the ones left at shutdown.

    Args:
        state: the config, quota store and metrics served from.
        offload_body_bytes: bodies at least this large are parsed and counted in a worker thread.
        meter: with ``ext_proc.account_responses``, where admitted reservations wait for Envoy's
            access-log entry (:mod:`ext_authz.meter`); None (or ``account_responses`` off): each
            reservation is settled at admission as the charge.
    """

    def __init__(
        self, state: ExtProcState, *, offload_body_bytes: int = OFFLOAD_BODY_BYTES, meter: Meter | None = None
    ) -> None:
        self.state = state
        self.meter = meter
        self.offload_body_bytes = offload_body_bytes
        self._running: set[asyncio.Future[Any]] = set()

    def check(self, request: CheckRequest) -> CheckAnswer | asyncio.Future[CheckAnswer]:
        """The answer to ``request``, or a future of it (see the class docstring). Never raises: a bug
        answers 500 (as 403 + status header) with an OpenAI ``server_error`` body, logged."""
        started = time.perf_counter()
        try:
            out = self._check(request, started)
        except Exception:
            log.exception("ext_authz check failed; answering 500")
            return self._internal_error()
        if isinstance(out, CheckAnswer):
            self.state.metrics.processed("check", time.perf_counter() - started)
        return out

    def _internal_error(self) -> CheckAnswer:
        self.state.metrics.request_ended("", "", "500")
        return refused(INTERNAL_ERROR)

    def _check(self, request: CheckRequest, started: float) -> CheckAnswer | asyncio.Future[CheckAnswer]:
        state = self.state
        gateway = state.gateway
        headers = {**request.headers, ":method": request.method, ":path": request.path}
        first = handlers.on_request_headers(gateway, headers, end_of_stream=not request.body)
        if isinstance(first, handlers.ImmediateReply):
            state.metrics.request_ended("", "", str(first.status))
            if first.status == 200:
                return ALLOWED  # the /v1/models routes answer it
            return refused(first)
        if isinstance(first, handlers.PassThrough):
            if not first.remove_headers:
                return ALLOWED
            return CheckAnswer(status=200, headers=((HEADERS_TO_REMOVE, ",".join(first.remove_headers)),))
        arrived = time.monotonic()
        if len(request.body) >= self.offload_body_bytes or not isinstance(state.quotas, MemoryQuotaStore):
            return self._track(self._check_async(first.pending, request.body, arrived, started))
        prepared = handlers.prepare_body(
            gateway, first.pending, request.body, deadline=arrived + gateway.counting_budget_s
        )
        if isinstance(prepared, handlers.ImmediateReply):
            return self._refuse(prepared, first.pending.tenant.name, "")
        version = handlers.pick_version(gateway, prepared, state.rng)
        prepared = state.length.decide(gateway.config, prepared, version)
        held = self._shed_or_hold(prepared, version)
        if isinstance(held, CheckAnswer):
            return held
        picked = self._pick(prepared, version)
        if isinstance(picked, CheckAnswer):
            self._release(held)
            return picked
        if isinstance(picked, PickWaiter):
            return self._track(
                self._check_after_wait(
                    prepared,
                    picked,
                    body_length=len(request.body),
                    version=version,
                    held=held,
                    arrived=arrived,
                    started=started,
                )
            )
        try:
            decision = state.quotas.admit_now(first.pending.tenant.name, prepared.reserved_tokens)
            answer = self._admitted(prepared, decision, len(request.body), version, picked)
        except BaseException:
            self._release(held, picked)
            raise
        if isinstance(decision, Admitted):
            metered = self._metered(prepared, decision, answer, held, picked, version=version)
            if metered is not None:
                return metered
            self._release(held, picked)
            state.quotas.settle_now(decision, decision.tokens)
        else:
            self._release(held, picked)
        return answer

    async def _check_async(
        self, pending: handlers.PendingRequest, body: bytes, arrived: float, started: float
    ) -> CheckAnswer:
        state = self.state
        gateway = state.gateway
        try:
            deadline = arrived + gateway.counting_budget_s
            if len(body) >= self.offload_body_bytes:
                prepared = await asyncio.to_thread(
                    handlers.prepare_body, gateway, pending, body, deadline=deadline
                )
            else:
                prepared = handlers.prepare_body(gateway, pending, body, deadline=deadline)
            if isinstance(prepared, handlers.ImmediateReply):
                return self._refuse(prepared, pending.tenant.name, "")
            version = handlers.pick_version(gateway, prepared, state.rng)
            prepared = state.length.decide(gateway.config, prepared, version)
            held = self._shed_or_hold(prepared, version)
            if isinstance(held, CheckAnswer):
                return held
            picked = self._pick(prepared, version)
            if isinstance(picked, CheckAnswer):
                self._release(held)
                return picked
        except Exception:
            log.exception("ext_authz check failed; answering 500")
            return self._internal_error()
        if isinstance(picked, PickWaiter):
            return await self._check_after_wait(
                prepared,
                picked,
                body_length=len(body),
                version=version,
                held=held,
                arrived=arrived,
                started=started,
            )
        return await self._admit_async(
            prepared,
            picked,
            body_length=len(body),
            version=version,
            held=held,
            arrived=arrived,
            started=started,
        )

    async def _check_after_wait(
        self,
        prepared: handlers.PreparedRequest,
        waiter: PickWaiter,
        *,
        body_length: int,
        version: str,
        held: str | None,
        arrived: float,
        started: float,
    ) -> CheckAnswer:
        """The check of a request that waits in its model's fair queue (:mod:`ext_proc.picking`): its pick
        once made (or the queue's 429), then the quota admission as :meth:`_admit_async`."""
        try:
            decision = await wait_for_pick(waiter)
        except BaseException:
            self._release(held)
            raise
        if isinstance(decision, handlers.ImmediateReply):
            self._release(held)
            return self._refuse(decision, prepared.pending.tenant.name, prepared.model.name)
        return await self._admit_async(
            prepared,
            decision,
            body_length=body_length,
            version=version,
            held=held,
            arrived=arrived,
            started=started,
        )

    async def _admit_async(
        self,
        prepared: handlers.PreparedRequest,
        picked: Picked | None,
        *,
        body_length: int,
        version: str,
        held: str | None,
        arrived: float,
        started: float,
    ) -> CheckAnswer:
        """Quota admission (awaited) and the answer of a request whose version and hosts are chosen."""
        state = self.state
        gateway = state.gateway
        pending = prepared.pending
        try:
            try:
                decision = await state.quotas.admit(
                    pending.tenant.name, prepared.reserved_tokens, deadline=arrived + gateway.admit_budget_s
                )
                answer = self._admitted(prepared, decision, body_length, version, picked)
            except BaseException:
                self._release(held, picked)
                raise
            metered = (
                self._metered(prepared, decision, answer, held, picked, version=version)
                if isinstance(decision, Admitted)
                else None
            )
            if metered is not None:
                answer = metered
            else:
                self._release(held, picked)
                if isinstance(decision, Admitted):
                    try:
                        await state.quotas.settle(decision, decision.tokens)
                    except Exception:
                        log.exception("settling the quota of tenant %r failed", decision.tenant)
        except Exception:
            log.exception("ext_authz check failed; answering 500")
            return self._internal_error()
        state.metrics.processed("check", time.perf_counter() - started)
        return answer

    def _metered(
        self,
        prepared: handlers.PreparedRequest,
        decision: Admitted,
        answer: CheckAnswer,
        held: str | None,
        picked: Picked | None = None,
        *,
        version: str,
    ) -> CheckAnswer | None:
        """``answer`` with the request's meter id when its reservation waits for Envoy's access-log entry
        (a meter is set, ``account_responses`` is on, the request goes upstream); None when the caller
        settles the reservation at once (and releases ``held``). A degraded admission (the Redis store
        failing open) is metered too: its settlement changes nothing in the store, but its end leaves the
        in-flight count ``held`` (the cluster :meth:`_shed_or_hold` counted it on), the endpoint count
        ``picked`` holds (:meth:`_pick`) and its length class's count on ``version``'s cluster
        (:meth:`ext_proc.length_state.LengthState.hold`, released with the predictor taught by
        :mod:`ext_authz.meter`)."""
        meter = self.meter
        if meter is None or answer.status != 200:
            return None
        if not self.state.gateway.config.ext_proc.account_responses:
            return None
        meter_id = meter.reserve(
            decision,
            model=prepared.model.name,
            prompt_tokens=prepared.prompt_tokens,
            in_flight=held,
            picked=None if picked is None else picked.held,
            length=self.state.length.hold(prepared, prepared.model.cluster_name(version)),
        )
        return CheckAnswer(status=200, headers=(*answer.headers, (h.METER, meter_id)))

    def _shed_or_hold(self, prepared: handlers.PreparedRequest, version: str) -> CheckAnswer | str | None:
        """Low-priority shedding (:mod:`inferlb.policy.shedding`), as ext_proc mode: a ``default`` or
        ``low`` request to ``version``'s cluster enters this process's in-flight count of it
        (``state.in_flight``; returns the cluster, which the caller releases unless the request is
        metered, when its settlement does), unless it is ``low`` and the count reached the cluster's limit:
        then the 503 ``overloaded`` answer (:func:`ext_proc.handlers.shed_low_priority`, as 403 +
        ``x-inferlb-status``). None: not counted (a ``high`` tenant, or no limits: without
        ``account_responses`` and its settler nothing tells the end of a request)."""
        if self.meter is None:
            return None
        state = self.state
        gateway = state.gateway
        cluster = prepared.model.cluster_name(version)
        if cluster not in gateway.low_priority_limits or not counted(prepared.pending.tenant.priority):
            return None
        shed = handlers.shed_low_priority(gateway, prepared, cluster, state.in_flight.get(cluster))
        if shed is not None:
            tenant, model = prepared.pending.tenant.name, prepared.model.name
            state.metrics.low_priority_shed.labels(tenant, model).inc()
            return self._refuse(shed, tenant, model)
        # counted before the quota call, so checks admitted meanwhile (Redis) see this one
        state.in_flight.enter(cluster)
        return cluster

    def _pick(
        self, prepared: handlers.PreparedRequest, version: str
    ) -> Picked | CheckAnswer | PickWaiter | None:
        """Endpoint picking (:func:`ext_proc.picking.choose`) for ``version``'s cluster: the hosts (their
        first entered in the process's count, left by the request's settlement), the 503 refusal when no
        endpoint is eligible (or the 429 of a full queue), the waiter of a request that waits in its model's
        fair queue, or None (the model does not pick, or no state yet)."""
        state = self.state
        out = choose(
            state.picking,
            prepared,
            prepared.model.cluster_name(version),
            state.metrics,
            now=time.monotonic(),
        )
        if isinstance(out, handlers.ImmediateReply):
            return self._refuse(out, prepared.pending.tenant.name, prepared.model.name)
        return out

    def _release(self, held: str | None, picked: Picked | None = None) -> None:
        """Leave the in-flight counts :meth:`_shed_or_hold` and :meth:`_pick` entered, for a request not
        metered."""
        if held is not None:
            self.state.in_flight.leave(held)
        if picked is not None:
            self.state.picking.leave(picked.held)

    def _refuse(self, reply: handlers.ImmediateReply, tenant: str, model: str) -> CheckAnswer:
        self.state.metrics.request_ended(tenant, model, str(reply.status))
        return refused(reply)

    def _admitted(
        self,
        prepared: handlers.PreparedRequest,
        decision: Admitted | Refused,
        body_length: int,
        version: str,
        picked: Picked | None = None,
    ) -> CheckAnswer:
        """The answer after the quota decision, routed to ``version`` and, with ``picked``, to its hosts
        (the caller settles an admission with its reservation)."""
        state = self.state
        tenant, model = prepared.pending.tenant.name, prepared.model.name
        if isinstance(decision, Refused):
            state.metrics.quota_rejections.labels(tenant, decision.limit.value).inc()
            return self._refuse(handlers.quota_refusal(decision), tenant, model)
        cont = handlers.route(
            state.gateway,
            prepared,
            decision,
            rng=state.rng,
            version=version,
            destination=None if picked is None else picked.header_value,
        )
        try:
            answer = allowed(cont, body_length)
        except ValueError:
            return self._refuse(_unsplicable(), tenant, model)
        state.metrics.request_ended(tenant, model, "forwarded")
        return answer

    def _track(self, work: Coroutine[Any, Any, CheckAnswer]) -> asyncio.Future[CheckAnswer]:
        task: asyncio.Future[CheckAnswer] = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def drain(self) -> None:
        """Wait for the checks still running (their connection may be gone)."""
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
