"""One worker's session with the node agent: its loads (pinned pages) and saves (reserved
pages), released when the worker asks, or when the worker is gone (see control.py: a session
whose connection broke keeps its pins until its process exits or a long lease passes, because
the worker may still be copying from those pages). Every call acts for a tenant the worker's
authenticated identity allows, and sees only that tenant's blocks. Runs in the node agent, on
that worker's control-connection thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore import block
from kvstore.errors import CapacityError, NotFoundError
from kvstore.keys import BlockKey
from kvstore.node.identity import WorkerIdentity
from kvstore.node.remote import RemoteFetcher
from kvstore.store import TieredStore
from kvstore.tiers.arena import ArenaTier

logger = logging.getLogger(__name__)
_ids = itertools.count(1)


@dataclass
class LoadedPrefix:
    load_id: int
    keys: list[BlockKey]
    pages: list[int]
    headers: list[block.BlockHeader]
    local_blocks: int
    remote_blocks: int


@dataclass
class Reservation:
    save_id: int
    pages: dict[BlockKey, int] = field(default_factory=dict)  # reserved, not yet committed


class RequestCounters:
    """Blocks asked for and served, across every session of one agent. Thread-safe."""

    NAMES = (
        "lookup_asked", "lookup_local_hit", "lookup_remote_hit", "load_local", "load_remote",
        "load_miss", "saved",
    )  # fmt: skip

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
        self, store: TieredStore, fetcher: RemoteFetcher | None, counters: RequestCounters,
        identity: WorkerIdentity, max_pins: int,
    ) -> None:  # fmt: skip
        self.store = store
        self.fetcher = fetcher
        self.counters = counters
        self.identity = identity
        self.max_pins = max_pins  # pinned plus reserved pages this worker may hold at once
        self.name = ""
        self.loads: dict[int, list[BlockKey]] = {}
        self.saves: dict[int, Reservation] = {}

    def pages_held(self) -> int:
        return sum(map(len, self.loads.values())) + sum(len(r.pages) for r in self.saves.values())

    def _require_room(self, wanted: int) -> None:
        held = self.pages_held()
        if held + wanted > self.max_pins:
            raise CapacityError(
                f"this worker holds {held} pinned or reserved pages and asks for {wanted} more; "
                f"the limit per worker is {self.max_pins}: release loads or commit saves first"
            )

    @property
    def arena(self) -> ArenaTier:
        return self.store.slots[0].tier

    # ---- reads -----------------------------------------------------------------------------
    def lookup(self, tenant: str, keys: Sequence[BlockKey], local_only: bool) -> tuple[int, int]:
        self.identity.require(tenant)
        local = self.store.lookup(keys, tenant)
        remote = 0
        if local < len(keys) and not local_only and self.fetcher is not None:
            remote = self.fetcher.remote_prefix(tenant, keys[local:])
        self.counters.add(lookup_asked=len(keys), lookup_local_hit=local, lookup_remote_hit=remote)
        return local, remote

    def load(self, tenant: str, keys: Sequence[BlockKey], timeout_s: float) -> LoadedPrefix:
        """Pin the longest prefix servable from the host arena, fetching remote blocks first."""
        self.identity.require(tenant)
        self._require_room(len(keys))
        local = self._pin_in_arena(keys, tenant)
        remote = 0
        if local < len(keys) and self.fetcher is not None:
            try:
                fetched = self.fetcher.fetch(tenant, keys[local:], timeout_s)
            except BaseException:
                self.store.unpin(keys[:local])  # not registered under a load id yet
                raise
            remote = self._pin_in_arena(keys[local : local + fetched], tenant)
        pinned = list(keys[: local + remote])
        load_id = next(_ids)
        self.loads[load_id] = pinned
        headers = [self._header(key) for key in pinned]
        pages = [self.arena.page_index(key) for key in pinned]
        self.counters.add(load_local=local, load_remote=remote, load_miss=len(keys) - len(pinned))
        return LoadedPrefix(load_id, pinned, pages, headers, local, remote)

    def _pin_in_arena(self, keys: Sequence[BlockKey], tenant: str) -> int:
        """Pin leading keys, keeping only those that are (or were promoted) in the arena."""
        pinned = self.store.pin(keys, tenant)
        in_arena = next((i for i, key in enumerate(keys[:pinned]) if key not in self.arena), pinned)
        self.store.unpin(keys[in_arena:pinned])
        return in_arena

    def _header(self, key: BlockKey) -> block.BlockHeader:
        page = self.arena.pages[self.arena.page_index(key), : block.HEADER_BYTES]
        return block.unpack_header(page)

    def release(self, load_id: int) -> None:
        keys = self.loads.pop(load_id, None)
        if keys is None:
            raise NotFoundError(f"no load {load_id} in this session (released already?)")
        self.store.unpin(keys)

    # ---- writes ----------------------------------------------------------------------------
    def save(
        self, tenant: str, keys: Sequence[BlockKey], first_parent: BlockKey | None,
        payload_bytes: int, layout_hash: int, codec_id: int,
    ) -> tuple[int, list[int | None]]:  # fmt: skip
        """Reserve a page per key (None: already stored, being written, or no room left)."""
        self.identity.require(tenant)
        self._require_room(len(keys))
        reservation = Reservation(next(_ids))
        pages: list[int | None] = []
        parent = first_parent
        try:
            for key in keys:
                pages.append(self._reserve(reservation, tenant, key, parent, payload_bytes,
                                           layout_hash, codec_id))  # fmt: skip
                parent = key
        except BaseException:
            for reserved in reservation.pages:
                self.store.abort(reserved)
            raise
        self.saves[reservation.save_id] = reservation
        return reservation.save_id, pages

    def _reserve(self, reservation, tenant, key, parent, payload_bytes, layout_hash, codec_id):
        try:
            view = self.store.reserve(key, parent, payload_bytes, layout_hash, codec_id, tenant)
        except CapacityError as exc:
            logger.info("save of %r skipped: %s", key, exc)
            return None
        if view is None:
            return None
        page = self.arena.page_index(key)
        reservation.pages[key] = page
        return page

    def commit(self, save_id: int, keys: Sequence[BlockKey], checksums: Sequence[int]) -> int:
        reservation = self._reservation(save_id)
        committed = 0
        for index, key in enumerate(keys):
            if reservation.pages.pop(key, None) is None:
                continue  # not reserved in this save: nothing to commit
            self.store.commit(key, checksums[index] if checksums else None)
            committed += 1
        self.counters.add(saved=committed)
        if not reservation.pages:
            del self.saves[save_id]
        return committed

    def abort(self, save_id: int) -> None:
        reservation = self._reservation(save_id)
        for key in reservation.pages:
            self.store.abort(key)
        del self.saves[save_id]

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
