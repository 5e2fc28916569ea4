"""CPU cost of inferlb's ext_proc service per request, in-process, without Envoy.

Run: ``.venv/bin/python bench/extproc_cpu.py [--requests 3000] [--rounds 5] [--concurrency 16]
[--callgrind-requests 300] [--profile 3000] [--sse]``. Prints rich tables; not a test.

Set-up, all on 127.0.0.1: the real ext_proc servicer (:func:`ext_proc.servicer.add_to_server` on
:func:`ext_proc.servicer.make_server`, in-process quota store, metrics on) runs in a **subprocess** with a
one-model, one-tenant config (the model and tenant of ``bench/extproc_overhead.py``). This process is the
client: a grpc aio stub sending, on one ``Process`` stream per request, the message sequence Envoy sends
with the gateway's processing mode and response accounting on (the default):

1. request headers (the pseudo-headers and the headers Envoy forwards for a ``wrk`` POST: authority,
   scheme, content-type, content-length, authorization, x-forwarded-for/-proto, x-request-id,
   x-envoy-internal), with ``protocol_config`` as Envoy >= 1.32 sends on the first message;
2. the BUFFERED request body (a ~3 KB chat completion: system prompt + one user turn, ``max_tokens`` 16);
3. response headers (``:status`` 200, content type, content-length, date, server,
   x-envoy-upstream-service-time);
4. the response body: one BUFFERED message with ``end_of_stream`` (a JSON completion with ``usage``: ext_proc
   asks for a buffered body at the response headers), or with ``--sse`` a STREAMED completion (one chunk
   per SSE event, the last with ``end_of_stream``).

Each message waits for its answer before the next is sent, as Envoy does. ``--concurrency`` streams run
at once (Envoy multiplexes its workers' streams on one HTTP/2 connection; so does this client).

Measures:

- **CPU us/request** of the server process: ``psutil`` user + system time over ``--requests`` requests
  after a warm-up, per round; median and min over ``--rounds``. The client's own CPU is shown beside it.
- **instructions/request** (when ``valgrind`` is installed): the server runs under
  ``valgrind --tool=callgrind --instr-atstart=no``; after the warm-up, ``callgrind_control -i on`` starts
  collection, ``--callgrind-requests`` requests run, and the dumped total (``Ir``) is divided by them. It is
  an instruction count, so it hardly moves when other work loads the machine (unlike CPU time, which
  shares caches and frequency with it).
- ``--profile N``: the server runs under cProfile for N requests after the warm-up; the top functions by
  own time are printed (where the remaining time goes).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import json
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc_overhead import API_KEY, MODEL, REPLY, chat_body  # the same model, tenant, body and reply
from rich.console import Console
from rich.table import Table

from ext_proc.process import run_event_loop

CONFIG: dict[str, Any] = {
    "models": [{"name": MODEL}],
    "endpoints": [{"address": "127.0.0.1:9", "model": MODEL, "gpu": "H100"}],
    "tenants": [{"name": "bench", "api_keys": [API_KEY]}],
    "ext_proc": {"protocol": "ext_proc", "account_responses": True},
}
SSE_WORDS = ("Hello", " there", ",", " how", " can", " I", " help", " you", " today", "?")


def _hmap(pairs: list[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def _sse_chunks() -> list[bytes]:
    chunks = []
    for i, word in enumerate(SSE_WORDS):
        doc = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}],
        }
        if i == 0:
            doc["choices"][0]["delta"]["role"] = "assistant"
        chunks.append(f"data: {json.dumps(doc)}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": 700, "completion_tokens": 10, "total_tokens": 710}}
    chunks.append(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return chunks


def envoy_messages(body: bytes, *, sse: bool) -> list[ep.ProcessingRequest]:
    """The ``ProcessingRequest`` sequence of one request, as Envoy sends it (module docstring)."""
    request_headers = [
        (":authority", "127.0.0.1:10000"),
        (":path", "/v1/chat/completions"),
        (":method", "POST"),
        (":scheme", "http"),
        ("user-agent", "wrk"),
        ("content-type", "application/json"),
        ("authorization", f"Bearer {API_KEY}"),
        ("content-length", str(len(body))),
        ("x-forwarded-for", "127.0.0.1"),
        ("x-forwarded-proto", "http"),
        ("x-envoy-internal", "true"),
        ("x-request-id", str(uuid.uuid4())),
    ]
    msgs = [
        ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(headers=_hmap(request_headers)),
            protocol_config=ep.ProtocolConfiguration(
                request_body_mode=2,  # BUFFERED
                response_body_mode=1,  # STREAMED
            ),
        ),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
    ]
    if sse:
        chunks = _sse_chunks()
        content_type, length = "text/event-stream", None
    else:
        chunks = [json.dumps(REPLY).encode()]
        content_type, length = "application/json", str(len(chunks[0]))
    response_headers = [(":status", "200"), ("content-type", content_type)]
    if length is not None:
        response_headers.append(("content-length", length))
    response_headers += [
        ("date", "Mon, 01 Jan 2024 00:00:00 GMT"),
        ("server", "envoy"),
        ("x-envoy-upstream-service-time", "0"),
    ]
    msgs.append(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=_hmap(response_headers))))
    for i, chunk in enumerate(chunks):
        msgs.append(
            ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=i == len(chunks) - 1))
        )
    return msgs


# -- the server process ---------------------------------------------------------------------------
async def _serve(profile_path: str | None, reset_wait_s: float | None) -> None:
    # imported here so the client process does not pay for tiktoken and the config models
    from ext_proc.servicer import RESET_WAIT_S, ExtProcState, add_to_server, make_server  # noqa: PLC0415
    from inferlb.config.schema import parse_config  # noqa: PLC0415

    state = ExtProcState(parse_config(CONFIG))
    state.gateway.counter.count("warm up the encoding")
    server = make_server()
    add_to_server(server, state, reset_wait_s=RESET_WAIT_S if reset_wait_s is None else reset_wait_s)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    profiler = cProfile.Profile() if profile_path else None
    if profiler is not None:
        # SIGUSR1 starts the profile (after the client's warm-up)
        loop.add_signal_handler(signal.SIGUSR1, profiler.enable)
    print(port, flush=True)
    await stop.wait()
    if profiler is not None and profile_path:
        profiler.disable()
        profiler.dump_stats(profile_path)
    await server.stop(0.5)


# -- the client -----------------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    pid: int  # the process doing the work (valgrind runs python in its own pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(
    prefix: list[str],
    *,
    profile_path: str | None = None,
    timeout_s: float = 30,
    reset_wait_s: float | None = None,
) -> Server:
    """The ext_proc server in a subprocess (``prefix``: a command to run it under, e.g. valgrind), once it
    listens; ``reset_wait_s``: the servicer's wait for a reset after a stream's last answer (seconds; None:
    its default).

    Raises:
        RuntimeError: it did not print its port within ``timeout_s``.
    """
    cmd = [*prefix, sys.executable, __file__, "--serve"]
    if profile_path:
        cmd += ["--profile-out", profile_path]
    if reset_wait_s is not None:
        cmd += ["--reset-wait-s", str(reset_wait_s)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).parents[1]
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.strip().isdigit():
            break
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"the ext_proc server did not start ({' '.join(cmd)})")
    return Server(proc=proc, port=int(line), pid=proc.pid)


class Workload:
    """The messages of each request: the same body every time, or (``unique``) a user turn that no other
    request of the run repeats (the system prompt still repeats, as in real traffic)."""

    def __init__(self, *, body_bytes: int, sse: bool, unique: bool) -> None:
        self.body_bytes, self.sse, self.unique = body_bytes, sse, unique
        self._serial = itertools.count()
        body = chat_body(body_bytes).encode()
        self.fixed = envoy_messages(body, sse=sse)

    def next(self) -> list[ep.ProcessingRequest]:
        """The messages of the next request."""
        if not self.unique:
            return self.fixed
        body = chat_body(self.body_bytes, next(self._serial)).encode()
        return envoy_messages(body, sse=self.sse)


async def run_requests(port: int, n: int, concurrency: int, work: Workload) -> int:
    """Send ``n`` requests over ``concurrency`` concurrent streams; returns the requests whose every message
    was answered with a continue (no immediate response)."""
    ok = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        todo = iter(range(n))

        async def worker() -> None:
            nonlocal ok
            for _ in todo:
                call = stub.Process()
                good = True
                for m in work.next():
                    await call.write(m)
                    resp = await call.read()
                    if resp is grpc.aio.EOF or resp.HasField("immediate_response"):
                        good = False
                        break
                await call.done_writing()
                call.cancel()  # Envoy resets the stream after its last message
                ok += good

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def measure_cpu(args: argparse.Namespace, work: Workload) -> dict[str, float]:
    server = start_server([], reset_wait_s=args.reset_wait_s)
    try:
        sproc = psutil.Process(server.pid)
        asyncio.run(run_requests(server.port, args.warmup, args.concurrency, work))
        per_req: list[float] = []
        client: list[float] = []
        for _ in range(args.rounds):
            s0, c0 = _cpu(sproc), time.process_time()
            ok = asyncio.run(run_requests(server.port, args.requests, args.concurrency, work))
            s1, c1 = _cpu(sproc), time.process_time()
            if ok != args.requests:
                raise RuntimeError(f"only {ok} of {args.requests} requests were continued")
            per_req.append((s1 - s0) / args.requests * 1e6)
            client.append((c1 - c0) / args.requests * 1e6)
    finally:
        server.stop()
    return {
        "median": statistics.median(per_req),
        "min": min(per_req),
        "max": max(per_req),
        "client": statistics.median(client),
    }


def _callgrind_total(path: Path) -> int:
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.match(r"(?:summary|totals):\s+(\d+)", line)
        if m:
            return int(m.group(1))
    raise RuntimeError(f"no instruction total in {path}")


def measure_instructions(args: argparse.Namespace, work: Workload) -> float | None:
    valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
    if valgrind is None or control is None:
        return None
    with tempfile.TemporaryDirectory(prefix="extproc-cg-") as tmp:
        out = Path(tmp) / "callgrind.out"
        prefix = [valgrind, "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p"]
        server = start_server(prefix, timeout_s=600, reset_wait_s=args.reset_wait_s)
        try:
            asyncio.run(run_requests(server.port, args.callgrind_warmup, 4, work))
            subprocess.run([control, "-i", "on", str(server.pid)], check=True, capture_output=True)
            n = args.callgrind_requests
            ok = asyncio.run(run_requests(server.port, n, args.concurrency, work))
            subprocess.run([control, "-d", str(server.pid)], check=True, capture_output=True)
            subprocess.run([control, "-i", "off", str(server.pid)], check=True, capture_output=True)
            if ok != n:
                raise RuntimeError(f"only {ok} of {n} requests were continued under callgrind")
        finally:
            server.stop()
        dumps = sorted(p for p in Path(tmp).iterdir() if re.search(r"\.\d+\.\d+$", p.name))
        if not dumps:
            raise RuntimeError("callgrind wrote no dump")
        return _callgrind_total(dumps[0]) / n


def profile(args: argparse.Namespace, work: Workload, console: Console) -> None:
    with tempfile.TemporaryDirectory(prefix="extproc-prof-") as tmp:
        path = os.path.join(tmp, "server.prof")
        server = start_server([], profile_path=path, reset_wait_s=args.reset_wait_s)
        try:
            asyncio.run(run_requests(server.port, args.warmup, args.concurrency, work))
            os.kill(server.pid, signal.SIGUSR1)
            asyncio.run(run_requests(server.port, args.profile, args.concurrency, work))
        finally:
            server.stop()
        stats = pstats.Stats(path)
        table = Table(title=f"server profile, {args.profile} requests (top by own time)")
        for col in ("own s", "own us/req", "cum s", "calls/req", "function"):
            table.add_column(col, justify="right" if col != "function" else "left")
        entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
        total = sum(v[2] for _, v in entries)
        for (file, line, name), (_cc, nc, tt, ct, _callers) in entries[: args.profile_top]:
            where = f"{Path(file).name}:{line}({name})" if line else name
            table.add_row(
                f"{tt:.3f}", f"{tt / args.profile * 1e6:.1f}", f"{ct:.3f}", f"{nc / args.profile:.1f}", where
            )
        console.print(table)
        console.print(
            f"profiled own time in total: {total:.3f} s = {total / args.profile * 1e6:.0f} us/request"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    p.add_argument("--requests", type=int, default=3000, help="requests per CPU round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streams")
    p.add_argument("--body-bytes", type=int, default=3072)
    p.add_argument("--sse", action="store_true", help="a streamed (SSE) response instead of JSON")
    p.add_argument(
        "--unique", action="store_true", help="a different user turn in every request (no count-cache hits)"
    )
    p.add_argument("--callgrind-requests", type=int, default=300, help="0: skip callgrind")
    p.add_argument("--callgrind-warmup", type=int, default=50)
    p.add_argument("--profile", type=int, default=0, help="profile N requests (0: no profile)")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--label", default="", help="a name for this run in the table title")
    p.add_argument(
        "--reset-wait-s",
        type=float,
        default=None,
        help="the servicer's wait for the reset after a stream's last answer (default its own; 0: none)",
    )
    args = p.parse_args(argv)
    if args.serve:
        # the same event loop `python -m ext_proc` runs on (uvloop when installed)
        run_event_loop(_serve(args.profile_out, args.reset_wait_s))
        return 0

    console = Console(width=150)
    work = Workload(body_bytes=args.body_bytes, sse=args.sse, unique=args.unique)
    body = work.fixed[1].request_body.body
    cpu = measure_cpu(args, work)
    instructions = measure_instructions(args, work) if args.callgrind_requests > 0 else None
    title = f"ext_proc CPU per request{f' ({args.label})' if args.label else ''}"
    table = Table(title=title)
    for col in (
        "response",
        "body B",
        "msgs/req",
        "streams",
        "server CPU us/req (median, min-max)",
        "client CPU us/req",
        "server instr/req (callgrind)",
    ):
        table.add_column(col, justify="right")
    table.add_row(
        ("SSE" if args.sse else "JSON") + (", unique user turns" if args.unique else ", same body"),
        str(len(body)),
        str(len(work.fixed)),
        str(args.concurrency),
        f"{cpu['median']:.0f} ({cpu['min']:.0f}-{cpu['max']:.0f})",
        f"{cpu['client']:.0f}",
        "n/a (no valgrind)" if instructions is None else f"{instructions / 1e6:.2f} M",
    )
    console.print(table)
    console.print(
        f"{args.rounds} rounds x {args.requests} requests after {args.warmup} warm-up; "
        f"callgrind: {args.callgrind_requests} requests; load average {os.getloadavg()[0]:.2f}"
    )
    if args.profile > 0:
        profile(args, work, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
