"""What a gateway costs on the request path: inferlb in both request-path modes beside Envoy alone and the
peers, all in front of the same nginx backend, in one run.

Run: ``.venv/bin/python bench/gateway_overhead.py [--duration 4] [--rounds 2] [--connections 1,16,64]
[--no-peers]`` (needs ``wrk`` and ``nginx``: ``apt-get install wrk nginx``; the peers are installed from PyPI
into bench-only venvs under ``~/.cache/inferlb-bench/peers/``, never into the project's). Prints one table;
not a test. ~9 min with the defaults (plus the peers' first install).

Set-up, all on 127.0.0.1, every gateway started before the first measurement and kept up to the last:

- backend: nginx (one worker, keep-alive unbounded, no access log) answering every request with one fixed
  OpenAI chat completion (JSON, with ``usage``); ``nginx direct`` is wrk against it, no gateway;
- ``envoy alone``: an Envoy (2 workers) with a static route to the backend (router only);
- ``inferlb ext_proc, metered``: the real gateway (``inferlb.ops.stack.Stack``: xds_server, Envoy over ADS,
  one ``python -m ext_proc``), ``ext_proc.account_responses`` on (the default: the response goes through
  ext_proc and settles the quota with its usage); ``..., unmetered``: the same with it off;
- ``inferlb ext_authz, metered``: ``ext_proc.protocol: ext_authz`` (one ``python -m ext_authz``), responses
  metered in Envoy (the Lua usage scan, the batched gRPC access log to the settler in the ext_authz
  process); ``..., unmetered``: ``account_responses`` off (each request settled at its reservation);
- every inferlb gateway with quota limits on: the tenant has requests and tokens per minute (and a daily
  budget) far above what the run sends, so each request is admitted, reserved and settled, never refused;
- the peers, each in its own venv (``--peers-dir``): sglang-router (``round_robin`` and ``cache_aware``),
  vllm-router (``round_robin``), the LiteLLM proxy (1.80.x: a 1.107 release was reported compromised)
  with a master key; a peer that does not install or start gets a note instead of rows.

Load: ``wrk`` POSTing a ~3 KB chat completion with the tenant's API key, ``repeated`` (the same body every
time) or ``unique`` (wrk's Lua ``request()`` puts a per-thread serial number at the start of the user
turn, so no two requests share a prompt and inferlb's prompt-token cache never hits). Each cell (gateway x
prompts x connections) runs ``--duration`` s once per round; the cells are shuffled anew every round so that
the shared machine's noise falls on all alike, and each figure is the median over the rounds. Columns:
req/s, wrk's p50/p99, answers that were not 2xx plus socket errors, CPU per request (user + system of every
process of the gateway, their threads and children: Envoy and the Python service apart for inferlb) and
of the backend, and the ratios to Envoy alone in the same cell (same prompts, same connections).

``--profile-s N``: afterwards, py-spy (when installed) samples the ext_authz service's event-loop thread for
N s under wrk at 16 connections through its Envoy, repeated then unique prompts (:func:`py_spy_profile`).

``--baseline REV``: one more gateway, ``inferlb ext_authz @REV``: the same ext_authz stack run from
``git archive REV`` (its processes import that tree: ``PYTHONPATH``), an A/B of a change in one run.
``--only-authz``: only Envoy alone and the ext_authz gateways (no ext_proc, no peers). For every ext_authz
gateway the ``new conns to svc`` column is the most TCP connections Envoy opened to the service during one
cell (sampled every 0.25 s; pooled connections of earlier cells left out): with keep-alive honoured, at
most one per check in flight at once.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil
import yaml
from extproc_overhead import (  # the same model, tenant, body and reply as the earlier bench
    API_KEY,
    MODEL,
    REPLY,
    WrkResult,
    alone_bootstrap,
    chat_body,
    start_envoy,
    start_listening,
    wrk,
)
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import default_config_path
from inferlb.ops.stack import Child, Stack, free_ports

T = TypeVar("T")

#: Where the peers' venvs live (never the project's venv).
PEERS_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inferlb-bench" / "peers"
#: Quota limits far above what a run sends: every request is checked, reserved and settled, none refused.
HIGH_LIMITS = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "daily_token_budget": 10**14}
CHAT_PATH = "/v1/chat/completions"


# -- load ------------------------------------------------------------------------------------------------
def wrk_script(path: Path, *, unique: bool) -> Path:
    """Write wrk's Lua script: POST :func:`chat_body` with the API key, built by ``request()`` for every
    request in both modes (so wrk's own cost is alike); ``unique``: each request's user turn starts with
    ``Request <thread>-<n>:`` (a prompt no request before it had)."""
    body = chat_body()
    cut = body.index("The quick brown fox")
    lines = [
        "wrk.method = 'POST'",
        "wrk.headers['Content-Type'] = 'application/json'",
        f"wrk.headers['Authorization'] = 'Bearer {API_KEY}'",
        f"local head = {json.dumps(body[:cut])}",
        f"local tail = {json.dumps(body[cut:])}",
        "local threads = 0",
        "function setup(thread) threads = threads + 1; thread:set('tid', threads) end",
        "local n = 0",
        "function request()",
        "  n = n + 1",
    ]
    if unique:
        lines.append(
            "  return wrk.format(nil, nil, nil, head .. 'Request ' .. tid .. '-' .. n .. ': ' .. tail)"
        )
    else:
        lines.append("  return wrk.format(nil, nil, nil, head .. tail)")
    path.write_text("\n".join([*lines, "end"]) + "\n", encoding="utf-8")
    return path


def bench_setup(
    args: argparse.Namespace, prefix: str, tools: tuple[str, ...]
) -> tuple[int, int, list[int], Path, dict[str, Path]] | None:
    """``--duration`` (1-30 s) and ``--rounds`` (1-10) bounded, ``--connections``, a fresh temp dir and the
    ``repeated``/``unique`` wrk scripts in it; None (said on stderr) when one of ``tools`` is missing."""
    for tool in tools:
        if shutil.which(tool) is None:
            print(f"{tool} not found: apt-get install {tool}", file=sys.stderr)
            return None
    work = Path(tempfile.mkdtemp(prefix=prefix))
    scripts = {
        "repeated": wrk_script(work / "repeated.lua", unique=False),
        "unique": wrk_script(work / "unique.lua", unique=True),
    }
    conns = [int(c) for c in args.connections.split(",")]
    return max(1, min(args.duration, 30)), max(1, min(args.rounds, 10)), conns, work, scripts


def tree_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` and their live descendants (threads included)."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def post(url: str, *, timeout_s: float = 10.0) -> tuple[int, str]:
    """One chat completion to ``url``: (status, body start)."""
    req = urllib.request.Request(
        url,
        data=chat_body().encode(),
        method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read(300).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(300).decode("utf-8", "replace")


def wait_ready(url: str, child: Child | None, timeout_s: float) -> str | None:
    """Post until ``url`` answers 200 (None) or ``timeout_s`` passes (the last answer or error)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if child is not None and child.exited() is not None:
            return f"exited ({child.exited()}): {child.log_tail(5)}"
        try:
            status, text = post(url, timeout_s=5)
            if status == 200:
                return None
            last = f"HTTP {status}: {text[:200]}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.3)
    return last


# -- gateways --------------------------------------------------------------------------------------------
def inferlb_config(work: Path, name: str, backend: int, *, protocol: str, accounting: bool) -> Path:
    """An inferlb config on free ports: one model on ``backend``, one tenant with :data:`HIGH_LIMITS`."""
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    ports = free_ports(7)
    doc["gateway"].update(listen=f"127.0.0.1:{ports[0]}", admin=f"127.0.0.1:{ports[1]}")
    doc["xds"].update(listen=f"127.0.0.1:{ports[2]}", api_listen=f"127.0.0.1:{ports[3]}")
    doc["ext_proc"].update(
        listen=f"127.0.0.1:{ports[4]}",
        metrics_listen=f"127.0.0.1:{ports[5]}",
        meter_listen=f"127.0.0.1:{ports[6]}",
        protocol=protocol,
        account_responses=accounting,
    )
    doc["models"] = [{"name": MODEL}]
    doc["endpoints"] = [{"address": f"127.0.0.1:{backend}", "model": MODEL, "gpu": "H100"}]
    doc["tenants"] = [{"name": "bench", "api_keys": [API_KEY], **HIGH_LIMITS}]
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def start_nginx(work: Path, port: int, *, name: str = "nginx", server: str | None = None) -> Child:
    """nginx ``name`` on ``port`` answering every request with :data:`REPLY` (module docstring), or with
    the ``server`` block lines given instead."""
    root = work / name
    root.mkdir()
    conf = root / "nginx.conf"
    reply = json.dumps(REPLY).replace("'", "\\'")
    if server is None:
        server = f"    default_type application/json;\n    location / {{ return 200 '{reply}'; }}"
    conf.write_text(
        f"""daemon off;
user root;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 600s;
  client_body_buffer_size 64k;
  server {{
    listen 127.0.0.1:{port} reuseport;
{server}
  }}
}}
""",
        encoding="utf-8",
    )
    return start_listening(
        Child(name, ["nginx", "-p", str(root), "-c", str(conf)], work / f"{name}.log"), port
    )


def peer_venv(peers_dir: Path, name: str, requirement: str, exe: str) -> tuple[Path | None, str]:
    """The executable ``exe`` of a bench-only venv ``peers_dir/name`` holding ``requirement``, installed on
    first use (bounded to 15 min); (None, why) when it does not install."""
    venv = peers_dir / name
    path = venv / "bin" / exe
    if path.exists():
        return path, ""
    peers_dir.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", requirement],
            check=True,
            timeout=900,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or exc.stdout or "").strip().splitlines()[-1:] or ["?"]
        return None, f"pip install {requirement!r} failed: {tail[0][:200]}"
    except subprocess.TimeoutExpired:
        return None, f"pip install {requirement!r} took over 15 min"
    if not path.exists():
        return None, f"{requirement!r} installed no {exe}"
    return path, ""


