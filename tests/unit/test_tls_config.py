"""TLS in the config and in what Envoy is given: ``gateway.tls``, ``gateway.upstream_tls``,
``gateway.sds_dir``, ``xds.tls``, ``ext_proc.tls`` are validated naming the field (files read and checked
to load together), and render into the listener's ``DownstreamTlsContext``, the services' clusters' and the
bootstrap's ``UpstreamTlsContext`` and the SDS files those name
(:mod:`xds_server.resources.transport_sockets`).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.config.schema import MAX_PEM_FILE_BYTES, Config, EndpointConfig, parse_config
from inferlb.errors import ConfigError
from inferlb.ops import cli
from inferlb.ops.stack import Stack, StackError, describe, sample_curl
from tests.conftest import make_config_doc
from tests.tls_certs import CertificateAuthority, replace_file
from xds_server.bootstrap import XDS_CLUSTER, render_bootstrap, sds_files
from xds_server.fleet_state import FleetState, effective_config
from xds_server.resources import build_clusters, build_listener
from xds_server.resources.common import EXT_AUTHZ_CLUSTER, EXT_PROC_CLUSTER, METER_CLUSTER
from xds_server.resources.transport_sockets import (
    ENVOY_CLIENT_CERT_SECRET,
    GATEWAY_CERT_SECRET,
    GATEWAY_CLIENT_CA_SECRET,
    SERVICES_CA_SECRET,
    TLS_TRANSPORT_SOCKET,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Certificate files: a CA, a server pair, a client pair, a key of another pair, a non-PEM file."""
    d = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority()
    replace_file(d / "ca.crt", ca.cert_pem)
    crt, key = ca.issue("svc.test").write(d, "server")
    ccrt, ckey = ca.issue("envoy", client=True).write(d, "client")
    replace_file(d / "not-pem.txt", b"hello\n")
    return {
        "ca": str(d / "ca.crt"),
        "crt": str(crt),
        "key": str(key),
        "client_crt": str(ccrt),
        "client_key": str(ckey),
        "not_pem": str(d / "not-pem.txt"),
        "dir": str(d),
    }


def tls_doc(
    pki: dict[str, str],
    *,
    gateway: bool = True,
    client_ca: bool = True,
    services: bool = True,
    server_name: str | None = "svc.test",
    mode: str = "ext_authz",
    sds_dir: str = "/run/inferlb/sds",
) -> dict[str, Any]:
    doc = make_config_doc()
    doc["ext_proc"]["protocol"] = mode
    pair = {"cert_file": pki["crt"], "key_file": pki["key"]}
    if gateway:
        doc["gateway"]["tls"] = {**pair, **({"client_ca_file": pki["ca"]} if client_ca else {})}
    if services:
        doc["gateway"]["upstream_tls"] = {
            "cert_file": pki["client_crt"],
            "key_file": pki["client_key"],
            "ca_file": pki["ca"],
        }
        service = {**pair, "client_ca_file": pki["ca"], "server_name": server_name}
        doc["xds"]["tls"] = dict(service)
        doc["ext_proc"]["tls"] = dict(service)
    if gateway or services:
        doc["gateway"]["sds_dir"] = sds_dir
    return doc


def _problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    return err.value.problems


# -- the config ------------------------------------------------------------------------------------


def test_plain_text_is_the_default_and_renders_no_tls() -> None:
    cfg = parse_config(make_config_doc())
    assert cfg.gateway.tls is None and cfg.gateway.upstream_tls is None and cfg.gateway.sds_dir is None
    assert cfg.xds.tls is None and cfg.ext_proc.tls is None
    assert not build_listener(cfg).filter_chains[0].HasField("transport_socket")
    assert not any(c.HasField("transport_socket") for c in build_clusters(cfg))
    assert "transport_socket" not in render_bootstrap(cfg)["static_resources"]["clusters"][0]
    assert sds_files(cfg) == {}


