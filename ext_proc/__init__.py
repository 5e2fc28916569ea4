"""inferlb's Envoy external processor (envoy.service.ext_proc.v3): reads each OpenAI request, checks key,
quota and model, counts prompt tokens and sets the ``x-inferlb-*`` routing headers.

``handlers`` holds the decisions (plain values), ``servicer`` the grpcio aio adapter, ``reload`` the config
file poller, and ``__main__`` the process (``python -m ext_proc --config PATH``).
"""
