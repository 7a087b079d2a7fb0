"""Prefix-aware eviction with a probationary and a protected part, split adaptively as ARC.

Leaf-first like prefix-lru; a key never read since it was stored is on probation, one that was
hit (or asked for again soon after its eviction) is protected, and ghost lists of both parts'
victims move the split toward the part whose victims come back. Runs in the tier's owning process.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.errors import ConfigError
from kvstore.eviction.base import CanEvict, register_policy
from kvstore.eviction.heap import LazyHeap
from kvstore.eviction.prefix_lru import PrefixLRUPolicy, Priority, TreeNode
from kvstore.keys import BlockKey

_PROBATION, _PROTECTED = 0, 1
_REQUEST_END, _REGULAR = 0, 1


@register_policy("prefix-arc")
class PrefixARCPolicy(PrefixLRUPolicy):
    """Leaves in two LRU parts: probation (never reused) and protected (reused).

    A key is reused once it is hit, or when it is inserted again while its key is still in a
    ghost list (the last `ghost_ratio` x capacity keys each part evicted): most reuse in KV
    caches comes after a user's think time, later than one turnover of the tier, so the ghost
    lists, not hits, find most reused chains. The protected part may hold a target share of
    the capacity; past it, protected leaves go first. A ghost hit of a probation victim lowers
    the target, one of a protected victim raises it (ARC's rule: by one key, or by the ratio of
    the other ghost list's size to this one's). Within probation, request ends (leaves that
    never had a child, never hit and not the latest insert) go first, as in prefix-reuse.
    `capacity_blocks` defaults to the most keys ever resident. O(log n) amortized per
    operation; the ghost lists hold at most 2 x `ghost_ratio` x capacity keys.
    """

    def __init__(
        self,
        ghost_ratio: float = 8.0,
        protected_share: float = 0.5,
        end_first: bool = True,
        capacity_blocks: int | None = None,
    ) -> None:
        if ghost_ratio < 0 or not 0.0 <= protected_share <= 1.0:
            raise ConfigError(
                f"prefix-arc ghost_ratio must be >= 0 and protected_share in [0, 1], got "
                f"{ghost_ratio} and {protected_share}"
            )
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ConfigError(f"prefix-arc capacity_blocks must be >= 1, got {capacity_blocks}")
        super().__init__()
        self._ghost_ratio = ghost_ratio
        self._protected_share = protected_share  # the target, adapted by ghost hits
        self._end_first = end_first
        self._capacity = capacity_blocks
        self._high_water = 0
        self._latest: BlockKey | None = None
        self._protected_keys = 0
        self._parts = (self._heap, LazyHeap(self._is_live))  # probation, protected
        self._ghosts: tuple[OrderedDict[BlockKey, None], ...] = (OrderedDict(), OrderedDict())

    @property
    def protected_share(self) -> float:
        """The share of the capacity the protected part may hold before it gives up leaves."""
        return self._protected_share

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        previous, self._latest = self._latest, key
        super().insert(key, parent)
        self._high_water = max(self._high_water, len(self))
        for part, ghosts in enumerate(self._ghosts):
            if key in ghosts:
                del ghosts[key]
                self._adapt(part)
                self._protect(key, self._nodes[key])
                break
        if previous is not None and previous != parent:
            self._refresh(previous)  # no longer the latest: it may now count as a request end

    def touch(self, key: BlockKey) -> None:
        node = self._nodes.get(key)
        if node is not None and not node.hits:
            self._protected_keys += 1
        super().touch(key)

    def remove(self, key: BlockKey) -> None:
        node = self._nodes.get(key)
        if node is not None:
            part = _PROTECTED if node.hits else _PROBATION
            if part == _PROTECTED:
                self._protected_keys -= 1
            self._remember(part, key)
        super().remove(key)

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        over_share = self._protected_keys > self._protected_share * self._capacity_keys()
        first, second = (_PROTECTED, _PROBATION) if over_share else (_PROBATION, _PROTECTED)
        found = self._parts[first].victim(can_evict)
        return found if found is not None else self._parts[second].victim(can_evict)

    def _protect(self, key: BlockKey, node: TreeNode) -> None:
        """A key asked for again after its eviction is a reused key."""
        node.hits = 1
        self._protected_keys += 1
        self._refresh(key)

    def _remember(self, part: int, key: BlockKey) -> None:
        ghosts = self._ghosts[part]
        ghosts[key] = None
        while len(ghosts) > self._ghost_ratio * self._capacity_keys():
            ghosts.popitem(last=False)

    def _adapt(self, part: int) -> None:
        """ARC's rule: a part whose victims come back should have been larger."""
        this, other = len(self._ghosts[part]) + 1, len(self._ghosts[1 - part])
        step = max(1.0, other / this) / self._capacity_keys()
        share = self._protected_share + (step if part == _PROTECTED else -step)
        self._protected_share = min(1.0, max(0.0, share))

    def _capacity_keys(self) -> int:
        return self._capacity or self._high_water or 1

    def _refresh(self, key: BlockKey) -> None:
        node = self._nodes.get(key)
        if node is None or key in self._children:
            return
        node.priority = self._priority(key, node)
        self._parts[node.priority[0]].push(node.priority, key, len(self._nodes))

    def _priority(self, key: BlockKey, node: TreeNode) -> Priority:
        if node.hits:
            return (_PROTECTED, _REGULAR, node.last_access)
        is_end = self._end_first and not node.had_child and key != self._latest
        return (_PROBATION, _REQUEST_END if is_end else _REGULAR, node.last_access)
