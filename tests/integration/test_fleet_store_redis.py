"""The shared fleet store's versioning against a real redis-server: compare-and-set, epochs, announcements,
failures named; and, as a property, that changes racing from several writers all land, each applied to the
state before it (the stored state is the changes folded in version order, versions without gaps)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferlb.adapters.state_redis import ABSENT, RedisDocument, SharedStateUnavailableError, redacted
from inferlb.config.schema import EndpointConfig
from inferlb.ops.redis_server import RedisServer
from inferlb.ops.stack import free_ports
from tests.conftest import redis_or_skip
from xds_server.fleet_state import FleetState, to_document
from xds_server.fleet_store import FleetStoreError, RedisFleetStore

KEYS = [f"127.0.0.1:{9000 + i}" for i in range(4)]


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_or_skip(tmp_path_factory.mktemp("redis")) as server:
        yield server


_count = iter(range(1_000_000))


def _doc(redis: RedisServer, key: str | None = None) -> RedisDocument:
    return RedisDocument.from_url(
        redis.url, key or f"test:fleet:{next(_count)}", timeout_s=1, connect_timeout_s=1
    )


async def test_compare_and_set_writes_once_per_stamp_and_announces(redis: RedisServer) -> None:
    doc = _doc(redis)
    other = RedisDocument(doc.client, doc.key, where=doc.where, writer="other")
    try:
        assert await doc.read() is None and await doc.stamp() == ABSENT
        await doc.wait_for_change(0.1)  # subscribes, returns at once
        first = await doc.write_if(ABSENT, {"n": 1})
        assert first is not None and first.version == 1 and first.epoch
        await asyncio.wait_for(doc.wait_for_change(5), 2)  # the announcement, well before the timeout
        assert await other.write_if(ABSENT, {"n": 2}) is None  # lost: it read before the first write
        second = await other.write_if(first, {"n": 2})
        assert second is not None and (second.epoch, second.version) == (first.epoch, 2)
        assert await doc.write_if(first, {"n": 3}) is None
        stored = await doc.read()
        assert stored is not None and stored.document == {"n": 2} and stored.writer == "other"
        # the document lost (a flushed Redis): a new epoch, so version 1 again is not mistaken for the old
        await doc.client.delete(doc.key)
        again = await doc.write_if(ABSENT, {"n": 4})
        assert again is not None and again.version == 1 and again.epoch != first.epoch
    finally:
        await doc.aclose()


async def test_a_hash_this_code_did_not_write_is_refused_naming_the_field(redis: RedisServer) -> None:
    doc = _doc(redis)
    try:
        await doc.client.hset(doc.key, mapping={"epoch": "e", "version": "1", "doc": "{not json"})
        with pytest.raises(ValueError, match="field doc is not JSON"):
            await doc.read()
        store = RedisFleetStore(doc)
        with pytest.raises(FleetStoreError, match=f"fleet store {doc.where}: .*field doc is not JSON"):
            await store.open()
        await doc.client.hset(doc.key, mapping={"doc": '{"inferlb_fleet_state": 7}'})
        with pytest.raises(
            FleetStoreError, match="version 1 is not a fleet state document: inferlb_fleet_state"
        ):
            await store.open()
    finally:
        await doc.aclose()


async def test_an_unreachable_redis_is_named_without_credentials() -> None:
    port = free_ports(1)[0]  # nothing listens there
    doc = RedisDocument.from_url(
        f"redis://user:secret@127.0.0.1:{port}/2", "k", timeout_s=0.5, connect_timeout_s=0.5
    )
    try:
        assert doc.where == f"redis://127.0.0.1:{port}/2 key k"
        assert redacted("rediss://u:p@[::1]:6380/1") == "rediss://[::1]:6380/1"
        with pytest.raises(SharedStateUnavailableError) as err:
            await doc.write_if(ABSENT, {})
        assert not err.value.maybe_applied  # refused: it never ran
        assert "secret" not in str(err.value) and f"127.0.0.1:{port}/2 key k" in str(err.value)
        with pytest.raises(SharedStateUnavailableError, match=r"\(read version\)"):
            await doc.stamp()
        with pytest.raises(SharedStateUnavailableError, match=r"\(subscribe\)"):
            await doc.wait_for_change(0.1)
    finally:
        await doc.aclose()


async def test_a_lost_document_is_written_back_from_the_last_state(redis: RedisServer) -> None:
    doc = _doc(redis)
    store = RedisFleetStore(doc)
    try:
        assert await store.open() is None
        state = FleetState().override_weight(KEYS[0], 5)

        async def pin(base: FleetState) -> FleetState:
            return base.override_weight(KEYS[0], 5)

        assert await store.update(pin, FleetState()) == state
        assert store.seen.version == 1
        await doc.client.delete(doc.key)
        assert await store.changed(state) is None  # written back, nothing new to adopt
        stored = await doc.read()
        assert stored is not None and stored.document["weight_overrides"] == {KEYS[0]: 5}
        assert store.seen == stored.stamp
    finally:
        await doc.aclose()


# -- the property: racing changes all land ------------------------------------------------------------
def _endpoint(i: int) -> EndpointConfig:
    return EndpointConfig.model_validate({"address": f"127.0.0.2:{9100 + i}", "model": "m", "gpu": "H100"})


#: (operation, endpoint index, value): each a pure change of FleetState
Op = tuple[str, int, int]
ops = st.tuples(st.sampled_from(["drain", "undrain", "pin", "unpin", "deregister", "register"]),
                st.integers(0, len(KEYS) - 1), st.integers(1, 1000))  # fmt: skip


def _apply(state: FleetState, op: Op) -> FleetState:
    name, i, value = op
    key = KEYS[i]
    if name == "drain":
        return state.drain(key, 1e9 + value)
    if name == "undrain":
        return state.undrain(key)
    if name == "pin":
        return state.override_weight(key, value)
    if name == "unpin":
        return state.override_weight(key, None)
    if name == "deregister":
        return state.deregister(key)
    return state.register(_endpoint(i))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writers=st.lists(st.lists(ops, min_size=1, max_size=6), min_size=2, max_size=3))
def test_racing_changes_from_several_writers_all_land(redis: RedisServer, writers: list[list[Op]]) -> None:
    asyncio.run(_race(redis, writers))


async def _race(redis: RedisServer, writers: list[list[Op]]) -> None:
    key = f"test:race:{next(_count)}"
    stores = [RedisFleetStore(_doc(redis, key)) for _ in writers]
    landed: list[tuple[int, Op]] = []  # (version, op) of every change that wrote

    async def run(store: RedisFleetStore, mine: list[Op]) -> None:
        for op in mine:

            async def change(base: FleetState, op: Op = op) -> FleetState:
                await asyncio.sleep(0)  # let the other writers read the same version: real races
                return _apply(base, op)

            before = store.seen
            await store.update(change, FleetState(), always=True)
            assert store.seen != before
            landed.append((store.seen.version, op))

    try:
        await asyncio.gather(*(run(s, mine) for s, mine in zip(stores, writers, strict=True)))
        stored = await stores[0].document.read()
        assert stored is not None
        versions = sorted(v for v, _ in landed)
        assert versions == list(range(1, sum(map(len, writers)) + 1))  # every change wrote, no version twice
        expected = FleetState()
        for _, op in sorted(landed):
            expected = _apply(expected, op)
        assert stored.stamp.version == len(versions)
        assert {k: v for k, v in stored.document.items() if k != "saved_at"} == to_document(expected)
    finally:
        for s in stores:
            await s.close()
