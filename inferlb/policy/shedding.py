"""Low-priority shedding: ``priority: low`` tenants are refused before ``default`` ones under saturation.

Envoy has two routing priorities, DEFAULT and HIGH, each with its own circuit-breaker thresholds per
cluster (``envoy.config.core.v3.RoutingPriority``; ``envoy.config.cluster.v3.CircuitBreakers.Thresholds``,
"Circuit breaking" in Envoy's architecture overview). ``high`` tenants ride HIGH; ``default`` and ``low``
share DEFAULT, so Envoy alone sheds them alike once the cluster's DEFAULT ``max_requests`` is reached (503,
response flag ``UO``). A third priority therefore needs a mechanism of its own, and it lives in the
request-path service, which sees every request's admission and, with ``ext_proc.account_responses``, its
end: ext_proc when its stream ends, ext_authz when the request's access-log entry settles its reservation
(``ext_authz.meter``: up to one flush interval late, or at the lease TTL for an entry that never comes):

- ext_proc counts, per model-version cluster, the requests it admitted at DEFAULT routing priority
  (``default`` and ``low`` tenants; ``high`` ones have their own budget) until their response ends
  (:class:`InFlight`);
- a ``low`` request is refused (503 ``overloaded`` with ``retry-after``, as Envoy's own overflow) when that
  count has reached :func:`low_priority_limit`, a share (``cluster.low_priority_max_requests_percent``) of the
  cluster's DEFAULT ``max_requests``; ``default`` requests go on to Envoy, which still has the rest of the
  budget for them (:func:`sheds`).

So under a load that fills the DEFAULT budget, low traffic holds at most that share of it and default
traffic keeps the remainder: low is shed first, default only when default traffic alone fills the budget.

Why not a second Envoy cluster per version for low traffic (same EDS ``service_name``, a smaller breaker)?
Its breaker would be a budget *beside* DEFAULT's, not a share of it: low traffic would keep its own slots
while default traffic is shed, the opposite of "shed first"; and the twin cluster would double each GPU's
health checks and split outlier detection and least-request state between two host sets.

The count is per ext_proc (ext_authz) process, and Envoy spreads its streams over the ``ext_proc.listen``
and ``extra_listen`` processes, so each process takes its share of the limit (``processes``). It is also per
Envoy budget: several Envoys behind one ext_proc (or ext_proc replicas the config does not list) make
the counts diverge from any one Envoy's breaker; the Redis quota store does not share this count.
"""

from __future__ import annotations

from inferlb.config.schema import Priority


def low_priority_limit(max_requests: int, percent: int, processes: int = 1) -> int:
    """Requests at DEFAULT routing priority one ext_proc process may have in flight on a cluster before it
    refuses ``low`` ones: ``percent`` % of the cluster's DEFAULT ``max_requests`` (Envoy
    ``CircuitBreakers.Thresholds.max_requests``), divided among ``processes`` ext_proc processes, rounded
    down, at least 1 (an idle cluster always takes a low request).

    Raises:
        ValueError: a non-positive ``max_requests`` or ``processes``, or ``percent`` outside 1..100.
    """
    if max_requests < 1 or processes < 1 or not 1 <= percent <= 100:
        raise ValueError(
            f"low_priority_limit: max_requests {max_requests} and processes {processes} must be >= 1, "
            f"percent {percent} in 1..100"
        )
    return max(1, max_requests * percent // (100 * processes))


def counted(priority: Priority) -> bool:
    """Whether a request of this tenant priority counts against the DEFAULT budget: ``default`` and ``low``
    ride Envoy's DEFAULT routing priority, ``high`` has HIGH's own thresholds."""
    return priority is not Priority.HIGH


def sheds(priority: Priority, in_flight: int, limit: int) -> bool:
    """Whether to refuse a request of ``priority`` with ``in_flight`` DEFAULT-priority requests already on
    its cluster: only ``low`` ones, once ``in_flight`` has reached ``limit``."""
    return priority is Priority.LOW and in_flight >= limit


class InFlight:
    """Requests in flight per cluster name, as one ext_proc or ext_authz process admitted them (not
    thread-safe: the service's event loop owns it). A count never goes below 0, and a cluster whose count
    returns to 0 is forgotten, so clusters removed by a config reload leave nothing behind."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def get(self, cluster: str) -> int:
        """Requests in flight on ``cluster``."""
        return self._counts.get(cluster, 0)

    def enter(self, cluster: str) -> None:
        """One more request in flight on ``cluster``."""
        self._counts[cluster] = self._counts.get(cluster, 0) + 1

    def leave(self, cluster: str) -> None:
        """One request on ``cluster`` ended."""
        n = self._counts.get(cluster, 0) - 1
        if n > 0:
            self._counts[cluster] = n
        else:
            self._counts.pop(cluster, None)

    def snapshot(self) -> dict[str, int]:
        """``{cluster: requests in flight}`` of the clusters with any."""
        return dict(self._counts)
