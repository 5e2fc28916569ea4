"""Kubernetes discovery at fleet scale: the xDS server following one ``InferencePool`` of N pods.

Not a test: it prints a table. Per size N (``--sizes``) it

1. fills the API server emulator (tests/kube_emulator.py, real HTTP on 127.0.0.1) with one pool and N
   ready pods (IPs in 127.1.0.0/16, nothing listens: the server only publishes them);
2. starts an in-process :class:`xds_server.server.XdsServer` whose config follows that pool, and measures
   the time until the published EDS snapshot holds all N endpoints (list + mapping + validation +
   publish);
3. ``--rounds`` times, marks one pod terminating (one watch event) and measures the time until the
   snapshot sends it DRAINING (p50 and max), then ready again;
4. replaces every pod at once (a rollout as N MODIFIED events in one burst) and measures the time until
   every endpoint in the snapshot carries its new GPU profile.

Usage: ``.venv/bin/python bench/k8s_discovery.py [--sizes 100,1000,5000] [--rounds 5]``. Limits: the
emulator, the client and the server share one event loop and process, so the times include the
emulator's own work; the machine is shared (print the load average beside the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from inferlb.config.schema import default_config_path
from tests.kube_emulator import KubeEmulator
from xds_server import resources as r
from xds_server.server import XdsServer

CLUSTER = "qwen2.5-7b-instruct--v1"
#: No single wait runs longer than this (s).
WAIT_LIMIT_S = 120.0


def _pod(i: int, *, ready: bool = True, deleting: bool = False, gpu: str = "H100") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"qwen-{i}", "namespace": "default", "labels": {"app": "qwen"},
                            "annotations": {"inferlb.io/gpu-profile": gpu}}  # fmt: skip
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status = {"phase": "Running", "podIP": f"127.1.{i // 250}.{i % 250 + 1}",
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {
        "name": "qwen-pool",
        "namespace": "default",
        "labels": {"inferlb.io/model": "qwen2.5-7b-instruct"},
    },
    "spec": {"selector": {"matchLabels": {"app": "qwen"}}, "targetPorts": [{"number": 8000}]},
}


def _hosts(server: XdsServer) -> dict[str, endpoint_pb2.LbEndpoint]:
    snap = server.cache.snapshot()
    if snap is None or CLUSTER not in snap.resources[r.ENDPOINT_TYPE]:
        return {}
    cla = snap.resources[r.ENDPOINT_TYPE][CLUSTER].message
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    return {
        f"{lb.endpoint.address.socket_address.address}:{lb.endpoint.address.socket_address.port_value}": lb
        for loc in cla.endpoints
        for lb in loc.lb_endpoints
    }


async def _until(predicate: Any, what: str) -> float:
    t0 = time.perf_counter()
    while not predicate():
        if time.perf_counter() - t0 > WAIT_LIMIT_S:
            raise SystemExit(f"gave up after {WAIT_LIMIT_S:.0f} s waiting for {what}")
        await asyncio.sleep(0.002)
    return time.perf_counter() - t0


async def _one(n: int, rounds: int, tmp: Path) -> dict[str, float]:
    emu = KubeEmulator()
    await emu.start()
    emu.apply({"type": "ADDED", "resource": "inferencepools", "object": POOL})
    for i in range(n):
        emu.apply({"type": "ADDED", "resource": "pods", "object": _pod(i)})
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["xds"]["push_debounce_ms"] = 20
    doc["discovery"] = {
        "kubernetes": {"inference_pools": ["qwen-pool"], "kubeconfig": str(emu.kubeconfig(tmp / "kc"))}
    }
    path = tmp / f"inferlb-{n}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    server = XdsServer(path, bind=("127.0.0.1", 0), api_bind=("127.0.0.1", 0), poll_interval_s=3600)
    t0 = time.perf_counter()
    await server.start()
    await _until(lambda: len(_hosts(server)) >= n + 3, "the first sync")  # + the file's 3 qwen endpoints
    first = time.perf_counter() - t0
    drains: list[float] = []
    for k in range(rounds):
        i = (k * 7919) % n
        key = _pod(i)["status"]["podIP"] + ":8000"
        emu.apply({"type": "MODIFIED", "resource": "pods", "object": _pod(i, deleting=True)})
        drains.append(
            await _until(
                lambda key=key: (
                    (lb := _hosts(server).get(key)) is not None
                    and lb.health_status == health_check_pb2.DRAINING
                ),
                "a drain",
            )
        )
        emu.apply({"type": "MODIFIED", "resource": "pods", "object": _pod(i)})
        await _until(
            lambda key=key: _hosts(server)[key].health_status != health_check_pb2.DRAINING, "undrain"
        )
    t1 = time.perf_counter()
    for i in range(n):
        emu.apply({"type": "MODIFIED", "resource": "pods", "object": _pod(i, gpu="A100")})

    def rolled() -> bool:
        assert server.effective is not None
        return (
            sum(
                1
                for e in server.effective.endpoints
                if e.gpu == "A100" and e.address.host.startswith("127.1.")
            )
            == n
        )

    await _until(rolled, "the rollout")
    rollout = time.perf_counter() - t1
    await server.stop(0)
    await emu.stop()
    return {
        "first_s": first,
        "drain_p50_ms": statistics.median(drains) * 1000,
        "drain_max_ms": max(drains) * 1000,
        "rollout_s": rollout,
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,1000,5000", help="pods per run, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="single-pod drains per size")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    head = ("pods", "first sync s", "1 drain p50 ms", "1 drain max ms", "rollout s")
    print(" | ".join(f"{h:>14}" for h in head))
    print("-" * 82)
    with tempfile.TemporaryDirectory() as d:
        for n in sizes:
            row = await _one(n, args.rounds, Path(d))
            cells = (
                f"{n}",
                f"{row['first_s']:.2f}",
                f"{row['drain_p50_ms']:.1f}",
                f"{row['drain_max_ms']:.1f}",
                f"{row['rollout_s']:.2f}",
            )
            print(" | ".join(f"{c:>14}" for c in cells))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    asyncio.run(main())
