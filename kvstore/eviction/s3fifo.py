"""S3-FIFO eviction (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

New keys enter the small queue and are dropped quickly unless hit; keys hit while probationary,
or re-inserted soon after eviction (ghost hit), live in the main queue. Runs in the tier's process.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.errors import ConfigError
from kvstore.eviction.base import CanEvict, EvictionPolicy, register_policy
from kvstore.keys import BlockKey

_MAX_FREQ = 3


@register_policy("s3fifo")
class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with queue sizes relative to the number of resident keys.

    `small_ratio` is the small queue's share of the resident keys; `promote_hits` the hits a
    probationary key needs to move to the main queue. The ghost queue remembers as many evicted
    keys as the tier has ever held. `victim` reorders the queues (promotions, second chances)
    but never changes residency. O(1) amortized per operation: each victim call moves a key a
    bounded number of times, and pinned keys are rotated past rather than rescanned.
    """

    def __init__(self, small_ratio: float = 0.1, promote_hits: int = 1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ConfigError(f"s3fifo small_ratio must be in (0, 1), got {small_ratio}")
        if not 1 <= promote_hits <= _MAX_FREQ:
            raise ConfigError(
                f"s3fifo promote_hits must be in [1, {_MAX_FREQ}], got {promote_hits}"
            )
        self._small_ratio = small_ratio
        self._promote_hits = promote_hits
        self._small: OrderedDict[BlockKey, int] = OrderedDict()  # key -> hits, oldest first
        self._main: OrderedDict[BlockKey, int] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._high_water = 0

    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self:
            raise ConfigError(f"{key!r} is already resident in this tier")
        if key in self._ghost:  # evicted recently while probationary: it deserves the main queue
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0
        self._high_water = max(self._high_water, len(self))

    def touch(self, key: BlockKey) -> None:
        for queue in (self._small, self._main):
            if key in queue:
                queue[key] = min(queue[key] + 1, _MAX_FREQ)
                return

    def remove(self, key: BlockKey) -> None:
        if self._small.pop(key, None) is not None:
            self._ghost[key] = None
            while len(self._ghost) > self._high_water:
                self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        small_first = len(self._small) >= self._small_ratio * len(self) or not self._main
        order = (
            (self._from_small, self._from_main)
            if small_first
            else (self._from_main, self._from_small)
        )
        for pick in order:
            key = pick(can_evict)
            if key is not None:
                return key
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def _from_small(self, can_evict: CanEvict) -> BlockKey | None:
        """Oldest unhit evictable probationary key; promotes hit ones on the way."""
        for _ in range(len(self._small)):
            key, hits = next(iter(self._small.items()))
            if hits >= self._promote_hits:
                del self._small[key]
                self._main[key] = 0
            elif can_evict(key):
                return key
            else:
                self._small.move_to_end(key)
        return None

    def _from_main(self, can_evict: CanEvict) -> BlockKey | None:
        """Oldest evictable main key without remaining credit (CLOCK-like second chances)."""
        for _ in range((_MAX_FREQ + 1) * len(self._main)):
            key, hits = next(iter(self._main.items()))
            if hits == 0 and can_evict(key):
                return key
            self._main.move_to_end(key)
            self._main[key] = max(hits - 1, 0)
        return None
