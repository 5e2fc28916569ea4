"""The narrow seam between Kubernetes discovery and the API server: list and watch one resource kind in
one namespace, objects as plain JSON dicts. :class:`KubeApi` is what :mod:`xds_server.k8s_discovery`
needs; :class:`LightkubeApi` is it over lightkube's async client.

Why lightkube: it is maintained, async (httpx), and hands back an object's JSON as the API server sent
it for custom resources (``InferencePool`` needs no generated model); its list exposes the collection's
``resourceVersion`` and its watch takes one, and it reads kubeconfig files and the in-cluster service
account. kubernetes-asyncio would do too, but its generated models would have to be turned back into
camelCase dicts for the pure mapping (:mod:`xds_server.k8s_mapping`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import httpx2 as httpx
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice

from inferlb.config.schema import KubernetesDiscovery


@dataclass(frozen=True)
class Kind:
    """A resource kind: ``group/version`` and plural, as its API path names it."""

    group: str
    version: str
    kind: str
    plural: str


ENDPOINT_SLICES: Final = Kind("discovery.k8s.io", "v1", "EndpointSlice", "endpointslices")
PODS: Final = Kind("", "v1", "Pod", "pods")
INFERENCE_POOLS: Final = Kind("inference.networking.k8s.io", "v1", "InferencePool", "inferencepools")


class WatchGone(Exception):
    """The API server no longer has the requested ``resourceVersion`` (HTTP 410 Gone): list again."""


class KubeUnavailable(Exception):
    """The API server could not be reached or answered an error other than 410 (the reason in the text)."""


class KubeApi(Protocol):
    """List and watch one kind in one namespace.

    Errors: :class:`WatchGone` for a 410 (from ``list`` or in a watch stream), :class:`KubeUnavailable` for
    anything else that failed (connection refused or dropped, a 5xx, 403, 404).
    """

    async def list(
        self, kind: Kind, namespace: str, label_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """Every object of ``kind`` matching the selector, and the list's ``metadata.resourceVersion``."""
        ...

    def watch(
        self, kind: Kind, namespace: str, resource_version: str, label_selector: str | None = None
    ) -> AsyncGenerator[tuple[str, dict[str, Any]]]:
        """``(type, object)`` events after ``resource_version``: ``ADDED``, ``MODIFIED``, ``DELETED``,
        ``BOOKMARK``. Ends when the server ends the stream cleanly (the caller watches again from the
        last version it saw)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


_POOL: Any = create_namespaced_resource(
    INFERENCE_POOLS.group, INFERENCE_POOLS.version, INFERENCE_POOLS.kind, INFERENCE_POOLS.plural
)
_RESOURCES: Final[dict[Kind, Any]] = {ENDPOINT_SLICES: EndpointSlice, PODS: Pod, INFERENCE_POOLS: _POOL}


def _as_dict(obj: Any) -> dict[str, Any]:
    out = obj.to_dict()
    assert isinstance(out, dict)
    return out


def _failure(exc: BaseException) -> Exception:
    if isinstance(exc, ApiError):
        if exc.status.code == 410:
            return WatchGone(str(exc.status.message or "410 Gone"))
        return KubeUnavailable(f"HTTP {exc.status.code}: {exc.status.message}")
    return KubeUnavailable(f"{type(exc).__name__}: {exc}")


def kube_config(settings: KubernetesDiscovery) -> KubeConfig:
    """The lightkube config ``discovery.kubernetes`` names: its ``kubeconfig`` file, the in-cluster
    service account, or ``$KUBECONFIG`` / ``~/.kube/config``.

    Raises:
        KubeUnavailable: the file or the service account cannot be read.
    """
    try:
        if settings.in_cluster:
            return KubeConfig.from_service_account()
        if settings.kubeconfig is not None:
            return KubeConfig.from_file(Path(settings.kubeconfig).expanduser())
        return KubeConfig.from_env()
    except Exception as exc:  # lightkube raises ConfigError, OSError, yaml errors
        raise KubeUnavailable(f"cannot read Kubernetes credentials: {exc}") from None


class LightkubeApi:
    """:class:`KubeApi` over ``lightkube.AsyncClient``.

    Args:
        config: where the API server is and how to authenticate (:func:`kube_config`).
        timeout_s: connect and read timeout of list calls (s); watches have no read timeout.
    """

    def __init__(self, config: KubeConfig, *, timeout_s: float = 10.0) -> None:
        self._client = AsyncClient(config, timeout=httpx.Timeout(timeout_s), field_manager="inferlb")

    async def list(
        self, kind: Kind, namespace: str, label_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """See :meth:`KubeApi.list`."""
        listing = self._client.list(_RESOURCES[kind], namespace=namespace, labels=_labels(label_selector))
        try:
            items = [_as_dict(o) async for o in listing]
            return items, listing.resourceVersion
        except (ApiError, httpx.HTTPError, OSError) as exc:
            raise _failure(exc) from None
        except Exception as exc:  # an answer lightkube could not decode
            raise KubeUnavailable(f"unreadable list answer: {type(exc).__name__}: {exc}") from None

    async def watch(
        self, kind: Kind, namespace: str, resource_version: str, label_selector: str | None = None
    ) -> AsyncGenerator[tuple[str, dict[str, Any]]]:
        """See :meth:`KubeApi.watch`."""
        stream = self._client.watch(
            _RESOURCES[kind],
            namespace=namespace,
            labels=_labels(label_selector),
            resource_version=resource_version,
        )
        try:
            async for kind_of_event, obj in stream:
                yield kind_of_event, _as_dict(obj)
        except (ApiError, httpx.HTTPError, OSError) as exc:
            raise _failure(exc) from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # msgspec and model decoding
            raise KubeUnavailable(f"unreadable watch event: {type(exc).__name__}: {exc}") from None
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await asyncio.shield(aclose())

    async def close(self) -> None:
        """See :meth:`KubeApi.close`."""
        await self._client.close()


def _labels(selector: str | None) -> dict[str, Any] | None:
    """``k=v,k2=v2`` (equality terms only, as discovery builds them) as lightkube's label dict."""
    if not selector:
        return None
    out: dict[str, Any] = {}
    for term in selector.split(","):
        k, _, v = term.partition("=")
        out[k] = v
    return out
