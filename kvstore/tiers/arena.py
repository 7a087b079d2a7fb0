"""Page bookkeeping for tiers that live in one preallocated tensor (device and host arenas).

Runs inside the process that owns the arena. Not thread-safe: the store serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvstore.errors import CapacityError, ConfigError, NotFoundError
from kvstore.keys import BlockKey
from kvstore.tiers.base import Tier


class ArenaTier(Tier):
    """A tier whose pages are the rows of `pages`: [capacity_pages, page_size_bytes] uint8."""

    def __init__(self, pages: torch.Tensor) -> None:
        super().__init__(capacity_pages=pages.shape[0], page_size_bytes=pages.shape[1])
        self.pages = pages
        self._free = list(range(pages.shape[0] - 1, -1, -1))
        self._committed: dict[BlockKey, tuple[int, int]] = {}  # key -> (page index, used bytes)
        self._reserved: dict[BlockKey, int] = {}

    def reserve(self, key: BlockKey) -> torch.Tensor:
        if key in self._committed or key in self._reserved:
            raise ConfigError(f"{self.kind} tier already holds {key!r}")
        if not self._free:
            raise CapacityError(f"{self.kind} tier is full ({self.capacity_pages} pages)")
        index = self._free.pop()
        self._reserved[key] = index
        return self.pages[index]

    def commit(self, key: BlockKey, used_bytes: int) -> None:
        if key not in self._reserved:
            raise NotFoundError(f"{self.kind} tier: {key!r} is not reserved")
        if not 0 < used_bytes <= self.page_size_bytes:
            raise ConfigError(f"used_bytes {used_bytes} outside (0, {self.page_size_bytes}]")
        self._committed[key] = (self._reserved.pop(key), used_bytes)

    def release(self, key: BlockKey) -> None:
        index = self._reserved.pop(key, None)
        if index is None:
            index, _ = self._committed.pop(key, (None, 0))
        if index is not None:
            self._free.append(index)

    @contextmanager
    def open(self, key: BlockKey) -> Iterator[torch.Tensor | None]:
        entry = self._committed.get(key)
        yield None if entry is None else self.pages[entry[0], : entry[1]]

    def page_index(self, key: BlockKey) -> int | None:
        """The row holding `key` (committed or reserved), for processes mapping the arena."""
        entry = self._committed.get(key)
        return entry[0] if entry is not None else self._reserved.get(key)
