"""Kubernetes objects to inferlb endpoints: EndpointSlices of a Service, and the pods an ``InferencePool``
selects. Pure: JSON objects (as the API server serves them, camelCase) in, endpoints out.

Which model, version and GPU profile an endpoint serves comes from these keys (labels or annotations;
an annotation wins over a label of the same key):

- ``inferlb.io/model`` (required): the config's ``models[].name``;
- ``inferlb.io/version``: one of that model's ``versions[].name`` (needed when it has several);
- ``inferlb.io/gpu-profile``: a ``gpu_profiles`` key (default :data:`DEFAULT_GPU_PROFILE`);
- ``inferlb.io/port-name`` (EndpointSlices only): serve only the slice port of this name (default:
  every TCP port).

For an EndpointSlice they are read from the slice (the EndpointSlice controller copies the Service's labels
onto its slices; annotations are not copied, so set the keys as Service labels, or annotate the slices you
write yourself). For an ``InferencePool`` they are read from the pool, and a selected pod's own labels or
annotations override the pool's (a pool of mixed GPUs labels each pod's ``inferlb.io/gpu-profile``).

States follow Kubernetes' own (``discovery.k8s.io/v1`` ``EndpointConditions``; ``core/v1`` Pod):

- an EndpointSlice endpoint with ``conditions.terminating: true`` or ``conditions.ready: false`` is
  DRAINING (``serving: true`` while terminating is still DRAINING: no new requests);
- a pod with ``metadata.deletionTimestamp`` or without the ``Ready`` condition ``True`` is DRAINING; a pod
  with no ``status.podIP`` (not scheduled yet) or in phase ``Succeeded``/``Failed`` is no endpoint;
- an ``InferencePool`` gives one endpoint per pod per ``spec.targetPorts[].number``; its
  ``spec.appProtocol`` must be ``http`` or unset (inferlb's upstreams speak HTTP/1.1).

Bad objects never stop the others: each problem is reported in :attr:`Mapped.problems` and that object (or
endpoint) is left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from inferlb.config.schema import Config, EndpointConfig

MODEL_KEY: Final = "inferlb.io/model"
VERSION_KEY: Final = "inferlb.io/version"
GPU_PROFILE_KEY: Final = "inferlb.io/gpu-profile"
PORT_NAME_KEY: Final = "inferlb.io/port-name"
#: The label the EndpointSlice controller sets to the owning Service's name.
SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
#: The GPU profile of an endpoint that names none (a ``gpu_profiles`` key built into the schema).
DEFAULT_GPU_PROFILE: Final = "H100"
#: ``InferencePool.spec.appProtocol`` values inferlb can serve (unset means ``http`` in GIE v1).
HTTP_PROTOCOLS: Final = frozenset({"http"})


@dataclass(frozen=True)
class Discovered:
    """One discovered endpoint.

    Attributes:
        endpoint: in the config file's endpoint shape (``name`` is ``namespace/pod:port``).
        draining: True: sent to Envoy as DRAINING (terminating or not ready).
        source: the object it came from, e.g. ``EndpointSlice default/llama-abcde``.
    """

    endpoint: EndpointConfig
    draining: bool
    source: str

    @property
    def key(self) -> str:
        """``host:port``, as :func:`xds_server.resources.endpoints.endpoint_key` names endpoints."""
        return str(self.endpoint.address)


@dataclass(frozen=True)
class Mapped:
    """Endpoints in a stable order (by address) and the problems of the objects left out."""

    endpoints: tuple[Discovered, ...] = ()
    problems: tuple[str, ...] = ()


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): str(v) for k, v in value.items()}


def object_keys(obj: Mapping[str, Any]) -> dict[str, str]:
    """An object's labels with its annotations on top (the inferlb.io keys may be either)."""
    meta = _meta(obj)
    return {**_str_map(meta.get("labels")), **_str_map(meta.get("annotations"))}


def object_name(obj: Mapping[str, Any]) -> str:
    """``namespace/name`` of an object (``?`` for a missing part)."""
    meta = _meta(obj)
    return f"{meta.get('namespace') or '?'}/{meta.get('name') or '?'}"


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@dataclass
class _Found:
    """Endpoints and problems as a mapping function finds them."""

    endpoints: list[Discovered]
    problems: list[str]

    def add(
        self, keys: Mapping[str, str], address: str, *, name: str, zone: str | None, where: str, detail: str,
        draining: bool,
    ) -> None:  # fmt: skip
        """Add the endpoint at ``address`` the inferlb.io ``keys`` describe, or the problem."""
        made = _endpoint(keys, address, name=name, zone=zone, where=where + detail)
        if isinstance(made, str):
            self.problems.append(made)
        else:
            self.endpoints.append(Discovered(made, draining, where))

    def mapped(self) -> Mapped:
        return _merged(self.endpoints, self.problems)


