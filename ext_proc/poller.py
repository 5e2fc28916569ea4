"""Config file polling by content hash: the edge that reads the file, for ``python -m ext_proc``.

A changed file is taken only once two consecutive polls read the same bytes
(:class:`inferlb.config.changes.StableContent`), so a file caught while it is being written in place is
not taken half-done; the caller then refuses a file that empties a section of the running config
(:func:`inferlb.config.changes.check_not_emptied`), as xds_server does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from inferlb.config.changes import StableContent
from inferlb.config.schema import Config, parse_config_yaml
from inferlb.errors import ConfigError


class ConfigPoller:
    """Reads a config file and reports a new :class:`Config` only when its bytes changed and then held
    still for one more poll.

    A file that changed but is invalid raises :class:`ConfigError` once per distinct content, so a bad
    edit is reported once, not every poll, and the caller keeps serving its last good config.

    Args:
        path: the YAML config file.
        current: the sha256 hex digest of the content being served (the file the process started with);
            :meth:`read`'s first element. None: the first stable content is new.

    Attributes:
        stable: the stability rule's state (what was taken last, what the previous poll read).
    """

    def __init__(self, path: str | Path, current: str | None = None) -> None:
        self.path = Path(path)
        self.stable = StableContent(taken=current)

    @property
    def digest(self) -> str | None:
        """sha256 hex of the content taken last (served or refused)."""
        return self.stable.taken

    @digest.setter
    def digest(self, value: str | None) -> None:
        self.stable = StableContent(taken=value)

    def read(self) -> tuple[str, Config]:
        """Read and validate the file now (no stability wait: start-up), returning
        ``(sha256 hex digest, config)``.

        Raises:
            ConfigError: unreadable, not YAML, or invalid (fields named).
        """
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise ConfigError(str(self.path), [("", f"cannot read: {exc.strerror or exc}")]) from None
        return hashlib.sha256(raw).hexdigest(), self._parse(raw)

    def poll(self) -> Config | None:
        """The new config if the file's content changed and read the same on this poll and the previous
        one, else None (unchanged, or changed but not yet stable).

        Raises:
            ConfigError: the changed, stable file is unreadable or invalid (raised once per distinct
                content; a file unreadable on two polls in a row is reported once, a moment's absence while
                an editor replaces it not at all).
        """
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            marker = hashlib.sha256(f"unreadable:{exc.errno}".encode()).hexdigest()
            self.stable, take = self.stable.observe(marker)
            if take:
                raise ConfigError(str(self.path), [("", f"cannot read: {exc.strerror or exc}")]) from None
            return None
        self.stable, take = self.stable.observe(hashlib.sha256(raw).hexdigest())
        if not take:
            return None
        return self._parse(raw)

    def _parse(self, raw: bytes) -> Config:
        return parse_config_yaml(raw, str(self.path))
