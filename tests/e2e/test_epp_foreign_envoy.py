"""``python -m epp`` as the endpoint picker of an Envoy inferlb did not configure: a static bootstrap written
the way the Gateway API Inference Extension's own test config is (an ORIGINAL_DST cluster that takes the
upstream from the ``x-gateway-destination-endpoint`` header, the ext_proc filter in
``FULL_DUPLEX_STREAMED`` with trailers SEND), with simulated GPUs as the pool.

What the foreign config adds beyond GIE's, to exercise the rest of the protocol: a header-to-metadata
filter turning the test header ``x-subset-hint`` into the ``envoy.lb.subset_hint`` metadata the EPP reads;
the route writing the upstream address into ``x-gateway-destination-endpoint-served`` and a second
header-to-metadata filter turning it into ``envoy.lb`` metadata on the response path (the served report a
GIE gateway makes); and response headers echoing, per request, the header and the ``envoy.lb`` dynamic
metadata the EPP set, so each answer shows what was picked and where it ran (gpusim's
``x-inferlb-endpoint``).

One stack for the module: gpusim (publishing its KV events over ZMQ), the EPP with the approximate prefix
index, Envoy (and a second EPP with a fair queue, behind a third Envoy; a third EPP with the precise prefix
index fed by gpusim's KV events, behind a fourth).
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferlb.ops.stack import find_envoy, free_ports
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import Reply, http_request

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b-instruct"
START_TIMEOUT_S = 60.0


def _http_filter(name: str, type_url: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": type_url, **config}}


#: The processing mode of GIE's current gateway configs (the EPP protocol's streaming mode).
FULL_DUPLEX_MODE = {
    "request_header_mode": "SEND",
    "response_header_mode": "SEND",
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "response_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_trailer_mode": "SEND",
}
#: The processing mode of GIE's older test config: a BUFFERED request body, no response phases.
BUFFERED_MODE = {
    "request_header_mode": "SEND",
    "response_header_mode": "SKIP",
    "request_body_mode": "BUFFERED",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SKIP",
}


def foreign_bootstrap(
    *, listen: int, admin: int, epp: int, log: Path, mode: dict[str, str] = FULL_DUPLEX_MODE
) -> dict[str, Any]:
    """A static Envoy bootstrap in the style of GIE's ``test/testdata/envoy.yaml`` (no xDS), with the
    ext_proc filter's ``processing_mode`` ``mode``."""
    h2m = "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config"
    filters = [
        _http_filter(
            "envoy.filters.http.header_to_metadata",
            h2m,
            request_rules=[
                {
                    "header": "x-subset-hint",
                    "on_header_present": {
                        "metadata_namespace": "envoy.lb.subset_hint",
                        "key": "x-gateway-destination-endpoint-subset",
                        "type": "STRING",
                    },
                    "remove": True,
                }
            ],
        ),
        _http_filter(
            "envoy.filters.http.ext_proc",
            "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            grpc_service={"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
            processing_mode=mode,
            message_timeout="10s",
            metadata_options={
                "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
        ),
        # on the response path this runs before ext_proc (filters encode in reverse order)
        _http_filter(
            "envoy.filters.http.header_to_metadata.served",
            h2m,
            response_rules=[
                {
                    "header": "x-gateway-destination-endpoint-served",
                    "on_header_present": {
                        "metadata_namespace": "envoy.lb",
                        "key": "x-gateway-destination-endpoint-served",
                        "type": "STRING",
                    },
                }
            ],
        ),
        _http_filter(
            "envoy.filters.http.router", "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        ),
    ]
    route = {
        "match": {"prefix": "/"},
        "route": {"cluster": "original_destination_cluster", "timeout": "60s"},
        "response_headers_to_add": [
            {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for k, v in (
                ("x-gateway-destination-endpoint-served", "%UPSTREAM_REMOTE_ADDRESS%"),
                ("x-test-picked-header", "%REQ(x-gateway-destination-endpoint)%"),
                ("x-test-picked-metadata", "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%"),
            )
        ],
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "epp-e2e",
        "http_protocol_options": {"enable_trailers": True},
        "route_config": {
            "name": "vllm",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}],
        },
        "http_filters": filters,
        "access_log": [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(log),
                },
            }
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "vllm",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "connect_timeout": "5s",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": "x-gateway-destination-endpoint",
                    },
                },
                {
                    "name": "ext_proc",
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3"
                            ".HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "ext_proc",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {"address": "127.0.0.1", "port_value": epp}
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }


