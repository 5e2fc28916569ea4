"""Length-aware placement (pure): long generations go to the fast GPUs of a model's cluster.

Why: at 90% load the slowest 1% of requests are long completions decoding on slow GPUs (a V100 decodes a
600-1,000-token answer in 15-40 s where an H100 takes a third of that). Endpoint weights change how many
requests each GPU gets, not which GPU gets the long ones. The gateway knows each request's output cap before
routing, so it can send the long ones to the fast GPUs (issue 5; bench/fleet_sim.py and bench/routing.py
measure it).

How it runs in Envoy, for a model whose ``cluster.length_aware`` is set
(:class:`inferlb.config.LengthAwareRouting`):

1. ext_proc classifies each admitted request by its output cap, :meth:`inferlb.openai_api.InferenceRequest.
   output_token_cap` (``max_completion_tokens``/``max_tokens``/``max_output_tokens``, else the model's
   ``default_max_tokens``, x ``n`` x prompts: the tokens quota admission reserves): above
   ``long_output_tokens`` it is :data:`LONG`, else :data:`SHORT` (:func:`length_class`), and sets the
   ``x-inferlb-length-class`` header (:data:`inferlb.headers.LENGTH_CLASS`).
2. The xDS server gives each endpoint of such a model the ``envoy.lb`` metadata ``{gpu_tier: fast}`` when its
   GPU profile's ``relative_capacity`` is at least ``fast_min_relative_capacity``, else
   ``{gpu_tier: standard}`` (:func:`gpu_tier`), and its clusters an ``lb_subset_config`` with one selector on
   ``gpu_tier`` and fallback ``ANY_ENDPOINT``. Each subset keeps the cluster's own balancer (least request
   with the pushed weights, or round robin): Envoy's subset load balancer "uses the load balancer policy
   specified by the cluster" (Envoy docs, "Load Balancer Subsets").
3. A route matching ``x-inferlb-length-class: long`` (before the model's other routes) carries
   ``metadata_match {envoy.lb: {gpu_tier: fast}}``: long requests are balanced among the fast GPUs only.
   Short requests match the model's usual routes, which carry no metadata match, so the fallback policy
   (``ANY_ENDPOINT``) balances them over every endpoint. With no fast endpoint in the cluster the ``fast``
   subset does not exist and long requests fall back to every endpoint too.

What the cap is: the client's declared upper bound. A client that always sends a large ``max_tokens`` (or
none, with a large model default) makes every request look long; the benchmarks replay a trace whose
``max_tokens`` equals the completion it generates, the best case. Unlike the discrete-event model in
:mod:`inferlb.fleetsim`, Envoy does not fall back from a busy fast subset to the whole fleet: the subset is
fixed by GPU class, not by load (a fast GPU that throttles stays in it, with its lowered weight).
"""

from __future__ import annotations

from typing import Final

from inferlb.config import Config, LengthAwareRouting

#: ``x-inferlb-length-class`` value of a request whose output cap exceeds the model's threshold.
LONG: Final = "long"
#: ``x-inferlb-length-class`` value of every other request of a length-aware model.
SHORT: Final = "short"
#: Envoy's metadata namespace for subset load balancing (endpoint metadata and route ``metadata_match``).
ENVOY_LB_NAMESPACE: Final = "envoy.lb"
#: The endpoint metadata key the subsets are built on.
TIER_KEY: Final = "gpu_tier"
#: Tier of a GPU whose profile's relative capacity is at least the model's ``fast_min_relative_capacity``.
FAST_TIER: Final = "fast"
#: Tier of every other GPU.
STANDARD_TIER: Final = "standard"


def length_class(output_cap_tokens: int, policy: LengthAwareRouting) -> str:
    """:data:`LONG` when ``output_cap_tokens`` (the request's whole output cap, tokens) exceeds
    ``policy.long_output_tokens``, else :data:`SHORT`."""
    return LONG if output_cap_tokens > policy.long_output_tokens else SHORT


def gpu_tier(config: Config, gpu: str, policy: LengthAwareRouting) -> str:
    """:data:`FAST_TIER` when GPU type ``gpu``'s profile has ``relative_capacity >=
    policy.fast_min_relative_capacity``, else :data:`STANDARD_TIER`.

    Raises:
        KeyError: ``gpu`` has no profile (config validation refuses such endpoints).
    """
    fast = config.gpu_profiles[gpu].relative_capacity >= policy.fast_min_relative_capacity
    return FAST_TIER if fast else STANDARD_TIER
