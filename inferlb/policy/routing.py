"""Request routing decisions (pure): API key -> tenant, model name/alias -> model, model -> version.

A :class:`RoutingTable` is built once per config (dicts and cumulative split tables precomputed), so the
per-request path does only dict lookups and one comparison walk over a model's few versions.

Version choice follows each model's ``traffic_percent`` split. When the request names an end user (the
OpenAI ``user`` field) the choice is sticky: a SHA-256 of ``(model, user)`` is mapped to a point in
[0, 100) so the same user always lands on the same version while the split holds (the usual canary
practice, e.g. Argo Rollouts/Flagger header- or user-based canaries). Without a user the point is drawn
from the injected RNG.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from inferlb.config.schema import Config, ModelConfig, Priority, TenantConfig, hash_api_key
from inferlb.errors import RequestError
from inferlb.request.parsing import echo

_BEARER = "bearer "


@dataclass(frozen=True, kw_only=True, slots=True)
class VersionSplit:
    """A model's versions with the cumulative upper bound of each one's share of [0, 100)."""

    names: tuple[str, ...]
    upper_bounds: tuple[float, ...]

    @classmethod
    def of(cls, model: ModelConfig) -> VersionSplit:
        """Build the split of ``model.versions``, leaving out versions at 0 %."""
        names: list[str] = []
        bounds: list[float] = []
        acc = 0.0
        for v in model.versions:
            if v.traffic_percent <= 0:
                continue
            acc += v.traffic_percent
            names.append(v.name)
            bounds.append(acc)
        if not names:  # config validation makes the shares add up to 100, so this is unreachable in practice
            names, bounds = [model.versions[0].name], [100.0]
        return cls(names=tuple(names), upper_bounds=tuple(bounds))

    def pick(self, point: float) -> str:
        """The version whose share contains ``point`` in [0, 100)."""
        i = bisect_right(self.upper_bounds, point)
        # rounding can leave the last bound a hair under 100: the last version takes the remainder
        return self.names[min(i, len(self.names) - 1)]


def sticky_point(model: str, user: str) -> float:
    """A stable point in [0, 100) for ``(model, user)``: the first 8 bytes of SHA-256 over
    ``model NUL user``, scaled."""
    digest = hashlib.sha256(f"{model}\x00{user}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 * 100.0


class RoutingTable:
    """Lookups precomputed from one :class:`~inferlb.config.schema.Config`.

    Attributes:
        models: every model name and alias -> its model (read-only).
        tenants_by_digest: every API key's SHA-256 digest -> its tenant, in config order (read-only).
    """

    __slots__ = ("_splits", "models", "tenants_by_digest")

    def __init__(self, config: Config) -> None:
        self.models: Mapping[str, ModelConfig] = MappingProxyType(config.model_by_name())
        self.tenants_by_digest: tuple[tuple[bytes, TenantConfig], ...] = tuple(
            (d, t) for t in config.tenants for d in t.key_digests()
        )
        self._splits: dict[str, VersionSplit] = {m.name: VersionSplit.of(m) for m in config.models}

    def authenticate(self, authorization: str | None) -> TenantConfig:
        """The tenant of an ``Authorization: Bearer <key>`` header value.

        Raises:
            RequestError: 401 ``authentication_error``/``invalid_api_key`` when the header is missing, not a
                Bearer credential, or carries an unknown key. The key is never echoed in full.
        """
        if not authorization:
            raise missing_api_key()
        if authorization[: len(_BEARER)].lower() != _BEARER:
            raise RequestError(
                401,
                "The Authorization header must use Bearer auth (Authorization: Bearer YOUR_KEY).",
                type="authentication_error",
                code="invalid_api_key",
            )
        key = authorization[len(_BEARER) :].strip()
        # compare the digest with every tenant's, without stopping at a match or a differing byte
        # (hmac.compare_digest), so the time taken tells nothing about which key or prefix is close
        digest = hash_api_key(key)
        tenant: TenantConfig | None = None
        for candidate, owner in self.tenants_by_digest:
            if hmac.compare_digest(digest, candidate):  # digests are unique (Config checks)
                tenant = owner
        if tenant is None:
            shown = f"{key[:3]}...{key[-4:]}" if len(key) > 10 else "***"
            raise RequestError(
                401,
                f"Incorrect API key provided: {shown}.",
                type="authentication_error",
                code="invalid_api_key",
            )
        return tenant

    def resolve_model(self, name: str) -> ModelConfig:
        """The model served under ``name`` (its name or an alias).

        Raises:
            RequestError: 404 ``invalid_request_error``/``model_not_found`` (param ``model``).
        """
        model = self.models.get(name)
        if model is None:
            raise model_not_found(name)
        return model

    def pick_version(self, model: ModelConfig, user: str | None, rng: random.Random) -> str:
        """A version of ``model`` by its traffic split: sticky per ``user`` when given, else from ``rng``."""
        split = self._splits[model.name]
        if len(split.names) == 1:
            return split.names[0]
        point = sticky_point(model.name, user) if user else rng.random() * 100.0
        return split.pick(point)


def missing_api_key() -> RequestError:
    """OpenAI's 401 ``authentication_error``/``invalid_api_key`` error for a request without an API key."""
    return RequestError(
        401,
        "You didn't provide an API key. You need to provide your API key in an Authorization header "
        "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        type="authentication_error",
        code="invalid_api_key",
    )


def model_not_found(name: str) -> RequestError:
    """OpenAI's 404 ``invalid_request_error``/``model_not_found`` error for ``name`` (param ``model``)."""
    return RequestError(
        404,
        f"The model '{echo(name)}' does not exist or you do not have access to it.",
        type="invalid_request_error",
        code="model_not_found",
        param="model",
    )


def priority_header_value(priority: Priority) -> str:
    """The ``x-inferlb-priority`` value for a tenant priority (``high`` selects Envoy's HIGH priority)."""
    return priority.value


def model_object(name: str) -> dict[str, object]:
    """OpenAI's model object for ``name`` (``GET /v1/models``); ``created`` is not known for a self-hosted
    model, 0 keeps the type right."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "inferlb"}


def models_list_body(config: Config) -> bytes:
    """The JSON body of ``GET /v1/models``: every model of ``config`` by its canonical name."""
    return json.dumps({"object": "list", "data": [model_object(m.name) for m in config.models]}).encode()


def model_object_bodies(config: Config) -> dict[str, bytes]:
    """Model name or alias -> the JSON body of ``GET /v1/models/{id}`` (the canonical model's object)."""
    out: dict[str, bytes] = {}
    for m in config.models:
        body = json.dumps(model_object(m.name)).encode()
        for name in (m.name, *m.aliases):
            out[name] = body
    return out
