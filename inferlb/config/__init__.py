"""The fleet and config model (core): the config file's typed schema and the run-time checks every service
runs before taking a file.

- :mod:`inferlb.config.schema`: pydantic models of the YAML config (gateway, xDS, ext_proc, GPU profiles,
  models, endpoints, tenants, weights, telemetry), parsing with field-named errors, the embedded default.
- :mod:`inferlb.config.checks`: the checks a parsed config must also pass (tokenizers load, endpoint host
  names resolve), shared by ``xds_server``, ``ext_proc`` and ``inferlb validate``.
- :mod:`inferlb.config.changes`: when a changed file may be taken at run time (stable across two polls, no
  section emptied unless ``allow_empty`` says so), shared by ``xds_server`` and ``ext_proc``.

May import: :mod:`inferlb.errors`, :mod:`inferlb.request` (tokenizers), pydantic, PyYAML; no server, client
or simulator.
"""
