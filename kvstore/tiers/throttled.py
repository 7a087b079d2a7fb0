"""A disk tier whose reads are held to a bandwidth: a slow NVMe, a network volume or a busy
device, on demand, for tests and load-or-recompute experiments (`disk_read_bytes_per_s`,
`disk_write_bytes_per_s`).
Owned by the node agent, like the disk tier it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.tiers.disk import DiskTier

SATA_SSD_READ_BYTES_PER_S = 500 << 20  # the default: a SATA SSD's sequential read


class ThrottledDiskTier(DiskTier):
    """A DiskTier whose `open` of a block of n bytes takes at least n / read_bytes_per_s
    seconds (the read happens, then the rest of that time is waited out), and whose writes
    of n bytes at least n / write_bytes_per_s (0: that direction at full speed). Like a
    slow device, the wait happens wherever the store reads or writes the tier (promotion to
    host, serving a peer's fetch, demotion)."""

    def __init__(
        self,
        *args,
        read_bytes_per_s: int = SATA_SSD_READ_BYTES_PER_S,
        write_bytes_per_s: int = 0,
        **options,
    ) -> None:
        if read_bytes_per_s < 0 or write_bytes_per_s < 0:
            raise ConfigError(
                f"disk_read_bytes_per_s ({read_bytes_per_s}) and disk_write_bytes_per_s "
                f"({write_bytes_per_s}) must be >= 0 (0: full speed)"
            )
        super().__init__(*args, **options)
        self.read_bytes_per_s = read_bytes_per_s
        self.write_bytes_per_s = write_bytes_per_s

    @contextmanager
    def open(self, key: BlockKey) -> Iterator[torch.Tensor | None]:
        started = time.perf_counter()
        with super().open(key) as view:
            if view is not None:
                _hold(started, view.numel(), self.read_bytes_per_s)
            yield view

    def _put(self, key: BlockKey, block: torch.Tensor) -> None:
        started = time.perf_counter()
        super()._put(key, block)
        _hold(started, block.numel(), self.write_bytes_per_s)


def _hold(started: float, size: int, bytes_per_s: int) -> None:
    """Wait out what is left of `size` bytes' time at `bytes_per_s` (0: no limit)."""
    left_s = size / bytes_per_s - (time.perf_counter() - started) if bytes_per_s else 0.0
    if left_s > 0:
        time.sleep(left_s)
