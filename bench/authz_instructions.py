"""Instructions per ext_authz check, counted by valgrind (callgrind), this tree against a baseline revision.

Run: ``.venv/bin/python bench/authz_instructions.py [--baseline REV] [--checks 300] [--unique-checks 100]``
(needs ``valgrind``). Prints one table; not a test. ~2-4 min.

Why instructions: on a shared machine the CPU time of a check moves by 30% from one second to the next
with the neighbours' load; the instructions a check executes do not (two runs agree within 0.1%). What
it counts: the service's Python path of one check, in-process, with no sockets: the wire bytes of Envoy's
HTTP authorization request (``POST /v1/chat/completions``, the ~3 KB chat body of
``bench/gateway_overhead.py``, the tenant's API key) fed to :class:`ext_authz.server.CheckProtocol`
(httptools parsing, the check, the answer's encoding) whose transport only keeps what it is given. The
kernel's share (the answer's ``send()``, ~30% of a check's CPU behind Envoy) and uvloop's reads are not
in it. ``repeated``: the same body every check (the prompt count cached); ``unique``: each body's user turn
starts with its own serial number (tiktoken's BPE every check).

Each cell is one process under ``valgrind --tool=callgrind --collect-atstart=no
--toggle-collect=functools_reduce``: the checks run inside one ``functools.reduce`` call, so only they are
counted (start-up, imports and the tokenizer's load are not), after one check that warms the caches. The
baseline runs from ``git archive REV`` (``PYTHONPATH``), the same script driving it. Each process also
prints the SHA-256 of every answer it wrote, so the table says whether both trees answered byte for byte
the same (the same decisions and headers).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
MODES = ("repeated", "unique")


def run_checks(mode: str, n: int) -> str:
    """Feed ``n`` checks to one :class:`~ext_authz.server.CheckProtocol` inside ``functools.reduce`` (the
    part callgrind counts); the SHA-256 of the answers."""
    sys.path.insert(0, str(HERE))
    import yaml  # noqa: PLC0415  # the child only: the tree under test is on PYTHONPATH
    from extproc_overhead import API_KEY, MODEL, chat_body  # noqa: PLC0415
    from gateway_overhead import CHAT_PATH, HIGH_LIMITS  # noqa: PLC0415

    from ext_authz.check import CheckService  # noqa: PLC0415
    from ext_authz.server import CheckProtocol, CheckServer  # noqa: PLC0415
    from ext_proc.state import ExtProcState  # noqa: PLC0415
    from inferlb.config.schema import default_config_path, parse_config  # noqa: PLC0415

    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["ext_proc"].update(protocol="ext_authz", account_responses=False)
    doc["models"] = [{"name": MODEL}]
    doc["endpoints"] = [{"address": "127.0.0.1:9", "model": MODEL, "gpu": "H100"}]
    doc["tenants"] = [{"name": "bench", "api_keys": [API_KEY], **HIGH_LIMITS}]
    service = CheckService(ExtProcState(parse_config(doc)))
    proto = CheckProtocol(service, CheckServer(service))
    written: list[bytes] = []

    class Transport:
        """Keeps what the protocol writes."""

        def write(self, data: bytes) -> None:
            written.append(data)

        def pause_reading(self) -> None: ...
        def resume_reading(self) -> None: ...
        def close(self) -> None: ...

    proto.connection_made(Transport())  # type: ignore[arg-type]

    def wire(body: str) -> bytes:
        raw = body.encode()
        head = (
            f"POST {CHAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(raw)}\r\n\r\n"
        )
        return head.encode() + raw

    reqs = [wire(chat_body())] * n if mode == "repeated" else [wire(chat_body(serial=i)) for i in range(n)]
    proto.data_received(wire(chat_body()))  # the tokenizer's load and the caches' first fill
    functools.reduce(lambda _, data: proto.data_received(data), reqs, None)
    if len(written) != n + 1:
        raise RuntimeError(f"{len(written)} answers to {n + 1} checks")
    return hashlib.sha256(b"".join(written)).hexdigest()


def count(tree: Path, mode: str, n: int) -> tuple[float, str]:
    """(instructions per check, answers' SHA-256) of ``n`` checks run from ``tree`` under callgrind.

    Raises:
        RuntimeError: the run failed or callgrind printed no count.
    """
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce"]
    cmd += ["--callgrind-out-file=/dev/null", sys.executable, __file__, "--child", mode, str(n)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False)
    found = re.search(r"Collected : ([\d,]+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{tree} {mode}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return int(found.group(1).replace(",", "")) / n, proc.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) and print its table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--baseline", default="", help="git revision to compare with (none: this tree only)")
    p.add_argument("--checks", type=int, default=300, help="repeated-prompt checks per run (10-5000)")
    p.add_argument("--unique-checks", type=int, default=100, help="unique-prompt checks per run (10-2000)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(run_checks(args.child[0], int(args.child[1])))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind not found: apt-get install valgrind", file=sys.stderr)
        return 1
    checks = {"repeated": max(10, min(args.checks, 5000)), "unique": max(10, min(args.unique_checks, 2000))}
    work = Path(tempfile.mkdtemp(prefix="authz-instructions-"))
    try:
        trees = {"this tree": HERE.parent}
        if args.baseline:
            base = work / "baseline"
            base.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(HERE.parent), "archive", args.baseline], check=True, capture_output=True
            )
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
            trees = {f"@{args.baseline}": base, **trees}
        cells = [(name, mode) for mode in MODES for name in trees]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = {c: pool.submit(count, trees[c[0]], c[1], checks[c[1]]) for c in cells}
            got = {c: f.result() for c, f in futures.items()}
        table = Table(
            title="ext_authz: instructions per check in-process (callgrind; no sockets), "
            f"{checks['repeated']} repeated / {checks['unique']} unique-prompt checks per run"
        )
        for col in ("tree", "prompts", "K instructions / check", "vs baseline", "answers (SHA-256)"):
            table.add_column(col, justify="right" if col.startswith(("K", "vs")) else "left")
        for name, mode in cells:
            per, digest = got[(name, mode)]
            first = got[(next(iter(trees)), mode)]
            same = "" if len(trees) == 1 else (" same as baseline" if digest == first[1] else " DIFFERENT")
            table.add_row(name, mode, f"{per / 1000:.1f}", f"{per / first[0]:.3f}x", digest[:12] + same)
        Console(width=140).print(table)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
