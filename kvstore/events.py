"""Block events: what the metadata service hears about a node's tiers (stored / removed).

Produced by the node-local store in the node agent's process; drained in batches by the
publisher. Sequence numbers are per store and strictly increasing.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from kvstore.keys import BlockKey


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class BlockEvent:
    seq: int
    kind: EventKind
    key: BlockKey
    tier: str
    size_bytes: int = 0
    tenant: str = "default"


class EventFeed:
    """A bounded FIFO of events. Thread-safe. When full, the oldest events are dropped and
    `dropped` counts them, so a consumer knows it must resync from the store's contents."""

    def __init__(self, max_events: int = 1_000_000) -> None:
        self._events: deque[BlockEvent] = deque()
        self._max_events = max_events
        self._next_seq = 1
        self._lock = threading.Lock()
        self.dropped = 0

    def emit(
        self,
        kind: EventKind,
        key: BlockKey,
        tier: str,
        size_bytes: int = 0,
        tenant: str = "default",
    ) -> None:
        with self._lock:
            event = BlockEvent(self._next_seq, kind, key, tier, size_bytes, tenant)
            self._events.append(event)
            self._next_seq += 1
            if len(self._events) > self._max_events:
                self._events.popleft()
                self.dropped += 1

    def drain(self, max_events: int | None = None) -> list[BlockEvent]:
        """Remove and return up to `max_events` oldest events (all when None)."""
        with self._lock:
            count = len(self._events) if max_events is None else min(max_events, len(self._events))
            return [self._events.popleft() for _ in range(count)]

    def __len__(self) -> int:
        return len(self._events)
