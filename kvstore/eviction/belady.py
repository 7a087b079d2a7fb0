"""Belady's offline optimum (MIN): evicts the resident key whose next use is farthest away.

For trace replay only: it needs the future, which the replay driver feeds it through
`set_next_use` before each request. Runs in the replay process.
"""

from __future__ import annotations

import math

from kvstore.errors import ConfigError
from kvstore.eviction.base import CanEvict, EvictionPolicy, register_policy
from kvstore.eviction.heap import LazyHeap
from kvstore.keys import BlockKey

NEVER = math.inf


@register_policy("belady")
class BeladyPolicy(EvictionPolicy):
    """The offline-optimal victim, given next-use positions.

    Contract: before the store sees a request, the driver calls `set_next_use(key, position)` for
    every key of that request, `position` being the index (in any increasing clock, e.g. the
    trace's block counter) of the NEXT request that reads the key, or `NEVER`. A key whose next use
    was never set counts as never used again. O(log n) amortized per operation.
    """

    def __init__(self) -> None:
        self._next_use: dict[BlockKey, float] = {}  # resident keys, and keys announced for insert
        self._resident: set[BlockKey] = set()
        self._heap: LazyHeap[float] = LazyHeap(self._is_live)  # (-next use, key)

    def set_next_use(self, key: BlockKey, position: float) -> None:
        """Record that `key` is next read at `position` (`NEVER` if it is not read again)."""
        self._next_use[key] = position
        if key in self._resident:
            self._push(key)

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self._resident:
            raise ConfigError(f"{key!r} is already resident in this tier")
        self._resident.add(key)
        self._next_use.setdefault(key, NEVER)
        self._push(key)

    def touch(self, key: BlockKey) -> None:
        """A hit changes nothing: the driver already announced the key's next use."""

    def remove(self, key: BlockKey) -> None:
        if key in self._resident:
            self._resident.discard(key)
            self._next_use.pop(key, None)

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        return self._heap.victim(can_evict)

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def _is_live(self, entry: tuple[float, BlockKey]) -> bool:
        negated_use, key = entry
        return key in self._resident and self._next_use[key] == -negated_use

    def _push(self, key: BlockKey) -> None:
        self._heap.push(-self._next_use[key], key, len(self._resident))
