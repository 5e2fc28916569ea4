"""The gateway's block keys (inferlb.request.blocks): chained per full block, resumable from a parent key,
equal to the keys of gpusim's token-id layout, and the per-conversation memo never changes a result."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.request import blocks
from inferlb.request.blocks import ROOT_KEY, block_keys_of_tokens, prompt_block_keys, root_key
from inferlb.request.parsing import EndpointKind, InferenceRequest, parse_request
from inferlb.request.prompt_ids import SizedLru, conversation_ids, prompt_token_ids

token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=80)


def chat(messages: list[dict[str, Any]], **extra: Any) -> InferenceRequest:
    body = msgspec.json.encode({"model": "m", "messages": messages, **extra})
    return parse_request(EndpointKind.CHAT_COMPLETIONS, body)


def completion(prompt: Any) -> InferenceRequest:
    return parse_request(EndpointKind.COMPLETIONS, msgspec.json.encode({"model": "m", "prompt": prompt}))


def test_the_formula_is_xxh3_over_little_endian_ids_seeded_by_the_parent() -> None:
    ids = list(range(40))
    first = xxhash.xxh3_64_intdigest(b"".join(i.to_bytes(4, "little") for i in ids[:16]), ROOT_KEY)
    second = xxhash.xxh3_64_intdigest(b"".join(i.to_bytes(4, "little") for i in ids[16:32]), first)
    assert block_keys_of_tokens(ids) == (first, second)  # the 8 ids after them are a partial block


@settings(deadline=None)
@given(ids=token_ids, bs=st.integers(1, 8), data=st.data())
def test_keys_chain_and_resume_from_a_parent(ids: list[int], bs: int, data: st.DataObject) -> None:
    keys = block_keys_of_tokens(ids, block_size=bs)
    assert len(keys) == len(ids) // bs
    k = data.draw(st.integers(0, len(keys)))
    parent = keys[k - 1] if k else None
    assert block_keys_of_tokens(ids[k * bs :], block_size=bs, parent=parent) == keys[k:]
    # a prefix's keys are the leading keys
    assert block_keys_of_tokens(ids[: k * bs], block_size=bs) == keys[:k]


@settings(deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), bs=st.integers(1, 8), data=st.data())
def test_one_changed_token_changes_its_block_and_every_later_one(
    ids: list[int], bs: int, data: st.DataObject
) -> None:
    i = data.draw(st.integers(0, len(ids) - 1))
    other = [*ids[:i], (ids[i] + 1) % 2**32, *ids[i + 1 :]]
    a, b = block_keys_of_tokens(ids, block_size=bs), block_keys_of_tokens(other, block_size=bs)
    assert a[: i // bs] == b[: i // bs]
    assert all(x != y for x, y in zip(a[i // bs :], b[i // bs :], strict=True))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys_of_tokens([1, 2], block_size=0)
    with pytest.raises(ValueError, match="token ids"):
        block_keys_of_tokens([1, 2**32])
    with pytest.raises(ValueError, match="token ids"):
        block_keys_of_tokens([-1])
    with pytest.raises(ValueError, match="parent"):
        block_keys_of_tokens([1], block_size=1, parent=2**64)
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_keys(chat([{"role": "user", "content": "hi"}]), block_size=0)


def test_a_requests_keys_are_those_of_its_first_prompts_ids() -> None:
    req = chat([{"role": "system", "content": "Be brief. " * 40}, {"role": "user", "content": "Hello."}])
    (ids,) = prompt_token_ids(req)
    keys = prompt_block_keys(req)
    assert keys and keys == block_keys_of_tokens(ids) and len(keys) == len(ids) // 16
    assert prompt_block_keys(req, block_size=4) == block_keys_of_tokens(ids, block_size=4)
    texts = completion(["first prompt " * 20, "second prompt " * 20])
    assert prompt_block_keys(texts) == block_keys_of_tokens(prompt_token_ids(texts)[0])
    assert prompt_block_keys(completion([list(range(40)), [1, 2]])) == block_keys_of_tokens(range(40))
    # a token id no vocabulary has: the request has no keys (the server refuses it)
    assert prompt_block_keys(completion([2**40, *range(40)])) == ()
    assert prompt_block_keys(completion("short")) == ()
    # a LoRA adapter's blocks chain on a root of their own
    lora = prompt_block_keys(req, lora_name="sql-adapter")
    assert lora == block_keys_of_tokens(ids, parent=root_key("sql-adapter")) and lora[0] != keys[0]
    assert root_key(None) == ROOT_KEY != root_key("sql-adapter")


def test_equal_leading_messages_give_equal_leading_keys() -> None:
    system = {"role": "system", "content": "You answer questions about the fleet's caches. " * 30}
    a = prompt_block_keys(chat([system, {"role": "user", "content": "What is a block? " * 10}]))
    b = prompt_block_keys(chat([system, {"role": "user", "content": "What is eviction? " * 10}]))
    ends: list[int] = []
    conversation_ids(chat([system]), message_ends=ends)
    shared = ends[-1] // 16
    assert shared > 10 and a[:shared] == b[:shared]
    assert len(a) > shared and all(x != y for x, y in zip(a[shared:], b[shared:], strict=False))


messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]),
         "content": st.text(st.sampled_from("ab c.\n"), max_size=120)}
    ),
    min_size=1, max_size=6,
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(messages, min_size=1, max_size=4), bs=st.sampled_from([1, 4, 16]))
def test_the_memo_never_changes_the_keys_of_a_growing_conversation(
    turns: list[list[dict[str, str]]], bs: int
) -> None:
    """A chat client resends its conversation with each new turn: every turn's keys (memo hit or not) are
    the keys of its ids computed from scratch."""
    blocks._MEMO.clear()
    sent: list[dict[str, str]] = []
    for turn in turns:
        sent = [*sent, *turn]
        req = chat(sent)
        assert prompt_block_keys(req, block_size=bs) == block_keys_of_tokens(
            prompt_token_ids(req)[0], block_size=bs
        )
        assert prompt_block_keys(req, block_size=bs) == block_keys_of_tokens(
            prompt_token_ids(req)[0], block_size=bs
        )  # the same conversation again: a hit at its last message


def test_the_memo_is_bounded_and_resumes_a_conversation_from_its_previous_turn() -> None:
    blocks._MEMO.clear()
    memo = blocks._MEMO
    first = [{"role": "system", "content": "A long system prompt. " * 100}, {"role": "user", "content": "q1"}]
    prompt_block_keys(chat(first))
    assert len(memo) == 1
    ((_, stored),) = memo._entries.items()
    second = [*first, {"role": "assistant", "content": "a1 " * 30}, {"role": "user", "content": "q2"}]
    keys = prompt_block_keys(chat(second))
    assert keys[: len(stored)] == stored and keys == block_keys_of_tokens(prompt_token_ids(chat(second))[0])
    assert len(memo) == 2
    small: SizedLru[bytes, tuple[int, ...]] = SizedLru(40, max_entry=10)
    for i in range(10):
        small.put(bytes([i]), tuple(range(8)))
    assert small.total == 40 and len(small) == 5 and small.get(b"\x00") is None and small.get(b"\x09")
    small.put(b"big", tuple(range(11)))  # longer than max_entry: not kept
    assert small.get(b"big") is None
