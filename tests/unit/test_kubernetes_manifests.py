"""deploy/kubernetes: every rendered object is a valid Kubernetes object (``kubernetes-validate``, strict),
every reference resolves (ConfigMaps, volume claims, ServiceAccounts, Roles, Service selectors and named
ports, probes, PDB and HPA targets), and the inferlb config of the ConfigMap is one inferlb loads, whose
advertised addresses, Redis and endpoints are Services of the same render."""

from __future__ import annotations

import copy
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inferlb.config.schema import Config, HostPort, check_advertise_flag, parse_config
from tests import kustomize_lite
from xds_server.bootstrap import render_bootstrap

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
BASE = ROOT / "base"
OVERLAY = ROOT / "overlays" / "vllm-example"
#: The Kubernetes version the objects are validated against (its OpenAPI schemas ship with the package).
K8S_VERSION = "1.32"
WORKLOADS = frozenset({"Deployment", "StatefulSet", "DaemonSet"})

Obj = dict[str, Any]


@pytest.fixture(scope="module", params=[BASE, OVERLAY], ids=["base", "vllm-example"])
def objects(request: pytest.FixtureRequest) -> list[Obj]:
    return kustomize_lite.render(request.param)


@pytest.fixture(scope="module")
def overlay() -> list[Obj]:
    return kustomize_lite.render(OVERLAY)


