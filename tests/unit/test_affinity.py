"""inferlb.policy.affinity: session and prefix keys."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from inferlb.policy.affinity import KEY_HEX_CHARS, affinity_keys, prefix_key, session_key
from inferlb.request.parsing import EndpointKind, InferenceRequest, parse_request

_KEY = re.compile(rf"^[0-9a-f]{{{KEY_HEX_CHARS}}}$")
texts = st.text(min_size=1, max_size=40)


def chat(messages: list[dict[str, Any]], **extra: Any) -> InferenceRequest:
    body = json.dumps({"model": "m", "messages": messages, **extra}).encode()
    return parse_request(EndpointKind.CHAT_COMPLETIONS, body)


@given(system=texts, first=texts, later=st.lists(st.tuples(texts, texts), max_size=5))
def test_a_growing_conversation_keeps_its_prefix_key(
    system: str, first: str, later: list[tuple[str, str]]
) -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": first},
    ]
    key = prefix_key(chat(msgs))
    assert key is not None and _KEY.match(key)
    for answer, question in later:
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        assert prefix_key(chat(msgs)) == key


@given(system=texts, a=texts, b=texts)
def test_different_openings_get_different_keys(system: str, a: str, b: str) -> None:
    ka = prefix_key(chat([{"role": "system", "content": system}, {"role": "user", "content": a}]))
    kb = prefix_key(chat([{"role": "system", "content": system}, {"role": "user", "content": b}]))
    assert (ka == kb) == (a == b)


def test_the_system_prompt_and_part_boundaries_count() -> None:
    base = [{"role": "user", "content": "hello"}]
    assert prefix_key(chat([{"role": "system", "content": "x"}, *base])) != prefix_key(chat(base))
    split_a = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]
    split_b = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "bc"}]}]
    assert prefix_key(chat(split_a)) != prefix_key(chat(split_b))


def test_no_user_message_no_prefix_key_and_embeddings_have_none() -> None:
    assert prefix_key(chat([{"role": "system", "content": "only a system prompt"}])) is None
    emb = parse_request(EndpointKind.EMBEDDINGS, b'{"model": "m", "input": "some text"}')
    assert prefix_key(emb) is None


def test_completions_key_on_the_start_of_the_first_prompt() -> None:
    def comp(prompt: Any) -> InferenceRequest:
        return parse_request(EndpointKind.COMPLETIONS, json.dumps({"model": "m", "prompt": prompt}).encode())

    doc = "Once upon a time " * 100  # longer than COMPLETION_PREFIX_CHARS
    assert prefix_key(comp(doc)) == prefix_key(comp(doc + " and then more"))
    assert prefix_key(comp("short one")) != prefix_key(comp("short two"))
    ids = list(range(300))
    assert prefix_key(comp(ids)) == prefix_key(comp([*ids, 7, 8]))
    assert prefix_key(comp([1, 2, 3])) != prefix_key(comp([1, 2, 4]))


@given(user=st.text(max_size=30), header=st.one_of(st.none(), st.text(max_size=30)))
def test_session_key_prefers_the_header_and_is_header_safe(user: str, header: str | None) -> None:
    key = session_key(user or None, header)
    if not (header or user):
        assert key is None
        return
    assert key is not None and _KEY.match(key)  # CR/LF or non-ASCII in a user id never reach a header
    assert key == session_key(None, header or user)


def test_affinity_keys_of_a_request() -> None:
    req = chat([{"role": "user", "content": "hi"}], user="alice")
    keys = affinity_keys(req)
    assert keys.session == session_key("alice", None)
    assert keys.prefix == prefix_key(req)
    assert affinity_keys(req, "sess-1").session == session_key(None, "sess-1") != keys.session
