"""The ext_proc decisions per processing phase, as plain functions over plain values (no gRPC types).

Envoy sends each HTTP request to ext_proc as request headers (SEND) and then the whole body (BUFFERED).

- :func:`on_request_headers` removes every client-sent ``x-inferlb-*`` header, authenticates the API key
  (401 before the body is read), answers ``GET /v1/models`` itself, lets POSTs to the inference paths go on
  to the body phase and refuses anything else (400/404/405).
- :func:`on_request_body` = :func:`prepare_body` (size check, parse, model resolution, prompt token
  count, and the upstream body rewrite: an alias becomes the canonical model name and a metered stream gets
  ``stream_options.include_usage``, see :mod:`inferlb.request.rewrite`; pure and thread-safe, so a big body
  can be prepared off the event loop) then :func:`admit`
  (quota and version choice, which mutate the :class:`~inferlb.policy.quota.QuotaBook` and so run on the
  loop). It ends with the routing headers and ``clear_route_cache`` or with an immediate refusal.

Refusals are :class:`ImmediateReply` values carrying the OpenAI JSON error body
(:meth:`inferlb.errors.RequestError.to_openai_json`) and a ``details`` token naming the reason (Envoy's
``%RESPONSE_CODE_DETAILS%``). The gRPC adapter is :mod:`ext_proc.servicer`.

The decisions, like the parsed request (:mod:`inferlb.request.parsing`) and the quota answers
(:mod:`inferlb.policy.quota`), are frozen keyword-only ``msgspec.Struct`` values rather than frozen
dataclasses: the same contract (immutable, compared and hashed by value, keyword construction), built in C.
A frozen dataclass sets each field through ``object.__setattr__`` and its call packs the keywords in a
dict; the dozen such values of one check were ~29% of an ext_authz check's instructions (callgrind,
in-process, 3 KB chat: 284 K instructions per check with Structs, 406 K with the dataclasses).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import msgspec

from inferlb.config.checks import SHARED_TOKENIZERS
from inferlb.config.schema import Config, EndpointPicking, ModelConfig, TenantConfig
from inferlb.errors import RequestError
from inferlb.policy.affinity import HASH_LB_POLICIES, NO_KEYS, affinity_keys
from inferlb.policy.length_aware import length_class
from inferlb.policy.output_predictor import LengthQuery
from inferlb.policy.quota import Admitted, Limit, QuotaBook, Refused
from inferlb.policy.routing import (
    RoutingTable,
    model_not_found,
    model_object_bodies,
    models_list_body,
    priority_header_value,
)
from inferlb.policy.shedding import low_priority_limit, sheds
from inferlb.request import headers as h
from inferlb.request.blocks import prompt_block_keys
from inferlb.request.parsing import INFERENCE_PATHS, EndpointKind, InferenceRequest, echo, parse_request
from inferlb.request.rewrite import BodySplice, rewrite_request
from inferlb.request.tokens import (
    CountingBudgetExceededError,
    TextTokenCounter,
    count_each_prompt,
    count_prompt_tokens,
    default_counter,
    min_prompt_tokens,
)
from inferlb.request.usage import Reservation

MODELS_PATH = "/v1/models"
#: Endpoints whose streams take ``stream_options.include_usage`` (the Responses API always sends usage in
#: its ``response.completed`` event and has no such option).
_INCLUDE_USAGE_KINDS = frozenset({EndpointKind.CHAT_COMPLETIONS, EndpointKind.COMPLETIONS})
_JSON = (("content-type", "application/json"),)
#: Longest error message sent (characters): a backstop behind :func:`inferlb.request.parsing.echo`.
MAX_ERROR_MESSAGE_CHARS = 2048
#: Share of Envoy's ``message_timeout`` the body phase may spend counting tokens: the rest covers the
#: gRPC hops, parsing and admission, so the client gets our error and not Envoy's empty 504.
COUNTING_BUDGET_FRACTION = 0.6
#: Share of Envoy's ``message_timeout`` within which the body phase must have its quota decision: a quota
#: store may wait this long after the body arrived for its own resources (a free Redis connection) before
#: it answers 503 ``quota_backend_busy``; the rest covers the answer's gRPC hop, so the client gets our
#: JSON and not Envoy's empty 504.
ADMIT_BUDGET_FRACTION = 0.9
#: Response code details of a request refused because counting ran out of time (logged by the servicer).
COUNTING_BUDGET_DETAILS = "inferlb_counting_budget_exceeded"


# -- decisions ------------------------------------------------------------------------------------
class ImmediateReply(msgspec.Struct, frozen=True, kw_only=True):
    """Answer the client now; the request never reaches a backend.

    Attributes:
        status: HTTP status.
        body: the response body (JSON).
        headers: response headers (``content-type``, ``retry-after``...).
        details: a whitespace-free reason token for Envoy's response code details.
    """

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...]
    details: str


class PendingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What the headers phase learned, carried to the body phase of the same stream."""

    tenant: TenantConfig
    kind: EndpointKind
    path: str
    #: the value of the configured session header (``ext_proc.session_header``) as sent, or None.
    session: str | None = None