@dataclass(kw_only=True)
class Gateway:
    """One gateway under test: its URL, the processes whose CPU is its own, split into groups."""

    name: str
    does: str
    url: str = ""
    procs: dict[str, list[int]] = field(default_factory=dict)
    note: str = ""
    #: the ext_authz service's pid and port, whose connections from Envoy are counted per cell
    service: tuple[int, int] | None = None


@dataclass(frozen=True, kw_only=True)
class Peer:
    """A peer gateway from PyPI: how to install and start it."""

    name: str
    venv: str
    requirement: str
    exe: str
    does: str
    argv: Callable[[Path, int, int, Path], list[str]]  # (exe, port, backend port, work dir)


def _router_argv(policy: str, *, vllm: bool) -> Callable[[Path, int, int, Path], list[str]]:
    def argv(exe: Path, port: int, backend: int, _work: Path) -> list[str]:
        out = [str(exe)] if vllm else [str(exe), "-m", "sglang_router.launch_router"]
        out += ["--worker-urls", f"http://127.0.0.1:{backend}", "--policy", policy]
        (metrics,) = free_ports(1)  # each router its own Prometheus port (default 29000 for all)
        out += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
        out += ["--log-level", "warning" if vllm else "warn"]  # their spellings differ
        return [*out, "--host", "127.0.0.1", "--port", str(port)]

    return argv


