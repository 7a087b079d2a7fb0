"""The tier interface: fixed-size pages holding blocks, written in two phases.

A tier is owned by one process (device: the worker; host and disk: the node agent) and is not
thread-safe on its own: the store serialises calls. Views it hands out are 1-D uint8 tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterator
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


class Tier(ABC):
    """Pages of `page_size_bytes`, each holding at most one block.

    Writes are two-phase: `reserve` gives a writable page; it is never readable until `commit`;
    `release` frees a reserved or committed page. `open` yields a committed page or None.
    """

    kind: str = ""
    verify_reads: bool = False  # whether the store must checksum every block read from here

    def __init__(self, capacity_pages: int, page_size_bytes: int) -> None:
        self.capacity_pages = capacity_pages
        self.page_size_bytes = page_size_bytes

    @abstractmethod
    def reserve(self, key: BlockKey) -> torch.Tensor:
        """A writable page for `key`. Raises CapacityError when full, ConfigError if `key` is
        already reserved or committed here."""

    @abstractmethod
    def commit(self, key: BlockKey, used_bytes: int) -> None:
        """Make the first `used_bytes` of `key`'s reserved page readable. NotFoundError if not
        reserved."""

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
    def used_pages(self) -> int:
        """Pages reserved or committed."""
        return len(self._committed) + len(self._reserved)

    def write(self, key: BlockKey, block: torch.Tensor) -> None:
        """Store a whole block in one step (reserve, copy, commit)."""
        page = self.reserve(key)
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
