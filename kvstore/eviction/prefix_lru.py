"""Prefix-aware LRU: evicts the least recently used LEAF of the tier's prefix tree.

A chunk is useless without its parent, so a key is never a victim while one of its children is
resident in this tier: chains shrink from their tails. Runs in the tier's owning process.
"""

from __future__ import annotations

import heapq
from itertools import count

from kvstore.errors import ConfigError
from kvstore.eviction.base import CanEvict, EvictionPolicy, register_policy
from kvstore.keys import BlockKey


@register_policy("prefix-lru")
class PrefixLRUPolicy(EvictionPolicy):
    """LRU among keys with no resident child.

    The parent of an inserted key need not be resident; if it arrives later (a demotion writes
    children before parents) it starts with its children counted. Operations are O(log n)
    amortized: leaves sit in a heap keyed by last access, stale entries are dropped lazily.
    """

    def __init__(self) -> None:
        self._clock = count()
        self._last_access: dict[BlockKey, int] = {}  # resident keys only
        self._parent: dict[BlockKey, BlockKey | None] = {}  # resident keys only
        self._children: dict[BlockKey, int] = {}  # resident-child counts, for any parent key
        self._leaf_heap: list[tuple[int, BlockKey]] = []  # may hold stale entries

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self._last_access:
            raise ConfigError(f"{key!r} is already resident in this tier")
        self._last_access[key] = next(self._clock)
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        if not self._children.get(key):
            self._push_leaf(key)

    def touch(self, key: BlockKey) -> None:
        if key not in self._last_access:
            return
        self._last_access[key] = next(self._clock)
        if not self._children.get(key):
            self._push_leaf(key)

    def remove(self, key: BlockKey) -> None:
        if self._last_access.pop(key, None) is None:
            return
        parent = self._parent.pop(key)
        if parent is None:
            return
        remaining = self._children[parent] - 1
        if remaining:
            self._children[parent] = remaining
            return
        del self._children[parent]
        if parent in self._last_access:
            self._push_leaf(parent)

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        skipped: list[tuple[int, BlockKey]] = []
        found = None
        while self._leaf_heap:
            entry = self._leaf_heap[0]
            if not self._is_live(entry):
                heapq.heappop(self._leaf_heap)
            elif can_evict(entry[1]):
                found = entry[1]
                break
            else:
                skipped.append(heapq.heappop(self._leaf_heap))
        for entry in skipped:
            heapq.heappush(self._leaf_heap, entry)
        return found

    def __len__(self) -> int:
        return len(self._last_access)

    def __contains__(self, key: object) -> bool:
        return key in self._last_access

    def _is_live(self, entry: tuple[int, BlockKey]) -> bool:
        tick, key = entry
        return self._last_access.get(key) == tick and not self._children.get(key)

    def _push_leaf(self, key: BlockKey) -> None:
        heapq.heappush(self._leaf_heap, (self._last_access[key], key))
        if len(self._leaf_heap) > 2 * len(self._last_access) + 64:
            self._leaf_heap = [entry for entry in self._leaf_heap if self._is_live(entry)]
            heapq.heapify(self._leaf_heap)