class BodyExpected(msgspec.Struct, frozen=True, kw_only=True):
    """Headers accepted: continue with ``remove_headers`` applied and process the body next."""

    pending: PendingRequest
    remove_headers: tuple[str, ...]


class PassThrough(msgspec.Struct, frozen=True, kw_only=True):
    """A path that is not inference, let through unexamined (``ext_proc.non_inference_paths: allow``):
    continue with ``remove_headers`` applied and leave the body alone."""

    remove_headers: tuple[str, ...]


class PreparedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed, counted request for a known model, ready for quota admission."""

    pending: PendingRequest
    request: InferenceRequest
    model: ModelConfig
    prompt_tokens: int
    #: prompt + the largest completion the request may produce (tokens): what admission reserves.
    reserved_tokens: int
    #: the body to send upstream instead of the client's (the canonical model name in place of an alias,
    #: ``stream_options.include_usage`` added), or None to forward the client's body as sent.
    upstream_body: bytes | None = None
    #: ``upstream_body`` as byte splices of the client's body (for a proxy that applies them: the ext_authz
    #: mode's Lua filter), None when there is no ``upstream_body`` or the client's body was not UTF-8.
    upstream_splices: tuple[BodySplice, ...] | None = None
    #: the gateway added ``include_usage`` to ``upstream_body``: the usage chunk is hidden from the client.
    usage_event_added: bool = False
    #: the prompt's block keys for the endpoint picker's prefix index (:func:`picking_block_keys`); empty
    #: unless the model picks in mode ``approximate`` or ``precise``.
    block_keys: tuple[int, ...] = ()
    #: its length class (``x-inferlb-length-class``) as the request path decided it
    #: (:meth:`ext_proc.length_state.LengthState.decide`: the cap or the predicted output, then the
    #: capacity guard); None: not decided, :func:`route` and the picker class it by its cap.
    length_class: str | None = None
    #: what the output predictor was asked about it, for its settlement to teach the answer (None when
    #: the model does not predict).
    length_query: LengthQuery | None = None


class ContinueRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Let the request go upstream with these header changes (and re-pick the route when asked).

    Attributes:
        set_headers: headers to set, overwriting any value.
        remove_headers: header names to remove.
        clear_route_cache: make Envoy pick the route again from the changed headers.
        body: a replacement request body (``set_headers`` then carries its ``content-length``), or None to
            forward the client's body unchanged.
        body_splices: ``body`` as byte splices of the client's body (None: no ``body``, or the client's
            body was not UTF-8).
        admitted: the quota reservation taken, to settle with the response's usage, or None.
        reservation: what the response meter needs to settle it (prompt, reservation, stream), or None.
        model: the canonical model name ("" before one is known), for metrics.
        destination: the hosts endpoint picking chose (``ip:port[,ip:port...]``, also among ``set_headers``
            as :data:`~inferlb.request.headers.DESTINATION_ENDPOINT`), for the ``envoy.lb`` dynamic
            metadata ext_proc mode sets; None when the model does not pick endpoints.
    """

    set_headers: tuple[tuple[str, str], ...] = ()
    remove_headers: tuple[str, ...] = ()
    clear_route_cache: bool = False
    body: bytes | None = None
    body_splices: tuple[BodySplice, ...] | None = None
    admitted: Admitted | None = None
    reservation: Reservation | None = None
    model: str = ""
    destination: str | None = None


