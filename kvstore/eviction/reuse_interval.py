"""Prefix-reuse eviction whose protection of reused chains lasts one observed reuse interval.

The extra life a reused chain gets is learned from the workload (how many inserts pass between
an access and the next access of the same key), not one capacity of the tier: reuse gaps are set
by users' turn times, not by the cache size. Runs in the process that owns the tier.
"""

from __future__ import annotations

from kvstore.errors import ConfigError
from kvstore.eviction.base import register_policy
from kvstore.eviction.prefix_lru import Priority, TreeNode
from kvstore.eviction.prefix_reuse import PrefixReusePolicy
from kvstore.keys import BlockKey

_REQUEST_END, _REGULAR = 0, 1


@register_policy("reuse-interval")
class ReuseIntervalPolicy(PrefixReusePolicy):
    """prefix-reuse, with the reuse bonus set to the mean observed reuse interval.

    Every hit and every insert of a key still remembered in the ghost list (evicted, then asked
    for again) is one observed reuse: the inserts into this tier since the key's previous access.
    Their exponentially weighted mean (weight `smoothing` for the newest; the plain mean while
    there are few) is how much longer a reused leaf is kept than an unused one of the same age;
    before the first observation it is the capacity, as in prefix-reuse. Request ends still go
    first. O(log n) amortized per operation, like prefix-reuse; the ghost list holds a key and
    one integer per entry.
    """

    def __init__(
        self,
        smoothing: float = 1e-3,
        ghost_ratio: float = 4.0,
        end_first: bool = True,
        capacity_blocks: int | None = None,
    ) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ConfigError(f"reuse-interval smoothing must be in (0, 1], got {smoothing}")
        super().__init__(
            ghost_ratio=ghost_ratio, end_first=end_first, capacity_blocks=capacity_blocks
        )
        self._smoothing = smoothing
        self._weighted_intervals = 0.0  # inserts, weighted: the newest by `smoothing`
        self._weights = 0.0

    @property
    def reuse_interval(self) -> float:
        """Inserts a reused leaf outlives an unused one by (the capacity until one is seen)."""
        if not self._weights:
            return self._capacity_keys()
        return self._weighted_intervals / self._weights

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        previous_access = self._ghosts.get(key)
        if previous_access is not None:
            self._observe(self._inserts - previous_access)
        super().insert(key, parent)

    def touch(self, key: BlockKey) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self._observe(self._inserts - node.inserts_at_access)
        super().touch(key)

    def remove(self, key: BlockKey) -> None:
        node = self._nodes.get(key)
        super().remove(key)
        if node is not None and key in self._ghosts:
            self._ghosts[key] = node.inserts_at_access  # keeps its place in the ghost order

    def _observe(self, interval: int) -> None:
        keep = 1.0 - self._smoothing
        self._weighted_intervals = keep * self._weighted_intervals + self._smoothing * interval
        self._weights = keep * self._weights + self._smoothing

    def _priority(self, key: BlockKey, node: TreeNode) -> Priority:
        if self._end_first and self._is_request_end(key, node):
            return (_REQUEST_END, node.last_access)
        bonus = self.reuse_interval if node.hits else 0.0
        return (_REGULAR, node.inserts_at_access + bonus, node.last_access)