@dataclass
class EppStack:
    gateway: str
    #: a second Envoy on the same EPP with GIE's older BUFFERED-body, no-response-phase mode
    buffered_gateway: str
    #: a third Envoy, on a second EPP with a fair queue (one request since the last scrape saturates an
    #: endpoint; it scrapes once at start, while gpusim is idle, then every 600 s: only ends make room, and
    #: the other tests' load on gpusim never shows in its values)
    queued_gateway: str
    queued_epp_metrics: str
    #: a fourth Envoy, on a third EPP with ``--prefix-index precise`` subscribed to every pool endpoint's KV
    #: events
    precise_gateway: str
    precise_epp_metrics: str
    admin: str
    epp: str
    epp_metrics: str
    #: gpusim display name -> address, for the pool's endpoints
    addresses: dict[str, str]
    access_log: Path

    def chat(self, content: str = "hello", headers: dict[str, str] | None = None, **extra: Any) -> Reply:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
        return http_request(self.gateway, "POST", "/v1/chat/completions", body, headers)

    def in_flight(self) -> float:
        """Requests the EPP counts in flight over the whole pool."""
        return sum(v for k, v in self.metrics().items() if k.startswith("inferlb_epp_in_flight{"))

    def metrics(self, where: str | None = None) -> dict[str, float]:
        """The EPP's Prometheus samples (the one serving ``where`` metrics), ``name{labels}`` -> value."""
        with urllib.request.urlopen(f"http://{where or self.epp_metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out


def _wait(what: str, ready: Any, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode} while waiting for {what}"
        try:
            if ready():
                return
        except (OSError, grpc.RpcError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {START_TIMEOUT_S}s waiting for {what}")


def _health(addr: str, service: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
    return int(reply.status)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return int(resp.status)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EppStack]:
    work = tmp_path_factory.mktemp("epp")
    doc = make_config_doc()
    config = write_config(work / "inferlb.yaml", doc)
    listen, admin, epp, epp_metrics, buffered_listen, buffered_admin = free_ports(6)
    queued_listen, queued_admin, queued_epp, queued_metrics = free_ports(4)
    precise_listen, precise_admin, precise_epp, precise_metrics = free_ports(4)
    access_log = work / "access.log"
    bootstrap = work / "envoy.yaml"
    bootstrap.write_text(
        yaml.safe_dump(foreign_bootstrap(listen=listen, admin=admin, epp=epp, log=access_log))
    )
    buffered = work / "envoy-buffered.yaml"
    buffered.write_text(
        yaml.safe_dump(
            foreign_bootstrap(
                listen=buffered_listen, admin=buffered_admin, epp=epp, log=access_log, mode=BUFFERED_MODE
            )
        )
    )
    queued = work / "envoy-queued.yaml"
    queued.write_text(
        yaml.safe_dump(
            foreign_bootstrap(listen=queued_listen, admin=queued_admin, epp=queued_epp, log=access_log)
        )
    )
    precise = work / "envoy-precise.yaml"
    precise.write_text(
        yaml.safe_dump(
            foreign_bootstrap(listen=precise_listen, admin=precise_admin, epp=precise_epp, log=access_log)
        )
    )
    pool = {e["name"]: e["address"] for e in doc["endpoints"] if e["model"] == MODEL}
    zmq_ports = dict(zip(pool, free_ports(len(pool)), strict=True))
    # gpusim binds a wildcard endpoint as vLLM does (it connects to any other); the EPP connects on loopback
    publish = [
        f"{name}="
        + json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})
        for name, port in zmq_ports.items()
    ]
    subscribe = [
        a for name, port in zmq_ports.items() for a in ("--kv-events", f"{pool[name]}=tcp://127.0.0.1:{port}")
    ]
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for name, argv in (
            (
                "gpusim",
                [
                    *(sys.executable, "-m", "simulation.gpusim", "--config", str(config)),
                    *(a for value in publish for a in ("--kv-events-config", value)),
                ],
            ),
            (
                "epp",
                [
                    *(sys.executable, "-m", "epp", "--config", str(config), "--model", MODEL),
                    *("--listen", f"127.0.0.1:{epp}", "--metrics-listen", f"127.0.0.1:{epp_metrics}"),
                    *("--scrape-interval", "0.2", "--prefix-index", "approximate"),
                ],
            ),
            (
                "epp-precise",
                [
                    *(sys.executable, "-m", "epp", "--config", str(config), "--model", MODEL),
                    *("--listen", f"127.0.0.1:{precise_epp}"),
                    *("--metrics-listen", f"127.0.0.1:{precise_metrics}"),
                    *("--scrape-interval", "0.2", "--prefix-index", "precise", *subscribe),
                ],
            ),
            (
                "epp-queued",
                [
                    *(sys.executable, "-m", "epp", "--config", str(config), "--model", MODEL),
                    *(
                        "--listen",
                        f"127.0.0.1:{queued_epp}",
                        "--metrics-listen",
                        f"127.0.0.1:{queued_metrics}",
                    ),
                    *(
                        "--scrape-interval",
                        "600",
                        "--queue-depth",
                        "1",
                        "--max-queued",
                        "4",
                        "--max-wait",
                        "8",
                    ),
                ],
            ),
            *(
                (
                    envoy,
                    [
                        *(find_envoy(), "-c", str(path), "--base-id", str(random.randint(10_000, 2_000_000))),
                        *("--concurrency", "1", "-l", "warning"),
                    ],
                )
                for envoy, path in (
                    ("envoy", bootstrap),
                    ("envoy-buffered", buffered),
                    ("envoy-queued", queued),
                    ("envoy-precise", precise),
                )
            ),
        ):
            if name == "epp":
                # an EPP's first scrape must find the pool up: it turns ready after that scrape even when it
                # failed, and the endpoint stays unhealthy until a good one (600 s for the queued EPP)
                _wait(
                    "the pool's /health",
                    lambda: all(_get(f"http://{a}/health") == 200 for a in pool.values()),
                    procs,
                )
            log = (work / f"{name}.log").open("wb")
            logs.append(log)
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        for port in (epp, queued_epp, precise_epp):
            _wait(
                "the EPP's readiness", lambda port=port: _health(f"127.0.0.1:{port}", "readiness") == 1, procs
            )
        for port in (admin, buffered_admin, queued_admin, precise_admin):
            _wait("Envoy's /ready", lambda port=port: _get(f"http://127.0.0.1:{port}/ready") == 200, procs)
        yield EppStack(
            gateway=f"127.0.0.1:{listen}",
            buffered_gateway=f"127.0.0.1:{buffered_listen}",
            queued_gateway=f"127.0.0.1:{queued_listen}",
            queued_epp_metrics=f"127.0.0.1:{queued_metrics}",
            precise_gateway=f"127.0.0.1:{precise_listen}",
            precise_epp_metrics=f"127.0.0.1:{precise_metrics}",
            admin=f"127.0.0.1:{admin}",
            epp=f"127.0.0.1:{epp}",
            epp_metrics=f"127.0.0.1:{epp_metrics}",
            addresses=pool,
            access_log=access_log,
        )
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for log in logs:
            log.close()


