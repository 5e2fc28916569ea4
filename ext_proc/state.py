"""The mutable state one request-path process serves from (ext_proc's gRPC servicer and the ext_authz HTTP
service alike): the current :class:`~ext_proc.handlers.Gateway`, the tenants' quota store, the metrics and
the in-flight counts. No transport here: the adapters (:mod:`ext_proc.servicer`, :mod:`ext_authz.check`)
read it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from ext_proc import handlers
from ext_proc.length_state import LengthState
from ext_proc.metrics import ExtProcMetrics
from ext_proc.picking import PickingState
from inferlb.config.schema import Config
from inferlb.policy.quota import MemoryQuotaStore, QuotaStore, lease_ttl_s, limits_from_config
from inferlb.policy.shedding import InFlight

#: Bodies at least this large are parsed and counted in a worker thread (tiktoken releases the GIL), so
#: a 4 MB prompt (~0.3-2.5 s of BPE work measured here) does not stall every other stream on the loop.
OFFLOAD_BODY_BYTES = 128 * 1024


class ExtProcState:
    """The mutable state one ext_proc process serves from: the current :class:`handlers.Gateway`, the
    tenants' :class:`~inferlb.policy.quota.QuotaStore` and the metrics.

    Args:
        config: the initial config.
        clock: monotonic seconds (injected for tests), for the default in-process store and the length
            classes' threshold learners.
        rng: randomness for version choice when a request names no user.
        quotas: the quota store; default an in-process :class:`~inferlb.policy.quota.MemoryQuotaStore`.
        metrics: the metric families; default a fresh :class:`~ext_proc.metrics.ExtProcMetrics`.

    Attributes:
        in_flight: DEFAULT-priority requests admitted and not ended, per cluster (kept across reloads).
        picking: endpoint picking's live endpoint state and in-flight counts per endpoint
            (:mod:`ext_proc.picking`; kept across reloads).
        length: the output predictor and in-flight counts per length class (:mod:`ext_proc.length_state`;
            kept across reloads).
    """

    def __init__(
        self,
        config: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        quotas: QuotaStore | None = None,
        metrics: ExtProcMetrics | None = None,
    ) -> None:
        self.clock = clock
        self.rng = rng or random.Random()
        self.gateway = handlers.Gateway.from_config(config)
        self.quotas: QuotaStore = (
            quotas
            if quotas is not None
            else MemoryQuotaStore(limits_from_config(config), clock=clock, lease_ttl_s=lease_ttl_s(config))
        )
        self.metrics = metrics if metrics is not None else ExtProcMetrics()
        self.in_flight = InFlight()
        self.picking = PickingState()
        self.picking.metrics = self.metrics
        self.length = LengthState(self.metrics, clock=clock)

    def apply_config(self, config: Config) -> None:
        """Serve ``config`` from now on; quota state of tenants whose limits did not change is kept.

        Streams already past their headers phase finish with the tenant they authenticated as.

        Raises:
            ValueError: a model's tokenizer cannot be built; the current config keeps serving.
        """
        gateway = handlers.Gateway.from_config(
            config,
            self.gateway.counter,
            known_counters={m.tokenizer: self.gateway.counters[m.name] for m in self.gateway.config.models},
        )
        self.quotas.update_limits(limits_from_config(config), lease_ttl_s=lease_ttl_s(config))
        self.gateway = gateway
