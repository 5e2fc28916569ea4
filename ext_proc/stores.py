"""Build the edge objects ``python -m ext_proc`` needs from the config: the quota store (in-process or
Redis) and the Prometheus ``/metrics`` HTTP server."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from ext_proc.metrics import ExtProcMetrics
from inferlb.adapters.quota_redis import RedisQuotaStore
from inferlb.config.schema import Config, HostPort
from inferlb.policy.quota import MemoryQuotaStore, QuotaStore, lease_ttl_s, limits_from_config


def make_quota_store(config: Config, metrics: ExtProcMetrics) -> QuotaStore:
    """The quota store ``ext_proc.quota_backend`` names: :class:`~inferlb.policy.quota.MemoryQuotaStore` or a
    :class:`~inferlb.adapters.quota_redis.RedisQuotaStore` on ``ext_proc.redis_url`` with a pool of
    ``redis_pool_size`` connections. Call its ``start()`` before serving: it opens the connections (an
    unreachable Redis at start-up is logged and then handled like one at run time: by
    ``redis_failure_mode``)."""
    limits = limits_from_config(config)
    ep = config.ext_proc
    if ep.quota_backend == "memory":
        return MemoryQuotaStore(limits, lease_ttl_s=lease_ttl_s(config))
    return RedisQuotaStore.from_url(
        ep.redis_url,
        limits,
        timeout_s=ep.redis_timeout_ms / 1000.0,
        connect_timeout_s=ep.redis_connect_timeout_ms / 1000.0,
        pool_size=ep.redis_pool_size,
        key_prefix=ep.redis_key_prefix,
        failure_mode=ep.redis_failure_mode,
        lease_ttl_s=lease_ttl_s(config),
        on_error=metrics.quota_backend_error,
    )


def start_metrics_server(listen: HostPort, metrics: ExtProcMetrics) -> tuple[WSGIServer, int]:
    """Serve ``metrics.registry`` as Prometheus text on ``http://listen/metrics`` from a daemon thread.

    Returns:
        ``(server, bound port)``; stop it with ``server.shutdown(); server.server_close()``.

    Raises:
        OSError: the address cannot be bound.
    """
    server, thread = start_http_server(listen.port, addr=listen.host, registry=metrics.registry)
    assert isinstance(thread, threading.Thread)
    return server, int(server.server_address[1])