def _by_kind(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _pod(obj: Obj) -> Obj:
    return obj["spec"]["template"]  # type: ignore[no-any-return]


def _containers(obj: Obj) -> list[Obj]:
    spec = _pod(obj)["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _config(objs: list[Obj]) -> Config:
    [cm] = [
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("inferlb-config")
    ]
    return parse_config(yaml.safe_load(cm["data"]["config.yaml"]), "inferlb-config/config.yaml")


def test_every_object_is_valid_for_kubernetes(objects: list[Obj]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_refuses_a_misspelt_field(objects: list[Obj]) -> None:
    bad = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_every_namespaced_object_is_in_the_namespace(objects: list[Obj]) -> None:
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "inferlb", obj["metadata"]["name"]


def test_mounted_configmaps_claims_and_service_accounts_exist(objects: list[Obj]) -> None:
    cms, pvcs = _by_kind(objects, "ConfigMap"), _by_kind(objects, "PersistentVolumeClaim")
    sas = _by_kind(objects, "ServiceAccount")
    for w in (o for o in objects if o["kind"] in WORKLOADS):
        spec = _pod(w)["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in cms, (w["metadata"]["name"], v)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, (w["metadata"]["name"], v)
        for c in _containers(w):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (w["metadata"]["name"], c["name"], m)
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or ref.get("optional") is True, (c["name"], e)  # no Secret shipped
        if "serviceAccountName" in spec:
            assert spec["serviceAccountName"] in sas


def test_the_discovery_role_reads_what_discovery_needs(objects: list[Obj]) -> None:
    [role] = _by_kind(objects, "Role").values()
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    for group, resource in [
        ("discovery.k8s.io", "endpointslices"),
        ("", "pods"),
        ("inference.networking.k8s.io", "inferencepools"),
    ]:
        assert {(group, resource, "list"), (group, resource, "watch")} <= granted
    assert not {v for _, _, v in granted} - {"get", "list", "watch"}  # read only
    [binding] = _by_kind(objects, "RoleBinding").values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    [subject] = binding["subjects"]
    assert subject["name"] in _by_kind(objects, "ServiceAccount")
    assert subject["namespace"] == "inferlb"


def _selected(objects: list[Obj], selector: dict[str, str]) -> list[Obj]:
    return [
        w
        for w in objects
        if w["kind"] in WORKLOADS and selector.items() <= _pod(w)["metadata"].get("labels", {}).items()
    ]


def _port_names(workloads: list[Obj]) -> set[str]:
    return {p["name"] for w in workloads for c in _containers(w) for p in c.get("ports", []) if "name" in p}


def test_services_select_pods_and_their_named_ports(objects: list[Obj]) -> None:
    for name, svc in _by_kind(objects, "Service").items():
        pods = _selected(objects, svc["spec"]["selector"])
        assert pods, f"Service {name} selects no pod template"
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            if isinstance(target, str):
                assert target in _port_names(pods), (name, p)


def test_workload_selectors_probes_and_requests(objects: list[Obj]) -> None:
    for w in (o for o in objects if o["kind"] in WORKLOADS):
        labels = _pod(w)["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for c in _pod(w)["spec"]["containers"]:
            names = {p["name"] for p in c.get("ports", [])}
            assert "readinessProbe" in c and "livenessProbe" in c, (w["metadata"]["name"], c["name"])
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(kind, {})
                for action in ("httpGet", "tcpSocket"):
                    port = probe.get(action, {}).get("port")
                    assert not isinstance(port, str) or port in names, (c["name"], kind, port)
        for c in _containers(w):
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), c["name"]


def test_disruption_budgets_and_the_autoscaler_have_targets(overlay: list[Obj]) -> None:
    pdbs = _by_kind(overlay, "PodDisruptionBudget")
    for name, pdb in pdbs.items():
        assert _selected(overlay, pdb["spec"]["selector"]["matchLabels"]), name
    for name in ("inferlb-xds", "inferlb-request-path", "inferlb-envoy", "vllm-llama-h100"):
        assert name in pdbs
    [hpa] = _by_kind(overlay, "HorizontalPodAutoscaler").values()
    ref = hpa["spec"]["scaleTargetRef"]
    assert ref["name"] in _by_kind(overlay, ref["kind"])
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["target"]["averageValue"] == "70"


def test_the_overlay_sets_replicas_and_images(overlay: list[Obj]) -> None:
    deps = _by_kind(overlay, "Deployment")
    assert deps["inferlb-request-path"]["spec"]["replicas"] == 4
    assert deps["inferlb-xds"]["spec"]["replicas"] == 2
    images = {c["image"] for d in deps.values() for c in _containers(d)}
    assert "registry.example.com/inferlb:0.1.0" in images and "inferlb:dev" not in images


def _service_at(objects: list[Obj], hp: HostPort) -> Obj:
    m = re.fullmatch(r"(?P<svc>[a-z0-9-]+)\.(?P<ns>[a-z0-9-]+)\.svc\.cluster\.local", hp.host)
    assert m is not None, f"{hp} is not a Service DNS name"
    assert m["ns"] == "inferlb"
    svc = _by_kind(objects, "Service")[m["svc"]]
    assert hp.port in {p["port"] for p in svc["spec"]["ports"]}, hp
    return svc


def test_the_config_loads_and_advertises_services_of_the_render(overlay: list[Obj]) -> None:
    config = _config(overlay)
    for bind in (config.xds.listen, config.ext_proc.listen, config.gateway.listen):
        assert bind.is_unspecified  # every interface of the pod
    xds = config.xds.dial_address()
    assert isinstance(xds, HostPort)
    assert _service_at(overlay, xds)["metadata"]["name"] == "inferlb-xds"
    api = config.xds.api_dial_address()
    assert api is not None and _service_at(overlay, api)["metadata"]["name"] == "inferlb-xds"
    [request_path] = config.ext_proc.dial_addresses()
    assert isinstance(request_path, HostPort)
    svc = _service_at(overlay, request_path)
    assert svc["spec"]["clusterIP"] == "None"  # headless: Envoy's STRICT_DNS sees every pod
    for url in (config.ext_proc.redis_url, config.xds.state_redis_url):
        m = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", url or "")
        assert m is not None, url
        assert (
            _service_at(overlay, HostPort(host=m[1], port=int(m[2])))["metadata"]["name"] == "inferlb-redis"
        )
    for e in config.endpoints:
        pods = _selected(overlay, _service_at(overlay, e.address)["spec"]["selector"])
        labels = _pod(pods[0])["metadata"]["labels"]
        assert labels["inferlb.io/model"] == e.model
        assert labels["inferlb.io/version"] in {
            v.name for m in config.models if m.name == e.model for v in m.versions
        }
        assert labels["inferlb.io/gpu-profile"] == e.gpu and e.gpu in config.gpu_profiles


def _flag(container: Obj, name: str) -> str:
    args = container["args"]
    return str(args[args.index(name) + 1])


def test_the_services_flags_agree_with_the_config(overlay: list[Obj]) -> None:
    config = _config(overlay)
    deps = _by_kind(overlay, "Deployment")
    [xds] = _pod(deps["inferlb-xds"])["spec"]["containers"]
    assert HostPort.model_validate(_flag(xds, "--listen")) == config.xds.listen
    check_advertise_flag(
        HostPort.model_validate(_flag(xds, "--advertise")), (config.xds.dial_address(),), "x"
    )
    [rp] = _pod(deps["inferlb-request-path"])["spec"]["containers"]
    assert rp["args"][0] == config.ext_proc.protocol  # python -m ext_proc
    assert HostPort.model_validate(_flag(rp, "--listen")) == config.ext_proc.listen
    check_advertise_flag(
        HostPort.model_validate(_flag(rp, "--advertise")), config.ext_proc.dial_addresses(), "x"
    )
    for container in _containers(deps["inferlb-xds"]) + _containers(deps["inferlb-request-path"]):
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert str(Path(_flag(container, "--config")).parent) in mounts


def test_envoy_renders_its_bootstrap_with_the_projects_renderer(overlay: list[Obj]) -> None:
    config = _config(overlay)
    envoy = _by_kind(overlay, "Deployment")["inferlb-envoy"]
    [init] = _pod(envoy)["spec"]["initContainers"]
    words = shlex.split(init["args"][0])
    assert words[:4] == ["python", "-m", "inferlb", "bootstrap"]
    config_path, out = Path(words[4]), Path(words[-1])
    mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    assert mounts[str(config_path.parent)] == "config" and mounts[str(out.parent)] == "bootstrap"
    [proxy] = _pod(envoy)["spec"]["containers"]
    assert _flag(proxy, "-c") == str(out)
    assert {m["name"] for m in proxy["volumeMounts"]} == {"bootstrap"}
    # what that command writes: the xDS cluster dials xds.advertise, the inferlb-xds Service
    b = render_bootstrap(config, node_id="inferlb-envoy-abc")
    [cluster] = b["static_resources"]["clusters"]
    sa = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"
    ]
    svc = _service_at(overlay, HostPort(host=sa["address"], port=sa["port_value"]))
    assert svc["metadata"]["name"] == "inferlb-xds" and cluster["type"] == "LOGICAL_DNS"
    admin = {p["containerPort"] for p in proxy["ports"] if p["name"] == "http-admin"}
    assert admin == {config.gateway.admin.port}


def test_the_gateway_service_keeps_client_addresses(overlay: list[Obj]) -> None:
    config = _config(overlay)
    gw = _by_kind(overlay, "Service")["inferlb-gateway"]
    assert gw["spec"]["type"] == "LoadBalancer"
    assert gw["spec"]["externalTrafficPolicy"] == "Local"
    envoy = _by_kind(overlay, "Deployment")["inferlb-envoy"]
    [port] = gw["spec"]["ports"]
    [proxy] = _pod(envoy)["spec"]["containers"]
    assert {p["containerPort"] for p in proxy["ports"] if p["name"] == port["targetPort"]} == {
        config.gateway.listen.port
    }


@pytest.mark.skipif(
    not (shutil.which("kustomize") or shutil.which("kubectl")),
    reason="neither kustomize nor kubectl installed",
)
@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "vllm-example"])
def test_the_small_loader_renders_what_kustomize_renders(directory: Path) -> None:
    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    def unhashed(objs: list[Obj]) -> str:
        text = yaml.safe_dump(sorted(objs, key=key), sort_keys=True)
        return re.sub(r"inferlb-config-[a-z0-9]{10}", "inferlb-config-HASH", text)

    tool = ["kustomize", "build"] if shutil.which("kustomize") else ["kubectl", "kustomize"]
    assert unhashed(kustomize_lite.load(directory)) == unhashed(kustomize_lite.render_with(tool, directory))
