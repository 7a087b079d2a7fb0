"""A node's pending publishes and evictions, coalesced and bounded, until the metadata service
takes them in batches.

Runs in the node agent's process, in its metadata link's thread (kvstore/node/link.py; the
`kvstore bench scale` agents hold one per simulated node); one thread owns an outbox, so it
has no lock. Each (tenant, key, tier) keeps only its newest event: a block stored and evicted
again before a flush costs nothing to send, and a flush that waited 1 s sends one batch, not
four. Never wrong KV at the bound: see `add`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.events import BlockEvent, EventKind

Slot = tuple[str, bytes, str]  # (tenant, key, tier)


@dataclass(frozen=True)
class Batch:
    """Entries of one kind and tenant, taken from the outbox to send in one call."""

    kind: EventKind
    tenant: str
    events: tuple[BlockEvent, ...]


class Outbox:
    """Pending events by (tenant, key, tier), newest first-come order kept per kind.

    At most `max_pending` events wait. At the bound, `add` keeps what a stale index would get
    wrong and drops what it would only miss: a new store is dropped (the service never learns
    the block: other nodes recompute it); a new eviction pushes out the oldest pending store
    instead, and where only evictions wait, the outbox is `overflowed`: its owner must
    re-register, which drops every holding of the node on the service, and publish its whole
    inventory. Both are counted in `dropped`."""

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.max_pending = max_pending
        self.dropped = 0  # stores dropped at the bound (never sent)
        self.overflowed = False  # an eviction found no room: resync before sending again
        self._pending: dict[EventKind, dict[Slot, BlockEvent]] = {
            EventKind.REMOVED: {},
            EventKind.STORED: {},
        }

    def __len__(self) -> int:
        return sum(map(len, self._pending.values()))

    def add(self, events: Iterable[BlockEvent]) -> None:
        """Queue `events` in order; a newer event of a slot replaces the older one."""
        for event in events:
            slot = (event.tenant, event.key, event.tier)
            mine = self._pending[event.kind]
            replaced = self._pending[_other(event.kind)].pop(slot, None) or mine.pop(slot, None)
            if replaced is None and len(self) >= self.max_pending and not self._make_room(event):
                continue
            mine[slot] = event  # (re-)inserted last: the newest goes out last

    def _make_room(self, event: BlockEvent) -> bool:
        """Room for one more `event` at the bound; False where it is dropped."""
        if event.kind is EventKind.STORED:
            self.dropped += 1
            return False
        stores = self._pending[EventKind.STORED]
        if stores:
            del stores[next(iter(stores))]
            self.dropped += 1
            return True
        self.overflowed = True
        return False

    def take(self, max_entries: int) -> Batch | None:
        """The oldest pending events of one kind and tenant (evictions first: a stale holder
        costs a failed fetch, a missing one only a recompute), at most `max_entries`; None
        when nothing waits. The caller sends it, then `restore`s it if that failed."""
        for kind, pending in self._pending.items():
            if not pending:
                continue
            tenant = next(iter(pending.values())).tenant
            slots = []
            for slot in pending:
                if slot[0] == tenant:
                    slots.append(slot)
                    if len(slots) == max_entries:
                        break
            return Batch(kind, tenant, tuple(pending.pop(slot) for slot in slots))
        return None

    def restore(self, batch: Batch) -> None:
        """Put back a batch that was not sent, ahead of newer events; a slot that got a newer
        event meanwhile keeps the newer one."""
        pending = self._pending[batch.kind]
        others = self._pending[_other(batch.kind)]
        kept = {
            (e.tenant, e.key, e.tier): e
            for e in batch.events
            if (e.tenant, e.key, e.tier) not in pending and (e.tenant, e.key, e.tier) not in others
        }
        self._pending[batch.kind] = {**kept, **pending}

    def clear(self) -> None:
        """Forget every pending event (a resync publishes the inventory instead)."""
        for pending in self._pending.values():
            pending.clear()
        self.overflowed = False


def _other(kind: EventKind) -> EventKind:
    return EventKind.REMOVED if kind is EventKind.STORED else EventKind.STORED
