"""Fleet API changes across a ``kill -9`` of the xDS server, and config files caught half-written.

Not a test: it prints two tables. It runs the local stack (:class:`inferlb.ops.stack.Stack`: the simulated
8-GPU fleet, ``python -m xds_server`` with its state file in the stack's work directory, ext_proc, Envoy) on
free loopback ports, plus one more simulated GPU (``h100-new``, its own ``python -m simulation.gpusim``) to
register, and then:

1. **restart**: makes the four fleet changes (register ``h100-new``, pin ``a100-0``'s weight to 250, drain
   ``h100-1`` for 120 s, deregister ``v100-2``), sends ``--requests`` chat requests and counts them per GPU,
   reads ``GET /v1/endpoints`` (without the clock-driven ``removed_in_ms``) and Envoy's ``/clusters`` (per
   model cluster: host, weight, EDS health); kills the xDS server with SIGKILL and starts it again on the
   same config and state file, waits until Envoy has reconnected, and compares both views and the request
   counts. Envoy keeps serving its last config while the xDS server is down.
2. **truncated write**: under a bounded request loop (key ``sk-demo-a``, ``--threads`` threads, at most
   ``--max-requests`` requests or ``--hold-s`` + 8 s), the config file is rewritten in place, its first part
   (cut just before ``tenants:``, then in a second trial before ``endpoints:``) left on disk for ``--hold-s``
   seconds (4 polls of each service at 0.5 s), then the rest appended (the whole file adds a tenant, so the
   completed file is seen to apply); counts answers by status and the refusals each service logged.

The two-server case (two xDS servers sharing a Redis fleet store, an Envoy on each) is
``bench/fleet_shared.py``.

Usage: ``.venv/bin/python bench/fleet_restart.py [--requests 200] [--hold-s 2] [--threads 4] [--json PATH]``
(about a minute; ``--json`` also writes both trials' figures to ``PATH``, what ``bench/faults.py`` reads).
Every request goes to 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import Config, default_config_path
from inferlb.ops.stack import Child, Stack, clusters_json, free_ports, model_cluster_names

TOKEN = "bench-fleet-token-0123456789"
KEY = "sk-demo-a"
LATE_KEYS = ("sk-bench-late-0001", "sk-bench-late-0002")
WAIT_S = 60.0
DRAIN_MS = 120_000


def _doc() -> dict[str, Any]:
    """The default config on free loopback ports, a fast simulated fleet, a short push debounce."""
    doc: dict[str, Any] = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    ports = free_ports(6 + len(doc["endpoints"]))
    doc["gateway"].update(listen=f"127.0.0.1:{ports[0]}", admin=f"127.0.0.1:{ports[1]}")
    doc["xds"].update(
        listen=f"127.0.0.1:{ports[2]}",
        api_listen=f"127.0.0.1:{ports[4]}",
        api_token=TOKEN,
        push_debounce_ms=20,
    )
    doc["ext_proc"].update(listen=f"127.0.0.1:{ports[3]}", metrics_listen=f"127.0.0.1:{ports[5]}")
    for ep, port in zip(doc["endpoints"], ports[6:], strict=True):
        ep["address"] = f"127.0.0.1:{port}"
    doc["simulation"].update(
        prefill_tokens_per_s=2_000_000, decode_tokens_per_s=5_000, max_batch=64, max_queue=4096
    )
    return doc


def _dump(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def _api(config: Config, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://{config.xds.api_listen}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _chat(config: Config, model: str, key: str = KEY) -> tuple[int, str]:
    """One chat completion through the gateway: (status, the GPU that served it or '')."""
    conn = http.client.HTTPConnection(config.gateway.listen.host, config.gateway.listen.port, timeout=30)
    try:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.getheader("x-inferlb-endpoint") or ""
    except OSError:
        return 0, ""
    finally:
        conn.close()


def _per_gpu(config: Config, n: int) -> Counter[str]:
    """``n`` requests, alternating the two models; counts per serving GPU (``error <status>`` otherwise)."""
    out: Counter[str] = Counter()
    for i in range(n):
        status, gpu = _chat(config, "qwen" if i % 2 else "llama3")
        out[gpu if status == 200 else f"error {status}"] += 1
    return out


def _listing(config: Config) -> list[dict[str, Any]]:
    status, body = _api(config, "GET", "/v1/endpoints")
    assert status == 200, body
    return [{k: v for k, v in row.items() if k != "removed_in_ms"} for row in body["endpoints"]]


def _envoy_view(config: Config) -> dict[str, list[tuple[str, int, str]]]:
    """Per model cluster: (host:port, weight, EDS health) of every host Envoy holds."""
    wanted = set(model_cluster_names(config))
    out = {}
    for c in clusters_json(config).get("cluster_statuses", []):
        if c.get("name") not in wanted:
            continue
        hosts = []
        for h in c.get("host_statuses", []):
            sock = h["address"]["socket_address"]
            health = h.get("health_status", {}).get("eds_health_status", "HEALTHY")
            hosts.append((f"{sock['address']}:{sock['port_value']}", int(h.get("weight", 1)), health))
        out[c["name"]] = sorted(hosts)
    return out


def _wait(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> float:
    """Poll ``check`` every 50 ms until true; returns the seconds it took. Raises after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if check():
                return time.monotonic() - start
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _kill_9(child: Child) -> None:
    assert child.proc is not None
    os.killpg(child.proc.pid, signal.SIGKILL)
    child.proc.wait(timeout=10)


