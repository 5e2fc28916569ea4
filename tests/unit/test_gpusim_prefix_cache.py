"""gpusim with the prefix cache: the engine prefills only uncached tokens, prompts become token ids as the
gateway counts them, and the cache shows under vLLM's metric names and types."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from inferlb.request.parsing import EndpointKind, parse_request
from inferlb.request.prompt_ids import prompt_token_ids, text_ids
from inferlb.request.tokens import SEGMENT_CHARS, count_prompt_tokens, count_text, default_counter
from simulation.gpusim.engine import BatchEngine, EngineStats, FirstTokenEmitted, TimingModel
from simulation.gpusim.vllm_metrics import CacheConfigInfo, EndpointMetrics
from simulation.kvcache import PrefixCache, PromptBlocks, block_hashes

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "vllm_metric_families_v0.26.0.txt"


def timing(**kw: int) -> TimingModel:
    return TimingModel(
        relative_capacity=1.0,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=50.0,
        max_batch=4,
        max_queue=3,
        kv_budget_tokens=kw.get("kv_budget_tokens", 10_000),
    )


def blocks(tokens: list[int], bs: int = 16) -> tuple[PromptBlocks, ...]:
    return (PromptBlocks(tokens=len(tokens), hashes=block_hashes(tokens, block_size=bs)),)


def ttft(engine: BatchEngine, at: float, rid: str, tokens: list[int] | None, n_prompt: int) -> float:
    """Submit at ``at`` on an idle engine and run it to the end; the request's time to first token."""
    engine.submit(
        at, request_id=rid, prompt_tokens=n_prompt, completion_tokens=2,
        prompts=None if tokens is None else blocks(tokens),
    )  # fmt: skip
    events = engine.advance(at + 50.0)
    (first,) = [e for e in events if isinstance(e, FirstTokenEmitted)]
    return first.at - at


# -- the engine ----------------------------------------------------------------------------------------------


def test_a_repeated_prompt_prefills_only_its_uncached_tokens() -> None:
    engine = BatchEngine(model=timing(), prefix_cache=PrefixCache(num_blocks=625, block_size=16))
    prompt = list(range(1000))
    cold = ttft(engine, 0.0, "a", prompt, 1000)
    warm = ttft(engine, 100.0, "b", prompt, 1000)
    assert cold == pytest.approx(engine.model.prefill_seconds(1000))
    # 62 full blocks of 16 hit (992 tokens); the last 8 are prefilled
    assert warm == pytest.approx(engine.model.prefill_seconds(8))
    st_ = engine.stats()
    assert (st_.prefix_cache_queries_total, st_.prefix_cache_hits_total) == (2000, 992)
    assert st_.prompt_tokens_total == 2000  # vLLM's prompt_tokens_total counts cached tokens too
    assert engine.prefix_cache is not None and engine.prefix_cache.blocks_in_use == 0


def test_without_a_cache_or_without_blocks_every_token_is_prefilled() -> None:
    plain = BatchEngine(model=timing())
    prompt = list(range(1000))
    ttft(plain, 0.0, "a", prompt, 1000)
    assert ttft(plain, 100.0, "b", prompt, 1000) == pytest.approx(plain.model.prefill_seconds(1000))
    assert plain.stats().prefix_cache_queries_total == 0
    cached = BatchEngine(model=timing(), prefix_cache=PrefixCache(num_blocks=625))
    ttft(cached, 0.0, "a", None, 1000)
    assert ttft(cached, 100.0, "b", None, 1000) == pytest.approx(cached.model.prefill_seconds(1000))
    assert cached.stats().prefix_cache_queries_total == 2000


def test_a_shared_prefix_hits_across_different_prompts() -> None:
    engine = BatchEngine(model=timing(), prefix_cache=PrefixCache(num_blocks=625))
    system = list(range(640))  # 40 blocks
    ttft(engine, 0.0, "a", [*system, *range(10_000, 10_300)], 940)
    warm = ttft(engine, 100.0, "b", [*system, *range(20_000, 20_300)], 940)
    assert warm == pytest.approx(engine.model.prefill_seconds(940 - 640))


def test_running_requests_pin_their_blocks_and_release_them_on_finish_or_cancel() -> None:
    cache = PrefixCache(num_blocks=625)
    engine = BatchEngine(model=timing(), prefix_cache=cache)
    prompt = list(range(100))
    engine.submit(0.0, request_id="a", prompt_tokens=100, completion_tokens=50, prompts=blocks(prompt))
    # the prompt's ceil(100 / 16) = 7 blocks at scheduling; decode blocks come as tokens are generated
    assert cache.blocks_in_use == 7 and cache.holds("a")
    engine.advance(0.5)  # 0.1 s of prefill, then 20 decode steps of 0.02 s: the 21st token is being fed
    assert cache.blocks_in_use == 6 + 2  # 6 full prompt blocks, then the 4-token tail + 21 tokens
    assert engine.cancel(0.5, "a")
    assert cache.blocks_in_use == 0 and not cache.holds("a")
    engine.submit(1.0, request_id="b", prompt_tokens=100, completion_tokens=3, prompts=blocks(prompt))
    engine.advance(1e6)
    assert cache.blocks_in_use == 0 and cache.hits_total == 96


