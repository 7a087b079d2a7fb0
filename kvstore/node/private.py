"""A worker's private buffer: what an isolated worker maps instead of the shared arena.

Runs in the node agent, on that worker's control-connection thread. The buffer is a memfd
only this worker is handed, cut into slots of one payload each. A load copies each pinned
payload from the arena into a slot (verified as copied) and unpins at once; a save hands out
slots and, at commit, copies them into the reserved arena pages, checksumming in the same pass
(a private worker's checksums are never trusted). The copy is the price of isolation: the
worker never sees another tenant's pages, and never holds an arena pin.
"""

from __future__ import annotations

import contextlib
import os

import torch

from kvstore.errors import CapacityError, ConfigError
from kvstore.tiers.host import private_buffer


class PrivateBuffer:
    """Slots of `slot_bytes` in a memfd of `size_bytes`. Not thread-safe (one connection)."""

    def __init__(self, name: str, size_bytes: int, slot_bytes: int) -> None:
        if size_bytes < slot_bytes:
            raise ConfigError(
                f"private_buffer_bytes {size_bytes} cannot hold one payload of {slot_bytes} bytes"
            )
        self.slot_bytes = slot_bytes
        self.fd, self._mapping = private_buffer(name, size_bytes)
        self.size_bytes = size_bytes
        self._free = list(range(size_bytes // slot_bytes - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """`count` slots (their byte offsets); CapacityError when fewer are free."""
        if count > len(self._free):
            raise CapacityError(
                f"the worker's private buffer has {len(self._free)} free payload slots, "
                f"{count} asked: release loads or raise private_buffer_bytes"
            )
        return [self._free.pop() * self.slot_bytes for _ in range(count)]

    def give_back(self, offsets: list[int]) -> None:
        self._free.extend(offset // self.slot_bytes for offset in offsets)

    def view(self, offset: int, size_bytes: int) -> torch.Tensor:
        return self._mapping.flat[offset : offset + size_bytes]

    def close(self) -> None:
        self._mapping.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
