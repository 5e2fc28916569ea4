"""``inferlb replay``: replay an LLM request trace through the gateway and report how the fleet served it.

A trace is a CSV of ``TIMESTAMP,ContextTokens,GeneratedTokens`` (the schema of the Azure LLM inference
trace 2023, Patel et al., "Splitwise", ISCA 2024; CC-BY 4.0). Each row becomes one chat completion whose
prompt has ``ContextTokens`` tokens (cl100k_base) and whose ``max_tokens`` is ``GeneratedTokens``, sent at
the row's offset from the first row, divided by ``speedup``. Requests are spread over the config's
tenants (round-robin) and models (in proportion to each model's fleet capacity, seeded).

The pure parts (reading, windowing, planning, summarising) are separate from the one async function that
sends requests (:func:`send_all`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from inferlb.config.schema import Config
from inferlb.request.headers import ENDPOINT
from inferlb.traces import TraceRow, percentile

#: Tokens a one-message chat adds around its content in cl100k_base chat formatting: 3 per message,
#: 1 for the role name, 3 priming the reply (OpenAI cookbook, "How to count tokens with tiktoken").
CHAT_OVERHEAD_TOKENS = 7

# Words that are each exactly one cl100k_base token with a leading space; " w1 w2 ..." is then exactly
# one token per word, since the pre-tokenizer splits at each space-led word.
_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "it",
    "at",
    "by",
    "from",
    "this",
    "be",
    "are",
    "was",
    "or",
    "an",
    "have",
    "not",
    "you",
    "all",
    "can",
    "more",
    "one",
    "will",
    "which",
    "their",
    "has",
    "but",
    "about",
    "time",
    "new",
    "some",
    "when",
    "there",
    "what",
    "also",
    "up",
    "out",
    "use",
    "other",
    "into",
    "only",
    "its",
    "like",
    "than",
    "first",
    "then",
    "two",
    "over",
    "make",
    "way",
    "these",
    "most",
    "any",
)


@dataclass(frozen=True, kw_only=True)
class PlannedRequest:
    """One request to send: at ``at_s`` seconds after the replay starts, with ``max_tokens`` (None: the
    body sets none, the model's default applies) and any ``headers`` besides the API key."""

    index: int
    at_s: float
    api_key: str
    tenant: str
    model: str
    prompt_tokens: int
    max_tokens: int | None
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What happened to one request. Times in seconds; ``ttft_s`` is None when no token arrived."""

    index: int
    tenant: str
    model: str
    status: int
    latency_s: float
    ttft_s: float | None
    endpoint: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


def plan(
    config: Config,
    rows: Sequence[TraceRow],
    *,
    model: str | None = None,
    seed: int = 1,
    min_max_tokens: int = 1,
) -> list[PlannedRequest]:
    """Assign tenants (round-robin over every tenant's first key) and models to trace rows.

    Each request's ``max_tokens`` is its row's cap (:attr:`inferlb.traces.TraceRow.output_cap`: the
    completion length unless :func:`inferlb.traces.client_caps` set another), none when the row's client
    sends none (``cap_sent`` False).

    Without ``model``, each row's model is drawn (seeded) in proportion to the total relative capacity of
    the GPUs serving that model, so the replay loads the fleet evenly.

    Raises:
        ValueError: the config has no tenant with a plain-text key (``api_key_sha256`` alone cannot be
            sent), or ``model`` is not in it.
    """
    tenants = [t for t in config.tenants if t.plaintext_keys()]
    if not tenants:
        raise ValueError("the config has no tenant with a plain-text API key: replay needs API keys")
    names = config.model_by_name()
    if model is not None and model not in names:
        raise ValueError(f"model {model!r} is not in the config (known: {sorted(names)})")
    cap: dict[str, float] = defaultdict(float)
    for e in config.endpoints:
        cap[e.model] += config.gpu_profiles[e.gpu].relative_capacity
    models = [m.name for m in config.models if cap.get(m.name, 0) > 0] or [config.models[0].name]
    weights = [cap.get(m, 1.0) for m in models]
    rng = random.Random(seed)
    out = []
    for i, r in enumerate(rows):
        t = tenants[i % len(tenants)]
        out.append(
            PlannedRequest(
                index=i,
                at_s=r.offset_s,
                api_key=t.plaintext_keys()[0],
                tenant=t.name,
                model=model or rng.choices(models, weights)[0],
                prompt_tokens=r.prompt_tokens,
                max_tokens=max(min_max_tokens, r.output_cap) if r.cap_sent else None,
            )
        )
    return out


#: Leading words of a prompt that spell its ``salt`` (base ``len(_WORDS)``: 810,000 distinct prompts).
SALT_WORDS = 4


def prompt_text(content_tokens: int, *, salt: int = 0) -> str:
    """Text of exactly ``content_tokens`` cl100k_base tokens (one common word per token).

    Its first :data:`SALT_WORDS` words spell ``salt`` (the request's index in the replay), so that two
    replayed requests never share a prefix: a trace without prefix information shows no reuse to a model
    server's prefix cache (vLLM's, or gpusim's model of it) instead of every prompt hitting the last one's.
    """
    n = max(1, content_tokens)
    w = len(_WORDS)
    digits = [(salt // w**k) % w for k in range(SALT_WORDS)]
    return "".join(" " + _WORDS[digits[i] if i < SALT_WORDS else i % w] for i in range(n))


def chat_body(req: PlannedRequest, *, stream: bool) -> dict[str, Any]:
    """The chat completion body for a planned request: a prompt of ``req.prompt_tokens`` tokens in all."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [
            {"role": "user", "content": prompt_text(req.prompt_tokens - CHAT_OVERHEAD_TOKENS, salt=req.index)}
        ],
    }
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(
    session: aiohttp.ClientSession, url: str, req: PlannedRequest, *, stream: bool, timeout_s: float
) -> Outcome:
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    headers = {**dict(req.headers), "Authorization": f"Bearer {req.api_key}"}

    def done(status: int, endpoint: str | None, error: str | None = None) -> Outcome:
        return Outcome(
            index=req.index,
            tenant=req.tenant,
            model=req.model,
            status=status,
            latency_s=time.perf_counter() - t0,
            ttft_s=ttft,
            endpoint=endpoint,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            error=error,
        )

    try:
        async with session.post(
            url,
            json=chat_body(req, stream=stream),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            endpoint = resp.headers.get(ENDPOINT)
            if resp.status != 200:
                text = await resp.text()
                try:
                    msg = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = text[:200]
                return done(resp.status, endpoint, msg)
            if not stream:
                data = await resp.json()  # no first token to time: ttft stays None
                usage = data.get("usage") or {}
                return done(200, endpoint)
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if ttft is None and event.get("choices"):
                    ttft = time.perf_counter() - t0
                if event.get("usage"):
                    usage = event["usage"]
            return done(200, endpoint)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return done(0, None, f"{type(exc).__name__}: {exc}")


async def send_all(
    gateway: str,
    planned: Sequence[PlannedRequest],
    *,
    stream: bool = True,
    timeout_s: float = 120.0,
    max_in_flight: int = 512,
    on_done: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Send every planned request at its time through ``gateway`` (``host:port``); return outcomes.

    Bounded: at most ``len(planned)`` requests, each cut off after ``timeout_s`` seconds, and at most
    ``max_in_flight`` at once (later arrivals wait, and their latency includes the wait).
    """
    url = f"http://{gateway}/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=max_in_flight, force_close=False)
    sem = asyncio.Semaphore(max_in_flight)
    start = time.perf_counter()

    async def run(req: PlannedRequest, session: aiohttp.ClientSession) -> Outcome:
        delay = req.at_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            out = await _one(session, url, req, stream=stream, timeout_s=timeout_s)
        if on_done is not None:
            on_done(out)
        return out

    async with aiohttp.ClientSession(connector=conn) as session:
        return list(await asyncio.gather(*(run(r, session) for r in planned)))


# -- summaries (pure) --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EndpointShare:
    """Per endpoint: requests and tokens served, as counts and as shares of its cluster, beside its
    weight share in Envoy (all shares 0..1)."""

    cluster: str
    endpoint: str
    gpu: str
    weight: int
    weight_share: float
    requests: int
    request_share: float
    tokens: int
    token_share: float


def endpoint_shares(
    config: Config, outcomes: Sequence[Outcome], weights: dict[str, int]
) -> list[EndpointShare]:
    """Join served outcomes with each endpoint's weight (``weights``: display name -> Envoy weight)."""
    by_name = {e.display_name: e for e in config.endpoints}
    models = {m.name: m for m in config.models}
    reqs: Counter[str] = Counter()
    toks: Counter[str] = Counter()
    for o in outcomes:
        if o.status == 200 and o.endpoint:
            reqs[o.endpoint] += 1
            toks[o.endpoint] += o.prompt_tokens + o.completion_tokens
    cluster_of = {
        e.display_name: models[e.model].cluster_name(config.endpoint_version(e)) for e in config.endpoints
    }
    tot_w: Counter[str] = Counter()
    tot_r: Counter[str] = Counter()
    tot_t: Counter[str] = Counter()
    for name, cl in cluster_of.items():
        tot_w[cl] += weights.get(name, 0)
        tot_r[cl] += reqs[name]
        tot_t[cl] += toks[name]
    rows = []
    for name, cl in sorted(cluster_of.items(), key=lambda kv: (kv[1], kv[0])):
        rows.append(
            EndpointShare(
                cluster=cl,
                endpoint=name,
                gpu=by_name[name].gpu,
                weight=weights.get(name, 0),
                weight_share=weights.get(name, 0) / tot_w[cl] if tot_w[cl] else 0.0,
                requests=reqs[name],
                request_share=reqs[name] / tot_r[cl] if tot_r[cl] else 0.0,
                tokens=toks[name],
                token_share=toks[name] / tot_t[cl] if tot_t[cl] else 0.0,
            )
        )
    return rows


@dataclass(frozen=True, kw_only=True)
class ReplaySummary:
    """Totals of a replay: latencies in seconds over successful requests."""

    sent: int
    ok: int
    by_status: dict[int, int]
    by_tenant: dict[str, dict[int, int]]
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    wall_s: float


def summarize(outcomes: Sequence[Outcome], wall_s: float) -> ReplaySummary:
    """Counts by status and tenant, and latency/TTFT p50/p99 of the successful requests."""
    ok = [o for o in outcomes if o.status == 200]
    by_tenant: dict[str, Counter[int]] = defaultdict(Counter)
    for o in outcomes:
        by_tenant[o.tenant][o.status] += 1
    lat = [o.latency_s for o in ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    return ReplaySummary(
        sent=len(outcomes),
        ok=len(ok),
        by_status=dict(Counter(o.status for o in outcomes)),
        by_tenant={t: dict(c) for t, c in sorted(by_tenant.items())},
        latency_p50_s=percentile(lat, 50),
        latency_p99_s=percentile(lat, 99),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        wall_s=wall_s,
    )
