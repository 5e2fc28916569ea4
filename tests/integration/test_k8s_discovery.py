"""Kubernetes discovery over real HTTP: lightkube's async client against the API server emulator
(tests/kube_emulator.py) replaying the recorded watch streams in tests/data/k8s/: the initial list,
add/modify/delete, terminating -> DRAINING, a dropped watch resumed from its resourceVersion, a 410 that
lists again, an API server restart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inferlb.config.schema import KubernetesDiscovery
from tests.conftest import wait_until
from tests.kube_emulator import KubeEmulator
from xds_server.k8s_api import LightkubeApi, kube_config
from xds_server.k8s_discovery import Discovery
from xds_server.k8s_mapping import Mapped

SLICES = "endpointslices.jsonl"
POOL = "inferencepool.jsonl"


@pytest.fixture
async def emulator() -> AsyncIterator[KubeEmulator]:
    emu = KubeEmulator()
    await emu.start()
    try:
        yield emu
    finally:
        await emu.stop()


class Seen:
    """What the discovery handed over, last first."""

    def __init__(self) -> None:
        self.calls: list[Mapped] = []

    def __call__(self, mapped: Mapped) -> None:
        self.calls.append(mapped)

    def states(self) -> dict[str, bool]:
        return {d.key: d.draining for d in self.calls[-1].endpoints} if self.calls else {}


async def _discovery(
    emu: KubeEmulator, tmp_path: Path, watch_restart_s: float = 300.0, **kw: object
) -> tuple[Discovery, Seen]:
    settings = KubernetesDiscovery.model_validate(
        {"kubeconfig": str(emu.kubeconfig(tmp_path / "kubeconfig")), "backoff_base_ms": 20,
         "backoff_max_ms": 200, **kw}
    )  # fmt: skip
    seen = Seen()
    d = Discovery(settings, LightkubeApi(kube_config(settings)), seen, watch_restart_s=watch_restart_s)
    await d.start()
    return d, seen


async def _until_state(seen: Seen, key: str, draining: bool | None, what: str) -> None:
    """Wait until ``key`` is served with ``draining`` (None: until it is gone)."""
    if draining is None:
        await wait_until(lambda: seen.calls != [] and key not in seen.states(), what)
    else:
        await wait_until(lambda: seen.states().get(key) is draining, what)


async def test_slices_initial_list_add_modify_terminating_delete(
    emulator: KubeEmulator, tmp_path: Path
) -> None:
    emulator.replay(SLICES, "initial")
    d, seen = await _discovery(emulator, tmp_path, services=["llama"])
    try:
        await wait_until(lambda: bool(seen.calls), "the first list")
        # only the followed Service's slices (the other Service's is not selected)
        assert seen.states() == {"127.0.1.1:8000": False, "127.0.1.2:8000": False}
        assert emulator.requests[0] == (
            "endpointslices",
            {"labelSelector": "kubernetes.io/service-name=llama"},
        )
        emulator.replay(SLICES, "added")
        await _until_state(seen, "127.0.1.3:8000", False, "the added endpoint")
        emulator.replay(SLICES, "terminating")
        await _until_state(seen, "127.0.1.2:8000", True, "the terminating endpoint DRAINING")
        emulator.replay(SLICES, "removed")
        await _until_state(seen, "127.0.1.2:8000", None, "the removed endpoint gone")
        emulator.replay(SLICES, "second_slice")
        await _until_state(seen, "127.0.1.4:8000", False, "a second slice's endpoint")
        emulator.replay(SLICES, "end")  # the first slice deleted
        await _until_state(seen, "127.0.1.1:8000", None, "the deleted slice's endpoints gone")
        assert seen.states() == {"127.0.1.4:8000": False}
        assert emulator.lists("endpointslices") == 1  # everything came over the one watch
    finally:
        await d.stop()


async def test_pool_pods_ready_terminating_deleted_and_ports(emulator: KubeEmulator, tmp_path: Path) -> None:
    emulator.replay(POOL, "initial")
    d, seen = await _discovery(emulator, tmp_path, inference_pools=["qwen-pool"])
    try:
        await wait_until(lambda: bool(seen.calls), "the first list")
        assert seen.states() == dict.fromkeys(
            ["127.0.2.1:8000", "127.0.2.1:8001", "127.0.2.2:8000", "127.0.2.2:8001"], False
        )
        emulator.replay(POOL, "added_not_ready")
        await _until_state(seen, "127.0.2.3:8000", True, "a not-ready pod DRAINING")
        emulator.replay(POOL, "ready")
        await _until_state(seen, "127.0.2.3:8000", False, "the pod ready")
        emulator.replay(POOL, "terminating")
        await _until_state(seen, "127.0.2.1:8001", True, "the terminating pod DRAINING")
        emulator.replay(POOL, "deleted")
        await _until_state(seen, "127.0.2.1:8000", None, "the deleted pod gone")
        emulator.replay(POOL, "one_port")  # the pool now targets 8000 only
        await _until_state(seen, "127.0.2.2:8001", None, "the dropped target port gone")
        assert seen.states() == {"127.0.2.2:8000": False, "127.0.2.3:8000": False}
    finally:
        await d.stop()


async def test_missing_pool_is_a_problem_until_it_is_created(emulator: KubeEmulator, tmp_path: Path) -> None:
    d, seen = await _discovery(emulator, tmp_path, inference_pools=["qwen-pool"])
    try:
        await wait_until(lambda: bool(seen.calls), "the first list")
        assert seen.calls[-1].problems == ("InferencePool default/qwen-pool: not found",)
        emulator.replay(POOL, "initial")
        await _until_state(seen, "127.0.2.1:8000", False, "the pool's endpoints once it exists")
        assert seen.calls[-1].problems == ()
    finally:
        await d.stop()


async def test_dropped_watch_resumes_from_its_resource_version(
    emulator: KubeEmulator, tmp_path: Path
) -> None:
    emulator.replay(SLICES, "initial")
    d, seen = await _discovery(emulator, tmp_path, services=["llama"])
    try:
        await wait_until(lambda: bool(emulator.watch_versions("endpointslices")), "the first watch")
        listed_at = emulator.version
        emulator.drop_watches()
        await wait_until(lambda: len(emulator.watch_versions("endpointslices")) == 2, "the watch again")
        emulator.replay(SLICES, "added")
        await _until_state(seen, "127.0.1.3:8000", False, "the endpoint added after the drop")
        # resumed from the listed version, never listed again
        assert emulator.watch_versions("endpointslices") == [str(listed_at), str(listed_at)]
        assert emulator.lists("endpointslices") == 1
    finally:
        await d.stop()


async def test_gone_version_lists_again_and_drops_what_was_deleted_meanwhile(
    emulator: KubeEmulator, tmp_path: Path
) -> None:
    emulator.replay(SLICES, "initial")
    emulator.replay(SLICES, "added")
    emulator.replay(SLICES, "terminating")
    emulator.replay(SLICES, "removed")
    emulator.replay(SLICES, "second_slice")
    d, seen = await _discovery(emulator, tmp_path, services=["llama"])
    try:
        await _until_state(seen, "127.0.1.4:8000", False, "the first list")
        await emulator.stop()
        emulator.replay(SLICES, "end")  # deleted while no watch runs
        emulator.compact()  # and the DELETED event compacted away: only a new list can tell
        await emulator.start()
        await _until_state(seen, "127.0.1.1:8000", None, "the deleted slice gone after the relist")
        assert seen.states() == {"127.0.1.4:8000": False}
        assert emulator.lists("endpointslices") == 2
        slices = d.slices["llama"]
        assert slices.stats.gone == 1 and slices.stats.failures >= 1
        assert slices.resource_version == str(emulator.version)
    finally:
        await d.stop()


async def test_api_server_restart_resumes_and_gets_the_events_it_missed(
    emulator: KubeEmulator, tmp_path: Path
) -> None:
    emulator.replay(POOL, "initial")
    d, seen = await _discovery(emulator, tmp_path, inference_pools=["qwen-pool"])
    try:
        await wait_until(lambda: bool(seen.calls), "the first list")
        await emulator.stop()
        await wait_until(lambda: d.pods is not None and d.pods.stats.failures >= 2, "reconnects failing")
        before = seen.states()
        emulator.replay(POOL, "added_not_ready")  # while the API server is down to clients
        await emulator.start()
        await _until_state(seen, "127.0.2.3:8000", True, "the pod added while down")
        # the endpoints known before kept serving through the outage
        assert before == dict.fromkeys(
            ["127.0.2.1:8000", "127.0.2.1:8001", "127.0.2.2:8000", "127.0.2.2:8001"], False
        )
        assert emulator.lists("pods") == 1  # resumed, not listed again
    finally:
        await d.stop()


async def test_a_silent_watch_is_made_again_from_its_version(emulator: KubeEmulator, tmp_path: Path) -> None:
    """A watch that sends nothing (a half-open connection looks the same) is ended after
    ``watch_restart_s`` and made again from the version it had, without listing again."""
    emulator.replay(SLICES, "initial")
    d, seen = await _discovery(emulator, tmp_path, watch_restart_s=0.1, services=["llama"])
    try:
        await wait_until(lambda: len(emulator.watch_versions("endpointslices")) >= 3, "the watch made again")
        assert set(emulator.watch_versions("endpointslices")) == {str(emulator.version)}
        emulator.replay(SLICES, "added")
        await _until_state(seen, "127.0.1.3:8000", False, "an event on a restarted watch")
        assert emulator.lists("endpointslices") == 1
        assert d.slices["llama"].stats.failures == 0
    finally:
        await d.stop()


async def test_server_errors_are_retried_with_backoff(emulator: KubeEmulator, tmp_path: Path) -> None:
    emulator.replay(SLICES, "initial")
    emulator.fail_next = 3
    d, seen = await _discovery(emulator, tmp_path, services=["llama"])
    try:
        await _until_state(seen, "127.0.1.1:8000", False, "the list once the API server answers")
        assert d.slices["llama"].stats.failures == 3
        assert emulator.lists("endpointslices") == 4
    finally:
        await d.stop()