@pytest.mark.parametrize(
    ("where", "field", "value", "expected"),
    [
        (("gateway", "tls"), "cert_file", "/nonexistent/gateway.crt", "gateway.tls.cert_file: cannot read"),
        (("gateway", "tls"), "key_file", "/nonexistent/gateway.key", "gateway.tls.key_file: cannot read"),
        (
            ("gateway", "tls"),
            "client_ca_file",
            "/nonexistent/ca.crt",
            "gateway.tls.client_ca_file: cannot read",
        ),
        (("gateway", "tls"), "cert_file", "relative.crt", "gateway.tls.cert_file: expected an absolute"),
        (("xds", "tls"), "client_ca_file", "not_pem", "xds.tls.client_ca_file: '"),
        (("ext_proc", "tls"), "key_file", "client_key", "ext_proc.tls.key_file: '"),
        (
            ("gateway", "upstream_tls"),
            "ca_file",
            "/nonexistent/ca.crt",
            "gateway.upstream_tls.ca_file: cannot",
        ),
    ],
)
def test_a_bad_file_is_refused_naming_its_field(
    pki: dict[str, str], where: tuple[str, str], field: str, value: str, expected: str
) -> None:
    doc = tls_doc(pki)
    doc[where[0]][where[1]][field] = pki.get(value, value)
    problems = _problems(doc)
    text = "; ".join(f"{f}: {m}" for f, m in problems)
    assert expected in text, text


def test_a_key_of_another_certificate_is_refused(pki: dict[str, str]) -> None:
    doc = tls_doc(pki)
    doc["ext_proc"]["tls"]["key_file"] = pki["client_key"]
    ((field, message),) = _problems(doc)
    assert field == "ext_proc.tls.key_file"
    assert "do not load as a certificate chain and its key" in message


def test_a_non_pem_file_is_refused(pki: dict[str, str]) -> None:
    doc = tls_doc(pki)
    doc["xds"]["tls"]["client_ca_file"] = pki["not_pem"]
    ((field, message),) = _problems(doc)
    assert field == "xds.tls.client_ca_file"
    assert "holds no PEM block" in message


def test_tls_needs_an_sds_dir_and_the_services_need_envoys_certificate(pki: dict[str, str]) -> None:
    doc = tls_doc(pki, services=False)
    del doc["gateway"]["sds_dir"]
    assert [f for f, _ in _problems(doc)] == ["gateway.sds_dir"]
    doc = tls_doc(pki)
    del doc["gateway"]["upstream_tls"]
    problems = _problems(doc)
    assert [f for f, _ in problems] == ["gateway.upstream_tls", "gateway.upstream_tls"]
    assert "xds.tls" in problems[0][1] and "ext_proc.tls" in problems[1][1]


def test_tls_is_refused_on_a_unix_socket(pki: dict[str, str], tmp_path: Path) -> None:
    doc = tls_doc(pki)
    doc["ext_proc"]["listen_unix"] = str(tmp_path / "ext_proc.sock")
    problems = _problems(doc)
    assert ("ext_proc.tls", problems[0][1]) == problems[0]
    assert "listen_unix" in problems[0][1]


# -- what Envoy is given ---------------------------------------------------------------------------


def _sds_names(common: tls_pb2.CommonTlsContext) -> list[str]:
    return [s.name for s in common.tls_certificate_sds_secret_configs]


def test_the_listener_serves_tls_from_sds_files_and_asks_for_a_client_certificate(
    pki: dict[str, str],
) -> None:
    cfg = parse_config(tls_doc(pki, services=False))
    socket = build_listener(cfg).filter_chains[0].transport_socket
    assert socket.name == TLS_TRANSPORT_SOCKET
    ctx = tls_pb2.DownstreamTlsContext()
    assert socket.typed_config.Unpack(ctx)
    common = ctx.common_tls_context
    assert _sds_names(common) == [GATEWAY_CERT_SECRET]
    assert list(common.alpn_protocols) == ["h2", "http/1.1"]
    assert common.validation_context_sds_secret_config.name == GATEWAY_CLIENT_CA_SECRET
    assert ctx.require_client_certificate.value
    files = sds_files(cfg)
    for sds in (common.tls_certificate_sds_secret_configs[0], common.validation_context_sds_secret_config):
        path = Path(sds.sds_config.path_config_source.path)
        assert path.parent == Path("/run/inferlb/sds") and path.name in files
    # no client CA: no client certificate asked for
    cfg = parse_config(tls_doc(pki, services=False, client_ca=False))
    ctx = tls_pb2.DownstreamTlsContext()
    build_listener(cfg).filter_chains[0].transport_socket.typed_config.Unpack(ctx)
    assert not ctx.require_client_certificate.value
    assert not ctx.common_tls_context.HasField("validation_context_sds_secret_config")


