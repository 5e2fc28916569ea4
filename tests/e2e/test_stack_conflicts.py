"""A second stack on the same addresses is refused up front with the addresses named; the running one is
left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferlb.ops.stack import Stack, StackError
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import SharedStacks, http_request

pytestmark = pytest.mark.e2e


def test_a_second_stack_on_the_same_ports_is_refused(tmp_path: Path, shared_stacks: SharedStacks) -> None:
    # the running stack: the shared one in the default mode (ext_authz), left as it was found
    first = shared_stacks.get("ext_authz")
    second = Stack(first.config_path, workdir=tmp_path / "second")
    with pytest.raises(StackError, match="already in use") as info:
        second.start(timeout_s=20)
    assert "gateway.admin" in str(info.value) and "xds.listen" in str(info.value)
    assert second.children == []
    assert first.stack.first_exited() is None
    r = http_request(first.gateway, "GET", "/v1/models", headers={"Authorization": "Bearer sk-demo-a"})
    assert r.status == 200


def test_a_stack_removes_its_own_temp_dir_on_a_clean_stop(tmp_path: Path) -> None:
    stack = Stack(write_config(tmp_path / "c.yaml", make_config_doc()))
    stack.start(timeout_s=60)
    work = stack.workdir
    assert (work / "envoy.log").exists()
    stack.stop()
    assert not work.exists()
