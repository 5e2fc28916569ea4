"""xds_server.bootstrap: the Envoy ADS bootstrap, and the committed envoy/bootstrap-ads.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import config_source_pb2

# registers the Any types the bootstrap names, so json_format can parse them
from envoy.extensions.access_loggers.file.v3 import file_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format

from inferlb.config.schema import default_config_path, load_config, parse_config
from xds_server.bootstrap import COMMITTED_BOOTSTRAPS, XDS_CLUSTER, render_bootstrap, render_bootstrap_yaml

COMMITTED = Path(__file__).resolve().parents[2] / "envoy" / "bootstrap-ads.yaml"


def _parse(doc: dict[str, Any]) -> bootstrap_pb2.Bootstrap:
    return json_format.ParseDict(doc, bootstrap_pb2.Bootstrap())


ROOT = COMMITTED.parents[1]


@pytest.mark.parametrize("name", sorted(COMMITTED_BOOTSTRAPS))
def test_committed_bootstraps_are_what_inferlb_bootstrap_prints(name: str) -> None:
    source, mode = COMMITTED_BOOTSTRAPS[name]
    text = (ROOT / "envoy" / name).read_text(encoding="utf-8")
    config = load_config(ROOT / source)
    assert yaml.safe_load(text) == render_bootstrap(config, mode=mode)
    assert text == render_bootstrap_yaml(config, source=source, mode=mode)


def test_the_compose_bootstrap_dials_the_xds_service_by_name() -> None:
    b = _parse(yaml.safe_load((ROOT / "envoy" / "bootstrap-compose.yaml").read_text(encoding="utf-8")))
    [cluster] = b.static_resources.clusters
    assert cluster.type == cluster.LOGICAL_DNS
    ep = cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (ep.address, ep.port_value) == ("xds-server", 18000)
    assert b.admin.address.socket_address.address == "0.0.0.0"


def test_bootstrap_is_a_valid_v3_bootstrap_pointing_at_ads() -> None:
    config = load_config(default_config_path())
    b = _parse(render_bootstrap(config, node_id="gw-3"))
    assert (b.node.id, b.node.cluster) == ("gw-3", config.gateway.node_cluster)
    sa = b.admin.address.socket_address
    assert (sa.address, sa.port_value) == ("127.0.0.1", 9901)
    [cluster] = b.static_resources.clusters
    assert cluster.name == XDS_CLUSTER
    assert cluster.type == cluster.STATIC
    assert (
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions" in cluster.typed_extension_protocol_options
    )
    ep = cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (ep.address, ep.port_value) == ("127.0.0.1", 18000)
    ads = b.dynamic_resources.ads_config
    assert ads.api_type == ads.GRPC
    assert ads.set_node_on_first_message_only
    assert ads.grpc_services[0].envoy_grpc.cluster_name == XDS_CLUSTER
    for source in (b.dynamic_resources.lds_config, b.dynamic_resources.cds_config):
        assert source.HasField("ads")
        assert source.resource_api_version == config_source_pb2.ApiVersion.V3


def test_xds_address_override_and_dns_names() -> None:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc["gateway"]["admin"] = "0.0.0.0:19901"
    doc["gateway"]["node_cluster"] = "edge"
    config = parse_config(doc)
    b = _parse(render_bootstrap(config, xds_host="xds-server", xds_port=28000))
    [cluster] = b.static_resources.clusters
    assert cluster.type == cluster.LOGICAL_DNS
    ep = cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (ep.address, ep.port_value) == ("xds-server", 28000)
    assert b.admin.address.socket_address.port_value == 19901
    assert b.node.cluster == "edge"


def test_yaml_has_no_aliases() -> None:
    text = render_bootstrap_yaml(load_config(default_config_path()))
    assert "&id" not in text
    assert "*id" not in text


def test_delta_mode_asks_for_delta_grpc() -> None:
    config = load_config(default_config_path())
    b = _parse(render_bootstrap(config, mode="delta"))
    assert b.dynamic_resources.ads_config.api_type == config_source_pb2.ApiConfigSource.DELTA_GRPC
    assert _parse(render_bootstrap(config)).dynamic_resources.ads_config.api_type == (
        config_source_pb2.ApiConfigSource.GRPC
    )
    with pytest.raises(ValueError, match="ADS mode"):
        render_bootstrap(config, mode="rest")  # type: ignore[arg-type]
