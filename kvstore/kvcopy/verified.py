"""Copy and checksum in one pass: the hash is of the destination, the private copy that will
be used, taken from the very registers that wrote it (kvstore._copyhash), so it costs no second
pass over the bytes.

Runs wherever bytes leave a shared page: the node agent (writes into its tiers) and the
worker (loads out of the shared arena). Hashing the private copy, not the shared page, is what
makes a page reused under a stale view a detected miss instead of wrong KV: whatever the page
held while it was read, the copy's digest says whether it is the block that was loaded.
"""

from __future__ import annotations

import torch

from kvstore import block
from kvstore._copyhash import Hasher
from kvstore.keys import BlockKey
from kvstore.tiers.base import copy_bytes

__all__ = ["Hasher", "copy_and_checksum", "copy_block", "copy_hashed"]


def copy_hashed(destination: torch.Tensor, source: torch.Tensor, hasher: Hasher) -> None:
    """Copy flat uint8 `source` into `destination` (host memory), feeding `hasher` with the
    copied bytes. Consecutive calls over consecutive pieces of a payload give the payload's
    xxh3-64, so a payload can be verified layer by layer as it is loaded."""
    if source.device.type != "cpu":
        copy_bytes(destination, source)
        hasher.update(destination.numpy())
        return
    hasher.copy(destination.numpy(), source.numpy())


def copy_and_checksum(destination: torch.Tensor, source: torch.Tensor) -> int | None:
    """Copy and return the xxh3-64 of the bytes (None for device memory: hash it later)."""
    if destination.device.type != "cpu":
        copy_bytes(destination, source)
        return None
    hasher = Hasher()
    copy_hashed(destination, source, hasher)
    return hasher.intdigest()


def copy_block(page: torch.Tensor, source: torch.Tensor, key: BlockKey) -> block.BlockHeader:
    """Copy the stored block `source` (header + payload) into `page` and return its header,
    verified in the same pass (the copy's checksum, against the header's); ChecksumError if
    it is not a whole, uncorrupted block of `key`. Into device memory, the source is hashed."""
    length = min(block.unpack_header(source).block_bytes, source.numel(), page.numel())
    page[: block.HEADER_BYTES].copy_(source[: block.HEADER_BYTES])
    start = block.HEADER_BYTES
    checksum = copy_and_checksum(page[start:length], source[start:length])
    if checksum is None:
        return block.verify(source[:length], key)
    return block.verify(page[:length], key, checksum)
