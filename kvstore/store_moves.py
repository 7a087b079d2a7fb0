"""Moving blocks between a TieredStore's tiers: eviction with demotion (tier i -> tier i+1,
the last tier drops), promotion on a pin (lower tier -> top tier) and demotion ahead of need.
Promotions and demotions ahead copy with the store lock released, so a slow disk stalls only
the thread that waits for it.

A mixin of TieredStore (kvstore/store.py), whose lock, slots, pins and bookkeeping it uses;
runs in the node agent's worker threads (promotions) and its demotion thread.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvstore import block
from kvstore.errors import CapacityError, ChecksumError
from kvstore.kvcopy.verified import copy_block
from kvstore.owned import key_of, owned_key

logger = logging.getLogger(__name__)


class TierMoves:
    """Eviction, promotion and demotion of TieredStore (see the module docstring)."""

    def _make_room(self, index: int) -> None:
        slot = self.slots[index]
        while slot.tier.free_pages <= 0:
            victim = slot.policy.victim(self._can_evict)
            if victim is None and index == 0 and self.expire_reservations():
                continue
            if victim is None:
                raise CapacityError(
                    f"{slot.tier.kind} tier full: all {slot.tier.capacity_pages} pages are "
                    "pinned or being written"
                )
            self._demote(index, victim)

    def _demote(self, index: int, key: bytes) -> None:
        lower = index + 1
        if lower < len(self.slots) and key not in self.slots[lower].tier:
            with self.slots[index].tier.open(key) as page:
                header = self._checked_header(index, key, page)
                if header is None:
                    return  # corrupt: already purged
                self._copy_into(lower, key, header, page[: header.block_bytes])
        self._remove(index, key)

    def _copy_into(self, index: int, key: bytes, header, page: torch.Tensor) -> None:
        """Write a victim down to tier `index`; where that fails (no room, a failing disk) the
        victim is only evicted: a miss later, and the save that needed its page goes on."""
        slot = self.slots[index]
        try:
            self._make_room(index)
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

    def _promoted(self, key: bytes) -> bool:
        """Bring pinned `key` into the top tier if it is below it and room can be made (else it
        stays where it is, readable there); False if its block is corrupt (purged). One
        thread copies a block up; others pinning it meanwhile wait for that copy."""
        with self._lock:
            index = self._slot_of(key)
            underway = self._promoting.get(key)
            below = index not in (0, None) and underway is None
            page = self._reserve_top(key) if below else None
        if underway is not None:
            underway.wait()
            with self._lock:
                return self._slot_of(key) is not None
        if page is None:
            return index is not None
        header, corrupt = None, False
        try:
            header = self._copy_up(index, key, page)
            corrupt = header is None
        finally:
            with self._lock:
                try:
                    self._end_promotion(index, key, header, corrupt)
                finally:
                    self._promoting.pop(key).set()
        return header is not None

    def _end_promotion(self, index: int, key: bytes, header, corrupt: bool) -> None:
        """Under the lock: commit the promoted copy, or free its page (and purge the block
        below when it was corrupt), in one step: no moment where the key is in no tier but
        still holds a top-tier page."""
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

    def _reserve_top(self, key: bytes) -> torch.Tensor | None:
        """Under the lock: a top-tier page for promoting `key` (None: no room), marked underway."""
        try:
            self._make_room(0)
            page = self.slots[0].tier.reserve(key)
        except CapacityError:
            logger.debug("no room in the top tier to promote %r; read where it is", key)
            return None
        self._promoting[key] = threading.Event()
        return page

    def _copy_up(self, index: int, key: bytes, page: torch.Tensor) -> block.BlockHeader | None:
        """Without the lock: copy `key`'s block from tier `index` into the top-tier `page`,
        checksummed as it is copied (one pass); None if it is corrupt (the caller purges)."""
        with self.slots[index].tier.open(key) as source:
            try:
                if source is None:
                    raise ChecksumError(f"{self.slots[index].tier.kind} tier lost {key_of(key)!r}")
                header = copy_block(page, source, key_of(key))
                if owned_key(header.tenant, header.key) != key:
                    raise ChecksumError(f"{key_of(key)!r} is stored as {header.tenant!r}'s")
                return header
            except ChecksumError as exc:
                logger.warning("purging corrupt block: %s", exc)
                return None

    def demote_ahead(self, free_pages: int, stop: threading.Event | None = None) -> int:
        """Demote the top tier's next victims until `free_pages` of its pages are free (or
        `stop` is set), each written into the tier below with the store lock released, so a
        save finds a free page instead of waiting under the lock for a disk write. A victim
        pinned while it was written stays, in both tiers. Returns how many blocks were
        written down. Called by the node agent's demotion thread."""
        written = 0
        while not (stop and stop.is_set()) and (victim := self._next_demotion(free_pages)):
            key, header, lower_page = victim
            done = False
            try:
                with self.slots[0].tier.open(key) as page:
                    if page is not None:  # None: purged meanwhile (corrupt), nothing to write
                        lower = self.slots[1].tier
                        lower.write_reserved(key, lower_page, page[: header.block_bytes])
                        done = True
            finally:
                with self._lock:
                    self._finish_demotion(key, header, done)
            written += done
        return written

    def _next_demotion(self, free_pages: int):
        """Under the lock: the next victim to write down, pinned, as (key, header, its reserved
        lower page), after dropping victims the lower tier holds already; None when enough
        pages are free."""
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
                    header = self._checked_header(0, key, page)
                if header is None:
                    continue  # corrupt: purged
                self._make_room(1)
                lower_page = self.slots[1].tier.reserve(key)
                self._pin(key)
                return key, header, lower_page
        return None

    def _finish_demotion(self, key: bytes, header: block.BlockHeader, written: bool) -> None:
        if written:
            self._announce(1, header)
        else:
            self.slots[1].tier.release(key)
        self.unpin([key])
        if written and key not in self._pins and key in self.slots[0].tier:
            self._remove(0, key)
