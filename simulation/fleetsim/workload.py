"""The fleet and its load: the GPUs, what one request costs them, the trace scaled to a target rate, and the
length thresholds of the length-aware policies.

**The fleet** (:func:`fleet_mix`): ``N`` GPUs split over the GPU types of the config's endpoints in the
config's proportions (the bundled config has 2 H100, 3 A100, 3 V100, so 1,000 GPUs are 250/375/375).

**Load** (:func:`fleet_capacity_rps`, :func:`scale_trace`): the capacity of a GPU is the request rate it
sustains with a full batch: one request costs ``prefill_seconds(P) + (C - 1) * decode_step_seconds(B) / B``
GPU-seconds (its prefill, whole or in chunks; its other ``C - 1`` tokens share full steps of ``B`` sequences),
averaged over the trace's prompt (``P``) and completion (``C``) lengths; the fleet's capacity is the sum over
GPUs of one over that mean. The trace is then superposed ``m`` times with circular shifts of ``j / m`` of
its length and time-scaled so that the arrival rate is the target (e.g. 0.9 x capacity): arrival times are
the trace's (rescaled), and each request keeps its prompt and completion tokens.

**Length thresholds** (:func:`long_output_threshold`, :func:`tiered_thresholds`): the completion tokens
above which ``length_aware`` calls a request long (a nearest-rank percentile of the arrivals'), and the
``tiered`` policy's thresholds by the rule :func:`inferlb.policy.length_aware.tier_thresholds`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from inferlb.config.schema import Config, EndpointConfig, HostPort
from inferlb.policy.capacity import capacity_weight
from inferlb.policy.length_aware import DEFAULT_TIER_WORK_FRACTION, tier_capacity_shares, tier_thresholds
from inferlb.policy.output_predictor import LengthQuery, OutputPredictor, PredictionKey, PredictorParams
from inferlb.traces import TraceRow, percentile
from simulation.fleetsim.seams import EngineTiming

#: What :func:`scale_trace` adds to the block hashes of each further copy of the trace (larger than any id a
#: trace gives: the Mooncake conversation trace's largest is under 2**18).
COPY_HASH_STRIDE = 2**40


@dataclass(frozen=True, kw_only=True)
class FleetGpu:
    """One GPU of the simulated fleet.

    Attributes:
        index: position in the fleet (0..N-1).
        gpu_type: GPU profile name (``H100``).
        relative_capacity: the profile's capacity (V100 = 1.0).
        endpoint: an endpoint config for it (never bound; for ``TimingModel.for_endpoint`` and the static
            weight).
        static_weight: :func:`inferlb.policy.capacity.capacity_weight` of the endpoint (EDS weight units).
    """

    index: int
    gpu_type: str
    relative_capacity: float
    endpoint: EndpointConfig
    static_weight: int


def fleet_mix(config: Config, n_gpus: int) -> tuple[FleetGpu, ...]:
    """``n_gpus`` GPUs in the proportions of the GPU types of ``config.endpoints``, types interleaved.

    Counts are rounded by largest remainder, so they add up to ``n_gpus``; GPUs of each type are spread
    evenly over the fleet order (the order does not matter to the balancers, but keeps small fleets mixed).

    Raises:
        ValueError: ``n_gpus < 1``, or the config has no endpoints.
    """
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    if not config.endpoints:
        raise ValueError("the config has no endpoints: the fleet's GPU mix comes from them")
    seen: dict[str, int] = {}
    for e in config.endpoints:
        seen[e.gpu] = seen.get(e.gpu, 0) + 1
    total = sum(seen.values())
    exact = {t: n_gpus * c / total for t, c in seen.items()}
    counts = {t: math.floor(x) for t, x in exact.items()}
    by_remainder = sorted(seen, key=lambda t: (-(exact[t] - counts[t]), list(seen).index(t)))
    for t in by_remainder[: n_gpus - sum(counts.values())]:
        counts[t] += 1
    # Interleave: the k-th GPU of a type of count c sits at fleet position (k + 0.5) / c.
    slots = sorted(((k + 0.5) / c, i, t) for i, (t, c) in enumerate(counts.items()) for k in range(c))
    model = config.endpoints[0].model
    version = config.endpoints[0].version
    out: list[FleetGpu] = []
    for index, (_, _, gpu_type) in enumerate(slots):
        endpoint = EndpointConfig(
            name=f"{gpu_type.lower()}-{index}",
            address=HostPort(host=f"gpu-{index}.fleet.invalid", port=8000),
            model=model,
            version=version,
            gpu=gpu_type,
            simulated=True,
        )
        out.append(
            FleetGpu(
                index=index,
                gpu_type=gpu_type,
                relative_capacity=config.gpu_profiles[gpu_type].relative_capacity,
                endpoint=endpoint,
                static_weight=capacity_weight(config, endpoint),
            )
        )
    return tuple(out)


def request_service_seconds(model: EngineTiming, prompt_tokens: int, completion_tokens: int) -> float:
    """GPU-seconds one request costs a server running full batches: ``prefill_seconds(P) + max(C - 1, 0) *
    decode_step_seconds(B) / B`` (see the module doc)."""
    b = model.max_batch
    return model.prefill_seconds(prompt_tokens) + max(completion_tokens - 1, 0) * (
        model.decode_step_seconds(b) / b
    )


def fleet_capacity_rps(models: Sequence[EngineTiming], rows: Sequence[TraceRow]) -> float:
    """Requests/s the fleet sustains with every GPU running full batches of the trace's mix of requests:
    ``sum over GPUs of 1 / mean(request_service_seconds)``.

    Models of equal ``relative_capacity``, ``max_batch``, prefill and decode times are taken to time alike
    (they do when built from one config), so the mean is computed once per distinct kind.

    Raises:
        ValueError: no models or no rows.
    """
    if not models or not rows:
        raise ValueError("need at least one model and one trace row")
    mean_by_kind: dict[tuple[float, int, float, float], float] = {}
    total = 0.0
    for m in models:
        kind = (m.relative_capacity, m.max_batch, m.prefill_seconds(1000), m.decode_step_seconds(1))
        mean = mean_by_kind.get(kind)
        if mean is None:
            mean = sum(request_service_seconds(m, r.prompt_tokens, r.output_tokens) for r in rows) / len(rows)
            mean_by_kind[kind] = mean
        total += 1.0 / mean
    return total


def scale_trace(rows: Sequence[TraceRow], *, rate_rps: float, duration_s: float) -> list[TraceRow]:
    """The trace's requests at ``rate_rps`` on average for ``duration_s`` seconds (see the module doc).

    ``m = ceil(rate_rps * duration_s / len(rows))`` copies of the trace, copy ``j`` shifted circularly by
    ``j / m`` of the trace period, are merged and time-scaled so that the mean rate is ``rate_rps``; rows at
    or after ``duration_s`` are dropped. The trace period is its span plus one mean inter-arrival gap, so
    the last request of one lap and the first of the next are spaced like the rest. Copy ``j``'s block
    hashes are shifted by ``j *`` :data:`COPY_HASH_STRIDE`: the copies stand for other users, whose
    requests share no prefix with the first copy's. Deterministic.

    Raises:
        ValueError: no rows, or a non-positive rate or duration.
    """
    if not rows:
        raise ValueError("the trace has no rows")
    if not (rate_rps > 0 and duration_s > 0 and math.isfinite(rate_rps) and math.isfinite(duration_s)):
        raise ValueError(f"rate_rps and duration_s must be finite and > 0, got {rate_rps}, {duration_s}")
    n = len(rows)
    t0 = min(r.offset_s for r in rows)
    span = max(r.offset_s for r in rows) - t0
    period = span + (span / (n - 1) if n > 1 and span > 0 else 1.0)
    copies = max(1, math.ceil(rate_rps * duration_s / n))
    speedup = rate_rps * period / (copies * n)
    out: list[TraceRow] = []
    for j in range(copies):
        shift = j * period / copies
        for r in rows:
            at = ((r.offset_s - t0 + shift) % period) / speedup
            if at < duration_s:
                hashes = r.block_hashes if j == 0 else tuple(h + j * COPY_HASH_STRIDE for h in r.block_hashes)
                out.append(replace(r, offset_s=at, block_hashes=hashes))
    out.sort(key=lambda r: r.offset_s)
    return out


def long_output_threshold(rows: Sequence[TraceRow], percentile_rank: float) -> int:
    """The nearest-rank ``percentile_rank``-th percentile (0..100) of the rows' output caps
    (:attr:`inferlb.traces.TraceRow.output_cap`: the completion tokens where no cap was set).

    Raises:
        ValueError: no rows, or a rank outside [0, 100].
    """
    if not rows:
        raise ValueError("no rows to take a percentile of")
    if not 0 <= percentile_rank <= 100:
        raise ValueError(f"percentile_rank must be in [0, 100], got {percentile_rank}")
    return int(percentile([float(r.output_cap) for r in rows], percentile_rank))


def tiered_thresholds(
    gpus: Sequence[FleetGpu],
    model: EngineTiming,
    rows: Sequence[TraceRow],
    *,
    fraction: float = DEFAULT_TIER_WORK_FRACTION,
) -> tuple[int, ...]:
    """The ``tiered`` policy's thresholds for this fleet from the requests ``rows`` (a training window):
    :func:`inferlb.policy.length_aware.tier_thresholds` over the tier sets of the fleet's GPU classes
    (:func:`inferlb.policy.length_aware.tier_capacity_shares`), each request's work priced by
    :func:`request_service_seconds` on ``model`` (any GPU type: the shares do not depend on it) from its
    completion, its cap the one the gateway sees (:attr:`inferlb.traces.TraceRow.output_cap`). A fleet of
    one GPU class has no tier set to confine to: no threshold.

    Raises:
        ValueError: no rows, or as :func:`inferlb.policy.length_aware.tier_thresholds`.
    """
    shares = [share for _, share in tier_capacity_shares([g.relative_capacity for g in gpus])]
    samples = [(r.output_cap, request_service_seconds(model, r.prompt_tokens, r.output_tokens)) for r in rows]
    return tier_thresholds(shares, samples, fraction=fraction)


#: The model and endpoint kind of the predictor's keys in the simulation (one model, chat completions).
SIM_MODEL = "sim-model"
SIM_KIND = "chat.completions"


def length_query(row: TraceRow, default_cap: int) -> LengthQuery:
    """What the request path's :class:`inferlb.policy.output_predictor.OutputPredictor` sees of ``row``: its
    tenant (key ``(tenant, SIM_MODEL, SIM_KIND)``), prompt tokens, its cap (None when it sent none) and the
    model's ``default_cap`` (tokens); no conversation id (the traces give none)."""
    return LengthQuery(
        key=PredictionKey(row.tenant, SIM_MODEL, SIM_KIND),
        prompt_tokens=row.prompt_tokens,
        conversation=None,
        cap=row.output_cap if row.cap_sent else None,
        default_cap=default_cap,
    )


