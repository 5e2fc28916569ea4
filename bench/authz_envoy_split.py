"""Where Envoy's own CPU goes in ``ext_proc.protocol: ext_authz`` mode: the gateway's filter chain built
up one piece at a time, each step its own Envoy, all in front of the same nginx backend and one real
``python -m ext_authz`` service, in one run.

Run: ``.venv/bin/python bench/authz_envoy_split.py [--duration 3] [--rounds 3] [--connections 1,16]``
(needs ``wrk`` and ``nginx``). Prints one table; not a test. ~2.5 min with the defaults.

Every Envoy (2 workers) runs a static bootstrap made from the gateway's own builders
(:func:`xds_server.resources.listener.build_listener`, :func:`~xds_server.resources.routes.
build_route_configuration`, :func:`~xds_server.resources.clusters.build_clusters` with the endpoints put
in the clusters), with a config in ``ext_authz`` mode and ``account_responses`` on (the production
default); the steps take pieces away from that listener (cumulative, in this order):

- ``router only``: the router and one catch-all route to the model's cluster;
- ``+ ext_authz check``: the ext_authz filter (the service answers every check), no ``clear_route_cache``
  (the catch-all route stays);
- ``+ route cache cleared``: ``clear_route_cache`` and the gateway's routes (matched again on the check's
  headers);
- ``+ header strip, fail-open filters``: the early header mutation and the three filters of the fail-open
  path (two ``transform``, ``api_key_auth`` behind its matcher);
- ``+ Lua request half``: the body-splice Lua filter (behind its matcher: skipped when the check sent no
  splices, as here);
- ``+ Lua response half``: the metering Lua filter;
- ``+ gRPC access log``: the access log to the settler;
- ``+ local replies = production``: the local-reply mappers, i.e. the listener as built.

and ``production, <variant>`` cells for the reductions tried (see :data:`VARIANTS`). Load: wrk POSTing the
~3 KB chat body of ``bench/gateway_overhead.py`` (repeated prompts) for ``--duration`` s per cell and
round, the cells shuffled anew every round; figures are medians over the rounds. CPU per request: user +
system of that Envoy process (``/proc`` via psutil), the service's apart.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.common.matching.v3 import extension_matcher_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2 as j2m_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from extproc_overhead import API_KEY, MODEL, WrkResult, chat_body, start_listening, wrk
from gateway_overhead import inferlb_config, interleaved, start_nginx, tree_cpu_s, wait_ready, wrk_script
from google.protobuf import json_format
from rich.console import Console
from rich.table import Table

from inferlb.config.schema import Config, HostPort, parse_config
from inferlb.ops.stack import Child, find_envoy, free_ports
from xds_server.resources import listener as lst
from xds_server.resources.clusters import build_clusters
from xds_server.resources.common import (
    API_KEY_FILTER,
    BODY_MODEL_FILTER,
    CANONICAL_MODEL_FILTER,
    EXT_AUTHZ_FILTER,
    LUA_FILTER,
    METER_LUA_FILTER,
    pack,
    socket_address,
)
from xds_server.resources.endpoints import build_load_assignments
from xds_server.resources.routes import build_route_configuration

Hcm = hcm_pb2.HttpConnectionManager
CHAT_PATH = "/v1/chat/completions"


def _copy(hcm: Hcm) -> Hcm:
    out = Hcm()
    out.CopyFrom(hcm)
    return out


def production_hcm(config: Config) -> Hcm:
    """The gateway listener's HTTP connection manager as built, with its routes inline (no RDS)."""
    hcm = Hcm()
    assert lst.build_listener(config).filter_chains[0].filters[0].typed_config.Unpack(hcm)
    hcm.route_config.CopyFrom(build_route_configuration(config))
    return hcm


def _catch_all(config: Config) -> route_pb2.RouteConfiguration:
    model = config.models[0]
    return route_pb2.RouteConfiguration(
        name="catch_all",
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name="all",
                domains=["*"],
                routes=[
                    route_components_pb2.Route(
                        match=route_components_pb2.RouteMatch(prefix="/"),
                        route=route_components_pb2.RouteAction(
                            cluster=model.cluster_name(model.versions[0].name)
                        ),
                    )
                ],
            )
        ],
    )


def _drop_filters(hcm: Hcm, names: set[str]) -> None:
    kept = [f for f in hcm.http_filters if f.name not in names]
    del hcm.http_filters[:]
    hcm.http_filters.extend(kept)


