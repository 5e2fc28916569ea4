"""The run-time config checks both services share: tokenizers load and endpoint host names resolve, each
problem naming its field and file; ``inferlb validate`` runs the same checks."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from inferlb.config.checks import CheckedConfig, TokenizerCache, check_config
from inferlb.config.schema import Config, parse_config
from inferlb.errors import ConfigError
from inferlb.ops.cli import main
from tests.conftest import make_config_doc, write_config

SOURCE = "fleet.yaml"
#: the only host names the injected resolver knows
HOSTS = {"gpu-a.example": "10.0.0.7", "gpu-b.example": "10.0.0.8"}


async def fake_resolve(name: str) -> str:
    """A resolver that knows :data:`HOSTS` and fails like getaddrinfo for any other name."""
    try:
        return HOSTS[name]
    except KeyError:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None


def tokenizer_file(path: Path, vocab: dict[str, int]) -> Path:
    """Write a word-level Hugging Face ``tokenizer.json`` with ``vocab`` (needs ``tokenizers``)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def config_of(doc: dict[str, Any]) -> Config:
    return parse_config(doc, SOURCE)


def check(config: Config, cache: TokenizerCache | None = None) -> CheckedConfig:
    return asyncio.run(
        check_config(config, SOURCE, resolve=fake_resolve, tokenizers=cache or TokenizerCache())
    )


def test_the_default_config_passes_with_what_was_found() -> None:
    config = config_of(make_config_doc())
    checked = check(config)
    assert checked.config is config
    assert checked.resolved_hosts == {}  # every endpoint is an IP literal: nothing looked up
    assert set(checked.counters) == {"tiktoken:cl100k_base"}


def test_host_names_and_an_hf_tokenizer_that_load_pass(tmp_path: Path) -> None:
    doc = make_config_doc()
    path = tokenizer_file(tmp_path / "tokenizer.json", {"hello": 0, "world": 1, "[UNK]": 2})
    doc["models"][1]["tokenizer"] = f"hf:{path}"
    doc["endpoints"][0]["address"] = "gpu-a.example:8001"
    doc["endpoints"][5]["address"] = "gpu-b.example:8001"
    checked = check(config_of(doc))
    assert checked.resolved_hosts == HOSTS
    assert checked.counters[f"hf:{path}"].count("hello world zzz") == 3


def test_a_tokenizer_that_cannot_load_is_refused_naming_the_field_and_file(tmp_path: Path) -> None:
    doc = make_config_doc()
    doc["models"][1]["tokenizer"] = f"hf:{tmp_path / 'nonexistent' / 'tokenizer.json'}"
    with pytest.raises(ConfigError) as caught:
        check(config_of(doc))
    assert caught.value.source == SOURCE
    [(field, message)] = caught.value.problems
    assert field == "models[1].tokenizer"
    assert "qwen2.5-7b-instruct" in message and "cannot load tokenizer" in message
    assert f"{SOURCE}: models[1].tokenizer: " in str(caught.value)


def test_a_host_name_that_does_not_resolve_is_refused_naming_each_endpoint() -> None:
    doc = make_config_doc()
    doc["endpoints"][3]["address"] = "gpu-9.invalid:8001"
    doc["endpoints"][7]["address"] = "gpu-9.invalid:8002"
    doc["endpoints"][4]["address"] = "gpu-a.example:8001"  # resolves: not named
    with pytest.raises(ConfigError) as caught:
        check(config_of(doc))
    fields = [field for field, _ in caught.value.problems]
    assert fields == ["endpoints[3].address", "endpoints[7].address"]
    assert all("'gpu-9.invalid' does not resolve" in m for _, m in caught.value.problems)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    doc = make_config_doc()
    doc["models"][0]["tokenizer"] = "tiktoken:p50k_base"  # not bundled offline
    doc["endpoints"][0]["address"] = "gpu-9.invalid:8001"
    with pytest.raises(ConfigError) as caught:
        check(config_of(doc))
    assert [f for f, _ in caught.value.problems] == ["models[0].tokenizer", "endpoints[0].address"]


def test_an_unchanged_tokenizer_file_is_read_once_and_a_replaced_one_again(tmp_path: Path) -> None:
    path = tokenizer_file(tmp_path / "tokenizer.json", {"hello": 0, "[UNK]": 1})
    cache = TokenizerCache()
    first = cache.load(f"hf:{path}")
    assert cache.load(f"hf:{path}") is first
    assert cache.loads == 1
    # replaced on disk (an editor writes a new file): loaded again, with the new vocabulary
    new = tokenizer_file(tmp_path / "new.json", {"hello": 0, "world": 1, "[UNK]": 2})
    os.replace(new, path)
    second = cache.load(f"hf:{path}")
    assert second is not first and cache.loads == 2
    assert second.count("hello world") == 2
    # gone: an error even though it was loaded before (a restart could not load it)
    path.unlink()
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        cache.load(f"hf:{path}")


def test_the_cache_keeps_at_most_its_bound_of_specs(tmp_path: Path) -> None:
    paths = [tokenizer_file(tmp_path / f"t{i}.json", {f"w{i}": 0, "[UNK]": 1}) for i in range(3)]
    cache = TokenizerCache(max_entries=2)
    for p in paths:
        cache.load(f"hf:{p}")
    cache.load(f"hf:{paths[2]}")
    assert cache.loads == 3  # the newest two are kept
    cache.load(f"hf:{paths[0]}")
    assert cache.loads == 4  # the oldest was dropped


def test_validate_runs_the_same_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = make_config_doc()
    good = write_config(tmp_path / "good.yaml", doc)
    assert main(["validate", str(good)]) == 0
    doc["models"][1]["tokenizer"] = f"hf:{tmp_path / 'nonexistent.json'}"
    bad = write_config(tmp_path / "bad.yaml", doc)
    assert main(["validate", str(bad)]) == 2
    assert f"{bad}: models[1].tokenizer: " in capsys.readouterr().err
