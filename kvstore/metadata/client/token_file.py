"""A metadata bearer token kept in a file that is replaced while in use, read again when the
file changes: the kubelet replaces a projected service-account token well before it expires.

Runs in the client's process (node agents); thread-safe: a caller gets the token as it was at
the last check (at most `recheck_s` old), never a partly written one (the kubelet swaps the
whole file at once).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from kvstore.config import read_secret_file
from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)
RECHECK_S = 1.0


class TokenFile:
    def __init__(self, path: Path, recheck_s: float = RECHECK_S) -> None:
        self.path = path
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._version: tuple[int, ...] = ()  # the file's (device, inode, mtime, size)
        self._token = ""
        self._checked_at = float("-inf")  # time.monotonic()

    @classmethod
    def read(cls, path: Path) -> TokenFile:
        """A token file whose first token is read now (ConfigError where it cannot be)."""
        token_file = cls(path)
        token_file.current()
        return token_file

    def current(self) -> str:
        """The token; the file is looked at again once `recheck_s` has passed."""
        if time.monotonic() - self._checked_at >= self.recheck_s:
            with self._lock:
                self._refresh()
        return self._token

    def _refresh(self) -> None:
        """Where the file cannot be read any more, keep the last token (the service refuses it
        once it expires); ConfigError where there has never been one."""
        self._checked_at = time.monotonic()
        try:
            self._read_if_changed()
        except ConfigError as exc:
            if not self._token:
                raise
            logger.warning("%s; using the last token read", exc)

    def _read_if_changed(self) -> None:
        try:
            info = self.path.stat()
        except OSError as exc:
            raise ConfigError(f"cannot read metadata token from {self.path}: {exc}") from None
        version = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)
        if version != self._version:
            self._token = read_secret_file(self.path, "metadata token")
            self._version = version
