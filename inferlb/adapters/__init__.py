"""Adapters: the core's seams bound to real I/O, one external system per module.

- :mod:`inferlb.adapters.quota_redis`: the quota store over Redis (atomic Lua scripts), shared by several
  ext_proc replicas.
- :mod:`inferlb.adapters.state_redis`: one versioned JSON document in Redis shared by several processes
  (compare-and-set writes, announced on a channel): the xDS server replicas' fleet store.
- :mod:`inferlb.adapters.nvml`: GPU readings through NVML (nvidia-ml-py) behind a ``typing.Protocol``.
- :mod:`inferlb.adapters.kv_events`: the model servers' KV events (ZMQ SUB, vLLM's wire format, its replay
  socket on a sequence gap) into the precise prefix index.
- :mod:`inferlb.adapters.unix_socket`: the gRPC services' Unix domain sockets (owner-only file mode).
- :mod:`inferlb.adapters.tls`: mutual TLS on the services' sockets (an ``ssl.SSLContext``), certificates read
  again when their files change; :mod:`inferlb.adapters.tls_grpc`: the same as grpc server credentials.

May import: the core (:mod:`inferlb.errors`, :mod:`inferlb.config`, :mod:`inferlb.request`,
:mod:`inferlb.policy`) and their client library; no service, operator tool or simulator.
"""