def test_health_services_answer_serving(stack: EppStack) -> None:
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert _health(stack.epp, service) == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as err:
        _health(stack.epp, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_requests_land_on_the_picked_endpoints(stack: EppStack) -> None:
    seen = set()
    for i in range(12):
        r = stack.chat(f"request {i}")
        assert r.status == 200, r.body
        picked = r.headers["x-test-picked-header"]
        # the header and the envoy.lb dynamic metadata carry the same value, and the request ran there
        assert r.headers["x-test-picked-metadata"] == picked
        assert stack.addresses[r.headers["x-inferlb-endpoint"]] == picked.split(",")[0]
        assert set(picked.split(",")) <= set(stack.addresses.values())
        seen.add(picked.split(",")[0])
        assert r.json()["choices"], r.body
    # sequential requests on an idle pool: load ties broken by the salted hash, still one of the pool
    assert seen <= set(stack.addresses.values())


def test_a_request_without_a_body_is_picked_at_its_headers(stack: EppStack) -> None:
    r = http_request(stack.gateway, "GET", "/v1/models")
    assert r.status == 200, r.body
    assert stack.addresses[r.headers["x-inferlb-endpoint"]] == r.headers["x-test-picked-header"]
    assert r.json()["data"], r.body


def test_the_served_report_comes_back_on_the_response_path(stack: EppStack) -> None:
    before = stack.metrics()
    for _ in range(3):
        assert stack.chat().status == 200
    after = stack.metrics()

    def total(samples: dict[str, float], match: str) -> float:
        return sum(
            v
            for k, v in samples.items()
            if k.startswith("inferlb_epp_served_total{") and f'match="{match}"' in k
        )

    assert total(after, "first") - total(before, "first") == 3
    assert total(after, "unreported") == total(before, "unreported")
    # every request ended: nothing left in flight
    assert stack.in_flight() == 0


def test_the_subset_hint_is_honoured(stack: EppStack) -> None:
    subset = sorted(stack.addresses.values())[:2]
    for i in range(8):
        r = stack.chat(f"subset {i}", headers={"x-subset-hint": ",".join(subset)})
        assert r.status == 200, r.body
        assert stack.addresses[r.headers["x-inferlb-endpoint"]] in subset
        assert set(r.headers["x-test-picked-header"].split(",")) <= set(subset)


def test_no_eligible_endpoint_is_a_503_with_an_openai_error(stack: EppStack) -> None:
    r = stack.chat(headers={"x-subset-hint": "192.0.2.1:9"})
    assert r.status == 503, r.body
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "no_endpoint_available"
    assert "x-inferlb-endpoint" not in r.headers


def test_a_bad_body_is_a_400_naming_the_field(stack: EppStack) -> None:
    r = http_request(stack.gateway, "POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"})
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == "messages"


