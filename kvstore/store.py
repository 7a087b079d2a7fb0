"""The node-local store: tiers stacked fastest first, each with its own eviction policy.
TieredStore composes the bookkeeping under one lock (kvstore/store_ledger.py) with the byte
moves run with it released: reads of pinned blocks (here), promotions, demotions ahead of need
and blocks received from peers (store_*.py). Runs in the node agent; replay and benchmarks too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kvstore import block
from kvstore.errors import ConfigError
from kvstore.events import EventFeed
from kvstore.keys import BlockKey
from kvstore.kvcopy.verified import copy_and_checksum
from kvstore.owned import owned_key
from kvstore.store_demotion import DemotionAhead
from kvstore.store_ledger import StoreLedger, TierSlot
from kvstore.store_promotion import Promotions
from kvstore.store_received import ReceivedBlocks
from kvstore.store_shares import ArenaLimits, TenantShares

__all__ = ["ArenaLimits", "TierSlot", "TieredStore"]


class TieredStore:
    """Blocks across tiers, named by owned keys (kvstore/owned.py: a tenant's block never
    answers another's). Slot 0 is the fastest; new blocks are written there. Thread-safe:
    the ledger's lock guards the bookkeeping; reads of pinned blocks and the copies of
    promotions, demotions ahead of need and received blocks run without it.
    """

    def __init__(
        self,
        slots: Sequence[TierSlot],
        events: EventFeed | None = None,
        limits: ArenaLimits | None = None,
    ) -> None:
        if not slots:
            raise ConfigError("a store needs at least one tier")
        self.ledger = StoreLedger(
            slots, events or EventFeed(), TenantShares(limits or ArenaLimits())
        )
        self.promotions = Promotions(self.ledger)
        self.demotions = DemotionAhead(self.ledger)
        self.received = ReceivedBlocks(self.ledger)
        self.ledger.recover()

    # ---- what the ledger holds, for the agent's metrics and tests -------------------------
    slots = property(lambda self: self.ledger.slots)
    events = property(lambda self: self.ledger.events)
    limits = property(lambda self: self.ledger.shares.limits)
    removals = property(lambda self: self.ledger.removals)  # per tier: evicted, demoted, purged
    checksum_failures = property(lambda self: self.ledger.checksum_failures)
    write_failures = property(lambda self: self.ledger.write_failures)  # evicted, not demoted
    expired_reservations = property(lambda self: self.ledger.expired_reservations)
    share_refusals = property(lambda self: self.ledger.shares.refusals)  # past a tenant's share

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading owned `keys` are committed in some tier. No side effects."""
        return self.ledger.lookup(keys)

    def lookup_slots(self, keys: Sequence[bytes]) -> bytes:
        """`lookup` with where: one byte per leading readable key, the index of the fastest
        slot holding it (len() is what `lookup` counts). No side effects."""
        return self.ledger.lookup_slots(keys)

    def tier_of(self, key: bytes) -> str | None:
        """The kind of the fastest tier holding `key`, or None."""
        index = self.ledger.slot_of(key)
        return None if index is None else self.ledger.slots[index].tier.kind

    # ---- pins ----------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> int:
        """Pin the leading resident owned `keys` for reading and return how many were pinned.

        Counts as an access for every policy; promotes blocks from lower tiers to the top
        tier when room can be made (key by key: a later key may be evicted to make room for
        an earlier one), reading them with the store lock released, so a disk read stalls no
        other worker. A block failing its checksum ends the run (it is purged). A key that
        would take its tenant past its share of the top tier ends the run too, or raises
        QuotaExceededError when it is the first.
        """
        for index, key in enumerate(keys):
            slot = self.ledger.pin_for_load(key, first=index == 0)
            if slot is None:
                return index
            if slot == 0:
                continue
            try:
                promoted = self.promotions.promoted(key)
            except BaseException:
                self.unpin(keys[: index + 1])  # the caller gets no count to release
                raise
            if not promoted:
                self.unpin([key])
                return index
        return len(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Drop one pin from each key; unknown or unpinned keys are ignored."""
        self.ledger.unpin(keys)

    def pins_held(self) -> int:
        return self.ledger.pins_held()

    # ---- two-phase writes ----------------------------------------------------------------
    def reserve(
        self,
        key: bytes,
        parent: bytes | None,
        payload_bytes: int,
        layout_hash: int = 0,
        codec_id: int = 0,
        writer: object = None,
    ) -> torch.Tensor | None:
        """A writable payload view in the top tier for owned `key` (`parent`: its parent's
        owned key), or None if `key` is already stored or being written. Evicts as needed;
        CapacityError if nothing can be evicted, or if only the pages kept for promotions are
        left; QuotaExceededError past the tenant's share. A `writer` (a worker's save) names
        who may claim, commit or abort it, and lets the reservation expire (see
        expire_reservations)."""
        return self.ledger.reserve(key, parent, payload_bytes, layout_hash, codec_id, writer)

    def commit(self, key: bytes, checksum: int | None = None, writer: object = None) -> None:
        """Seal the header and make the block readable. `checksum` is the payload's xxh3-64 if
        the writer computed it while writing; otherwise it is computed here (one more pass).
        NotFoundError if `key` is not reserved by `writer` (committed, aborted or expired)."""
        self.ledger.commit(key, checksum, writer)

    def abort(self, key: bytes, writer: object = None) -> None:
        """Give up `writer`'s reservation of `key`; its page is freed and nothing becomes
        readable. Another writer's reservation (this one's expired) is left alone."""
        self.ledger.abort(key, writer)

    def claim(self, key: bytes, writer: object) -> bool:
        """Whether `writer`'s reservation of `key` is still there; if so it no longer expires
        (its writer is about to commit or abort it). Call before copying into its page."""
        return self.ledger.claim(key, writer)

    def expire_reservations(self) -> int:
        """Release worker reservations older than the reservation TTL and not claimed; returns
        how many (counted in expired_reservations). Runs whenever pages are wanted and none
        is free (a save, a promotion, a tenant at its share) and at each metrics scrape."""
        return self.ledger.expire_reservations()

    def writes_pending(self) -> int:
        """Reserved pages not yet readable: saves and blocks on their way from peers."""
        return self.ledger.writes_pending()

    def put(self, key: bytes, parent: bytes | None, payload: bytes | torch.Tensor) -> bool:
        """Store a whole payload (reserve, copy, commit) under owned `key`. False if `key` was
        already present or is being written."""
        source = (
            payload
            if isinstance(payload, torch.Tensor)
            else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        )
        view = self.reserve(key, parent, source.numel())
        if view is None:
            return False
        try:
            checksum = copy_and_checksum(view, source.view(-1).view(torch.uint8))
        except BaseException:
            self.abort(key)
            raise
        self.commit(key, checksum)
        return True

    def tenant_pages(self) -> dict[str, dict[str, int]]:
        """Per tenant: pages its saves reserved, blocks pinned, and blocks stored per tier
        (as "stored_host", "stored_disk")."""
        return self.ledger.tenant_pages()

    # ---- reads ---------------------------------------------------------------------------
    @contextmanager
    def read(self, key: bytes) -> Iterator[torch.Tensor | None]:
        """Yield the payload of `key` from its fastest tier, or None on a miss; see open_block."""
        with self.open_block(key) as whole:
            yield None if whole is None else whole[block.HEADER_BYTES :]

    def open_tenant_block(self, key: BlockKey, tenant: str):
        """open_block of `tenant`'s block of `key`: what the transfer engine serves peers (a
        block of another tenant is a miss, like an absent one)."""
        return self.open_block(owned_key(tenant, key))

    @contextmanager
    def open_block(self, key: bytes) -> Iterator[torch.Tensor | None]:
        """Yield the whole stored block (header + payload) of owned `key`, or None on a miss.

        The block is pinned while the context is open, so the view stays valid without the
        store lock (other threads keep working). Blocks from tiers that require it (disk) are
        checksummed first; a corrupt block is purged and reads as a miss.
        """
        index = self.ledger.pin_for_read(key)
        if index is None:
            yield None
            return
        try:
            with self.ledger.slots[index].tier.open(key) as page:
                header = self.ledger.checked_header(index, key, page)
                yield None if header is None else page[: header.block_bytes]
        finally:
            self.unpin([key])

    def purge_if_corrupt(self, key: bytes) -> None:
        """Checksum `key`'s stored block (a reader's copy of it failed its checksum) and purge
        it if its bytes are not the checksum's; a block whose page was reused under the reader
        is not in doubt and stays."""
        index = self.ledger.pin_for_read(key)
        if index is None:
            return
        try:
            with self.ledger.slots[index].tier.open(key) as page:
                self.ledger.checked_header(index, key, page, verify=True)
        finally:
            self.unpin([key])

    # ---- moves between tiers and from peers ----------------------------------------------
    def demote_ahead(self, free_pages: int, stop: threading.Event | None = None) -> int:
        """See DemotionAhead.demote_ahead (kvstore/store_demotion.py); called by the node
        agent's demotion thread."""
        return self.demotions.demote_ahead(free_pages, stop)

    def reserve_page(self, key: bytes) -> torch.Tensor | None:
        """See ReceivedBlocks.reserve_page (kvstore/store_received.py)."""
        return self.received.reserve_page(key)

    def await_arrival(self, key: bytes, timeout_s: float) -> bool:
        """See ReceivedBlocks.await_arrival (kvstore/store_received.py)."""
        return self.received.await_arrival(key, timeout_s)

    def commit_received(
        self, key: bytes, received_bytes: int, payload_checksum: int | None = None
    ) -> bool:
        """See ReceivedBlocks.commit_received (kvstore/store_received.py)."""
        return self.received.commit_received(key, received_bytes, payload_checksum)

    # ---- which tier holds what, and lifecycle --------------------------------------------
    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop owned `keys` from every tier (removed events follow); pinned keys stay. Returns how
        many blocks were removed."""
        return self.ledger.remove(keys)

    def inventory(self) -> list[tuple[BlockKey, str, str]]:
        """(key, tier kind, tenant) of every readable block, for a full re-publish."""
        return self.ledger.inventory()

    def usage(self) -> dict[str, dict[str, int]]:
        """Pages used and available per tier, its page size and largest block."""
        return self.ledger.usage()

    def close(self) -> None:
        self.ledger.close()
