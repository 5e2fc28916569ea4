"""``length_aware.learn_thresholds``: its config (defaults agree with the learner's, bad values refused
naming the field, both forms), and :class:`ext_proc.length_state.LengthState`'s thresholds: the learnt ones
per cluster, the metrics of the thresholds in use, the check of static thresholds against the caps seen
(counted, warned at most every interval), a reload that keeps a cluster alike keeps what it learnt."""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ext_proc import handlers
from ext_proc.handlers import Gateway, PendingRequest, PreparedRequest
from ext_proc.length_state import OVERCOMMIT_LOG_INTERVAL_S, LengthState
from ext_proc.metrics import ExtProcMetrics
from inferlb.config.schema import Config, LearnedThresholds, LengthAwareRouting, parse_config
from inferlb.errors import ConfigError
from inferlb.policy import length_aware, threshold_learner
from inferlb.policy.length_aware import class_by_thresholds, confined_classes, length_class, static_thresholds
from inferlb.request.parsing import EndpointKind

CLUSTER = "llama--v1"
TIERS = [
    {"above_output_tokens": 2000, "min_relative_capacity": 3.0},
    {"above_output_tokens": 500, "min_relative_capacity": 1.5},
]


def config(length_aware: dict[str, Any], **model: Any) -> Config:
    return parse_config(
        {
            "models": [{"name": "llama", "cluster": {"length_aware": length_aware}, **model}],
            "endpoints": [
                {"address": f"10.0.0.{i}:80", "model": "llama", "gpu": g}
                for i, g in enumerate(("H100", "A100", "V100", "V100"), start=1)
            ],
            "tenants": [{"name": "t", "api_keys": ["sk-t-000001"]}],
        }
    )


def test_the_defaults_are_the_learners() -> None:
    d = LearnedThresholds()
    assert d.window == threshold_learner.DEFAULT_WINDOW
    assert d.samples_before_use == threshold_learner.DEFAULT_MIN_SAMPLES
    assert d.rederive_every_s == threshold_learner.DEFAULT_REDERIVE_EVERY_S
    assert d.hysteresis == threshold_learner.DEFAULT_HYSTERESIS
    assert d.fraction == length_aware.DEFAULT_TIER_WORK_FRACTION
    assert d.prompt_token_work == threshold_learner.DEFAULT_PROMPT_TOKEN_WORK
    assert LearnedThresholds(window=100).samples_before_use == 100


@pytest.mark.parametrize("form", [{"long_output_tokens": 100}, {"tiers": TIERS}])
def test_true_asks_for_the_defaults_in_both_forms(form: dict[str, Any]) -> None:
    la = config({**form, "learn_thresholds": True}).models[0].cluster.length_aware
    assert la is not None and la.learn_thresholds == LearnedThresholds()
    off = config({**form, "learn_thresholds": False}).models[0].cluster.length_aware
    assert off is not None and off.learn_thresholds is None


@pytest.mark.parametrize(
    ("learn", "field"),
    [
        ({"window": 8}, "learn_thresholds.window"),
        ({"window": 100, "min_samples": 101}, "learn_thresholds: min_samples"),
        ({"min_samples": 0}, "learn_thresholds.min_samples"),
        ({"rederive_every_s": -1}, "learn_thresholds.rederive_every_s"),
        ({"hysteresis": 1.0}, "learn_thresholds.hysteresis"),
        ({"fraction": 0}, "learn_thresholds.fraction"),
        ({"prompt_token_work": -0.1}, "learn_thresholds.prompt_token_work"),
        ({"windw": 10}, "learn_thresholds.windw"),
        ("auto", "learn_thresholds"),
    ],
)
def test_bad_values_are_refused_naming_the_field(learn: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"models\[0\]\.cluster\.length_aware\.{field}"):
        config({"tiers": TIERS, "learn_thresholds": learn})


