"""The local stack's xDS server gets a state file in a work directory of the caller's (``inferlb up
--workdir DIR``), none in a temporary one (removed on a clean stop) or when the config names its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inferlb.ops.stack import STATE_FILE_NAME, Stack
from tests.conftest import write_config


def _xds_argv(stack: Stack) -> list[str]:
    return next(child.argv for child, _ in stack._control_children() if child.name == "xds_server")


def test_the_callers_work_directory_holds_the_state_file(tmp_path: Path, config_doc: dict[str, Any]) -> None:
    stack = Stack(write_config(tmp_path / "c.yaml", config_doc), workdir=tmp_path / "work")
    assert stack.state_file == tmp_path / "work" / STATE_FILE_NAME
    argv = _xds_argv(stack)
    assert argv[argv.index("--state-file") + 1] == str(tmp_path / "work" / STATE_FILE_NAME)


def test_no_state_file_in_a_temporary_work_directory_or_over_the_configs(
    tmp_path: Path, config_doc: dict[str, Any]
) -> None:
    temporary = Stack(write_config(tmp_path / "c.yaml", config_doc))
    try:
        assert temporary.state_file is None and "--state-file" not in _xds_argv(temporary)
    finally:
        temporary.stop()
    config_doc["xds"]["state_file"] = "fleet.json"
    own = Stack(write_config(tmp_path / "d.yaml", config_doc), workdir=tmp_path / "work")
    assert own.state_file is None and "--state-file" not in _xds_argv(own)
