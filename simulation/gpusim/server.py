"""The simulated GPU model server: one aiohttp application per endpoint, OpenAI-compatible, timed by
:mod:`simulation.gpusim.engine` in real time.

Routes (what vLLM's OpenAI server answers, in its shapes):

* ``POST /v1/chat/completions``, ``POST /v1/completions``: streamed (SSE) or not; exactly ``max_tokens``
  (``max_completion_tokens``, else the model's ``default_max_tokens``) tokens per choice, ``n`` choices per
  prompt, as vLLM with ``ignore_eos`` (or, with the simulation's ``x-gpusim-eos-after: N`` request header,
  at most ``N``: the answer's own length under a larger cap, :data:`EOS_AFTER_HEADER`). Time to first
  token = queueing + prefill; then one token per engine step. Errors are OpenAI JSON: 400 malformed body,
  404 unknown model (vLLM also answers 404), 503 with ``retry-after`` when the queue is full.
* ``POST /v1/responses`` (the Responses API): the same generation (``max_output_tokens``, else the model's
  ``default_max_tokens``; one output message), as a ``response`` object with ``usage.input_tokens`` /
  ``output_tokens``, or streamed as typed events ending in ``response.incomplete``
  (:class:`simulation.gpusim.replies.ResponseBuilder`). Timed and counted like chat.
* ``POST /v1/embeddings``: one pseudo-embedding per input (:func:`simulation.gpusim.replies.pseudo_embedding`,
  :data:`~simulation.gpusim.replies.EMBEDDING_DIMENSIONS` long unless the request sets ``dimensions``), as
  floats or base64. Timed as a prefill with zero completion tokens through the same engine (the inputs of one
  request are prefilled together in one batch slot), so it queues behind and slows down generation like vLLM's
  pooling requests, and shows in the same metrics (``finished_reason="stop"``, as vLLM finishes them).

Bodies are parsed with :func:`inferlb.request.parsing.parse_request` and prompts counted with
:func:`inferlb.request.tokens.count_prompt_tokens`, as the gateway does, so ``usage.prompt_tokens`` is the
count the gateway reserved.
* ``GET /v1/models``, ``GET /health`` (``{"status": "ok"}``), ``GET /metrics`` (vLLM names, see
  :mod:`simulation.gpusim.vllm_metrics`).
* The simulation's control API (:mod:`simulation.gpusim.faults`): ``POST /sim/fault`` with ``{"action":
  "throttle" | "slow" | "fail" | "recover" | "mute" | "unmute", "factor": 2.0}`` answers the new fault state;
  ``GET /sim/fault`` the current one; ``GET /sim/telemetry`` the GPU's NVML-like telemetry
  (:class:`inferlb.policy.telemetry.GpuTelemetry` JSON); while muted, it and ``/metrics`` answer 503.
  ``GET /sim/requests``: the method, path and headers of the last :data:`RECORDED_REQUESTS` inference
  requests it received (``{"requests": [{"method", "path", "headers"}]}``, newest last), so tests can see
  what the gateway sends a model server.
  A failed endpoint answers 503 to ``/health`` and to every inference request; a hung one never answers
  them (it reads each request, then holds it; streams in flight stop before their next chunk) until
  ``recover``; ``/metrics`` and ``/sim/*`` keep answering.

Every response, errors included, carries ``x-inferlb-endpoint: <display name>`` and ``x-inferlb-gpu: <GPU
type>``. A client that disconnects (the handler is cancelled: ``handler_cancellation=True``) frees its batch
slots at the next step boundary.

The engine runs on the event loop's monotonic clock (``loop.time()``): a single driver task per endpoint
advances it at each step boundary and wakes the requests in flight.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from inferlb.config.schema import Config, EndpointConfig, ModelConfig
from inferlb.errors import RequestError
from inferlb.policy.telemetry import GpuTelemetry
from inferlb.request import headers
from inferlb.request.parsing import EndpointKind, InferenceRequest, parse_request
from inferlb.request.prompt_ids import prompt_token_ids
from inferlb.request.tokens import count_each_prompt, count_prompt_tokens, default_counter
from simulation.gpusim import replies
from simulation.gpusim.engine import (
    BatchEngine,
    EngineEvent,
    EngineStats,
    FirstTokenEmitted,
    Refused,
    SequenceFinished,
    SequenceScheduled,
    TimingModel,
)
from simulation.gpusim.faults import (
    FaultCommand,
    FaultState,
    parse_fault_command,
    simulated_gpu_telemetry,
    utilization_percent,
)
from simulation.gpusim.kv_events import KvEventPublisher, KvEventsConfig
from simulation.gpusim.replies import (
    EMBEDDING_DIMENSIONS,
    MAX_EMBEDDING_DIMENSIONS,
    bad_request,
    choice_count,
)
from simulation.gpusim.vllm_metrics import CONTENT_TYPE, CacheConfigInfo, EndpointMetrics
from simulation.kvcache import PrefixCache, PromptBlocks, block_hashes

log = logging.getLogger("gpusim")


async def _cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (when there is one) and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


#: Response header naming the GPU type of the endpoint that served a request.
GPU_HEADER: Final = "x-inferlb-gpu"
#: Request header of the simulation (never a model server's): the simulated model emits its end of
#: sequence after this many tokens per choice, so the answer is ``min(cap, this)`` tokens long; without
#: it every answer fills its cap (vLLM with ``ignore_eos``). Lets tests send clients' uninformative caps
#: with answers of their own length, as real traffic has. ``finish_reason`` stays "length" either way
#: (the simulation does not tell an end of sequence from the cap).
EOS_AFTER_HEADER: Final = "x-gpusim-eos-after"
#: How many inference requests' headers ``GET /sim/requests`` keeps (the newest).
RECORDED_REQUESTS: Final = 64
#: Seconds aiohttp waits for handlers at shutdown (requests in flight are told to stop first).
SHUTDOWN_TIMEOUT_S = 2.0
#: Utilization readings closer together than this reuse the last value (a shorter window is all noise).
MIN_UTILIZATION_WINDOW_S = 0.2

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, kw_only=True)
class _Admission:
    """What a checked request asks of the engine: prompt tokens, tokens per choice, batch slots."""

    prompt_tokens: int
    tokens_per_choice: int
    width: int


def _eos_after(admission: _Admission, value: str | None) -> _Admission:
    """``admission`` with its tokens per choice cut to :data:`EOS_AFTER_HEADER`'s value when that is
    smaller (unchanged without the header, and for embeddings, which generate nothing).

    Raises:
        RequestError: 400 for a value that is not an integer >= 1.
    """
    if value is None or admission.tokens_per_choice == 0:
        return admission
    try:
        eos = int(value)
    except ValueError:
        eos = 0
    if eos < 1:
        raise bad_request(f"'{EOS_AFTER_HEADER}' must be an integer >= 1, got {value!r}", param=None)
    return dataclasses.replace(admission, tokens_per_choice=min(admission.tokens_per_choice, eos))


@dataclass(eq=False, kw_only=True)
class _Flight:
    """A request in the engine, seen from its HTTP handler. Times are engine (loop) seconds."""

    request_id: str
    arrived_at: float
    progressed: asyncio.Event = field(default_factory=asyncio.Event)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens_per_choice: int = 0
    stopped: bool = False


class SimulatedEndpoint:
    """One simulated GPU model server for one :class:`EndpointConfig`.

    Args:
        config: the whole config (the endpoint's model, GPU profile and ``simulation`` timing come from it).
        endpoint: the endpoint to simulate; its ``address`` is where :meth:`start` listens by default.
        timing: overrides the timing derived with :meth:`TimingModel.for_endpoint` (tests, benchmarks).
        kv_events: where to publish the prefix cache's KV events (vLLM's ``--kv-events-config``;
            :mod:`simulation.gpusim.kv_events`); None or a config that does not publish: nowhere.

    Raises:
        ValueError: ``endpoint.model`` is not a model of ``config``, or KV events are asked for with
            ``simulation.prefix_caching`` off.
    """

    def __init__(
        self,
        *,
        config: Config,
        endpoint: EndpointConfig,
        timing: TimingModel | None = None,
        kv_events: KvEventsConfig | None = None,
    ) -> None:
        model = next((m for m in config.models if m.name == endpoint.model), None)
        if model is None:
            raise ValueError(f"endpoint {endpoint.display_name}: unknown model {endpoint.model!r}")
        self.endpoint = endpoint
        self.model: ModelConfig = model
        self.timing = timing or TimingModel.for_endpoint(config, endpoint)
        sim = config.simulation
        self.kv_events = kv_events if kv_events is not None and kv_events.publishes else None
        if self.kv_events is not None and not sim.prefix_caching:
            raise ValueError("--kv-events-config needs simulation.prefix_caching (it is false)")
        cache = (
            PrefixCache(
                num_blocks=max(1, self.timing.kv_budget_tokens // sim.block_size),
                block_size=sim.block_size,
                record_events=self.kv_events is not None,
            )
            if sim.prefix_caching
            else None
        )
        self._publisher: KvEventPublisher | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.engine = BatchEngine(model=self.timing, prefix_cache=cache)
        self.memory_gb = config.gpu_profiles[endpoint.gpu].memory_gb
        self.fault = FaultState()
        #: set while the endpoint answers; cleared by the ``hang`` fault, set again by any other mode and
        #: by :meth:`stop` (so no handler outlives the server)
        self._answering = asyncio.Event()
        self._answering.set()
        self._util_sample: tuple[float, float] | None = None  # (engine time, busy seconds)
        self._util_percent = 0.0
        self.metrics = EndpointMetrics(
            model_name=model.name,
            stats=self._stats_now,
            cache_config=CacheConfigInfo(
                block_size=sim.block_size,
                num_gpu_blocks=self.timing.kv_budget_tokens // sim.block_size,
                enable_prefix_caching=sim.prefix_caching,
            ),
        )
        self._served_names = (model.name, *model.aliases)
        self._flights: dict[str, _Flight] = {}
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._client_max_size = max(config.gateway.max_request_body_bytes, 1024 * 1024)
        #: the request line and headers of the last :data:`RECORDED_REQUESTS` inference requests, newest
        #: last (``GET /sim/requests``)
        self.recorded: collections.deque[dict[str, object]] = collections.deque(maxlen=RECORDED_REQUESTS)
        self.app = self._build_app()

    @property
    def display_name(self) -> str:
        """The name in the ``x-inferlb-endpoint`` header."""
        return self.endpoint.display_name

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self, *, host: str | None = None, port: int | None = None) -> tuple[str, int]:
        """Listen on ``host:port`` (default: the endpoint's address; port 0 picks a free one) and start the
        engine driver. Returns the bound ``(host, port)``.

        Raises:
            OSError: the address cannot be bound.
            RuntimeError: already started.
        """
        if self._runner is not None:
            raise RuntimeError(f"endpoint {self.display_name} is already started")
        default_counter().count("warm up")  # load the encoding now, not on the first request
        if self.kv_events is not None:
            self._publisher = KvEventPublisher(self.kv_events)
            self._replay_task = asyncio.create_task(
                self._publisher.serve_replay(), name=f"gpusim-kv-replay-{self.display_name}"
            )
        self._wake = asyncio.Event()
        self._driver = asyncio.create_task(self._drive(), name=f"gpusim-driver-{self.display_name}")
        self._util_sample = (self._now(), self.engine.stats().busy_seconds_total)
        runner = web.AppRunner(
            self.app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, access_log=None
        )
        await runner.setup()
        bind_host = host if host is not None else self.endpoint.address.host
        bind_port = port if port is not None else self.endpoint.address.port
        site = web.TCPSite(runner, bind_host, bind_port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            await self._stop_driver()
            await self._close_publisher()
            raise
        self._runner = runner
        bound = runner.addresses[0]
        return str(bound[0]), int(bound[1])

    async def stop(self) -> None:
        """Stop listening, end the requests in flight (non-streamed ones get 503, streams are cut), stop the
        driver. Safe to call twice."""
        for flight in self._flights.values():
            flight.stopped = True
            flight.progressed.set()
        self._answering.set()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self._stop_driver()
        await self._close_publisher()

    async def _close_publisher(self) -> None:
        task, self._replay_task = self._replay_task, None
        await _cancel(task)
        if self._publisher is not None:
            publisher, self._publisher = self._publisher, None
            publisher.close()

    async def _stop_driver(self) -> None:
        driver, self._driver = self._driver, None
        await _cancel(driver)

    def set_slowdown(self, factor: float) -> None:
        """Make this GPU ``factor`` times slower from its next step on (1.0 = normal). For throttling.

        Raises:
            ValueError: ``factor`` not a finite number > 0.
        """
        self.engine.set_slowdown(self._now(), factor)
        self._pump()

    def apply_fault(self, command: FaultCommand) -> FaultState:
        """Put the GPU in the fault ``command`` leads to (replacing any other); returns the new state.

        Throttle and slow change the engine's slowdown from its next step on; fail makes ``/health`` and new
        inference requests answer 503 (requests in flight finish); hang holds ``/health``, new requests and
        the next chunk of every stream (the engine runs on); recover undoes all and releases what was held.
        """
        state = command.apply(self.fault)
        self.set_slowdown(state.slowdown)
        self.fault = state
        if state.mode == "hung":
            self._answering.clear()
        else:
            self._answering.set()
        log.info("%s: fault %s (factor %g)", self.display_name, state.mode, state.factor)
        return state

    def gpu_telemetry(self) -> GpuTelemetry:
        """The GPU's NVML-like telemetry now (:func:`simulation.gpusim.faults.simulated_gpu_telemetry`).
        Utilization covers the time since the previous reading, at least :data:`MIN_UTILIZATION_WINDOW_S`."""
        stats = self._stats_now()
        now = self.engine.clock
        if self._util_sample is None:
            self._util_sample = (0.0, 0.0)
        at, busy = self._util_sample
        if now - at >= MIN_UTILIZATION_WINDOW_S:
            self._util_percent = utilization_percent(busy, at, stats.busy_seconds_total, now)
            self._util_sample = (now, stats.busy_seconds_total)
        return simulated_gpu_telemetry(
            name=self.display_name,
            gpu_type=self.endpoint.gpu,
            memory_gb=self.memory_gb,
            kv_budget_tokens=self.timing.kv_budget_tokens,
            stats=stats,
            utilization=self._util_percent,
            fault=self.fault,
        )

    # -- the engine driver ----------------------------------------------------------------------------------

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _stats_now(self) -> EngineStats:
        self._pump()
        return self.engine.stats()

    def _pump(self) -> None:
        """Advance the engine to now and hand its events to the requests in flight."""
        events = self.engine.advance(self._now())
        self._dispatch(events)
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Send the prefix cache's KV events since the last batch (with KV events on)."""
        cache = self.engine.prefix_cache
        if self._publisher is not None and cache is not None:
            self._publisher.publish(cache.take_events())

    def _dispatch(self, events: list[EngineEvent]) -> None:
        for ev in events:
            flight = self._flights.get(ev.request_id)
            if flight is None:
                continue
            if isinstance(ev, SequenceScheduled):
                flight.scheduled_at = ev.at
            elif isinstance(ev, FirstTokenEmitted):
                flight.first_token_at = ev.at
            elif isinstance(ev, SequenceFinished):
                flight.finished_at = ev.at
                flight.tokens_per_choice = ev.completion_tokens
        # Every running request may have a new token after a step: wake them all (a stream reads its count).
        for flight in self._flights.values():
            flight.progressed.set()

    async def _drive(self) -> None:
        """Advance the engine at each step boundary (token time) or when a request arrives or leaves."""
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while True:
            self._pump()
            due = self.engine.next_step_end()
            wake.clear()
            if due is None:
                await wake.wait()
                continue
            timer = loop.call_at(due, wake.set)
            try:
                await wake.wait()
            finally:
                timer.cancel()

    def _kick(self) -> None:
        self._pump()
        if self._wake is not None:
            self._wake.set()

    # -- HTTP -----------------------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_as_json], client_max_size=self._client_max_size)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_model_info", self._get_model_info)
        app.router.add_get("/get_server_info", self._get_server_info)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/sim/fault", self._post_fault)
        app.router.add_get("/sim/fault", self._get_fault)
        app.router.add_get("/sim/telemetry", self._get_telemetry)
        app.router.add_get("/sim/requests", self._get_requests)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.on_response_prepare.append(self._stamp_headers)
        return app

    async def _stamp_headers(self, _request: web.Request, response: web.StreamResponse) -> None:
        response.headers[headers.ENDPOINT] = self.display_name
        response.headers[GPU_HEADER] = self.endpoint.gpu

    @web.middleware
    async def _errors_as_json(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """aiohttp's own errors (unknown route 404, 405, 413) as OpenAI JSON errors."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err = RequestError(
                exc.status,
                exc.reason if exc.text is None else exc.text,
                type="invalid_request_error" if exc.status < 500 else "server_error",
            )
            return _error_response(err, extra_headers=dict(exc.headers))

    async def _hold_while_hung(self) -> None:
        """Return at once unless the endpoint is hung; then only when it recovers (or stops). A client that
        gives up meanwhile cancels the handler (``handler_cancellation``) and frees its batch slots."""
        await self._answering.wait()

    async def _health(self, _request: web.Request) -> web.Response:
        await self._hold_while_hung()
        if self.fault.mode == "failed":
            return _error_response(self._failed_error())
        return web.json_response({"status": "ok"})

    def _failed_error(self) -> RequestError:
        return RequestError(
            503, f"The GPU of {self.display_name} has failed (simulated).", type="server_error",
            code="gpu_failed",
        )  # fmt: skip

    async def _post_fault(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read() or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _error_response(
                RequestError(400, f"body is not JSON: {exc}", type="invalid_request_error")
            )
        try:
            command = parse_fault_command(body)
        except RequestError as exc:
            return _error_response(exc)
        return web.json_response(self.apply_fault(command).to_json())

    async def _reset_prefix_cache(self, _request: web.Request) -> web.Response:
        """vLLM's ``POST /reset_prefix_cache``: drop every cached block, unless requests hold blocks.
        Answers ``{"cleared": bool}`` (409 when blocks are in use, 404 without a prefix cache)."""
        self._pump()
        cache = self.engine.prefix_cache
        if cache is None:
            return _error_response(
                RequestError(404, "This server has no prefix cache.", type="invalid_request_error")
            )
        cleared = cache.clear()
        self._publish_kv_events()
        return web.json_response({"cleared": cleared}, status=200 if cleared else 409)

    async def _get_requests(self, _request: web.Request) -> web.Response:
        return web.json_response({"requests": list(self.recorded)})

    async def _get_fault(self, _request: web.Request) -> web.Response:
        return web.json_response(self.fault.to_json())

    def _muted_error(self) -> RequestError:
        return RequestError(
            503, f"The telemetry of {self.display_name} is muted (simulated).", type="server_error",
            code="telemetry_muted",
        )  # fmt: skip

    async def _get_telemetry(self, _request: web.Request) -> web.Response:
        if self.fault.telemetry_muted:
            return _error_response(self._muted_error())
        return web.json_response(self.gpu_telemetry().to_json())

    async def _models(self, _request: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "inferlb-gpusim",
                "root": self.model.name,
                "parent": None,
                "max_model_len": self.model.context_length,
            }
            for name in self._served_names
        ]
        return web.json_response({"object": "list", "data": data})

    async def _get_model_info(self, _request: web.Request) -> web.Response:
        """SGLang's ``GET /get_model_info`` (what sglang-router asks a worker it adds): the served model as
        ``model_path`` and ``tokenizer_path``, a generation model."""
        return web.json_response(
            {"model_path": self.model.name, "tokenizer_path": self.model.name, "is_generation": True}
        )

    async def _get_server_info(self, _request: web.Request) -> web.Response:
        """SGLang's ``GET /get_server_info``, the fields a router reads: the served model, the KV cache's
        capacity (``max_total_num_tokens``, tokens) and the batch limit (``max_running_requests``)."""
        return web.json_response(
            {
                "model_path": self.model.name,
                "served_model_name": self.model.name,
                "max_total_num_tokens": self.timing.kv_budget_tokens,
                "max_running_requests": self.timing.max_batch,
                "version": "inferlb-gpusim",
            }
        )

    async def _metrics(self, _request: web.Request) -> web.Response:
        if self.fault.telemetry_muted:
            return _error_response(self._muted_error())
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, EndpointKind.CHAT_COMPLETIONS)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, EndpointKind.COMPLETIONS)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, EndpointKind.RESPONSES)

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, EndpointKind.EMBEDDINGS)

    def _admit(self, req: InferenceRequest) -> _Admission:
        """Check a parsed request against the endpoint and size it for the engine.

        Prompt tokens are :func:`inferlb.request.tokens.count_prompt_tokens`, the gateway's count. Each prompt
        (or embedding input) must fit the context with the completion, as vLLM checks each sequence.

        Raises:
            RequestError: 404 for a model this endpoint does not serve; 400 for ``max_tokens`` 0 (vLLM needs
                at least 1), a context overflow, more choices than batch slots, or ``dimensions`` above
                :data:`~simulation.gpusim.replies.MAX_EMBEDDING_DIMENSIONS`.
        """
        if req.model not in self._served_names:
            raise RequestError(
                404,
                f"The model `{req.model}` does not exist.",
                type="invalid_request_error",
                code="model_not_found",
                param="model",
            )
        prompt_tokens = count_prompt_tokens(req)
        if req.kind is EndpointKind.EMBEDDINGS:
            if req.dimensions is not None and req.dimensions > MAX_EMBEDDING_DIMENSIONS:
                raise bad_request(
                    f"'dimensions' must be at most {MAX_EMBEDDING_DIMENSIONS}, got {req.dimensions}",
                    param="dimensions",
                )
            self._check_context(max(count_each_prompt(req)), 0, param="input")
            return _Admission(prompt_tokens=prompt_tokens, tokens_per_choice=0, width=1)
        tokens = req.max_output_tokens
        if tokens is None:
            tokens = self.model.default_max_tokens
        cap_param = "max_output_tokens" if req.kind is EndpointKind.RESPONSES else "max_tokens"
        if tokens < 1:
            raise bad_request(f"'{cap_param}' must be at least 1, got {tokens}", param=cap_param)
        if req.kind is EndpointKind.CHAT_COMPLETIONS:
            self._check_context(prompt_tokens, tokens, param="messages")
        elif req.kind is EndpointKind.RESPONSES:
            self._check_context(prompt_tokens, tokens, param="input")
        else:
            self._check_context(max(count_each_prompt(req)), tokens, param="prompt")
        width = choice_count(req)
        if width > self.timing.max_batch:
            raise bad_request(
                f"'n' ({req.n}) x {req.prompt_count} prompt(s) = {width} choices exceeds this server's batch "
                f"size ({self.timing.max_batch})",
                param="n",
            )
        return _Admission(prompt_tokens=prompt_tokens, tokens_per_choice=tokens, width=width)

    def _prompt_blocks(self, req: InferenceRequest, prompt_tokens: int) -> tuple[PromptBlocks, ...] | None:
        """The request's prompts as the prefix cache sees them (:mod:`inferlb.request.prompt_ids`), or None
        without a prefix cache. Should the ids ever disagree with the count the request was sized by, it is
        logged and the request looked up as one prompt of unknown blocks (it hits nothing)."""
        cache = self.engine.prefix_cache
        if cache is None:
            return None
        ids = prompt_token_ids(req)
        if sum(len(i) for i in ids) != prompt_tokens:
            log.warning(
                "%s: %d prompt token ids for %d counted tokens; prefix cache lookup skipped",
                self.display_name, sum(len(i) for i in ids), prompt_tokens,
            )  # fmt: skip
            return None
        keep_ids = cache.record_events  # BlockStored events carry the tokens
        return tuple(
            PromptBlocks(
                tokens=len(i),
                hashes=block_hashes(i, block_size=cache.block_size),
                token_ids=i if keep_ids else (),
            )
            for i in ids
        )

    def _check_context(self, prompt_tokens: int, completion_tokens: int, *, param: str) -> None:
        """400 ``context_length_exceeded`` when one sequence outgrows the model's context (vLLM's message)."""
        if prompt_tokens + completion_tokens > self.model.context_length:
            raise bad_request(
                f"This model's maximum context length is {self.model.context_length} tokens. However, you "
                f"requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, "
                f"{completion_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                param=param,
                code="context_length_exceeded",
            )

    async def _serve(self, request: web.Request, kind: EndpointKind) -> web.StreamResponse:
        self.metrics.request_received()
        self.recorded.append(
            {
                "method": request.method,
                "path": request.path_qs,
                # every header as received, lower-cased, repeated ones joined as HTTP does
                "headers": {k.lower(): ", ".join(request.headers.getall(k)) for k in request.headers},
            }
        )
        if self.fault.mode == "failed":
            self.metrics.request_refused("gpu_failed")
            return _error_response(self._failed_error())
        body = await request.read()
        await self._hold_while_hung()
        try:
            req = parse_request(kind, body)
            admission = self._admit(req)
            admission = _eos_after(admission, request.headers.get(EOS_AFTER_HEADER))
        except RequestError as exc:
            self.metrics.request_refused("model_not_found" if exc.status == 404 else "bad_request")
            return _error_response(exc)
        request_id = uuid.uuid4().hex
        outcome = self.engine.submit(
            self._now(),
            request_id=request_id,
            prompt_tokens=admission.prompt_tokens,
            completion_tokens=admission.tokens_per_choice,
            width=admission.width,
            prompts=self._prompt_blocks(req, admission.prompt_tokens),
        )
        if isinstance(outcome, Refused) and outcome.reason == "exceeds_kv_cache":
            self.metrics.request_refused("bad_request")
            return _error_response(
                bad_request(
                    f"This request needs more KV cache than the server has ({self.engine.pool.num_blocks} "
                    f"blocks of {self.engine.pool.block_size} tokens): {admission.prompt_tokens} prompt "
                    f"tokens and {admission.tokens_per_choice} completion tokens x {admission.width}.",
                    param="max_tokens",
                )
            )
        if isinstance(outcome, Refused):
            self.metrics.request_refused("queue_full")
            retry_after = max(1, math.ceil(outcome.retry_after_s))
            return _error_response(
                RequestError(
                    503,
                    f"The server is overloaded: {self.timing.max_batch} running and {self.timing.max_queue} "
                    "queued requests at most. Retry later.",
                    type="server_error",
                    code="overloaded",
                    retry_after_s=retry_after,
                )
            )
        flight = _Flight(request_id=request_id, arrived_at=self.engine.clock)
        self._flights[request_id] = flight
        self._kick()
        log.debug(
            "%s: %s request %s admitted (%d prompt, %d x %d tokens)",
            self.display_name,
            kind,
            request_id,
            admission.prompt_tokens,
            admission.width,
            admission.tokens_per_choice,
        )
        try:
            if req.stream:
                return await self._respond_streamed(request, req, flight, admission.prompt_tokens)
            return await self._respond_whole(req, flight, admission.prompt_tokens)
        finally:
            self._flights.pop(request_id, None)
            if self.engine.holds(request_id):
                # The client went away (handler cancelled, or a write failed) or the server is stopping.
                self.engine.cancel(self._now(), request_id)
                self.metrics.request_aborted()
                self._kick()
                log.debug("%s: request %s aborted", self.display_name, request_id)

    def _record_finish(self, flight: _Flight, kind: EndpointKind) -> None:
        assert flight.finished_at is not None
        scheduled = flight.scheduled_at if flight.scheduled_at is not None else flight.arrived_at
        # a prefill-only request (embedding) emits no token: its "first token" is the end of its prefill
        first = flight.first_token_at if flight.first_token_at is not None else flight.finished_at
        self.metrics.request_finished(
            queue_s=scheduled - flight.arrived_at,
            ttft_s=first - flight.arrived_at,
            e2e_s=flight.finished_at - flight.arrived_at,
            finished_reason="length" if kind.generates_tokens else "stop",
        )

    async def _respond_whole(
        self, req: InferenceRequest, flight: _Flight, prompt_tokens: int
    ) -> web.StreamResponse:
        while flight.finished_at is None:
            if flight.stopped:
                return _error_response(RequestError(503, "The server is shutting down.", type="server_error"))
            await flight.progressed.wait()
            flight.progressed.clear()
        await self._hold_while_hung()
        self._record_finish(flight, req.kind)
        if req.kind is EndpointKind.EMBEDDINGS:
            dimensions = req.dimensions or EMBEDDING_DIMENSIONS
            vectors = [replies.pseudo_embedding(self.model.name, p, dimensions) for p in req.prompts]
            body = replies.embedding_response(req, vectors=vectors, prompt_tokens=prompt_tokens)
        elif req.kind is EndpointKind.RESPONSES:
            builder = replies.ResponseBuilder(req, request_id=flight.request_id, created_at=int(time.time()))
            body = builder.response(
                status=replies.CAPPED, input_tokens=prompt_tokens, output_tokens=flight.tokens_per_choice
            )
        else:
            body = replies.full_response(
                req,
                request_id=flight.request_id,
                created=int(time.time()),
                prompt_tokens=prompt_tokens,
                tokens_per_choice=flight.tokens_per_choice,
            )
        return web.json_response(body)

    async def _respond_streamed(
        self, request: web.Request, req: InferenceRequest, flight: _Flight, prompt_tokens: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created = int(time.time())
        builder: replies.ResponseBuilder | None = None
        if req.kind is EndpointKind.RESPONSES:
            builder = replies.ResponseBuilder(req, request_id=flight.request_id, created_at=created)
            await response.write(b"".join(replies.typed_sse(e) for e in builder.opening_events()))
        sent = 0
        while True:
            await flight.progressed.wait()
            flight.progressed.clear()
            await self._hold_while_hung()
            if flight.stopped:
                return response
            if flight.finished_at is not None:
                emitted = flight.tokens_per_choice
            elif self.engine.holds(flight.request_id):
                emitted = self.engine.tokens_emitted(flight.request_id)
            else:
                emitted = sent
            if emitted > sent and builder is not None:
                deltas = builder.delta_events(sent, emitted)
                await response.write(b"".join(replies.typed_sse(e) for e in deltas))
                sent = emitted
            elif emitted > sent:
                chunks = replies.token_chunks(
                    req, request_id=flight.request_id, created=created, start=sent, stop=emitted
                )
                await response.write(b"".join(replies.sse(c) for c in chunks))
                sent = emitted
            if flight.finished_at is not None:
                break
        self._record_finish(flight, req.kind)
        if builder is not None:
            closing = builder.closing_events(
                input_tokens=prompt_tokens, output_tokens=flight.tokens_per_choice
            )
            await response.write(b"".join(replies.typed_sse(e) for e in closing))
            await response.write_eof()
            return response
        tail = [replies.sse(replies.final_chunk(req, request_id=flight.request_id, created=created))]
        if req.include_usage:
            usage = replies.usage_chunk(
                req,
                request_id=flight.request_id,
                created=created,
                prompt_tokens=prompt_tokens,
                completion_tokens=flight.tokens_per_choice * choice_count(req),
            )
            tail.append(replies.sse(usage))
        tail.append(replies.SSE_DONE)
        await response.write(b"".join(tail))
        await response.write_eof()
        return response


def _error_response(err: RequestError, *, extra_headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI JSON error response (with ``retry-after`` when the error carries one)."""
    hdrs = {
        k: v for k, v in (extra_headers or {}).items() if k.lower() not in ("content-type", "content-length")
    }
    if err.retry_after_s is not None:
        hdrs["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return web.json_response(err.to_openai_json(), status=err.status, headers=hdrs)
