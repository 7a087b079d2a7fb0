"""The node-local store: tiers stacked fastest first, each with its own eviction policy.

Runs in the process that owns the tiers (the node agent; replay and benchmarks in-process).
Thread-safe: one lock guards what every tier holds; reads of pinned blocks, and the copies
of promotions and of demotions ahead of need, run outside it. Blocks are named by owned keys
(kvstore/owned.py: a tenant's key), so one tenant's block never answers another's. Longest-
prefix lookup across tiers; pins (pinned blocks are never evicted); each tenant's share of the
top tier's pages; stored/removed events for the publisher. Moves
between tiers (promotion on a pin, demotion on eviction or ahead of it): kvstore/store_moves.py;
blocks received from peers: kvstore/store_received.py; each tenant's share of the top tier:
kvstore/store_shares.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvstore import block
from kvstore.errors import (
    ChecksumError,
    ConfigError,
    NotFoundError,
)
from kvstore.events import EventFeed, EventKind
from kvstore.eviction.base import EvictionPolicy
from kvstore.keys import BlockKey
from kvstore.kvcopy.verified import copy_and_checksum
from kvstore.owned import key_of, owned_key, tenant_of
from kvstore.store_moves import TierMoves
from kvstore.store_received import PendingWrite, ReceivedBlocks
from kvstore.store_shares import ArenaLimits, ArenaShares, count_change
from kvstore.tiers.base import Tier

logger = logging.getLogger(__name__)


@dataclass
class TierSlot:
    tier: Tier
    policy: EvictionPolicy


class TieredStore(TierMoves, ReceivedBlocks, ArenaShares):
    """Blocks across tiers. Slot 0 is the fastest; new blocks are written there."""

    def __init__(
        self,
        slots: Sequence[TierSlot],
        events: EventFeed | None = None,
        limits: ArenaLimits | None = None,
    ) -> None:
        if not slots:
            raise ConfigError("a store needs at least one tier")
        self.slots = list(slots)
        self.events = events or EventFeed()
        self.limits = limits or ArenaLimits()
        self._lock = threading.RLock()
        self._pins: Counter[bytes] = Counter()  # owned key -> pins
        self._pending: dict[bytes, PendingWrite] = {}
        self._promoting: dict[bytes, threading.Event] = {}  # set when its copy up is done
        self._reserved: Counter[str] = Counter()  # tenant -> its saves' reserved pages
        self._pinned: Counter[str] = Counter()  # tenant -> its pinned blocks
        self._stored: Counter[tuple[str, str]] = Counter()  # (tenant, tier kind) -> blocks
        self.removals: Counter[str] = Counter()  # per tier: evicted, demoted or purged
        self.checksum_failures = 0
        self.write_failures = 0  # victims a lower tier failed to store (evicted, not demoted)
        self.expired_reservations = 0
        self.share_refusals = 0  # reserves and pins refused: the tenant held its share
        self._recover()

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading owned `keys` are committed in some tier. No side effects."""
        with self._lock:
            for count, key in enumerate(keys):
                if self._slot_of(key) is None:
                    return count
            return len(keys)

    def lookup_slots(self, keys: Sequence[bytes]) -> bytes:
        """`lookup` with where: one byte per leading readable key, the index of the fastest
        slot holding it (len() is what `lookup` counts). No side effects."""
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

    def tier_of(self, key: bytes) -> str | None:
        """The kind of the fastest tier holding `key`, or None."""
        with self._lock:
            slot = self._slot_of(key)
            return None if slot is None else self.slots[slot].tier.kind

    def _slot_of(self, key: bytes) -> int | None:
        for index, slot in enumerate(self.slots):
            if key in slot.tier:
                return index
        return None

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
            with self._lock:
                if self._slot_of(key) is None:
                    return index
                if key not in self._pins and not self._within_share(tenant_of(key), index == 0):
                    return index
                self._pin(key)
                for slot in self.slots:
                    slot.policy.touch(key)
                if self._slot_of(key) == 0:
                    continue
            try:
                promoted = self._promoted(key)
            except BaseException:
                self.unpin(keys[: index + 1])  # the caller gets no count to release
                raise
            if not promoted:
                self.unpin([key])
                return index
        return len(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Drop one pin from each key; unknown or unpinned keys are ignored."""
        with self._lock:
            for key in keys:
                pins = self._pins.get(key, 0)
                if pins > 1:
                    self._pins[key] = pins - 1
                elif pins == 1:
                    del self._pins[key]
                    count_change(self._pinned, tenant_of(key), -1)

    def _pin(self, key: bytes) -> None:
        """Under the lock: one more pin on `key`; its first counts against its tenant."""
        if key not in self._pins:
            self._pinned[tenant_of(key)] += 1
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
        with self._lock:
            if self._slot_of(key) is not None or key in self._pending or key in self._promoting:
                return None
            top = self.slots[0].tier
            if block.HEADER_BYTES + payload_bytes > top.page_size_bytes or payload_bytes <= 0:
                raise ConfigError(
                    f"payload of {payload_bytes} bytes does not fit a {top.kind} page of "
                    f"{top.page_size_bytes} bytes (header {block.HEADER_BYTES})"
                )
            tenant = tenant_of(key)
            block.encode_tenant(tenant)  # validate before taking a page, not at commit
            self._check_room_for_saves()
            self._within_share(tenant, raise_if_not=True)
            self._make_room(0)
            page = top.reserve(key)
            parent_key = None if parent is None else key_of(parent)
            header = block.BlockHeader(
                key_of(key), parent_key, payload_bytes, 0, layout_hash, codec_id, tenant
            )
            self._pending[key] = PendingWrite(0, page, header, writer=writer)
            self._reserved[tenant] += 1
            return page[block.HEADER_BYTES : block.HEADER_BYTES + payload_bytes]

    def commit(self, key: bytes, checksum: int | None = None, writer: object = None) -> None:
        """Seal the header and make the block readable. `checksum` is the payload's xxh3-64 if
        the writer computed it while writing; otherwise it is computed here (one more pass).
        NotFoundError if `key` is not reserved by `writer` (committed, aborted or expired)."""
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

    def abort(self, key: bytes, writer: object = None) -> None:
        """Give up `writer`'s reservation of `key`; its page is freed and nothing becomes
        readable. Another writer's reservation (this one's expired) is left alone."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or pending.writer is not writer:
                return
            self._drop_pending(key)
            self.slots[pending.slot].tier.release(key)
            if pending.arrived is not None:
                pending.arrived.set()

    def put(self, key: bytes, parent: bytes | None, payload: bytes | torch.Tensor) -> bool:
        """Store a whole payload (reserve, copy, commit) under owned `key`. False if `key` was
        already present."""
        source = (
            payload
            if isinstance(payload, torch.Tensor)
            else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        )
        with self._lock:
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
        with self._lock:
            index = self._slot_of(key)
            if index is not None:
                self._pin(key)
        if index is None:
            yield None
            return
        try:
            with self.slots[index].tier.open(key) as page:
                header = self._checked_header(index, key, page)
                yield None if header is None else page[: header.block_bytes]
        finally:
            self.unpin([key])

    def purge_if_corrupt(self, key: bytes) -> None:
        """Checksum `key`'s stored block (a reader's copy of it failed its checksum) and purge
        it if its bytes are not the checksum's; a block whose page was reused under the reader
        is not in doubt and stays."""
        with self._lock:
            index = self._slot_of(key)
            if index is None:
                return
            self._pin(key)
        try:
            with self.slots[index].tier.open(key) as page:
                self._checked_header(index, key, page, verify=True)
        finally:
            self.unpin([key])

    def _checked_header(
        self, index: int, key: bytes, page: torch.Tensor | None, verify: bool = False
    ) -> block.BlockHeader | None:
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

    # ---- bookkeeping of what each tier holds ---------------------------------------------
    def _announce(self, index: int, header: block.BlockHeader) -> None:
        """A block became readable in tier `index`: tell its policy and the event feed."""
        slot = self.slots[index]
        parent = None if header.parent is None else owned_key(header.tenant, header.parent)
        slot.policy.insert(owned_key(header.tenant, header.key), parent)
        self._stored[header.tenant, slot.tier.kind] += 1
        self.events.emit(
            EventKind.STORED, header.key, slot.tier.kind, header.block_bytes, header.tenant
        )

    def _remove(self, index: int, key: bytes) -> None:
        slot = self.slots[index]
        slot.tier.release(key)
        slot.policy.remove(key)
        tenant = tenant_of(key)
        self.removals[slot.tier.kind] += 1
        count_change(self._stored, (tenant, slot.tier.kind), -1)
        self.events.emit(EventKind.REMOVED, key_of(key), slot.tier.kind, tenant=tenant)

    def _recover(self) -> None:
        """Index blocks already in the tiers (a reopened disk tier) and announce them."""
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
        """Drop owned `keys` from every tier (removed events follow); pinned keys stay. Returns how
        many blocks were removed."""
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

    # ---- lifecycle -----------------------------------------------------------------------
    def usage(self) -> dict[str, dict[str, int]]:
        """Pages and bytes used and available per tier."""
        with self._lock:
            return {
                slot.tier.kind: {
                    "used_pages": slot.tier.used_pages,
                    "capacity_pages": slot.tier.capacity_pages,
                    "page_size_bytes": slot.tier.page_size_bytes,
                }
                for slot in self.slots
            }

    def close(self) -> None:
        with self._lock:
            for slot in self.slots:
                slot.tier.close()
