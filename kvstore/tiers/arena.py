"""Block placement in one preallocated tensor of pages (the host arena; the planner's stand-ins):
each block holds a run of contiguous pages (kvstore/tiers/page_runs.py), so blocks of every
model and TP size share one arena, each wasting less than a page.

Runs inside the process that owns the arena. Not thread-safe: the store serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kvstore.errors import CapacityError, ConfigError, NotFoundError
from kvstore.keys import BlockKey
from kvstore.tiers.base import Tier
from kvstore.tiers.page_runs import PageRuns


class ArenaTier(Tier):
    """A tier whose blocks are runs of the rows of `pages`: [capacity_pages, page_size_bytes]
    uint8; a block of up to `max_block_bytes` (0: one page) starts at a page boundary, at byte
    `page_index(key) * page_size_bytes` of the flat arena."""

    def __init__(self, pages: torch.Tensor, max_block_bytes: int = 0) -> None:
        super().__init__(pages.shape[0], pages.shape[1], max_block_bytes)
        self.pages = pages
        self.flat = pages.view(-1)
        self.runs = PageRuns(pages.shape[0])
        self._committed: dict[BlockKey, tuple[int, int]] = {}  # key -> (first page, bytes)
        self._reserved: dict[BlockKey, int] = {}  # key -> first page

    def reserve(self, key: BlockKey, size_bytes: int = 0) -> torch.Tensor:
        if key in self._committed or key in self._reserved:
            raise ConfigError(f"{self.kind} tier already holds {key!r}")
        pages = self.pages_needed(size_bytes)
        start = self.runs.take(pages, key)
        if start is None:
            raise CapacityError(
                f"{self.kind} tier is full: no {pages} contiguous free pages "
                f"({self.free_pages} of {self.capacity_pages} free)"
            )
        self._reserved[key] = start
        return self.view(start, 0, pages * self.page_size_bytes)

    def commit(self, key: BlockKey, used_bytes: int) -> None:
        start = self._reserved.get(key)
        if start is None:
            raise NotFoundError(f"{self.kind} tier: {key!r} is not reserved")
        room = self.runs.held_pages(start) * self.page_size_bytes
        if not 0 < used_bytes <= room:
            raise ConfigError(f"used_bytes {used_bytes} outside (0, {room}]")
        self.runs.shrink(start, self.pages_needed(used_bytes))
        self._committed[key] = (self._reserved.pop(key), used_bytes)

    def release(self, key: BlockKey) -> None:
        start = self._reserved.pop(key, None)
        if start is None:
            start, _ = self._committed.pop(key, (None, 0))
        if start is not None:
            self.runs.give_back(start)

    @contextmanager
    def open(self, key: BlockKey) -> Iterator[torch.Tensor | None]:
        entry = self._committed.get(key)
        yield None if entry is None else self.view(entry[0], 0, entry[1])

    def view(self, page: int, start_bytes: int, stop_bytes: int) -> torch.Tensor:
        """Bytes [start_bytes, stop_bytes) of the block whose run starts at `page`."""
        base = page * self.page_size_bytes
        return self.flat[base + start_bytes : base + stop_bytes]

    def page_index(self, key: BlockKey) -> int | None:
        """The first page of `key`'s run (committed or reserved), for processes mapping the
        arena: its block starts at byte page_index * page_size_bytes."""
        entry = self._committed.get(key)
        return entry[0] if entry is not None else self._reserved.get(key)

    def room_bytes(self, key: BlockKey) -> int:
        """Bytes of the run `key` holds (0: none): no block of it may claim to be longer."""
        start = self.page_index(key)
        return 0 if start is None else self.runs.held_pages(start) * self.page_size_bytes

    def stored_bytes(self, key: BlockKey) -> int:
        entry = self._committed.get(key)
        return 0 if entry is None else entry[1]

    @property
    def used_pages(self) -> int:
        return self.capacity_pages - self.runs.free_pages

    @property
    def used_bytes(self) -> int:
        """Bytes the committed blocks hold (their pages' unused tails not counted)."""
        return sum(used for _, used in self._committed.values())

    def has_room(self, size_bytes: int) -> bool:
        return self.runs.widest_free() >= self.pages_needed(size_bytes)

    def eviction_window(
        self, victim: BlockKey, size_bytes: int, can_evict: Callable[[BlockKey], bool]
    ) -> list[BlockKey]:
        """The victim, then the committed neighbours (never a reserved run) that open a run
        of `size_bytes` around it freeing the fewest pages; the victim alone when no such run
        exists (its pages still count towards one elsewhere)."""
        start = self.page_index(victim)
        if start is None or victim not in self._committed:
            return [victim]
        pages = self.pages_needed(size_bytes)
        neighbours = self.runs.window(
            start, pages, lambda key: key in self._committed and can_evict(key)
        )
        return [victim, *(neighbours or [])]
