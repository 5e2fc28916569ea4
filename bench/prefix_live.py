"""Cache-aware placement through the live stack: inferlb (real Envoy over xDS, the ext_authz request path)
under five placements beside sglang-router and vllm-router, all in front of one shared fleet of simulated
GPUs (gpusim, vLLM-like prefix caching and KV events), cells interleaved in one run. Not a test: it prints a
table, writes a PNG plot and a results file.

Fleet: the embedded config's GPU mix (``inferlb/data/local.yaml``: 2 x H100, 3 x A100, 3 x V100) serving one
model, with that config's ``simulation`` timing; one ``python -m simulation.gpusim`` process serves all eight
on free loopback ports, each publishing its KV events (vLLM's ZMQ ``--kv-events-config``). Every gateway
sends to these same eight servers.

Gateways (all started before the first cell, kept up to the last):

- ``inferlb least_request``: ``endpoint_picking`` off, Envoy's least request;
- ``inferlb ring_hash``: ``cluster.lb_policy: ring_hash`` (bounded load 150) on the gateway's prefix key
  (the messages up to and including the first user message: :mod:`inferlb.policy.affinity`);
- ``inferlb pick load`` / ``approximate`` / ``precise``: ``models[].endpoint_picking.mode`` (``precise``
  subscribes to the eight servers' KV events through ``endpoints[].kv_events``);
- ``sglang-router cache_aware`` / ``round_robin`` and ``vllm-router round_robin``, from their bench-only
  venvs under ``~/.cache/inferlb-bench/peers/`` (see ``bench/gateway_overhead.py``; never the project's
  dependencies), given the eight servers as ``--worker-urls``. A peer that is not installed or does not
  start gets a note instead of rows.

Workloads, each a list of (arrival, prompt blocks, completion tokens):

(a) ``mooncake``: a window of the Mooncake conversation trace (Qin et al., "Mooncake", USENIX FAST 2025;
    ``--mooncake FILE``): its first ``--window-s`` seconds thinned by conversation to the cell's request
    count (:func:`conversations`: whole conversations kept, so their later turns can hit; the trace's
    first minutes alone reuse little, 6% ideal in 200 rows), time-compressed to the load. Each
    ``hash_id`` is a 512-token block whose text is built from the id alone (:func:`block_text`), so equal
    ids give equal token prefixes on every server. A request is a chat: ``system`` = its first block,
    ``user`` = its second (the conversation's opening, which ring hash keys on), then ``assistant`` = the
    blocks up to the last and ``user`` = the last; each block one text part. The message framing between
    the blocks means that a later turn of a conversation that moved a block from the last ``user`` turn
    into ``assistant`` reuses one block less than the ids say (the ideal below is by ids: a bound).
(b) ``shared-prefix``: llm-d's prefix-cache benchmark shape (:class:`simulation.fleetsim.workload.
    SharedPrefixSpec`): ``--groups`` system prompts of ``--system-tokens``, ``--users`` users per group each
    with its own question of ``--question-tokens``; Poisson arrivals, each one of the prompts drawn
    uniformly; ``system`` = the group's blocks, ``user`` = the question's.

Rates: ``--loads`` fractions of the fleet's capacity with no cache hit (:func:`simulation.fleetsim.workload.
fleet_capacity_rps` over the eight servers' timing and the workload's requests), as the fleet benches do.
Completions are capped at ``--max-output`` tokens (the simulated decode is 30 tokens/s on a V100: uncapped,
one Mooncake answer takes ~10 s) so a cell stays short; the capacity is computed with the cap.

One cell = (workload, load, gateway): before it, every server's prefix cache is reset (vLLM's
``POST /reset_prefix_cache``) and the block texts get a new per-cell salt (so a gateway's memory of its own
earlier cells, e.g. the approximate index, matches nothing); arrivals for ``--duration`` s, open loop, every
request streamed (``stream_options.include_usage``); requests still open ``--drain`` s after the last arrival
are cancelled and counted as errors. Cells run in a shuffled order per round (``--rounds``), so the shared
machine's noise falls on all alike. Per cell: TTFT p50/p90/p99 (client-side, first content chunk), e2e
p50/p99, output tokens/s (completion tokens of the answers over the cell's span), the prefix-cache hit rate
from the servers' own ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` (deltas over the
cell) beside the workload's ideal (one never-evicting cache that sees every request, counted by vLLM's
rules on the block ids: :func:`prefix_cache.ideal_hits`), each server's in-flight requests
(``vllm:num_requests_running + waiting``, sampled every ``--sample-ms``) as max over mean of the per-server
time averages, and the errors.

Usage: ``.venv/bin/python bench/prefix_live.py --mooncake shared/traces/mooncake/mooncake_conversation_
trace.jsonl --quick [--out DIR]`` (``--help`` for the rest; ``--quick``: 12 s cells at 90% only).
``--prefill-ab`` puts each picking row beside its ``decode-priced`` twin, the same gateway with its GPU
profiles' ``prefill_relative_capacity`` removed (its picker prices prefill by the decode weight, as before
the picker had a prefill weight; the shared gpusim fleet keeps its speeds); ``--tokens-weights W ...`` adds
each picking row with ``endpoint_picking.weights.tokens`` at ``W``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
import urllib.request
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from gateway_overhead import PEERS_DIR, peer_venv  # bench/gateway_overhead.py
from plots import save_figure  # bench/plots.py
from prefix_cache import ideal_hits  # bench/prefix_cache.py
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import default_config_path, load_config
from inferlb.ops.stack import Child, Stack, free_ports, gpusim_kv_events_args, on_free_ports
from inferlb.request.tokens import offline_encoding
from inferlb.traces import MOONCAKE_BLOCK_TOKENS, TraceRow, percentile, read_mooncake_trace
from simulation.fleetsim.workload import SharedPrefixSpec, fleet_capacity_rps, shared_prefix_rows
from simulation.gpusim.engine import TimingModel

ROOT = Path(__file__).resolve().parent.parent
MODEL = "llama-3.1-8b-instruct"
API_KEY = "sk-bench-live"
HIGH_LIMITS = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "daily_token_budget": 10**14}
MOONCAKE_CREDIT = "Trace: Mooncake conversation trace, Qin et al., 'Mooncake', USENIX FAST 2025 (Apache-2.0)"
CHAT = "/v1/chat/completions"

#: inferlb's placements: (gateway name, model fields set on top of the bench model).
INFERLB: list[tuple[str, dict[str, Any]]] = [
    ("inferlb least_request", {"cluster": {"lb_policy": "least_request"}}),
    ("inferlb ring_hash", {"cluster": {"lb_policy": "ring_hash"}}),
    ("inferlb pick load", {"endpoint_picking": {"mode": "load"}}),
    ("inferlb pick approximate", {"endpoint_picking": {"mode": "approximate"}}),
    ("inferlb pick precise", {"endpoint_picking": {"mode": "precise"}}),
]
#: the ``--prefill-ab`` twin of a picking row: its GPU profiles without ``prefill_relative_capacity``, so its
#: picker prices prefill by the decode weight (the picker before the prefill weight; gpusim keeps its speeds)
DECODE_PRICED = "decode-priced"


def inferlb_rows(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], bool]]:
    """The inferlb gateways of this run: (name, model fields, decode-priced), from :data:`INFERLB` as
    ``--policies`` selects, each picking row followed by its ``--tokens-weights`` variants and, with
    ``--prefill-ab``, every one of them by its decode-priced twin."""
    out: list[tuple[str, dict[str, Any], bool]] = []
    for name, fields in INFERLB:
        if name.split()[-1] not in args.policies:
            continue
        picking = fields.get("endpoint_picking")
        if picking is None:
            out.append((name, fields, False))
            continue
        variants = [(name, fields)] + [
            (f"{name} tokens {w:g}", {"endpoint_picking": {**picking, "weights": {"tokens": w}}})
            for w in args.tokens_weights
        ]
        for n, f in variants:
            out.append((n, f, False))
            if args.prefill_ab:
                out.append((f"{n} {DECODE_PRICED}", f, True))
    return out


#: the peers: (gateway name, venv, requirement, executable, policy, vllm-router's spelling).
PEERS: list[tuple[str, str, str, str, str, bool]] = [
    ("sglang-router cache_aware", "sglang", "sglang-router", "python", "cache_aware", False),
    ("sglang-router round_robin", "sglang", "sglang-router", "python", "round_robin", False),
    ("vllm-router round_robin", "vllm", "vllm-router", "vllm-router", "round_robin", True),
    ("vllm-router cache_aware", "vllm", "vllm-router", "vllm-router", "cache_aware", True),
]


# -- the workload's text ------------------------------------------------------------------------------------
_TEXTS: dict[tuple[int, int, int], str] = {}


def block_text(block_id: int, salt: int, tokens: int = MOONCAKE_BLOCK_TOKENS) -> str:
    """The text of block ``block_id`` under ``salt``: the decoding of ``tokens`` cl100k token ids drawn by
    ``random.Random`` seeded with both (ids 1,000-30,000, ordinary text tokens), so one (id, salt) is one
    text, and a shorter block (the last, partial one of a prompt) is a prefix of the full one's ids.
    Re-encoded it is ``tokens`` ids give or take a few merges at its edges (the counter is the gateway's
    and gpusim's, :func:`inferlb.request.tokens.offline_encoding`)."""
    key = (block_id, salt, tokens)
    hit = _TEXTS.get(key)
    if hit is None:
        rng = random.Random(block_id * 1_000_003 + salt)
        ids = [rng.randrange(1000, 30000) for _ in range(MOONCAKE_BLOCK_TOKENS)][:tokens]
        hit = _TEXTS[key] = offline_encoding().decode(ids) + "\n"
        if len(_TEXTS) > 200_000:
            _TEXTS.clear()
    return hit


def _parts(blocks: list[tuple[int, int]], salt: int) -> list[dict[str, str]]:
    return [{"type": "text", "text": block_text(b, salt, n)} for b, n in blocks]


def mooncake_messages(row: TraceRow, salt: int) -> list[dict[str, Any]]:
    """The chat of one Mooncake row (see the module doc): system = block 0, user = block 1, assistant = the
    blocks up to the last, user = the last (partial) block; fewer blocks, fewer messages."""
    ids = list(row.block_hashes) or [0]
    last = max(1, row.prompt_tokens - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1))
    blocks = [(b, MOONCAKE_BLOCK_TOKENS) for b in ids[:-1]] + [(ids[-1], min(last, MOONCAKE_BLOCK_TOKENS))]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": _parts(blocks[:1], salt)}]
    if len(blocks) >= 2:
        msgs.append({"role": "user", "content": _parts(blocks[1:2], salt)})
    if len(blocks) >= 4:
        msgs.append({"role": "assistant", "content": _parts(blocks[2:-1], salt)})
    if len(blocks) >= 3:
        msgs.append({"role": "user", "content": _parts(blocks[-1:], salt)})
    if len(blocks) == 1:
        msgs.append({"role": "user", "content": "Go on."})
    return msgs


