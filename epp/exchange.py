"""One ext_proc stream of the EPP as a state machine: ``ProcessingRequest`` in, the ``ProcessingResponse``
values to send out (Envoy's protos, no gRPC), after the Gateway API Inference Extension's endpoint-picker
protocol (proposal 004) and Envoy's ``FULL_DUPLEX_STREAMED`` body mode.

In ``FULL_DUPLEX_STREAMED`` (``envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto``) Envoy
sends the request headers and then every body chunk as it arrives, without waiting for answers; the body
is complete at a chunk with ``end_of_stream``, or at the request trailers (the trailer mode must be SEND)
when the request has some. Envoy forwards upstream only the body the server streams back
(``StreamedBodyResponse``), and the answers must keep the order headers -> body -> trailers. So the EPP:

- answers nothing to the request headers (unless they end the request: then it picks at once), buffers
  the body chunks (at most ``max_body_bytes``, else 413);
- once the body is complete, picks, and sends the answer to the request headers (header
  ``x-gateway-destination-endpoint`` set, the same value in dynamic metadata ``envoy.lb``, route cache
  cleared), then the whole body back in chunks of at most :data:`STREAMED_CHUNK_BYTES` (the last with
  ``end_of_stream`` unless trailers follow), then the answer to the trailers when they came;
- or, refusing, one ``ImmediateResponse`` (OpenAI error JSON) and nothing more;
- on the response path answers each message in turn: the response headers unchanged (reading the
  ``envoy.lb`` metadata's ``x-gateway-destination-endpoint-served``), each response body chunk streamed
  back as is when the response body mode is ``FULL_DUPLEX_STREAMED`` (a plain continue otherwise), the
  trailers unchanged.

A stream whose ``protocol_config`` says the request body mode is ``BUFFERED`` (or ``BUFFERED_PARTIAL``) is
answered in that mode's order instead: the headers at once, the decision on the body answer. In ``NONE`` and
``STREAMED`` (where Envoy waits for the headers answer and forwards each chunk as answered) the EPP never
holds the body before the headers go: it picks on the headers answer by load alone (no parse) and lets the
chunks through. The subset hint is read from the ``metadata_context`` of any request
message (Envoy forwards the namespaces its ``metadata_options`` names): key
``x-gateway-destination-endpoint-subset`` of namespace ``envoy.lb.subset_hint``, a list of ``ip:port``
strings or one comma-separated string (a header-to-metadata filter writes the latter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from epp.flow import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, PRIORITY_HEADER, Waiting
from epp.picking import Refused, RequestSeen, Routed, body_too_large

#: The header (and ``envoy.lb`` metadata key) carrying the picked endpoints.
DESTINATION_ENDPOINT: Final = "x-gateway-destination-endpoint"
#: Metadata namespace of the picked endpoints, and of the served endpoint on the response path.
DESTINATION_NAMESPACE: Final = "envoy.lb"
#: Metadata namespace and key of the gateway's subset hint.
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
#: ``envoy.lb`` key of the endpoint that served the request (response path).
SERVED_KEY: Final = "x-gateway-destination-endpoint-served"
#: Largest body chunk streamed back in one message (bytes): under the 64 KiB some Envoy builds allow per
#: streamed chunk, the margin the Gateway API Inference Extension's EPP keeps (62,000).
STREAMED_CHUNK_BYTES: Final = 62_000

_Mode = processing_mode_pb2.ProcessingMode
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

_RESPONSE_HEADERS_CONTINUE = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
_REQUEST_HEADERS_CONTINUE = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
_REQUEST_BODY_CONTINUE = ep.ProcessingResponse(request_body=ep.BodyResponse())
_RESPONSE_BODY_CONTINUE = ep.ProcessingResponse(response_body=ep.BodyResponse())
_REQUEST_TRAILERS_CONTINUE = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
_RESPONSE_TRAILERS_CONTINUE = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def _header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


def immediate_response(reply: Refused) -> ep.ProcessingResponse:
    """``reply`` as an ``ImmediateResponse``."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=ep.HeaderMutation(set_headers=[_header(k, v) for k, v in reply.headers]),
            body=reply.body,
            details=reply.details,
        )
    )


def destination_metadata(value: str) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": value}}`` as dynamic metadata."""
    meta = struct_pb2.Struct()
    meta.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT].string_value = value
    return meta


def routed_common(routed: Routed) -> ep.CommonResponse:
    """The header mutation carrying ``routed``, with the route cache cleared (a route may match on it)."""
    return ep.CommonResponse(
        clear_route_cache=True,
        header_mutation=ep.HeaderMutation(set_headers=[_header(DESTINATION_ENDPOINT, routed.value)]),
    )