def _one_lua(hcm: Hcm) -> None:
    """The Lua layout before the split: one Lua filter, not behind a matcher, with both halves."""
    source = lst.BODY_SPLICE_LUA + lst.meter_lua()
    lua = pack(lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=source)))
    _drop_filters(hcm, {METER_LUA_FILTER})
    for f in hcm.http_filters:
        if f.name == LUA_FILTER:
            f.typed_config.CopyFrom(lua)


def _splice_unwrapped(hcm: Hcm) -> None:
    """The two Lua filters, the splice one not behind its matcher (runs on every request)."""
    for f in hcm.http_filters:
        if f.name == LUA_FILTER:
            wrapped = extension_matcher_pb2.ExtensionWithMatcher()
            assert f.typed_config.Unpack(wrapped)
            f.typed_config.CopyFrom(wrapped.extension_config.typed_config)


def _log_buffer(size: int) -> Callable[[Hcm], None]:
    def change(hcm: Hcm) -> None:
        for log in hcm.access_log:
            grpc_log = als_pb2.HttpGrpcAccessLogConfig()
            assert log.typed_config.Unpack(grpc_log)
            grpc_log.common_config.buffer_size_bytes.value = size
            log.typed_config.CopyFrom(pack(grpc_log))

    return change


def _json_to_metadata(hcm: Hcm) -> None:
    """The usage of a JSON answer read by Envoy's ``json_to_metadata`` response rules (two numbers) instead
    of the Lua response half: JSON only (no SSE), and a metadata shape the settler does not read, so it is
    measured, not built."""
    rules = j2m_pb2.JsonToMetadata(
        response_rules=j2m_pb2.JsonToMetadata.MatchRules(
            rules=[
                j2m_pb2.JsonToMetadata.Rule(
                    selectors=[
                        j2m_pb2.JsonToMetadata.Selector(key="usage"),
                        j2m_pb2.JsonToMetadata.Selector(key=k),
                    ],
                    on_present=j2m_pb2.JsonToMetadata.KeyValuePair(
                        metadata_namespace="inferlb.meter", key=k, type=j2m_pb2.JsonToMetadata.NUMBER
                    ),
                )
                for k in ("prompt_tokens", "completion_tokens")
            ]
        )
    )
    for f in hcm.http_filters:
        if f.name == METER_LUA_FILTER:
            f.name = "inferlb.meter_json"
            f.typed_config.CopyFrom(pack(rules))


def _ext_authz(hcm: Hcm, change: Callable[[ext_authz_pb2.ExtAuthz], None]) -> None:
    for f in hcm.http_filters:
        if f.name == EXT_AUTHZ_FILTER:
            authz = ext_authz_pb2.ExtAuthz()
            assert f.typed_config.Unpack(authz)
            change(authz)
            f.typed_config.CopyFrom(pack(authz))


#: The steps, cumulative from the production listener down (applied in reverse order of the table).
def steps(config: Config) -> list[tuple[str, Hcm]]:
    """(name, HCM) of each step of the module docstring, from ``router only`` up to production."""
    out: list[tuple[str, Hcm]] = []
    hcm = production_hcm(config)
    out.append(("+ local replies = production", _copy(hcm)))
    hcm.ClearField("local_reply_config")
    out.append(("+ gRPC access log", _copy(hcm)))
    hcm.ClearField("access_log")
    out.append(("+ Lua response half", _copy(hcm)))
    _drop_filters(hcm, {METER_LUA_FILTER})
    out.append(("+ Lua request half", _copy(hcm)))
    _drop_filters(hcm, {LUA_FILTER})
    out.append(("+ header strip, fail-open filters", _copy(hcm)))
    _drop_filters(hcm, {BODY_MODEL_FILTER, CANONICAL_MODEL_FILTER, API_KEY_FILTER})
    hcm.ClearField("early_header_mutation_extensions")
    out.append(("+ route cache cleared", _copy(hcm)))
    _ext_authz(hcm, lambda a: setattr(a, "clear_route_cache", False))
    hcm.route_config.CopyFrom(_catch_all(config))
    out.append(("+ ext_authz check", _copy(hcm)))
    _drop_filters(hcm, {EXT_AUTHZ_FILTER})
    out.append(("router only", _copy(hcm)))
    return out[::-1]


def _no_local_replies(hcm: Hcm) -> None:
    hcm.ClearField("local_reply_config")


def _no_cel_mappers(hcm: Hcm) -> None:
    """Only the local-reply mappers whose filter is not a CEL expression (response flags)."""
    kept = [m for m in hcm.local_reply_config.mappers if not m.filter.HasField("extension_filter")]
    del hcm.local_reply_config.mappers[:]
    hcm.local_reply_config.mappers.extend(kept)