def shared_prefix_messages(row: TraceRow, spec: SharedPrefixSpec, salt: int) -> list[dict[str, Any]]:
    """The chat of one shared-prefix row: system = the group's blocks, user = the question's blocks."""
    n_sys = -(-spec.system_tokens // spec.block_tokens)
    sys_blocks = [(b, spec.block_tokens) for b in row.block_hashes[:n_sys]]
    q = [(b, spec.block_tokens) for b in row.block_hashes[n_sys:]]
    return [
        {"role": "system", "content": _parts(sys_blocks, salt)},
        {"role": "user", "content": _parts(q, salt)},
    ]


def conversations(trace: list[TraceRow], count: int, window_s: float) -> list[TraceRow]:
    """About ``count`` rows of the trace's first ``window_s`` seconds, thinned by conversation: a row is kept
    when the CRC-32 of its opening (its second block id; the first when it has one) falls in one residue
    class modulo ``m = len(window) // count``, so every turn of a kept conversation is kept (the turns of
    one conversation share their opening). Arrival offsets as in the trace (s)."""
    win = [r for r in trace if r.offset_s < window_s]
    m = max(1, len(win) // max(1, count))

    def opening(r: TraceRow) -> int:
        return r.block_hashes[1] if len(r.block_hashes) > 1 else (r.block_hashes or (0,))[0]

    return [r for r in win if zlib.crc32(str(opening(r)).encode()) % m == 0]


# -- the fleet and the gateways -----------------------------------------------------------------------------
def fleet_doc(work: Path) -> dict[str, Any]:
    """The bench config: the embedded config's timing, GPU profiles and GPU mix, one model on all eight
    endpoints (free ports, each with a KV-events port), one tenant with limits far above the run."""
    doc: dict[str, Any] = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["models"] = [{"name": MODEL, "context_length": 131072}]
    doc["endpoints"] = [
        {"name": e["name"], "address": "127.0.0.1:1", "model": MODEL, "gpu": e["gpu"], "simulated": True}
        for e in doc["endpoints"]
    ]
    doc["tenants"] = [{"name": "bench", "api_keys": [API_KEY], **HIGH_LIMITS}]
    doc["gateway"]["concurrency"] = 1
    doc["gateway"]["request_timeout_ms"] = 0
    doc["ext_proc"]["meter_flush_interval_ms"] = 200  # a pick's in-flight count ends near its answer
    on_free_ports(doc)
    kv = free_ports(len(doc["endpoints"]))
    for e, port in zip(doc["endpoints"], kv, strict=True):
        e["kv_events"] = f"tcp://127.0.0.1:{port}"
    return doc


def write(work: Path, name: str, doc: dict[str, Any]) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def start_gpusim(work: Path, fleet: dict[str, Any]) -> tuple[Child, list[str]]:
    """One gpusim process serving the fleet, publishing KV events; (child, the servers' base URLs)."""
    sim = {**fleet, "models": [{**fleet["models"][0], "endpoint_picking": {"mode": "precise"}}]}
    path = write(work, "gpusim", sim)
    cfg = load_config(path)
    argv = [sys.executable, "-m", "simulation.gpusim", "--config", str(path), "--log-level", "warning"]
    child = Child("gpusim", [*argv, *gpusim_kv_events_args(cfg)], work / "gpusim.log")
    child.start({**os.environ, "PYTHONUNBUFFERED": "1"})
    urls = [f"http://{e['address']}" for e in fleet["endpoints"]]
    # bound before the gateways' free ports are drawn, so that none is handed one of the servers' ports
    deadline = time.monotonic() + 60
    for u in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{u}/metrics", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gpusim: {u}/metrics did not answer within 60 s") from None
                time.sleep(0.2)
    return child, urls


def inferlb_doc(fleet: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A stack config on its own ports, in front of the fleet's servers (not simulated: gpusim runs apart);
    ``kv_events`` kept only in precise mode (the config refuses it elsewhere)."""
    doc = json.loads(json.dumps(fleet))
    saved = [e["address"] for e in doc["endpoints"]]
    on_free_ports(doc)
    precise = fields.get("endpoint_picking", {}).get("mode") == "precise"
    for e, addr in zip(doc["endpoints"], saved, strict=True):
        e.update(address=addr, simulated=False)
        if not precise:
            e.pop("kv_events", None)
    doc["models"] = [{**doc["models"][0], **fields}]
    return doc


@dataclass(kw_only=True)
class Gateway:
    """One gateway under test: its chat URL, the headers it needs, what keeps it up."""

    name: str
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    note: str = ""
    stack: Stack | None = None
    child: Child | None = None


def start_peer(work: Path, spec: tuple[str, str, str, str, str, bool], workers: list[str]) -> Gateway:
    name, venv, requirement, exe_name, policy, vllm = spec
    gw = Gateway(name=name)
    exe, why = peer_venv(PEERS_DIR, venv, requirement, exe_name)
    if exe is None:
        gw.note = why
        return gw
    port, metrics = free_ports(2)
    argv = [str(exe)] if vllm else [str(exe), "-m", "sglang_router.launch_router"]
    argv += ["--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    argv += ["--log-level", "warning" if vllm else "warn"]
    slug = name.replace(" ", "-")
    gw.child = Child(slug, argv, work / f"{slug}.log")
    gw.child.start({**os.environ, "NO_PROXY": "127.0.0.1"})
    gw.url = f"http://127.0.0.1:{port}{CHAT}"
    return gw


async def answers(http: aiohttp.ClientSession, gw: Gateway, timeout_s: float) -> str | None:
    """Poll ``gw`` with a tiny chat until it answers 200 (None) or ``timeout_s`` passes (the last problem)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if gw.child is not None and gw.child.exited() is not None:
            return f"exited {gw.child.exited()}: {gw.child.log_tail(3)[-300:]}"
        try:
            async with http.post(gw.url, json=body, headers=gw.headers) as resp:
                if resp.status == 200:
                    return None
                last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            last = repr(exc)[:200]
        await asyncio.sleep(0.5)
    return last


# -- the servers' own counters ------------------------------------------------------------------------------
def _sum_metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def scrape(http: aiohttp.ClientSession, urls: list[str]) -> list[str]:
    async def one(u: str) -> str:
        async with http.get(f"{u}/metrics") as resp:
            return await resp.text()

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def reset_caches(http: aiohttp.ClientSession, urls: list[str], timeout_s: float = 30.0) -> None:
    """Every server's ``POST /reset_prefix_cache`` until it answers 200 (409 while blocks are held)."""
    deadline = time.monotonic() + timeout_s
    for u in urls:
        while True:
            async with http.post(f"{u}/reset_prefix_cache") as resp:
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{u} kept its prefix cache busy for {timeout_s:.0f} s")
            await asyncio.sleep(0.5)


# -- one cell -----------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Cell:
    """One (workload, load, gateway) run's figures; times in s."""

    workload: str
    load: float
    gateway: str
    rate_rps: float
    ideal: float
    sent: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    output_tokens: int = 0
    span_s: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    in_flight_mean: list[float] = field(default_factory=list)
    in_flight_peak: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    #: the first answer's body of each HTTP error status (up to 300 characters)
    error_bodies: dict[str, str] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def in_flight_ratio(self) -> float:
        mean = statistics.fmean(self.in_flight_mean) if self.in_flight_mean else 0.0
        return max(self.in_flight_mean) / mean if mean > 0 else 0.0


async def one_request(
    http: aiohttp.ClientSession, gw: Gateway, body: dict[str, Any], cell: Cell, t0: float
) -> None:
    """Send one streamed chat; record TTFT, e2e and completion tokens, or the error's kind."""
    start = time.perf_counter()
    first: float | None = None
    usage = 0
    try:
        async with http.post(gw.url, json=body, headers=gw.headers) as resp:
            if resp.status != 200:
                key = f"HTTP {resp.status}"
                cell.errors[key] = cell.errors.get(key, 0) + 1
                cell.error_bodies.setdefault(key, (await resp.text())[:300])
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if first is None and b'"content"' in line:
                    first = time.perf_counter() - start
                if b'"usage"' in line:
                    doc = json.loads(line[6:])
                    if doc.get("usage"):
                        usage = int(doc["usage"].get("completion_tokens", 0))
    except asyncio.CancelledError:
        cell.errors["unfinished"] = cell.errors.get("unfinished", 0) + 1
        raise
    except (TimeoutError, aiohttp.ClientError) as exc:
        key = type(exc).__name__
        cell.errors[key] = cell.errors.get(key, 0) + 1
        return
    if first is None:
        cell.errors["no token"] = cell.errors.get("no token", 0) + 1
        return
    end = time.perf_counter()
    cell.ttft.append(first)
    cell.e2e.append(end - start)
    cell.output_tokens += usage
    cell.span_s = max(cell.span_s, end - t0)


async def run_cell(
    http: aiohttp.ClientSession,
    gw: Gateway,
    urls: list[str],
    cell: Cell,
    requests: list[tuple[float, list[dict[str, Any]], int]],
    *,
    drain_s: float,
    sample_s: float,
) -> None:
    """Reset the caches, send ``requests`` (arrival s, messages, max_tokens) open loop, sample the servers'
    queues, cancel what is open ``drain_s`` after the last arrival, and fill ``cell``."""
    await reset_caches(http, urls)
    before = await scrape(http, urls)
    samples: list[list[int]] = []
    stop = asyncio.Event()

    async def sampler() -> None:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                texts = await scrape(http, urls)
                samples.append(
                    [
                        int(
                            _sum_metric(t, "vllm:num_requests_running")
                            + _sum_metric(t, "vllm:num_requests_waiting")
                        )
                        for t in texts
                    ]
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), sample_s)

    sampling = asyncio.create_task(sampler())
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    for at, messages, max_tokens in requests:
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        tasks.append(asyncio.create_task(one_request(http, gw, body, cell, t0)))
        cell.sent += 1
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    stop.set()
    await sampling
    after = await scrape(http, urls)
    cell.hits, cell.queries = (
        sum(_sum_metric(a, name) - _sum_metric(b, name) for a, b in zip(after, before, strict=True))
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    )
    if samples:
        cell.in_flight_mean = [statistics.fmean(col) for col in zip(*samples, strict=True)]
        cell.in_flight_peak = max(max(s) for s in samples)


# -- output -------------------------------------------------------------------------------------------------
def _ms(xs: list[float], q: float) -> str:
    return f"{percentile(xs, q) * 1e3:,.0f}" if xs else "-"


def table(cells: list[Cell], title: str, caption: str) -> Table:
    t = Table(title=title, caption=caption)
    cols = ("workload", "load", "gateway", "req/s", "sent", "ok", "TTFT p50 ms", "p90", "p99", "e2e p50 ms",
            "p99", "out tok/s", "hit rate", "ideal", "of ideal", "in-flight max/mean", "peak",
            "errors")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c in ("workload", "gateway", "errors") else "right")
    for c in cells:
        t.add_row(
            c.workload, f"{c.load:.0%}", c.gateway, f"{c.rate_rps:.2f}", str(c.sent), str(len(c.ttft)),
            _ms(c.ttft, 50), _ms(c.ttft, 90), _ms(c.ttft, 99), _ms(c.e2e, 50), _ms(c.e2e, 99),
            f"{c.output_tokens / c.span_s:,.0f}" if c.span_s else "-",
            f"{c.hit_rate:.1%}", f"{c.ideal:.1%}", f"{c.hit_rate / c.ideal:.0%}" if c.ideal else "-",
            f"{c.in_flight_ratio:.2f}", str(c.in_flight_peak),
            ", ".join(f"{k} x{v}" for k, v in sorted(c.errors.items())) or "0",
        )  # fmt: skip
    return t