def _litellm_argv(exe: Path, port: int, backend: int, work: Path) -> list[str]:
    cfg = work / "litellm.yaml"
    doc = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"http://127.0.0.1:{backend}/v1",
                    "api_key": "sk-backend",
                },
            }
        ],
        "general_settings": {"master_key": API_KEY},
        "litellm_settings": {"telemetry": False, "drop_params": True},
    }
    cfg.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]


PEERS = [
    Peer(
        name="sglang-router round_robin",
        venv="sglang",
        requirement="sglang-router",
        exe="python",
        does="Rust; forwards the body, reads it for the policy; no auth, no token count, no quota",
        argv=_router_argv("round_robin", vllm=False),
    ),
    Peer(
        name="sglang-router cache_aware",
        venv="sglang",
        requirement="sglang-router",
        exe="python",
        does="Rust; parses the body, prefix tree of the prompt text per worker; no auth/quota",
        argv=_router_argv("cache_aware", vllm=False),
    ),
    Peer(
        name="vllm-router round_robin",
        venv="vllm",
        requirement="vllm-router",
        exe="vllm-router",
        does="Rust (sglang-router's fork); forwards; no auth, no token count, no quota",
        argv=_router_argv("round_robin", vllm=True),
    ),
    Peer(
        name="litellm proxy",
        venv="litellm",
        requirement="litellm[proxy]>=1.80,<1.81",
        exe="litellm",
        does="Python; master-key auth, parses the body, OpenAI client call upstream, parses the answer, "
        "cost/usage bookkeeping; no DB (no per-key quota)",
        argv=_litellm_argv,
    ),
]