# -- the per-config state -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Gateway:
    """Everything the handlers read, precomputed from one config (swap the whole value on reload).

    Attributes:
        config: the config it was built from.
        routing: key/model/version lookups.
        max_body_bytes: ``gateway.max_request_body_bytes`` (bytes).
        models_list_body: the ``GET /v1/models`` JSON body.
        model_bodies: model name or alias -> the ``GET /v1/models/{id}`` JSON body.
        counter: the default prompt token counter (the bundled cl100k_base unless given).
        counters: canonical model name -> its ``tokenizer``'s counter.
        counting_budget_s: most seconds the body phase spends counting one request's tokens
            (``ext_proc.message_timeout_ms`` x :data:`COUNTING_BUDGET_FRACTION`).
        admit_budget_s: seconds after the body's arrival by which admission must be decided
            (``ext_proc.message_timeout_ms`` x :data:`ADMIT_BUDGET_FRACTION`).
        account_responses: this process meters responses on its own stream (``ext_proc.account_responses``
            with ``protocol: ext_proc``). False with
            ``protocol: ext_authz``: Envoy meters there (:mod:`ext_authz.meter`).
        asks_usage: responses are metered (``ext_proc.account_responses``, either protocol), so a stream
            whose client did not ask for ``stream_options.include_usage`` gets it added and the usage chunk
            is hidden from the client again (by ext_proc's response stream, or with ``protocol: ext_authz``
            by Envoy's Lua filter).
        allow_other_paths: ``ext_proc.non_inference_paths == "allow"``.
        low_priority_limits: cluster name -> DEFAULT-priority requests this process may have in flight
            there before it refuses ``low`` tenants (:func:`inferlb.policy.shedding.low_priority_limit`
            of the model's ``cluster.low_priority_max_requests_percent``, shared among the ext_proc
            processes); empty when ``account_responses`` is off (no response end, so no count). Either
            protocol: ext_proc counts until its stream ends, ext_authz until the request's access-log
            entry settles it (:mod:`ext_authz.meter`).
        overflow_retry_after_s: ``gateway.overflow_retry_after_s``, the ``retry-after`` of a shed request.
    """

    config: Config
    routing: RoutingTable
    max_body_bytes: int
    models_list_body: bytes
    model_bodies: Mapping[str, bytes]
    counter: TextTokenCounter
    counters: Mapping[str, TextTokenCounter]
    counting_budget_s: float = 3.0
    admit_budget_s: float = 4.5
    account_responses: bool = True
    asks_usage: bool = True
    allow_other_paths: bool = False
    low_priority_limits: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    overflow_retry_after_s: int = 1

    @classmethod
    def from_config(
        cls,
        config: Config,
        counter: TextTokenCounter | None = None,
        *,
        known_counters: Mapping[str, TextTokenCounter] | None = None,
    ) -> Gateway:
        """Precompute the lookups, fixed response bodies and token counters of ``config``.

        Args:
            counter: the counter for models on the default tokenizer (tests inject one).
            known_counters: tokenizer spec -> counter already built (a reload reuses them, so an ``hf:``
                file is read once).

        Raises:
            ValueError: a model's ``tokenizer`` cannot be built (file missing, package missing).
        """
        default = counter or default_counter()
        specs: dict[str, TextTokenCounter] = {"tiktoken:cl100k_base": default, **(known_counters or {})}
        counters: dict[str, TextTokenCounter] = {}
        for m in config.models:
            if m.tokenizer not in specs:
                try:  # the process's cache: the reload check has just loaded it
                    specs[m.tokenizer] = SHARED_TOKENIZERS.load(m.tokenizer)
                except ValueError as exc:
                    raise ValueError(f"models[{m.name}].tokenizer: {exc}") from None
            counters[m.name] = specs[m.tokenizer]
        processes = 1 + len(config.ext_proc.extra_listen)
        own_stream_meters = config.ext_proc.account_responses and config.ext_proc.protocol == "ext_proc"
        limits = {
            m.cluster_name(v.name): low_priority_limit(
                m.cluster.circuit_breaker_default.max_requests,
                m.cluster.low_priority_max_requests_percent,
                processes,
            )
            for m in config.models
            for v in m.versions
        }
        return cls(
            config=config,
            routing=RoutingTable(config),
            max_body_bytes=config.gateway.max_request_body_bytes,
            models_list_body=models_list_body(config),
            model_bodies=MappingProxyType(model_object_bodies(config)),
            counter=default,
            counters=MappingProxyType(counters),
            counting_budget_s=config.ext_proc.message_timeout_ms / 1000 * COUNTING_BUDGET_FRACTION,
            admit_budget_s=config.ext_proc.message_timeout_ms / 1000 * ADMIT_BUDGET_FRACTION,
            account_responses=own_stream_meters,
            asks_usage=config.ext_proc.account_responses,
            allow_other_paths=config.ext_proc.non_inference_paths == "allow",
            # either mode learns each request's end with account_responses: ext_proc from its stream,
            # ext_authz from the access-log settlement (ext_authz.meter)
            low_priority_limits=MappingProxyType(limits if config.ext_proc.account_responses else {}),
            overflow_retry_after_s=config.gateway.overflow_retry_after_s,
        )


