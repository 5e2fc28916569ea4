"""When a service may take a changed config file at run time: the two rules xds_server and ext_proc share.

Both services poll their config file by content hash. A file written in place (``open(path, "w")``, an
editor saving without a rename, ``cat > file``) is, for a moment, cut short, and a cut at a line break is
usually still valid YAML: the sections after the cut are simply missing (a file cut before ``tenants:``
parses into a config with no tenants, and every request then gets 401). Two rules keep such a file from
being served:

- **stability** (:class:`StableContent`): a changed content is taken only when two consecutive polls read
  the same bytes (the same sha256). A write that finishes within one poll interval is never seen half-done
  twice in a row, so it is never taken half-done; the cost is one more poll interval before a change
  applies.
- **no emptied section** (:func:`emptied_sections`, :func:`check_not_emptied`): a changed file that has no
  models, no endpoints or no tenants where the running config has some is refused, unless it lists the
  section in its top-level ``allow_empty`` (``allow_empty: [tenants]``). This catches a cut that stays put
  longer than a poll (a writer that stalled), when it drops whole sections.

What neither rule catches is a file cut inside a list that keeps every section non-empty and stays cut for
two polls: only an atomic replace (write a temporary file in the same directory, then ``mv`` it over the
config: ``rename(2)`` swaps the whole file at once) rules that out. Start-up is not gated: the file read at
start is the one served (it must still pass every check).

Pure: digests and configs in, decisions out; the services do the reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, get_args

from inferlb.config.schema import Config, EmptiableSection
from inferlb.errors import ConfigError

#: The sections :func:`emptied_sections` compares, in file order.
SECTIONS: Final[tuple[EmptiableSection, ...]] = get_args(EmptiableSection)


@dataclass(frozen=True, kw_only=True)
class StableContent:
    """The stability rule over a sequence of polls, one :meth:`observe` per poll.

    Attributes:
        taken: digest of the content last taken (applied or refused: a refused content is reported once,
            not every poll); None before any.
        seen: digest read on the previous poll that differed from ``taken`` (a change seen once, not yet
            taken); None when the previous poll read ``taken``.
    """

    taken: str | None = None
    seen: str | None = None

    def observe(self, digest: str) -> tuple[StableContent, bool]:
        """One poll read content of ``digest`` (any string that identifies the bytes, e.g. sha256 hex).

        Returns:
            ``(the next state, take)``: ``take`` is True when the content differs from ``taken`` and the
            previous poll read the same digest (it has been stable across two polls); the caller then
            validates and applies (or refuses) it, and the next state records it as ``taken``. A poll that
            reads ``taken`` again (a change undone) forgets the change seen.
        """
        if digest == self.taken:
            return StableContent(taken=self.taken), False
        if digest == self.seen:
            return StableContent(taken=digest), True
        return StableContent(taken=self.taken, seen=digest), False


def _entries(config: Config, section: EmptiableSection) -> int:
    return len(getattr(config, section))


def emptied_sections(running: Config, new: Config) -> list[tuple[str, str]]:
    """The sections ``new`` empties: ``running`` has entries there, ``new`` has none and does not name the
    section in ``allow_empty``.

    Returns:
        one ``(section, message)`` per such section (``models``, ``endpoints``, ``tenants``), the message
        naming ``allow_empty``; empty when ``new`` may replace ``running``.
    """
    problems: list[tuple[str, str]] = []
    for section in SECTIONS:
        had = _entries(running, section)
        if had and not _entries(new, section) and section not in new.allow_empty:
            problems.append(
                (
                    section,
                    f"the running config has {had} {section} and this file has none (a file cut short "
                    f"while being written?); to empty it on purpose, add 'allow_empty: [{section}]' to "
                    "the file",
                )
            )
    return problems


def check_not_emptied(running: Config | None, new: Config, source: str) -> None:
    """Refuse a changed file that empties a section of the running config (:func:`emptied_sections`).

    Args:
        running: the config being served; None at start-up (nothing to compare: never refused).
        new: the changed file's config.
        source: the file, for the error.

    Raises:
        ConfigError: one problem per emptied section, its field the section's name.
    """
    if running is None:
        return
    problems = emptied_sections(running, new)
    if problems:
        raise ConfigError(source, problems)