@contextlib.contextmanager
def extra_gpu(stack: Stack, doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One more simulated H100 for ``qwen`` on a free port (its own gpusim process, from a config that lists
    only it), to register over the fleet API; yields its endpoint (the config file's shape)."""
    new = {"name": "h100-new", "address": f"127.0.0.1:{free_ports(1)[0]}", "model": "qwen2.5-7b-instruct",
           "gpu": "H100"}  # fmt: skip
    extra = stack.workdir / "extra-gpu.yaml"
    extra.write_text(_dump({**doc, "endpoints": [{**new, "simulated": True}]}), encoding="utf-8")
    with (stack.workdir / "gpusim-extra.log").open("ab") as log:
        sim = subprocess.Popen(
            [sys.executable, "-m", "simulation.gpusim", "--config", str(extra)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            _wait("the extra GPU", lambda: _health(int(new["address"].rsplit(":", 1)[1])))
            yield new
        finally:
            sim.send_signal(signal.SIGTERM)
            try:
                sim.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sim.kill()
                sim.wait(timeout=10)


def restart_trial(
    stack: Stack, doc: dict[str, Any], new: dict[str, Any], requests: int, out: Console, *,
    figures: dict[str, Any],
) -> Table:  # fmt: skip
    """The four fleet changes, kill -9 of the xDS server, restart; the table comparing before and after.

    ``figures`` receives the verdicts: ``listing_same``, ``envoy_same`` (bool), ``api_up_s`` and
    ``reconnect_s`` (s after the kill), and ``served_after`` (requests per GPU after the restart)."""
    config = stack.config
    names = {e["name"]: e["address"] for e in doc["endpoints"]}
    xds = stack.child("xds_server")
    changes = [
        ("register h100-new", "POST", "/v1/endpoints", new),
        ("pin a100-0 weight 250", "PUT", f"/v1/endpoints/{names['a100-0']}/weight", {"weight": 250}),
        ("drain h100-1", "POST", f"/v1/endpoints/{names['h100-1']}/drain", {"drain_ms": DRAIN_MS}),
        ("deregister v100-2", "DELETE", f"/v1/endpoints/{names['v100-2']}", None),
    ]
    for what, method, path, body in changes:
        status, answer = _api(config, method, path, body)
        if status >= 300:
            raise RuntimeError(f"{what}: {status} {answer}")
    _wait("Envoy holding the changes", lambda: _present(_envoy_view(config), new["address"]) == "present")
    time.sleep(0.5)
    listing_before, envoy_before = _listing(config), _envoy_view(config)
    counts_before = _per_gpu(config, requests)

    t0 = time.monotonic()
    _kill_9(xds)
    xds.start({**os.environ, "PYTHONUNBUFFERED": "1"})
    _wait("the xDS server's API", lambda: _api(config, "GET", "/v1/endpoints")[0] == 200)
    up_s = time.monotonic() - t0
    # Envoy reconnects with backoff; until then it keeps its last config, which is the same
    _wait("Envoy connected again", lambda: bool(_api(config, "GET", "/v1/clients")[1]["clients"]))
    reconnect_s = time.monotonic() - t0
    time.sleep(0.5)
    listing_after, envoy_after = _listing(config), _envoy_view(config)
    counts_after = _per_gpu(config, requests)

    lines = xds.log_path.read_text(encoding="utf-8").splitlines()
    restored = next((ln for ln in reversed(lines) if "fleet state restored" in ln), "")
    figures.update(
        listing_same=listing_before == listing_after, envoy_same=envoy_before == envoy_after,
        api_up_s=up_s, reconnect_s=reconnect_s, served_after=dict(counts_after),
    )  # fmt: skip
    out.print(
        f"xds_server restart: API up {up_s:.1f} s after the kill, Envoy connected again at "
        f"{reconnect_s:.1f} s; log: {restored.split(': ', 1)[-1]}"
    )
    table = Table(title=f"Fleet API changes across kill -9 of the xDS server ({requests} requests each side)")
    table.add_column("what")
    table.add_column("before kill -9", justify="right")
    table.add_column("after restart", justify="right")
    table.add_column("same", justify="center")
    table.add_row(
        "GET /v1/endpoints rows",
        str(len(listing_before)),
        str(len(listing_after)),
        _yes(listing_before == listing_after),
    )
    hosts_b = sum(len(v) for v in envoy_before.values())
    hosts_a = sum(len(v) for v in envoy_after.values())
    table.add_row(
        "Envoy hosts (host, weight, EDS health)",
        str(hosts_b),
        str(hosts_a),
        _yes(envoy_before == envoy_after),
    )
    for label, host in (
        ("h100-new weight (registered)", new["address"]),
        ("a100-0 weight (pinned)", names["a100-0"]),
        ("h100-1 health (drained)", names["h100-1"]),
    ):
        b, a = _host(envoy_before, host, label), _host(envoy_after, host, label)
        table.add_row(label, b, a, _yes(a == b))
    table.add_row(
        "v100-2 in Envoy (deregistered)",
        _present(envoy_before, names["v100-2"]),
        _present(envoy_after, names["v100-2"]),
        _yes(True),
    )
    # every GPU, the drained and the deregistered ones too (they must serve none, before and after)
    for gpu in sorted(set(names) | {new["name"]} | set(counts_before) | set(counts_after)):
        table.add_row(f"requests served by {gpu}", str(counts_before[gpu]), str(counts_after[gpu]), "")
    return table


def _health(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    finally:
        conn.close()


def _host(view: dict[str, list[tuple[str, int, str]]], host: str, label: str) -> str:
    for hosts in view.values():
        for addr, weight, health in hosts:
            if addr == host:
                return health if "health" in label else str(weight)
    return "absent"


def _present(view: dict[str, list[tuple[str, int, str]]], host: str) -> str:
    return "present" if any(addr == host for hosts in view.values() for addr, _, _ in hosts) else "absent"


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


#: A refusal's line naming an emptied section (both services log ``<file>: <section>: the running ...``).
_EMPTIED = re.compile(r": (models|endpoints|tenants): the running config has")


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _emptied(lines: list[str]) -> str:
    """The sections the refusals in ``lines`` name, or ``-`` when nothing was refused for that."""
    return ", ".join(sorted({m[1] for ln in lines if (m := _EMPTIED.search(ln))})) or "-"


def truncated_trial(
    stack: Stack, doc: dict[str, Any], section: str, late_key: str, *, hold_s: float, threads: int,
    max_requests: int,
) -> list[str]:  # fmt: skip
    """Rewrite the config in place, cut before ``section:`` for ``hold_s``, then complete it, under a bounded
    request loop (``threads`` threads, at most ``max_requests`` requests, ``hold_s`` + 8 s).

    Returns:
        the table row: the cut, the loop's length (s), requests, 200s, 401s, other answers by status, the
        sections each service's refusals named, whether the completed file's new tenant key is served.
    """
    config = stack.config
    full = copy.deepcopy(doc)
    full["tenants"].append({"name": f"late-{section}", "api_keys": [late_key]})
    text = _dump(full)
    cut = text[: text.index(f"\n{section}:") + 1]
    xds_log, ext_log = stack.child("xds_server").log_path, stack.child("ext_proc").log_path
    xds_seen, ext_seen = len(_lines(xds_log)), len(_lines(ext_log))
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    sent = [0]
    stop_at = time.monotonic() + hold_s + 8.0

    def worker(i: int) -> None:
        while time.monotonic() < stop_at:
            with lock:
                if sent[0] >= max_requests:
                    return
                sent[0] += 1
            status, _ = _chat(config, "qwen" if i % 2 else "llama3")
            with lock:
                statuses[str(status or "no answer")] += 1

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    started = time.monotonic()
    for t in pool:
        t.start()
    time.sleep(1.0)
    stack.config_path.write_text(cut, encoding="utf-8")  # in place: truncate, write the first part
    time.sleep(hold_s)
    with stack.config_path.open("a", encoding="utf-8") as f:
        f.write(text[len(cut) :])
    for t in pool:
        t.join(timeout=hold_s + 40)
    loop_s = time.monotonic() - started
    applied = True
    try:
        _wait("the completed file", lambda: _chat(config, "qwen", late_key)[0] == 200, 10)
    except RuntimeError:
        applied = False
    doc.clear()
    doc.update(full)
    other = ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items()) if s not in ("200", "401")) or "0"
    return [
        f"cut before {section}:",
        f"{loop_s:.1f}",
        str(sum(statuses.values())),
        str(statuses["200"]),
        str(statuses["401"]),
        other,
        _emptied(_lines(xds_log)[xds_seen:]),
        _emptied(_lines(ext_log)[ext_seen:]),
        _yes(applied),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="requests before and after the restart")
    p.add_argument("--hold-s", type=float, default=2.0, help="seconds the cut file stays on disk")
    p.add_argument("--threads", type=int, default=4, help="request threads in the truncated-write trial")
    p.add_argument("--max-requests", type=int, default=3000, help="bound on each truncated-write trial")
    p.add_argument("--json", metavar="PATH", help="also write both trials' figures to PATH as JSON")
    args = p.parse_args(argv)
    figures: dict[str, Any] = {"restart": {}, "truncated": []}
    out = Console(width=150)
    doc = _doc()
    with tempfile.TemporaryDirectory(prefix="inferlb-fleet-restart-") as tmp:
        work = Path(tmp)
        path = work / "inferlb.yaml"
        path.write_text(_dump(doc), encoding="utf-8")
        stack = Stack(path, workdir=work / "stack")
        out.print(f"starting the stack (work directory {stack.workdir}, state file {stack.state_file})")
        stack.start(timeout_s=WAIT_S)
        stack_extra = contextlib.ExitStack()
        try:
            gpu = stack_extra.enter_context(extra_gpu(stack, doc))
            out.print(restart_trial(stack, doc, gpu, args.requests, out, figures=figures["restart"]))
            table = Table(
                title=f"Config file rewritten in place under load ({args.threads} threads): first part on "
                f"disk from 1 s to {1 + args.hold_s:g} s of the loop, then the rest appended"
            )
            for col in ("trial", "loop s", "requests", "200", "401", "other answers", "xds_server refused",
                        "ext_proc refused", "completed file applied"):  # fmt: skip
                table.add_column(col, justify="left" if col in ("trial", "other answers") else "right")
            for section, key in zip(("tenants", "endpoints"), LATE_KEYS, strict=True):
                row = truncated_trial(
                    stack, doc, section, key, hold_s=args.hold_s, threads=args.threads,
                    max_requests=args.max_requests,
                )  # fmt: skip
                table.add_row(*row)
                figures["truncated"].append(dict(zip(("trial", "loop_s", "requests", "ok", "401", "other"),
                                                     row, strict=False)))  # fmt: skip
            out.print(table)
        finally:
            stack_extra.close()
            stack.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
