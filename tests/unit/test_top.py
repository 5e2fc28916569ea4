"""``inferlb top``'s model: load per capacity, shades, the window, request shares, the loop's bounds."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from inferlb.config.schema import Config, default_config_path, load_config
from inferlb.ops.status import HostRow, WeightRow
from inferlb.ops.top import SHADES, LoadHeatMap, TopSample, run_top, samples_from, shade


def sample(
    name: str, in_flight: int, *, capacity: float = 1.0, rq_total: int = 0, cluster: str = "c"
) -> TopSample:
    return TopSample(
        cluster=cluster, name=name, address=f"{name}:1", gpu="V100", in_flight=in_flight, source="envoy",
        capacity=capacity, weight_share=0.5, rq_total=rq_total,
    )  # fmt: skip


def host(name: str, gpu: str, rq_active: int) -> HostRow:
    return HostRow(
        cluster="c", address=f"{name}:1", name=name, gpu=gpu, weight=10, weight_share=0.5, health="healthy",
        rq_active=rq_active, rq_total=0, rq_error=0,
    )  # fmt: skip


def weight(name: str, *, fresh: bool, running: int | None, waiting: int | None) -> WeightRow:
    return WeightRow(
        cluster="c", name=name, address=f"{name}:1", gpu="H100", envoy_weight=10, served_weight=10,
        source="telemetry", policy_weight=10, profile_weight=10, fresh=fresh, waiting=waiting,
        running=running, kv=0.25, throttle="-", clock_ratio=1.0, tokens_per_s=None, age_s=0.1, factors={},
    )  # fmt: skip


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(default_config_path())


def test_load_is_in_flight_per_unit_of_capacity() -> None:
    assert sample("h", 7, capacity=3.5).load == 2.0


def test_shade_runs_from_idle_to_the_scale() -> None:
    assert shade(0, 4.0) == SHADES[0]
    assert shade(0.001, 4.0) == SHADES[1]  # any load shows
    assert shade(4.0, 4.0) == SHADES[-1] and shade(40.0, 4.0) == SHADES[-1]
    assert shade(2.0, 4.0) == SHADES[4]


@pytest.mark.parametrize(("load", "scale"), [(1.0, 0.0), (-1.0, 1.0), (float("nan"), 1.0)])
def test_shade_refuses_bad_input(load: float, scale: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        shade(load, scale)


@given(st.floats(min_value=0, max_value=1e6), st.floats(min_value=1e-3, max_value=1e6))
def test_shade_is_monotone(load: float, scale: float) -> None:
    lower = shade(load / 2, scale)
    assert SHADES.index(lower) <= SHADES.index(shade(load, scale))


def test_the_gpus_own_queue_wins_over_envoys_count_when_fresh(config: Config) -> None:
    hosts = [host("a", "H100", rq_active=1), host("b", "V100", rq_active=2), host("x", "nope", rq_active=3)]
    weights = [
        weight("a", fresh=True, running=4, waiting=3),
        weight("b", fresh=False, running=9, waiting=9),  # stale: Envoy's count
    ]
    a, b, x = samples_from(config, hosts, weights)
    assert (a.in_flight, a.source, a.kv, a.capacity) == (
        7,
        "gpu",
        0.25,
        config.gpu_profiles["H100"].relative_capacity,
    )
    assert (b.in_flight, b.source, b.kv) == (2, "envoy", None)
    assert x.capacity == 1.0  # an unknown GPU type counts as one V100


def test_the_window_keeps_width_samples_and_drops_endpoints_that_left() -> None:
    heat = LoadHeatMap(width=3)
    heat.add([sample("a", 1), sample("b", 8)])
    assert heat.scale() == 8.0
    heat.add([sample("a", 2)])  # b left the fleet
    heat.add([sample("a", 3)])
    assert heat.scale() == 8.0  # b's sample is still in the window
    heat.add([sample("a", 0)])
    assert heat.scale() == 3.0 and heat.ticks == 4
    rendered = render(heat)
    assert "a" in rendered and " b " not in rendered


def test_an_idle_fleet_is_not_shaded_as_hot() -> None:
    heat = LoadHeatMap(width=2)
    heat.add([sample("a", 0)])
    assert heat.scale() == 1.0


def test_request_share_is_the_growth_of_rq_total_over_the_window() -> None:
    heat = LoadHeatMap(width=4)
    heat.add([sample("a", 0, rq_total=10), sample("b", 0, rq_total=100)])
    assert heat.request_share("c", "a:1") is None  # one sample: no growth yet
    heat.add([sample("a", 0, rq_total=40), sample("b", 0, rq_total=110)])
    assert heat.request_share("c", "a:1") == 0.75 and heat.request_share("c", "b:1") == 0.25
    heat.add([sample("a", 0, rq_total=0), sample("b", 0, rq_total=110)])  # Envoy restarted
    assert heat.request_share("c", "a:1") == 0.0 and heat.request_share("c", "b:1") == 1.0


def test_width_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="width"):
        LoadHeatMap(width=1)


def render(heat: LoadHeatMap) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(heat.render(interval_s=1.0))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_the_map_shows_each_sample_newest_right() -> None:
    heat = LoadHeatMap(width=3)
    for n in (0, 4, 8):
        heat.add([sample("a", n)])
    row = next(line for line in render(heat).splitlines() if " a " in line)
    assert SHADES[0][0] + SHADES[4][0] + SHADES[-1][0] in row


def test_run_top_takes_the_samples_asked_for_at_the_interval() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    def take() -> list[TopSample]:
        now[0] += 0.25  # a sample takes 0.25 s
        return [sample("a", 1)]

    console = Console(file=io.StringIO(), width=200, color_system=None)
    heat = run_top(take, console, interval_s=1.0, iterations=3, clock=lambda: now[0], sleep=sleep)
    assert heat.ticks == 3 and slept == [0.75, 0.75]  # no sleep after the last
    assert "inferlb top" in console.file.getvalue()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kw", "match"), [({"interval_s": 0.0}, "interval"), ({"iterations": 0}, "iterations")]
)
def test_run_top_refuses_bad_bounds(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_top(lambda: [], Console(file=io.StringIO()), **kw)  # type: ignore[arg-type]