def plot(cells: list[Cell], path: Path) -> Path:
    import matplotlib  # noqa: PLC0415 - a benchmark-only dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    groups = sorted({(c.workload, c.load) for c in cells})
    fig, axes = plt.subplots(2, len(groups), figsize=(6 * len(groups), 8), squeeze=False)
    for j, (w, load) in enumerate(groups):
        cs = [c for c in cells if (c.workload, c.load) == (w, load)]
        names = [c.gateway.replace("inferlb ", "").replace("-router", "") for c in cs]
        x = range(len(cs))
        ax = axes[0][j]
        p50 = [percentile(c.ttft, 50) if c.ttft else 0 for c in cs]
        p99 = [percentile(c.ttft, 99) if c.ttft else 0 for c in cs]
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="TTFT p50")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="TTFT p99")
        ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("s")
        ax.set_title(f"{w} at {load:.0%} of capacity")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        ax.bar(list(x), [c.hit_rate for c in cs], 0.6, label="prefix-cache hit rate (servers')")
        if cs:
            ax.axhline(cs[0].ideal, color="k", linestyle="--", label="ideal (one infinite cache)")
        ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    return save_figure(fig, path, MOONCAKE_CREDIT)


# -- main ---------------------------------------------------------------------------------------------------
async def bench(args: argparse.Namespace, console: Console) -> list[Cell]:
    work = Path(args.workdir)
    fleet = fleet_doc(work)
    cfg = load_config(
        write(work, "fleet", {**fleet, "endpoints": [{**e, "kv_events": None} for e in fleet["endpoints"]]})
    )
    timings = [TimingModel.for_endpoint(cfg, e) for e in cfg.endpoints]

    # the workloads' rows at each load
    workloads: list[tuple[str, float, float, list[TraceRow], float]] = []
    if "mooncake" in args.workloads:
        trace = [
            TraceRow(offset_s=r.offset_s, prompt_tokens=r.prompt_tokens,
                     output_tokens=max(1, min(r.output_tokens, args.max_output)), block_hashes=r.block_hashes)
            for r in read_mooncake_trace(args.mooncake)
        ]  # fmt: skip
        for load in args.loads:
            rate = load * fleet_capacity_rps(timings, conversations(trace, 10**9, args.window_s))
            rows = conversations(trace, round(rate * args.duration), args.window_s)
            rows = [replace(r, offset_s=r.offset_s * len(rows) / (rate * args.window_s)) for r in rows]
            rows = [r for r in rows if r.offset_s < args.duration]
            h, q = ideal_hits(rows)
            workloads.append(("mooncake", load, rate, rows, h / q if q else 0.0))
    spec = SharedPrefixSpec(groups=args.groups, users=args.users, system_tokens=args.system_tokens,
                            question_tokens=args.question_tokens, output_tokens=args.max_output)  # fmt: skip
    if "shared-prefix" in args.workloads:
        probe = [TraceRow(offset_s=0.0, prompt_tokens=spec.prompt_tokens, output_tokens=spec.output_tokens)]
        cap = fleet_capacity_rps(timings, probe)
        for load in args.loads:
            rows = shared_prefix_rows(spec, rate_rps=load * cap, duration_s=args.duration, seed=args.seed)
            h, q = ideal_hits(rows)
            workloads.append(("shared-prefix", load, load * cap, rows, h / q if q else 0.0))
    for w, load, rate, rows, ideal in workloads:
        console.print(
            f"{w} at {load:.0%}: {rate:.2f} req/s, {len(rows)} requests, ideal hit rate {ideal:.1%}"
        )

    sim, urls = start_gpusim(work, fleet)
    gateways: list[Gateway] = []
    try:
        for i, (name, fields, decode_priced) in enumerate(inferlb_rows(args)):
            doc = inferlb_doc(fleet, fields)
            if decode_priced:
                doc["gpu_profiles"] = {
                    g: {k: v for k, v in p.items() if k != "prefill_relative_capacity"}
                    for g, p in doc["gpu_profiles"].items()
                }
            stack = Stack(write(work, name.replace(" ", "-"), doc), workdir=work / name.replace(" ", "-"),
                          log_level="warning", base_id=(os.getpid() % 5000) * 10 + 100 + i)  # fmt: skip
            gateways.append(Gateway(name=name, stack=stack, url=f"http://{doc['gateway']['listen']}{CHAT}",
                                    headers={"Authorization": f"Bearer {API_KEY}"}))  # fmt: skip
        for spec_ in PEERS:
            if f"{spec_[1]}-{spec_[4]}" in args.peers:
                gateways.append(start_peer(work, spec_, urls))
        for gw in gateways:
            if gw.stack is not None:
                console.print(f"starting {gw.name}")
                gw.stack.start(timeout_s=120)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
            for gw in gateways:
                if gw.url and not gw.note:
                    problem = await answers(http, gw, 90)
                    if problem is not None:
                        gw.note = f"did not answer 200 within 90 s: {problem}"
                console.print(f"{gw.name}: {gw.note or 'answering'}")
            live = [g for g in gateways if not g.note]
            cells: list[Cell] = []
            salt = 0
            rng = random.Random(args.seed)
            order = [(wl, gw) for wl in workloads for gw in live]
            for rnd in range(args.rounds):
                rng.shuffle(order)
                for (w, load, rate, rows, ideal), gw in order:
                    salt += 1
                    cell = Cell(workload=w, load=load, gateway=gw.name, rate_rps=rate, ideal=ideal)
                    if w == "mooncake":
                        reqs = [(r.offset_s, mooncake_messages(r, salt), r.output_tokens) for r in rows]
                    else:
                        reqs = [
                            (r.offset_s, shared_prefix_messages(r, spec, salt), r.output_tokens) for r in rows
                        ]
                    await run_cell(
                        http, gw, urls, cell, reqs, drain_s=args.drain, sample_s=args.sample_ms / 1e3
                    )
                    cells.append(cell)
                    for k, body in cell.error_bodies.items():
                        console.print(f"    first {k} answer: {body!r}", highlight=False)
                    console.print(
                        f"  round {rnd + 1} {w} {load:.0%} {gw.name}: {len(cell.ttft)}/{cell.sent} ok, "
                        "TTFT p50 "
                        f"{_ms(cell.ttft, 50)} ms, hit {cell.hit_rate:.1%} (ideal {ideal:.1%}), "
                        f"errors {sum(cell.errors.values())}", highlight=False,
                    )  # fmt: skip
        for gw in gateways:
            if gw.note:
                console.print(f"[bold]{gw.name}[/]: no rows: {gw.note}")
        return cells
    finally:
        for gw in gateways:
            if gw.stack is not None:
                gw.stack.stop()
            if gw.child is not None:
                gw.child.stop()
        sim.stop()


