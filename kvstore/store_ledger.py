"""The bookkeeping of a node's TieredStore under its one lock (StoreLedger): which tier holds
which block, pins, reservations, promotions under way, tenants' shares, eviction, events. The
byte moves (store.py's reads, store_promotion.py, store_demotion.py, store_received.py) call
its public methods and copy with the lock released. Runs in the node agent (and in-process).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvstore import block
from kvstore.errors import CapacityError, ChecksumError, ConfigError, NotFoundError
from kvstore.events import EventFeed, EventKind
from kvstore.eviction.base import EvictionPolicy
from kvstore.keys import BlockKey
from kvstore.owned import key_of, owned_key, tenant_of
from kvstore.store_shares import TenantShares
from kvstore.tiers.base import Tier

logger = logging.getLogger(__name__)


@dataclass
class TierSlot:
    tier: Tier
    policy: EvictionPolicy


@dataclass
class PendingWrite:
    """A reserved top-tier page not yet readable: a worker's save, or a block from a peer."""

    slot: int
    page: torch.Tensor
    header: block.BlockHeader
    arrived: threading.Event | None = None  # a block received from a peer: set once decided
    writer: object = None  # a worker's save: who may commit it; it expires unless claimed
    claimed: bool = False  # its writer is committing it: it no longer expires
    reserved_at: float = field(default_factory=time.monotonic)


class PromotionStart(NamedTuple):
    """What begin_promotion found: the slot holding the key (None: absent), another thread's
    copy up to wait for, or the top-tier page reserved for this thread's copy."""

    index: int | None
    underway: threading.Event | None
    page: torch.Tensor | None


class DemotionStart(NamedTuple):
    """The next victim to write down (pinned): its key, header and reserved lower page."""

    key: bytes
    header: block.BlockHeader
    lower_page: torch.Tensor


WINDOW_CANDIDATES = 8  # victims whose eviction windows are compared (see _cheapest_window)


def _too_large(top: Tier, payload_bytes: int) -> str:
    """Why a payload cannot be reserved, and the setting that would let it be."""
    room = (
        f"a {top.kind} page of {top.page_size_bytes} bytes"
        if top.max_block_bytes == top.page_size_bytes
        else f"the {top.kind} tier's largest block of {top.max_block_bytes} bytes"
    )
    return (
        f"payload of {payload_bytes} bytes does not fit {room} (header {block.HEADER_BYTES}): "
        "raise max_block_bytes (at most the arena) or store smaller chunks"
    )


