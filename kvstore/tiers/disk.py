"""Disk tier: blocks in an LMDB environment sized to the tier's capacity.

Owned by the node agent. A block becomes visible in one LMDB write transaction, so a writer
killed mid-write never leaves a readable partial block; reads are zero-copy views into LMDB's
map, valid inside `open`'s `with`. Reopening the directory finds every committed block.
Writes go through write(2), not the map (no MDB_WRITEMAP): with a writable map the file is
sparse, and a page written when the disk is full killed the agent with SIGBUS; a full disk
or a full map is an OSError here, the block is not stored, and every other one stays.
One agent at a time holds a directory (a lock file). An environment LMDB reads as corrupt (a
power loss without fsync) is set aside, and the tier starts empty: a cache's loss, not a stop.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import torch

from kvstore.errors import CapacityError, ConfigError, NotFoundError
from kvstore.keys import BlockKey
from kvstore.tiers.base import Tier, check_max_block, pages_for

# LMDB's read buffers are read-only; torch warns once when wrapping one. The tier's contract
# already says views are read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

logger = logging.getLogger(__name__)
_CORRUPT = tuple(
    getattr(lmdb, name)
    for name in (
        "CorruptedError",
        "InvalidError",
        "PageNotFoundError",
        "VersionMismatchError",
        "PanicError",
        "BadChecksumError",  # lmdb >= 3
    )
    if hasattr(lmdb, name)
)

# B-tree pages and overflow-page rounding: LMDB needs some room beyond the raw values.
_MAP_OVERHEAD = 1.25
_MAP_SLACK_BYTES = 64 << 20
_MAX_SPARE_PAGES = 4


class DiskTier(Tier):
    """Blocks are LMDB values keyed by block key, counted in the pages they would take (a
    block of up to `max_block_bytes` takes whole pages); `reserve` hands out a staging buffer
    in DRAM."""

    kind = "disk"
    verify_reads = True

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        page_size_bytes: int,
        fsync: bool = False,
        max_block_bytes: int = 0,
    ) -> None:
        pages = pages_for(capacity_bytes, page_size_bytes, self.kind)
        check_max_block(max_block_bytes, page_size_bytes, pages * page_size_bytes)
        super().__init__(pages, page_size_bytes, max_block_bytes)
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.path)
        self._unlock = weakref.finalize(self, os.close, self._lock_fd)  # dropped unclosed too
        map_size = int(capacity_bytes * _MAP_OVERHEAD) + _MAP_SLACK_BYTES
        options = {
            "map_size": map_size,
            "sync": fsync,
            "metasync": fsync,
            "readahead": False,
            "max_spare_txns": 4,
            "writemap": False,
        }
        try:
            self._env, self._committed = self._open(options)
        except BaseException:
            self._unlock()
            raise
        self._reserved: dict[BlockKey, torch.Tensor] = {}
        self._spare_pages: list[torch.Tensor] = []  # reused staging pages: no page faults
        self._used_pages = sum(map(self._pages_of, self._committed.values()))

    def _open(self, options: dict) -> tuple[lmdb.Environment, dict[BlockKey, int]]:
        """The environment and its keys' sizes; one LMDB reads as corrupt is set aside first."""
        for attempt in range(2):
            env = None
            try:
                env = lmdb.open(str(self.path), **options)
                with env.begin(buffers=True) as txn:
                    keys = {bytes(k): len(v) for k, v in txn.cursor().iternext()}
                return env, keys
            except _CORRUPT as exc:
                if env is not None:
                    env.close()
                if attempt:
                    raise ConfigError(f"disk tier: LMDB at {self.path} is corrupt: {exc}") from exc
                _set_aside(self.path, exc)
            except lmdb.Error as exc:
                if env is not None:
                    env.close()
                raise ConfigError(f"disk tier: cannot open LMDB at {self.path}: {exc}") from exc
        raise AssertionError("unreachable")

    def reserve(self, key: BlockKey, size_bytes: int = 0) -> torch.Tensor:
        self._check_room(key, size_bytes)
        pages = self.pages_needed(size_bytes)
        spare = next(
            (p for p in self._spare_pages if p.numel() == pages * self.page_size_bytes), None
        )
        if spare is not None:
            self._spare_pages.remove(spare)
        page = (
            spare
            if spare is not None
            else torch.empty(pages * self.page_size_bytes, dtype=torch.uint8)
        )
        self._reserved[key] = page
        self._used_pages += pages
        return page

    def _check_room(self, key: BlockKey, size_bytes: int) -> None:
        if key in self._committed or key in self._reserved:
            raise ConfigError(f"disk tier already holds {key!r}")
        if self.free_pages < self.pages_needed(size_bytes):
            raise CapacityError(f"disk tier is full ({self.capacity_pages} pages)")

    def commit(self, key: BlockKey, used_bytes: int) -> None:
        page = self._reserved.get(key)
        if page is None:
            raise NotFoundError(f"disk tier: {key!r} is not reserved")
        if not 0 < used_bytes <= page.numel():
            raise ConfigError(f"used_bytes {used_bytes} outside (0, {page.numel()}]")
        self._put(key, page[:used_bytes])
        self._recycle(self._unreserve(key))

    def write(self, key: BlockKey, block: torch.Tensor) -> None:
        """One copy: straight from `block` into LMDB, no staging page."""
        self._check_room(key, block.numel())
        self._put(key, block)

    def write_reserved(self, key: BlockKey, page: torch.Tensor, block: torch.Tensor) -> None:
        """One copy, straight from `block` into LMDB (the staging page goes back unused).
        Safe beside the store's calls for other keys: LMDB serialises write transactions."""
        if key not in self._reserved:
            raise NotFoundError(f"disk tier: {key!r} is not reserved")
        if block.numel() > self._reserved[key].numel():
            raise ConfigError(f"block of {block.numel()} bytes exceeds its reservation")
        staging = self._unreserve(key)  # before the put: never counted twice in used_pages
        try:
            self._put(key, block)
        finally:
            self._recycle(staging)

    def _put(self, key: BlockKey, block: torch.Tensor) -> None:
        try:
            with self._env.begin(write=True) as txn:
                txn.put(key, memoryview(block.contiguous().numpy()))
        except lmdb.MapFullError as exc:  # a write failure, counted and warned about
            raise OSError(errno.ENOSPC, f"disk tier: LMDB map full at {self.path}") from exc
        except lmdb.Error as exc:  # e.g. the disk is full (ENOSPC), an I/O error
            raise OSError(f"disk tier: LMDB write failed at {self.path}: {exc}") from exc
        self._committed[key] = block.numel()
        self._used_pages += self._pages_of(block.numel())

    def _unreserve(self, key: BlockKey) -> torch.Tensor:
        staging = self._reserved.pop(key)
        self._used_pages -= self._pages_of(staging.numel())
        return staging

    def _pages_of(self, size_bytes: int) -> int:
        return max(1, -(-size_bytes // self.page_size_bytes))

    @property
    def used_pages(self) -> int:
        return self._used_pages

    def stored_bytes(self, key: BlockKey) -> int:
        return self._committed.get(key, 0)

    def _recycle(self, page: torch.Tensor) -> None:
        if len(self._spare_pages) < _MAX_SPARE_PAGES:
            self._spare_pages.append(page)

    def release(self, key: BlockKey) -> None:
        if key in self._reserved:
            self._recycle(self._unreserve(key))
            return
        if key in self._committed:
            with self._env.begin(write=True) as txn:
                txn.delete(key)
            self._used_pages -= self._pages_of(self._committed.pop(key))

    @contextmanager
    def open(self, key: BlockKey) -> Iterator[torch.Tensor | None]:
        if key not in self._committed:
            yield None
            return
        with self._env.begin(buffers=True) as txn:
            buffer = txn.get(key)
            yield None if buffer is None else torch.frombuffer(buffer, dtype=torch.uint8)

    @property
    def closed(self) -> bool:
        return self._env is None

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
            self._unlock()


def _lock_directory(path: Path) -> int:
    """An exclusive lock on `path`/kvstore.lock, held until close (or the process ends)."""
    fd = os.open(path / "kvstore.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, BlockingIOError):
            raise ConfigError(
                f"disk tier: {path} is in use by another agent (its kvstore.lock "
                "is held); give each agent its own disk_dir"
            ) from None
        raise ConfigError(f"disk tier: cannot lock {path}: {exc}") from None
    return fd


def _set_aside(path: Path, exc: Exception) -> None:
    """Move a corrupt environment's files to path/corrupt-<time>/ (kept for a post-mortem;
    only the newest such copy is kept, so copies cannot fill the disk)."""
    for older in path.glob("corrupt-*"):
        shutil.rmtree(older, ignore_errors=True)
    aside = path / f"corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.mkdir(exist_ok=True)
    for name in ("data.mdb", "lock.mdb"):
        if (path / name).exists():
            os.replace(path / name, aside / name)
    logger.warning(
        "disk tier: LMDB at %s is corrupt (%s); moved to %s, starting empty", path, exc, aside
    )