#: Other layouts of the production listener, measured beside it: name -> change of its HCM.
VARIANTS: dict[str, Callable[[Hcm], None]] = {
    "one Lua filter, both halves (before)": _one_lua,
    "two Lua filters, splice not skipped": _splice_unwrapped,
    "access log buffer 64 KiB": _log_buffer(65_536),
    "json_to_metadata, not Lua, meters JSON": _json_to_metadata,
    "no local replies": _no_local_replies,
    "local replies without the CEL mappers": _no_cel_mappers,
}


def bootstrap(config: Config, hcm: Hcm, port: int, admin: int) -> dict[str, Any]:
    """A static Envoy bootstrap: the gateway listener on ``port`` with ``hcm``, every cluster of
    ``config`` with its endpoints inline."""
    listener = lst.build_listener(config)
    listener.address.CopyFrom(socket_address(HostPort(host="127.0.0.1", port=port)))
    listener.filter_chains[0].filters[0].typed_config.CopyFrom(pack(hcm))
    assignments = {a.cluster_name: a for a in build_load_assignments(config)}
    clusters = []
    for c in build_clusters(config):
        if c.name in assignments:
            c.type = c.STATIC
            c.ClearField("eds_cluster_config")
            c.load_assignment.CopyFrom(assignments[c.name])
        clusters.append(json_format.MessageToDict(c))
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [json_format.MessageToDict(listener)],
            "clusters": clusters,
        },
    }


def start_envoy(work: Path, name: str, boot: dict[str, Any], port: int, base_id: int) -> Child:
    """Envoy (2 workers) on ``boot`` under its own ``--base-id``, listening on ``port``."""
    path = work / f"{name}.json"
    path.write_text(json.dumps(boot), encoding="utf-8")
    argv = [find_envoy(), "-c", str(path), "--base-id", str(base_id), "--concurrency", "2"]
    return start_listening(Child(name, [*argv, "--log-level", "warning"], work / f"{name}.log"), port)


