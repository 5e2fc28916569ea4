"""The request path's live length classes (:mod:`ext_proc.length_state`): the prediction decides the class
of requests whose cap is uninformative, the settled usage teaches it, the reservation stays the cap, the
capacity guard spills a loaded class (Envoy-subset path from per-class counts, picking path from the
book), and the config refuses the options without response accounting."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from ext_authz.meter import Meter
from ext_proc import handlers
from ext_proc.handlers import ContinueRequest, Gateway, PendingRequest, PreparedRequest
from ext_proc.length_state import LengthState, class_capacities
from ext_proc.metrics import ExtProcMetrics
from ext_proc.picking import Picked, PickingState, choose
from ext_proc.state import ExtProcState
from inferlb.config.schema import Config, parse_config
from inferlb.errors import ConfigError
from inferlb.policy.columnar import COLUMNAR_MIN_ENDPOINTS
from inferlb.policy.endpoint_book import parse_picking_state
from inferlb.policy.quota import Admitted, MemoryQuotaStore, QuotaBook, limits_from_config
from inferlb.policy.settlement import MeterEntry
from inferlb.request import headers as h
from inferlb.request.parsing import EndpointKind

FAST, SLOW_1, SLOW_2 = "10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"
CLUSTER = "llama--v1"


def config(length_aware: dict[str, Any], *, picking: bool = False, accounting: bool = True) -> Config:
    model: dict[str, Any] = {
        "name": "llama",
        "context_length": 100_000,
        "default_max_tokens": 4096,
        "cluster": {"length_aware": {"long_output_tokens": 100, **length_aware}},
    }
    doc: dict[str, Any] = {
        "models": [model],
        "endpoints": [
            {"address": FAST, "model": "llama", "gpu": "H100"},
            {"address": SLOW_1, "model": "llama", "gpu": "V100"},
            {"address": SLOW_2, "model": "llama", "gpu": "V100"},
        ],
        "tenants": [{"name": "t", "api_keys": ["sk-t-000001"]}],
        "ext_proc": {"account_responses": accounting},
    }
    if picking:
        model["endpoint_picking"] = {"mode": "load"}
        doc["xds"] = {"api_listen": "127.0.0.1:18999"}
    return parse_config(doc)


_QUESTIONS = itertools.count()


def prepared(cfg: Config, max_tokens: int | None = 1024, user: str | None = None) -> PreparedRequest:
    """A chat request; each opens a conversation of its own (a new question) unless ``user`` names one."""
    pending = PendingRequest(
        tenant=cfg.tenants[0], kind=EndpointKind.CHAT_COMPLETIONS, path="/v1/chat/completions"
    )
    question = f"question {next(_QUESTIONS)}"
    body: dict[str, Any] = {"model": "llama", "messages": [{"role": "user", "content": question}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if user is not None:
        body["user"] = user
    out = handlers.prepare_body(Gateway.from_config(cfg), pending, json.dumps(body).encode())
    assert isinstance(out, PreparedRequest), out
    return out


def served(length: LengthState, cfg: Config, completion: int, **kw: Any) -> str:
    """Decide, hold and settle one request answering ``completion`` tokens; its class."""
    p = length.decide(cfg, prepared(cfg, **kw), "v1")
    hold = length.hold(p, CLUSTER)
    assert hold is not None and p.length_class is not None
    length.release(hold, completion)
    return p.length_class


def header(cont: ContinueRequest, name: str) -> str:
    return dict(cont.set_headers)[name]


def test_an_uninformative_cap_is_classed_by_the_answers_it_gets() -> None:
    cfg = config({"predict_output": True})
    metrics = ExtProcMetrics()
    length = LengthState(metrics)
    first = [served(length, cfg, 12, max_tokens=None) for _ in range(8)]
    # cold: the cap (the model's default, 4,096) classes long until the key holds min_samples answers
    assert first == ["long"] * 8
    assert served(length, cfg, 12, max_tokens=None) == "short"
    decisions = metrics.length_class_decisions
    sources = {
        src: decisions.labels("llama", cls, src)._value.get()
        for src, cls in (("cap", "long"), ("prediction", "short"))
    }
    assert sources == {"cap": 8, "prediction": 1}


def test_the_prediction_decides_the_header_but_the_reservation_stays_the_cap() -> None:
    cfg = config({"predict_output": True})
    length = LengthState(ExtProcMetrics())
    for _ in range(10):
        served(length, cfg, 12, max_tokens=4096)  # the model's default: uninformative
    p = length.decide(cfg, prepared(cfg, max_tokens=4096), "v1")
    quotas = QuotaBook(limits_from_config(cfg), now=0.0)
    cont = handlers.admit(Gateway.from_config(cfg), quotas, p, now=0.0, rng=random.Random(1))
    assert isinstance(cont, ContinueRequest)
    assert header(cont, h.LENGTH_CLASS) == "short"
    assert cont.reservation is not None and cont.reservation.reserved_tokens == p.prompt_tokens + 4096


def test_a_conversation_that_writes_long_answers_stays_long() -> None:
    cfg = config({"predict_output": True})
    length = LengthState(ExtProcMetrics())
    for _ in range(10):
        served(length, cfg, 12, max_tokens=None)
    assert served(length, cfg, 800, max_tokens=None, user="coder") == "short"  # nothing known of it yet
    assert served(length, cfg, 800, max_tokens=None, user="coder") == "long"
    assert served(length, cfg, 10, max_tokens=None, user="chatter") == "short"


def test_an_informative_cap_keeps_classing_by_the_cap() -> None:
    cfg = config({"predict_output": True})
    length = LengthState(ExtProcMetrics())
    classes = [served(length, cfg, 10, max_tokens=cap) for cap in (50, 500, 60, 600, 70, 700, 80, 800, 90)]
    assert classes == ["short", "long"] * 4 + ["short"]
    assert served(length, cfg, 10, max_tokens=900) == "long"


def test_without_prediction_the_class_is_the_caps() -> None:
    cfg = config({})
    length = LengthState(ExtProcMetrics())
    assert [served(length, cfg, 5, max_tokens=None) for _ in range(20)] == ["long"] * 20


def test_the_envoy_path_guard_spills_once_the_fast_set_holds_its_share() -> None:
    cfg = config({"capacity_guard_factor": 1.5})
    assert class_capacities(cfg, cfg.models[0], "v1") == ((3.4,), 5.4)
    length = LengthState(ExtProcMetrics())
    classes = []
    for _ in range(20):  # all in flight at once: nothing settles
        p = length.decide(cfg, prepared(cfg, max_tokens=1024), "v1")
        length.hold(p, CLUSTER)
        classes.append(p.length_class)
    # the fast set may hold ceil(1.5 x (T + 1) x 3.4 / 5.4) of T in flight: it never passes that
    assert classes[:2] == ["long", "long"]
    assert "short" in classes
    held = length.in_flight()
    assert held[(CLUSTER, "long")] <= 1.5 * 20 * 3.4 / 5.4 + 1
    assert held[(CLUSTER, "long")] + held[(CLUSTER, "short")] == 20


def picking_state(*, fast_busy: int) -> PickingState:
    picking = PickingState(salt=b"test")
    rows = [
        {"address": a, "weight": w, "healthy": True, "waiting": 0, "kv_usage": 0, "telemetry_age_ms": 0,
         "length_classes": c}
        for a, w, c in ((FAST, 34, ["long"]), (SLOW_1, 10, []), (SLOW_2, 10, []))
    ]  # fmt: skip
    picking.book.update(parse_picking_state({"clusters": {CLUSTER: rows}, "stale_after_ms": 1e9}), now=0.0)
    for _ in range(fast_busy):
        picking.book.enter(FAST)
    return picking


@pytest.mark.parametrize(("factor", "busy", "spills"), [(None, 20, False), (1.5, 20, True), (1.5, 12, False)])
def test_the_picker_guard_spills_a_loaded_class_to_every_host(
    factor: float | None, busy: int, spills: bool
) -> None:
    la: dict[str, Any] = {} if factor is None else {"capacity_guard_factor": factor}
    cfg = config(la, picking=True)
    picking = picking_state(fast_busy=busy)
    metrics = ExtProcMetrics()
    out = choose(picking, prepared(cfg, max_tokens=1024), CLUSTER, metrics, now=0.0)
    assert isinstance(out, Picked), out
    # by load the idle slow GPUs come first; confined, the long request has only the fast one. The fast
    # set (34 of 54 weight) may hold ceil(1.5 x (busy + 1) x 34 / 54): 20 of 21, 13 of 13
    assert (out.hosts[0] != FAST) is spills
    spilled = metrics.length_class_spills.labels("llama", "long", "short")._value.get()
    assert spilled == (1 if spills else 0)


@pytest.mark.parametrize("option", [{"predict_output": True}, {"capacity_guard_factor": 2.0}])
def test_the_options_need_response_accounting(option: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.cluster\.length_aware\.\w+: needs ext_proc.account"):
        config(option, accounting=False)


def test_the_guard_factor_must_exceed_one() -> None:
    with pytest.raises(ConfigError, match="capacity_guard_factor"):
        config({"capacity_guard_factor": 1.0})


async def test_the_ext_authz_settler_releases_the_class_and_teaches_the_predictor() -> None:
    cfg = config({"predict_output": True})
    state = ExtProcState(cfg, clock=lambda: 0.0)
    meter = Meter(state, clock=lambda: 0.0)
    ids = []
    for completion in (12,) * 8 + (None,):
        p = state.length.decide(cfg, prepared(cfg, max_tokens=None), "v1")
        assert isinstance(state.quotas, MemoryQuotaStore)
        admitted = state.quotas.admit_now("t", p.reserved_tokens)
        assert isinstance(admitted, Admitted)
        hold = state.length.hold(p, CLUSTER)
        meter_id = meter.reserve(admitted, model="llama", prompt_tokens=p.prompt_tokens, length=hold)
        ids.append(meter_id)
        usage = None if completion is None else (p.prompt_tokens, completion)
        await meter.on_entries([MeterEntry(meter_id=meter_id, status=200, usage=usage)])
    # every hold released; eight metered answers taught (the unmetered one did not)
    assert state.length.in_flight() == {}
    assert state.length.decide(cfg, prepared(cfg, max_tokens=None), "v1").length_class == "short"


def test_the_picker_guard_of_a_large_cluster_runs_over_its_columns() -> None:
    """A cluster of COLUMNAR_MIN_ENDPOINTS or more is picked over columns: the guard sums those."""
    cfg = config({"capacity_guard_factor": 1.5}, picking=True)
    fast = [f"10.1.0.{i}:80" for i in range(8)]
    slow = [f"10.2.0.{i}:80" for i in range(COLUMNAR_MIN_ENDPOINTS)]
    rows = [
        {"address": a, "weight": w, "healthy": True, "waiting": 0, "kv_usage": 0, "telemetry_age_ms": 0,
         "length_classes": c}
        for group, w, c in ((fast, 34, ["long"]), (slow, 10, []))
        for a in group
    ]  # fmt: skip
    picking = PickingState(salt=b"test")
    picking.book.update(parse_picking_state({"clusters": {CLUSTER: rows}, "stale_after_ms": 1e9}), now=0.0)
    assert picking.book.columns(CLUSTER, 0.0) is not None
    hosts = []
    for _ in range(400):  # nothing settles: the fast set fills to its bound, then the class spills
        out = choose(picking, prepared(cfg, max_tokens=1024), CLUSTER, ExtProcMetrics(), now=0.0)
        assert isinstance(out, Picked), out
        hosts.append(out.hosts[0])
    on_fast = sum(h in fast for h in hosts)
    share = 8 * 34 / (8 * 34 + COLUMNAR_MIN_ENDPOINTS * 10)
    assert on_fast <= 1.5 * share * 400 + 1
    assert hosts[0] in fast