class StoreLedger:
    """What every tier of a store holds, and who holds what of it. Every public method takes
    the lock at most once (an RLock: the ledger's own nested calls re-enter it) and moves no
    bytes but the eviction's write to the tier below and checksums of the blocks it reads."""

    def __init__(self, slots: Sequence[TierSlot], events: EventFeed, shares: TenantShares) -> None:
        self.slots = list(slots)
        self.events = events
        self.shares = shares
        self.removals: Counter[str] = Counter()  # per tier: evicted, demoted or purged
        self.checksum_failures = 0
        self.write_failures = 0  # victims a lower tier failed to store (evicted, not demoted)
        self.expired_reservations = 0
        self._lock = threading.RLock()
        self._pins: Counter[bytes] = Counter()  # owned key -> pins
        self._pending: dict[bytes, PendingWrite] = {}
        self._promoting: dict[bytes, threading.Event] = {}  # set when its copy up is done

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading owned `keys` are committed in some tier. No side effects."""
        with self._lock:
            for count, key in enumerate(keys):
                if self._slot_of(key) is None:
                    return count
            return len(keys)

    def lookup_slots(self, keys: Sequence[bytes]) -> bytes:
        """One byte per leading readable key: the index of the fastest slot holding it."""
        found = bytearray()
        with self._lock:
            fastest = self.slots[0].tier.committed_keys()
            if all(map(fastest.__contains__, keys)):
                return bytes(len(keys))  # the common hit, in C: all in the fastest slot
            for key in keys:
                if key in fastest:  # the common case, tested in C
                    found.append(0)
                    continue
                index = self._slot_of(key)
                if index is None:
                    break
                found.append(index)
        return bytes(found)

    def slot_of(self, key: bytes) -> int | None:
        """The index of the fastest slot holding `key`, or None."""
        with self._lock:
            return self._slot_of(key)

    def _slot_of(self, key: bytes) -> int | None:
        for index, slot in enumerate(self.slots):
            if key in slot.tier:
                return index
        return None

    # ---- pins ----------------------------------------------------------------------------
    def pin_for_load(self, key: bytes, first: bool) -> int | None:
        """Pin resident `key` and count an access in every policy; the slot it is pinned in,
        or None (not pinned) if it is absent or would take its tenant past its share (then
        QuotaExceededError when it is the load's `first` key)."""
        with self._lock:
            index = self._slot_of(key)
            if index is None:
                return None
            if key not in self._pins and not self._within_share(tenant_of(key), first):
                return None
            self._pin(key)
            for slot in self.slots:
                slot.policy.touch(key)
            return index

    def pin_for_read(self, key: bytes) -> int | None:
        """Pin `key` where it is, no access counted: the slot, or None if it is absent."""
        with self._lock:
            index = self._slot_of(key)
            if index is not None:
                self._pin(key)
            return index

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Drop one pin from each key; unknown or unpinned keys are ignored."""
        with self._lock:
            self._unpin(keys)

    def _unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            pins = self._pins.get(key, 0)
            if pins > 1:
                self._pins[key] = pins - 1
            elif pins == 1:
                del self._pins[key]
                self.shares.count_pinned(tenant_of(key), -1)

    def _pin(self, key: bytes) -> None:
        """Under the lock: one more pin on `key`; its first counts against its tenant."""
        if key not in self._pins:
            self.shares.count_pinned(tenant_of(key), 1)
        self._pins[key] += 1

    def pins_held(self) -> int:
        with self._lock:
            return sum(self._pins.values())

    def _can_evict(self, key: bytes) -> bool:
        return key not in self._pins

    # ---- two-phase writes ----------------------------------------------------------------
    def reserve(
        self,
        key: bytes,
        parent: bytes | None,
        payload_bytes: int,
        layout_hash: int,
        codec_id: int,
        writer: object,
    ) -> torch.Tensor | None:
        """See TieredStore.reserve."""
        with self._lock:
            if self._slot_of(key) is not None or self._being_written(key):
                return None
            top = self.slots[0].tier
            size_bytes = block.HEADER_BYTES + payload_bytes
            if size_bytes > top.max_block_bytes or payload_bytes <= 0:
                raise ConfigError(_too_large(top, payload_bytes))
            tenant = tenant_of(key)
            block.encode_tenant(tenant)  # validate before taking a page, not at commit
            self._check_room_for_saves()
            self._within_share(tenant, raise_if_not=True)
            self._make_room(0, size_bytes)
            page = top.reserve(key, size_bytes)
            parent_key = None if parent is None else key_of(parent)
            header = block.BlockHeader(
                key_of(key), parent_key, payload_bytes, 0, layout_hash, codec_id, tenant
            )
            self._pending[key] = PendingWrite(0, page, header, writer=writer)
            self.shares.count_reserved(tenant, 1)
            return page[block.HEADER_BYTES : block.HEADER_BYTES + payload_bytes]

    def commit(self, key: bytes, checksum: int | None, writer: object) -> None:
        """See TieredStore.commit."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or pending.writer is not writer:
                raise NotFoundError(f"{key_of(key)!r} is not reserved in this store")
            self._drop_pending(key)
            header = pending.header
            if checksum is None:
                payload = pending.page[block.HEADER_BYTES : header.block_bytes]
                checksum = block.payload_checksum(payload.cpu())
            sealed = dataclasses.replace(header, checksum=checksum)
            header_bytes = torch.frombuffer(bytearray(block.pack_header(sealed)), dtype=torch.uint8)
            pending.page[: block.HEADER_BYTES].copy_(header_bytes)
            self.slots[pending.slot].tier.commit(key, sealed.block_bytes)
            self._announce(pending.slot, sealed)

    def abort(self, key: bytes, writer: object) -> None:
        """See TieredStore.abort."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or pending.writer is not writer:
                return
            self._drop_pending(key)
            self.slots[pending.slot].tier.release(key)
            if pending.arrived is not None:
                pending.arrived.set()

    def claim(self, key: bytes, writer: object) -> bool:
        """See TieredStore.claim."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or pending.writer is not writer:
                return False
            pending.claimed = True
            return True

    def writes_pending(self) -> int:
        """Reserved pages not yet readable: saves and blocks on their way from peers."""
        with self._lock:
            return len(self._pending)

    def expire_reservations(self) -> int:
        """See TieredStore.expire_reservations."""
        ttl_s = self.shares.limits.reservation_ttl_s
        if not ttl_s:
            return 0
        now = time.monotonic()
        with self._lock:
            stale = [
                key
                for key, pending in self._pending.items()
                if pending.writer is not None
                and not pending.claimed
                and now - pending.reserved_at > ttl_s
            ]
            for key in stale:
                self.slots[self._drop_pending(key).slot].tier.release(key)
            self.expired_reservations += len(stale)
        if stale:
            logger.warning(
                "released %d reservations not committed within %.0f s", len(stale), ttl_s
            )
        return len(stale)

    def _being_written(self, key: bytes) -> bool:
        """Under the lock: whether a save, a received block or a promotion holds a page for
        `key` that is not readable yet."""
        return key in self._pending or key in self._promoting

    def _drop_pending(self, key: bytes) -> PendingWrite:
        """Under the lock: forget `key`'s reservation (its page stays the caller's to free or
        commit) and what it counted against its tenant."""
        pending = self._pending.pop(key)
        if pending.arrived is None:  # a save's page (reserve), not a block from a peer
            self.shares.count_reserved(pending.header.tenant, -1)
        return pending

    # ---- tenants' shares -----------------------------------------------------------------
    def _within_share(self, tenant: str, raise_if_not: bool) -> bool:
        """Under the lock: whether `tenant` may hold one more top-tier page reserved or pinned
        (always while no other tenant uses the tier), expiring stale reservations first if it
        is at its share. Past it, False, or with `raise_if_not` QuotaExceededError."""
        shares, top = self.shares, self.slots[0].tier
        if not shares.at_share(tenant, top):
            return True
        if self.expire_reservations() and not shares.at_share(tenant, top):
            return True
        return not shares.others_use(tenant, top) or shares.refuse(tenant, top, raise_if_not)

    def _check_room_for_saves(self) -> None:
        """Under the lock: CapacityError when a save's page would leave fewer evictable pages
        than the promotion reserve (a pinned block on disk could then not be read)."""
        top = self.slots[0].tier
        kept = self.shares.limits.promotion_reserve_pages
        if not kept or self._unevictable() < top.capacity_pages - kept:
            return
        if self.expire_reservations() and self._unevictable() < top.capacity_pages - kept:
            return
        raise CapacityError(
            f"{top.kind} tier: {self._unevictable()} of {top.capacity_pages} pages are reserved "
            f"or pinned; the last {kept} are kept for promotions"
        )

    def _unevictable(self) -> int:
        """Top-tier pages reserved or pinned (a pin below the top tier counts a page: rare,
        and erring on the side of room for promotions)."""
        top = self.slots[0].tier
        pinned = sum(top.pages_needed(top.stored_bytes(key)) for key in self._pins)
        pending = sum(p.page.numel() // top.page_size_bytes for p in self._pending.values())
        return pinned + pending

    def tenant_pages(self) -> dict[str, dict[str, int]]:
        """See TieredStore.tenant_pages."""
        self.expire_reservations()
        with self._lock:
            return self.shares.pages()

    # ---- eviction ------------------------------------------------------------------------
    def _make_room(self, index: int, size_bytes: int) -> None:
        """Under the lock: evict tier `index`'s victims (each demoted to the tier below where
        it has room) until a block of `size_bytes` fits; CapacityError if the rest is pinned
        or reserved. Victims come in the policy's order; where blocks need contiguous pages
        (the arena), a victim's neighbours go with it when together they open a run wide
        enough (Tier.eviction_window), so a block never waits for unrelated victims."""
        slot = self.slots[index]
        while not slot.tier.has_room(size_bytes):
            window = self._cheapest_window(slot, size_bytes)
            if window is None and index == 0 and self.expire_reservations():
                continue
            if window is None:
                raise CapacityError(
                    f"{slot.tier.kind} tier full: no room for a block of {size_bytes} bytes; "
                    f"the rest of its {slot.tier.capacity_pages} pages are pinned or being written"
                )
            for key in window:
                if key in slot.tier:  # a neighbour may go with an earlier victim's purge
                    self._evict(index, key)

    def _cheapest_window(self, slot: TierSlot, size_bytes: int) -> list[bytes] | None:
        """Under the lock: of the policy's next WINDOW_CANDIDATES victims (in its order: with
        prefix-aware policies, all leaves), the eviction window (Tier.eviction_window) that
        evicts the fewest bytes, the coldest on a tie; a window evicting no more than the new
        block needs ends the search (with blocks of one size, the first victim's always
        does). None when nothing can be evicted. Taking the cheapest of a few keeps the runs
        left between blocks, too narrow for any, rare (kvstore bench micro, arena_mix)."""
        best: list[bytes] | None = None
        best_bytes = 0
        tried: set[bytes] = set()
        for _ in range(WINDOW_CANDIDATES):
            victim = slot.policy.victim(lambda key: key not in tried and self._can_evict(key))
            if victim is None:
                break
            tried.add(victim)
            window = slot.tier.eviction_window(victim, size_bytes, self._can_evict)
            freed = sum(slot.tier.stored_bytes(key) for key in window)
            if best is None or freed < best_bytes:
                best, best_bytes = window, freed
            if best_bytes <= size_bytes:
                break
        return best

    def _evict(self, index: int, key: bytes) -> None:
        lower = index + 1
        if lower < len(self.slots) and key not in self.slots[lower].tier:
            with self.slots[index].tier.open(key) as page:
                header = self.checked_header(index, key, page)
                if header is None:
                    return  # corrupt: already purged
                self._copy_into(lower, key, header, page[: header.block_bytes])
        self._remove(index, key)

    def _copy_into(self, index: int, key: bytes, header, page: torch.Tensor) -> None:
        """Write a victim down to tier `index`; where that fails (no room, a failing disk) the
        victim is only evicted: a miss later, and the save that needed its page goes on."""
        slot = self.slots[index]
        try:
            self._make_room(index, page.numel())
            slot.tier.write(key, page)
        except CapacityError:
            logger.debug("no room in %s tier for %r; not copied", slot.tier.kind, key)
            return
        except Exception as exc:  # an I/O error; the tier's write stored nothing
            self.write_failures += 1
            if self.write_failures & (self.write_failures - 1) == 0:  # 1st, 2nd, 4th, ...
                logger.warning(
                    "writing a block down to the %s tier failed (%s; %d so far); "
                    "evicted without a copy",
                    slot.tier.kind,
                    exc,
                    self.write_failures,
                )
            return
        self._announce(index, header)

    # ---- promotion (kvstore/store_promotion.py copies the bytes) --------------------------
    def begin_promotion(self, key: bytes) -> PromotionStart:
        """Where pinned `key` is, and if it is below the top tier and no other thread is
        copying it up, a top-tier page reserved for it (None: no room) and marked underway:
        end_promotion must follow."""
        with self._lock:
            index = self._slot_of(key)
            underway = self._promoting.get(key)
            below = index not in (0, None) and underway is None
            page = (
                self._reserve_top(key, self.slots[index].tier.stored_bytes(key)) if below else None
            )
            return PromotionStart(index, underway, page)

    def _reserve_top(self, key: bytes, size_bytes: int) -> torch.Tensor | None:
        try:
            self._make_room(0, size_bytes)
            page = self.slots[0].tier.reserve(key, size_bytes)
        except CapacityError:
            logger.debug("no room in the top tier to promote %r; read where it is", key)
            return None
        self._promoting[key] = threading.Event()
        return page

    def end_promotion(
        self, index: int, key: bytes, header: block.BlockHeader | None, corrupt: bool
    ) -> None:
        """Commit the promoted copy (`header`), or free its page (and purge the block below
        when it was `corrupt`), in one step: no moment where the key is in no tier but still
        holds a top-tier page. Then wakes the threads waiting for this promotion."""
        with self._lock:
            try:
                top = self.slots[0].tier
                if header is not None:
                    top.commit(key, header.block_bytes)
                    self._announce(0, header)
                    return
                top.release(key)
                if corrupt:
                    self.checksum_failures += 1
                    if key in self.slots[index].tier:
                        self._remove(index, key)
            finally:
                self._promoting.pop(key).set()

    # ---- demotion ahead of need (kvstore/store_demotion.py copies the bytes) --------------
    def next_demotion(self, free_pages: int) -> DemotionStart | None:
        """The top tier's next victim to write down, pinned, with a page reserved for it in
        the tier below (victims that tier holds already are dropped on the way); None when
        `free_pages` are free or nothing can be evicted. finish_demotion must follow."""
        with self._lock:
            top = self.slots[0]
            while len(self.slots) > 1 and top.tier.free_pages < free_pages:
                key = top.policy.victim(self._can_evict)
                if key is None:
                    return None
                if key in self.slots[1].tier:
                    self._remove(0, key)
                    continue
                with top.tier.open(key) as page:
                    header = self.checked_header(0, key, page)
                if header is None:
                    continue  # corrupt: purged
                self._make_room(1, header.block_bytes)
                lower_page = self.slots[1].tier.reserve(key, header.block_bytes)
                self._pin(key)
                return DemotionStart(key, header, lower_page)
        return None

    def finish_demotion(self, key: bytes, header: block.BlockHeader, written: bool) -> None:
        """Commit the copy below (`written`) or free its page; unpin the victim and drop it
        from the top tier unless it was pinned meanwhile (then it stays in both)."""
        with self._lock:
            if written:
                self._announce(1, header)
            else:
                self.slots[1].tier.release(key)
            self._unpin([key])
            if written and key not in self._pins and key in self.slots[0].tier:
                self._remove(0, key)

    # ---- blocks received from peers (kvstore/store_received.py verifies the bytes) -------
    def reserve_received(self, key: bytes) -> torch.Tensor | None:
        """Top-tier room for the largest block the tier takes, for `key` arriving from a peer
        (its size is known once it lands: the commit frees the pages past it), pending until
        finish_received; None if `key` is already stored or being written."""
        with self._lock:
            if self._slot_of(key) is not None or self._being_written(key):
                return None
            top = self.slots[0].tier
            self._make_room(0, top.max_block_bytes)
            page = top.reserve(key, top.max_block_bytes)
            header = block.BlockHeader(key_of(key), None, 0, 0, tenant=tenant_of(key))
            self._pending[key] = PendingWrite(0, page, header, threading.Event())
            return page

    def pending_write(self, key: bytes) -> PendingWrite | None:
        """`key`'s reservation not yet readable (a save or a block on its way), or None."""
        with self._lock:
            return self._pending.get(key)

    def finish_received(
        self, key: bytes, pending: PendingWrite, header: block.BlockHeader | None
    ) -> bool:
        """Decide `key`'s received block: readable with its verified `header`, or discarded
        (None: counted in checksum_failures, False). Wakes the threads waiting for it."""
        with self._lock:
            del self._pending[key]
            if pending.arrived is not None:  # under the lock: a waiter finds it decided
                pending.arrived.set()
            if header is None:
                self.checksum_failures += 1
                self.slots[pending.slot].tier.release(key)
                return False
            self.slots[pending.slot].tier.commit(key, header.block_bytes)
            self._announce(pending.slot, header)
            return True

    # ---- which tier holds what -----------------------------------------------------------
    def checked_header(
        self, index: int, key: bytes, page: torch.Tensor | None, verify: bool = False
    ) -> block.BlockHeader | None:
        """The header of `key`'s block in `page` of tier `index` (checksummed where the tier
        wants it, or `verify`), or None: the block is corrupt and purged (takes the lock then).
        The caller keeps the page from reuse (a pin, or the lock)."""
        tier = self.slots[index].tier
        try:
            if page is None:
                raise ChecksumError(f"{tier.kind} tier lost {key_of(key)!r}")
            if verify or tier.verify_reads:
                header = block.verify(page, key_of(key))
            else:
                cpu = page if page.device.type == "cpu" else page[: block.HEADER_BYTES].cpu()
                header = block.unpack_header(cpu)
            if owned_key(header.tenant, header.key) != key:
                raise ChecksumError(
                    f"{tier.kind} page holds {header.key!r} of {header.tenant!r}, not "
                    f"{key_of(key)!r} of {tenant_of(key)!r}"
                )
            return header
        except ChecksumError as exc:
            logger.warning("purging corrupt block: %s", exc)
            with self._lock:
                self.checksum_failures += 1
                if key in tier:
                    self._remove(index, key)
            return None

    def _announce(self, index: int, header: block.BlockHeader) -> None:
        """A block became readable in tier `index`: tell its policy and the event feed."""
        slot = self.slots[index]
        parent = None if header.parent is None else owned_key(header.tenant, header.parent)
        slot.policy.insert(owned_key(header.tenant, header.key), parent)
        self.shares.count_stored(header.tenant, slot.tier.kind, 1)
        self.events.emit(
            EventKind.STORED, header.key, slot.tier.kind, header.block_bytes, header.tenant
        )

    def _remove(self, index: int, key: bytes) -> None:
        slot = self.slots[index]
        slot.tier.release(key)
        slot.policy.remove(key)
        tenant = tenant_of(key)
        self.removals[slot.tier.kind] += 1
        self.shares.count_stored(tenant, slot.tier.kind, -1)
        self.events.emit(EventKind.REMOVED, key_of(key), slot.tier.kind, tenant=tenant)

    def recover(self) -> None:
        """Index blocks already in the tiers (a reopened disk tier) and announce them. Runs
        once, before the store is shared."""
        with self._lock:
            for index, slot in enumerate(self.slots):
                for key in slot.tier.keys():  # noqa: SIM118 (a Tier is not a dict)
                    header = self._recovered_header(index, key)
                    if header is not None:
                        self._announce(index, header)

    def _recovered_header(self, index: int, key: bytes) -> block.BlockHeader | None:
        """Header only: payloads are checksummed when read, not all at start-up."""
        tier = self.slots[index].tier
        with tier.open(key) as page:
            try:
                header = block.unpack_header(page[: block.HEADER_BYTES].cpu())
                if owned_key(header.tenant, header.key) == key:
                    return header
            except ChecksumError:
                pass
        logger.warning("dropping unreadable %r from the %s tier", key, tier.kind)
        self._remove(index, key)
        return None

    def remove(self, keys: Sequence[bytes]) -> int:
        """See TieredStore.remove."""
        removed = 0
        with self._lock:
            for key in keys:
                if key in self._pins:
                    continue
                for index, slot in enumerate(self.slots):
                    if key in slot.tier:
                        self._remove(index, key)
                        removed += 1
        return removed

    def inventory(self) -> list[tuple[BlockKey, str, str]]:
        """(key, tier kind, tenant) of every readable block, for a full re-publish."""
        with self._lock:
            return [
                (key_of(key), slot.tier.kind, tenant_of(key))
                for slot in self.slots
                for key in slot.tier.keys()  # noqa: SIM118 (a Tier is not a dict)
            ]

    def usage(self) -> dict[str, dict[str, int]]:
        """Pages used (by blocks, reserved or committed) and available per tier, with the page
        size and the largest block each takes."""
        with self._lock:
            return {
                slot.tier.kind: {
                    "used_pages": slot.tier.used_pages,
                    "used_blocks": slot.tier.used_blocks,
                    "capacity_pages": slot.tier.capacity_pages,
                    "page_size_bytes": slot.tier.page_size_bytes,
                    "max_block_bytes": slot.tier.max_block_bytes,
                }
                for slot in self.slots
            }

    def close(self) -> None:
        with self._lock:
            for slot in self.slots:
                slot.tier.close()
