"""Prefix-aware eviction that protects reused chains and sacrifices request ends first.

Leaf-first like prefix-lru, with online signals from the prefix tree: a key that was hit, or
that comes back soon after being evicted, is kept about one cache turnover longer; a leaf that
ended an insert run without ever being read goes first. Runs in the process that owns the tier.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.errors import ConfigError
from kvstore.eviction.base import register_policy
from kvstore.eviction.prefix_lru import PrefixLRUPolicy, Priority, TreeNode
from kvstore.keys import BlockKey

_REQUEST_END, _REGULAR = 0, 1


@register_policy("prefix-reuse")
class PrefixReusePolicy(PrefixLRUPolicy):
    """Among leaves: request ends first (oldest first), then GreedyDual-style recency with a bonus.

    A regular leaf's priority is the insert count at its last access, plus `reuse_bonus` times
    the tier's capacity in keys if it was reused: hit, or re-inserted while still remembered in
    a ghost list of the last `ghost_ratio` x capacity removed keys (a chain whose tail was
    evicted and then asked for again is a reused chain). So a reused chain outlives unreused
    ones by about `reuse_bonus` full turnovers of the tier.
    A request end is a leaf that never had a child, was never hit and is not the latest insert
    (which may still be extended): in a multi-turn conversation the next turn forks before the
    last, partial chunk, so it is rarely read again. Set `end_first=False` where only full chunks
    are stored. `capacity_blocks` defaults to the most keys ever resident.
    O(log n) amortized per operation; the ghost list holds keys only.
    """

    def __init__(
        self,
        reuse_bonus: float = 1.0,
        ghost_ratio: float = 2.0,
        end_first: bool = True,
        capacity_blocks: int | None = None,
    ) -> None:
        if reuse_bonus < 0 or ghost_ratio < 0:
            raise ConfigError(
                f"prefix-reuse reuse_bonus and ghost_ratio must be >= 0, got {reuse_bonus} "
                f"and {ghost_ratio}"
            )
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ConfigError(f"prefix-reuse capacity_blocks must be >= 1, got {capacity_blocks}")
        super().__init__()
        self._reuse_bonus = reuse_bonus
        self._ghost_ratio = ghost_ratio
        self._end_first = end_first
        self._capacity = capacity_blocks
        self._high_water = 0
        self._latest: BlockKey | None = None
        self._ghosts: OrderedDict[BlockKey, None] = OrderedDict()  # oldest first

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        previous, self._latest = self._latest, key
        super().insert(key, parent)
        self._high_water = max(self._high_water, len(self))
        if key in self._ghosts:
            del self._ghosts[key]
            self._nodes[key].hits = 1  # asked for again after its eviction: reused
            self._refresh(key)
        if previous is not None and previous != parent:
            self._refresh(previous)  # no longer the latest: it may now count as a request end

    def remove(self, key: BlockKey) -> None:
        if key in self:
            self._ghosts[key] = None
            while len(self._ghosts) > self._ghost_ratio * self._capacity_keys():
                self._ghosts.popitem(last=False)
        super().remove(key)

    def _capacity_keys(self) -> int:
        return self._capacity or self._high_water

    def _priority(self, key: BlockKey, node: TreeNode) -> Priority:
        if self._end_first and self._is_request_end(key, node):
            return (_REQUEST_END, node.last_access)
        bonus = self._reuse_bonus * self._capacity_keys() if node.hits else 0.0
        return (_REGULAR, node.inserts_at_access + bonus, node.last_access)

    def _is_request_end(self, key: BlockKey, node: TreeNode) -> bool:
        return not node.had_child and not node.hits and key != self._latest
