"""The OpenAI request side (core): what a request says and what it costs, as plain values.

- :mod:`inferlb.request.parsing`: OpenAI bodies (chat, completions, embeddings, Responses) to
  :class:`~inferlb.request.parsing.InferenceRequest`; errors in OpenAI's vocabulary.
- :mod:`inferlb.request.tokens`: prompt token counting (tiktoken, HF ``tokenizers``, byte estimate).
- :mod:`inferlb.request.usage`: metering a response's ``usage`` (JSON, SSE, counted deltas).
- :mod:`inferlb.request.rewrite`: the body rewrite (alias to canonical model name, stream usage).
- :mod:`inferlb.request.prompt_ids`: a request's prompt token ids as the prefix caches see them (the layout
  the gateway and gpusim share).
- :mod:`inferlb.request.blocks`: the chained keys of a prompt's full token blocks (what the endpoint picker
  matches against the prefix caches).
- :mod:`inferlb.request.headers`: the ``x-inferlb-*`` header names between the gateway and model servers.

May import: :mod:`inferlb.errors`, tiktoken, tokenizers, xxhash; no config model, server, client or simulator.
"""
