"""Envoy resyncs within 2 s of a restarted xDS server's return (its reconnect backoff comes from the
bootstrap, :func:`xds_server.bootstrap.reconnect_policy`), and serves its last config meanwhile.

Measured from the moment the new xDS server listens to the moment it lists this Envoy as having ACKed
every type it sent (``GET /v1/clients``). Envoy's default backoff (1 s doubling to 10 s, jittered) made
that up to ~18 s; three restarts in a row make a lucky pass on such a backoff unlikely.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from inferlb.ops.stack import synced_nodes
from tests.conftest import make_config_doc
from tests.e2e.conftest import RunningStack, started_stack

pytestmark = pytest.mark.e2e

#: How long the xDS server stays away: long enough for Envoy's backoff to grow past its first steps.
DOWN_S = 5.0
RESYNC_LIMIT_S = 2.0
NODE = "inferlb-gateway-0"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with started_stack(tmp_path_factory.mktemp("reconnect"), make_config_doc()) as rs:
        yield rs


def _resynced(rs: RunningStack) -> bool:
    token = rs.config.xds.api_token
    assert token is not None
    try:
        return NODE in synced_nodes(rs.config, token, timeout_s=0.5)
    except OSError:
        return False


def test_envoy_resyncs_within_two_seconds_of_a_restarted_xds_server(stack: RunningStack) -> None:
    deadline = time.monotonic() + 10
    while not _resynced(stack):
        assert time.monotonic() < deadline, "Envoy never synced with the first xDS server"
        time.sleep(0.05)
    took = []
    for _ in range(3):
        listening_at = stack.stack.restart("xds_server", down_s=DOWN_S)
        while not _resynced(stack):
            assert time.monotonic() - listening_at < 30, "Envoy did not come back within 30 s"
            time.sleep(0.02)
        took.append(time.monotonic() - listening_at)
        # the gateway kept serving on its last config while the xDS server was away, and still does
        assert stack.chat("qwen").status == 200
    assert max(took) <= RESYNC_LIMIT_S, [round(t, 2) for t in took]


def test_the_gateway_serves_while_the_xds_server_is_down(stack: RunningStack) -> None:
    xds = stack.stack.child("xds_server")
    xds.stop()
    try:
        assert [stack.chat("llama3").status for _ in range(5)] == [200] * 5
    finally:
        stack.stack.restart("xds_server")