def _endpoint(
    keys: Mapping[str, str], address: str, *, name: str, zone: str | None, where: str
) -> EndpointConfig | str:
    """An endpoint from the inferlb.io keys, or the problem (a string naming the key at fault)."""
    model = keys.get(MODEL_KEY)
    if not model:
        return f"{where}: no {MODEL_KEY} label or annotation"
    doc: dict[str, Any] = {
        "address": address,
        "model": model,
        "version": keys.get(VERSION_KEY) or None,
        "gpu": keys.get(GPU_PROFILE_KEY) or DEFAULT_GPU_PROFILE,
        "name": name,
    }
    if zone:
        doc["zone"] = zone
    try:
        return EndpointConfig.model_validate(doc)
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return f"{where}: {detail}"


def _valid_port(value: Any) -> int | None:
    return value if type(value) is int and 1 <= value <= 65535 else None


def endpoints_from_slices(slices: Iterable[Mapping[str, Any]]) -> Mapped:
    """The endpoints of EndpointSlices (``discovery.k8s.io/v1``): one per address per served port.

    Ports: the slice's ``ports`` of protocol TCP (unset means TCP), only the one named by
    ``inferlb.io/port-name`` when the slice sets it. Addresses: every ``endpoints[].addresses`` entry.
    States: module docstring.
    """
    found = _Found([], [])
    problems = found.problems
    for s in slices:
        where = f"EndpointSlice {object_name(s)}"
        keys = object_keys(s)
        if s.get("addressType") not in (None, "IPv4", "IPv6"):
            problems.append(f"{where}: addressType {s.get('addressType')!r} is not an IP family")
            continue
        wanted = keys.get(PORT_NAME_KEY)
        ports: list[int] = []
        for p in s.get("ports") or ():
            if not isinstance(p, Mapping) or (p.get("protocol") or "TCP") != "TCP":
                continue
            if wanted is not None and p.get("name") != wanted:
                continue
            number = _valid_port(p.get("port"))
            if number is not None:
                ports.append(number)
        if not ports:
            named = f" named {wanted!r}" if wanted is not None else ""
            if s.get("endpoints"):
                problems.append(f"{where}: no TCP port{named} in ports")
            continue
        for i, e in enumerate(s.get("endpoints") or ()):
            if not isinstance(e, Mapping):
                continue
            cond = e.get("conditions") if isinstance(e.get("conditions"), Mapping) else {}
            assert isinstance(cond, Mapping)
            # v1: a nil ready means ready, a nil terminating means not terminating
            draining = cond.get("terminating") is True or cond.get("ready") is False
            ref = e.get("targetRef") if isinstance(e.get("targetRef"), Mapping) else None
            namespace = _meta(s).get("namespace") or "?"
            zone = e.get("zone") if isinstance(e.get("zone"), str) else None
            for ip in e.get("addresses") or ():
                for port in ports:
                    who = ref.get("name") if ref is not None and ref.get("name") else ip
                    found.add(keys, _host_port(str(ip), port), name=f"{namespace}/{who}:{port}", zone=zone,
                              where=where, detail=f" endpoints[{i}]", draining=draining)  # fmt: skip
    return found.mapped()


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` match a ``LabelSelector`` (``matchLabels``, and ``matchExpressions`` with
    operators ``In``, ``NotIn``, ``Exists``, ``DoesNotExist``; ``k8s.io/apimachinery`` semantics, where an
    empty selector matches everything). An unknown operator matches nothing.

    GIE v1 ``InferencePool.spec.selector`` is ``{matchLabels: {...}}``; the expressions are accepted too.
    """
    if selector is None:
        return False
    for k, v in _str_map(selector.get("matchLabels")).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or ():
        if not isinstance(expr, Mapping):
            return False
        key, op = str(expr.get("key")), expr.get("operator")
        values = {str(v) for v in expr.get("values") or ()}
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    assert isinstance(status, Mapping)
    for c in status.get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def endpoints_from_pool(pool: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> Mapped:
    """The endpoints of an ``InferencePool`` (GIE ``inference.networking.k8s.io/v1``): each pod in the
    pool's namespace that ``spec.selector`` matches, one endpoint per ``spec.targetPorts[].number``.
    States and keys: module docstring.
    """
    where = f"InferencePool {object_name(pool)}"
    spec = pool.get("spec") if isinstance(pool.get("spec"), Mapping) else None
    if spec is None:
        return Mapped(problems=(f"{where}: no spec",))
    protocol = spec.get("appProtocol")
    if protocol is not None and protocol not in HTTP_PROTOCOLS:
        return Mapped(problems=(f"{where}: spec.appProtocol {protocol!r} is not served (only 'http')",))
    selector = spec.get("selector")
    if not isinstance(selector, Mapping) or not (
        selector.get("matchLabels") or selector.get("matchExpressions")
    ):
        return Mapped(problems=(f"{where}: spec.selector: expected matchLabels",))
    ports: list[int] = []
    for i, p in enumerate(spec.get("targetPorts") or ()):
        number = _valid_port(p.get("number")) if isinstance(p, Mapping) else None
        if number is None:
            return Mapped(problems=(f"{where}: spec.targetPorts[{i}].number: expected 1..65535",))
        ports.append(number)
    if not ports:
        return Mapped(problems=(f"{where}: spec.targetPorts: expected at least one port",))
    pool_ns = _meta(pool).get("namespace")
    pool_keys = object_keys(pool)
    found = _Found([], [])
    for pod in pods:
        meta = _meta(pod)
        if meta.get("namespace") != pool_ns or not selector_matches(selector, _str_map(meta.get("labels"))):
            continue
        status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
        assert isinstance(status, Mapping)
        ip = status.get("podIP")
        if not ip or status.get("phase") in ("Succeeded", "Failed"):
            continue
        draining = bool(meta.get("deletionTimestamp")) or not _pod_ready(pod)
        keys = {**pool_keys, **object_keys(pod)}
        for port in ports:
            found.add(keys, _host_port(str(ip), port), name=f"{object_name(pod)}:{port}", zone=None,
                      where=where, detail=f" pod {object_name(pod)}", draining=draining)  # fmt: skip
    return found.mapped()


def _merged(endpoints: Sequence[Discovered], problems: Sequence[str]) -> Mapped:
    """One endpoint per address, sorted by address: a serving copy wins over a draining one (a pod listed
    by two slices while it moves), else the first."""
    by_key: dict[str, Discovered] = {}
    for d in endpoints:
        seen = by_key.get(d.key)
        if seen is None or (seen.draining and not d.draining):
            by_key[d.key] = d
    return Mapped(tuple(by_key[k] for k in sorted(by_key)), tuple(problems))


def merge(parts: Iterable[Mapped]) -> Mapped:
    """Several sources' endpoints as one (:func:`_merged` rules), their problems concatenated."""
    endpoints: list[Discovered] = []
    problems: list[str] = []
    for m in parts:
        endpoints.extend(m.endpoints)
        problems.extend(m.problems)
    return _merged(endpoints, problems)


def fit_to_config(mapped: Mapped, config: Config) -> Mapped:
    """The discovered endpoints ``config`` can serve, the others as problems: the model must be one of
    ``models[].name``, the version one of its ``versions`` (named when it has several), the GPU profile a
    ``gpu_profiles`` key, and the address not already one of the file's ``endpoints`` (the file wins)."""
    models = {m.name: m for m in config.models}
    listed = {str(e.address) for e in config.endpoints}
    kept: list[Discovered] = []
    problems = list(mapped.problems)
    for d in mapped.endpoints:
        e, why = d.endpoint, ""
        model = models.get(e.model)
        versions = [v.name for v in model.versions] if model is not None else []
        if model is None:
            why = f"{MODEL_KEY} {e.model!r} is not in models (known: {sorted(models)})"
        elif e.version is not None and e.version not in versions:
            why = f"{VERSION_KEY} {e.version!r} is not a version of {e.model!r} (known: {versions})"
        elif e.version is None and len(versions) > 1:
            why = f"{VERSION_KEY}: model {e.model!r} has several versions; name one"
        elif e.gpu not in config.gpu_profiles:
            why = f"{GPU_PROFILE_KEY} {e.gpu!r} is not in gpu_profiles (known: {sorted(config.gpu_profiles)})"
        elif d.key in listed:
            why = f"{d.key} is already in the config file's endpoints (the file's entry is served)"
        if why:
            problems.append(f"{d.source} {e.name}: {why}")
        else:
            kept.append(d)
    return Mapped(tuple(kept), tuple(problems))
