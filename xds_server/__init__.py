"""inferlb's xDS control server: config -> Envoy resources -> versioned snapshots -> ADS streams.

Layers, each importing only the ones before it (as envoyproxy/go-control-plane's ``pkg/resource`` ->
``pkg/cache`` -> ``pkg/server``):

- :mod:`xds_server.resources`: pure functions from an :class:`inferlb.config.schema.Config` to Envoy v3
  protos, one module per resource: :mod:`~xds_server.resources.common` (type URLs, ``PUSH_ORDER``, names,
  proto helpers), :mod:`~xds_server.resources.endpoints` (ClusterLoadAssignments, endpoint keys and
  overrides), :mod:`~xds_server.resources.clusters`, :mod:`~xds_server.resources.listener` (HTTP
  connection manager, HTTP filters, local replies), :mod:`~xds_server.resources.routes`, and
  :mod:`~xds_server.resources.build` (``build_resources``, the whole set).
- :mod:`xds_server.bootstrap`: the Envoy bootstrap (pure; the one module operator tools import);
  :mod:`xds_server.config_source`: the per-type services' variant of the resources (EDS and RDS not
  over ADS).
- :mod:`xds_server.cache`: immutable versioned snapshots, their consistency check, the snapshot cache.
- :mod:`xds_server.fleet_state`: fleet API changes (register, drain, undrain, deregister, weight pins) as
  pure values, and their JSON document; :mod:`xds_server.fleet_store`: that document stored, in the state
  file (atomic replace, one server per file by lock, a bad file refused naming it) or in Redis, shared by
  several servers (compare-and-set, announced and polled; over :mod:`inferlb.adapters.state_redis`).
- :mod:`xds_server.sotw` / :mod:`xds_server.delta`: the state-of-the-world and Delta protocol state of one
  stream (no I/O).
- :mod:`xds_server.coalesce`: push coalescing (debounce with a staleness bound).
- :mod:`xds_server.ads`: the grpcio aio ADS servicer (both modes); :mod:`xds_server.per_type`: CDS, EDS,
  LDS, RDS on the same streams.
- :mod:`xds_server.k8s_mapping`: Kubernetes objects (EndpointSlices, ``InferencePool`` pods) to endpoints,
  pure; :mod:`xds_server.k8s_api`: the seam to the API server (a ``KubeApi`` Protocol: list and watch,
  over lightkube); :mod:`xds_server.k8s_discovery`: list + watch reflectors (resume, 410 relist,
  backoff) feeding the mapping.
- :mod:`xds_server.metrics` and :mod:`xds_server.http_api`: Prometheus metrics and the HTTP API;
  :mod:`xds_server.collector`: telemetry into endpoint weights. Each states what it needs of the server
  as a ``typing.Protocol`` (``MetricsSource``, ``FleetApiServer``, ``TelemetryTarget``) instead of
  importing it.
- :mod:`xds_server.server`: the server lifecycle, the config-file poller and the entry points for
  fleet and telemetry changes; ``__main__`` runs it (and is the only module importing it).
"""
