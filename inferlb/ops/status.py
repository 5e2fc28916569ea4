"""``inferlb status``: Envoy's view of the fleet, from its admin API, as a table.

Reads ``/clusters?format=json`` (per-host weight, health flags and request stats; see Envoy's admin docs,
"Cluster manager: /clusters") and joins each host with the config's endpoint (name, GPU type).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from inferlb.config.schema import Config


@dataclass(frozen=True, kw_only=True)
class HostRow:
    """One endpoint as Envoy sees it.

    ``weight`` is Envoy's ``load_balancing_weight``; ``weight_share`` its fraction of the cluster's total
    (0..1); ``rq_active`` requests in flight now; ``rq_total`` requests since Envoy started; ``health`` the
    failed health flags joined by ``,`` or ``healthy``.
    """

    cluster: str
    address: str
    name: str
    gpu: str
    weight: int
    weight_share: float
    health: str
    rq_active: int
    rq_total: int
    rq_error: int


def _stat(host: dict[str, Any], name: str) -> int:
    for s in host.get("stats", []):
        if s.get("name") == name:
            return int(s.get("value", 0))
    return 0


def _health(host: dict[str, Any]) -> str:
    hs = host.get("health_status", {})
    flags = [k for k, v in hs.items() if k.startswith("failed") or k.startswith("pending") if v is True]
    eds = hs.get("eds_health_status", "HEALTHY")
    if eds not in ("HEALTHY", "UNKNOWN"):
        flags.append(eds.lower())
    return ",".join(flags) if flags else "healthy"


def host_rows(config: Config, clusters: dict[str, Any], *, only_models: bool = True) -> list[HostRow]:
    """Rows for every host of every cluster in an admin ``/clusters?format=json`` document.

    With ``only_models`` the internal clusters (xDS, ext_proc) are left out. Rows are sorted by cluster and
    endpoint name, so repeated calls list them in the same order (Envoy's own order varies).
    """
    by_addr = {str(e.address): e for e in config.endpoints}
    model_clusters = {m.cluster_name(v.name) for m in config.models for v in m.versions}
    rows: list[HostRow] = []
    for c in clusters.get("cluster_statuses", []):
        name = c.get("name", "")
        if only_models and name not in model_clusters:
            continue
        hosts = c.get("host_statuses", [])
        total_w = sum(int(h.get("weight", 1)) for h in hosts) or 1
        for h in hosts:
            sa = h.get("address", {}).get("socket_address", {})
            addr = f"{sa.get('address', '?')}:{sa.get('port_value', '?')}"
            ep = by_addr.get(addr)
            w = int(h.get("weight", 1))
            rows.append(
                HostRow(
                    cluster=name,
                    address=addr,
                    name=ep.display_name if ep else addr,
                    gpu=ep.gpu if ep else "?",
                    weight=w,
                    weight_share=w / total_w,
                    health=_health(h),
                    rq_active=_stat(h, "rq_active"),
                    rq_total=_stat(h, "rq_total"),
                    rq_error=_stat(h, "rq_error"),
                )
            )
    rows.sort(key=lambda r: (r.cluster, r.name))
    return rows


def status_table(rows: list[HostRow]) -> Table:
    """A rich table of :func:`host_rows`."""
    t = Table(title="inferlb fleet (Envoy's view)")
    for col, just in (
        ("cluster", "left"),
        ("endpoint", "left"),
        ("address", "left"),
        ("gpu", "left"),
        ("weight", "right"),
        ("share", "right"),
        ("health", "left"),
        ("active", "right"),
        ("total", "right"),
        ("errors", "right"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        t.add_row(
            r.cluster,
            r.name,
            r.address,
            r.gpu,
            str(r.weight),
            f"{r.weight_share:.0%}",
            r.health,
            str(r.rq_active),
            str(r.rq_total),
            str(r.rq_error),
        )
    return t


@dataclass(frozen=True, kw_only=True)
class WeightRow:
    """One endpoint's weight and the inputs behind it: the xDS server's ``GET /v1/weights`` row joined with
    Envoy's view (:class:`HostRow`).

    Attributes:
        cluster / name / address / gpu: as in :class:`HostRow`.
        envoy_weight: the weight Envoy holds now (``/clusters``), None when Envoy does not list the host.
        served_weight: the weight the xDS server serves; ``source`` where it comes from (``pin``,
            ``telemetry``, ``capacity``); ``policy_weight``: what the telemetry policy computes (shown
            even in ``static`` mode), ``profile_weight``: its no-telemetry fallback.
        waiting / running: requests queued and in the batch; ``kv``: KV-cache usage 0..1;
        throttle: ``thermal``/``power``/``-``; clock_ratio: SM clock over max; tokens_per_s: generation
            rate (tokens/s); age_s: age of the freshest telemetry (s), None = none or stale;
        factors: ``performance``, ``load``, ``kv``, ``errors`` and ``target`` of
            :func:`inferlb.policy.weights.target_weight`; fresh: whether telemetry counted; collected: whether
            the xDS server collects telemetry for it at all (False in ``weights.mode: static``).
        length_classes: for a length-aware model, the confined length classes the endpoint serves (live
            with telemetry weights, :func:`inferlb.policy.length_aware.live_class_sets`), None otherwise;
            profile_classes: those of its GPU profile alone.
    """

    cluster: str
    name: str
    address: str
    gpu: str
    envoy_weight: int | None
    served_weight: int
    source: str
    policy_weight: int | None
    profile_weight: int
    fresh: bool
    waiting: int | None
    running: int | None
    kv: float | None
    throttle: str
    clock_ratio: float | None
    tokens_per_s: float | None
    age_s: float | None
    factors: dict[str, float | None]
    length_classes: tuple[str, ...] | None = None
    profile_classes: tuple[str, ...] | None = None
    collected: bool = True


def weight_rows(weights: dict[str, Any], envoy: list[HostRow]) -> list[WeightRow]:
    """Join the xDS server's ``GET /v1/weights`` body with Envoy's rows (by address ``host:port``).

    Envoy lists hosts by IP; endpoints written with a host name are joined by name instead.
    """
    by_addr = {r.address: r for r in envoy}
    by_name = {r.name: r for r in envoy}
    out: list[WeightRow] = []
    for e in weights.get("endpoints", []):
        host = by_addr.get(e["key"]) or by_name.get(e["name"])
        inputs = e.get("inputs") or {}
        factors = e.get("factors") or {}
        fresh = bool(factors.get("fresh", False))
        flags = [f for f in ("thermal", "power") if inputs.get(f"{f}_throttled")]
        out.append(
            WeightRow(
                cluster=e.get("cluster") or (host.cluster if host else "?"),
                name=e["name"],
                address=e["key"],
                gpu=e["gpu"],
                envoy_weight=host.weight if host else None,
                served_weight=int(e["served_weight"]),
                source=e["weight_source"],
                policy_weight=e.get("policy_weight"),
                profile_weight=int(e["profile_weight"]),
                fresh=fresh,
                waiting=inputs.get("waiting_requests") if fresh else None,
                running=inputs.get("running_requests") if fresh else None,
                kv=inputs.get("kv_cache_usage") if fresh else None,
                throttle=",".join(flags) or "-",
                clock_ratio=inputs.get("clock_ratio"),
                tokens_per_s=inputs.get("generation_tokens_per_s"),
                age_s=inputs.get("telemetry_age_s") if fresh else None,
                factors={k: factors.get(k) for k in ("performance", "load", "kv", "errors", "target")},
                collected=bool(factors),
                length_classes=_classes(e.get("length_classes")),
                profile_classes=_classes(e.get("profile_classes")),
            )
        )
    return out


def _classes(v: Any) -> tuple[str, ...] | None:
    return None if v is None else tuple(str(c) for c in v)


def _classes_cell(r: WeightRow) -> str:
    """``long-0,long-1`` (``-``: short only); a ``*`` marks live classes that differ from the profile's."""
    if r.length_classes is None:
        return ""
    cell = ",".join(r.length_classes) or "-"
    return cell + "*" if r.profile_classes is not None and r.length_classes != r.profile_classes else cell


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def weights_table(rows: list[WeightRow], mode: str) -> Table:
    """A rich table of :func:`weight_rows`: Envoy's weight, the served one and its source, the inputs
    (queue, batch, KV, throttle, throughput, age), the policy's factors and, for length-aware models, the
    length classes served (``*``: live, differing from the GPU profile's)."""
    t = Table(title=f"inferlb weights (mode {mode}; target = profile x perf x load x kv x errors)")
    cols = (
        "cluster", "endpoint", "gpu", "envoy", "served", "source", "policy", "profile", "queue", "run",
        "KV", "throttle", "clock", "tok/s", "age s", "perf", "load", "kv", "err", "target", "classes",
    )  # fmt: skip
    for col in cols:
        t.add_column(
            col,
            justify="left"
            if col in ("cluster", "endpoint", "gpu", "source", "throttle", "classes")
            else "right",
        )
    for r in rows:
        f = r.factors
        t.add_row(
            r.cluster,
            r.name,
            r.gpu,
            _num(r.envoy_weight, "d"),
            str(r.served_weight),
            r.source,
            _num(r.policy_weight, "d"),
            str(r.profile_weight),
            _num(r.waiting, "d"),
            _num(r.running, "d"),
            "-" if r.kv is None else f"{r.kv:.0%}",
            r.throttle,
            _num(r.clock_ratio, ".2f"),
            _num(r.tokens_per_s, ".0f"),
            # static mode collects nothing: nothing is stale
            ("stale" if r.collected else "-") if not r.fresh else _num(r.age_s, ".1f"),
            _num(f.get("performance"), ".2f"),
            _num(f.get("load"), ".2f"),
            _num(f.get("kv"), ".2f"),
            _num(f.get("errors"), ".2f"),
            _num(f.get("target"), ".0f"),
            _classes_cell(r),
        )
    return t
