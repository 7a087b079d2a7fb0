"""Prefix-aware LRU: evicts the least recently used LEAF of the tier's prefix tree.

A chunk is useless without its parent, so a key is never a victim while one of its children is
resident in this tier: chains shrink from their tails. A parent claim that would close a
cycle (a key its own ancestor) is ignored: no leaf, so no victim, would be left among them, and a
worker could fill the tier with blocks nothing evicts. Runs in the tier's owning process.
"""

from __future__ import annotations

from itertools import count

from kvstore.errors import ConfigError
from kvstore.eviction.base import CanEvict, EvictionPolicy, register_policy
from kvstore.eviction.heap import LazyHeap
from kvstore.keys import BlockKey

Priority = tuple[float, ...]


class TreeNode:
    """What the policy knows about one resident key."""

    __slots__ = ("had_child", "hits", "inserts_at_access", "last_access", "parent", "priority")

    def __init__(self, parent: BlockKey | None, had_child: bool) -> None:
        self.parent = parent
        self.last_access = 0  # position in the sequence of inserts and touches
        self.inserts_at_access = 0  # inserts into this tier before the last access
        self.hits = 0
        self.had_child = had_child
        self.priority: Priority = ()


@register_policy("prefix-lru")
class PrefixLRUPolicy(EvictionPolicy):
    """LRU among keys with no resident child.

    The parent of an inserted key need not be resident; if it arrives later (a demotion writes
    children before parents) it starts with its children counted. Leaves sit in a heap ordered by
    `_priority` (smallest evicted first; here the last access); stale entries are dropped lazily,
    so every operation is O(log n) amortized. Subclasses change the order by overriding
    `_priority` and calling `_refresh` when an input to it changes.
    """

    def __init__(self) -> None:
        self._clock = count()
        self._inserts = 0
        self._nodes: dict[BlockKey, TreeNode] = {}
        self._children: dict[BlockKey, int] = {}  # resident-child counts, for any parent key
        self._heap: LazyHeap[Priority] = LazyHeap(self._is_live)  # leaves

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self._nodes:
            raise ConfigError(f"{key!r} is already resident in this tier")
        # a cycle closes only if a resident key names `key` as its parent: O(1) otherwise
        if parent is not None and (
            parent == key or (key in self._children and self._is_ancestor(key, parent))
        ):
            parent = None  # a cycle: the key is kept as a root
        node = TreeNode(parent, had_child=key in self._children)
        self._nodes[key] = node
        self._inserts += 1
        self._stamp(node)
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            parent_node = self._nodes.get(parent)
            if parent_node is not None:
                parent_node.had_child = True
        self._refresh(key)

    def _is_ancestor(self, key: BlockKey, parent: BlockKey) -> bool:
        """Whether `key` is `parent` or one of its resident ancestors (O(depth))."""
        seen = 0
        while parent is not None and seen <= len(self._nodes):
            if parent == key:
                return True
            node = self._nodes.get(parent)
            parent = node.parent if node is not None else None
            seen += 1
        return False

    def touch(self, key: BlockKey) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        node.hits += 1
        self._stamp(node)
        self._refresh(key)

    def remove(self, key: BlockKey) -> None:
        node = self._nodes.pop(key, None)
        if node is None or node.parent is None:
            return
        remaining = self._children[node.parent] - 1
        if remaining:
            self._children[node.parent] = remaining
        else:
            del self._children[node.parent]
            self._refresh(node.parent)

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        return self._heap.victim(can_evict)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def _stamp(self, node: TreeNode) -> None:
        node.last_access = next(self._clock)
        node.inserts_at_access = self._inserts

    def _priority(self, key: BlockKey, node: TreeNode) -> Priority:
        """Eviction order among leaves: smallest first. Must depend only on the policy's state."""
        return (node.last_access,)

    def _refresh(self, key: BlockKey) -> None:
        """Recompute `key`'s priority and queue it if it is a resident leaf."""
        node = self._nodes.get(key)
        if node is None or key in self._children:
            return
        node.priority = self._priority(key, node)
        self._heap.push(node.priority, key, len(self._nodes))

    def _is_live(self, entry: tuple[Priority, BlockKey]) -> bool:
        priority, key = entry
        node = self._nodes.get(key)
        return node is not None and node.priority == priority and key not in self._children
