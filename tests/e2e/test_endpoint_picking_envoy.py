"""Endpoint picking through a real Envoy 1.40, in both request-path modes (:mod:`ext_proc.picking`).

One stack per mode: qwen (one H100, two V100s) picks endpoints (``endpoint_picking.mode: load``), llama
does not. What is checked: Envoy ACKs qwen's ``override_host`` cluster; the request path's pick is what
serves (the upstream's recorded ``x-gateway-destination-endpoint`` names the serving endpoint first) and
a client's own header changes nothing; a picked endpoint that fails (503s), or that is dead (registered
through the fleet API, nothing listening), is retried on the next listed one and then left out of the
picks; a burst spreads over every endpoint. A third model, mistral, picks in mode ``precise`` from its
three gpusims' KV events (``endpoints[].kv_events``, which ``inferlb up`` hands gpusim as its
``--kv-events-config``): several conversations spread over its endpoints and every turn of each lands on
the endpoint holding its prefix, and gpusim's own ``vllm:prefix_cache_hits_total`` grows, by at least what
the same conversations get from qwen's ``load`` mode. mistral is length-aware too: a burst of long requests
is picked within the long class's hosts (its H100) only. Which GPU served is gpusim's ``x-inferlb-endpoint``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest

from inferlb.ops.stack import admin_get, free_ports
from inferlb.request import headers as h
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, http_request, in_mode, sim_fault, started_stack

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-7b-instruct"
LLAMA = "llama-3.1-8b-instruct"
CLUSTER = f"{QWEN}--v1"
PRECISE = "mistral-7b-instruct"
PRECISE_CLUSTER = f"{PRECISE}--v1"
TOKEN = "inferlb-local-demo-token"


@pytest.fixture(scope="module")
def picking_stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(make_config_doc(), request_path)
    qwen = next(m for m in doc["models"] if m["name"] == QWEN)
    qwen["endpoint_picking"] = {"mode": "load"}
    # a failing GPU is out of the picks after 4 probes of 200 ms plus a 100 ms poll (a window long enough
    # for a dozen requests to meet a stale pick on this loaded machine)
    qwen["cluster"] = {"health_check": {"unhealthy_threshold": 4}}
    doc["telemetry"] = {"scrape_interval_ms": 200, "scrape_timeout_ms": 500}
    doc["ext_proc"]["endpoint_state_poll_ms"] = 100
    # ext_authz mode leaves a pick's in-flight count at the access log's flush: a conversation's next turn
    # sent within it sees its endpoint still busy with the turn before (and the load guard moves it on)
    doc["ext_proc"]["meter_flush_interval_ms"] = 200
    # mistral picks from its servers' KV events: three gpusims publishing on loopback, with replay
    # and length-aware placement: an output cap above 150 tokens is long, served by its H100 only (the
    # conversations' 100 are short)
    doc["models"].append(
        {
            "name": PRECISE,
            "endpoint_picking": {"mode": "precise"},
            "cluster": {"length_aware": {"long_output_tokens": 150}},
        }
    )
    ports = free_ports(9)
    for i, gpu in enumerate(("H100", "V100", "V100")):
        doc["endpoints"].append(
            {
                "name": f"mistral-{gpu.lower()}-{i}",
                "address": f"127.0.0.1:{ports[3 * i]}",
                "model": PRECISE,
                "gpu": gpu,
                "simulated": True,
                "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{ports[3 * i + 1]}",
                    "replay_endpoint": f"tcp://127.0.0.1:{ports[3 * i + 2]}",
                },
            }
        )
    with started_stack(tmp_path_factory.mktemp("picking"), doc) as rs:
        yield rs


def _address(rs: RunningStack, name: str) -> str:
    return str(next(e.address for e in rs.config.endpoints if e.display_name == name))


def _qwen_names(rs: RunningStack) -> list[str]:
    return [e.display_name for e in rs.config.endpoints if e.model == QWEN]


def _picking(rs: RunningStack) -> dict[str, Any]:
    api = rs.config.xds.api_listen
    reply = http_request(str(api), "GET", "/v1/picking", headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status == 200, reply.body
    doc: dict[str, Any] = reply.json()
    return doc


def _cluster_stat(rs: RunningStack, cluster: str, stat: str) -> int:
    text = admin_get(rs.config, "/stats").decode()
    key = f"cluster.{cluster}.{stat}: "
    return next(int(line[len(key) :]) for line in text.splitlines() if line.startswith(key))


def _wait_for_state(rs: RunningStack, healthy: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """The xDS server's picking state once ``healthy`` qwen endpoints are healthy in it."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = _picking(rs)
        rows = doc["clusters"].get(CLUSTER, [])
        if sum(r["healthy"] for r in rows) == healthy:
            return doc
        if time.monotonic() > deadline:
            raise AssertionError(f"qwen never had {healthy} healthy endpoints: {rows}")
        time.sleep(0.1)


