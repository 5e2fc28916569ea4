"""The pure Kubernetes mapping: EndpointSlices and InferencePool pods to endpoints, their states, the
inferlb.io keys, label selectors, fitting to a config; and the ``discovery.kubernetes`` config section."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from inferlb.config.schema import default_config_path, parse_config
from inferlb.errors import ConfigError
from tests.kube_emulator import recording
from xds_server.k8s_mapping import (
    Mapped,
    endpoints_from_pool,
    endpoints_from_slices,
    fit_to_config,
    merge,
    selector_matches,
)


def _objects(name: str, until: str, resource: str) -> list[dict[str, Any]]:
    """The objects of one resource after the recording's steps up to ``until`` (the emulator's state)."""
    state: dict[str, dict[str, Any]] = {}
    for mark, events in recording(name):
        for e in events:
            if e["resource"] != resource:
                continue
            key = e["object"]["metadata"]["name"]
            if e["type"] == "DELETED":
                state.pop(key, None)
            else:
                state[key] = copy.deepcopy(e["object"])
        if mark == until:
            break
    return list(state.values())


def _states(m: Mapped) -> dict[str, bool]:
    return {d.key: d.draining for d in m.endpoints}


def test_slices_initial_list_gives_one_endpoint_per_address_with_the_slice_keys() -> None:
    m = endpoints_from_slices(_objects("endpointslices.jsonl", "initial", "endpointslices"))
    assert _states(m) == {"127.0.1.1:8000": False, "127.0.1.2:8000": False, "127.0.9.9:9000": False}
    llama0 = next(d for d in m.endpoints if d.key == "127.0.1.1:8000")
    e = llama0.endpoint
    assert (e.model, e.version, e.gpu, e.zone, e.name) == (
        "llama-3.1-8b-instruct", "v1", "A100", "b", "default/llama-0:8000",
    )  # fmt: skip
    assert llama0.source == "EndpointSlice default/llama-abcde"
    # no inferlb.io/gpu-profile: the default profile
    assert next(d for d in m.endpoints if d.key == "127.0.9.9:9000").endpoint.gpu == "H100"
    assert m.problems == ()


def test_slice_terminating_or_not_ready_endpoint_is_draining() -> None:
    m = endpoints_from_slices(_objects("endpointslices.jsonl", "terminating", "endpointslices"))
    assert _states(m)["127.0.1.2:8000"] is True
    assert _states(m)["127.0.1.3:8000"] is False
    s = _objects("endpointslices.jsonl", "initial", "endpointslices")[0]
    s["endpoints"][0]["conditions"] = {"ready": False}
    s["endpoints"][1]["conditions"] = {}  # nil ready means ready
    assert _states(endpoints_from_slices([s])) == {"127.0.1.1:8000": True, "127.0.1.2:8000": False}


def test_slice_removed_endpoint_and_deleted_slice_are_gone() -> None:
    removed = endpoints_from_slices(_objects("endpointslices.jsonl", "removed", "endpointslices"))
    assert "127.0.1.2:8000" not in _states(removed)
    deleted = endpoints_from_slices(_objects("endpointslices.jsonl", "end", "endpointslices"))
    assert set(_states(deleted)) == {"127.0.1.4:8000", "127.0.9.9:9000"}


def test_slice_ports_each_an_endpoint_unless_port_name_picks_one() -> None:
    s = _objects("endpointslices.jsonl", "initial", "endpointslices")[0]
    s["ports"] = [
        {"name": "http", "port": 8000},
        {"name": "metrics", "port": 9100},
        {"port": 53, "protocol": "UDP"},
    ]
    s["endpoints"] = s["endpoints"][:1]
    assert set(_states(endpoints_from_slices([s]))) == {"127.0.1.1:8000", "127.0.1.1:9100"}
    s["metadata"]["labels"]["inferlb.io/port-name"] = "metrics"
    assert set(_states(endpoints_from_slices([s]))) == {"127.0.1.1:9100"}
    s["metadata"]["labels"]["inferlb.io/port-name"] = "grpc"
    m = endpoints_from_slices([s])
    assert m.endpoints == () and "no TCP port named 'grpc'" in m.problems[0]


def test_slice_without_model_key_or_with_fqdn_addresses_is_a_problem_not_an_endpoint() -> None:
    s = _objects("endpointslices.jsonl", "initial", "endpointslices")[0]
    del s["metadata"]["labels"]["inferlb.io/model"]
    m = endpoints_from_slices([s])
    assert m.endpoints == () and all("no inferlb.io/model" in p for p in m.problems)
    s["addressType"] = "FQDN"
    assert "not an IP family" in endpoints_from_slices([s]).problems[0]


def test_annotation_wins_over_label() -> None:
    s = _objects("endpointslices.jsonl", "initial", "endpointslices")[0]
    s["metadata"]["annotations"] = {"inferlb.io/gpu-profile": "V100"}
    assert {d.endpoint.gpu for d in endpoints_from_slices([s]).endpoints} == {"V100"}


def test_pool_selects_pods_one_endpoint_per_target_port_pod_keys_override_the_pool() -> None:
    pools = _objects("inferencepool.jsonl", "initial", "inferencepools")
    pods = _objects("inferencepool.jsonl", "initial", "pods")
    m = endpoints_from_pool(pools[0], pods)
    assert _states(m) == dict.fromkeys(
        ("127.0.2.1:8000", "127.0.2.1:8001", "127.0.2.2:8000", "127.0.2.2:8001"), False
    )
    gpus = {d.key: d.endpoint.gpu for d in m.endpoints}
    assert gpus["127.0.2.1:8000"] == "H100" and gpus["127.0.2.2:8001"] == "V100"
    assert {d.endpoint.model for d in m.endpoints} == {"qwen2.5-7b-instruct"}
    assert m.endpoints[0].endpoint.name == "default/qwen-0:8000"


def test_pool_not_ready_and_terminating_pods_are_draining_deleted_ones_gone() -> None:
    pool = _objects("inferencepool.jsonl", "initial", "inferencepools")[0]
    added = endpoints_from_pool(pool, _objects("inferencepool.jsonl", "added_not_ready", "pods"))
    assert _states(added)["127.0.2.3:8000"] is True
    ready = endpoints_from_pool(pool, _objects("inferencepool.jsonl", "ready", "pods"))
    assert _states(ready)["127.0.2.3:8000"] is False
    terminating = endpoints_from_pool(pool, _objects("inferencepool.jsonl", "terminating", "pods"))
    assert _states(terminating)["127.0.2.1:8000"] is True and _states(terminating)["127.0.2.1:8001"] is True
    deleted = endpoints_from_pool(pool, _objects("inferencepool.jsonl", "deleted", "pods"))
    assert "127.0.2.1:8000" not in _states(deleted)


def test_pool_without_ip_or_finished_pods_gives_nothing_and_other_namespaces_are_ignored() -> None:
    pool = _objects("inferencepool.jsonl", "initial", "inferencepools")[0]
    pod = _objects("inferencepool.jsonl", "initial", "pods")[0]
    pending = copy.deepcopy(pod)
    del pending["status"]["podIP"]
    done = copy.deepcopy(pod)
    done["status"]["phase"] = "Succeeded"
    elsewhere = copy.deepcopy(pod)
    elsewhere["metadata"]["namespace"] = "other"
    assert endpoints_from_pool(pool, [pending, done, elsewhere]) == Mapped()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"appProtocol": "kubernetes.io/h2c"}, "spec.appProtocol 'kubernetes.io/h2c' is not served"),
        ({"targetPorts": []}, "spec.targetPorts: expected at least one port"),
        ({"targetPorts": [{"number": 0}]}, "spec.targetPorts[0].number"),
        ({"selector": {}}, "spec.selector: expected matchLabels"),
    ],
)
def test_pool_spec_problems_name_the_field(change: dict[str, Any], problem: str) -> None:
    pool = _objects("inferencepool.jsonl", "initial", "inferencepools")[0]
    pool["spec"].update(change)
    m = endpoints_from_pool(pool, _objects("inferencepool.jsonl", "initial", "pods"))
    assert m.endpoints == () and problem in m.problems[0]


def test_selector_match_labels_and_expressions() -> None:
    labels = {"app": "qwen", "tier": "gpu"}
    assert selector_matches({"matchLabels": {"app": "qwen"}}, labels)
    assert not selector_matches({"matchLabels": {"app": "web"}}, labels)
    assert selector_matches(
        {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu"]}]}, labels
    )
    assert not selector_matches(
        {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gpu"]}]}, labels
    )
    assert selector_matches({"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "x", "operator": "Exists"}]}, labels)
    assert not selector_matches(
        {"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]}, labels
    )
    assert not selector_matches(None, labels)


def test_merge_prefers_a_serving_copy_of_an_address() -> None:
    s = _objects("endpointslices.jsonl", "initial", "endpointslices")[0]
    moving = copy.deepcopy(s)
    moving["metadata"]["name"] = "llama-new"
    s["endpoints"][0]["conditions"] = {"ready": False, "terminating": True}
    m = merge([endpoints_from_slices([s]), endpoints_from_slices([moving])])
    assert _states(m)["127.0.1.1:8000"] is False
    assert [d.key for d in m.endpoints] == sorted(d.key for d in m.endpoints)


def _config(**changes: Any) -> Any:
    doc = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    doc.update(changes)
    return parse_config(doc)


def test_fit_to_config_keeps_what_the_config_serves_and_names_the_key_at_fault() -> None:
    s = _objects("endpointslices.jsonl", "initial", "endpointslices")
    m = endpoints_from_slices(s)
    fitted = fit_to_config(m, _config())
    # llama has two versions: the slice without inferlb.io/version is refused
    assert {d.key for d in fitted.endpoints} == {"127.0.1.1:8000", "127.0.1.2:8000"}
    assert any(
        "inferlb.io/version: model 'llama-3.1-8b-instruct' has several versions" in p for p in fitted.problems
    )
    s[0]["metadata"]["labels"].update({"inferlb.io/model": "nope", "inferlb.io/gpu-profile": "H100"})
    s[1]["metadata"]["labels"].update({"inferlb.io/version": "v9"})
    problems = fit_to_config(endpoints_from_slices(s), _config()).problems
    assert any("inferlb.io/model 'nope' is not in models" in p for p in problems)
    assert any("inferlb.io/version 'v9' is not a version" in p for p in problems)
    s = _objects("endpointslices.jsonl", "initial", "endpointslices")[:1]
    s[0]["metadata"]["labels"]["inferlb.io/gpu-profile"] = "TPU"
    assert (
        "inferlb.io/gpu-profile 'TPU' is not in gpu_profiles"
        in fit_to_config(endpoints_from_slices(s), _config()).problems[0]
    )


def test_fit_to_config_leaves_the_file_entry_at_a_shared_address() -> None:
    s = _objects("endpointslices.jsonl", "initial", "endpointslices")[:1]
    s[0]["endpoints"][0]["addresses"] = ["127.0.0.1"]
    s[0]["ports"] = [{"port": 8001}]
    fitted = fit_to_config(endpoints_from_slices(s), _config())
    assert "127.0.0.1:8001" not in {d.key for d in fitted.endpoints}
    assert any("already in the config file's endpoints" in p for p in fitted.problems)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"namespace": "Bad_NS", "services": ["llama"]}, "discovery.kubernetes.namespace"),
        ({"services": ["llama"], "kubeconfig": "/k", "in_cluster": True}, "discovery.kubernetes"),
        ({}, "discovery.kubernetes"),
        ({"services": ["llama", "llama"]}, "discovery.kubernetes.services"),
        ({"services": ["llama"], "backoff_base_ms": 0}, "discovery.kubernetes.backoff_base_ms"),
        ({"services": ["llama"], "watch": True}, "discovery.kubernetes.watch"),
    ],
)
def test_discovery_config_errors_name_the_field(section: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(discovery={"kubernetes": section})
    assert field in {f for f, _ in err.value.problems}, err.value.problems


def test_discovery_config_defaults() -> None:
    k = _config(discovery={"kubernetes": {"inference_pools": ["qwen-pool"]}}).discovery.kubernetes
    assert k is not None
    assert (k.namespace, k.services, k.kubeconfig, k.in_cluster) == ("default", (), None, False)
    assert _config().discovery.kubernetes is None