@given(
    window=st.integers(-5, 2_000_000),
    min_samples=st.one_of(st.none(), st.integers(-5, 2_000_000)),
    hysteresis=st.floats(-0.5, 1.5, allow_nan=False),
)
def test_the_block_is_accepted_exactly_within_its_ranges(
    window: int, min_samples: int | None, hysteresis: float
) -> None:
    learn: dict[str, Any] = {"window": window, "min_samples": min_samples, "hysteresis": hysteresis}
    problems = []
    if not 16 <= window <= 1_000_000:
        problems.append("window")
    if min_samples is not None and not 1 <= min_samples <= 1_000_000:
        problems.append("min_samples")
    if not 0 <= hysteresis < 1:
        problems.append("hysteresis")
    if not problems and min_samples is not None and min_samples > window:
        problems.append("min_samples")
    if not problems:
        la = config({"learn_thresholds": learn}).models[0].cluster.length_aware
        assert la is not None and la.learn_thresholds is not None
        assert 1 <= la.learn_thresholds.samples_before_use <= window
        return
    with pytest.raises(ConfigError) as err:
        config({"learn_thresholds": learn})
    assert all(p in str(err.value) for p in problems), err.value


@given(cap=st.integers(0, 10_000), two_tier=st.booleans())
def test_the_static_thresholds_class_as_length_class(cap: int, two_tier: bool) -> None:
    policy = LengthAwareRouting() if two_tier else LengthAwareRouting.model_validate({"tiers": TIERS})
    names = [c.name for c in confined_classes(policy)]
    assert class_by_thresholds(cap, static_thresholds(policy), names) == length_class(cap, policy)


_QUESTIONS = itertools.count()


def prepared(cfg: Config, max_tokens: int) -> PreparedRequest:
    pending = PendingRequest(
        tenant=cfg.tenants[0], kind=EndpointKind.CHAT_COMPLETIONS, path="/v1/chat/completions"
    )
    body = {"model": "llama", "messages": [{"role": "user", "content": f"q {next(_QUESTIONS)}"}]}
    body["max_tokens"] = max_tokens  # type: ignore[assignment]
    out = handlers.prepare_body(Gateway.from_config(cfg), pending, json.dumps(body).encode())
    assert isinstance(out, PreparedRequest), out
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def classes(length: LengthState, cfg: Config, caps: list[int]) -> list[str]:
    out = []
    for c in caps:
        name = length.decide(cfg, prepared(cfg, c), "v1").length_class
        assert name is not None
        out.append(name)
    return out


def sample(metrics: ExtProcMetrics, name: str, cls: str) -> float | None:
    return metrics.registry.get_sample_value(
        name, {"model": "llama", "cluster": CLUSTER, "length_class": cls}
    )


LEARN = {"window": 100, "min_samples": 20, "rederive_every_s": 1.0, "hysteresis": 0.0}


def test_tiered_thresholds_learnt_from_the_caps_and_their_metrics() -> None:
    # tiers: H100 (3.4) | + A100 (1.7) | + 2 V100: set shares 3.4/7.1 = 0.48 and 5.1/7.1 = 0.72, budgets
    # (x 0.75) 0.36 and 0.54 of the work (~ the cap; a prompt token costs 0.12)
    cfg = config({"tiers": TIERS, "learn_thresholds": LEARN})
    metrics, clock = ExtProcMetrics(), Clock()
    length = LengthState(metrics, clock=clock)
    # per 10 requests: 7 capped at 100, 2 at 600, 1 at 3,000 (work 700, 1,200, 3,000 of 4,900): above 600
    # 0.61, above 100 0.86, both past their budgets: T_1 = T_2 = 3,000, nothing confined
    caps = ([100] * 7 + [600] * 2 + [3000]) * 10
    assert set(classes(length, cfg, caps[:20])) == {"long-0", "long-1", "short"}  # configured: 2,000, 500
    clock.now = 1.0
    classes(length, cfg, caps[20:])
    clock.now = 2.0
    assert classes(length, cfg, [3000, 600, 100]) == ["short"] * 3
    assert sample(metrics, "inferlb_length_class_threshold_tokens", "long-0") == 3000
    assert sample(metrics, "inferlb_length_class_threshold_tokens", "long-1") == 3000
    assert sample(metrics, "inferlb_length_class_set_share", "long-0") == pytest.approx(3.4 / 7.1)
    assert sample(metrics, "inferlb_length_class_set_share", "long-1") == pytest.approx(5.1 / 7.1)
    # 90 at 100, 8 at 600, 2 at 2,000 (9,000, 4,800, 4,000 of 17,800): above 600 0.22 (T_1 = 600), above
    # 100 0.49 (T_2 = 100)
    clock.now = 3.0
    classes(length, cfg, [100] * 90 + [600] * 8 + [2000] * 2)
    clock.now = 4.0
    assert classes(length, cfg, [2000, 600, 100]) == ["long-0", "long-1", "short"]
    assert sample(metrics, "inferlb_length_class_threshold_tokens", "long-0") == 600
    assert sample(metrics, "inferlb_length_class_threshold_tokens", "long-1") == 100
    # the window's share above T_1 at the review (which saw these three requests too): within its budget
    confined = sample(metrics, "inferlb_length_class_confined_work_share", "long-0")
    assert confined is not None and 0.2 < confined <= 0.75 * 3.4 / 7.1


