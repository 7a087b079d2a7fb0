"""Blocks received from peers into a TieredStore: a top-tier page reserved for each, verified
(checksum, key, tenant) before it becomes readable, and waited for by other loads of the same
block while it is on its way, so a block is fetched once however many workers want it.

A mixin of TieredStore (kvstore/store.py), whose lock, slots and pending writes it uses; runs
in the node agent's worker threads (their loads' remote fetches, kvstore/node/remote.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from kvstore import block
from kvstore.errors import ChecksumError, NotFoundError
from kvstore.owned import key_of, tenant_of

logger = logging.getLogger(__name__)


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


class ReceivedBlocks:
    """Blocks received from peers (see the module docstring)."""

    def reserve_page(self, key: bytes) -> torch.Tensor | None:
        """A whole writable top-tier page for a block arriving from a peer (header included),
        or None if owned `key` is already stored or being written. Finish with
        commit_received."""
        with self._lock:
            if self._slot_of(key) is not None or key in self._pending or key in self._promoting:
                return None
            self._make_room(0)
            page = self.slots[0].tier.reserve(key)
            header = block.BlockHeader(key_of(key), None, 0, 0, tenant=tenant_of(key))
            self._pending[key] = PendingWrite(0, page, header, threading.Event())
            return page

    def await_arrival(self, key: bytes, timeout_s: float) -> bool:
        """Whether `key` is stored, once the block another thread is receiving for it from a
        peer (if any) arrived or failed, waited for at most `timeout_s`: a load of a block
        already on its way joins that fetch instead of missing it."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None and pending.arrived is not None:
            pending.arrived.wait(max(0.0, timeout_s))
        with self._lock:
            return self._slot_of(key) is not None

    def commit_received(
        self, key: bytes, received_bytes: int, payload_checksum: int | None = None
    ) -> bool:
        """Verify a received block (header, key, length, checksum, and that it is the block of
        the tenant owned `key` names, the one it was fetched for) and make it readable.
        `payload_checksum`: the xxh3-64 of the page's bytes past the header, as the transfer
        engine hashed them landing (see TransferEngine.fetch); the payload is then not read
        again. A block that fails is
        discarded, counted in checksum_failures, and False returned."""
        with self._lock:
            pending = self._pending.get(key)  # stays pending (not re-reservable) until decided
            if pending is None:
                raise NotFoundError(f"{key!r} has no page reserved for a received block")
        try:
            received = pending.page[:received_bytes].cpu()
            header = block.verify(received, key_of(key), payload_checksum)
            if header.tenant != tenant_of(key):
                raise ChecksumError(
                    f"holder sent tenant {header.tenant!r}, fetched for {tenant_of(key)!r}"
                )
        except ChecksumError as exc:
            logger.warning("discarding block received for %r: %s", key, exc)
            header = None
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