def _last_upstream_headers(rs: RunningStack, name: str) -> dict[str, str]:
    got = http_request(_address(rs, name), "GET", "/sim/requests").json()["requests"][-1]["headers"]
    return {k.lower(): v for k, v in got.items()}


def test_envoy_acks_the_override_host_cluster(picking_stack: RunningStack) -> None:
    rs = picking_stack
    text = admin_get(rs.config, "/stats").decode()
    rejected = [line for line in text.splitlines() if "update_rejected" in line and not line.endswith(" 0")]
    assert rejected == []
    dump = json.loads(admin_get(rs.config, "/config_dump?resource=dynamic_active_clusters"))
    clusters = {e["cluster"]["name"]: e["cluster"] for e in dump["configs"] if "cluster" in e}
    [policy] = clusters[CLUSTER]["load_balancing_policy"]["policies"]
    typed = policy["typed_extension_config"]
    assert typed["name"] == "envoy.load_balancing_policies.override_host"
    # ext_proc mode hands Envoy the envoy.lb metadata, ext_authz mode the header
    source = (
        {"metadata": {"key": "envoy.lb", "path": [{"key": h.DESTINATION_ENDPOINT}]}}
        if rs.config.ext_proc.protocol == "ext_proc"
        else {"header": h.DESTINATION_ENDPOINT}
    )
    assert typed["typed_config"]["override_host_sources"] == [source]
    [fallback] = typed["typed_config"]["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.least_request"
    # a model without picking keeps its legacy least-request cluster
    assert "load_balancing_policy" not in clusters[f"{LLAMA}--v1"]
    assert clusters[f"{LLAMA}--v1"]["lb_policy"] == "LEAST_REQUEST"
    state = _wait_for_state(rs, healthy=3)
    assert sorted(r["name"] for r in state["clusters"][CLUSTER]) == sorted(_qwen_names(rs))
    assert set(state["clusters"]) == {CLUSTER, PRECISE_CLUSTER}


def test_the_pick_serves_and_a_client_cannot_choose(picking_stack: RunningStack) -> None:
    rs = picking_stack
    _wait_for_state(rs, healthy=3)
    names = _qwen_names(rs)
    by_address = {_address(rs, n): n for n in names}
    for spoof_name in names:
        spoof = _address(rs, spoof_name)
        for _ in range(4):
            reply = rs.chat(QWEN, headers={h.DESTINATION_ENDPOINT: spoof})
            assert reply.status == 200, reply.body
            served = reply.headers["x-inferlb-endpoint"]
            sent = _last_upstream_headers(rs, served)[h.DESTINATION_ENDPOINT]
            hosts = sent.split(",")
            # the gateway's own list (up to max_hosts: 3), first choice first, is what served
            assert hosts[0] == _address(rs, served), (served, sent)
            assert len(hosts) == 3 and set(hosts) == set(by_address), sent
    # a model without picking gets no list, and a client's is removed there too
    reply = rs.chat(LLAMA, headers={h.DESTINATION_ENDPOINT: _address(rs, names[0])})
    assert reply.status == 200, reply.body
    assert h.DESTINATION_ENDPOINT not in _last_upstream_headers(rs, reply.headers["x-inferlb-endpoint"])


def test_long_requests_are_picked_within_their_length_classs_hosts(picking_stack: RunningStack) -> None:
    """A concurrent burst of long requests (cap 200 > 100): by load the picker would spread it over the three
    GPUs (the load guard moves a request on from a busy one); within the long class it all goes to the
    H100, and the list the gateway sent names the H100 alone."""
    rs = picking_stack
    _subscribed(rs)
    state = _picking(rs)
    classes = {r["name"]: r["length_classes"] for r in state["clusters"][PRECISE_CLUSTER]}
    fast = [n for n, c in classes.items() if c == ["long"]]
    assert len(fast) == 1 and sorted(c for c in classes.values() if c != ["long"]) == [[], []], classes
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: rs.chat(PRECISE, max_tokens=200, content=f"long {i}"), range(12)))
    assert all(r.status == 200 for r in replies), [r.body for r in replies if r.status != 200]
    assert {r.headers["x-inferlb-endpoint"] for r in replies} == set(fast)
    assert _last_upstream_headers(rs, fast[0])[h.DESTINATION_ENDPOINT] == _address(rs, fast[0])