def streamed_body(phase: str, body: bytes, *, end_of_stream: bool) -> list[ep.ProcessingResponse]:
    """``body`` as ``phase`` (``request_body``/``response_body``) answers carrying ``StreamedBodyResponse``
    chunks of at most :data:`STREAMED_CHUNK_BYTES`; the last has ``end_of_stream`` as given (one empty chunk
    for an empty body)."""
    out: list[ep.ProcessingResponse] = []
    starts = range(0, len(body), STREAMED_CHUNK_BYTES) if body else range(1)
    last = starts[-1]
    for start in starts:
        chunk = body[start : start + STREAMED_CHUNK_BYTES]
        mutation = ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(
                body=chunk, end_of_stream=end_of_stream and start == last
            )
        )
        answer = ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
        out.append(ep.ProcessingResponse(**{phase: answer}))
    return out


def _header_value(hv: base_pb2.HeaderValue) -> str:
    raw = hv.raw_value
    return raw.decode("utf-8", "replace") if raw else str(hv.value)


def subset_hint(req: ep.ProcessingRequest) -> tuple[str, ...] | None:
    """The subset hint in ``req``'s metadata: its ``ip:port`` values (stripped, comma-separated strings
    split), or None when the message carries no hint. Values that are not strings are ignored."""
    spaces = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in spaces:
        return None
    fields = spaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        texts = [value.string_value]
    elif kind == "list_value":
        texts = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    else:
        texts = []
    return tuple(part.strip() for text in texts for part in text.split(",") if part.strip())


def served_endpoint(req: ep.ProcessingRequest) -> str | None:
    """The ``envoy.lb`` metadata's ``x-gateway-destination-endpoint-served`` in ``req``, or None."""
    spaces = req.metadata_context.filter_metadata
    if DESTINATION_NAMESPACE not in spaces:
        return None
    fields = spaces[DESTINATION_NAMESPACE].fields
    if SERVED_KEY not in fields or fields[SERVED_KEY].WhichOneof("kind") != "string_value":
        return None
    return str(fields[SERVED_KEY].string_value).strip() or None


