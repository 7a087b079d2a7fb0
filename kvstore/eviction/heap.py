"""A min-heap of (priority, key) entries whose stale entries are dropped lazily.

Shared by the heap-ordered eviction policies; runs wherever its policy runs, not thread-safe.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Generic, TypeVar

from kvstore.eviction.base import CanEvict
from kvstore.keys import BlockKey

P = TypeVar("P")


class LazyHeap(Generic[P]):
    """Entries stay queued when their key's priority changes or the key leaves.

    The owning policy says which entries still count through `is_live`, and pushes a fresh entry
    whenever a key's priority changes; stale entries are skipped and dropped by `victim`, and
    swept out once they outnumber the live keys. O(log n) amortized per operation.
    """

    def __init__(self, is_live: Callable[[tuple[P, BlockKey]], bool]) -> None:
        self._is_live = is_live
        self._entries: list[tuple[P, BlockKey]] = []

    def push(self, priority: P, key: BlockKey, live_keys: int) -> None:
        """Queue `key` at `priority`; `live_keys` (how many keys the policy tracks) bounds the
        stale entries kept."""
        heapq.heappush(self._entries, (priority, key))
        if len(self._entries) > 2 * live_keys + 64:
            self._entries = [entry for entry in self._entries if self._is_live(entry)]
            heapq.heapify(self._entries)

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        """The live key of smallest priority for which `can_evict` is true, or None.

        Drops the stale entries it passes; the live entries it skips stay queued.
        """
        skipped: list[tuple[P, BlockKey]] = []
        found = None
        while self._entries:
            entry = self._entries[0]
            if not self._is_live(entry):
                heapq.heappop(self._entries)
            elif can_evict(entry[1]):
                found = entry[1]
                break
            else:
                skipped.append(heapq.heappop(self._entries))
        for entry in skipped:
            heapq.heappush(self._entries, entry)
        return found