def test_a_failing_pick_falls_back_then_leaves_the_picks(picking_stack: RunningStack) -> None:
    rs = picking_stack
    _wait_for_state(rs, healthy=3)
    first = rs.chat(QWEN)
    assert first.status == 200, first.body
    picked = first.headers["x-inferlb-endpoint"]
    retries_before = _cluster_stat(rs, CLUSTER, "upstream_rq_retry")
    sim_fault(rs.config, picked, "fail")
    try:
        served: Counter[str] = Counter()
        statuses: Counter[int] = Counter()
        started = time.monotonic()
        # right after the failure the picker may still list it first: Envoy retries the next listed host
        while time.monotonic() - started < 3.0:
            reply = rs.chat(QWEN)
            statuses[reply.status] += 1
            served[reply.headers.get("x-inferlb-endpoint", "?")] += 1
        assert statuses == Counter({200: sum(statuses.values())}), statuses
        assert picked not in served, served
        state = _wait_for_state(rs, healthy=2)
        failed = next(r for r in state["clusters"][CLUSTER] if r["name"] == picked)
        assert failed["healthy"] is False
        time.sleep(0.5)  # five request-path polls (100 ms each) after the xDS server knew
        # once out of the picks, no request is sent to it (no retry more)
        retries = _cluster_stat(rs, CLUSTER, "upstream_rq_retry")
        for _ in range(10):
            reply = rs.chat(QWEN)
            assert reply.status == 200, reply.body
            assert reply.headers["x-inferlb-endpoint"] != picked
        assert _cluster_stat(rs, CLUSTER, "upstream_rq_retry") == retries
        print(f"retries while the failed pick was still listed: {retries - retries_before}, served {served}")
    finally:
        sim_fault(rs.config, picked, "recover")
    _wait_for_state(rs, healthy=3)


def test_a_dead_pick_falls_back_then_leaves_the_picks(picking_stack: RunningStack) -> None:
    rs = picking_stack
    # The dead endpoint is listed only between the request path's first poll that holds it and the xDS
    # server's probes finding it dead (a fraction of a second on a loaded machine): a registration whose
    # window no request hit is tried again, up to three times. A broken fallback fails on any try (a
    # non-200, or a reply from the dead endpoint), and one that never lists the endpoint fails all three.
    listed_first = 0
    for _attempt in range(3):
        listed_first = _register_a_dead_endpoint_and_send(rs)
        if listed_first:
            break
    assert listed_first >= 1, "the dead endpoint was never picked first in 3 tries: nothing fell back"


def _register_a_dead_endpoint_and_send(rs: RunningStack) -> int:
    """Register an endpoint nothing listens on, send requests while the picker may list it first, check
    that every one is served 200 by a live endpoint and that the dead one leaves the picks; returns how
    many requests listed it first."""
    _wait_for_state(rs, healthy=3)
    api = str(rs.config.xds.api_listen)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    dead = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    # one long request on each live endpoint (the picker spreads three over three idle ones), so that an
    # endpoint registered now, idle, is the picker's first choice until the xDS server's probes find it dead
    background = ThreadPoolExecutor(max_workers=3)
    long = [background.submit(rs.chat, QWEN, max_tokens=20_000) for _ in range(3)]
    time.sleep(0.2)
    spec = {"name": "dead-h100", "address": dead, "model": QWEN, "gpu": "H100"}
    reply = http_request(api, "POST", "/v1/endpoints", spec, headers=auth)
    assert reply.status == 201, reply.body
    try:
        listed_first = 0
        statuses: Counter[int] = Counter()
        started = time.monotonic()
        while time.monotonic() - started < 3.0:
            reply = rs.chat(QWEN)
            statuses[reply.status] += 1
            served = reply.headers.get("x-inferlb-endpoint", "?")
            assert served != "dead-h100"
            if reply.status == 200:
                sent = _last_upstream_headers(rs, served)[h.DESTINATION_ENDPOINT]
                listed_first += sent.split(",")[0] == dead
        assert statuses == Counter({200: sum(statuses.values())}), statuses
        state = _wait_for_state(rs, healthy=3)  # the three live ones; the dead one is out
        [row] = [r for r in state["clusters"][CLUSTER] if r["address"] == dead]
        assert row["healthy"] is False
        print(f"dead pick listed first {listed_first} times of {sum(statuses.values())}, every request 200")
        assert [f.result().status for f in long] == [200] * 3
    finally:
        background.shutdown(wait=True)
        reply = http_request(api, "DELETE", f"/v1/endpoints/{dead}", headers=auth)
        assert reply.status == 200, reply.body
    deadline = time.monotonic() + 10
    while any(r["address"] == dead for r in _picking(rs)["clusters"][CLUSTER]):
        assert time.monotonic() < deadline, "the dead endpoint never left the picking state"
        time.sleep(0.1)
    return listed_first


