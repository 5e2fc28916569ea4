"""HTTP header names shared by ext_proc (which sets them), the xDS routes (which match on them, and add the
served-by response headers) and the simulated GPU servers.

Every ``x-inferlb-*`` header a client sends is removed by ext_proc before routing, so only ext_proc can
set them.
"""

from typing import Final

PREFIX: Final = "x-inferlb-"
#: Canonical model name chosen by ext_proc (aliases resolved); routes match on it.
MODEL: Final = "x-inferlb-model"
#: Model version chosen by ext_proc (canary split); routes match on it with MODEL.
VERSION: Final = "x-inferlb-version"
#: Tenant name resolved from the API key.
TENANT: Final = "x-inferlb-tenant"
#: Tenant priority (``high``/``default``/``low``); ``high`` routes with Envoy priority HIGH (``low`` may be
#: refused by ext_proc first, under saturation).
PRIORITY: Final = "x-inferlb-priority"
#: Prompt tokens counted by ext_proc.
PROMPT_TOKENS: Final = "x-inferlb-prompt-tokens"
#: Session affinity key (a digest of the session header or the ``user`` field,
#: :mod:`inferlb.policy.affinity`); ring_hash/maglev routes hash on it when there is no prefix key.
SESSION_KEY: Final = "x-inferlb-session"
#: Conversation-prefix affinity key (a digest of the conversation's opening, :mod:`inferlb.policy.affinity`);
#: ring_hash/maglev routes hash on it first.
PREFIX_KEY: Final = "x-inferlb-prefix"
#: Length class of a request to a length-aware model (``long``/``short``, :mod:`inferlb.policy.length_aware`):
#: a ``long`` request's route balances it among the model's fast GPUs only.
LENGTH_CLASS: Final = "x-inferlb-length-class"
#: ``true`` on a streamed request (``"stream": true``): its route bounds each attempt by the silence before
#: the first byte and between chunks (``gateway.stream_idle_timeout_ms``) instead of by the whole answer.
STREAM: Final = "x-inferlb-stream"
#: Set by the ext_authz service on a request whose body the gateway rewrites (an alias renamed): the
#: byte splices the Envoy Lua filter after ext_authz applies, then removes
#: (:func:`inferlb.request.rewrite.encode_splices` gives the format).
BODY_SPLICE: Final = "x-inferlb-body-splice"
#: On an ext_authz refusal with a 5xx status: that status. Envoy turns a 5xx from the HTTP authorization
#: service into ``status_on_error`` with an empty body, so the service refuses with 403 and this header,
#: which Envoy keeps as dynamic metadata (``dynamic_metadata_from_headers``; not sent to the client), and
#: the gateway's local-reply mapper gives the reply back its status (the OpenAI JSON body stays).
STATUS: Final = "x-inferlb-status"
#: Response header the gateway (Envoy, from the upstream host's EDS metadata) sets on every answer a model
#: server gave: the name of the endpoint that served it (``endpoints[].name``, else its address). Any
#: value the model server sent is replaced (gpusim sends the same name itself).
ENDPOINT: Final = "x-inferlb-endpoint"
#: Response header the gateway sets beside :data:`ENDPOINT`: the model version of the endpoint that served.
MODEL_VERSION: Final = "x-inferlb-model-version"
#: Response header the gateway sets beside :data:`ENDPOINT`: the ``ip:port`` Envoy sent the request to
#: (Envoy's ``%UPSTREAM_HOST%``).
UPSTREAM_HOST: Final = "x-inferlb-upstream-host"
#: The request body's ``model``, read by Envoy itself (transform filter) only on a path whose request failed
#: open (ext_proc did not answer): the fail-open routes match on it. Never set by ext_proc; a client's own
#: is removed before routing like every other routing header.
BODY_MODEL: Final = "x-inferlb-body-model"
#: The ext_authz answer's meter id of an admitted request (``ext_proc.protocol: ext_authz`` with
#: ``account_responses``): Envoy turns it into dynamic metadata (``dynamic_metadata_from_headers``, never sent
#: upstream) that its access-log entry brings back to the settler (:mod:`inferlb.policy.settlement`).
METER: Final = "x-inferlb-meter"
#: Set to ``1`` by the ext_authz service on a stream it asked for usage (``stream_options.include_usage``
#: added, the client did not ask): Envoy turns it into dynamic metadata (``dynamic_metadata_from_headers``,
#: never sent upstream) and its Lua filter removes the usage chunk and the ``"usage": null`` members from
#: what the client gets (:data:`xds_server.resources.listener.METER_LUA`).
USAGE_ADDED: Final = "x-inferlb-usage-added"
#: The endpoint-picker protocol's header (Gateway API Inference Extension, proposal 004): the hosts the
#: request path picked, ``ip:port[,ip:port...]``, first choice first. Envoy's ``override_host``
#: load-balancing policy of a picking model's clusters reads it (and the same value in dynamic metadata
#: :data:`DESTINATION_ENDPOINT_NAMESPACE`). A client's own is removed before any filter runs.
DESTINATION_ENDPOINT: Final = "x-gateway-destination-endpoint"
#: The dynamic-metadata namespace of the picked hosts (key :data:`DESTINATION_ENDPOINT`), as the EPP
#: protocol sets it (ext_proc mode; Envoy's ext_authz filter can write only its own namespace).
DESTINATION_ENDPOINT_NAMESPACE: Final = "envoy.lb"
