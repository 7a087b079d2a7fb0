"""Blocks received from peers: a top-tier page reserved for each, verified (checksum, key,
tenant) before it becomes readable, and waited for by other loads of the same block while it
is on its way, so a block is fetched once however many workers want it. Runs in the node
agent's worker threads (their loads' remote fetches, kvstore/node/remote.py).
"""

from __future__ import annotations

import logging

import torch

from kvstore import block
from kvstore.errors import ChecksumError, NotFoundError
from kvstore.owned import key_of, tenant_of
from kvstore.store_ledger import StoreLedger

logger = logging.getLogger(__name__)


class ReceivedBlocks:
    """Verifies blocks from peers; the ledger reserves their pages and decides them."""

    def __init__(self, ledger: StoreLedger) -> None:
        self.ledger = ledger

    def reserve_page(self, key: bytes) -> torch.Tensor | None:
        """A whole writable top-tier page for a block arriving from a peer (header included),
        or None if owned `key` is already stored or being written. Finish with
        commit_received."""
        return self.ledger.reserve_received(key)

    def await_arrival(self, key: bytes, timeout_s: float) -> bool:
        """Whether `key` is stored, once the block another thread is receiving for it from a
        peer (if any) arrived or failed, waited for at most `timeout_s`: a load of a block
        already on its way joins that fetch instead of missing it."""
        pending = self.ledger.pending_write(key)
        if pending is not None and pending.arrived is not None:
            pending.arrived.wait(max(0.0, timeout_s))
        return self.ledger.slot_of(key) is not None

    def commit_received(
        self, key: bytes, received_bytes: int, payload_checksum: int | None = None
    ) -> bool:
        """Verify a received block (header, key, length, checksum, and that it is the block of
        the tenant owned `key` names, the one it was fetched for) and make it readable.
        `payload_checksum`: the xxh3-64 of the page's bytes past the header, as the transfer
        engine hashed them landing (see TransferEngine.fetch); the payload is then not read
        again. A block that fails is discarded, counted in checksum_failures, and False
        returned."""
        pending = self.ledger.pending_write(key)  # stays pending (not re-reservable) until decided
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
        return self.ledger.finish_received(key, pending, header)