def start_peer(peer: Peer, work: Path, backend: int, peers_dir: Path) -> tuple[Gateway, Child | None]:
    """Install (once) and start ``peer``; a gateway with a note and no child when it cannot run."""
    gw = Gateway(name=peer.name, does=peer.does)
    exe, why = peer_venv(peers_dir, peer.venv, peer.requirement, peer.exe)
    if exe is None:
        gw.note = why
        return gw, None
    (port,) = free_ports(1)
    slug = peer.name.replace(" ", "-")
    child = Child(slug, peer.argv(exe, port, backend, work), work / f"{slug}.log")
    child.start({**os.environ, "LITELLM_TELEMETRY": "False", "NO_PROXY": "127.0.0.1"})
    gw.url = f"http://127.0.0.1:{port}{CHAT_PATH}"
    problem = wait_ready(gw.url, child, 90)
    if problem is not None:
        gw.note = f"did not answer 200 within 90 s: {problem}"
        child.stop()
        return gw, None
    assert child.proc is not None
    gw.procs = {"gateway": [child.proc.pid]}
    return gw, child


INFERLB = [
    ("inferlb ext_proc, metered", "ext_proc", True),
    ("inferlb ext_proc, unmetered", "ext_proc", False),
    ("inferlb ext_authz, metered", "ext_authz", True),
    ("inferlb ext_authz, unmetered", "ext_authz", False),
]
#: How each mode settles, metered (True) or not (False), said beside its rows.
METERING = {
    "ext_proc": {True: "; response usage read", False: ""},
    "ext_authz": {
        True: "; usage read by Envoy's Lua filter, batched gRPC access log to the settler",
        False: ", settled at the reservation",
    },
}
INFERLB_DOES = {
    "ext_proc": "API key -> tenant, JSON body parse, prompt token count (cached per text), quota "
    "reserve + settle, routing headers; gRPC stream per request",
    "ext_authz": "the same decisions over one HTTP/1.1 check per request (body buffered by Envoy)",
}


def start_inferlb(
    work: Path,
    name: str,
    protocol: str,
    *,
    accounting: bool,
    backend: int,
    base_id: int,
    tree: Path | None = None,
) -> Stack:
    """The inferlb gateway ``name`` (:data:`INFERLB`), started and answering; its Python processes import
    ``tree`` first when given (``PYTHONPATH``)."""
    slug = name.replace(" ", "-").replace(",", "").replace("@", "")
    cfg = inferlb_config(work, slug, backend, protocol=protocol, accounting=accounting)
    stack = Stack(cfg, workdir=work / slug, log_level="warning", base_id=base_id)
    saved = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = str(tree)  # the stack's children inherit the environment at start
    try:
        stack.start(timeout_s=60)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return stack


def baseline_tree(work: Path, rev: str) -> Path:
    """``git archive rev`` of this repository, unpacked under ``work``.

    Raises:
        subprocess.CalledProcessError: ``rev`` is not a revision of the repository.
    """
    root = Path(__file__).resolve().parents[1]
    out = work / "baseline"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