def test_static_thresholds_are_checked_against_the_caps_seen(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ext_proc.length_state")
    cfg = config({"tiers": TIERS})
    metrics, clock = ExtProcMetrics(), Clock()
    length = LengthState(metrics, clock=clock)
    # every client sends 1,024: all of the work is above long-1's 500, a set of 0.72 of the capacity
    classes(length, cfg, [1024] * 300)
    clock.now = 10.0
    assert classes(length, cfg, [1024]) == ["long-1"]  # static: no learning
    assert sample(metrics, "inferlb_length_class_confined_work_share", "long-1") == 1.0
    assert sample(metrics, "inferlb_length_class_confined_work_share", "long-0") == 0.0
    assert sample(metrics, "inferlb_length_class_overcommitted_total", "long-1") == 1
    assert sample(metrics, "inferlb_length_class_overcommitted_total", "long-0") == 0
    warnings = [r for r in caplog.records if "more work than their GPU sets" in r.getMessage()]
    assert len(warnings) == 1 and "learn_thresholds" in warnings[0].getMessage()
    # every interval counts again; the warning waits for its own interval
    clock.now = 20.0
    classes(length, cfg, [1024])
    assert sample(metrics, "inferlb_length_class_overcommitted_total", "long-1") == 2
    assert len([r for r in caplog.records if "more work" in r.getMessage()]) == 1
    clock.now = 10.0 + OVERCOMMIT_LOG_INTERVAL_S
    classes(length, cfg, [1024])
    assert len([r for r in caplog.records if "more work" in r.getMessage()]) == 2


def test_static_thresholds_within_their_sets_are_not_flagged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ext_proc.length_state")
    cfg = config({"tiers": TIERS})
    metrics, clock = ExtProcMetrics(), Clock()
    length = LengthState(metrics, clock=clock)
    classes(length, cfg, [100] * 290 + [600] * 10)  # above 500: 6,000 of 35,000 (0.17 <= 0.72)
    clock.now = 10.0
    classes(length, cfg, [100])
    assert sample(metrics, "inferlb_length_class_overcommitted_total", "long-1") == 0
    assert not [r for r in caplog.records if "more work" in r.getMessage()]


def test_a_reload_that_keeps_the_cluster_alike_keeps_what_it_learnt() -> None:
    doc = {"long_output_tokens": 100, "learn_thresholds": {**LEARN, "rederive_every_s": 0}}
    cfg = config(doc)
    length = LengthState(ExtProcMetrics(), clock=Clock())
    classes(length, cfg, [1024] * 20)
    assert classes(length, cfg, [1024]) == ["short"]
    same = config(doc)  # a new Config, equal
    assert classes(length, same, [1024]) == ["short"]
    changed = config({**doc, "long_output_tokens": 200})  # a new policy: learns anew
    assert classes(length, changed, [1024]) == ["long"]


def test_one_absurd_cap_is_not_confined_either() -> None:
    """A cap beyond the learner's 64-bit window (a model whose context_length lets it through) counts as
    its bound on both sides: one such cap for every request still confines nothing."""
    doc = {"long_output_tokens": 100, "learn_thresholds": {**LEARN, "rederive_every_s": 0}}
    cfg = config(doc, context_length=10**22)
    length = LengthState(ExtProcMetrics(), clock=Clock())
    got = classes(length, cfg, [10**20] * 25)
    assert got == ["long"] * 20 + ["short"] * 5
