"""One worker's session with the node agent: its loads and saves, released when the worker
asks, or when the worker is gone (see orphans.py: a session whose connection broke keeps its
pins until its process exits or a long lease passes, because the worker may still be copying
from those pages). Every call acts for a tenant the worker's authenticated identity allows and
sees only that tenant's blocks. A shared worker reads and writes arena pages in place; a
private one gets copies in its own buffer (private.py). Runs in the node agent, on that
worker's control-connection thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore import block
from kvstore.errors import (
    CapacityError,
    ChecksumError,
    ConfigError,
    NotFoundError,
    QuotaExceededError,
)
from kvstore.keys import BlockKey
from kvstore.kvcopy.verified import copy_and_checksum
from kvstore.node.identity import WorkerIdentity
from kvstore.node.private import PrivateBuffer
from kvstore.node.remote import RemoteFetcher
from kvstore.owned import owned_key, owned_keys
from kvstore.store import TieredStore
from kvstore.tier import DISK, HOST, REMOTE
from kvstore.tiers.arena import ArenaTier

logger = logging.getLogger(__name__)
_ids = itertools.count(1)
TIER_CODES = {answer.name: answer.code[0] for answer in (HOST, DISK)}  # per slot
REMOTE_CODE = REMOTE.code


@dataclass
class LoadedPrefix:
    load_id: int
    offsets: list[int]  # where each payload starts in the worker's mapping
    headers: list[block.BlockHeader]
    local_blocks: int
    remote_blocks: int


@dataclass
class _Load:
    keys: list[bytes]  # owned keys pinned in the arena (shared workers)
    slots: list[int] = field(default_factory=list)  # private-buffer offsets (private workers)


@dataclass(eq=False)
class Reservation:
    """One save: its pages, by owned key; the store knows it as their writer."""

    save_id: int
    tenant: str
    payload_bytes: int
    pages: dict[bytes, int] = field(default_factory=dict)  # reserved, not yet committed
    slots: dict[bytes, int] = field(default_factory=dict)  # private workers' write slots


class RequestCounters:
    """Blocks asked for and served, across every session of one agent. Thread-safe."""

    NAMES = (
        "lookup_asked",
        "lookup_local_hit",
        "lookup_remote_hit",
        "lookup_tokens_asked",
        "lookup_tokens_local_hit",
        "lookup_tokens_remote_hit",
        "load_local",
        "load_remote",
        "load_miss",
        "saved",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.NAMES, 0)

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                self._counts[name] += value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class WorkerSession:
    def __init__(
        self,
        store: TieredStore,
        fetcher: RemoteFetcher | None,
        counters: RequestCounters,
        identity: WorkerIdentity,
        max_pins: int,
        private: PrivateBuffer | None = None,
    ) -> None:
        self.store = store
        self.fetcher = fetcher
        self.counters = counters
        self.identity = identity
        self.max_pins = max_pins  # pinned plus reserved pages this worker may hold at once
        self.private = private  # None: the worker maps the arena itself
        self.name = ""
        self.loads: dict[int, _Load] = {}
        self.saves: dict[int, Reservation] = {}
        self._codes: bytes | None = None  # see _slot_codes

    @property
    def arena(self) -> ArenaTier:
        return self.store.slots[0].tier

    def pages_held(self) -> int:
        """Arena pages this worker keeps pinned or reserved."""
        pinned = sum(len(load.keys) for load in self.loads.values())
        return pinned + sum(len(r.pages) for r in self.saves.values())

    def _require_room(self, wanted: int) -> None:
        held = self.pages_held()
        if held + wanted > self.max_pins:
            raise CapacityError(
                f"this worker holds {held} pinned or reserved pages and asks for {wanted} more; "
                f"the limit per worker is {self.max_pins}: release loads or commit saves first"
            )

    def _payload_offset(self, page: int) -> int:
        """Where the payload of the block whose run starts at `page` starts in the arena."""
        return page * self.arena.page_size_bytes + block.HEADER_BYTES

    # ---- reads -----------------------------------------------------------------------------
    def lookup(
        self, tenant: str, keys: Sequence[bytes], local_only: bool, chunk_tokens: int = 0
    ) -> bytes:
        """Where each leading key is, one byte each (TIER_CODES: host, disk, remote); the
        keys after them are absent. `chunk_tokens`: the prompt tokens per key, counted."""
        self.identity.require(tenant)
        slots = self.store.lookup_slots(owned_keys(tenant, keys))
        local, remote = len(slots), 0
        if local < len(keys) and not local_only and self.fetcher is not None:
            remote = self.fetcher.remote_prefix(tenant, keys[local:], chunk_tokens)
        self.counters.add(
            lookup_asked=len(keys),
            lookup_local_hit=local,
            lookup_remote_hit=remote,
            lookup_tokens_asked=len(keys) * chunk_tokens,
            lookup_tokens_local_hit=local * chunk_tokens,
            lookup_tokens_remote_hit=remote * chunk_tokens,
        )
        return slots.translate(self._slot_codes()) + REMOTE_CODE * remote

    def _slot_codes(self) -> bytes:
        """bytes.translate table: store slot index -> its tier's code."""
        if self._codes is None:
            codes = [TIER_CODES[slot.tier.kind] for slot in self.store.slots]
            self._codes = bytes(codes) + bytes(256 - len(codes))
        return self._codes

    def load(self, tenant: str, keys: Sequence[BlockKey], timeout_s: float) -> LoadedPrefix:
        """Pin the longest prefix servable from the host arena, fetching remote blocks first;
        for a private worker, copy it into the worker's buffer and unpin."""
        self.identity.require(tenant)
        self._require_room(len(keys))
        pinned, local, remote = self._pin_prefix(tenant, keys, timeout_s)  # owned keys
        try:
            headers = self._headers(pinned)  # may end the prefix early
        except BaseException:
            self.store.unpin(pinned)  # not registered under a load id yet
            raise
        pinned = pinned[: len(headers)]
        pages = [self.arena.page_index(key) for key in pinned]
        load = _Load(pinned)
        if self.private is None:
            offsets = [self._payload_offset(page) for page in pages]
        else:
            offsets, headers = self._copy_out(load, pages, headers)
        load_id = next(_ids)
        self.loads[load_id] = load
        served = len(offsets)
        local, remote = min(local, served), max(0, served - local)
        self.counters.add(load_local=local, load_remote=remote, load_miss=len(keys) - served)
        return LoadedPrefix(load_id, offsets, headers, local, remote)

    def _pin_prefix(self, tenant: str, keys: Sequence[BlockKey], timeout_s: float):
        owned = owned_keys(tenant, keys)
        local = self._pin_in_arena(owned)
        remote = 0
        if local < len(keys) and self.fetcher is not None:
            try:
                fetched = self.fetcher.fetch(tenant, keys[local:], timeout_s)
                remote = self._pin_in_arena(owned[local : local + fetched])
            except BaseException:
                self.store.unpin(owned[:local])  # not registered under a load id yet
                raise
        return owned[: local + remote], local, remote

    def _copy_out(self, load: _Load, pages: list[int], headers: list[block.BlockHeader]):
        """Private worker: copy the pinned payloads into its buffer, verified as copied, then
        unpin them all. The prefix ends at the first block whose copy fails its checksum."""
        try:
            wanted = min(len(pages), self.private.free_slots)
            if pages and not wanted:
                self.private.take(len(pages))  # raises: the worker must release first
            load.slots = self.private.take(wanted)
            for index, (page, header, slot) in enumerate(
                zip(pages, headers, load.slots, strict=False)  # slots may be fewer
            ):
                payload = self.arena.view(page, block.HEADER_BYTES, header.block_bytes)
                target = self.private.view(slot, header.payload_bytes)
                if copy_and_checksum(target, payload) != header.checksum:
                    logger.warning("block %r changed while copied out; the load stops", header.key)
                    self.store.purge_if_corrupt(load.keys[index])  # if its stored bytes are bad
                    wanted = index
                    break
            self.private.give_back(load.slots[wanted:])
            load.slots = load.slots[:wanted]
            return list(load.slots), headers[:wanted]
        finally:
            self.store.unpin(load.keys)
            load.keys = []

    def _pin_in_arena(self, keys: Sequence[bytes]) -> int:
        """Pin leading owned keys, keeping only those that are (or were promoted) in the arena."""
        pinned = self.store.pin(keys)
        in_arena = next((i for i, key in enumerate(keys[:pinned]) if key not in self.arena), pinned)
        self.store.unpin(keys[in_arena:pinned])
        return in_arena

    def _headers(self, pinned: list[bytes]) -> list[block.BlockHeader]:
        """The pinned blocks' headers, up to the first that is not its key's (corrupt: the
        block is purged, and it and the rest are unpinned: a miss, never an error)."""
        headers = []
        for index, key in enumerate(pinned):
            page = self.arena.view(self.arena.page_index(key), 0, block.HEADER_BYTES)
            try:
                header = block.unpack_header(page)
                stored_as = owned_key(header.tenant, header.key)
                if stored_as != key or header.block_bytes > self.arena.room_bytes(key):
                    raise ChecksumError(
                        f"the arena page of {key!r} holds {header.key!r} "
                        f"of {header.block_bytes} bytes"
                    )
            except ChecksumError as exc:
                logger.warning("a corrupt block header ends the load: %s", exc)
                self.store.purge_if_corrupt(key)
                self.store.unpin(pinned[index:])
                break
            headers.append(header)
        return headers

    def release(self, load_id: int, suspect: Sequence[int] = ()) -> None:
        """Unpin a load; its blocks at the `suspect` positions are checked first (purged if
        their stored bytes are not their checksum's: a worker cannot purge a good block)."""
        load = self.loads.pop(load_id, None)
        if load is None:
            raise NotFoundError(f"no load {load_id} in this session (released already?)")
        for position in sorted(set(suspect)):
            if position < len(load.keys):
                self.store.purge_if_corrupt(load.keys[position])
        self.store.unpin(load.keys)
        if self.private is not None:
            self.private.give_back(load.slots)

    # ---- writes ----------------------------------------------------------------------------
    def save(
        self,
        tenant: str,
        keys: Sequence[BlockKey],
        first_parent: BlockKey | None,
        payload_bytes: int,
        layout_hash: int,
        codec_id: int,
    ) -> tuple[int, list[int | None]]:
        """Reserve a page per key; returns each payload's offset in the worker's mapping
        (None: already stored, being written, or no room left)."""
        self.identity.require(tenant)
        self._require_room(len(keys))
        if len(set(keys)) != len(keys) or first_parent in keys:
            raise ConfigError(
                "a save's keys are a chain: each key once, none its own ancestor "
                "(a cycle of parents would make its blocks unevictable)"
            )
        reservation = Reservation(next(_ids), tenant, payload_bytes)
        offsets: list[int | None] = []
        parent = None if first_parent is None else owned_key(tenant, first_parent)
        try:
            for key in owned_keys(tenant, keys):
                offsets.append(self._reserve(reservation, key, parent, layout_hash, codec_id))
                parent = key
        except BaseException:
            self._drop(reservation)
            raise
        self.saves[reservation.save_id] = reservation
        return reservation.save_id, offsets

    def _reserve(self, reservation, key, parent, layout_hash, codec_id) -> int | None:
        """Reserve owned `key`'s page; its offset, or None (stored, being written, no room).
        A tenant past its share of the arena gets QuotaExceededError when this save has no
        page yet, else None for the rest of the chain."""
        try:
            view = self.store.reserve(
                key, parent, reservation.payload_bytes, layout_hash, codec_id, writer=reservation
            )
            if view is None:
                return None
            reservation.pages[key] = page = self.arena.page_index(key)
            if self.private is None:
                return self._payload_offset(page)
            reservation.slots[key] = slot = self.private.take(1)[0]
            return slot
        except QuotaExceededError:
            if not reservation.pages:
                raise
            return None
        except CapacityError as exc:
            logger.info("save of %r skipped: %s", key, exc)
            if key in reservation.pages and key not in reservation.slots:
                self.store.abort(key, reservation)
                del reservation.pages[key]
            return None

    def commit(self, save_id: int, keys: Sequence[BlockKey], checksums: Sequence[int]) -> int:
        reservation = self._reservation(save_id)
        committed = 0
        for index, key in enumerate(owned_keys(reservation.tenant, keys)):
            page = reservation.pages.pop(key, None)
            if page is None:
                continue  # not reserved in this save: nothing to commit
            if not self.store.claim(key, reservation):
                logger.info("save %d: %r expired before its commit", save_id, keys[index])
                if self.private is not None:
                    self.private.give_back([reservation.slots.pop(key)])
                continue
            checksum = checksums[index] if checksums else None
            if self.private is not None:
                checksum = self._copy_in(reservation, key, page)
            self.store.commit(key, checksum, reservation)
            committed += 1
        self.counters.add(saved=committed)
        if not reservation.pages:
            self._drop(reservation)
            del self.saves[save_id]
        return committed

    def _copy_in(self, reservation: Reservation, key: bytes, page: int) -> int | None:
        """Private worker: its slot into the reserved page, checksummed as copied."""
        slot = reservation.slots.pop(key)
        start = block.HEADER_BYTES
        target = self.arena.view(page, start, start + reservation.payload_bytes)
        checksum = copy_and_checksum(target, self.private.view(slot, reservation.payload_bytes))
        self.private.give_back([slot])
        return checksum

    def abort(self, save_id: int) -> None:
        self._drop(self._reservation(save_id))
        del self.saves[save_id]

    def _drop(self, reservation: Reservation) -> None:
        for key in reservation.pages:
            self.store.abort(key, reservation)
        reservation.pages.clear()
        if self.private is not None:
            self.private.give_back(list(reservation.slots.values()))
        reservation.slots.clear()

    def _reservation(self, save_id: int) -> Reservation:
        reservation = self.saves.get(save_id)
        if reservation is None:
            raise NotFoundError(f"no save {save_id} in this session (committed or aborted?)")
        return reservation

    # ---- end of session --------------------------------------------------------------------
    def close(self) -> None:
        """Drop every pin and reservation this worker still holds."""
        for load_id in list(self.loads):
            self.release(load_id)
        for save_id in list(self.saves):
            self.abort(save_id)
        if self.private is not None:
            self.private.close()
