"""inferlb's xDS control server: config -> Envoy resources -> versioned snapshots -> ADS streams.

Layers, each importing only the ones before it (shared/STYLE.md, item 3):

- :mod:`xds_server.resources`: pure functions from an :class:`inferlb.config.Config` to Envoy v3 protos.
- :mod:`xds_server.cache`: immutable versioned snapshots, their consistency check, the snapshot cache.
- :mod:`xds_server.sotw`: the state-of-the-world protocol state of one stream (no I/O).
- :mod:`xds_server.ads`: the grpcio aio servicer, a thin adapter over the above.
- :mod:`xds_server.server`: the server lifecycle and the config-file poller; ``__main__`` runs it.
"""