# -- helpers --------------------------------------------------------------------------------------
def refusal(err: RequestError, details: str) -> ImmediateReply:
    """An :class:`ImmediateReply` for ``err``: its status, OpenAI JSON body, and ``retry-after`` in whole
    seconds (at least 1) when it carries a retry time."""
    headers: tuple[tuple[str, str], ...] = _JSON
    if err.retry_after_s is not None:
        headers = (*_JSON, ("retry-after", str(max(1, math.ceil(err.retry_after_s)))))
    if len(err.message) > MAX_ERROR_MESSAGE_CHARS or (err.param is not None and len(err.param) > 300):
        err = RequestError(
            err.status,
            echo(err.message, MAX_ERROR_MESSAGE_CHARS),
            type=err.type,
            code=err.code,
            param=None if err.param is None else echo(err.param, 300),
            retry_after_s=err.retry_after_s,
        )
    doc = err.to_openai_json()
    return ImmediateReply(
        status=err.status,
        body=json.dumps(doc).encode(),
        headers=headers,
        details=details,
    )


def _ok(body: bytes, details: str) -> ImmediateReply:
    return ImmediateReply(status=200, body=body, headers=_JSON, details=details)


# -- phases ---------------------------------------------------------------------------------------
def on_request_headers(
    gateway: Gateway, headers: Mapping[str, str], *, end_of_stream: bool
) -> BodyExpected | PassThrough | ImmediateReply:
    """Decide on a request from its headers.

    Args:
        gateway: the current precomputed config.
        headers: request headers with lower-case names, pseudo-headers included (``:method``, ``:path``).
        end_of_stream: True when the request has no body.

    Returns:
        :class:`BodyExpected` for a POST to an inference path with a body; :class:`PassThrough` for another
        path when ``ext_proc.non_inference_paths`` is ``allow``; otherwise an :class:`ImmediateReply`: 200
        model list/object, 400 missing body, 401 bad key, 404 unknown path or model, 405 wrong method.
    """
    method = headers.get(":method", "")
    path = headers.get(":path", "").partition("?")[0]
    try:
        tenant = gateway.routing.authenticate(headers.get("authorization"))
    except RequestError as err:
        return refusal(err, "inferlb_invalid_api_key")

    kind = INFERENCE_PATHS.get(path)
    if kind is not None:
        if method != "POST":
            return _method_not_allowed(method, path, "POST")
        if end_of_stream:
            return refusal(
                RequestError(
                    400,
                    "The request body is empty; expected a JSON object.",
                    type="invalid_request_error",
                ),
                "inferlb_empty_body",
            )
        spoofed = tuple(sorted({k for k in headers if k.startswith(h.PREFIX)}))
        session_header = gateway.config.ext_proc.session_header
        session = headers.get(session_header) if session_header else None
        pending = PendingRequest(tenant=tenant, kind=kind, path=path, session=session)
        return BodyExpected(pending=pending, remove_headers=spoofed)

    if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
        if method != "GET":
            return _method_not_allowed(method, path, "GET")
        if path == MODELS_PATH:
            return _ok(gateway.models_list_body, "inferlb_models_list")
        model_id = path[len(MODELS_PATH) + 1 :]
        body = gateway.model_bodies.get(model_id)
        if body is None:
            return refusal(model_not_found(model_id), "inferlb_model_not_found")
        return _ok(body, "inferlb_model_object")

    if gateway.allow_other_paths:
        return PassThrough(remove_headers=_spoofed(headers))
    return refusal(
        RequestError(
            404,
            f"Invalid URL ({echo(method, 32)} {echo(path)})",
            type="invalid_request_error",
            code="unknown_url",
        ),
        "inferlb_unknown_path",
    )