def test_the_sds_files_name_the_certificate_files_and_watch_their_directory(pki: dict[str, str]) -> None:
    files = sds_files(parse_config(tls_doc(pki)))
    secrets = {}
    for name, text in files.items():
        (resource,) = yaml.safe_load(text)["resources"]
        assert resource["@type"] == "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
        assert name.startswith(resource["name"] + "-") and name.endswith(".yaml")
        secrets[resource["name"]] = resource
    assert set(secrets) == {
        GATEWAY_CERT_SECRET,
        GATEWAY_CLIENT_CA_SECRET,
        ENVOY_CLIENT_CERT_SECRET,
        SERVICES_CA_SECRET,
    }
    cert = secrets[GATEWAY_CERT_SECRET]["tls_certificate"]
    assert cert["certificate_chain"] == {"filename": pki["crt"]}
    assert cert["private_key"] == {"filename": pki["key"]}
    assert cert["watched_directory"] == {"path": pki["dir"]}
    assert secrets[SERVICES_CA_SECRET]["validation_context"]["trusted_ca"] == {"filename": pki["ca"]}
    assert secrets[ENVOY_CLIENT_CERT_SECRET]["tls_certificate"]["certificate_chain"] == {
        "filename": pki["client_crt"]
    }


def _upstream(cluster: cluster_pb2.Cluster) -> tls_pb2.UpstreamTlsContext:
    assert cluster.transport_socket.name == TLS_TRANSPORT_SOCKET
    ctx = tls_pb2.UpstreamTlsContext()
    assert cluster.transport_socket.typed_config.Unpack(ctx)
    return ctx


@pytest.mark.parametrize("mode", ["ext_proc", "ext_authz"])
def test_the_request_path_clusters_dial_mutual_tls(pki: dict[str, str], mode: str) -> None:
    cfg = parse_config(tls_doc(pki, mode=mode))
    clusters = {c.name: c for c in build_clusters(cfg)}
    dialled = [EXT_PROC_CLUSTER] if mode == "ext_proc" else [EXT_AUTHZ_CLUSTER, METER_CLUSTER]
    for name in dialled:
        ctx = _upstream(clusters[name])
        common = ctx.common_tls_context
        assert ctx.sni == "svc.test"
        assert _sds_names(common) == [ENVOY_CLIENT_CERT_SECRET]
        combined = common.combined_validation_context
        assert combined.validation_context_sds_secret_config.name == SERVICES_CA_SECRET
        (san,) = combined.default_validation_context.match_typed_subject_alt_names
        assert (san.san_type, san.matcher.exact) == (common_pb2.SubjectAltNameMatcher.DNS, "svc.test")
        # HTTP/2 over TLS offers h2 (RFC 7540 3.3); ext_authz's HTTP/1.1 service takes no ALPN
        assert list(common.alpn_protocols) == ([] if name == EXT_AUTHZ_CLUSTER else ["h2"])
    # the model clusters are not ours: they stay plain text
    assert not any(c.HasField("transport_socket") for n, c in clusters.items() if n not in dialled)


def test_without_a_server_name_envoy_checks_the_dialled_ip(pki: dict[str, str]) -> None:
    cfg = parse_config(tls_doc(pki, server_name=None, mode="ext_proc"))
    (cluster,) = [c for c in build_clusters(cfg) if c.name == EXT_PROC_CLUSTER]
    ctx = _upstream(cluster)
    (san,) = (
        ctx.common_tls_context.combined_validation_context.default_validation_context.match_typed_subject_alt_names
    )
    assert (san.san_type, san.matcher.exact) == (
        common_pb2.SubjectAltNameMatcher.IP_ADDRESS,
        cfg.ext_proc.listen.host,
    )
    assert ctx.sni == ""  # SNI carries host names only (RFC 6066 3)


