"""Several ext_proc processes (``ext_proc.extra_listen``) with ``quota_backend: memory`` would each keep
their own quota state, so every tenant limit would be multiplied by the number of processes: such a config
is refused when some tenant has a limit, and accepted with Redis, without limits or with one process, in
both request-path modes (ext_authz processes each meter on their own settler:
``tests/unit/test_meter_processes.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferlb.config.schema import ConfigError, parse_config

LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "daily_token_budget")


PROTOCOLS = st.sampled_from(("ext_proc", "ext_authz"))


def _doc(
    *, extra: int, backend: str | None, tenant_limits: dict[str, int], protocol: str = "ext_proc"
) -> dict[str, Any]:
    ext_proc: dict[str, Any] = {
        "protocol": protocol,
        "listen": "127.0.0.1:18080",
        "extra_listen": [f"127.0.0.1:{18090 + i}" for i in range(extra)],
    }
    if backend is not None:
        ext_proc["quota_backend"] = backend
    return {
        "ext_proc": ext_proc,
        "models": [{"name": "m"}],
        "tenants": [
            {"name": "free", "api_keys": ["sk-free-key"]},
            {"name": "capped", "api_keys": ["sk-capped-key"], **tenant_limits},
        ],
    }


@given(
    limits=st.dictionaries(st.sampled_from(LIMITS), st.integers(1, 10**9), min_size=1),
    extra=st.integers(1, 4),
    protocol=PROTOCOLS,
)
def test_a_limited_tenant_with_memory_quotas_and_extra_processes_is_refused(
    limits: dict[str, int], extra: int, protocol: str
) -> None:
    for backend in (None, "memory"):  # the default is memory
        doc = _doc(extra=extra, backend=backend, tenant_limits=limits, protocol=protocol)
        with pytest.raises(ConfigError) as info:
            parse_config(doc, "f.yaml")
        [(field, message)] = info.value.problems
        assert field == "ext_proc.extra_listen"
        assert f"{extra + 1} ext_proc processes with quota_backend memory" in message
        assert f"limits x {extra + 1}" in message
        assert "tenant 'capped' sets " + ", ".join(f for f in LIMITS if f in limits) in message
        assert "quota_backend: redis" in message


@given(
    limits=st.dictionaries(st.sampled_from(LIMITS), st.integers(1, 10**9)),
    extra=st.integers(0, 4),
    protocol=PROTOCOLS,
)
def test_redis_quotas_share_the_limits_between_processes(
    limits: dict[str, int], extra: int, protocol: str
) -> None:
    config = parse_config(_doc(extra=extra, backend="redis", tenant_limits=limits, protocol=protocol))
    assert len(config.ext_proc.extra_listen) == extra
    if protocol == "ext_authz":  # metered (the default): one settler per process
        assert len(config.ext_proc.meter_addresses()) == extra + 1
    assert config.tenants[1].limits_set() == tuple(f for f in LIMITS if f in limits)


@pytest.mark.parametrize("backend", [None, "memory"])
def test_extra_processes_with_memory_quotas_are_fine_when_no_tenant_has_a_limit(backend: str | None) -> None:
    config = parse_config(_doc(extra=2, backend=backend, tenant_limits={}))
    assert config.ext_proc.quota_backend == "memory"
    assert len(config.ext_proc.extra_listen) == 2
    assert all(t.limits_set() == () for t in config.tenants)


@given(limits=st.dictionaries(st.sampled_from(LIMITS), st.integers(1, 10**9), min_size=1))
def test_one_process_with_memory_quotas_keeps_every_limit(limits: dict[str, int]) -> None:
    config = parse_config(_doc(extra=0, backend=None, tenant_limits=limits))
    capped = config.tenants[1]
    assert {f: getattr(capped, f) for f in capped.limits_set()} == limits
