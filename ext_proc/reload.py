"""Config file polling by content hash: the edge that reads the file, for ``python -m ext_proc``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from inferlb.config.schema import Config, parse_config
from inferlb.errors import ConfigError


class ConfigPoller:
    """Reads a config file and reports a new :class:`Config` only when its bytes changed.

    A file that changed but is invalid raises :class:`ConfigError` once per distinct content, so a bad
    edit is reported once, not every poll, and the caller keeps serving its last good config.

    Args:
        path: the YAML config file.
        current: the bytes-digest baseline; pass the digest of the file the process started with.
    """

    def __init__(self, path: str | Path, current: bytes | None = None) -> None:
        self.path = Path(path)
        self.digest = current

    def read(self) -> tuple[bytes, Config]:
        """Read and validate the file now, returning ``(sha256 digest, config)``.

        Raises:
            ConfigError: unreadable, not YAML, or invalid (fields named).
        """
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise ConfigError(str(self.path), [("", f"cannot read: {exc.strerror or exc}")]) from None
        digest = hashlib.sha256(raw).digest()
        return digest, self._parse(raw)

    def poll(self) -> Config | None:
        """The new config if the file's content changed since the last poll, else None.

        Raises:
            ConfigError: the changed file is unreadable or invalid (raised once per distinct content).
        """
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            # an editor replacing the file can make it vanish for a moment: report once per state
            marker = hashlib.sha256(f"unreadable:{exc.errno}".encode()).digest()
            if marker == self.digest:
                return None
            self.digest = marker
            raise ConfigError(str(self.path), [("", f"cannot read: {exc.strerror or exc}")]) from None
        digest = hashlib.sha256(raw).digest()
        if digest == self.digest:
            return None
        self.digest = digest
        return self._parse(raw)

    def _parse(self, raw: bytes) -> Config:
        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(str(self.path), [("", f"not valid YAML: {exc}")]) from None
        return parse_config(data, str(self.path))