def test_a_large_body_arrives_in_chunks_and_goes_upstream_whole(stack: EppStack) -> None:
    """A ~600 KB body (a field no parser reads pads it) reaches the EPP in several body messages and the
    model server whole: a cut or empty body would not parse as JSON there (400)."""
    before = stack.metrics().get('inferlb_epp_processing_seconds_count{phase="request_body"}', 0.0)
    pad = "".join(f"{i:07d}" for i in range(80_000))
    r = stack.chat("large body", x_pad=pad)
    after = stack.metrics()['inferlb_epp_processing_seconds_count{phase="request_body"}']
    assert r.status == 200, r.body[:300]
    assert r.json()["choices"], r.body[:300]
    assert r.headers["x-test-picked-header"] == stack.addresses[r.headers["x-inferlb-endpoint"]]
    assert after - before >= 2, "the body came in one message; the test does not exercise streaming"


def test_a_chunked_request_with_trailers_is_picked_at_the_trailers(stack: EppStack) -> None:
    """HTTP/1.1 chunked body with a trailer: Envoy ends the body with the trailers message, not with an
    end_of_stream body chunk; the EPP picks there and the request still goes upstream whole."""

    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "trailers"}], "max_tokens": 4}
    )
    half = len(body) // 2
    chunks = [body[:half].encode(), body[half:].encode()]
    host, port = stack.gateway.rsplit(":", 1)
    wire = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: epp\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nTrailer: x-checksum\r\nConnection: close\r\n\r\n"
    )
    for c in chunks:
        wire += f"{len(c):x}\r\n".encode() + c + b"\r\n"
    wire += b"0\r\nx-checksum: 1\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(wire)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, _ = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data[:500]
    assert b"x-inferlb-endpoint" in head.lower()


