"""Two xDS servers sharing one Redis fleet store (``xds.state_redis_url``), one Envoy on each: the two-server
case of ``bench/fleet_restart.py``.

Not a test: it prints one table. It starts a ``redis-server`` (append-only file, ``appendfsync everysec``)
and the local stack (:class:`inferlb.ops.stack.Stack`: the simulated 8-GPU fleet, ext_proc, xds_server A,
Envoy A) on a config naming that Redis, then a second ``python -m xds_server`` (B) on the same fleet and
store with its own ports and an Envoy B bootstrapped from it (its own listener), and then:

1. **propagation**: a drain of ``h100-1`` through A's API, timed until Envoy B shows it DRAINING; a weight pin
   of ``a100-0`` through B's API, timed until Envoy A holds it; ``--requests`` chat requests through Envoy B
   counted per GPU before and after the drain;
2. **concurrent**: ``--concurrent`` weight pins sent at once, alternating the two servers, one endpoint each
   (of 4, so several pins race on one endpoint): how many answered 200, whether both servers list the same
   pins and the store's version moved by exactly that many writes;
3. **kill -9 of server A**: SIGKILL, a change through B while A is down (deregister ``v100-2``), A started
   again: seconds until Envoy A is connected again, and whether both Envoys hold the same hosts;
4. **Redis restart** (SIGTERM, the AOF replayed): the store's version and the pins before and after, and a
   change through A afterwards reaching Envoy B;
5. **Redis down**: a change's status and error code, and ``--requests`` requests through each Envoy.

Usage: ``.venv/bin/python bench/fleet_shared.py [--requests 100] [--concurrent 16]`` (about a minute). Every
address is 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from fleet_restart import _api, _doc, _dump, _envoy_view, _host, _kill_9, _per_gpu, _present, _wait, _yes
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import Config, load_config
from inferlb.ops.redis_server import RedisServer
from inferlb.ops.stack import Child, Stack, find_envoy, free_ports
from xds_server.bootstrap import render_bootstrap

#: Bound on how long one change may take to reach the other server's Envoy in this run (s).
PROPAGATE_S = 10.0


@contextmanager
def second_server(work: Path, doc: dict[str, Any]) -> Iterator[tuple[Config, Child]]:
    """xds_server B and Envoy B: the same fleet and store as ``doc``, their own xDS, API, listener and admin
    ports; yields B's config and B's process."""
    xds, api, gw, admin = free_ports(4)
    doc_b = {
        **doc,
        "xds": {**doc["xds"], "listen": f"127.0.0.1:{xds}", "api_listen": f"127.0.0.1:{api}"},
        "gateway": {**doc["gateway"], "listen": f"127.0.0.1:{gw}", "admin": f"127.0.0.1:{admin}"},
    }
    path = work / "b.yaml"
    path.write_text(_dump(doc_b), encoding="utf-8")
    config = load_config(path)
    boot = work / "envoy-b.yaml"
    boot.write_text(yaml.safe_dump(render_bootstrap(config, node_id="gateway-b")), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    xds_b = Child(
        "xds_server-b", [sys.executable, "-m", "xds_server", "--config", str(path)], work / "xds_b.log"
    )
    argv = [find_envoy(), "-c", str(boot), "--base-id", "7317", "--concurrency", "1", "-l", "warning"]
    envoy_b = Child("envoy-b", argv, work / "envoy_b.log")
    try:
        xds_b.start(env)
        _wait("xds_server B's API", lambda: _api(config, "GET", "/v1/endpoints")[0] == 200)
        envoy_b.start(env)
        _wait("Envoy B serving", lambda: bool(_envoy_view(config)) and _per_gpu(config, 2)["error 0"] == 0)
        yield config, xds_b
    finally:
        envoy_b.stop()
        xds_b.stop()


def _timed(what: str, check: Any) -> float:
    return _wait(what, check, PROPAGATE_S)


def _pins(config: Config) -> dict[str, int]:
    status, body = _api(config, "GET", "/v1/endpoints")
    assert status == 200, body
    return {row["key"]: row["weight_override"] for row in body["endpoints"] if row["weight_override"]}


def _version(config: Config) -> int:
    return int(_api(config, "GET", "/v1/endpoints")[1]["state_store"]["version"])


def run(
    stack: Stack,
    redis: RedisServer,
    config_b: Config,
    doc: dict[str, Any],
    *,
    args: argparse.Namespace,
    out: Console,
) -> Table:
    """The five trials; the table of their results."""
    a, b = stack.config, config_b
    names = {e["name"]: e["address"] for e in doc["endpoints"]}
    table = Table(title="Two xDS servers sharing one Redis fleet store, one Envoy each")
    for col in ("trial", "what", "result", "ok"):
        table.add_column(col, justify="left" if col != "ok" else "center")

    # 1. propagation both ways, and traffic through Envoy B around a drain made through A
    before = _per_gpu(b, args.requests)
    status, body = _api(a, "POST", f"/v1/endpoints/{names['h100-1']}/drain", {"drain_ms": 600_000})
    assert status == 202, body
    t_ab = _timed(
        "Envoy B: h100-1 DRAINING", lambda: _host(_envoy_view(b), names["h100-1"], "health") == "DRAINING"
    )
    assert _api(b, "PUT", f"/v1/endpoints/{names['a100-0']}/weight", {"weight": 250})[0] == 200
    t_ba = _timed(
        "Envoy A: a100-0 weight 250", lambda: _host(_envoy_view(a), names["a100-0"], "weight") == "250"
    )
    time.sleep(0.3)
    after = _per_gpu(b, args.requests)
    table.add_row(
        "propagation", "drain via A -> DRAINING in Envoy B", f"{t_ab * 1000:.0f} ms", _yes(t_ab < 1.5)
    )
    table.add_row("", "weight pin via B -> weight in Envoy A", f"{t_ba * 1000:.0f} ms", _yes(t_ba < 1.5))
    table.add_row(
        "",
        f"h100-1's requests via Envoy B ({args.requests} before / after the drain)",
        f"{before['h100-1']} / {after['h100-1']}",
        _yes(before["h100-1"] > 0 and after["h100-1"] == 0),
    )
    errors = sum(n for k, n in after.items() if k.startswith("error"))
    table.add_row("", "failed requests via Envoy B after the drain", str(errors), _yes(errors == 0))

    # 2. concurrent changes through both servers
    keys = [names[n] for n in ("a100-1", "a100-2", "h100-0", "v100-0")]
    v0 = _version(a)
    jobs = [((a, b)[i % 2], keys[i % len(keys)], 100 + i) for i in range(args.concurrent)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.concurrent) as pool:
        statuses = list(
            pool.map(lambda j: _api(j[0], "PUT", f"/v1/endpoints/{j[1]}/weight", {"weight": j[2]})[0], jobs)
        )
    _timed("both servers at the last version", lambda: _version(a) == _version(b) == v0 + args.concurrent)
    pins_a, pins_b = _pins(a), _pins(b)
    landed = all(pins_a.get(k) in {w for _, kk, w in jobs if kk == k} for k in keys)
    table.add_row(
        "concurrent",
        f"{args.concurrent} pins at once, alternating A/B, {len(keys)} endpoints",
        f"{statuses.count(200)} x 200, version +{_version(a) - v0}",
        _yes(statuses.count(200) == args.concurrent),
    )
    table.add_row(
        "",
        "both list the same pins, each one of its endpoint's",
        _yes(pins_a == pins_b and landed),
        _yes(pins_a == pins_b and landed),
    )

    # 3. kill -9 of server A, a change through B meanwhile, A again
    xds_a = stack.child("xds_server")
    t0 = time.monotonic()
    _kill_9(xds_a)
    assert _api(b, "DELETE", f"/v1/endpoints/{names['v100-2']}")[0] == 200
    xds_a.start({**os.environ, "PYTHONUNBUFFERED": "1"})
    _wait("server A's API", lambda: _api(a, "GET", "/v1/endpoints")[0] == 200)
    _wait("Envoy A connected again", lambda: bool(_api(a, "GET", "/v1/clients")[1]["clients"]))
    back_s = time.monotonic() - t0
    _timed("Envoy A without v100-2", lambda: _present(_envoy_view(a), names["v100-2"]) == "absent")
    same = _envoy_view(a) == _envoy_view(b)
    table.add_row(
        "kill -9 A",
        "deregister v100-2 via B while A is down; A restarted",
        f"Envoy A back at {back_s:.1f} s, v100-2 {_present(_envoy_view(a), names['v100-2'])}",
        _yes(same),
    )
    table.add_row("", "Envoy A hosts == Envoy B hosts (host, weight, EDS health)", _yes(same), _yes(same))

    # 4. Redis restart: the AOF keeps the document
    v_before, pins_before = _version(a), _pins(a)
    redis.restart()
    _wait(
        "a change accepted again",
        lambda: _api(a, "PUT", f"/v1/endpoints/{names['v100-1']}/weight", {"weight": 9})[0] == 200,
    )
    t_after = _timed(
        "Envoy B: v100-1 weight 9", lambda: _host(_envoy_view(b), names["v100-1"], "weight") == "9"
    )
    kept = {k: v for k, v in _pins(b).items() if k != names["v100-1"]} == pins_before
    table.add_row(
        "Redis restart",
        "version before -> after the next change",
        f"{v_before} -> {_version(b)}",
        _yes(_version(b) == v_before + 1),
    )
    table.add_row(
        "",
        "pins kept; the next change via A reaches Envoy B",
        f"{_yes(kept)}, {t_after * 1000:.0f} ms",
        _yes(kept),
    )

    # 5. Redis down
    redis.stop()
    status, body = _api(b, "POST", f"/v1/endpoints/{names['v100-1']}/drain", {})
    code = body.get("error", {}).get("code", "-") if isinstance(body, dict) else "-"
    served_a, served_b = _per_gpu(a, args.requests), _per_gpu(b, args.requests)
    ok_a = sum(n for k, n in served_a.items() if not k.startswith("error"))
    ok_b = sum(n for k, n in served_b.items() if not k.startswith("error"))
    table.add_row("Redis down", "a drain via B", f"{status} {code}", _yes(status == 503))
    table.add_row(
        "",
        f"requests served via Envoy A / B ({args.requests} each)",
        f"{ok_a} / {ok_b}",
        _yes(ok_a == ok_b == args.requests),
    )
    redis.start()
    out.print(f"redis-server on {redis.url} with appendonly yes, appendfsync {redis.appendfsync}")
    return table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100, help="requests per traffic sample")
    p.add_argument("--concurrent", type=int, default=16, help="pins sent at once in the concurrent trial")
    return p


def main(argv: list[str] | None = None) -> int:
    args, out = _parser().parse_args(argv), Console(width=150)
    with tempfile.TemporaryDirectory(prefix="inferlb-fleet-shared-") as tmp:
        work = Path(tmp)
        (work / "redis").mkdir()
        with RedisServer(work / "redis", appendonly=True) as redis:
            doc = _doc()
            doc["xds"].update(state_redis_url=redis.url, state_redis_poll_ms=200)
            path = work / "inferlb.yaml"
            path.write_text(_dump(doc), encoding="utf-8")
            stack = Stack(path, workdir=work / "stack")
            out.print(f"starting the stack and a second xDS server + Envoy (work directory {work})")
            stack.start(timeout_s=60)
            try:
                with second_server(work, doc) as (config_b, _):
                    out.print(run(stack, redis, config_b, doc, args=args, out=out))
            finally:
                stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
