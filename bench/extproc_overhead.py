"""What ext_proc costs on the request path: Envoy alone vs Envoy + inferlb's ext_proc.

Run: ``.venv/bin/python bench/extproc_overhead.py [--duration 5] [--connections 1,16,64] [--processes 1,2]``
(needs ``wrk``: ``apt-get install wrk``). Prints one table; not a test.

Set-up, all on 127.0.0.1:

- backend: an Envoy answering every request with a fixed chat completion (``direct_response``), so the
  backend costs next to nothing and never limits;
- ``envoy alone``: an Envoy with a static listener routing straight to the backend (router only);
- ``envoy + null ext_proc``: the same gateway (same Envoy config, same messages per request) with its
  ext_proc process replaced by a do-nothing processor: grpc aio on uvloop, the same ``read()``/``write()``
  loop, which answers every message with a bare continue except the request body, which it parses with
  ``json.loads`` to set the two routing headers (model, version). It is the floor any grpc-python
  processor pays here, measured in the same run; what inferlb's ext_proc costs above it is our code;
- ``envoy + ext_proc xN``: the real inferlb gateway (xds_server + Envoy configured over ADS with the
  ext_proc filter, ``inferlb.ops.stack.Stack``) with N ext_proc processes, each its own endpoint of the
  ext_proc cluster (``ext_proc.extra_listen``), routing to the same backend; response accounting on (the
  default: the response body goes through ext_proc too, its first chunk carrying the status);
- ``..., unmetered``: the same with ``ext_proc.account_responses`` off (quotas settled on the reservation,
  no response phases: two messages per request instead of four), for the real and the null processor.

Load: ``wrk`` POSTing a ~3 KB chat-completion body with a valid API key, for ``--duration`` seconds per
row, at each connection count. Columns: requests/s, latency p50/p99 (wrk's, ms), non-2xx answers, and
where the CPU went: CPU time (user + system, from ``/proc/PID/stat``) of the gateway Envoy, of all
ext_proc processes and of the backend over the row, divided by the requests served (us per request).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import HostPort, default_config_path
from inferlb.ops.stack import Child, Stack, find_envoy, free_ports, port_open

sys.path.insert(0, str(Path(__file__).parents[1]))

CLK_TCK = os.sysconf("SC_CLK_TCK")
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
MODEL = "bench-model"
API_KEY = "sk-bench-key-0001"
REPLY = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 0,
    "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 700, "completion_tokens": 1, "total_tokens": 701},
}


def chat_body(size: int = 3072, serial: int | None = None) -> str:
    """A chat completion request body of about ``size`` bytes (system prompt + one user turn); with
    ``serial``, the user turn starts with it, so no two requests share their user text."""
    filler = "The quick brown fox jumps over the lazy dog. "
    text = (filler * (size // len(filler) + 1))[: size - 200]
    if serial is not None:
        text = f"Request {serial}: {text}"[: size - 200]
    return json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": text},
            ],
            "max_tokens": 16,
        }
    )


def _static_listener(port: int, route: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "l",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                            "http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "bench",
                            "route_config": {
                                "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]
                            },
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {"@type": ROUTER_TYPE},
                                }
                            ],
                        },
                    }
                ]
            }
        ],
    }


def backend_bootstrap(port: int, admin: int) -> dict[str, Any]:
    route = {
        "match": {"prefix": "/"},
        "direct_response": {"status": 200, "body": {"inline_string": json.dumps(REPLY)}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [_static_listener(port, route)]},
    }


def alone_bootstrap(port: int, admin: int, backend: int) -> dict[str, Any]:
    route = {"match": {"prefix": "/"}, "route": {"cluster": "backend", "timeout": "30s"}}
    cluster = {
        "name": "backend",
        "type": "STATIC",
        "connect_timeout": "1s",
        "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_requests": 100000}]},
        "load_assignment": {
            "cluster_name": "backend",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": "127.0.0.1", "port_value": backend}}
                            }
                        }
                    ]
                }
            ],
        },
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [_static_listener(port, route)], "clusters": [cluster]},
    }


def start_envoy(work: Path, name: str, bootstrap: dict[str, Any], port: int, concurrency: int) -> Child:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(bootstrap), encoding="utf-8")
    base_id = (os.getpid() % 10_000) * 10 + (3 if name == "backend" else 4)
    argv = [find_envoy(), "-c", str(path), "--base-id", str(base_id), "--concurrency", str(concurrency)]
    return start_listening(Child(name, [*argv, "--log-level", "warning"], work / f"{name}.log"), port)


def start_listening(child: Child, port: int, timeout_s: float = 20) -> Child:
    """Start ``child`` and wait until 127.0.0.1:``port`` accepts connections (RuntimeError with its log
    after ``timeout_s`` or when it exits)."""
    child.start(dict(os.environ))
    deadline = time.monotonic() + timeout_s
    while not port_open(HostPort(host="127.0.0.1", port=port)):
        if child.exited() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} did not start:\n{child.log_tail()}")
        time.sleep(0.05)
    return child


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (their threads included)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))
    return total / CLK_TCK


@dataclass(frozen=True, kw_only=True)
class Row:
    scenario: str
    connections: int
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    cpu_us: dict[str, float]


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    if m is None:
        raise ValueError(f"wrk latency {text!r}")
    return float(m[1]) * _UNIT[m[2]]


@dataclass(frozen=True, kw_only=True)
class WrkResult:
    """What one wrk run printed."""

    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    requests: int


def wrk(url: str, script: Path, connections: int, duration_s: int, timeout_s: int = 2) -> WrkResult:
    """One bounded wrk run (2 threads, 1 at one connection) against ``url`` with ``script``; a request
    unanswered after ``timeout_s`` counts as a socket error."""
    threads = 1 if connections == 1 else 2
    argv = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration_s}s", "--latency"]
    argv += ["--timeout", f"{timeout_s}s", "-s", str(script), url]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=duration_s + timeout_s + 30, check=True
    ).stdout
    if "Latency Distribution" not in out:
        raise RuntimeError(f"wrk measured nothing at {url}:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return WrkResult(
        rps=float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]),  # type: ignore[index]
        p50_ms=_ms(re.search(r"^\s+50%\s+(\S+)", out, re.M)[1]),  # type: ignore[index]
        p99_ms=_ms(re.search(r"^\s+99%\s+(\S+)", out, re.M)[1]),  # type: ignore[index]
        non_2xx=int(bad[1]) if bad else 0,
        socket_errors=sum(int(x) for x in errors.groups()) if errors else 0,
        requests=int(re.search(r"(\d+) requests in", out)[1]),  # type: ignore[index]
    )


def run_wrk(
    url: str, script: Path, connections: int, duration_s: int
) -> tuple[float, float, float, int, int]:
    """(req/s, p50 ms, p99 ms, non-2xx, requests) of one wrk run (:func:`wrk`)."""
    r = wrk(url, script, connections, duration_s)
    return r.rps, r.p50_ms, r.p99_ms, r.non_2xx, r.requests


def measure(
    scenario: str, url: str, script: Path, *, conns: list[int], duration_s: int, procs: dict[str, list[int]]
) -> list[Row]:
    """One row per connection count: wrk at ``url`` and the CPU used per request by each group of
    ``procs`` (name -> pids)."""
    rows = []
    run_wrk(url, script, 4, 1)  # warm-up: connections, JIT-free but caches and pools
    for c in conns:
        before = {k: cpu_s(v) for k, v in procs.items()}
        rps, p50, p99, bad, total = run_wrk(url, script, c, duration_s)
        used = {k: (cpu_s(v) - before[k]) / max(total, 1) * 1e6 for k, v in procs.items()}
        rows.append(
            Row(scenario=scenario, connections=c, rps=rps, p50_ms=p50, p99_ms=p99, non_2xx=bad, cpu_us=used)
        )
    return rows


def serve_null(port: int, model: str, version: str) -> None:
    """Run the do-nothing ext_proc (module docstring) on 127.0.0.1:``port`` until SIGTERM."""
    # imported here: only the server process needs them
    import asyncio  # noqa: PLC0415
    import signal  # noqa: PLC0415

    import grpc  # noqa: PLC0415
    from envoy.config.core.v3 import base_pb2  # noqa: PLC0415
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: PLC0415
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: PLC0415

    from ext_proc.process import run_event_loop  # noqa: PLC0415
    from ext_proc.servicer import make_server  # noqa: PLC0415
    from inferlb.request import headers  # noqa: PLC0415

    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    answers = {
        "request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
        "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
        "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse()),
    }

    class Null(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # generated, untyped
        async def Process(self, request_iterator: Any, context: Any) -> None:  # gRPC's name
            read, write = context.read, context.write
            while True:
                req = await read()
                if req is grpc.aio.EOF:
                    return
                phase = req.WhichOneof("request")
                if phase == "request_body":
                    name = json.loads(req.request_body.body)["model"]
                    common = ep.CommonResponse(clear_route_cache=True)
                    for key, value in ((headers.MODEL, name), (headers.VERSION, version)):
                        common.header_mutation.set_headers.append(
                            base_pb2.HeaderValueOption(
                                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                append_action=overwrite,
                            )
                        )
                    await write(ep.ProcessingResponse(request_body=ep.BodyResponse(response=common)))
                else:
                    await write(answers[phase])

    async def main() -> int:
        server = make_server()
        ep_grpc.add_ExternalProcessorServicer_to_server(Null(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0.5)
        return 0

    run_event_loop(main())


def start_null(work: Path, listen: HostPort, version: str) -> Child:
    """Start :func:`serve_null` as a process on ``listen`` and wait until it accepts connections."""
    argv = [sys.executable, __file__, "--serve-null", str(listen.port), MODEL, version]
    child = Child("null ext_proc", argv, work / "null-ext-proc.log")
    child.start(dict(os.environ))
    deadline = time.monotonic() + 20
    while not port_open(listen):
        if child.exited() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the null ext_proc did not start:\n{child.log_tail()}")
        time.sleep(0.05)
    return child


def post_once(url: str) -> None:
    """One chat completion through the gateway; raises unless it answers 200."""
    probe = urllib.request.Request(
        url,
        data=chat_body().encode(),
        method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(probe, timeout=10) as resp:
        assert resp.status == 200


def gateway_config(work: Path, backend: int, processes: int, *, accounting: bool = True) -> Path:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    extra = processes - 1
    ports = free_ports(6 + 2 * extra)  # then each extra ext_proc process: its gRPC and its metrics port
    doc["gateway"].update(listen=f"127.0.0.1:{ports[0]}", admin=f"127.0.0.1:{ports[1]}")
    doc["xds"].update(listen=f"127.0.0.1:{ports[2]}", api_listen=f"127.0.0.1:{ports[3]}")
    doc["ext_proc"].update(
        protocol="ext_proc",  # this bench measures the ext_proc mode (gateway_overhead.py has both)
        listen=f"127.0.0.1:{ports[4]}",
        metrics_listen=f"127.0.0.1:{ports[5]}",
        extra_listen=[f"127.0.0.1:{p}" for p in ports[6 : 6 + extra]],
        extra_metrics_listen=[f"127.0.0.1:{p}" for p in ports[6 + extra :]],
    )
    doc["models"] = [{"name": MODEL}]
    doc["endpoints"] = [{"address": f"127.0.0.1:{backend}", "model": MODEL, "gpu": "H100"}]
    doc["tenants"] = [{"name": "bench", "api_keys": [API_KEY]}]
    doc["ext_proc"]["account_responses"] = accounting
    path = work / f"gateway-{processes}-{'metered' if accounting else 'unmetered'}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--duration", type=int, default=5, help="seconds per row (1-60)")
    p.add_argument("--connections", default="1,16,64")
    p.add_argument("--processes", default="1,2", help="ext_proc process counts to run")
    p.add_argument(
        "--no-unmetered",
        dest="unmetered",
        action="store_false",
        help="skip the rows with ext_proc.account_responses off",
    )
    p.add_argument(
        "--no-null", dest="null", action="store_false", help="skip the do-nothing processor's rows"
    )
    p.add_argument("--serve-null", nargs=3, metavar=("PORT", "MODEL", "VERSION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_null:
        serve_null(int(args.serve_null[0]), args.serve_null[1], args.serve_null[2])
        return 0
    if shutil.which("wrk") is None:
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 1
    duration = max(1, min(args.duration, 60))
    conns = [int(c) for c in args.connections.split(",")]
    work = Path(tempfile.mkdtemp(prefix="extproc-bench-"))
    script = work / "post.lua"
    script.write_text(
        f"wrk.method = 'POST'\nwrk.body = {json.dumps(chat_body())}\n"
        "wrk.headers['Content-Type'] = 'application/json'\n"
        f"wrk.headers['Authorization'] = 'Bearer {API_KEY}'\n",
        encoding="utf-8",
    )
    backend_port, backend_admin, alone_port, alone_admin = free_ports(4)
    children: list[Child] = []
    rows: list[Row] = []
    try:
        backend = start_envoy(
            work, "backend", backend_bootstrap(backend_port, backend_admin), backend_port, 1
        )
        children.append(backend)
        assert backend.proc is not None
        backend_pid = backend.proc.pid
        alone = start_envoy(
            work, "alone", alone_bootstrap(alone_port, alone_admin, backend_port), alone_port, 2
        )
        children.append(alone)
        assert alone.proc is not None
        url = f"http://127.0.0.1:{alone_port}/v1/chat/completions"
        rows += measure(
            "envoy alone",
            url,
            script,
            conns=conns,
            duration_s=duration,
            procs={"gateway envoy": [alone.proc.pid], "backend": [backend_pid]},
        )
        alone.stop()
        children.remove(alone)
        runs = [(n, True) for n in (int(x) for x in args.processes.split(","))]
        if args.unmetered:
            runs.append((1, False))
        for n, accounting in runs:
            cfg = gateway_config(work, backend_port, n, accounting=accounting)
            stack = Stack(cfg, workdir=work / f"stack-{n}-{accounting}", log_level="warning")
            suffix = "" if accounting else ", unmetered"
            try:
                stack.start(timeout_s=60)
                pids = {c.name: c.proc.pid for c in stack.children if c.proc is not None}
                url = f"http://{stack.config.gateway.listen}/v1/chat/completions"
                post_once(url)
                # the Stack starts one ext_proc process per address: ext_proc, ext_proc-2, ...
                real_pids = [pid for name, pid in pids.items() if name.startswith("ext_proc")]
                procs = {"gateway envoy": [pids["envoy"]], "ext_proc": real_pids, "backend": [backend_pid]}
                scenario = f"envoy + ext_proc x{n}{suffix}"
                rows += measure(scenario, url, script, conns=conns, duration_s=duration, procs=procs)
                if n == 1 and args.null:
                    # the same Envoy, its ext_proc process swapped for the do-nothing one on its address
                    real = next(c for c in stack.children if c.name == "ext_proc")
                    real.stop()
                    version = stack.config.models[0].versions[0].name
                    null = start_null(work, stack.config.ext_proc.listen, version)
                    children.append(null)
                    assert null.proc is not None
                    deadline = time.monotonic() + 20
                    while True:  # Envoy reconnects to the ext_proc cluster's endpoint
                        try:
                            post_once(url)
                            break
                        except (OSError, AssertionError):
                            if time.monotonic() > deadline:
                                raise
                            time.sleep(0.2)
                    procs["ext_proc"] = [null.proc.pid]
                    scenario = f"envoy + null ext_proc{suffix}"
                    null_rows = measure(scenario, url, script, conns=conns, duration_s=duration, procs=procs)
                    rows[-len(conns) : -len(conns)] = null_rows  # shown before the real processor's rows
                    null.stop()
                    children.remove(null)
            finally:
                stack.stop(keep_workdir=True)
    finally:
        for c in children:
            c.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = Table(
        title=f"ext_proc overhead: POST /v1/chat/completions, {len(chat_body())} B body, {duration} s per row"
    )
    for col in (
        "scenario",
        "conns",
        "req/s",
        "p50 ms",
        "p99 ms",
        "non-2xx",
        "CPU us/req envoy",
        "CPU us/req ext_proc",
        "CPU us/req backend",
    ):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for r in rows:
        table.add_row(
            r.scenario,
            str(r.connections),
            f"{r.rps:,.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            str(r.non_2xx),
            f"{r.cpu_us.get('gateway envoy', 0):.0f}",
            f"{r.cpu_us['ext_proc']:.0f}" if "ext_proc" in r.cpu_us else "-",
            f"{r.cpu_us.get('backend', 0):.0f}",
        )
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
