"""Least-recently-used eviction: the baseline policy, blind to the prefix tree.

Runs in the process that owns the tier (node agent or replay), under the store's lock.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.errors import ConfigError
from kvstore.eviction.base import CanEvict, EvictionPolicy, register_policy
from kvstore.keys import BlockKey


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    """Evicts the key whose last insert or touch is oldest.

    O(1) per insert/touch/remove; victim is O(1 + number of non-evictable keys skipped), and the
    skipped (pinned) keys are few and short-lived.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()  # oldest first

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self._order:
            raise ConfigError(f"{key!r} is already resident in this tier")
        self._order[key] = None

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        for key in self._order:
            if can_evict(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