def test_a_buffered_body_gateway_without_response_phases_is_answered_in_its_order(stack: EppStack) -> None:
    """GIE's older test config (request body BUFFERED, response phases skipped): Envoy waits for the
    headers answer before it sends the body, so the EPP reads the mode from the stream's protocol_config,
    answers the headers at once and routes on the body answer."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "buffered"}], "max_tokens": 4}
    for _ in range(3):
        r = http_request(stack.buffered_gateway, "POST", "/v1/chat/completions", body)
        assert r.status == 200, r.body
        assert stack.addresses[r.headers["x-inferlb-endpoint"]] == r.headers["x-test-picked-header"]
        assert r.headers["x-test-picked-metadata"] == r.headers["x-test-picked-header"]
    r = http_request(stack.buffered_gateway, "POST", "/v1/chat/completions", {"model": MODEL})
    assert r.status == 400 and r.json()["error"]["param"] == "messages"
    # no response phase reports the end: the count is left when Envoy ends the stream
    deadline = time.monotonic() + 10
    while (left := stack.in_flight()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == 0


def test_a_request_on_a_saturated_endpoint_waits_and_is_admitted_when_the_one_ahead_ends(
    stack: EppStack,
) -> None:
    target = sorted(stack.addresses.values())[0]
    hint = {"x-subset-hint": target}

    def chat(max_tokens: int, tenant: str) -> Reply:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
        headers = {**hint, "x-gateway-inference-fairness-id": tenant}
        return http_request(stack.queued_gateway, "POST", "/v1/chat/completions", body, headers)

    def in_flight() -> float:
        samples = stack.metrics(stack.queued_epp_metrics)
        return sum(v for k, v in samples.items() if k.startswith("inferlb_epp_in_flight{"))

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(chat, 4000, "a")  # decodes for a few hundred ms on the simulated GPU
        deadline = time.monotonic() + 10
        while in_flight() < 1:
            assert time.monotonic() < deadline, (
                f"the first request never went in flight: {slow.result() if slow.done() else 'pending'}"
            )
            time.sleep(0.01)
        # the endpoint's backlog is 1 = --queue-depth: this one waits until the first ends
        second = chat(4, "b")
        first = slow.result(30)
    assert first.status == 200 and second.status == 200, (first, second)
    assert first.headers["x-test-picked-header"] == second.headers["x-test-picked-header"] == target
    samples = stack.metrics(stack.queued_epp_metrics)
    assert samples['inferlb_epp_queue_wait_seconds_count{outcome="admitted"}'] == 1
    assert samples['inferlb_epp_requests_total{outcome="routed"}'] == 2
    assert in_flight() == 0


def _prefix_hits(address: str) -> float:
    """gpusim's ``vllm:prefix_cache_hits_total`` at ``address`` (prompt tokens found in its prefix cache)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


def _long_prompt(tag: str) -> str:
    """A prompt of many KV-cache blocks, its own per ``tag``."""
    return f"{tag}: " + " ".join(f"{tag}-{i}" for i in range(400))


@pytest.mark.parametrize("index", ["approximate", "precise"])
def test_a_repeated_long_prompt_lands_on_the_gpu_holding_its_prefix(stack: EppStack, index: str) -> None:
    """A long prompt placed (through the subset hint) on a GPU other than the one an idle pool's load alone
    picks is sent again without a hint: it goes to the GPU that holds its prefix, whose prefix-cache hits
    grow by about the prompt. The approximate EPP knows from its own pick; the precise one only from the
    GPU's KV events (its index ignores picks)."""
    gateway = stack.gateway if index == "approximate" else stack.precise_gateway
    metrics = stack.epp_metrics if index == "approximate" else stack.precise_epp_metrics
    tag = f"{index}-{random.randrange(1 << 30)}"

    def chat(content: str, headers: dict[str, str] | None = None) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        r = http_request(gateway, "POST", "/v1/chat/completions", body, headers)
        assert r.status == 200, r.body
        return stack.addresses[r.headers["x-inferlb-endpoint"]]

    # where load alone goes now (a prompt no GPU holds), and a GPU that is not that one
    by_load = chat(_long_prompt(f"{tag}-probe"))
    target = next(a for a in sorted(stack.addresses.values()) if a != by_load)
    prompt = _long_prompt(tag)
    batches = f'inferlb_kv_events_batches_total{{endpoint="{target}"}}'
    before_events = stack.metrics(metrics).get(batches, 0.0)
    assert chat(prompt, {"x-subset-hint": target}) == target
    if index == "precise":
        deadline = time.monotonic() + 10
        while stack.metrics(metrics).get(batches, 0.0) <= before_events:
            assert time.monotonic() < deadline, "the precise EPP saw no KV event of the placed prompt"
            time.sleep(0.05)
    hits = _prefix_hits(target)
    assert chat(prompt) == target
    # the repeat reused the cached prompt there: hundreds of tokens of hits, not the chat template's few
    assert _prefix_hits(target) - hits >= 400
