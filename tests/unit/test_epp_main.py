"""``python -m epp``'s command line: the pool from ``--endpoint`` or from one model of a config file (GPU
weights), and a bad pool refused with exit status 2 naming the flag or field."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from epp.__main__ import _parser, main, pool_endpoints, queue_settings
from epp.pool import Pool, PoolEndpoint, PoolError
from tests.conftest import make_config_doc, write_config


def _pool(argv: list[str]) -> list[PoolEndpoint]:
    return pool_endpoints(_parser().parse_args(argv))


def test_endpoints_from_flags_repeated_or_comma_separated() -> None:
    pool = _pool(["--endpoint", "10.0.0.1:80,10.0.0.2:80", "--endpoint", "[::1]:9"])
    assert [e.address for e in pool] == ["10.0.0.1:80", "10.0.0.2:80", "[::1]:9"]
    assert {e.weight for e in pool} == {1.0}


def test_endpoints_of_one_model_weighted_by_their_gpu(tmp_path: Path) -> None:
    doc: dict[str, Any] = make_config_doc()
    path = write_config(tmp_path / "c.yaml", doc)
    pool = _pool(["--config", str(path), "--model", "qwen2.5-7b-instruct"])
    by_gpu = {e["address"]: e["gpu"] for e in doc["endpoints"] if e["model"] == "qwen2.5-7b-instruct"}
    assert {e.address for e in pool} == set(by_gpu)
    # the embedded config's profiles: H100 3.4, V100 1.0 (relative capacity)
    assert sorted(e.weight for e in pool) == [1.0, 1.0, 3.4]
    # ... and their prefill capacities (H100 7.23, V100 none: its weight), what the picker's prefill term
    # divides by, carried to the picker by the pool's snapshot
    assert sorted((e.weight, e.prefill_weight) for e in pool) == [
        (1.0, 1.0),
        (1.0, 1.0),
        (3.4, pytest.approx(7.23)),
    ]
    assert sorted(s.prefill_weight or 0 for s in Pool(pool).snapshot()) == [1.0, 1.0, pytest.approx(7.23)]


def test_without_prefill_capacities_the_prefill_weight_is_the_weight(tmp_path: Path) -> None:
    doc: dict[str, Any] = make_config_doc()
    doc["gpu_profiles"] = {
        g: {"relative_capacity": c} for g, c in (("H100", 3.4), ("A100", 1.7), ("V100", 1.0))
    }
    path = write_config(tmp_path / "c.yaml", doc)
    pool = _pool(["--config", str(path), "--model", "qwen2.5-7b-instruct"])
    assert [e.prefill_weight for e in pool] == [e.weight for e in pool]
    with pytest.raises(ValueError, match="prefill_weight"):
        PoolEndpoint(address="10.0.0.1:80", prefill_weight=0.0)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        ([], "--endpoint/--config"),
        (["--endpoint", "gpu-0:8000"], "--endpoint"),
        (["--config", "{config}"], "--model"),
        (["--config", "{config}", "--model", "nope"], "--model"),
    ],
)
def test_a_bad_pool_is_refused_naming_the_flag(tmp_path: Path, argv: list[str], field: str) -> None:
    path = write_config(tmp_path / "c.yaml", make_config_doc())
    with pytest.raises(PoolError) as err:
        _pool([a.replace("{config}", str(path)) for a in argv])
    assert err.value.field == field


def test_a_config_endpoint_named_by_host_is_refused_naming_its_field(tmp_path: Path) -> None:
    doc = make_config_doc()
    doc["endpoints"][1]["address"] = "gpu-1.internal:8000"
    path = write_config(tmp_path / "c.yaml", doc)
    with pytest.raises(PoolError) as err:
        _pool(["--config", str(path), "--model", doc["endpoints"][1]["model"]])
    assert err.value.field == "endpoints[1].address"


def test_main_exits_2_and_logs_the_field(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="epp"):
        assert main(["--endpoint", "10.0.0.1:80", "--kv-usage", "1.5"]) == 2
        assert main(["--endpoint", "10.0.0.1:80", "--listen", "nowhere"]) == 2
    assert "kv_usage" in caplog.text and "--listen" in caplog.text


def test_queue_flags_build_the_fair_queue_and_bad_ones_exit_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = _parser().parse_args(
        [
            *("--endpoint", "10.0.0.1:80", "--max-queued", "16", "--max-wait", "2.5"),
            *("--objective", "premium=100", "--objective", "batch=-10"),
        ]
    )
    settings = queue_settings(args)
    assert (settings.max_queued, settings.max_wait_s) == (16, 2.5)
    assert settings.objectives == {"premium": 100, "batch": -10}
    assert settings.default_max_tokens == 256
    doc: dict[str, Any] = make_config_doc()
    doc["models"][0]["default_max_tokens"] = 77
    path = write_config(tmp_path / "c.yaml", doc)
    model = doc["models"][0]["name"]
    assert (
        queue_settings(_parser().parse_args(["--config", str(path), "--model", model])).default_max_tokens
        == 77
    )
    assert queue_settings(_parser().parse_args(["--endpoint", "10.0.0.1:80"])).max_queued == 0
    with caplog.at_level(logging.ERROR, logger="epp"):
        assert main(["--endpoint", "10.0.0.1:80", "--objective", "premium"]) == 2
        assert main(["--endpoint", "10.0.0.1:80", "--max-queued", "4", "--max-wait", "0"]) == 2
    assert "--objective" in caplog.text and "--max-wait" in caplog.text