def test_prompts_must_add_up_to_the_prompt_tokens() -> None:
    engine = BatchEngine(model=timing(), prefix_cache=PrefixCache(num_blocks=8))
    with pytest.raises(ValueError, match="prompts hold 20 tokens, prompt_tokens is 21"):
        engine.submit(0.0, request_id="a", prompt_tokens=21, completion_tokens=1, prompts=blocks([1] * 20))


# -- prompt token ids --------------------------------------------------------------------------------------

texts = st.text(st.characters(codec="utf-8"), max_size=80)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": texts},
        optional={"name": st.from_regex(r"[a-z]{1,8}", fullmatch=True)},
    ),
    min_size=1,
    max_size=5,
)


def chat(msgs: Sequence[Mapping[str, object]], **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": msgs, **extra}).encode()


@settings(max_examples=60, deadline=None)
@given(msgs=messages)
def test_chat_ids_are_as_many_as_the_gateway_counts(msgs: list[dict[str, str]]) -> None:
    req = parse_request(EndpointKind.CHAT_COMPLETIONS, chat(msgs))
    (ids,) = prompt_token_ids(req)
    assert len(ids) == count_prompt_tokens(req)


@settings(max_examples=40, deadline=None)
@given(msgs=messages, more=messages)
def test_a_conversation_that_goes_on_keeps_its_leading_ids(
    msgs: list[dict[str, str]], more: list[dict[str, str]]
) -> None:
    (short,) = prompt_token_ids(parse_request(EndpointKind.CHAT_COMPLETIONS, chat(msgs)))
    (long,) = prompt_token_ids(parse_request(EndpointKind.CHAT_COMPLETIONS, chat(msgs + more)))
    head = len(short) - 3  # all but the reply priming
    assert long[:head] == short[:head]
    a, b = block_hashes(short[:head]), block_hashes(long)
    assert b[: len(a)] == a


def test_long_texts_tools_images_and_token_arrays_match_the_count() -> None:
    long_text = ("lorem ipsum dolor sit amet " * 700) + "x" * (3 * SEGMENT_CHARS)  # clean and unclean cuts
    assert len(text_ids(long_text)) == count_text(long_text, default_counter())
    body = chat(
        [
            {"role": "system", "content": long_text},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "http://x.invalid/a.png", "detail": "low"}},
            ]},
        ],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    )  # fmt: skip
    req = parse_request(EndpointKind.CHAT_COMPLETIONS, body)
    (ids,) = prompt_token_ids(req)
    assert len(ids) == count_prompt_tokens(req)
    comp = parse_request(EndpointKind.COMPLETIONS, b'{"model": "m", "prompt": [[5, 6, 7], [8, 9]]}')
    assert prompt_token_ids(comp) == ((5, 6, 7), (8, 9))
    text = parse_request(EndpointKind.COMPLETIONS, b'{"model": "m", "prompt": ["hello world", "bye"]}')
    assert [len(i) for i in prompt_token_ids(text)] == [2, 1]


def test_equal_text_prefixes_give_equal_block_hashes() -> None:
    head = "You are a helpful assistant. " * 40
    a = text_ids(head + "Tell me about cats. " * 20)
    b = text_ids(head + "Tell me about dogs. " * 20)
    ha, hb = block_hashes(a), block_hashes(b)
    same = len(text_ids(head)) // 16
    assert same >= 10 and ha[: same - 1] == hb[: same - 1]
    # the blocks after the first one that differs differ too, to the end
    assert all(x != y for x, y in zip(ha[same + 1 :], hb[same + 1 :], strict=False))
    assert len(ha) > same + 1


# -- metrics -----------------------------------------------------------------------------------------------


def stats(**kw: int) -> EngineStats:
    values = dict.fromkeys(
        ("running_requests", "running_slots", "waiting_requests", "kv_tokens", "prompt_tokens_total",
         "generation_tokens_total", "requests_finished_total", "requests_refused_total",
         "requests_cancelled_total", "steps_total"), 0,
    )  # fmt: skip
    return EngineStats(
        **values, kv_usage=0.25, busy_seconds_total=0.0, slowdown=1.0,
        prefix_cache_queries_total=kw.get("queries", 0), prefix_cache_hits_total=kw.get("hits", 0),
    )  # fmt: skip


def test_cache_metrics_have_vllm_names_and_types() -> None:
    golden = {}
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("vllm:"):
            name, kind = line.split()
            golden[name] = kind
    metrics = EndpointMetrics(
        model_name="m",
        stats=lambda: stats(queries=3000, hits=992),
        cache_config=CacheConfigInfo(block_size=16, num_gpu_blocks=625, enable_prefix_caching=True),
    )
    text = metrics.exposition().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    exported = {}
    for f in families.values():
        # prometheus_client's *_created series are no vLLM family
        if f.name.startswith("vllm:") and not f.name.endswith("_created"):
            exported[f.name + ("_total" if f.type == "counter" else "")] = f.type
    for name, kind in exported.items():
        assert golden.get(name) == kind, name
    cache_names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    for name in (*cache_names, "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
        assert name in exported
    assert "vllm:gpu_cache_usage_perc" not in text and "gpu_prefix_cache" not in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 992.0' in text
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("16", "625")