def merge(cells: list[Cell], order: list[str]) -> list[Cell]:
    """One cell per (workload, load, gateway): the rounds' samples pooled, counters added, in ``order`` of
    the gateways' names."""
    out: dict[tuple[str, float, str], Cell] = {}
    for c in cells:
        k = (c.workload, c.load, c.gateway)
        m = out.get(k)
        if m is None:
            out[k] = Cell(**{**c.__dict__, "ttft": list(c.ttft), "e2e": list(c.e2e), "errors": dict(c.errors),
                             "error_bodies": dict(c.error_bodies),
                             "in_flight_mean": list(c.in_flight_mean)})  # fmt: skip
            continue
        m.sent += c.sent
        m.ttft += c.ttft
        m.e2e += c.e2e
        m.output_tokens += c.output_tokens
        m.span_s += c.span_s
        m.hits += c.hits
        m.queries += c.queries
        m.in_flight_mean = [(a + b) / 2 for a, b in zip(m.in_flight_mean, c.in_flight_mean, strict=False)]
        m.in_flight_peak = max(m.in_flight_peak, c.in_flight_peak)
        for e, n in c.errors.items():
            m.errors[e] = m.errors.get(e, 0) + n
    return sorted(out.values(), key=lambda c: (c.workload, c.load, order.index(c.gateway)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--mooncake",
        type=Path,
        default=ROOT.parent / "shared/traces/mooncake/mooncake_conversation_trace.jsonl",
    )
    ap.add_argument(
        "--workloads", nargs="+", default=["mooncake", "shared-prefix"], choices=["mooncake", "shared-prefix"]
    )
    ap.add_argument("--window-s", type=float, default=1800.0, help="mooncake: seconds of the trace thinned")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.7, 0.9], help="fractions of no-hit capacity")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per cell")
    ap.add_argument(
        "--drain", type=float, default=30.0, help="seconds after the last arrival before cancelling"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-output", type=int, default=64, help="completion tokens cap")
    ap.add_argument("--groups", type=int, default=12, help="shared-prefix: system prompts (1.5 per GPU)")
    ap.add_argument("--users", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=6000)
    ap.add_argument("--question-tokens", type=int, default=1200)
    ap.add_argument(
        "--policies", nargs="+", default=["least_request", "ring_hash", "load", "approximate", "precise"]
    )
    ap.add_argument(
        "--peers",
        nargs="*",
        default=["sglang-cache_aware", "sglang-round_robin", "vllm-round_robin", "vllm-cache_aware"],
    )
    ap.add_argument(
        "--prefill-ab",
        action="store_true",
        help=f"each picking row beside its '{DECODE_PRICED}' twin (no prefill_relative_capacity)",
    )
    ap.add_argument(
        "--tokens-weights",
        type=float,
        nargs="*",
        default=[],
        help="picking rows also with endpoint_picking.weights.tokens at each of these",
    )
    ap.add_argument("--sample-ms", type=float, default=500.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--quick", action="store_true", help="12 s cells (20 s drain) at 90%% only, --max-output 32"
    )
    ap.add_argument("--workdir", default="/tmp/inferlb-prefix-live")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.drain, args.loads, args.max_output = 12.0, 20.0, [max(args.loads)], 32
    console = Console(width=230, record=True)
    load1 = os.getloadavg()
    t0 = time.monotonic()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    cells = merge(
        asyncio.run(bench(args, console)), [r[0] for r in inferlb_rows(args)] + [p[0] for p in PEERS]
    )
    load2 = os.getloadavg()
    caption = (
        "8 gpusim servers (2 H100, 3 A100, 3 V100; local.yaml timing), "
        f"completions <= {args.max_output} tokens, {args.duration:.0f} s of arrivals per cell, "
        f"drain {args.drain:.0f} s, {args.rounds} round(s) shuffled; "
        f"load average {load1[0]:.1f} at start, {load2[0]:.1f} at end ({os.cpu_count()} cores); "
        f"{time.monotonic() - t0:.0f} s"
    )
    console.print(table(cells, "prefix placement through the live stack (TTFT/e2e client-side)", caption))
    args.out.mkdir(parents=True, exist_ok=True)
    console.print(f"wrote {plot(cells, args.out / 'prefix_live.png')}")
    (args.out / "prefix_live.txt").write_text(console.export_text(), encoding="utf-8")


if __name__ == "__main__":
    main()
