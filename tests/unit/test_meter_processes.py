"""Several ext_authz processes that meter (``ext_proc.extra_listen`` with ``account_responses``): each has
its own settler address (``extra_meter_listen``, or derived below ``meter_listen``), validated with the
field named, and Envoy gets one access-log cluster and one gRPC access logger per process, each logger
taking only its own process's meter ids (a prefix match on the ext_authz metadata), so an entry reaches
the one settler that holds its reservation."""

from __future__ import annotations

import logging
import string
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from hypothesis import example, given
from hypothesis import strategies as st

from ext_proc.process import warn_if_process_moved
from inferlb.config.schema import HostPort, default_config_path, parse_config
from inferlb.errors import ConfigError
from inferlb.policy.settlement import AUTHZ_NAMESPACE, meter_id_prefix
from inferlb.request import headers
from xds_server import resources as r
from xds_server.resources.clusters import build_clusters
from xds_server.resources.common import METER_CLUSTER, meter_cluster_name


def authz_doc(extra: int, **ext_proc: Any) -> dict[str, Any]:
    """The default config in ext_authz mode with Redis quotas and ``extra`` more processes."""
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["ext_proc"].update(
        protocol="ext_authz",
        quota_backend="redis",
        extra_listen=[f"127.0.0.1:{18090 + i}" for i in range(extra)],
        **ext_proc,
    )
    return doc


def refusal(doc: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "f.yaml")
    return str(info.value)


def hcm_of(doc: dict[str, Any]) -> http_connection_manager_pb2.HttpConnectionManager:
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert r.build_listener(parse_config(doc)).filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def test_extra_processes_meter_on_derived_settler_addresses() -> None:
    ep = parse_config(authz_doc(2)).ext_proc
    assert ep.meters_access_log()
    assert ep.meter_addresses() == (
        ep.meter_listen,
        HostPort(host="127.0.0.1", port=ep.meter_listen.port - 1),
        HostPort(host="127.0.0.1", port=ep.meter_listen.port - 2),
    )
    sockets = parse_config(authz_doc(2)).listen_sockets()
    assert ("ext_proc.extra_meter_listen[1]", ep.meter_addresses()[2]) in sockets
    assert [ep.process_index(a) for a in (ep.listen, *ep.extra_listen)] == [0, 1, 2]
    assert ep.process_index(HostPort(host="127.0.0.1", port=1)) is None


def test_given_settler_addresses_are_used_in_order() -> None:
    ep = parse_config(authz_doc(2, extra_meter_listen=["127.0.0.1:19001", "127.0.0.1:19002"])).ext_proc
    assert [a.port for a in ep.meter_addresses()] == [ep.meter_listen.port, 19001, 19002]


@pytest.mark.parametrize(
    ("ext_proc", "field", "says"),
    [
        ({"extra_meter_listen": ["127.0.0.1:19001"]}, "ext_proc.extra_meter_listen", "1 addresses for 2"),
        ({"meter_listen": "127.0.0.1:2"}, "ext_proc.extra_meter_listen", "goes below 1"),
        (  # a settler on another process's metrics address
            {"extra_meter_listen": ["127.0.0.1:19001", "127.0.0.1:18081"]},
            "ext_proc.extra_meter_listen[1]",
            "127.0.0.1:18081 is already used by ext_proc.metrics_listen",
        ),
        (  # two settlers on one address
            {"extra_meter_listen": ["127.0.0.1:19001", "127.0.0.1:19001"]},
            "ext_proc.extra_meter_listen[1]",
            "already used by ext_proc.extra_meter_listen[0]",
        ),
        (  # derived settlers (18091, 18090) on the extra processes' own addresses
            {"meter_listen": "127.0.0.1:18092"},
            "ext_proc.extra_meter_listen[1]",
            "127.0.0.1:18090",
        ),
    ],
)
def test_bad_settler_addresses_are_refused_by_field(ext_proc: dict[str, Any], field: str, says: str) -> None:
    text = refusal(authz_doc(2, **ext_proc))
    assert field in text and says in text, text


