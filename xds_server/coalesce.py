"""Push coalescing: a burst of changes becomes one snapshot publish, with a bound on staleness.

Every input of the snapshot (the config file, the fleet API, telemetry weights) calls
:meth:`PushCoalescer.changed`; the publish runs ``debounce`` after the *last* change of a burst, but never
later than ``max_delay`` after the *first* one, so a steady trickle of changes (a weight every 50 ms) cannot
postpone a push forever (debounce, but never go stale).

The timing rule is the pure function :func:`push_deadline`; :class:`PushCoalescer` is the asyncio edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

log = logging.getLogger("xds_server.coalesce")


def push_deadline(*, first_change: float, last_change: float, debounce_s: float, max_delay_s: float) -> float:
    """When a pending burst of changes is published (same clock as the arguments, seconds).

    ``min(last_change + debounce_s, first_change + max_delay_s)``: quiet for ``debounce_s`` after the
    last change, or ``max_delay_s`` after the first, whichever comes first.
    """
    return min(last_change + debounce_s, first_change + max_delay_s)


class PushCoalescer:
    """Calls ``publish(first_change)`` once per burst of :meth:`changed` calls (see the module docstring).

    Args:
        publish: builds and publishes the snapshot; gets the monotonic time of the burst's first change
            (for the push-latency metric). It must not raise for bad input (log and keep serving); an
            exception is logged and the burst dropped.
        debounce_s: quiet time after the last change (s); 0 publishes synchronously inside :meth:`changed`.
        max_delay_s: bound on the time from a burst's first change to its publish (s).
        clock: monotonic clock (s), injectable for tests.

    Attributes:
        publishes: how many bursts were published; ``changes``: how many changes were reported.
    """

    def __init__(
        self,
        publish: Callable[[float], None],
        *,
        debounce_s: float,
        max_delay_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._publish = publish
        self.debounce_s = debounce_s
        self.max_delay_s = max(max_delay_s, 0.0)
        self._clock = clock
        self._first: float | None = None
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None
        self.publishes = 0
        self.changes = 0

    @property
    def pending(self) -> bool:
        """True while changes wait to be published."""
        return self._first is not None

    def changed(self) -> None:
        """Report one change; the publish follows per :func:`push_deadline`. Call from the loop thread."""
        now = self._clock()
        self.changes += 1
        if self._first is None:
            self._first = now
        self._last = now
        if self.debounce_s <= 0:
            self.flush()
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="xds-push-coalescer")

    def flush(self) -> None:
        """Publish pending changes now (no-op when none are pending)."""
        first = self._first
        if first is None:
            return
        self._first = None
        self.publishes += 1
        try:
            self._publish(first)
        except Exception:  # a publish bug must not kill the coalescer: the next change retries
            log.exception("snapshot publish failed")

    async def _run(self) -> None:
        while self._first is not None:
            deadline = push_deadline(
                first_change=self._first,
                last_change=self._last,
                debounce_s=self.debounce_s,
                max_delay_s=self.max_delay_s,
            )
            delay = deadline - self._clock()
            if delay <= 0:
                self.flush()
                return
            # a change during the sleep only moves the deadline later (never past first + max_delay), so
            # sleeping to the current deadline and recomputing is enough
            await asyncio.sleep(delay)

    async def close(self) -> None:
        """Stop the timer; pending changes are dropped (the server is stopping)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._first = None