def test_load_picking_spreads_a_burst(picking_stack: RunningStack) -> None:
    rs = picking_stack
    _wait_for_state(rs, healthy=3)
    burst = 30
    body = {"model": QWEN, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 400}
    url = f"http://{rs.gateway}/v1/chat/completions"

    async def one(http: aiohttp.ClientSession) -> tuple[int, str]:
        async with http.post(url, json=body, headers={"Authorization": "Bearer sk-demo-a"}) as r:
            await r.read()
            return r.status, r.headers.get("x-inferlb-endpoint", "?")

    async def run() -> list[tuple[int, str]]:
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            return await asyncio.gather(*(one(http) for _ in range(burst)))

    got = asyncio.run(run())
    assert all(status == 200 for status, _ in got), got
    served = Counter(name for _, name in got)
    print(f"burst of {burst}: {dict(served)}")
    # every endpoint takes a share (the in-flight count and the load guard move the picks on); with the
    # weights (H100 34, V100 10 each) the V100s' fair share is 10/54 each, ~5 of 30
    assert set(served) == set(_qwen_names(rs)), served
    assert min(served.values()) >= 2, served


# -- precise mode: the servers' KV events --------------------------------------------------------------------


def _names(rs: RunningStack, model: str) -> list[str]:
    return [e.display_name for e in rs.config.endpoints if e.model == model]


def _prefix_hits(rs: RunningStack, model: str) -> int:
    """gpusim's own ``vllm:prefix_cache_hits_total`` (tokens) over ``model``'s endpoints."""
    total = 0
    for name in _names(rs, model):
        text = http_request(_address(rs, name), "GET", "/metrics").body.decode()
        total += sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("vllm:prefix_cache_hits_total")
        )
    return total


def _subscribed(rs: RunningStack, timeout_s: float = 10.0) -> None:
    """Wait until the request path has a KV-event subscriber per mistral endpoint (its /metrics says)."""
    addresses = {_address(rs, n) for n in _names(rs, PRECISE)}
    deadline = time.monotonic() + timeout_s
    while True:
        text = http_request(str(rs.config.ext_proc.metrics_listen), "GET", "/metrics").body.decode()
        seen = {a for a in addresses if f'inferlb_kv_events_batches_total{{endpoint="{a}"}}' in text}
        if seen == addresses:
            return
        assert time.monotonic() < deadline, f"subscribed to {seen} of {addresses}"
        time.sleep(0.1)


def _conversations(rs: RunningStack, model: str, count: int, turns: int) -> list[list[str]]:
    """``count`` conversations of ``turns`` turns each on ``model``; the endpoints that served each turn.
    The first turns go at once (the in-flight counts spread them), the later ones one at a time, each
    resending the whole conversation as a chat client does."""
    url = f"http://{rs.gateway}/v1/chat/completions"
    auth = {"Authorization": "Bearer sk-demo-a"}
    history: list[list[dict[str, str]]] = [
        [{"role": "user", "content": f"Conversation {i}. " + "Tell me about prefix caches, please. " * 30}]
        for i in range(count)
    ]

    async def turn(http: aiohttp.ClientSession, i: int) -> str:
        body = {"model": model, "messages": history[i], "max_tokens": 100}
        async with http.post(url, json=body, headers=auth) as r:
            doc = await r.json()
            assert r.status == 200, doc
            history[i].append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
            history[i].append({"role": "user", "content": f"And then, {len(history[i])}?"})
            return r.headers.get("x-inferlb-endpoint", "?")

    async def run() -> list[list[str]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            served = [[name] for name in await asyncio.gather(*(turn(http, i) for i in range(count)))]
            for _ in range(turns - 1):
                # past the access log's flush (ext_authz mode): the turns before have left their counts
                await asyncio.sleep(0.3)
                for i in range(count):
                    served[i].append(await turn(http, i))
            return served

    return asyncio.run(run())


def test_precise_picking_keeps_each_conversation_where_its_prefix_is_cached(
    picking_stack: RunningStack,
) -> None:
    rs = picking_stack
    state = _picking(rs)
    rows = state["clusters"][PRECISE_CLUSTER]
    assert len(rows) == 3 and all(r["kv_events"]["endpoint"].startswith("tcp://127.0.0.1:") for r in rows)
    _subscribed(rs)
    count, turns = 6, 4
    before = _prefix_hits(rs, PRECISE), _prefix_hits(rs, QWEN)
    precise = _conversations(rs, PRECISE, count, turns)
    load = _conversations(rs, QWEN, count, turns)
    hits = _prefix_hits(rs, PRECISE) - before[0], _prefix_hits(rs, QWEN) - before[1]
    stay = [len(set(s)) == 1 for s in precise]
    print(
        f"precise: {precise}\nload: {load}\nprefix cache hits (tokens): precise {hits[0]}, load {hits[1]}; "
        f"conversations on one endpoint: precise {sum(stay)}/{count}, "
        f"load {sum(len(set(s)) == 1 for s in load)}/{count}"
    )
    assert all(stay), precise
    assert len({s[0] for s in precise}) >= 2, precise  # different conversations spread
    assert hits[0] > 0 and hits[0] >= hits[1], hits
