"""The shared waiting layer over the fair queue (:mod:`inferlb.policy.fair_wait`), on an event loop with a
fake clock (no test waits on time): admission in the queue's order, a full queue, expiry answered by the
owner's reply, a client gone before or after its decision, and each leave reported once (Hypothesis over
the order of pushes, admissions and abandons)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.policy.fair_wait import FairWaiters, QueueFull, Waiter
from tests.unit.test_epp_exchange import Clock


def _make(
    clock: Clock, *, max_queued: int = 16, max_wait_s: float = 10.0
) -> tuple[FairWaiters[Waiter[str], str], list[tuple[str, str]]]:
    left: list[tuple[str, str]] = []
    waiters: FairWaiters[Waiter[str], str] = FairWaiters(
        max_queued=max_queued,
        max_wait_s=max_wait_s,
        on_expired=lambda w: f"timeout {w.request_id}",
        on_left=lambda w, outcome, _s: left.append((w.request_id, outcome)),
        clock=clock,
    )
    return waiters, left


def _push(waiters: FairWaiters[Waiter[str], str], tenant: str, band: int = 1, cost: int = 10) -> Waiter[str]:
    waiter = Waiter[str](
        request_id=waiters.new_id(),
        tenant=tenant,
        band=band,
        cost_tokens=cost,
        enqueued_at=waiters.clock(),
        outcome=asyncio.get_running_loop().create_future(),
    )
    return waiters.enqueue(waiter)


async def test_admission_follows_bands_then_tokens_and_a_full_queue_refuses() -> None:
    waiters, left = _make(Clock(), max_queued=4)
    heavy = [_push(waiters, "heavy", cost=40) for _ in range(2)]
    light = _push(waiters, "light", cost=10)
    vip = _push(waiters, "vip", band=0)
    with pytest.raises(QueueFull):
        _push(waiters, "light")
    order = [waiters.take_head("go", "admitted") for _ in range(4)]
    assert order == [vip, heavy[0], light, heavy[1]]
    assert all(w.outcome.result() == "go" for w in order)
    assert [o for _, o in left] == ["admitted"] * 4 and len(waiters) == 0


async def test_expiry_answers_with_the_owners_reply_and_a_gone_client_leaves() -> None:
    clock = Clock()
    waiters, left = _make(clock, max_wait_s=1.0)
    old = _push(waiters, "a")
    clock.now += 0.6
    young = _push(waiters, "b")
    gone = _push(waiters, "c")
    clock.now += 0.5
    assert waiters.expire_due() == [old]
    assert old.outcome.result() == f"timeout {old.request_id}"
    assert waiters.abandon(gone) is None and gone.outcome.cancelled()
    assert waiters.head() is young
    decided = waiters.take_head("go", "admitted")
    # a client gone after its decision: the decision comes back for the caller to release
    assert waiters.abandon(decided) == "go"
    assert left == [
        (old.request_id, "expired"),
        (gone.request_id, "cancelled"),
        (young.request_id, "admitted"),
    ]


@given(st.lists(st.sampled_from(["push-a", "push-b", "admit", "abandon"]), max_size=40))
def test_every_waiter_leaves_once_and_the_count_matches(ops: list[str]) -> None:
    async def run() -> None:
        waiters, left = _make(Clock(), max_queued=8)
        pushed: list[Waiter[str]] = []
        for op in ops:
            if op.startswith("push") and len(waiters) < 8:
                pushed.append(_push(waiters, op[-1], cost=5 if op == "push-a" else 50))
            elif op == "admit" and waiters.head() is not None:
                waiters.take_head("go", "admitted")
            elif op == "abandon" and pushed:
                waiters.abandon(pushed[len(pushed) // 2])
        ids = [i for i, _ in left]
        assert len(ids) == len(set(ids))
        assert len(waiters) == len(pushed) - len(ids) == sum(waiters.waiting().values())
        for w in pushed:
            assert w.outcome.done() == (w.request_id in ids)

    asyncio.run(run())