def predicted_caps(
    rows: Sequence[TraceRow], default_cap: int, params: PredictorParams | None = None
) -> list[TraceRow]:
    """The rows with the output length the request path would class each by, through one fresh
    :class:`inferlb.policy.output_predictor.OutputPredictor` walked in arrival order: its cap, or its
    prediction where the cap is uninformative (``max_tokens`` set to it, ``cap_sent`` kept); each row's true
    completion is learnt right after it (as if every answer came back before the next request: a training
    window's thresholds, :func:`tiered_thresholds`, fitted on what the gateway classes by)."""
    predictor = OutputPredictor(params)
    out: list[TraceRow] = []
    for r in rows:
        q = length_query(r, default_cap)
        est = predictor.estimate(q)
        out.append(replace(r, max_tokens=est.output_tokens))
        predictor.observe(q, r.output_tokens)
    return out


@dataclass(frozen=True, kw_only=True)
class SharedPrefixSpec:
    """A shared-prefix workload as llm-d's prefix-cache benchmark runs it (inference-perf's
    ``shared_prefix`` data: ``num_groups``, ``num_prompts_per_group``, ``system_prompt_len``,
    ``question_len``, ``output_len``): ``groups`` system prompts, each shared by ``users`` prompts that append
    their own question; every request sends one of the ``groups * users`` prompts, drawn uniformly, so a
    prompt recurs and hits in full where it was computed before.

    Attributes:
        groups: distinct system prompts (>= 1).
        users: prompts per group, each with its own question (>= 1).
        system_tokens: tokens of each system prompt (>= 1).
        question_tokens: tokens of each question (>= 1).
        output_tokens: completion tokens of each request (>= 1).
        block_tokens: tokens per block id (the engines' cache block size; >= 1).
    """

    groups: int
    users: int = 5
    system_tokens: int = 6000
    question_tokens: int = 1200
    output_tokens: int = 1000
    block_tokens: int = 512

    def __post_init__(self) -> None:
        if min(self.groups, self.users, self.system_tokens, self.question_tokens, self.output_tokens) < 1:
            raise ValueError("groups, users and every token count must be >= 1")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every prompt: system prompt plus question."""
        return self.system_tokens + self.question_tokens

    def prompt_blocks(self, group: int, user: int) -> tuple[int, ...]:
        """The chained block ids of prompt ``(group, user)``: its full blocks, those wholly inside the system
        prompt named by the group alone (shared by its users), the rest by the group and the user."""
        bs = self.block_tokens
        shared = self.system_tokens // bs
        total = self.prompt_tokens // bs
        prompt = group * self.users + user
        stride = total + 1
        return tuple(
            (group * stride + i) if i < shared else (COPY_HASH_STRIDE + prompt * stride + i)
            for i in range(total)
        )


def shared_prefix_rows(
    spec: SharedPrefixSpec, *, rate_rps: float, duration_s: float, seed: int
) -> list[TraceRow]:
    """Poisson arrivals at ``rate_rps`` for ``duration_s`` seconds, each one of ``spec``'s prompts drawn
    uniformly (``random.Random(seed)``: deterministic).

    Raises:
        ValueError: a non-positive or non-finite rate or duration.
    """
    if not (rate_rps > 0 and duration_s > 0 and math.isfinite(rate_rps) and math.isfinite(duration_s)):
        raise ValueError(f"rate_rps and duration_s must be finite and > 0, got {rate_rps}, {duration_s}")
    rng = random.Random(seed)
    out: list[TraceRow] = []
    t = rng.expovariate(rate_rps)
    while t < duration_s:
        g, u = rng.randrange(spec.groups), rng.randrange(spec.users)
        out.append(
            TraceRow(
                offset_s=t,
                prompt_tokens=spec.prompt_tokens,
                output_tokens=spec.output_tokens,
                block_hashes=spec.prompt_blocks(g, u),
            )
        )
        t += rng.expovariate(rate_rps)
    return out