def _spoofed(headers: Mapping[str, str]) -> tuple[str, ...]:
    # a client must not choose its own route, tenant or priority
    return tuple(sorted({k for k in headers if k.startswith(h.PREFIX)}))


def _method_not_allowed(method: str, path: str, allowed: str) -> ImmediateReply:
    """The 405 refusal, with the ``allow`` header RFC 9110 (section 15.5.6) requires of a 405."""
    err = RequestError(
        405,
        f"Method {echo(method, 32)} is not allowed on {echo(path)}; use {allowed}.",
        type="invalid_request_error",
        code="method_not_allowed",
    )
    reply = refusal(err, "inferlb_method_not_allowed")
    return msgspec.structs.replace(reply, headers=(*reply.headers, ("allow", allowed)))


def picking_block_keys(picking: EndpointPicking, request: InferenceRequest) -> tuple[int, ...]:
    """The prompt block keys a model's endpoint picking matches
    (:func:`inferlb.request.blocks.prompt_block_keys` at ``picking.block_size``) in modes ``approximate``
    and ``precise``; none in the others (no index to match). One XXH3 call per block not memoized."""
    if picking.mode not in ("approximate", "precise"):
        return ()
    return prompt_block_keys(request, block_size=picking.block_size)


def prepare_body(
    gateway: Gateway,
    pending: PendingRequest,
    body: bytes,
    *,
    end_of_stream: bool = True,
    deadline: float | None = None,
) -> PreparedRequest | ImmediateReply:
    """Check size, parse, resolve the model and count prompt tokens (pure; safe in a worker thread).

    The context-length check runs twice: first on a floor computed without tokenizing
    (:func:`inferlb.request.tokens.min_prompt_tokens`), so a body that cannot fit is refused before any BPE
    work, then on the real count. Completions and embeddings are checked per prompt (each is its own
    sequence).

    Args:
        body: the buffered request body.
        end_of_stream: False when Envoy sent only part of the body (its buffer filled): refused as 413.
        deadline: monotonic time by which counting must finish (None: no limit).

    Returns:
        :class:`PreparedRequest`, or an :class:`ImmediateReply`: 413 body too large or counting not done
        by ``deadline`` (details :data:`COUNTING_BUDGET_DETAILS`), 400 malformed body or prompt +
        requested output over the model's context length, 404 unknown model.
    """
    if len(body) > gateway.max_body_bytes or not end_of_stream:
        return refusal(
            RequestError(
                413,
                f"The request body is larger than the gateway accepts: {len(body)}"
                f"{'' if end_of_stream else '+'} bytes, limit {gateway.max_body_bytes} bytes.",
                type="invalid_request_error",
                code="request_too_large",
            ),
            "inferlb_body_too_large",
        )
    try:
        request = parse_request(pending.kind, body)
    except RequestError as err:
        return refusal(err, "inferlb_invalid_request")
    try:
        model = gateway.routing.resolve_model(request.model)
    except RequestError as err:
        return refusal(err, "inferlb_model_not_found")
    counter = gateway.counters.get(model.name, gateway.counter)
    per_prompt_output = request.max_output_tokens or 0
    floors = min_prompt_tokens(request, counter, per_image=model.image_tokens)
    over = _over_context(pending.kind, floors, per_prompt_output, model)
    if over is not None:
        return over
    try:
        if pending.kind.is_conversation:
            each: tuple[int, ...] = (
                count_prompt_tokens(request, counter, deadline=deadline, per_image=model.image_tokens),
            )
        else:
            each = count_each_prompt(request, counter, deadline=deadline)
    except CountingBudgetExceededError as exc:
        return refusal(
            RequestError(
                413,
                f"The gateway could not count the prompt's tokens within its time budget "
                f"({gateway.counting_budget_s * 1000:.0f} ms; {exc.counted_chars} characters counted). "
                "Please send a shorter prompt.",
                type="invalid_request_error",
                code="request_too_large",
            ),
            COUNTING_BUDGET_DETAILS,
        )
    over = _over_context(pending.kind, each, per_prompt_output, model, exact=True)
    if over is not None:
        return over
    prompt_tokens = sum(each)
    output_cap = request.output_token_cap(model.default_max_tokens)
    # the model server knows the model by its canonical name only (vLLM answers 404 for an alias)
    rename = request.model != model.name
    # ask the model server for the usage event so the stream is billed from its own numbers
    want_usage = (
        gateway.asks_usage
        and request.stream
        and not request.include_usage
        and pending.kind in _INCLUDE_USAGE_KINDS
    )
    rewritten = None
    if rename or want_usage:
        # one pass for both changes; the body parsed above, so it is a JSON object
        rewritten = rewrite_request(body, model=model.name if rename else None, include_usage=want_usage)
    return PreparedRequest(
        pending=pending,
        request=request,
        model=model,
        prompt_tokens=prompt_tokens,
        reserved_tokens=prompt_tokens + output_cap,
        upstream_body=None if rewritten is None else rewritten.body,
        upstream_splices=None if rewritten is None else rewritten.splices,
        usage_event_added=rewritten is not None and rewritten.include_usage_added,
        block_keys=picking_block_keys(model.endpoint_picking, request),
    )


