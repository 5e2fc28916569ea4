"""inferlb.config.changes: a changed file is taken only once stable across two polls, and never when it
empties the running config's models, endpoints or tenants unless ``allow_empty`` names the section."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from inferlb.config.changes import SECTIONS, StableContent, check_not_emptied, emptied_sections
from inferlb.config.schema import Config, default_config_path, parse_config
from inferlb.errors import ConfigError


def _run(start: str | None, polls: list[str]) -> list[str]:
    """The digests taken over a sequence of polls."""
    state = StableContent(taken=start)
    taken = []
    for digest in polls:
        state, take = state.observe(digest)
        if take:
            taken.append(digest)
    return taken


def test_a_change_is_taken_on_its_second_poll_only() -> None:
    state = StableContent(taken="a")
    state, take = state.observe("b")
    assert not take and state == StableContent(taken="a", seen="b")
    state, take = state.observe("b")
    assert take and state == StableContent(taken="b")
    state, take = state.observe("b")
    assert not take


def test_a_half_written_file_seen_once_is_never_taken() -> None:
    # poll 1 reads the first half, poll 2 the whole file, poll 3 the whole file again
    assert _run("old", ["half", "whole", "whole"]) == ["whole"]
    # a change undone before it settled is forgotten
    assert _run("old", ["half", "old", "half"]) == []


@given(
    start=st.sampled_from(["a", "b", None]),
    polls=st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=40),
)
def test_taken_only_after_two_equal_polls_and_once_per_run(start: str | None, polls: list[str]) -> None:
    state = StableContent(taken=start)
    previous: str | None = None
    last_taken = start
    for digest in polls:
        state, take = state.observe(digest)
        if take:
            # the same bytes on this poll and the one before, and not what is served
            assert digest == previous
            assert digest != last_taken
            last_taken = digest
        elif previous == digest:
            # read twice in a row but not taken: it is what is served already
            assert digest == last_taken
        assert state.taken == last_taken
        previous = digest


@given(st.lists(st.sampled_from(["x", "y"]), min_size=1, max_size=30))
def test_content_that_never_reads_the_same_twice_in_a_row_is_never_taken(flips: list[str]) -> None:
    alternating = [d for i, d in enumerate(flips) if i == 0 or d != flips[i - 1]]
    assert _run("served", alternating) == []


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    data = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _config(doc: dict[str, Any], **changes: Any) -> Config:
    d = copy.deepcopy(doc)
    d.update(changes)
    return parse_config(d)


def test_a_file_cut_before_tenants_is_refused_with_the_field_named(doc: dict[str, Any]) -> None:
    running = _config(doc)
    cut = _config({k: v for k, v in doc.items() if k != "tenants"})
    assert [f for f, _ in emptied_sections(running, cut)] == ["tenants"]
    with pytest.raises(ConfigError) as err:
        check_not_emptied(running, cut, "inferlb.yaml")
    assert err.value.source == "inferlb.yaml"
    (field, message), = err.value.problems
    assert field == "tenants"
    assert "allow_empty: [tenants]" in message and "3 tenants" in message


def test_each_emptied_section_is_named(doc: dict[str, Any]) -> None:
    running = _config(doc)
    bare = _config(doc, models=[], endpoints=[], tenants=[])
    assert [f for f, _ in emptied_sections(running, bare)] == list(SECTIONS)
    no_endpoints = _config(doc, endpoints=[])
    assert [f for f, _ in emptied_sections(running, no_endpoints)] == ["endpoints"]


def test_allow_empty_lets_a_file_empty_what_it_names(doc: dict[str, Any]) -> None:
    running = _config(doc)
    assert emptied_sections(running, _config(doc, tenants=[], allow_empty=["tenants"])) == []
    both = _config(doc, tenants=[], endpoints=[], allow_empty=["tenants"])
    assert [f for f, _ in emptied_sections(running, both)] == ["endpoints"]
    with pytest.raises(ConfigError) as err:
        parse_config({**doc, "allow_empty": ["gpu_profiles"]})
    assert err.value.problems[0][0].startswith("allow_empty")


def test_fewer_entries_an_already_empty_section_and_start_up_are_not_refused(doc: dict[str, Any]) -> None:
    running = _config(doc)
    assert emptied_sections(running, _config(doc, tenants=doc["tenants"][:1])) == []
    empty = _config(doc, tenants=[], allow_empty=["tenants"])
    assert emptied_sections(empty, _config(doc, tenants=[])) == []  # nothing there to lose
    check_not_emptied(None, _config(doc, tenants=[]), "inferlb.yaml")  # start-up: nothing to compare