def test_unmetered_processes_need_no_settler_address() -> None:
    config = parse_config(authz_doc(2, account_responses=False, meter_listen="127.0.0.1:2"))
    assert not any("meter" in f for f, _ in config.listen_sockets())
    assert METER_CLUSTER not in {c.name for c in build_clusters(config)}
    assert list(hcm_of(authz_doc(2, account_responses=False)).access_log) == []


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_envoy_logs_each_processs_entries_to_its_own_settler(extra: int) -> None:
    doc = authz_doc(extra)
    config = parse_config(doc)
    addresses = config.ext_proc.meter_addresses()
    clusters = {c.name: c for c in build_clusters(config)}
    logs = hcm_of(doc).access_log
    assert len(logs) == extra + 1 == len(addresses)
    for process, (log, addr) in enumerate(zip(logs, addresses, strict=True)):
        name = meter_cluster_name(process)
        grpc_log = als_pb2.HttpGrpcAccessLogConfig()
        assert log.typed_config.Unpack(grpc_log)
        assert grpc_log.common_config.grpc_service.envoy_grpc.cluster_name == name
        assert grpc_log.common_config.log_name == name  # one stream per logger per worker
        matcher = log.filter.metadata_filter.matcher
        assert matcher.filter == AUTHZ_NAMESPACE
        assert [p.key for p in matcher.path] == [headers.METER]
        assert matcher.value.string_match.prefix == meter_id_prefix(process)
        assert log.filter.metadata_filter.HasField("match_if_key_not_found")
        assert not log.filter.metadata_filter.match_if_key_not_found.value
        cluster = clusters[name]
        assert cluster.type == cluster_pb2.Cluster.STATIC
        [endpoint] = cluster.load_assignment.endpoints[0].lb_endpoints
        sa = endpoint.endpoint.address.socket_address
        assert (sa.address, sa.port_value) == (addr.host, addr.port)
    assert len({meter_cluster_name(i) for i in range(extra + 1)}) == extra + 1
    assert meter_cluster_name(0) == METER_CLUSTER


#: What follows a prefix in a meter id: the nonce (hex), a dash, the counter.
_TAIL = st.text(alphabet=string.hexdigits.lower() + "-", max_size=20)


@given(owner=st.integers(0, 200), logger=st.integers(0, 200), tail=_TAIL)
@example(owner=10, logger=1, tail="")
@example(owner=1, logger=10, tail="0-1")
def test_exactly_one_logger_takes_each_meter_id(owner: int, logger: int, tail: str) -> None:
    meter_id = meter_id_prefix(owner) + tail
    assert meter_id.startswith(meter_id_prefix(logger)) == (owner == logger)


def test_a_negative_process_has_no_prefix() -> None:
    with pytest.raises(ValueError, match="process must be >= 0"):
        meter_id_prefix(-1)


@pytest.mark.parametrize(
    ("ext_proc", "listen", "says"),
    [
        # reordered: each process keeps its settler address and prefix, as Envoy's loggers do: quiet
        ({"extra_listen": ["127.0.0.1:18091", "127.0.0.1:18090"]}, "127.0.0.1:18091", []),
        (
            {"extra_listen": ["127.0.0.1:18090"]},
            "127.0.0.1:18091",
            ["no longer ext_proc.listen/listen_unix nor one of", "the settler addresses changed"],
        ),
        (
            {"extra_meter_listen": ["127.0.0.1:19001", "127.0.0.1:19002"]},
            "127.0.0.1:18090",
            ["the settler addresses changed to 127.0.0.1:18079, 127.0.0.1:19001, 127.0.0.1:19002"],
        ),
    ],
)
def test_a_reload_that_moves_a_settler_says_it_needs_a_restart(
    ext_proc: dict[str, Any], listen: str, says: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    old = parse_config(authz_doc(2))
    doc = authz_doc(2)
    doc["ext_proc"].update(ext_proc)
    log = logging.getLogger("test.reload")
    with caplog.at_level(logging.WARNING, logger="test.reload"):
        warn_if_process_moved(old, parse_config(doc), listen, log)
    got = [r.getMessage() for r in caplog.records]
    assert len(got) == len(says) and all(s in m for s, m in zip(says, got, strict=True)), got