#: The body field a context-length refusal names, by endpoint (``input`` for the others).
_PROMPT_FIELD = MappingProxyType(
    {EndpointKind.CHAT_COMPLETIONS: "messages", EndpointKind.COMPLETIONS: "prompt"}
)


def _over_context(
    kind: EndpointKind,
    prompt_tokens: tuple[int, ...],
    per_prompt_output: int,
    model: ModelConfig,
    *,
    exact: bool = False,
) -> ImmediateReply | None:
    """The 400 ``context_length_exceeded`` reply for the first prompt whose tokens + requested output
    exceed the model's context length, or None. ``exact=False``: the counts are floors ("at least")."""
    field = _PROMPT_FIELD.get(kind, "input")
    for i, tokens in enumerate(prompt_tokens):
        if tokens + per_prompt_output <= model.context_length:
            continue
        where = field if len(prompt_tokens) == 1 else f"{field}[{i}]"
        prompt_words = f"{tokens}" if exact else f"at least {tokens}"
        return refusal(
            RequestError(
                400,
                f"This model's maximum context length is {model.context_length} tokens. However, you "
                f"requested {'' if exact else 'at least '}{tokens + per_prompt_output} tokens "
                f"({prompt_words} in {where}, {per_prompt_output} for the completion). Please reduce the "
                "prompt or the completion length.",
                type="invalid_request_error",
                code="context_length_exceeded",
                param=where,
            ),
            "inferlb_context_length_exceeded",
        )
    return None


