"""The embedded default's own secrets, kept in its data dir: the cluster secret of its transfer
engine, the agent's metadata token, an operator token, and the metadata tokens file that grants
both tokens. `kvstore serve` makes them on its first start and reuses them after.

Runs in the `kvstore serve` process, and in the CLI process of `kvstore stats | events
--data-dir`, which read the operator token. No one but their owner ever reads these files: each
is mode 0600 from its first byte, and one another user could have read is refused.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)
SECRET_BYTES = 32  # random bytes of each secret (43 url-safe characters)


@dataclass(frozen=True)
class ServeSecrets:
    """The secret files of one `kvstore serve` data dir."""

    data_dir: Path

    @property
    def cluster_secret_file(self) -> Path:
        return self.data_dir / "cluster.secret"

    @property
    def agent_token_file(self) -> Path:
        return self.data_dir / "agent.token"

    @property
    def operator_token_file(self) -> Path:
        return self.data_dir / "operator.token"

    @property
    def tokens_file(self) -> Path:
        return self.data_dir / "metadata.tokens"

    def made_on_start(self) -> tuple[Path, ...]:
        """The secrets a start makes where they are missing."""
        return (self.cluster_secret_file, self.agent_token_file, self.operator_token_file)

    def ensure(self, node_id: str, more_tokens: Path | None = None) -> None:
        """Makes the data dir (0700) and each missing secret, checks the existing ones, then
        writes the tokens file anew: the agent's token bound to `node_id`, the operator's, and
        the lines of `more_tokens` (a --token-file given to serve). ConfigError if an existing
        secret is not safe (see `read_own_secret`)."""
        _make_private_dir(self.data_dir)
        try:
            kept = {path: _made_or_kept(path) for path in self.made_on_start()}
            lines = [
                f"{kept[self.agent_token_file]} * node={node_id}",
                f"{kept[self.operator_token_file]} *",
            ]
            if more_tokens is not None:
                lines.append(_read_text(more_tokens, "token file"))
            _write_private(self.tokens_file, "\n".join(lines) + "\n")
        except OSError as exc:
            raise ConfigError(f"cannot write the secrets of {self.data_dir}: {exc}") from None

    def check(self) -> None:
        """Refuses what `ensure` would refuse, creating nothing (for `--check`)."""
        for path in self.made_on_start():
            if os.path.lexists(path):
                read_own_secret(path)

    def operator_token(self) -> str:
        """The operator token of a data dir that `kvstore serve` started in."""
        if not os.path.lexists(self.operator_token_file):
            raise ConfigError(
                f"no operator token in {self.data_dir}: start `kvstore serve --data-dir "
                f"{self.data_dir}` (its first start makes one), or give --token-file"
            )
        return read_own_secret(self.operator_token_file)


def read_own_secret(path: Path) -> str:
    """The stripped text of a secret file that only this process's user can read: a regular
    file (not a link), owned by this uid, mode 0600 or stricter; ConfigError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"secret file {path} is a symbolic link: {_REMAKE}") from None
        raise ConfigError(f"cannot read secret file {path}: {exc.strerror}") from None
    try:
        _require_private(path, os.fstat(fd))  # of the file opened, not of what the path names now
        with open(fd, "rb", closefd=False) as file:
            secret = file.read().decode(errors="replace").strip()
    finally:
        os.close(fd)
    if not secret:
        raise ConfigError(f"secret file {path} is empty: {_REMAKE}")
    return secret


_REMAKE = "delete it, and the next `kvstore serve` makes a new one"


def _require_private(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"secret file {path} is not a regular file: {_REMAKE}")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"secret file {path} belongs to uid {info.st_uid}, not to this process's uid "
            f"{os.geteuid()}, so another user may know it: {_REMAKE}"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"secret file {path} is open to group or others (mode {mode:o}): {_REMAKE} "
            "(or, if no one else can have read it, chmod 600 it)"
        )


def _make_private_dir(directory: Path) -> None:
    """The data dir, made 0700; one that exists already is kept as it is, with a warning if
    other users may enter it (its LMDB files hold every cached block)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = stat.S_IMODE(directory.stat().st_mode)
    except OSError as exc:
        raise ConfigError(f"cannot make data dir {directory}: {exc.strerror}") from None
    if mode & 0o077:
        logger.warning(
            "data dir %s is open to other users (mode %o): its disk tier and index files hold "
            "every cached block and key; chmod 700 %s",
            directory,
            mode,
            directory,
        )


def _made_or_kept(path: Path) -> str:
    _create_secret(path)
    return read_own_secret(path)


def _create_secret(path: Path) -> None:
    """A new random secret at `path` unless one is there: written to a temporary file (0600
    from creation) and linked into place, so the file is never seen half-written or open to
    others; of two starts racing, the first one's secret stays."""
    if os.path.lexists(path):
        return
    temporary = _write_temporary(path.parent, secrets.token_urlsafe(SECRET_BYTES) + "\n")
    try:
        os.link(temporary, path)
        logger.info("made secret %s", path)
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary)


def _write_private(path: Path, text: str) -> None:
    """`text` as the whole of `path` (0600), replaced in one step."""
    temporary = _write_temporary(path.parent, text)
    try:
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _write_temporary(directory: Path, text: str) -> str:
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".secret-")  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        os.unlink(temporary)
        raise
    return temporary


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
