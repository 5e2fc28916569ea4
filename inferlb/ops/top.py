"""``inferlb top``: each GPU's load over time as a live heat map in the terminal (rich).

One row per endpoint of the model clusters, one column per sample (the newest on the right), the cell's
shade the endpoint's **load per unit of capacity** at that sample:

    load = in-flight requests / the GPU profile's ``relative_capacity``   (requests per V100-equivalent)

so a fleet balanced in proportion to capacity shows one even shade, and a hot spot (a sticky prefix, a
throttled card that keeps its share) stands out as a brighter row. The in-flight count is the GPU's own
(``running + waiting`` of the model server's metrics, as the xDS server's ``GET /v1/weights`` reports
them) when that telemetry is fresh, else Envoy's ``rq_active`` for the host (admin ``/clusters``), which
counts one Envoy's requests only; the row's ``src`` column says which (``gpu`` / ``envoy``).

Beside the map: the weight share Envoy holds for the host and the share of the cluster's requests it got
over the window (from the growth of ``rq_total``), the two columns the weights exist to keep equal; the KV
cache usage when telemetry has it. The scale runs from 0 to the highest load in the window (shown in the
title), so shades compare rows and times within one screen, not across screens.

The model here (:class:`LoadHeatMap`, :class:`TopSample`) is pure; :func:`run_top` drives it from a
``sample`` callable (the CLI's reads of Envoy and the xDS server).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from inferlb.config.schema import Config
from inferlb.ops.status import HostRow, WeightRow

#: The shades of a cell, lowest load first: a glyph (readable without colour) and a colour (dark blue to
#: red, the usual heat ramp).
SHADES: tuple[tuple[str, str], ...] = (
    ("·", "grey35"),
    ("▁", "blue"),
    ("▂", "dodger_blue2"),
    ("▃", "cyan"),
    ("▄", "green"),
    ("▅", "yellow"),
    ("▆", "dark_orange"),
    ("▇", "red"),
    ("█", "bright_red"),
)


@dataclass(frozen=True, kw_only=True)
class TopSample:
    """One endpoint at one sample.

    Attributes:
        cluster / name / address / gpu: as in :class:`inferlb.ops.status.HostRow`.
        in_flight: requests in flight on it (count).
        source: where ``in_flight`` comes from: ``gpu`` (the model server's running + waiting) or
            ``envoy`` (Envoy's ``rq_active``).
        capacity: its GPU profile's ``relative_capacity`` (V100 = 1.0, > 0).
        weight_share: Envoy's weight for it over its cluster's total (0..1).
        rq_total: requests Envoy has sent it since Envoy started (count).
        kv: KV-cache usage 0..1, None without fresh telemetry.
    """

    cluster: str
    name: str
    address: str
    gpu: str
    in_flight: int
    source: str
    capacity: float
    weight_share: float
    rq_total: int
    kv: float | None = None

    @property
    def load(self) -> float:
        """In-flight requests per unit of capacity (requests per V100-equivalent)."""
        return self.in_flight / self.capacity


def samples_from(
    config: Config, hosts: Sequence[HostRow], weights: Sequence[WeightRow] = ()
) -> list[TopSample]:
    """One :class:`TopSample` per Envoy host row, its in-flight count the GPU's own where ``weights`` has
    fresh telemetry for it (joined by address), else Envoy's ``rq_active``.

    A host whose GPU type the config does not know (``?``) counts capacity 1.0.
    """
    by_addr = {w.address: w for w in weights}
    out: list[TopSample] = []
    for h in hosts:
        w = by_addr.get(h.address)
        profile = config.gpu_profiles.get(h.gpu)
        capacity = profile.relative_capacity if profile is not None else 1.0
        if w is not None and w.fresh and w.running is not None and w.waiting is not None:
            in_flight, source, kv = w.running + w.waiting, "gpu", w.kv
        else:
            in_flight, source, kv = h.rq_active, "envoy", None
        out.append(
            TopSample(
                cluster=h.cluster, name=h.name, address=h.address, gpu=h.gpu, in_flight=in_flight,
                source=source, capacity=capacity, weight_share=h.weight_share, rq_total=h.rq_total, kv=kv,
            )
        )  # fmt: skip
    return out


def shade(load: float, scale: float) -> tuple[str, str]:
    """The (glyph, colour) of ``load`` on a 0..``scale`` ramp of :data:`SHADES`: 0 is the first shade, any
    load above 0 at least the second, ``scale`` and above the last.

    Raises:
        ValueError: ``scale`` not above 0, or ``load`` negative or not finite.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not (math.isfinite(load) and load >= 0):
        raise ValueError(f"load must be a finite number >= 0, got {load}")
    if load == 0:
        return SHADES[0]
    top = len(SHADES) - 1
    return SHADES[max(1, min(top, math.ceil(load / scale * top)))]


class LoadHeatMap:
    """The last ``width`` samples of every endpoint, rendered as a rich table (see the module doc).

    Endpoints keep their row while they are sampled; one that is missing from a sample (left the fleet)
    gets an empty cell for it and is dropped once its whole window is empty.

    Args:
        width: samples kept per endpoint (columns of the map, >= 2).

    Raises:
        ValueError: ``width`` below 2.
    """

    def __init__(self, width: int = 60) -> None:
        if width < 2:
            raise ValueError(f"width must be >= 2, got {width}")
        self.width = width
        self.ticks = 0
        self._loads: dict[tuple[str, str], collections.deque[float | None]] = {}
        self._totals: dict[tuple[str, str], collections.deque[int | None]] = {}
        self._last: dict[tuple[str, str], TopSample] = {}

    def add(self, samples: Sequence[TopSample]) -> None:
        """Take one sample of the fleet (every endpoint at one time)."""
        self.ticks += 1
        seen: set[tuple[str, str]] = set()
        for s in samples:
            key = (s.cluster, s.address)
            seen.add(key)
            self._last[key] = s
            if key not in self._loads:
                self._loads[key] = collections.deque([None] * (self.width - 1), maxlen=self.width)
                self._totals[key] = collections.deque([None] * (self.width - 1), maxlen=self.width)
            self._loads[key].append(s.load)
            self._totals[key].append(s.rq_total)
        for key in list(self._loads):
            if key in seen:
                continue
            self._loads[key].append(None)
            self._totals[key].append(None)
            if all(v is None for v in self._loads[key]):
                del self._loads[key], self._totals[key], self._last[key]

    def scale(self) -> float:
        """The highest load in the window (at least 1.0, so an idle fleet is not shaded as hot)."""
        return max([1.0, *(v for d in self._loads.values() for v in d if v is not None)])

    def request_shares(self) -> dict[tuple[str, str], float | None]:
        """Every endpoint's share (0..1) of its cluster's requests over the window, keyed ``(cluster,
        address)``: the growth of its ``rq_total`` between the oldest and newest sample it holds over its
        cluster's; None for an endpoint with fewer than two samples' growth to share in (the cluster got no
        request in the window, or the map has one sample)."""
        grew: dict[tuple[str, str], int] = {}
        per_cluster: dict[str, int] = {}
        for key, totals in self._totals.items():
            held = [t for t in totals if t is not None]
            # a restarted Envoy counts from 0 again: the window's growth is then unknown, counted as 0
            n = grew[key] = max(0, held[-1] - held[0]) if len(held) >= 2 else 0
            per_cluster[key[0]] = per_cluster.get(key[0], 0) + n
        return {key: n / per_cluster[key[0]] if per_cluster[key[0]] else None for key, n in grew.items()}

    def request_share(self, cluster: str, address: str) -> float | None:
        """One endpoint's entry of :meth:`request_shares` (None, too, for an endpoint not in the map)."""
        return self.request_shares().get((cluster, address))

    def render(self, *, interval_s: float) -> Table:
        """The map and its side columns as a rich table; ``interval_s`` (s) is the sample period the title
        states."""
        scale = self.scale()
        shares = self.request_shares()
        table = Table(
            title=(
                f"inferlb top: in-flight requests per unit of capacity, last {self.width} samples every "
                f"{interval_s:g} s (scale 0-{scale:.1f}; newest right)"
            ),
            caption=" ".join(f"{g} {i / (len(SHADES) - 1) * scale:.1f}" for i, (g, _) in enumerate(SHADES)),
        )
        for col, justify in (
            ("cluster", "left"), ("endpoint", "left"), ("gpu", "left"), ("load", "left"), ("now", "right"),
            ("src", "left"), ("weight", "right"), ("requests", "right"), ("KV", "right"),
        ):  # fmt: skip
            table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        for key in sorted(self._loads, key=lambda k: (k[0], self._last[k].name)):
            s = self._last[key]
            cells = Text()
            for v in self._loads[key]:
                if v is None:
                    cells.append(" ")
                else:
                    glyph, colour = shade(v, scale)
                    cells.append(glyph, style=colour)
            share = shares[key]
            table.add_row(
                s.cluster,
                s.name,
                s.gpu,
                cells,
                f"{s.load:.1f}",
                s.source,
                f"{s.weight_share:.0%}",
                "-" if share is None else f"{share:.0%}",
                "-" if s.kv is None else f"{s.kv:.0%}",
            )
        return table


def run_top(
    sample: Callable[[], list[TopSample]],
    console: Console,
    *,
    interval_s: float = 1.0,
    width: int = 60,
    iterations: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> LoadHeatMap:
    """Sample every ``interval_s`` seconds and redraw the map until interrupted (Ctrl-C) or, with
    ``iterations``, after that many samples; returns the map. On a terminal the map redraws in place; on
    other output (a pipe, a log) it is printed once, at the end.

    ``sample`` raising stops the loop with its exception (the CLI turns an unreachable Envoy into a
    message).

    Raises:
        ValueError: ``interval_s`` not above 0 or ``iterations`` below 1.
    """
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    if iterations is not None and iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    heat = LoadHeatMap(width)
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while iterations is None or heat.ticks < iterations:
                started = clock()
                heat.add(sample())
                live.update(heat.render(interval_s=interval_s), refresh=True)
                if iterations is not None and heat.ticks >= iterations:
                    break
                sleep(max(0.0, interval_s - (clock() - started)))
        except KeyboardInterrupt:
            pass
    return heat
