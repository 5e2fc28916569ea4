"""The live capacity guard of length classes (pure): a confined class never takes more work than its GPU
set can carry.

Why: length-aware placement (:mod:`inferlb.policy.length_aware`) confines long requests to the fast GPUs.
Its thresholds assume the long requests are a bounded share of the work; when they are not (clients whose
caps all look long, a burst of long answers, a fast GPU gone), Envoy's subsets and the picker's class hosts
keep sending every confined request to the fast set, which saturates while the rest of the fleet idles
(the design note "Length classes need honest caps"). The guard lets a class spill to the next wider set
when its own set is loaded well above the fleet.

The rule (:func:`guarded_class`). Class ``k``'s set (longest class first; the sets are nested, each class's
set within the next's: :func:`inferlb.policy.length_aware.live_class_sets`) carries load ``L_k`` (requests
in flight on it, and, where the picker knows them, waiting in its servers' queues) on capacity ``C_k``
(summed relative capacity, or EDS weight); the fleet carries ``T`` on ``C``. As in the picker's load guard
(bounded-load consistent hashing, Mirrokni, Thorup and Zadimoghaddam, SODA 2018,
:mod:`inferlb.policy.picker`), the set may hold ``ceil(factor x (T + 1) x C_k / C)`` requests, its share of
the fleet's load with this request, times ``factor``; a request of class ``k`` whose set would pass that by
taking it goes to class ``k + 1`` instead, checked the same way, and past the last confined class it is
short (anywhere). The ``ceil`` and the ``+ 1`` let an idle fleet place a request in its class whatever the
set's share, and ``factor`` > 1 is the headroom: 1.5 lets a set run at 1.5x the fleet's load per unit of
capacity before its class spills (long answers belong on fast GPUs: some queueing there is the point).

Where the load comes from is the caller's (each request-path process counts its own requests):
:func:`set_loads` from the picker's endpoint states, :func:`nested_class_loads` from per-class in-flight
counts (the Envoy-subset path, which knows each class's requests but not which GPU took them).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from inferlb.policy.output_predictor import LengthQuery
from inferlb.policy.picker import EndpointState


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassHold:
    """One admitted request of a length-aware model, as its settlement must see it: it leaves the
    in-flight count of ``(cluster, length_class)`` and, with a ``query``, teaches the predictor its
    answer's length.

    Attributes:
        cluster: its model version's cluster.
        length_class: the class it was sent as (its ``x-inferlb-length-class``).
        query: what the predictor was asked (None when the model does not predict).
    """

    cluster: str
    length_class: str
    query: LengthQuery | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SetLoad:
    """Work on a set of GPUs and what it can carry.

    Attributes:
        load: requests in flight (and waiting) on it (>= 0).
        capacity: its summed capacity (relative capacity or EDS weight, >= 0; 0: an empty set).
    """

    load: float
    capacity: float


def within_bound(set_load: SetLoad, fleet: SetLoad, factor: float) -> bool:
    """True when ``set_load`` may take one more request: ``L + 1 <= ceil(factor x (T + 1) x C_k / C)``
    (module docstring); False for an empty set or an empty fleet."""
    if set_load.capacity <= 0 or fleet.capacity <= 0:
        return False
    bound = math.ceil(factor * (fleet.load + 1) * set_load.capacity / fleet.capacity - 1e-9)
    return set_load.load + 1 <= bound


def guarded_class(sets: Sequence[SetLoad], fleet: SetLoad, start: int, factor: float) -> int:
    """The class a request of class ``start`` goes to (module docstring's rule).

    Args:
        sets: each confined class's set, longest class first.
        fleet: the whole fleet (every endpoint of the cluster).
        start: the request's own class (index into ``sets``; ``len(sets)``: short, returned as is).
        factor: the headroom (> 1).

    Returns:
        The first index ``k >= start`` whose set is within its bound, ``len(sets)`` (short) when none is.

    Raises:
        ValueError: ``start`` outside ``0 .. len(sets)``, or ``factor`` not > 1.
    """
    if not 0 <= start <= len(sets):
        raise ValueError(f"start must be in 0..{len(sets)}, got {start}")
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    for k in range(start, len(sets)):
        if within_bound(sets[k], fleet, factor):
            return k
    return len(sets)


def set_loads(
    states: Sequence[EndpointState], class_sets: Sequence[Collection[str]]
) -> tuple[list[SetLoad], SetLoad]:
    """Each class set's load and capacity, and the fleet's, from the picker's endpoint states: load
    ``in_flight + waiting`` and capacity ``weight`` of the healthy endpoints of positive weight (those
    :func:`inferlb.policy.picker.pick` may choose), per set of addresses in ``class_sets``."""
    usable = [s for s in states if s.healthy and s.weight > 0]
    sets = [_summed([s for s in usable if s.address in hosts]) for hosts in class_sets]
    return sets, _summed(usable)


def _summed(states: Sequence[EndpointState]) -> SetLoad:
    """``in_flight + waiting`` and ``weight`` summed over ``states``."""
    return SetLoad(
        load=math.fsum(s.in_flight + s.waiting for s in states), capacity=math.fsum(s.weight for s in states)
    )


def nested_class_loads(
    in_flight: Sequence[int], short_in_flight: int, capacities: Sequence[float], fleet_capacity: float
) -> tuple[list[SetLoad], SetLoad]:
    """Each class set's load from per-class in-flight counts (the Envoy-subset path).

    ``in_flight[j]`` requests of confined class ``j`` (longest first) are on class ``j``'s set, which lies
    within every later class's set: set ``k`` carries at least ``sum(in_flight[: k + 1])`` (the short
    requests and the rest of the balancer's choices are not known per GPU, so this is a lower bound of
    its load). ``capacities[k]`` is set ``k``'s summed capacity, ``fleet_capacity`` the cluster's; the fleet
    carries every class's requests and the short ones.

    Raises:
        ValueError: ``in_flight`` and ``capacities`` of different lengths.
    """
    if len(in_flight) != len(capacities):
        raise ValueError("in_flight and capacities must have one entry per confined class")
    out = []
    acc = 0
    for n, capacity in zip(in_flight, capacities, strict=True):
        acc += n
        out.append(SetLoad(load=float(acc), capacity=capacity))
    return out, SetLoad(load=float(acc + short_in_flight), capacity=fleet_capacity)
