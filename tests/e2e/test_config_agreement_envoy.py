"""The request-path service (ext_proc, or ext_authz in that mode) and xds_server accept or refuse a changed
config file together, through a real Envoy, in both request-path modes.

Each follows the file on its own. They once ran different checks beyond the schema (ext_proc loaded the
tokenizers, xds_server resolved the endpoint host names), so a file one refused the other applied: with
llama's only version renamed v1 -> v3 in that file, Envoy got v3 routes while ext_proc kept sending
``x-inferlb-version: v1``, and every llama request was a 404 ``no_route``. Both now run
:func:`inferlb.config.checks.check_config`, so such a file leaves both on the last good config.
"""

from __future__ import annotations

import copy
import functools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from inferlb.ops.stack import admin_get
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import RunningStack, in_mode, started_stack

pytestmark = pytest.mark.e2e

LLAMA = "llama-3.1-8b-instruct"
QWEN = "qwen2.5-7b-instruct"
REQUESTS = 12


def single_version_doc() -> dict[str, Any]:
    """The default fleet with llama on one version, v1 (its canary endpoint moved to v1)."""
    doc = make_config_doc()
    llama = next(m for m in doc["models"] if m["name"] == LLAMA)
    llama["versions"] = [{"name": "v1", "traffic_percent": 100}]
    for ep in doc["endpoints"]:
        if ep["model"] == LLAMA:
            ep["version"] = "v1"
    return doc


def renamed_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with llama's version (and its endpoints) renamed v1 -> v3: a valid file on its own."""
    out = copy.deepcopy(doc)
    next(m for m in out["models"] if m["name"] == LLAMA)["versions"] = [
        {"name": "v3", "traffic_percent": 100}
    ]
    for ep in out["endpoints"]:
        if ep["model"] == LLAMA:
            ep["version"] = "v3"
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request_path: str) -> Iterator[RunningStack]:
    doc = in_mode(single_version_doc(), request_path)
    with started_stack(tmp_path_factory.mktemp("agree"), doc) as rs:
        yield rs


def log_count(rs: RunningStack, service: str, needle: str) -> int:
    path = dict(rs.stack.logs())[service]
    return path.read_text(encoding="utf-8", errors="replace").count(needle)


def until(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


def llama_versions_in_envoy(rs: RunningStack) -> set[str]:
    """The llama versions of the clusters Envoy's routes send to (``/config_dump`` of the route table)."""
    dump = json.loads(admin_get(rs.config, "/config_dump?resource=dynamic_route_configs"))
    text = json.dumps(dump)
    prefix = f"{LLAMA}--"
    return {v for v in ("v1", "v2", "v3") if f'"{prefix}{v}"' in text}


def llama_statuses(rs: RunningStack) -> list[int]:
    return [rs.chat(LLAMA, max_tokens=2).status for _ in range(REQUESTS)]


def services(rs: RunningStack) -> tuple[str, str]:
    """The stack's services that follow the file: the request-path service (``ext_proc`` or ``ext_authz``,
    by ``ext_proc.protocol``) and the xDS server."""
    return (rs.config.ext_proc.protocol, "xds_server")


def polls(rs: RunningStack, service: str) -> int:
    """How many changed files ``service`` has logged applying or refusing."""
    needles = (
        (f"config {rs.config_path} accepted", "config change refused")
        if service == "xds_server"
        else ("config reloaded from", "config reload refused")  # ext_proc/process.py, both services
    )
    return sum(log_count(rs, service, needle) for needle in needles)


def refuse_together(rs: RunningStack, bad: dict[str, Any], field: str) -> None:
    """Write ``bad``; once both services have polled it, llama is still routed to v1 and served, and both
    logged the refusal naming ``field``."""
    before = {service: polls(rs, service) for service in services(rs)}
    write_config(rs.config_path, bad)
    for service in services(rs):
        until(functools.partial(lambda s: polls(rs, s) > before[s], service), f"{service} to poll the file")
    assert llama_versions_in_envoy(rs) == {"v1"}
    assert llama_statuses(rs) == [200] * REQUESTS
    assert rs.chat(QWEN, max_tokens=2).status == 200
    for service in services(rs):
        assert log_count(rs, service, field) >= 1, f"{service} did not name {field}"


def test_the_stack_starts_on_v1(stack: RunningStack) -> None:
    assert llama_versions_in_envoy(stack) == {"v1"}
    assert llama_statuses(stack) == [200] * REQUESTS


def test_a_rename_with_a_bad_tokenizer_is_refused_by_both(stack: RunningStack) -> None:
    bad = renamed_to_v3(stack.doc)
    next(m for m in bad["models"] if m["name"] == QWEN)["tokenizer"] = "hf:/nonexistent/tokenizer.json"
    refuse_together(stack, bad, "models[1].tokenizer")


def test_a_rename_with_an_unresolvable_host_is_refused_by_both(stack: RunningStack) -> None:
    bad = renamed_to_v3(stack.doc)
    bad["endpoints"][-1]["address"] = "gpu-9.invalid:8001"  # .invalid never resolves (RFC 2606)
    refuse_together(stack, bad, f"endpoints[{len(bad['endpoints']) - 1}].address")


def test_the_same_rename_in_a_good_file_is_applied_by_both(stack: RunningStack) -> None:
    # the checks above could not pass by refusing everything: the good rename reaches Envoy and ext_proc
    # (each polls on its own, so for up to one poll interval they may disagree: wait it out)
    write_config(stack.config_path, renamed_to_v3(stack.doc))
    until(lambda: llama_versions_in_envoy(stack) == {"v3"}, "Envoy's routes to move to v3")
    until(lambda: stack.chat(LLAMA, max_tokens=2).status == 200, "llama to be served on v3")
    assert llama_statuses(stack) == [200] * REQUESTS
