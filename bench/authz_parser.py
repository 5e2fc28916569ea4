"""The ext_authz service's HTTP parser: httptools (the product's :class:`ext_authz.server.CheckProtocol`) vs
h11 (:class:`H11CheckProtocol` below, same behaviour) serving the same checks.

Run: ``.venv/bin/python bench/authz_parser.py [--duration 4] [--rounds 3] [--connections 1,16,64]
[--profile-s 0]`` (needs ``wrk``). Prints one table; not a test.

Set-up, all on 127.0.0.1: two ``python -m ext_authz`` processes on the same config (one model, one tenant
with the quota limits of ``bench/gateway_overhead.py``: every request is admitted, reserved and settled),
one as shipped (httptools), one with its protocol class swapped for :class:`H11CheckProtocol` (this file,
``--serve h11``). No Envoy: wrk sends what Envoy's ext_authz HTTP service sends (the client's method, path,
headers and buffered ~3 KB chat body, keep-alive), repeated or unique prompts (wrk's Lua script, as in
``gateway_overhead.py``). Each cell (parser x prompts x connections) runs ``--duration`` s once per
round, the cells shuffled anew every round; each figure is the median over the rounds. CPU is the
service process's user + system time over the cell divided by the checks answered.

``--profile-s N``: afterwards, py-spy (when installed) samples the httptools service's event-loop thread
(not the idle metrics, poller and pool threads; GIL held or not, so tiktoken's Rust counts) for N s under
wrk at
16 connections, repeated then unique prompts, and prints the top functions (by their first line) by own
samples and by samples under them.

:class:`H11CheckProtocol` keeps the product's bounds: keep-alive (h11's own cycle), the body cap (413),
the head cap (h11's ``max_incomplete_event_size`` = :data:`ext_authz.server.MAX_HEADER_BYTES`, 431),
malformed HTTP 400, each with the product's OpenAI JSON error and the connection closed; a check that
must await pauses reading until it is answered (h11 buffers what arrived; answers stay in order).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import h11
from extproc_overhead import WrkResult, cpu_s, wrk
from gateway_overhead import CHAT_PATH, bench_setup, inferlb_config, interleaved, post, py_spy_profile
from rich.console import Console
from rich.table import Table

from ext_authz import server as product
from ext_authz.check import CheckAnswer, CheckRequest, CheckService
from inferlb.ops.stack import Child, free_ports

PARSERS = ("httptools", "h11")


class H11CheckProtocol(asyncio.Protocol):
    """One connection from Envoy, parsed by h11 (module docstring); the product's
    :class:`~ext_authz.server.CheckProtocol` with h11 in place of httptools."""

    def __init__(self, service: CheckService, server: product.CheckServer) -> None:
        self._service = service
        self._server = server
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=product.MAX_HEADER_BYTES)
        self._transport: asyncio.Transport | None = None
        self._request: h11.Request | None = None
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._waiting: asyncio.Future[CheckAnswer] | None = None
        self._closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Asyncio's callback: the connection is open."""
        self._transport = cast(asyncio.Transport, transport)
        self._server.connections.add(cast(product.CheckProtocol, self))

    def connection_lost(self, exc: Exception | None) -> None:
        """Asyncio's callback: the connection is gone."""
        self._transport = None
        self._server.forget(cast(product.CheckProtocol, self))

    def data_received(self, data: bytes) -> None:
        """Asyncio's callback: bytes arrived."""
        self._conn.receive_data(data)
        self._run()

    def eof_received(self) -> bool | None:
        """Asyncio's callback: the peer closed its side."""
        self._conn.receive_data(b"")
        self._run()
        return None

    def _run(self) -> None:
        """Handle the events h11 has until a check must wait or more bytes are needed."""
        while self._waiting is None and self._transport is not None:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                if status == 431:
                    self._fail(431, f"The request headers are larger than {product.MAX_HEADER_BYTES} bytes.",
                               "headers_too_large")  # fmt: skip
                else:
                    self._fail(400, f"Malformed HTTP request: {exc}", "invalid_http")
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                if self._closing and self._conn.their_state is h11.IDLE:
                    self._transport.close()
                return
            if isinstance(event, h11.Request):
                self._request, self._body, self._body_bytes = event, [], 0
            elif isinstance(event, h11.Data):
                self._body_bytes += len(event.data)
                limit = self._service.state.gateway.max_body_bytes
                if self._body_bytes > limit:
                    self._fail(413, "The request body is larger than the gateway accepts: "
                               f"limit {limit} bytes.", "request_too_large")  # fmt: skip
                    return
                self._body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._answer_request()
            elif isinstance(event, h11.ConnectionClosed):
                self._transport.close()
                return

    def _answer_request(self) -> None:
        req = self._request
        assert req is not None
        headers: dict[str, str] = {}
        for name, value in req.headers:  # h11 lower-cases the names
            headers[name.decode("latin-1")] = value.decode("utf-8", "replace")
        out = self._service.check(
            CheckRequest(
                method=req.method.decode("latin-1"),
                path=req.target.decode("utf-8", "replace"),
                headers=headers,
                body=b"".join(self._body),
            )
        )
        if isinstance(out, CheckAnswer):
            self._write(out)
            return
        self._waiting = out
        assert self._transport is not None
        self._transport.pause_reading()
        out.add_done_callback(self._finish)

    def _finish(self, done: asyncio.Future[CheckAnswer]) -> None:
        self._waiting = None
        if self._transport is None:
            return
        if done.cancelled():
            self._transport.abort()
            return
        self._write(done.result())
        if self._transport is not None:
            self._transport.resume_reading()
            self._run()

    def _write(self, answer: CheckAnswer) -> None:
        transport = self._transport
        assert transport is not None
        headers = [*answer.headers, ("content-length", str(len(answer.body)))]
        data = self._conn.send(h11.Response(status_code=answer.status, headers=headers))
        if answer.body:
            data = (data or b"") + (self._conn.send(h11.Data(data=answer.body)) or b"")
        data = (data or b"") + (self._conn.send(h11.EndOfMessage()) or b"")
        transport.write(data)
        if self._conn.our_state is h11.MUST_CLOSE:
            transport.close()
            self._transport = None
            return
        self._conn.start_next_cycle()

    def _fail(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with the product's JSON error and close (the connection is not reusable)."""
        if self._transport is not None:
            self._transport.write(product.protocol_error(status, message, code))
            self._transport.close()
            self._transport = None

    def shutdown(self) -> None:
        """Close once the answer owed is written (at once when idle)."""
        self._closing = True
        if self._waiting is None and self._transport is not None and self._conn.their_state is h11.IDLE:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now."""
        if self._transport is not None:
            self._transport.abort()


class H11CheckServer(product.CheckServer):
    """:class:`ext_authz.server.CheckServer` accepting :class:`H11CheckProtocol` connections."""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` and return the bound port."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: H11CheckProtocol(self.service, self), host, port)
        self._server = server  # the base class closes it
        return int(server.sockets[0].getsockname()[1])


def serve(parser: str, argv: list[str]) -> int:
    """``python -m ext_authz`` with ``argv``, on ``parser`` (h11: :class:`H11CheckServer` in place of the
    product's server class)."""
    import ext_authz.__main__ as service  # noqa: PLC0415  # only the server processes need it

    if parser == "h11":
        service.CheckServer = H11CheckServer  # type: ignore[misc]  # the one seam the bench swaps
    return service.main(argv)


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One cell's measurement in one round."""

    result: WrkResult
    cpu_us: float


def start_service(work: Path, parser: str, config: Path) -> tuple[Child, str]:
    """One ext_authz process on ``parser`` and its check URL, answering."""
    port, metrics = free_ports(2)
    argv = [sys.executable, __file__, "--serve", parser, "--config", str(config)]
    argv += ["--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}"]
    child = Child(parser, [*argv, "--log-level", "warning"], work / f"{parser}.log")
    child.start(dict(os.environ))
    url = f"http://127.0.0.1:{port}{CHAT_PATH}"
    deadline = time.monotonic() + 30
    while True:
        try:
            status, text = post(url, timeout_s=5)
            if status != 200:
                raise RuntimeError(f"{parser}: HTTP {status}: {text}")
            return child, url
        except OSError:
            if child.exited() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{parser} did not start:\n{child.log_tail()}") from None
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) and print its table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--duration", type=int, default=4, help="seconds per cell and round (1-30)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all cells (1-10)")
    p.add_argument("--connections", default="1,16,64")
    p.add_argument("--profile-s", type=int, default=0, help="py-spy the httptools service this long")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--serve", choices=PARSERS, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.serve:
        return serve(args.serve, rest)
    setup = bench_setup(args, "authz-parser-", ("wrk",))
    if setup is None:
        return 1
    duration, rounds, conns, work, scripts = setup
    (backend,) = free_ports(1)  # never contacted: no Envoy here
    config = inferlb_config(work, "authz", backend, protocol="ext_authz", accounting=False)
    children: dict[str, tuple[Child, str]] = {}
    try:
        for parser in PARSERS:
            children[parser] = start_service(work, parser, config)
        for _child, url in children.values():
            for script in scripts.values():
                wrk(url, script, 4, 1)

        def run(cell: tuple[str, str, int]) -> Sample:
            child, url = children[cell[0]]
            assert child.proc is not None
            before = cpu_s([child.proc.pid])
            res = wrk(url, scripts[cell[1]], cell[2], duration)
            used = (cpu_s([child.proc.pid]) - before) / max(res.requests, 1) * 1e6
            return Sample(result=res, cpu_us=used)

        order = [(parser, prompts, c) for parser in PARSERS for prompts in scripts for c in conns]
        cells = interleaved(order, rounds, random.Random(args.seed), run)
        table = Table(
            title=f"ext_authz HTTP parser: same checks, wrk direct (no Envoy), {duration} s per cell, "
            f"median of {rounds} rounds, cells shuffled per round"
        )
        cols = ["parser", "prompts", "conns", "checks/s", "p50 ms", "p99 ms", "non-2xx", "CPU us/check"]
        for col in [*cols, "h11 / httptools CPU", "h11 / httptools checks/s"]:
            table.add_column(col, justify="left" if col in ("parser", "prompts") else "right")
        for prompts in scripts:
            for c in conns:
                base = cells[("httptools", prompts, c)]
                for parser in PARSERS:
                    got = cells[(parser, prompts, c)]
                    cpu = statistics.median(s.cpu_us for s in got)
                    rps = statistics.median(s.result.rps for s in got)
                    ratio = ["-", "-"]
                    if parser == "h11":
                        ratio = [
                            f"{cpu / statistics.median(s.cpu_us for s in base):.2f}x",
                            f"{rps / statistics.median(s.result.rps for s in base):.2f}x",
                        ]
                    table.add_row(
                        parser,
                        prompts,
                        str(c),
                        f"{rps:,.0f}",
                        f"{statistics.median(s.result.p50_ms for s in got):.2f}",
                        f"{statistics.median(s.result.p99_ms for s in got):.2f}",
                        str(sum(s.result.non_2xx + s.result.socket_errors for s in got)),
                        f"{cpu:.0f}",
                        *ratio,
                    )
        Console(width=180).print(table)
        if args.profile_s > 0:
            child, url = children["httptools"]
            assert child.proc is not None
            for prompts, script in scripts.items():
                title = f"py-spy, httptools service, wrk direct, {prompts} prompts"
                py_spy_profile(child.proc.pid, url, script, min(args.profile_s, 60), work, title=title)
    finally:
        for child, _ in children.values():
            child.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
