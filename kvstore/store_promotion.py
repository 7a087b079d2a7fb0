"""Promotion on a pin: a block below the top tier is copied up into it, checksummed as it
is copied, with the ledger's lock released, so a slow disk stalls only the thread that waits
for its block; other threads pinning the same block meanwhile wait for that one copy. Runs
in the node agent's worker threads (their loads), through TieredStore.pin.
"""

from __future__ import annotations

import logging

import torch

from kvstore import block
from kvstore.errors import ChecksumError
from kvstore.kvcopy.verified import copy_block
from kvstore.owned import key_of, owned_key
from kvstore.store_ledger import StoreLedger

logger = logging.getLogger(__name__)


class Promotions:
    """Copies pinned blocks up to the top tier; the ledger decides, reserves and commits."""

    def __init__(self, ledger: StoreLedger) -> None:
        self.ledger = ledger

    def promoted(self, key: bytes) -> bool:
        """Bring pinned `key` into the top tier if it is below it and room can be made (else it
        stays where it is, readable there); False if its block is corrupt (purged) or gone."""
        index, underway, page = self.ledger.begin_promotion(key)
        if underway is not None:
            underway.wait()
            return self.ledger.slot_of(key) is not None
        if page is None:
            return index is not None
        header, corrupt = None, False
        try:
            header = self._copy_up(index, key, page)
            corrupt = header is None
        finally:
            self.ledger.end_promotion(index, key, header, corrupt)
        return header is not None

    def _copy_up(self, index: int, key: bytes, page: torch.Tensor) -> block.BlockHeader | None:
        """Copy `key`'s block from tier `index` into the top-tier `page`, checksummed as it is
        copied (one pass); None if it is corrupt (end_promotion purges it)."""
        tier = self.ledger.slots[index].tier
        with tier.open(key) as source:
            try:
                if source is None:
                    raise ChecksumError(f"{tier.kind} tier lost {key_of(key)!r}")
                header = copy_block(page, source, key_of(key))
                if owned_key(header.tenant, header.key) != key:
                    raise ChecksumError(f"{key_of(key)!r} is stored as {header.tenant!r}'s")
                return header
            except ChecksumError as exc:
                logger.warning("purging corrupt block: %s", exc)
                return None
