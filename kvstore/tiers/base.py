"""The tier interface: pages of one size holding blocks (a block takes the fewest whole pages
that hold it, up to the tier's largest block), written in two phases.

A tier is owned by one process (device: the worker; host and disk: the node agent) and is not
thread-safe on its own: the store serialises calls. Views it hands out are 1-D uint8 tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterator
from contextlib import AbstractContextManager

import numpy as np
import torch

from kvstore.errors import ConfigError
from kvstore.keys import BlockKey


def copy_bytes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy equal-sized uint8 tensors. Host to host goes through numpy: one thread, no torch
    thread-pool hand-off, which collapses when the machine's other cores are busy."""
    if destination.device.type == "cpu" and source.device.type == "cpu":
        np.copyto(destination.numpy(), source.numpy())
    else:
        destination.copy_(source)


def pages_for(capacity_bytes: int, page_size_bytes: int, kind: str) -> int:
    """How many pages fit; raises ConfigError naming the setting to change if none does."""
    if page_size_bytes <= 0:
        raise ConfigError(f"{kind} tier: page_size_bytes must be positive, got {page_size_bytes}")
    if capacity_bytes < page_size_bytes:
        raise ConfigError(
            f"{kind} tier: capacity_bytes={capacity_bytes} holds no page of {page_size_bytes} "
            "bytes; raise the capacity or lower chunk_tokens / the page size"
        )
    return capacity_bytes // page_size_bytes


def check_max_block(max_block_bytes: int, page_size_bytes: int, capacity_bytes: int) -> int:
    """The largest block a tier takes (0: one page), refused unless it is at least a page and
    at most the tier; raises ConfigError naming the setting to change. With 0, a tier too
    small for one page is pages_for's to refuse (it names the capacity)."""
    if not max_block_bytes:
        return page_size_bytes
    largest = max_block_bytes
    if not page_size_bytes <= largest <= capacity_bytes:
        raise ConfigError(
            f"max_block_bytes={max_block_bytes} must be 0 (one page) or between page_size_bytes "
            f"({page_size_bytes}) and the tier's capacity ({capacity_bytes} bytes)"
        )
    return largest


class Tier(ABC):
    """Pages of `page_size_bytes`; a block takes the fewest whole pages that hold it (one page,
    unless `max_block_bytes` allows more), and no page holds two blocks.

    Writes are two-phase: `reserve` gives writable pages; they are never readable until
    `commit`; `release` frees reserved or committed pages. `open` yields a committed block or
    None.
    """

    kind: str = ""
    verify_reads: bool = False  # whether the store must checksum every block read from here

    def __init__(self, capacity_pages: int, page_size_bytes: int, max_block_bytes: int = 0) -> None:
        self.capacity_pages = capacity_pages
        self.page_size_bytes = page_size_bytes
        self.max_block_bytes = max_block_bytes or page_size_bytes

    @abstractmethod
    def reserve(self, key: BlockKey, size_bytes: int = 0) -> torch.Tensor:
        """Writable pages for a block of `size_bytes` (0: one page) of `key`, as one flat view
        of whole pages. Raises CapacityError when no room is free, ConfigError if `key` is
        already reserved or committed here or the block is larger than `max_block_bytes`."""

    @abstractmethod
    def commit(self, key: BlockKey, used_bytes: int) -> None:
        """Make the first `used_bytes` of `key`'s reservation readable; pages past them are
        freed. NotFoundError if not reserved."""

    @abstractmethod
    def release(self, key: BlockKey) -> None:
        """Free `key`'s page, reserved or committed. Unknown keys are ignored."""

    @abstractmethod
    def open(self, key: BlockKey) -> AbstractContextManager[torch.Tensor | None]:
        """Yield the committed bytes of `key` (read-only by contract), or None if absent.
        The view is valid only inside the `with` block."""

    # ---- bookkeeping: subclasses keep their committed keys in `_committed` (a dict or a set)
    # and their reserved ones in `_reserved` (a dict), and these read both --------------------
    _committed: dict | set
    _reserved: dict

    def __contains__(self, key: object) -> bool:
        """Whether `key` is committed here (reserved pages do not count)."""
        return key in self._committed

    def keys(self) -> Iterator[BlockKey]:
        """Committed keys, in no particular order."""
        return iter(list(self._committed))

    def committed_keys(self) -> Container[object]:
        """What `key in` tests for committed keys, read under the store's lock: the tier's own
        dict or set, so a lookup tests each key in C, without a call."""
        return self._committed

    @property
    def used_blocks(self) -> int:
        """Blocks reserved or committed."""
        return len(self._committed) + len(self._reserved)

    @property
    def used_pages(self) -> int:
        """Pages reserved or committed (a block of one page each, unless overridden)."""
        return self.used_blocks

    def pages_needed(self, size_bytes: int) -> int:
        """Pages a block of `size_bytes` takes (0: one page); ConfigError past the largest
        block this tier takes."""
        if not 0 <= size_bytes <= self.max_block_bytes:
            raise ConfigError(
                f"a block of {size_bytes} bytes does not fit this {self.kind} tier: its largest "
                f"block is {self.max_block_bytes} bytes (raise max_block_bytes, at most the tier, "
                "or store smaller chunks)"
            )
        return max(1, -(-size_bytes // self.page_size_bytes))

    def has_room(self, size_bytes: int) -> bool:
        """Whether a block of `size_bytes` can be reserved now, without evicting."""
        return self.free_pages >= self.pages_needed(size_bytes)

    def eviction_window(
        self, victim: BlockKey, size_bytes: int, can_evict: Callable[[BlockKey], bool]
    ) -> list[BlockKey]:
        """What to evict, `victim` first, to make room for a block of `size_bytes`: tiers
        whose blocks need contiguous pages add the victim's neighbours that open a run wide
        enough with it (those `can_evict` allows), where there are such. Changes nothing."""
        return [victim]

    def stored_bytes(self, key: BlockKey) -> int:
        """The committed size of `key` (0: not committed here)."""
        return 0

    def write(self, key: BlockKey, block: torch.Tensor) -> None:
        """Store a whole block in one step (reserve, copy, commit)."""
        page = self.reserve(key, block.numel())
        try:
            copy_bytes(page[: block.numel()], block)
        except BaseException:
            self.release(key)
            raise
        self.commit(key, block.numel())

    def write_reserved(self, key: BlockKey, page: torch.Tensor, block: torch.Tensor) -> None:
        """Commit `key`, reserved (`page`: what reserve gave), holding the bytes of `block`.
        Tiers that can store `block` without the page (disk) do; this one copies. The store
        calls it without its lock (demotion ahead), for a key it holds pinned in the tier
        above: readers find that copy first until the store announces this one."""
        copy_bytes(page[: block.numel()], block)
        self.commit(key, block.numel())

    @property
    def free_pages(self) -> int:
        return self.capacity_pages - self.used_pages

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_size_bytes

    def close(self) -> None:  # noqa: B027 (optional hook: most tiers hold nothing to free)
        """Free the tier's resources. Idempotent."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
