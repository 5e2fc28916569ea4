"""A config file written in place, caught half-written, is never served: ``python -m xds_server`` keeps
every endpoint in EDS and ``python -m ext_proc`` answers no 401 for a valid key while the file is cut before
``endpoints:`` / ``tenants:`` for several polls (such a file empties a section: refused, naming
``allow_empty``); a cut that keeps every section and is seen on one poll only is not taken by either
service's poller (the change must read the same on two polls in a row)."""

from __future__ import annotations

import asyncio
import copy
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from envoy.config.endpoint.v3 import endpoint_pb2

from ext_proc.poller import ConfigPoller
from tests.conftest import make_config_doc, write_config
from tests.integration.test_ads_stream import AdsClient
from tests.integration.test_ext_proc_grpc import CONFIG, Process, first_status, free_port
from xds_server import resources as r
from xds_server.server import XdsServer

CLUSTERS = ["llama-3.1-8b-instruct--v1", "llama-3.1-8b-instruct--v2", "qwen2.5-7b-instruct--v1"]
#: xds_server's config poll period (its default) and ext_proc's (``--poll-interval``), s
XDS_POLL_S = 0.5
EXT_PROC_POLL_S = 0.1


def _dump(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def _cut_before(text: str, section: str) -> str:
    """The file as a writer that stopped just before the line ``section:`` left it (valid YAML)."""
    return text[: text.index(f"\n{section}:") + 1]


def _endpoint_count(resp: Any) -> dict[str, int]:
    out = {}
    for any_ in resp.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert any_.Unpack(cla)
        out[cla.cluster_name] = sum(len(loc.lb_endpoints) for loc in cla.endpoints)
    return out


def _weights(resp: Any) -> dict[str, int]:
    out = {}
    for any_ in resp.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert any_.Unpack(cla)
        out.update({lb.endpoint.hostname: lb.load_balancing_weight.value for loc in cla.endpoints
                    for lb in loc.lb_endpoints})  # fmt: skip
    return out


async def test_xds_server_never_serves_a_file_cut_before_endpoints(tmp_path: Path) -> None:
    doc = make_config_doc()
    path = write_config(tmp_path / "inferlb.yaml", doc)
    port = int(doc["xds"]["listen"].rsplit(":", 1)[1])
    proc = Process(
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "xds_server", "--config", str(path), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
    )  # fmt: skip
    client: AdsClient | None = None
    try:
        await proc.wait_for_line("xds_server ready on")
        client = AdsClient(port)
        await client.send(r.ENDPOINT_TYPE, names=CLUSTERS, node=True)
        first = await client.recv()
        full = _endpoint_count(first)
        assert sum(full.values()) == len(doc["endpoints"])
        await client.ack(first, CLUSTERS)

        # the new file differs (H100s weigh 40): its first half stays on disk for 4 polls, then the rest
        changed = copy.deepcopy(doc)
        changed["gpu_profiles"]["H100"] = {"relative_capacity": 4.0}
        text = _dump(changed)
        path.write_text(_cut_before(text, "endpoints"), encoding="utf-8")
        await proc.wait_for_line("config change refused", within_s=10)
        # the error names each emptied section (one line each) and the field that allows it
        refused = await proc.wait_for_line(": endpoints: the running config has 8 endpoints")
        assert "allow_empty: [endpoints]" in refused
        assert "allow_empty: [tenants]" in await proc.wait_for_line(": tenants: the running config has 3")
        deadline = time.monotonic() + 4 * XDS_POLL_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                pushed = await client.recv(left)
            except TimeoutError:
                break
            assert _endpoint_count(pushed) == full, "a push with endpoints missing"
            await client.ack(pushed, CLUSTERS)
        with path.open("a", encoding="utf-8") as f:
            f.write(text[len(_cut_before(text, "endpoints")) :])
        pushed = await client.recv(10)
        assert _endpoint_count(pushed) == full
        assert _weights(pushed)["h100-0"] == 40  # the whole file, once written, is served
    finally:
        if client is not None:
            await client.close()
        assert await proc.stop() == 0


async def test_ext_proc_answers_no_401_while_the_file_is_cut_before_tenants(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    cfg = {
        "ext_proc": {
            "protocol": "ext_proc",
            "listen": f"127.0.0.1:{port}",
            "metrics_listen": f"127.0.0.1:{metrics_port}",
        },
        **CONFIG,
    }
    assert list(cfg)[-1] == "tenants"
    path = tmp_path / "inferlb.yaml"
    path.write_text(_dump(cfg), encoding="utf-8")
    proc = Process(
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ext_proc", "--config", str(path), "--poll-interval",
            str(EXT_PROC_POLL_S), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    )  # fmt: skip
    addr = f"127.0.0.1:{port}"
    try:
        await proc.wait_for_line("ext_proc ready on")
        assert await first_status(addr, "sk-gold-0001") == 200
        full = {**cfg, "tenants": [*cfg["tenants"], {"name": "late", "api_keys": ["sk-late-0001"]}]}
        text = _dump(full)
        cut = _cut_before(text, "tenants")
        path.write_text(cut, encoding="utf-8")
        # a bounded request loop over 10 polls with the cut file on disk
        statuses: dict[int, int] = {}
        deadline = time.monotonic() + 10 * EXT_PROC_POLL_S
        for _ in range(500):
            if time.monotonic() > deadline:
                break
            status = await first_status(addr, "sk-gold-0001")
            statuses[status] = statuses.get(status, 0) + 1
        assert statuses.get(401, 0) == 0, statuses
        assert sum(statuses.values()) >= 5
        line = await proc.wait_for_line("config reload refused")
        assert ": tenants: the running config has 2 tenants" in line and "allow_empty: [tenants]" in line
        with path.open("a", encoding="utf-8") as f:
            f.write(text[len(cut) :])
        await proc.wait_for_line("config reloaded")
        assert await first_status(addr, "sk-late-0001") == 200
        assert await first_status(addr, "sk-gold-0001") == 200

        # emptying the tenants on purpose works when the file says so
        path.write_text(_dump({**cfg, "tenants": [], "allow_empty": ["tenants"]}), encoding="utf-8")
        await proc.wait_for_line("0 tenants")
        assert await first_status(addr, "sk-gold-0001") == 401
    finally:
        rc = await proc.stop()
    assert rc == 0


def _halves(doc: dict[str, Any], section: str, keep: int) -> tuple[str, str]:
    """``(the file cut after the first ``keep`` entries of ``section``, the whole file)``, ``section`` last:
    the cut keeps every section non-empty, so only the stability rule stands between it and the server."""
    head = {k: v for k, v in doc.items() if k != section}
    first = _dump(head) + f"{section}:\n" + _dump(doc[section][:keep])
    return first, first + _dump(doc[section][keep:])


async def test_xds_server_takes_a_change_only_once_two_polls_read_it(tmp_path: Path) -> None:
    doc = make_config_doc()
    half, whole = _halves(doc, "endpoints", 3)
    assert yaml.safe_load(whole) == {**{k: v for k, v in doc.items() if k != "endpoints"},
                                     "endpoints": doc["endpoints"]}  # fmt: skip
    path = write_config(tmp_path / "inferlb.yaml", doc)
    # polled by hand below: the background poll waits an hour
    srv = XdsServer(path, bind=("127.0.0.1", 0), api_bind=None, poll_interval_s=3600)
    await srv.start()

    def served() -> int:
        snap = srv.cache.snapshot()
        assert snap is not None
        return sum(
            len(loc.lb_endpoints)
            for res in snap.resources[r.ENDPOINT_TYPE].values()
            for loc in res.message.endpoints
        )

    try:
        doc["gpu_profiles"]["H100"] = {"relative_capacity": 4.0}
        half, whole = _halves(doc, "endpoints", 3)
        path.write_text(half, encoding="utf-8")  # a writer half-way through
        assert await srv.reload_if_changed() is None  # poll 1: seen once
        path.write_text(whole, encoding="utf-8")  # ... done before the next poll
        assert await srv.reload_if_changed() is None  # poll 2: changed again, seen once
        assert served() == 8
        loaded = await srv.reload_if_changed()  # poll 3: the same bytes twice in a row
        assert loaded is not None and len(loaded.config.endpoints) == 8
        assert loaded.config.gpu_profiles["H100"].relative_capacity == 4.0
        assert served() == 8 and srv.reload_errors == 0
    finally:
        await srv.stop(0)


def test_ext_proc_takes_a_change_only_once_two_polls_read_it(tmp_path: Path) -> None:
    cfg = {**CONFIG, "tenants": [*CONFIG["tenants"], {"name": "late", "api_keys": ["sk-late-0001"]}]}
    path = tmp_path / "inferlb.yaml"
    path.write_text(_dump(CONFIG), encoding="utf-8")
    poller = ConfigPoller(path)
    digest, _ = poller.read()
    poller.digest = digest
    half, whole = _halves(cfg, "tenants", 1)  # the first tenant only
    path.write_text(half, encoding="utf-8")
    assert poller.poll() is None  # seen once
    path.write_text(whole, encoding="utf-8")
    assert poller.poll() is None  # changed again
    config = poller.poll()
    assert config is not None and [t.name for t in config.tenants] == ["gold", "small", "late"]
    assert poller.poll() is None
