"""A bounded ring of index events, found by sequence number in O(log n) (bisect on seq).

Used by the embedded index (memory.py) under that index's lock; not thread-safe by itself.
When full, appending drops the oldest event: readers learn of it as a gap.
"""

from __future__ import annotations

from bisect import bisect_left

from kvstore.metadata.records import IndexEvent


class EventRing:
    """The newest `capacity` events, oldest first, with strictly increasing seqs."""

    def __init__(self, capacity: int) -> None:
        self._slots: list[IndexEvent | None] = [None] * capacity
        self._start = 0  # slot of the oldest event
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, position: int) -> IndexEvent:
        """The event at `position` from the oldest (0). For bisect; no negative positions."""
        if not 0 <= position < self._size:
            raise IndexError(position)
        return self._slots[(self._start + position) % len(self._slots)]

    def append(self, event: IndexEvent) -> None:
        capacity = len(self._slots)
        if capacity == 0:
            return
        if self._size < capacity:
            self._slots[(self._start + self._size) % capacity] = event
            self._size += 1
        else:  # overwrite the oldest
            self._slots[self._start] = event
            self._start = (self._start + 1) % capacity

    def oldest_seq(self) -> int | None:
        return self[0].seq if self._size else None

    def since(self, from_seq: int, max_events: int) -> list[IndexEvent]:
        """Up to `max_events` events with seq >= from_seq, oldest first."""
        first = bisect_left(self, from_seq, key=lambda event: event.seq)
        last = min(self._size, first + max(max_events, 0))
        return [self[position] for position in range(first, last)]
