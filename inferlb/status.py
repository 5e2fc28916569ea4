"""``inferlb status``: Envoy's view of the fleet, from its admin API, as a table.

Reads ``/clusters?format=json`` (per-host weight, health flags and request stats; see Envoy's admin docs,
"Cluster manager: /clusters") and joins each host with the config's endpoint (name, GPU type).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from inferlb.config import Config


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

    With ``only_models`` the internal clusters (xDS, ext_proc) are left out.
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