class Exchange:
    """The state of one stream (one HTTP request).

    Args:
        decide: the decision for a complete request (:meth:`epp.picking.EndpointPicker.decide`).
        on_served: ``(routed, served or None) -> None``, once, at the response headers (or at the stream's
            end when no response phase came).
        on_refused: counts a refusal the exchange decides itself (413).
        max_body_bytes: a request body over this is refused 413.

    After :attr:`done` the stream needs nothing more (an immediate response or the response's end was
    answered); :attr:`routed` is the decision once made. While :attr:`waiting` is set the request waits in
    the fair queue: the answers the decision gives come from :meth:`resume`, and the stream reads nothing
    meanwhile (Envoy sends nothing more on the request path before them, and anything it does send waits in
    gRPC's flow control).
    """

    __slots__ = (
        "_body",
        "_body_size",
        "_decide",
        "_headers",
        "_on_refused",
        "_on_served",
        "_pending_answer",
        "_request_body_mode",
        "_response_body_mode",
        "_subset",
        "_trailers_seen",
        "done",
        "max_body_bytes",
        "routed",
        "served_reported",
        "waiting",
    )

    def __init__(
        self,
        decide: Callable[[RequestSeen], Routed | Refused | Waiting],
        *,
        on_served: Callable[[Routed, str | None], None],
        on_refused: Callable[[Refused], None],
        max_body_bytes: int,
    ) -> None:
        self._decide = decide
        self._on_served = on_served
        self._on_refused = on_refused
        self.max_body_bytes = max_body_bytes
        self._headers: dict[str, str] | None = None
        self._body: list[bytes] = []
        self._body_size = 0
        self._subset: tuple[str, ...] | None = None
        self._trailers_seen = False
        # the EPP protocol's mode until the stream's protocol_config says otherwise
        self._request_body_mode: int = _Mode.FULL_DUPLEX_STREAMED
        self._response_body_mode: int = _Mode.FULL_DUPLEX_STREAMED
        self.routed: Routed | None = None
        self.served_reported = False
        self.done = False
        self.waiting: Waiting | None = None
        self._pending_answer: Callable[[Routed | Refused], list[ep.ProcessingResponse]] | None = None

    def on_message(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """The answers to send for ``req``, in order (possibly none yet)."""
        if req.HasField("protocol_config"):
            self._request_body_mode = req.protocol_config.request_body_mode
            self._response_body_mode = req.protocol_config.response_body_mode
        hint = subset_hint(req)
        if hint is not None:
            self._subset = hint
        phase = req.WhichOneof("request")
        if phase == "request_headers":
            return self._on_request_headers(req.request_headers)
        if phase == "request_body":
            return self._on_request_body(req.request_body)
        if phase == "request_trailers":
            return self._on_request_trailers()
        if phase == "response_headers":
            self._report_served(served_endpoint(req))
            if req.response_headers.end_of_stream:
                self.done = True
            return [_RESPONSE_HEADERS_CONTINUE]
        if phase == "response_body":
            if not self.served_reported:
                self._report_served(served_endpoint(req))
            msg = req.response_body
            if msg.end_of_stream:
                self.done = True
            if self._response_body_mode == _Mode.FULL_DUPLEX_STREAMED:
                return streamed_body("response_body", msg.body, end_of_stream=msg.end_of_stream)
            return [_RESPONSE_BODY_CONTINUE]
        if phase == "response_trailers":
            if not self.served_reported:
                self._report_served(served_endpoint(req))
            self.done = True
            return [_RESPONSE_TRAILERS_CONTINUE]
        return []

    def _report_served(self, served: str | None) -> None:
        if self.routed is not None and not self.served_reported:
            self.served_reported = True
            self._on_served(self.routed, served)

    def _buffered_mode(self) -> bool:
        return self._request_body_mode in (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL)

    def _on_request_headers(self, msg: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        self._headers = {hv.key.lower(): _header_value(hv) for hv in msg.headers.headers}
        if msg.end_of_stream or self._request_body_mode in (_Mode.NONE, _Mode.STREAMED):
            # no body before the headers answer: decide on the headers alone
            return self._decided(self._decision(body_read=msg.end_of_stream), self._headers_answer)
        if self._buffered_mode():
            # Envoy waits for this answer before it sends the body; the decision rides on the body answer
            return [_REQUEST_HEADERS_CONTINUE]
        return []

    def _on_request_body(self, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self.routed is not None or self._headers is None:
            # a body after the decision, or without headers (a misconfigured processing mode): pass it on
            return self._passthrough_body(msg)
        self._body_size += len(msg.body)
        if self._body_size > self.max_body_bytes:
            reply = body_too_large(self.max_body_bytes)
            self._on_refused(reply)
            return self._refusal(reply)
        self._body.append(msg.body)
        if not msg.end_of_stream:
            if self._buffered_mode():
                return [_REQUEST_BODY_CONTINUE]  # BUFFERED_PARTIAL: more is coming
            return []
        return self._complete(trailers=False)

    def _passthrough_body(self, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self._request_body_mode == _Mode.FULL_DUPLEX_STREAMED:
            return streamed_body("request_body", msg.body, end_of_stream=msg.end_of_stream)
        return [_REQUEST_BODY_CONTINUE]

    def _on_request_trailers(self) -> list[ep.ProcessingResponse]:
        self._trailers_seen = True
        if self.routed is not None or self._headers is None:
            return [_REQUEST_TRAILERS_CONTINUE]
        # the request had trailers: its body ended with them
        return self._complete(trailers=True)

    def _headers_answer(self, decision: Routed | Refused) -> list[ep.ProcessingResponse]:
        if isinstance(decision, Refused):
            return self._refusal(decision)
        return [
            ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=routed_common(decision)),
                dynamic_metadata=destination_metadata(decision.value),
            )
        ]

    def _complete(self, *, trailers: bool) -> list[ep.ProcessingResponse]:
        return self._decided(self._decision(), lambda d: self._body_answer(d, trailers=trailers))

    def _decided(
        self,
        decision: Routed | Refused | Waiting,
        answer: Callable[[Routed | Refused], list[ep.ProcessingResponse]],
    ) -> list[ep.ProcessingResponse]:
        if isinstance(decision, Waiting):
            self.waiting = decision
            self._pending_answer = answer
            return []
        return answer(decision)

    def resume(self, decision: Routed | Refused) -> list[ep.ProcessingResponse]:
        """The answers held back while the request waited, now that ``decision`` is made (its admission or
        its refusal).

        Raises:
            RuntimeError: the request was not waiting.
        """
        answer = self._pending_answer
        if self.waiting is None or answer is None:
            raise RuntimeError("resume() without a waiting request")
        self.waiting = None
        self._pending_answer = None
        if isinstance(decision, Routed):
            self.routed = decision
        return answer(decision)

    def _body_answer(self, decision: Routed | Refused, *, trailers: bool) -> list[ep.ProcessingResponse]:
        if isinstance(decision, Refused):
            return self._refusal(decision)
        body = b"".join(self._body)
        self._body = []
        metadata = destination_metadata(decision.value)
        if self._buffered_mode():
            out = [
                ep.ProcessingResponse(
                    request_body=ep.BodyResponse(response=routed_common(decision)), dynamic_metadata=metadata
                )
            ]
        else:
            out = [
                ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(response=routed_common(decision)),
                    dynamic_metadata=metadata,
                ),
                *streamed_body("request_body", body, end_of_stream=not trailers),
            ]
        if trailers:
            out.append(_REQUEST_TRAILERS_CONTINUE)
        return out

    def _decision(self, *, body_read: bool = True) -> Routed | Refused | Waiting:
        headers = self._headers or {}
        path = headers.get(":path", "").partition("?")[0]
        seen = RequestSeen(
            method=headers.get(":method", ""),
            path=path,
            body=b"".join(self._body),
            subset=self._subset,
            body_read=body_read,
            fairness_id=headers.get(FAIRNESS_ID_HEADER),
            objective=headers.get(OBJECTIVE_HEADER),
            priority=headers.get(PRIORITY_HEADER),
        )
        decision = self._decide(seen)
        if isinstance(decision, Routed):
            self.routed = decision
        return decision

    def _refusal(self, reply: Refused) -> list[ep.ProcessingResponse]:
        self.done = True
        self._body = []
        return [immediate_response(reply)]