def admit(
    gateway: Gateway, quotas: QuotaBook, prepared: PreparedRequest, *, now: float, rng: random.Random
) -> ContinueRequest | ImmediateReply:
    """Take the quota reservation and choose the version; answer with the routing headers.

    Args:
        now: monotonic seconds for the per-minute quota windows.
        rng: randomness for version choice when the request names no ``user``.

    Returns:
        :class:`ContinueRequest` setting ``x-inferlb-model``, ``-version``, ``-tenant``, ``-priority``,
        ``-prompt-tokens`` (``-stream: true`` for a streamed request, ``-length-class`` for a length-aware
        model) with ``clear_route_cache``;
        or a 429 ``rate_limit_error``/``rate_limit_exceeded`` :class:`ImmediateReply` with ``retry-after``
        (none when the request can never fit the quota).
    """
    decision = quotas.try_admit(prepared.pending.tenant.name, prepared.reserved_tokens, now)
    if isinstance(decision, Refused):
        return quota_refusal(decision)
    return route(gateway, prepared, decision, rng=rng)


#: Response code details of a ``low`` request refused because its cluster is busy (:func:`shed_low_priority`).
LOW_PRIORITY_SHED_DETAILS = "inferlb_low_priority_overloaded"


def shed_low_priority(
    gateway: Gateway, prepared: PreparedRequest, cluster: str, in_flight: int
) -> ImmediateReply | None:
    """The 503 of a ``low`` tenant's request when ``cluster`` (its model version's) already has
    ``in_flight`` DEFAULT-priority requests of this process and that reached the cluster's low-priority
    limit (:attr:`Gateway.low_priority_limits`, :func:`inferlb.policy.shedding.sheds`); None otherwise,
    and always None for a cluster without a limit (``account_responses`` off).

    The answer is Envoy's own circuit-breaker overflow as the gateway's local-reply mapper shapes it:
    503 ``server_error``/``overloaded`` with ``retry-after`` = ``gateway.overflow_retry_after_s``, so
    clients handle both alike.
    """
    limit = gateway.low_priority_limits.get(cluster)
    if limit is None or not sheds(prepared.pending.tenant.priority, in_flight, limit):
        return None
    err = RequestError(
        503,
        f"The model's servers are busy and low-priority requests are shed first ({in_flight} requests in "
        f"flight, low-priority limit {limit}); retry after the number of seconds in the retry-after header.",
        type="server_error",
        code="overloaded",
        retry_after_s=gateway.overflow_retry_after_s,
    )
    return refusal(err, LOW_PRIORITY_SHED_DETAILS)


def quota_refusal(decision: Refused) -> ImmediateReply:
    """The answer to a quota refusal: 429 ``rate_limit_error``/``rate_limit_exceeded`` with ``retry-after``
    (none when the request can never fit), or 503 ``server_error`` with ``retry-after``: code
    ``quota_backend_unavailable`` when the shared quota state is unreachable and the store fails closed,
    ``quota_backend_busy`` when no connection to it freed within the request's budget."""
    if decision.limit in (Limit.QUOTA_BACKEND_UNAVAILABLE, Limit.QUOTA_BACKEND_BUSY):
        err = RequestError(
            503,
            decision.message,
            type="server_error",
            code=decision.limit.value,
            retry_after_s=decision.retry_after_s,
        )
        return refusal(err, f"inferlb_{decision.limit.value}")
    err = RequestError(
        429,
        decision.message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        retry_after_s=decision.retry_after_s,
    )
    reason = "request_too_large" if decision.never_fits else decision.limit.value
    return refusal(err, f"inferlb_quota_{reason}")


def pick_version(gateway: Gateway, prepared: PreparedRequest, rng: random.Random) -> str:
    """The version a request goes to: the model's canary split, sticky per session (the session header,
    else the request's ``user`` field) like affinity, else drawn from ``rng``."""
    return gateway.routing.pick_version(
        prepared.model, prepared.pending.session or prepared.request.user, rng
    )


