"""inferlb: an Envoy control plane (xDS + ext_proc) that load-balances LLM inference over GPU fleets.

The core package holds config, fleet model, weights, quotas, token counting and request parsing; it
starts no server and does no I/O at import. Services live in ``xds_server``, ``ext_proc`` and ``gpusim``.
"""

__version__ = "0.1.0"
