"""A node's pending publishes and evictions, coalesced and bounded, until the metadata service
takes them in batches.

Runs in the node agent's process, in its metadata link's thread (kvstore/node/link.py; the
`kvstore bench scale` agents hold one per simulated node); one thread owns an outbox, so it
has no lock. A block's events go out in their order, a repeat replacing the last pending one;
a flush that waited 1 s sends one batch per kind and tenant, not one per event. Never wrong
KV at the bound: see `Outbox`.
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
    """Pending events by (tenant, key, tier), in the order each block's events happened.

    A block's events are sent in their order (a block stored then evicted before a flush is
    published, then unpublished: the service's event stream, and routers reading it, see
    both); a repeat of a block's last pending event replaces it. Blocks are independent of
    each other, so a batch takes the pending events of one kind and tenant that come first
    for their blocks, whatever the order between blocks. At most `max_pending` events wait.
    At the bound, `add` keeps what a stale index would get wrong and drops what it would only
    miss: a block's event that undoes its last pending one cancels it (the service never hears
    of either); a new store is dropped (the service never learns the block: other nodes
    recompute it); a new eviction pushes out the oldest pending store of a block with nothing
    else pending instead, and where there is none the outbox is `overflowed`: its owner must
    re-register, which drops every holding of the node on the service, and publish its whole
    inventory. Dropped stores are counted in `dropped`."""

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.max_pending = max_pending
        self.dropped = 0  # stores dropped at the bound (never sent)
        self.overflowed = False  # an eviction found no room: resync before sending again
        self._slots: dict[Slot, list[BlockEvent]] = {}  # a block's pending events, in order
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, events: Iterable[BlockEvent]) -> None:
        """Queue `events` in order."""
        for event in events:
            slot = (event.tenant, event.key, event.tier)
            pending = self._slots.get(slot)
            if pending and pending[-1].kind is event.kind:
                pending[-1] = event  # a repeat: the newest stands for both
            elif self._count < self.max_pending:
                self._append(slot, event)
            elif pending:
                self._pop_last(slot)  # it undoes the last pending one: neither is sent
            elif self._make_room(event):
                self._append(slot, event)

    def _append(self, slot: Slot, event: BlockEvent) -> None:
        self._slots.setdefault(slot, []).append(event)
        self._count += 1

    def _pop_last(self, slot: Slot) -> None:
        pending = self._slots[slot]
        pending.pop()
        self._count -= 1
        if not pending:
            del self._slots[slot]

    def _make_room(self, event: BlockEvent) -> bool:
        """Room for one more `event` (of a block with nothing pending) at the bound; False
        where it is dropped."""
        if event.kind is EventKind.STORED:
            self.dropped += 1
            return False
        for slot, pending in self._slots.items():
            if len(pending) == 1 and pending[0].kind is EventKind.STORED:
                self._pop_last(slot)
                self.dropped += 1
                return True
        self.overflowed = True
        return False

    def take(self, max_entries: int) -> Batch | None:
        """At most `max_entries` events that come first for their blocks, of the kind and
        tenant of the oldest pending one; None when nothing waits. The caller sends it, then
        `restore`s it if that failed."""
        if not self._slots:
            return None
        first = next(iter(self._slots.values()))[0]
        taken = []
        for slot, pending in list(self._slots.items()):
            if len(taken) == max_entries:
                break
            if pending[0].kind is first.kind and pending[0].tenant == first.tenant:
                taken.append(pending.pop(0))
                self._count -= 1
                if not pending:
                    del self._slots[slot]
        return Batch(first.kind, first.tenant, tuple(taken))

    def restore(self, batch: Batch) -> None:
        """Put back a batch that was not sent, each event ahead of its block's newer ones (a
        repeat of the same kind right after it is dropped: the newer one stands)."""
        restored: dict[Slot, list[BlockEvent]] = {}
        for event in batch.events:
            slot = (event.tenant, event.key, event.tier)
            pending = self._slots.pop(slot, [])
            if pending and pending[0].kind is event.kind:
                restored[slot] = pending
            else:
                restored[slot] = [event, *pending]
                self._count += 1
        self._slots = {**restored, **self._slots}

    def clear(self) -> None:
        """Forget every pending event (a resync publishes the inventory instead)."""
        self._slots.clear()
        self._count = 0
        self.overflowed = False
