"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03): balances recency and frequency.

T1 holds keys seen once, T2 keys hit again; ghost lists B1/B2 remember recent evictions from each
and steer the target size of T1. Runs in the process that owns the tier.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.errors import ConfigError
from kvstore.eviction.base import CanEvict, EvictionPolicy, register_policy
from kvstore.keys import BlockKey


@register_policy("arc")
class ARCPolicy(EvictionPolicy):
    """ARC over the resident keys of one tier.

    ARC needs the cache size c; pass `capacity_blocks` or it uses the most keys ever resident.
    The target is adapted on insert (a ghost hit), one eviction later than in the paper, since
    the store asks for the victim before inserting. O(1) per operation, plus skipped pinned keys.
    """

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ConfigError(f"arc capacity_blocks must be positive, got {capacity_blocks}")
        self._capacity = capacity_blocks or 0
        self._fixed_capacity = capacity_blocks is not None
        self._target_t1 = 0.0
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()  # oldest first
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self:
            raise ConfigError(f"{key!r} is already resident in this tier")
        if key in self._b1:
            step = max(len(self._b2) / len(self._b1), 1.0)
            self._target_t1 = min(self._target_t1 + step, float(self._capacity))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            step = max(len(self._b1) / len(self._b2), 1.0)
            self._target_t1 = max(self._target_t1 - step, 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        if not self._fixed_capacity:
            self._capacity = max(self._capacity, len(self))

    def touch(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        t1_first = bool(self._t1) and len(self._t1) > self._target_t1
        lists = (self._t1, self._t2) if t1_first else (self._t2, self._t1)
        for queue in lists:
            for key in queue:
                if can_evict(key):
                    return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def _trim_ghosts(self) -> None:
        """Keep |T1| + |B1| <= c and the whole directory within 2c, as in the paper."""
        while self._b1 and len(self._t1) + len(self._b1) > self._capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * self._capacity:
            self._b2.popitem(last=False)