def test_the_bootstrap_dials_the_xds_server_over_mutual_tls(pki: dict[str, str]) -> None:
    cfg = parse_config(tls_doc(pki))
    (xds,) = render_bootstrap(cfg)["static_resources"]["clusters"]
    assert xds["name"] == XDS_CLUSTER
    socket = xds["transport_socket"]
    assert socket["name"] == TLS_TRANSPORT_SOCKET
    typed = socket["typed_config"]
    assert (
        typed["@type"] == "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
    )
    assert typed["sni"] == "svc.test"
    common = typed["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    path = common["tls_certificate_sds_secret_configs"][0]["sds_config"]["path_config_source"]["path"]
    assert Path(path).name in sds_files(cfg)
    # the bootstrap round-trips through YAML as Envoy reads it
    assert yaml.safe_load(yaml.safe_dump(render_bootstrap(cfg))) == render_bootstrap(cfg)


def _sds_paths(cfg: Config) -> set[str]:
    """Every SDS file path the listener, the clusters and the bootstrap name."""
    out: set[str] = set()

    def walk(common: tls_pb2.CommonTlsContext) -> None:
        for s in (
            *common.tls_certificate_sds_secret_configs,
            common.validation_context_sds_secret_config,
            common.combined_validation_context.validation_context_sds_secret_config,
        ):
            if s.name:
                out.add(s.sds_config.path_config_source.path)

    listener_socket = build_listener(cfg).filter_chains[0].transport_socket
    if listener_socket.name:
        d = tls_pb2.DownstreamTlsContext()
        listener_socket.typed_config.Unpack(d)
        walk(d.common_tls_context)
    for c in build_clusters(cfg):
        if c.HasField("transport_socket"):
            walk(_upstream(c).common_tls_context)
    boot = render_bootstrap(cfg)["static_resources"]["clusters"][0]
    if "transport_socket" in boot:
        common = boot["transport_socket"]["typed_config"]["common_tls_context"]
        out.add(common["tls_certificate_sds_secret_configs"][0]["sds_config"]["path_config_source"]["path"])
        v = common["combined_validation_context"]["validation_context_sds_secret_config"]
        out.add(v["sds_config"]["path_config_source"]["path"])
    return out


# each example parses a config that reads its certificate files and builds every resource: no deadline
@settings(max_examples=40, deadline=None)
@given(
    gateway=st.booleans(),
    client_ca=st.booleans(),
    services=st.booleans(),
    mode=st.sampled_from(["ext_proc", "ext_authz"]),
    sds_dir=st.sampled_from(["/run/inferlb/sds", "/etc/envoy/sds", "/tmp/a b"]),
)
def test_every_sds_file_envoy_is_told_to_read_is_one_that_is_written(
    pki: dict[str, str], gateway: bool, client_ca: bool, services: bool, mode: str, sds_dir: str
) -> None:
    doc = tls_doc(pki, gateway=gateway, client_ca=client_ca, services=services, mode=mode, sds_dir=sds_dir)
    cfg = parse_config(copy.deepcopy(doc))
    written = {f"{sds_dir}/{name}" for name in sds_files(cfg)}
    assert _sds_paths(cfg) == written
    # the same config names the same files; another certificate path names another file
    assert sds_files(parse_config(copy.deepcopy(doc))) == sds_files(cfg)
    if gateway:
        doc["gateway"]["tls"]["cert_file"] = pki["client_crt"]
        doc["gateway"]["tls"]["key_file"] = pki["client_key"]
        assert set(sds_files(parse_config(doc))) != set(sds_files(cfg))


def test_the_bootstrap_verb_writes_envoys_sds_files(
    pki: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "inferlb.yaml"
    config.write_text(yaml.safe_dump(tls_doc(pki)), encoding="utf-8")
    out = tmp_path / "envoy-host" / "sds"
    assert cli.main(["bootstrap", str(config), "--sds-dir", str(out)]) == 0
    printed = capsys.readouterr()
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(sds_files(parse_config(tls_doc(pki))))
    assert all(f"wrote {out / name}" in printed.err for name in written)
    (xds,) = yaml.safe_load(printed.out)["static_resources"]["clusters"]
    assert xds["transport_socket"]["name"] == TLS_TRANSPORT_SOCKET
    # without --sds-dir nothing is written
    assert cli.main(["bootstrap", str(config)]) == 0
    assert sorted(p.name for p in out.iterdir()) == written


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_file_that_is_not_a_regular_file_is_refused_without_blocking(
    pki: dict[str, str], tmp_path: Path, kind: str
) -> None:
    """A named pipe with no writer (its open and read block for ever) or a character device (``/dev/zero``
    reads without end, filling the memory) as a certificate file is refused naming the field, at once; a
    load, a reload above all, used to hang on it."""
    if kind == "fifo":
        path = tmp_path / "cert.pipe"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    doc = tls_doc(pki)
    doc["gateway"]["tls"]["cert_file"] = str(path)
    started = time.monotonic()
    problems = _problems(doc)
    assert time.monotonic() - started < 5
    ((field, message),) = problems
    assert field == "gateway.tls.cert_file"
    assert "not a regular file" in message


def test_a_file_over_the_size_limit_is_refused(pki: dict[str, str], tmp_path: Path) -> None:
    big = tmp_path / "big.crt"
    big.write_bytes(Path(pki["crt"]).read_bytes() * (MAX_PEM_FILE_BYTES // 500))
    assert big.stat().st_size > MAX_PEM_FILE_BYTES
    doc = tls_doc(pki)
    doc["xds"]["tls"]["client_ca_file"] = str(big)
    ((field, message),) = _problems(doc)
    assert field == "xds.tls.client_ca_file"
    assert "larger than" in message


@pytest.mark.parametrize("content", ["garbled", "a key"])
def test_a_cert_file_that_holds_no_certificate_is_refused_naming_cert_file(
    pki: dict[str, str], tmp_path: Path, content: str
) -> None:
    """A ``cert_file`` whose PEM block is not a certificate (garbled base64, or the key file named twice)
    is the certificate's fault, not the key's: the error names ``cert_file`` (it named ``key_file``)."""
    bad = tmp_path / "bad.crt"
    if content == "garbled":
        bad.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n")
    else:
        bad.write_bytes(Path(pki["key"]).read_bytes())
    doc = tls_doc(pki)
    doc["gateway"]["tls"]["cert_file"] = str(bad)
    ((field, message),) = _problems(doc)
    assert field == "gateway.tls.cert_file", (field, message)
    assert "certificate" in message


def test_an_sds_dir_that_cannot_be_written_is_an_error_naming_it(
    pki: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inferlb bootstrap --sds-dir`` and ``inferlb up`` (``gateway.sds_dir``) into a directory that
    cannot be made (under a regular file; root passes a mode check, so not a mode) report it naming the
    directory and exit 1, or raise :class:`StackError`; both used to end in an OSError traceback (``up``
    after every service had been started)."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    doc = tls_doc(pki, sds_dir=str(blocker / "sds"))
    config = tmp_path / "inferlb.yaml"
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    assert cli.main(["bootstrap", str(config), "--sds-dir", str(blocker / "sds")]) == 1
    assert f"cannot write Envoy's SDS files into {blocker / 'sds'}" in capsys.readouterr().err
    stack = Stack(config, workdir=tmp_path / "work", envoy_bin="envoy")
    with pytest.raises(StackError, match=r"gateway\.sds_dir: cannot write Envoy's SDS files into"):
        stack.bootstrap_path()


def test_a_fleet_change_does_not_read_the_certificate_files_again(
    pki: dict[str, str], tmp_path: Path
) -> None:
    """A fleet change (an endpoint registered through the API, a Kubernetes discovery event, a drain's
    end) re-validates the running config with the new endpoints, but not its certificate files: they were
    checked when the config was loaded, and mid-rotation (a key renamed over before its certificate, as
    the README describes) or with a file moved away they may not load for a moment. That used to refuse
    the endpoint registration with an error about ``gateway.tls.key_file``."""
    d = tmp_path / "tls"
    d.mkdir()
    ca = CertificateAuthority("fleet CA")
    crt, key = ca.issue("gw.test").write(d, "gw")
    doc = tls_doc(pki, services=False)
    doc["gateway"]["tls"] = {"cert_file": str(crt), "key_file": str(key)}
    config = parse_config(doc)
    # mid-rotation: the new key is in place, its certificate not yet
    replace_file(key, ca.issue("gw.test").key_pem)
    endpoint = EndpointConfig.model_validate(
        {**config.endpoints[0].model_dump(mode="json"), "address": "127.0.0.1:1", "name": "registered"}
    )
    effective = effective_config(config, FleetState().register(endpoint))
    assert effective.endpoints[-1].display_name == "registered"
    assert effective.gateway.tls == config.gateway.tls
    # a config load still checks them
    with pytest.raises(ConfigError, match="key_file"):
        parse_config(doc)


@pytest.mark.parametrize("client_ca", [False, True], ids=["server-only", "client-certificates"])
def test_the_ready_banner_and_sample_curl_speak_https_when_the_gateway_serves_tls(
    pki: dict[str, str], client_ca: bool
) -> None:
    plain = parse_config(make_config_doc())
    assert describe(plain)[0].startswith(f"gateway  http://{plain.gateway.listen} ")
    assert f" http://{plain.gateway.listen}/v1/chat/completions" in sample_curl(plain)
    cfg = parse_config(tls_doc(pki, client_ca=client_ca, services=False))
    assert describe(cfg)[0].startswith(f"gateway  https://{cfg.gateway.listen} ")
    curl = sample_curl(cfg)
    assert f"--cacert {pki['crt']} " in curl
    assert f" https://{cfg.gateway.listen}/v1/chat/completions" in curl
    assert ("--cert CLIENT.crt --key CLIENT.key" in curl) == client_ca
