"""Runs of contiguous pages in one arena: which runs are free (best fit, merged with their free
neighbours when given back) and which block holds which run, so that an eviction can name the
neighbours whose runs, freed with its victim's, open a run wide enough for a new block.

Pure bookkeeping, in the process that owns the arena (the node agent; replay and benchmarks
in-process). Not thread-safe: the store serialises calls.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable
from typing import NamedTuple


class Run(NamedTuple):
    """`pages` pages from page `start`; `owner` holds them (None: free)."""

    start: int
    pages: int
    owner: Hashable | None


class PageRuns:
    """Free and held runs tiling pages [0, capacity_pages). Blocks are placed best fit (the
    narrowest free run that holds them, the lowest such first), which keeps wide runs whole
    for wide blocks; freed runs merge with free neighbours, so no two free runs touch."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = capacity_pages
        self.free_pages = capacity_pages
        self._free: dict[int, int] = {0: capacity_pages}  # start -> pages
        self._free_starts = [0]  # sorted
        self._by_width = [(capacity_pages, 0)]  # sorted (pages, start): best fit by bisect
        self._held: dict[int, tuple[int, Hashable]] = {}  # start -> (pages, owner)
        self._held_starts: list[int] = []  # sorted

    # ---- placing and freeing -------------------------------------------------------------
    def take(self, pages: int, owner: Hashable) -> int | None:
        """The first page of a run of `pages` now held by `owner`, or None if no free run is
        that wide (the free pages may still add up to more: they are not contiguous)."""
        found = bisect.bisect_left(self._by_width, (pages, -1))
        if found == len(self._by_width):
            return None
        width, start = self._by_width[found]
        self._drop_free(start)
        if width > pages:
            self._add_free(start + pages, width - pages)
        self._hold(start, pages, owner)
        return start

    def give_back(self, start: int) -> None:
        """Free the held run starting at `start` (merged with its free neighbours)."""
        pages, _ = self._held.pop(start)
        del self._held_starts[bisect.bisect_left(self._held_starts, start)]
        self.free_pages += pages
        self._free_merged(start, pages)

    def shrink(self, start: int, pages: int) -> None:
        """Keep the first `pages` of the held run at `start`; its tail is freed."""
        held, owner = self._held[start]
        if pages < held:
            self._held[start] = (pages, owner)
            self.free_pages += held - pages
            self._free_merged(start + pages, held - pages)

    def widest_free(self) -> int:
        """Pages in the widest free run (0 when none is free)."""
        return self._by_width[-1][0] if self._by_width else 0

    def held_pages(self, start: int) -> int:
        return self._held[start][0]

    # ---- eviction windows ----------------------------------------------------------------
    def window(
        self, start: int, pages: int, can_free: Callable[[Hashable], bool]
    ) -> list[Hashable] | None:
        """The owners, other than the one of the held run at `start`, whose runs freed with it
        open a free run of `pages` that contains it: the choice that frees the fewest held
        pages (owners must pass `can_free`). None when no such run exists around it."""
        own = self._held[start][0]
        left = self._neighbours(start, -1, pages - own, can_free)
        right = self._neighbours(start + own, +1, pages - own, can_free)
        best: tuple[int, int, int] | None = None  # (held pages freed, left units, right units)
        for lefts in range(len(left) + 1):
            width = own + sum(run.pages for run in left[:lefts])
            rights = 0
            while width < pages and rights < len(right):
                width += right[rights].pages
                rights += 1
            if width < pages:
                continue
            freed = sum(r.pages for r in left[:lefts] + right[:rights] if r.owner is not None)
            if best is None or freed < best[0]:
                best = (freed, lefts, rights)
        if best is None:
            return None
        _, lefts, rights = best
        return [r.owner for r in left[:lefts] + right[:rights] if r.owner is not None]

    def _neighbours(
        self, edge: int, step: int, pages: int, can_free: Callable[[Hashable], bool]
    ) -> list[Run]:
        """Runs next to page `edge` going `step` (-1: left of it; +1: from it on), nearest
        first, free or held by owners `can_free`, until they hold `pages` or one is not."""
        runs: list[Run] = []
        width = 0
        while width < pages:
            run = self._run_ending_at(edge) if step < 0 else self._run_starting_at(edge)
            if run is None or (run.owner is not None and not can_free(run.owner)):
                break
            runs.append(run)
            width += run.pages
            edge = run.start if step < 0 else run.start + run.pages
        return runs

    def _run_starting_at(self, page: int) -> Run | None:
        if page in self._free:
            return Run(page, self._free[page], None)
        held = self._held.get(page)
        return None if held is None else Run(page, *held)

    def _run_ending_at(self, page: int) -> Run | None:
        for starts in (self._free_starts, self._held_starts):
            index = bisect.bisect_left(starts, page) - 1
            if index >= 0:
                run = self._run_starting_at(starts[index])
                if run is not None and run.start + run.pages == page:
                    return run
        return None

    # ---- the sorted structures -----------------------------------------------------------
    def _hold(self, start: int, pages: int, owner: Hashable) -> None:
        self._held[start] = (pages, owner)
        bisect.insort(self._held_starts, start)
        self.free_pages -= pages

    def _free_merged(self, start: int, pages: int) -> None:
        """Add a free run, merged with the free runs just before and after it."""
        after = self._free.get(start + pages)
        if after is not None:
            self._drop_free(start + pages)
            pages += after
        before = self._run_ending_at(start)
        if before is not None and before.owner is None:
            self._drop_free(before.start)
            start, pages = before.start, before.pages + pages
        self._add_free(start, pages)

    def _add_free(self, start: int, pages: int) -> None:
        self._free[start] = pages
        bisect.insort(self._free_starts, start)
        bisect.insort(self._by_width, (pages, start))

    def _drop_free(self, start: int) -> None:
        pages = self._free.pop(start)
        del self._free_starts[bisect.bisect_left(self._free_starts, start)]
        del self._by_width[bisect.bisect_left(self._by_width, (pages, start))]
