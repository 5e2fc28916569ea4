"""The prompt cache (whole chat messages and long texts per counter): a cached count always equals the
uncached one, the budget holds, concurrent counting agrees, and the counting deadline still stops work."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferlb.request.parsing import ChatMessage, EndpointKind, ImageDetail, InferenceRequest
from inferlb.request.tokens import (
    PROMPT_CACHE_ENTRY_CHARS,
    PROMPT_CACHE_MAX_ENTRY_CHARS,
    REPLY_PRIMING_TOKENS,
    SEGMENT_CHARS,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    ByteCeilingCounter,
    CountingBudgetExceededError,
    PromptCountCache,
    TiktokenCounter,
    count_chat_messages,
    count_each_prompt,
    count_prompt_tokens,
    count_text,
    image_tokens,
    prompt_cache_of,
)

UNCACHED = TiktokenCounter(cache_chars=0, prompt_cache_chars=0)

texts = st.text(max_size=60) | st.sampled_from(
    ["", " ", "hello world", "<|endoftext|>", "é😀\n\n  x", "日本語"]
)
messages = st.builds(
    ChatMessage,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    name=st.none() | st.text(max_size=8),
    texts=st.lists(texts, max_size=3).map(tuple),
    images=st.lists(st.sampled_from(list(ImageDetail)), max_size=2).map(tuple),
)
conversations = st.lists(messages, max_size=8)
per_images = st.none() | st.integers(0, 2000)


def reference(msgs: tuple[ChatMessage, ...], per_image: int | None) -> int:
    """The cookbook formula spelled out, every text counted by the uncached counter."""
    total = REPLY_PRIMING_TOKENS
    for m in msgs:
        total += (
            TOKENS_PER_MESSAGE + count_text(m.role, UNCACHED) + sum(count_text(t, UNCACHED) for t in m.texts)
        )
        if m.name is not None:
            total += count_text(m.name, UNCACHED) + TOKENS_PER_NAME
        total += sum(image_tokens(d, per_image) for d in m.images)
    return total


def chat(msgs: tuple[ChatMessage, ...]) -> InferenceRequest:
    return InferenceRequest(kind=EndpointKind.CHAT_COMPLETIONS, model="m", messages=msgs)


@settings(max_examples=60, deadline=None)
@given(
    system=messages,
    turns=st.lists(st.tuples(messages, messages), min_size=1, max_size=6),
    other=conversations,
    edit_at=st.integers(0, 20),
    edit=messages,
    per_image=per_images,
    budget=st.sampled_from([0, 300, 3_000, 1 << 20]),
)
@example(  # a message whose text equals another message's role: the keys must still differ
    system=ChatMessage(role="user", texts=("system",)),
    turns=[(ChatMessage(role="system", texts=("user",)), ChatMessage(role="user", name="", texts=()))],
    other=[],
    edit_at=0,
    edit=ChatMessage(role="user"),
    per_image=None,
    budget=1 << 20,
)
def test_growing_shared_and_edited_conversations_count_as_uncached(
    system: ChatMessage,
    turns: list[tuple[ChatMessage, ChatMessage]],
    other: list[ChatMessage],
    edit_at: int,
    edit: ChatMessage,
    per_image: int | None,
    budget: int,
) -> None:
    counter = TiktokenCounter(cache_chars=budget, prompt_cache_chars=budget)
    history: tuple[ChatMessage, ...] = (system,)
    seen = []
    for user, assistant in turns:  # turn by turn: the earlier messages are resent each time
        history = (*history, user)
        seen.append(history)
        history = (*history, assistant)
    # a second conversation sharing the system prompt and first turn; the longest one edited in the middle
    seen.append((*seen[0], *other))
    at = edit_at % len(history)
    seen.append((*history[:at], edit, *history[at + 1 :]))
    for msgs in seen + seen[::-1]:  # each again, from the cache where it fits
        got = count_chat_messages(msgs, counter, per_image=per_image)
        assert got == count_chat_messages(msgs, UNCACHED, per_image=per_image) == reference(msgs, per_image)
        assert counter.prompt_cache.cached_chars <= counter.prompt_cache.max_chars
        assert counter.cache.cached_chars <= counter.cache.max_chars


@settings(max_examples=25, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(texts, st.integers(1, 3 * SEGMENT_CHARS // 60)).map(lambda p: p[0] * p[1])
        | st.lists(st.integers(0, 100), max_size=5).map(tuple),
        min_size=1,
        max_size=4,
    ),
    tools=st.none() | texts.map(lambda t: '{"name":"' + t * 200 + '"}'),
)
def test_long_prompts_tools_and_prompt_lists_count_as_uncached(
    prompts: list[str | tuple[int, ...]], tools: str | None
) -> None:
    counter = TiktokenCounter(prompt_cache_chars=4 * SEGMENT_CHARS)
    request = InferenceRequest(
        kind=EndpointKind.COMPLETIONS,
        model="m",
        prompts=tuple(prompts),
        texts=tuple(p for p in prompts if isinstance(p, str)),
    )
    conv = InferenceRequest(
        kind=EndpointKind.CHAT_COMPLETIONS,
        model="m",
        messages=(ChatMessage(role="user", texts=("hi",)),),
        tools_json=tools,
    )
    for _ in range(2):
        assert count_each_prompt(request, counter) == count_each_prompt(request, UNCACHED)
        assert count_prompt_tokens(conv, counter) == count_prompt_tokens(conv, UNCACHED)
        assert counter.prompt_cache.cached_chars <= counter.prompt_cache.max_chars
    # only texts over a segment are kept whole (shorter ones are CountCache's)
    long_texts = {p for p in prompts if isinstance(p, str) and len(p) > SEGMENT_CHARS}
    assert len(counter.prompt_cache) <= len(long_texts) + 2  # + the message, + long tools JSON


def test_a_later_request_reuses_the_earlier_messages() -> None:
    calls: list[str] = []

    class Recording(TiktokenCounter):
        __slots__ = ()

        def count(self, text: str) -> int:
            calls.append(text)
            return super().count(text)

    counter = Recording()
    turn1 = (ChatMessage(role="system", texts=("be brief",)), ChatMessage(role="user", texts=("hi",)))
    count_chat_messages(turn1, counter)
    calls.clear()
    turn2 = (
        *turn1,
        ChatMessage(role="assistant", texts=("hello",)),
        ChatMessage(role="user", texts=("bye",)),
    )
    assert count_chat_messages(turn2, counter) == reference(turn2, None)
    assert calls == ["assistant", "hello", "user", "bye"]  # the two new messages only


def test_the_budget_is_lru_in_characters_and_big_entries_are_skipped() -> None:
    entry = 10 + PROMPT_CACHE_ENTRY_CHARS
    cache = PromptCountCache(max_chars=2 * entry)
    a, b, c = ("a" * 10, "b" * 10, "c" * 10)
    cache.put_many([(a, 1), (b, 2)])
    assert cache.get_many([a]) == [1]  # a is now the most recent
    cache.put_many([(c, 3)])  # evicts b
    assert cache.get_many([a, b, c]) == [1, None, 3] and cache.cached_chars == 2 * entry
    # a message is charged its role, name and texts
    key = ("user", "bob", ("xy", "z"))
    cache.put_many([(key, 9)])
    assert cache.get_many([key]) == [9] and len(cache) == 2
    huge = PromptCountCache()
    huge.put_many([("x" * PROMPT_CACHE_MAX_ENTRY_CHARS, 1), ("y", 1)])
    assert len(huge) == 1 and huge.get_many(["y"]) == [1]


def test_counters_without_a_caching_prompt_cache_count_directly() -> None:
    assert prompt_cache_of(ByteCeilingCounter()) is None
    assert prompt_cache_of(UNCACHED) is None
    msgs = (ChatMessage(role="user", texts=("héllo",)),)
    assert count_chat_messages(msgs, ByteCeilingCounter()) == 3 + 4 + 6 + 3


def test_concurrent_counting_on_one_counter_agrees_and_keeps_the_bound() -> None:
    counter = TiktokenCounter(cache_chars=2_000, prompt_cache_chars=2_000)
    convs = [
        tuple(ChatMessage(role="user", texts=(f"turn {i} of {c} é{'x' * (i * 7 % 50)}",)) for i in range(n))
        for c, n in enumerate(range(1, 25))
    ]
    expected = [count_chat_messages(m, UNCACHED) for m in convs]
    errors: list[str] = []
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        start.wait()
        for k in range(300):
            i = (k * (seed + 3)) % len(convs)
            got = count_chat_messages(convs[i], counter)
            if got != expected[i]:
                errors.append(f"conversation {i}: {got} != {expected[i]}")
            if counter.prompt_cache.cached_chars > 2_000:
                errors.append("over budget")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert 0 < counter.prompt_cache.cached_chars <= 2_000


class _SlowOn(TiktokenCounter):
    """A counter that takes 50 ms on the text ``slow``."""

    __slots__ = ()

    def count(self, text: str) -> int:
        if text == "slow":
            time.sleep(0.05)
        return super().count(text)


def test_the_deadline_still_stops_counting_and_keeps_what_was_counted() -> None:
    counter = _SlowOn()
    msgs = tuple(ChatMessage(role="user", texts=(t,)) for t in ("fast", "slow", "late"))
    with pytest.raises(CountingBudgetExceededError):
        count_chat_messages(msgs, counter, deadline=time.monotonic() + 0.02)
    # the two messages counted before the deadline passed are kept; the third was never counted
    keys = [(m.role, m.name, m.texts) for m in msgs]
    framed = [reference((m,), None) - REPLY_PRIMING_TOKENS for m in msgs[:2]]
    assert counter.prompt_cache.get_many(keys) == [*framed, None]
    # a passed deadline is refused even when every message is cached, as before the cache
    count_chat_messages(msgs, counter)
    with pytest.raises(CountingBudgetExceededError) as err:
        count_chat_messages(msgs, counter, deadline=time.monotonic() - 1)
    assert err.value.counted_chars == 0
    long = "word " * (SEGMENT_CHARS // 2)
    count_prompt_tokens(InferenceRequest(kind=EndpointKind.COMPLETIONS, model="m", prompts=(long,)), counter)
    with pytest.raises(CountingBudgetExceededError):
        count_each_prompt(
            InferenceRequest(kind=EndpointKind.COMPLETIONS, model="m", prompts=(long,)),
            counter,
            deadline=time.monotonic() - 1,
        )
