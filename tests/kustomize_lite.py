"""Render a kustomization the way ``kustomize build`` does, for the features deploy/kubernetes uses, when
neither ``kustomize`` nor ``kubectl`` is installed: ``resources`` (files and other kustomizations),
``namespace``, ``labels`` (``pairs`` on ``metadata.labels`` only), ``configMapGenerator`` (``files``, with a
content-hash name suffix that the pods' ``configMap`` volumes are renamed to), ``replicas`` and ``images``.
Anything else in a kustomization is refused, so a manifest using more cannot pass on this loader alone.

:func:`render` prefers the real tool (``kustomize build``, else ``kubectl kustomize``); tests compare the
two where the tool exists (the hash suffixes aside: kustomize's own hash is not reproduced here).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

#: The kustomization fields this loader understands.
KNOWN_FIELDS = frozenset(
    {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator", "replicas", "images"}
)

#: Kinds whose objects carry no namespace.
CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"})


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects of the kustomization in ``directory``: ``kustomize build`` or ``kubectl kustomize``
    when on PATH, else :func:`load`.

    Raises:
        subprocess.CalledProcessError: the tool refused the kustomization.
        ValueError: (this loader) a kustomization field it does not understand."""
    for cmd in (["kustomize", "build"], ["kubectl", "kustomize"]):
        if shutil.which(cmd[0]):
            return render_with(cmd, directory)
    return load(directory)


def render_with(cmd: list[str], directory: Path) -> list[dict[str, Any]]:
    """``cmd + [directory]``'s output, one dict per object."""
    out = subprocess.run([*cmd, str(directory)], check=True, capture_output=True, text=True, timeout=120)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _images(objects: list[dict[str, Any]], images: list[dict[str, str]]) -> None:
    by_name = {i["name"]: i for i in images}
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            name, _, tag = c["image"].partition(":")
            if (rule := by_name.get(name)) is not None:
                c["image"] = f"{rule.get('newName', name)}:{rule.get('newTag', tag)}"


def load(directory: Path) -> list[dict[str, Any]]:
    """The objects of ``directory/kustomization.yaml``, rendered by this module.

    Raises:
        ValueError: a field outside :data:`KNOWN_FIELDS`, or a generator option it does not know."""
    return _load(directory)[0]


def _load(directory: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """:func:`load`'s objects and the generated ConfigMaps' renames (name -> hashed name), those of the
    kustomizations it includes too: as in kustomize, an object of an overlay that mounts a ConfigMap its
    base generates gets the hashed name."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this loader does not render: {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    renames: dict[str, str] = {}
    for res in k.get("resources", []):
        path = directory / res
        if path.is_dir():
            included, their_renames = _load(path)
            objects += included
            renames |= their_renames
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    for gen in k.get("configMapGenerator", []):
        if set(gen) - {"name", "files"}:
            raise ValueError(f"{directory}: configMapGenerator options not rendered here: {sorted(gen)}")
        data = {}
        for f in gen["files"]:
            key, _, src = f.partition("=")
            data[key] = (directory / (src or key)).read_text(encoding="utf-8")
        digest = hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest()[:10]
        renames[gen["name"]] = f"{gen['name']}-{digest}"
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": renames[gen["name"]]},
                "data": data,
            }
        )
    for obj in objects:
        meta = obj.setdefault("metadata", {})
        if "namespace" in k and obj["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = k["namespace"]
        for rule in k.get("labels", []):
            if set(rule) - {"pairs"}:
                raise ValueError(f"{directory}: labels options not rendered here: {sorted(rule)}")
            meta.setdefault("labels", {}).update(rule["pairs"])
        for v in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] in renames:
                v["configMap"]["name"] = renames[v["configMap"]["name"]]
        for sub in obj.get("subjects", []):
            if sub.get("kind") == "ServiceAccount" and "namespace" in k:
                sub.setdefault("namespace", k["namespace"])
    counts = {r["name"]: r["count"] for r in k.get("replicas", [])}
    for obj in objects:
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] in counts:
            obj["spec"]["replicas"] = counts[obj["metadata"]["name"]]
    _images(objects, k.get("images", []))
    return objects, renames