class ConnectionCounter:
    """TCP connections to ``port`` of process ``pid`` opened while it runs (a sampling thread): those seen
    that were not open at the start (Envoy keeps idle pooled connections of an earlier cell open)."""

    def __init__(self, pid: int, port: int, every_s: float = 0.25) -> None:
        self._proc = psutil.Process(pid)
        self._port = port
        self._every_s = every_s
        self._before = self._open()
        self.opened: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> set[tuple[str, int]]:
        return {
            (c.raddr.ip, c.raddr.port)
            for c in self._proc.net_connections(kind="tcp")
            if c.laddr and c.laddr.port == self._port and c.raddr
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            self.opened |= self._open() - self._before
            self._stop.wait(self._every_s)

    def __enter__(self) -> ConnectionCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def py_spy_profile(pid: int, url: str, script: Path, seconds: int, work: Path, *, title: str) -> None:
    """py-spy on the Python process ``pid`` for ``seconds`` under wrk at 16 connections to ``url``: the top
    functions of its event-loop thread by own samples and by samples under them (idle threads left out)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not installed: no profile", file=sys.stderr)
        return
    out = work / f"profile-{pid}-{time.monotonic_ns()}.txt"
    cmd = [
        spy,
        "record",
        "--pid",
        str(pid),
        "--rate",
        "250",
        "--format",
        "raw",
        "--function",
    ]
    spy_proc = subprocess.Popen(
        [*cmd, "--duration", str(seconds), "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    time.sleep(1)
    r = wrk(url, script, 16, seconds)
    _, err = spy_proc.communicate(timeout=seconds + 60)
    if not out.exists():
        print(f"py-spy wrote nothing: {err.decode()[-500:]}", file=sys.stderr)
        return
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in out.read_text(encoding="utf-8").splitlines():
        stack, _, count = line.rpartition(" ")
        if "run_event_loop" not in stack:
            continue  # another thread (metrics server, config poller, thread pool), idle in a wait
        n = int(count)
        frames = stack.split(";")
        samples += n
        own[frames[-1]] += n
        for f in set(frames):
            total[f] += n
    table = Table(title=f"{title}, 16 conns, {seconds} s, {r.rps:,.0f} req/s, "
                  f"{samples} samples of the event-loop thread")  # fmt: skip
    for col in ("function (file:line)", "own %", "total %"):
        table.add_column(col, justify="left" if col.startswith("function") else "right")
    for frame, n in own.most_common(25):
        table.add_row(frame[:110], f"{100 * n / samples:.1f}", f"{100 * total[frame] / samples:.1f}")
    Console(width=160).print(table)
    cum = Table(title="the same, by samples under each function (top 25)")
    cum.add_column("function (file:line)")
    cum.add_column("total %", justify="right")
    for frame, n in total.most_common(25):
        cum.add_row(frame[:110], f"{100 * n / samples:.1f}")
    Console(width=160).print(cum)


# -- measuring -------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Sample:
    """One cell's measurement in one round."""

    result: WrkResult
    cpu_us: dict[str, float]  # group -> CPU us per request
    service_conns: int | None = None  # connections to the ext_authz service opened (ConnectionCounter)


def measure(gw: Gateway, script: Path, conns: int, duration_s: int, backend: list[int]) -> Sample:
    """wrk against ``gw`` and the CPU per request of each of its process groups and the backend."""
    groups = {**gw.procs, "backend": backend}
    counter = ConnectionCounter(*gw.service) if gw.service is not None else contextlib.nullcontext()
    before = {k: tree_cpu_s(v) for k, v in groups.items()}
    with counter:
        r = wrk(gw.url, script, conns, duration_s, timeout_s=10)
    n = max(r.requests, 1)
    return Sample(
        result=r,
        cpu_us={k: (tree_cpu_s(v) - before[k]) / n * 1e6 for k, v in groups.items()},
        service_conns=len(counter.opened) if isinstance(counter, ConnectionCounter) else None,
    )


def interleaved(
    cells: list[tuple[str, str, int]],
    rounds: int,
    rng: random.Random,
    run: Callable[[tuple[str, str, int]], T],
) -> dict[tuple[str, str, int], list[T]]:
    """Each of ``cells`` (name, prompts, connections) run once per round, in an order shuffled anew every
    round (so the shared machine's noise falls on all alike): the results per cell, in round order."""
    say = Console(stderr=True).log
    out: dict[tuple[str, str, int], list[T]] = {}
    order = list(cells)
    for r in range(rounds):
        rng.shuffle(order)
        for i, cell in enumerate(order):
            say(f"round {r + 1}/{rounds} cell {i + 1}/{len(order)}: {cell[0]}, {cell[1]}, {cell[2]} conns")
            out.setdefault(cell, []).append(run(cell))
    return out


def _median(samples: list[Sample], get: Callable[[Sample], float]) -> float:
    return statistics.median(get(s) for s in samples)


def print_table(
    gateways: list[Gateway],
    cells: dict[tuple[str, str, int], list[Sample]],
    conns: list[int],
    *,
    duration: int,
    rounds: int,
) -> None:
    """The table of the module docstring."""
    table = Table(
        title=f"gateway overhead: POST {CHAT_PATH}, {len(chat_body())} B body, {duration} s per cell, "
        f"median of {rounds} rounds, cells shuffled per round"
    )
    cols = ["gateway", "prompts", "conns", "req/s", "p50 ms", "p99 ms", "bad", "CPU us/req gateway"]
    cols += ["of it envoy", "of it python", "backend", "req/s / alone", "p50 - alone", "CPU / alone"]
    cols += ["new conns to svc"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("gateway", "prompts") else "right")

    def cpu(s: Sample, *groups: str) -> float:
        return sum(s.cpu_us.get(g, 0.0) for g in groups)

    own = ("gateway", "envoy", "python")
    for gw in gateways:
        for prompts in ("repeated", "unique"):
            for c in conns:
                got = cells.get((gw.name, prompts, c))
                if not got:
                    continue
                alone = cells.get(("envoy alone", prompts, c))
                rps = _median(got, lambda s: s.result.rps)
                p50 = _median(got, lambda s: s.result.p50_ms)
                gcpu = _median(got, lambda s: cpu(s, *own))
                ratios = ["-", "-", "-"]
                if alone and gw.name not in ("envoy alone", "nginx direct"):
                    ratios = [
                        f"{rps / _median(alone, lambda s: s.result.rps):.2f}x",
                        f"{p50 - _median(alone, lambda s: s.result.p50_ms):+.2f}",
                        f"{gcpu / _median(alone, lambda s: cpu(s, *own)):.1f}x",
                    ]
                bad = sum(s.result.non_2xx + s.result.socket_errors for s in got)
                table.add_row(
                    gw.name,
                    prompts,
                    str(c),
                    f"{rps:,.0f}",
                    f"{p50:.2f}",
                    f"{_median(got, lambda s: s.result.p99_ms):.2f}",
                    str(bad),
                    f"{gcpu:.0f}" if gw.name != "nginx direct" else "-",
                    f"{_median(got, lambda s: cpu(s, 'envoy')):.0f}" if "envoy" in gw.procs else "-",
                    f"{_median(got, lambda s: cpu(s, 'python')):.0f}" if "python" in gw.procs else "-",
                    f"{_median(got, lambda s: cpu(s, 'backend')):.0f}",
                    *ratios,
                    "-" if got[0].service_conns is None else str(max(s.service_conns or 0 for s in got)),
                )
    console = Console(width=220)
    console.print(table)
    notes = Table(title="what each gateway does per request; notes")
    notes.add_column("gateway")
    notes.add_column("per request")
    notes.add_column("note")
    for gw in gateways:
        notes.add_row(gw.name, gw.does, gw.note or "")
    console.print(notes)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) and print its tables."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--duration", type=int, default=4, help="seconds per cell and round (1-30)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all cells (1-10)")
    p.add_argument("--connections", default="1,16,64")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="skip the PyPI peers")
    p.add_argument("--only-peers", default="", help="comma-separated peer names to run (default: all)")
    p.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile-s", type=int, default=0, help="then py-spy the ext_authz service this long")
    p.add_argument("--baseline", default="", help="also run ext_authz from this git revision (A/B)")
    p.add_argument("--only-authz", action="store_true", help="only Envoy alone and the ext_authz gateways")
    args = p.parse_args(argv)
    setup = bench_setup(args, "gateway-bench-", ("wrk", "nginx"))
    if setup is None:
        return 1
    duration, rounds, conns, work, scripts = setup
    children: list[Child] = []
    stacks: list[Stack] = []
    gateways: list[Gateway] = []
    say = Console(stderr=True).log
    try:
        backend_port, alone_port, alone_admin = free_ports(3)
        nginx = start_nginx(work, backend_port)
        children.append(nginx)
        assert nginx.proc is not None
        backend = [nginx.proc.pid]
        gateways.append(
            Gateway(
                name="nginx direct",
                does="the backend itself: fixed JSON answer",
                url=f"http://127.0.0.1:{backend_port}{CHAT_PATH}",
            )
        )
        alone = start_envoy(
            work, "alone", alone_bootstrap(alone_port, alone_admin, backend_port), alone_port, 2
        )
        children.append(alone)
        assert alone.proc is not None
        gateways.append(
            Gateway(
                name="envoy alone",
                does="Envoy 1.40, 2 workers, static route, router only",
                url=f"http://127.0.0.1:{alone_port}{CHAT_PATH}",
                procs={"envoy": [alone.proc.pid]},
            )
        )
        runs: list[tuple[str, str, bool, Path | None]] = [(*g, None) for g in INFERLB]
        if args.only_authz:
            runs = [r for r in runs if r[1] == "ext_authz"]
        if args.baseline:
            runs.append(
                (
                    f"inferlb ext_authz @{args.baseline}",
                    "ext_authz",
                    False,
                    baseline_tree(work, args.baseline),
                )
            )
        for i, (name, protocol, accounting, tree) in enumerate(runs):
            say(f"starting {name}")
            base_id = (os.getpid() % 5_000) * 10 + 5 + i
            stack = start_inferlb(
                work, name, protocol, accounting=accounting, backend=backend_port, base_id=base_id, tree=tree
            )
            stacks.append(stack)
            pids = {c.name: c.proc.pid for c in stack.children if c.proc is not None}
            gw = Gateway(
                name=name,
                does=INFERLB_DOES[protocol] + METERING[protocol][accounting],
                url=f"http://{stack.config.gateway.listen}{CHAT_PATH}",
                procs={
                    "envoy": [pids["envoy"]],
                    "python": [pid for n, pid in pids.items() if n.startswith(("ext_proc", "ext_authz"))],
                    "gateway": [pid for n, pid in pids.items() if n == "xds_server"],
                },
                service=(pids["ext_authz"], stack.config.ext_proc.listen.port)
                if protocol == "ext_authz" and "ext_authz" in pids
                else None,
            )
            problem = wait_ready(gw.url, None, 20)
            if problem is not None:
                raise RuntimeError(f"{name} does not answer 200: {problem}")
            gateways.append(gw)
        if args.peers and not args.only_authz:
            only = {x.strip() for x in args.only_peers.split(",") if x.strip()}
            for peer in PEERS:
                if only and peer.name not in only:
                    continue
                say(f"starting {peer.name}")
                gw, child = start_peer(peer, work, backend_port, args.peers_dir)
                if child is not None:
                    children.append(child)
                elif gw.note:
                    say(f"{peer.name}: {gw.note}")
                gateways.append(gw)
        live = [gw for gw in gateways if gw.url and (gw.procs or gw.name == "nginx direct")]
        for gw in live:  # warm-up: connections, pools and caches
            for script in scripts.values():
                wrk(gw.url, script, 4, 1, timeout_s=10)
        by_name = {gw.name: gw for gw in live}
        cells = interleaved(
            [(gw.name, prompts, c) for gw in live for prompts in scripts for c in conns],
            rounds,
            random.Random(args.seed),
            lambda cell: measure(by_name[cell[0]], scripts[cell[1]], cell[2], duration, backend),
        )
        print_table(gateways, cells, conns, duration=duration, rounds=rounds)
        authz = next(gw for gw in gateways if gw.name == "inferlb ext_authz, metered")
        for prompts, script in scripts.items() if args.profile_s > 0 else ():
            title = f"py-spy, inferlb ext_authz service behind Envoy, {prompts} prompts"
            seconds = min(args.profile_s, 60)
            py_spy_profile(authz.procs["python"][0], authz.url, script, seconds, work, title=title)
    finally:
        for stack in stacks:
            stack.stop()
        for child in reversed(children):
            child.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
