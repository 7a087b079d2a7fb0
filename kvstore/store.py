"""The node-local store: tiers stacked fastest first, each with its own eviction policy.

Runs in the process that owns the tiers (the node agent; replay and benchmarks in-process).
Thread-safe: one lock guards what every tier holds; reads of pinned blocks, and the copies
of promotions and of demotions ahead of need, run outside it. Longest-prefix lookup across
tiers; pins (pinned blocks are never evicted); stored/removed events for the publisher. Moves
between tiers (promotion on a pin, demotion on eviction or ahead of it): kvstore/store_moves.py;
blocks received from peers: kvstore/store_received.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat

import torch

from kvstore import block
from kvstore.errors import ChecksumError, ConfigError, NotFoundError
from kvstore.events import EventFeed, EventKind
from kvstore.eviction.base import EvictionPolicy
from kvstore.keys import BlockKey
from kvstore.kvcopy.verified import copy_and_checksum
from kvstore.store_moves import TierMoves
from kvstore.store_received import PendingWrite, ReceivedBlocks
from kvstore.tiers.base import Tier

logger = logging.getLogger(__name__)


@dataclass
class TierSlot:
    tier: Tier
    policy: EvictionPolicy


class TieredStore(TierMoves, ReceivedBlocks):
    """Blocks across tiers. Slot 0 is the fastest; new blocks are written there."""

    def __init__(self, slots: Sequence[TierSlot], events: EventFeed | None = None) -> None:
        if not slots:
            raise ConfigError("a store needs at least one tier")
        self.slots = list(slots)
        self.events = events or EventFeed()
        self._lock = threading.RLock()
        self._pins: Counter[BlockKey] = Counter()
        self._pending: dict[BlockKey, PendingWrite] = {}
        self._promoting: dict[BlockKey, threading.Event] = {}  # set when its copy up is done
        self._tenants: dict[BlockKey, str] = {}  # key -> tenant, for events
        self.removals: Counter[str] = Counter()  # per tier: evicted, demoted or purged
        self.checksum_failures = 0
        self.write_failures = 0  # victims a lower tier failed to store (evicted, not demoted)
        self._recover()

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], tenant: str | None = None) -> int:
        """How many leading `keys` are committed in some tier (and, with `tenant`, belong to
        that tenant: another tenant's block reads as absent). No side effects."""
        with self._lock:
            for count, key in enumerate(keys):
                if not self._readable(key, tenant):
                    return count
            return len(keys)

    def lookup_slots(self, keys: Sequence[BlockKey], tenant: str | None = None) -> bytes:
        """`lookup` with where: one byte per leading readable key, the index of the fastest
        slot holding it (len() is what `lookup` counts). No side effects."""
        found = bytearray()
        with self._lock:
            fastest = self.slots[0].tier.committed_keys()
            if tenant is None:
                owners = repeat(None)
            else:
                owners = list(map(self._tenants.get, keys))
                if owners.count(tenant) == len(keys) and all(map(fastest.__contains__, keys)):
                    return bytes(len(keys))  # the common hit, in C: all in the fastest slot
            for key, owner in zip(keys, owners, strict=False):  # repeat() is endless
                if owner != tenant:
                    break
                if key in fastest:  # the common case, tested in C
                    found.append(0)
                    continue
                index = self._slot_of(key)
                if index is None:
                    break
                found.append(index)
        return bytes(found)

    def _readable(self, key: BlockKey, tenant: str | None) -> bool:
        if self._slot_of(key) is None:
            return False
        return tenant is None or self._tenants.get(key) == tenant

    def tier_of(self, key: BlockKey) -> str | None:
        """The kind of the fastest tier holding `key`, or None."""
        with self._lock:
            slot = self._slot_of(key)
            return None if slot is None else self.slots[slot].tier.kind

    def _slot_of(self, key: BlockKey) -> int | None:
        for index, slot in enumerate(self.slots):
            if key in slot.tier:
                return index
        return None

    # ---- pins ----------------------------------------------------------------------------
    def pin(self, keys: Sequence[BlockKey], tenant: str | None = None) -> int:
        """Pin the leading resident `keys` (of `tenant`, when given) for reading and return
        how many were pinned.

        Counts as an access for every policy; promotes blocks from lower tiers to the top
        tier when room can be made (key by key: a later key may be evicted to make room for
        an earlier one), reading them with the store lock released, so a disk read stalls no
        other worker. A block failing its checksum ends the run (it is purged).
        """
        for index, key in enumerate(keys):
            with self._lock:
                if not self._readable(key, tenant):
                    return index
                self._pins[key] += 1
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

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        """Drop one pin from each key; unknown or unpinned keys are ignored."""
        with self._lock:
            for key in keys:
                if self._pins[key] <= 1:
                    self._pins.pop(key, None)
                else:
                    self._pins[key] -= 1

    def pins_held(self) -> int:
        with self._lock:
            return sum(self._pins.values())

    def _can_evict(self, key: BlockKey) -> bool:
        return key not in self._pins

    # ---- two-phase writes ----------------------------------------------------------------
    def reserve(
        self, key: BlockKey, parent: BlockKey | None, payload_bytes: int,
        layout_hash: int = 0, codec_id: int = 0, tenant: str = "default",
    ) -> torch.Tensor | None:  # fmt: skip
        """A writable payload view in the top tier for `key`, or None if `key` is already
        stored or being written. Evicts as needed; CapacityError if nothing can be evicted."""
        with self._lock:
            if self._slot_of(key) is not None or key in self._pending or key in self._promoting:
                return None
            top = self.slots[0].tier
            if block.HEADER_BYTES + payload_bytes > top.page_size_bytes or payload_bytes <= 0:
                raise ConfigError(
                    f"payload of {payload_bytes} bytes does not fit a {top.kind} page of "
                    f"{top.page_size_bytes} bytes (header {block.HEADER_BYTES})"
                )
            block.encode_tenant(tenant)  # validate before taking a page, not at commit
            self._make_room(0)
            page = top.reserve(key)
            header = block.BlockHeader(key, parent, payload_bytes, 0, layout_hash, codec_id, tenant)
            self._pending[key] = PendingWrite(0, page, header)
            return page[block.HEADER_BYTES : block.HEADER_BYTES + payload_bytes]

    def commit(self, key: BlockKey, checksum: int | None = None) -> None:
        """Seal the header and make the block readable. `checksum` is the payload's xxh3-64 if
        the writer computed it while writing; otherwise it is computed here (one more pass)."""
        with self._lock:
            pending = self._pending.pop(key, None)
            if pending is None:
                raise NotFoundError(f"{key!r} is not reserved in this store")
            header = pending.header
            if checksum is None:
                payload = pending.page[block.HEADER_BYTES : header.block_bytes]
                checksum = block.payload_checksum(payload.cpu())
            sealed = dataclasses.replace(header, checksum=checksum)
            header_bytes = torch.frombuffer(bytearray(block.pack_header(sealed)), dtype=torch.uint8)
            pending.page[: block.HEADER_BYTES].copy_(header_bytes)
            self.slots[pending.slot].tier.commit(key, sealed.block_bytes)
            self._announce(pending.slot, sealed)

    def abort(self, key: BlockKey) -> None:
        """Give up a reservation; its page is freed and nothing becomes readable."""
        with self._lock:
            pending = self._pending.pop(key, None)
            if pending is not None:
                self.slots[pending.slot].tier.release(key)
                if pending.arrived is not None:
                    pending.arrived.set()

    def put(self, key: BlockKey, parent: BlockKey | None, payload: bytes | torch.Tensor) -> bool:
        """Store a whole payload (reserve, copy, commit). False if `key` was already present."""
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
    def read(self, key: BlockKey) -> Iterator[torch.Tensor | None]:
        """Yield the payload of `key` from its fastest tier, or None on a miss; see open_block."""
        with self.open_block(key) as whole:
            yield None if whole is None else whole[block.HEADER_BYTES :]

    @contextmanager
    def open_block(self, key: BlockKey, tenant: str | None = None) -> Iterator[torch.Tensor | None]:
        """Yield the whole stored block (header + payload) of `key`, or None on a miss; with
        `tenant`, a block of another tenant is a miss too (the caller cannot tell them apart).

        The block is pinned while the context is open, so the view stays valid without the
        store lock (other threads keep working). Blocks from tiers that require it (disk) are
        checksummed first; a corrupt block is purged and reads as a miss.
        """
        with self._lock:
            index = self._slot_of(key) if self._readable(key, tenant) else None
            if index is not None:
                self._pins[key] += 1
        if index is None:
            yield None
            return
        try:
            with self.slots[index].tier.open(key) as page:
                header = self._checked_header(index, key, page)
                yield None if header is None else page[: header.block_bytes]
        finally:
            self.unpin([key])

    def purge_if_corrupt(self, key: BlockKey) -> None:
        """Checksum `key`'s stored block (a reader's copy of it failed its checksum) and purge
        it if its bytes are not the checksum's; a block whose page was reused under the reader
        is not in doubt and stays."""
        with self._lock:
            index = self._slot_of(key)
            if index is None:
                return
            self._pins[key] += 1
        try:
            with self.slots[index].tier.open(key) as page:
                self._checked_header(index, key, page, verify=True)
        finally:
            self.unpin([key])

    def _checked_header(
        self, index: int, key: BlockKey, page: torch.Tensor | None, verify: bool = False
    ) -> block.BlockHeader | None:
        tier = self.slots[index].tier
        try:
            if page is None:
                raise ChecksumError(f"{tier.kind} tier lost {key!r}")
            if verify or tier.verify_reads:
                return block.verify(page, key)
            header = block.unpack_header(page if page.device.type == "cpu" else page[:64].cpu())
            if header.key != key:
                raise ChecksumError(f"{tier.kind} page holds {header.key!r}, not {key!r}")
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
        slot.policy.insert(header.key, header.parent)
        self._tenants[header.key] = header.tenant
        self.events.emit(
            EventKind.STORED, header.key, slot.tier.kind, header.block_bytes, header.tenant
        )

    def _remove(self, index: int, key: BlockKey) -> None:
        slot = self.slots[index]
        slot.tier.release(key)
        slot.policy.remove(key)
        tenant = self._tenants.get(key, "default")
        self.removals[slot.tier.kind] += 1
        if self._slot_of(key) is None:
            self._tenants.pop(key, None)
        self.events.emit(EventKind.REMOVED, key, slot.tier.kind, tenant=tenant)

    def _recover(self) -> None:
        """Index blocks already in the tiers (a reopened disk tier) and announce them."""
        for index, slot in enumerate(self.slots):
            for key in slot.tier.keys():  # noqa: SIM118 (a Tier is not a dict)
                header = self._recovered_header(index, key)
                if header is not None:
                    self._announce(index, header)

    def _recovered_header(self, index: int, key: BlockKey) -> block.BlockHeader | None:
        """Header only: payloads are checksummed when read, not all at start-up."""
        tier = self.slots[index].tier
        with tier.open(key) as page:
            try:
                header = block.unpack_header(page[: block.HEADER_BYTES].cpu())
                if header.key == key:
                    return header
            except ChecksumError:
                pass
        logger.warning("dropping unreadable %r from the %s tier", key, tier.kind)
        self._remove(index, key)
        return None

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop `keys` from every tier (removed events follow); pinned keys stay. Returns how
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
                (key, slot.tier.kind, self._tenants.get(key, "default"))
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