def check_answer_headers(config: Config, body: bytes) -> list[tuple[str, str]]:
    """The ``x-inferlb-*`` headers of the ext_authz service's 200 answer to the bench request (asked
    directly, as Envoy asks it)."""
    conn = http.client.HTTPConnection(config.ext_proc.listen.host, config.ext_proc.listen.port, timeout=10)
    try:
        conn.request("POST", CHAT_PATH, body=body, headers={"authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"the ext_authz service answered {resp.status}")
        return [(k.lower(), v) for k, v in resp.getheaders() if k.lower().startswith("x-inferlb-")]
    finally:
        conn.close()


def start_fixed_checker(work: Path, port: int, answer: list[tuple[str, str]]) -> Child:
    """nginx on ``port`` answering every check 200 with ``answer``'s headers: the check's cost to Envoy
    without the Python service's (a meter id it answers is unknown to the settler, which ignores it)."""
    adds = "".join(f"    add_header {k} '{v}' always;\n" for k, v in answer)
    return start_nginx(work, port, name="checker", server=f"{adds}    location / {{ return 200; }}")


@dataclass(frozen=True, kw_only=True)
class Sample:
    result: WrkResult
    envoy_us: float
    service_us: float


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) and print its table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--duration", type=int, default=3, help="seconds per cell and round (1-30)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all cells (1-10)")
    p.add_argument("--connections", default="1,16")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", default="", help="semicolon-separated cell names to run (default: all)")
    p.add_argument(
        "--checker",
        choices=("python", "nginx"),
        default="python",
        help="who answers the checks: the ext_authz service, or nginx with the service's answer fixed",
    )
    args = p.parse_args(argv)
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            print(f"{tool} not found: apt-get install {tool}", file=sys.stderr)
            return 1
    duration, rounds = max(1, min(args.duration, 30)), max(1, min(args.rounds, 10))
    conns = [int(c) for c in args.connections.split(",")]
    work = Path(tempfile.mkdtemp(prefix="authz-split-"))
    script = wrk_script(work / "repeated.lua", unique=False)
    children: list[Child] = []
    try:
        (backend,) = free_ports(1)
        children.append(start_nginx(work, backend))
        path = inferlb_config(work, "authz", backend, protocol="ext_authz", accounting=True)
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        (meter,) = free_ports(1)
        doc["ext_proc"]["meter_listen"] = f"127.0.0.1:{meter}"
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        config = parse_config(doc)
        service = Child(
            "ext_authz",
            [sys.executable, "-m", "ext_authz", "--config", str(path), "--log-level", "warning"],
            work / "ext_authz.log",
        )
        children.append(start_listening(service, config.ext_proc.listen.port))
        assert service.proc is not None
        if args.checker == "nginx":
            (check_port,) = free_ports(1)
            answer = check_answer_headers(config, chat_body().encode())
            children.append(start_fixed_checker(work, check_port, answer))
            doc["ext_proc"]["listen"] = f"127.0.0.1:{check_port}"
            config = parse_config(doc)  # Envoy's ext_authz cluster goes to nginx, the settler stays
        cells_hcm = steps(config)
        production = cells_hcm[-1][1]
        for name, change in VARIANTS.items():
            hcm = _copy(production)
            change(hcm)
            cells_hcm.append((f"production, {name}", hcm))
        only = {x.strip() for x in args.only.split(";") if x.strip()}
        cells_hcm = [(n, h) for n, h in cells_hcm if not only or n in only or n == "router only"]
        envoys: dict[str, tuple[str, int]] = {}
        base = (os.getpid() % 5_000) * 20
        for i, (name, hcm) in enumerate(cells_hcm):
            port, admin = free_ports(2)
            child = start_envoy(work, f"envoy-{i}", bootstrap(config, hcm, port, admin), port, base + i)
            children.append(child)
            assert child.proc is not None
            url = f"http://127.0.0.1:{port}{CHAT_PATH}"
            problem = wait_ready(url, None, 20)
            if problem is not None:
                raise RuntimeError(f"{name} does not answer 200: {problem}\n{child.log_tail(10)}")
            envoys[name] = (url, child.proc.pid)
            wrk(url, script, 4, 1, timeout_s=10)  # warm-up
        service_pid = service.proc.pid

        def run(cell: tuple[str, str, int]) -> Sample:
            url, pid = envoys[cell[0]]
            before = tree_cpu_s([pid]), tree_cpu_s([service_pid])
            r = wrk(url, script, cell[2], duration, timeout_s=10)
            n = max(r.requests, 1)
            after = tree_cpu_s([pid]), tree_cpu_s([service_pid])
            return Sample(
                result=r,
                envoy_us=(after[0] - before[0]) / n * 1e6,
                service_us=(after[1] - before[1]) / n * 1e6,
            )

        cells = interleaved(
            [(name, "repeated", c) for name, _ in cells_hcm for c in conns],
            rounds,
            random.Random(args.seed),
            run,
        )
        table = Table(
            title=f"Envoy CPU per request in ext_authz mode, piece by piece: POST {CHAT_PATH}, {duration} s "
            f"per cell, median of {rounds} rounds, cells shuffled per round"
        )
        for col in ("Envoy config", "conns", "req/s", "p50 ms", "bad", "Envoy us/req", "step", "vs router"):
            table.add_column(col, justify="left" if col == "Envoy config" else "right")
        table.add_column("Envoy min-max", justify="right")
        table.add_column("service us/req", justify="right")
        for c in conns:
            prev: float | None = None
            alone = statistics.median(s.envoy_us for s in cells[("router only", "repeated", c)])
            for name, _ in cells_hcm:
                got = cells[(name, "repeated", c)]
                envoy = statistics.median(s.envoy_us for s in got)
                step = "-" if prev is None or name.startswith("production,") else f"{envoy - prev:+.0f}"
                table.add_row(
                    name,
                    str(c),
                    f"{statistics.median(s.result.rps for s in got):,.0f}",
                    f"{statistics.median(s.result.p50_ms for s in got):.2f}",
                    str(sum(s.result.non_2xx + s.result.socket_errors for s in got)),
                    f"{envoy:.0f}",
                    step,
                    f"{envoy / alone:.2f}x",
                    f"{min(s.envoy_us for s in got):.0f}-{max(s.envoy_us for s in got):.0f}",
                    f"{statistics.median(s.service_us for s in got):.0f}",
                )
                if not name.startswith("production,"):
                    prev = envoy
        Console(width=200).print(table)
        run_args = {"checker": args.checker, "connections": conns, "rounds": rounds, "duration_s": duration}
        print(json.dumps({"model": MODEL, **run_args}))
    finally:
        stop_all(children, work)
    return 0


def stop_all(children: list[Child], work: Path) -> None:
    """Stop ``children`` in reverse start order and remove the work directory."""
    for child in reversed(children):
        child.stop()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