def route(
    gateway: Gateway,
    prepared: PreparedRequest,
    admitted: Admitted,
    *,
    rng: random.Random,
    version: str | None = None,
    destination: str | None = None,
) -> ContinueRequest:
    """The routing headers of an admitted request (and its rewritten body with its new
    ``content-length``, when the gateway renamed an alias to the canonical model name or added
    ``include_usage``), to ``version`` (default: :func:`pick_version`); ``destination``: the hosts endpoint
    picking chose (:mod:`ext_proc.picking`), sent as :data:`~inferlb.request.headers.DESTINATION_ENDPOINT`."""
    tenant = prepared.pending.tenant
    if version is None:
        version = pick_version(gateway, prepared, rng)
    # the keys cost a SHA-256 over the conversation's opening; only ring_hash/maglev routes read them (and
    # every model route strips them before the upstream), so other models skip the work
    if prepared.model.cluster.lb_policy in HASH_LB_POLICIES:
        keys = affinity_keys(prepared.request, prepared.pending.session)
    else:
        keys = NO_KEYS
    headers: tuple[tuple[str, str], ...] = (
        (h.MODEL, prepared.model.name),
        (h.VERSION, version),
        (h.TENANT, tenant.name),
        (h.PRIORITY, priority_header_value(tenant.priority)),
        (h.PROMPT_TOKENS, str(prepared.prompt_tokens)),
    )
    # affinity keys for ring_hash/maglev routes (inferlb.policy.affinity); absent keys leave the header unset
    if keys.prefix is not None:
        headers = (*headers, (h.PREFIX_KEY, keys.prefix))
    if keys.session is not None:
        headers = (*headers, (h.SESSION_KEY, keys.session))
    if prepared.request.stream:
        # streamed answers get their own route: a per-try bound on the silence, not on the whole answer
        headers = (*headers, (h.STREAM, "true"))
    length_aware = prepared.model.cluster.length_aware
    if length_aware is not None:
        # the whole output cap (x n x prompts, as admission reserves): n choices share one GPU's batch
        name = prepared.length_class
        if name is None:
            name = length_class(
                prepared.request.output_token_cap(prepared.model.default_max_tokens), length_aware
            )
        headers = (*headers, (h.LENGTH_CLASS, name))
    if destination is not None:
        # Envoy's override_host policy of the model's clusters reads it (and ext_proc's envoy.lb metadata)
        headers = (*headers, (h.DESTINATION_ENDPOINT, destination))
    body = prepared.upstream_body
    if body is not None:
        # Envoy's ProcessingMode docs: with a BUFFERED body and SEND headers, the processor that mutates
        # the body must set content-length to the new length (Envoy >= 1.29 no longer drops it)
        headers = (*headers, ("content-length", str(len(body))))
    return ContinueRequest(
        set_headers=headers,
        clear_route_cache=True,
        body=body,
        body_splices=prepared.upstream_splices,
        admitted=admitted,
        reservation=Reservation(
            prompt_tokens=prepared.prompt_tokens,
            reserved_tokens=prepared.reserved_tokens,
            stream=prepared.request.stream,
            strip_usage_event=prepared.usage_event_added,
        ),
        model=prepared.model.name,
        destination=destination,
    )


def on_request_body(
    gateway: Gateway,
    quotas: QuotaBook,
    pending: PendingRequest,
    body: bytes,
    *,
    now: float,
    rng: random.Random,
    end_of_stream: bool = True,
    deadline: float | None = None,
) -> ContinueRequest | ImmediateReply:
    """:func:`prepare_body` then :func:`admit`, in one call."""
    prepared = prepare_body(gateway, pending, body, end_of_stream=end_of_stream, deadline=deadline)
    if isinstance(prepared, ImmediateReply):
        return prepared
    return admit(gateway, quotas, prepared, now=now, rng=rng)
