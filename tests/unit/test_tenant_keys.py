"""Tenant API keys from ``api_key_sha256``, ``api_key_file`` and ``api_key_env``: matched, never shown."""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path
from typing import Any

import pytest

from inferlb.config.schema import Config, parse_config
from inferlb.errors import ConfigError, RequestError
from inferlb.ops.cli import main
from inferlb.policy.routing import RoutingTable

SECRET = "sk-file-secret-0123"
ENV_SECRET = "sk-env-secret-4567"
HASHED = "sk-hashed-secret-89ab"


def _doc(*tenants: dict[str, Any]) -> dict[str, Any]:
    return {"models": [{"name": "m"}], "tenants": list(tenants)}


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    (tmp_path / "key").write_text(SECRET + "\n")
    monkeypatch.setenv("TENANT_C_KEY", ENV_SECRET)
    return parse_config(
        _doc(
            {"name": "a", "api_key_sha256": hashlib.sha256(HASHED.encode()).hexdigest()},
            {"name": "b", "api_key_file": str(tmp_path / "key"), "api_keys": ["sk-plain-b-1"]},
            {"name": "c", "api_key_env": "TENANT_C_KEY"},
        )
    )


def test_each_source_authenticates(config: Config) -> None:
    table = RoutingTable(config)
    assert table.authenticate(f"Bearer {HASHED}").name == "a"
    assert table.authenticate(f"Bearer {SECRET}").name == "b"
    assert table.authenticate("Bearer sk-plain-b-1").name == "b"
    assert table.authenticate(f"Bearer {ENV_SECRET}").name == "c"
    with pytest.raises(RequestError) as info:
        table.authenticate(f"Bearer {HASHED}x")
    assert info.value.status == 401


def test_repr_shows_no_key(config: Config) -> None:
    text = repr(config) + str(config) + repr(config.tenants)
    for key in (SECRET, ENV_SECRET, HASHED, "sk-plain-b-1"):
        assert key not in text


def test_envoy_fail_open_credentials_take_plaintext_keys_only(config: Config) -> None:
    assert config.tenants[0].plaintext_keys() == ()
    assert config.tenants[1].plaintext_keys() == ("sk-plain-b-1", SECRET)
    assert config.tenants[2].plaintext_keys() == (ENV_SECRET,)


def _error(doc: dict[str, Any], caplog: pytest.LogCaptureFixture) -> ConfigError:
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as info:
        parse_config(doc)
    return info.value


def test_unreadable_file_names_the_field(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    err = _error(_doc({"name": "a", "api_key_file": str(tmp_path / "absent")}), caplog)
    assert "tenants[0].api_key_file" in str(err)
    assert "No such file" in str(err)


def test_bad_key_in_file_is_not_shown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "key").write_text("sk-has white space\n")
    err = _error(_doc({"name": "a", "api_key_file": str(tmp_path / "key")}), caplog)
    assert "tenants[0].api_key_file" in str(err)
    assert "white space" in str(err)
    assert "sk-has" not in str(err) + repr(err) + caplog.text


def test_unset_env_names_the_field(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    err = _error(_doc({"name": "a", "api_key_env": "NO_SUCH_KEY_VAR"}), caplog)
    assert "tenants[0].api_key_env" in str(err)


def test_shared_key_across_sources(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("K", SECRET)
    doc = _doc(
        {"name": "a", "api_key_sha256": [hashlib.sha256(SECRET.encode()).hexdigest()]},
        {"name": "b", "api_key_env": "K"},
    )
    err = _error(doc, caplog)
    assert "shared with tenant 'a'" in str(err)
    assert SECRET not in str(err) + caplog.text


@pytest.mark.parametrize("doc", [{"name": "a"}, {"name": "a", "api_keys": []}])
def test_a_tenant_needs_a_key(doc: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    assert "at least one API key" in str(_error(_doc(doc), caplog))


def test_bad_digest_names_the_field(caplog: pytest.LogCaptureFixture) -> None:
    err = _error(_doc({"name": "a", "api_key_sha256": "ABC"}), caplog)
    assert "tenants[0].api_key_sha256" in str(err)


def test_hash_key_command(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(HASHED + "\n"))
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hashlib.sha256(HASHED.encode()).hexdigest()
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert main(["hash-key"]) == 2
