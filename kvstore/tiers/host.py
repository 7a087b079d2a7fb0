"""Host tier: a shared-memory arena of fixed-size pages in a file under /dev/shm.

The node agent creates and owns the arena; workers on the same host `attach` to it by name and
read or write pages in place (zero copy). A file mapped with mmap, not multiprocessing's
SharedMemory, so that attaching never registers the segment for unlinking (Python 3.11's
resource tracker would unlink it when a worker exits). Segment names carry the owner's pid so a
restarted agent can remove segments left by a crashed one (`remove_stale_arenas`).
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from pathlib import Path

import torch

from kvstore.errors import ConfigError, NotFoundError, UnavailableError
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import pages_for

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "kvstore-arena-"


def _map_file(path: Path, size_bytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o660)  # the worker group maps it, like the agent's socket
    try:
        if create:
            os.ftruncate(fd, size_bytes)
        return mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class SharedArena:
    """A named shared-memory region viewed as a [num_pages, page_size_bytes] uint8 tensor."""

    def __init__(self, name: str, num_pages: int, page_size_bytes: int, create: bool) -> None:
        self.name = name
        self.path = SHM_DIR / name
        self.owner = create
        try:
            self._mmap = _map_file(self.path, num_pages * page_size_bytes, create)
        except FileNotFoundError:
            raise NotFoundError(f"no shared arena named {name!r} in {SHM_DIR}") from None
        except FileExistsError:
            raise ConfigError(f"shared arena {name!r} already exists; pick another name") from None
        except PermissionError as exc:
            raise UnavailableError(f"cannot map shared arena {name!r}: {exc}") from None
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.pages = flat.view(num_pages, page_size_bytes)
        self._cuda_registered = create and _register_with_cuda(self.pages)

    def close(self) -> None:
        """Unmap (and, for the owner, unlink). Idempotent; views must not be used afterwards."""
        if self._mmap is None:
            return
        if self._cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(self.pages.data_ptr())
        self.pages = None
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view; the mapping goes when it does
            logger.debug("arena %s still has views; leaving the mapping to the GC", self.name)
        self._mmap = None
        if self.owner:
            self.path.unlink(missing_ok=True)


def _register_with_cuda(pages: torch.Tensor) -> bool:
    """Pin the arena for fast DMA when CUDA is present (cudaHostRegister); no-op otherwise."""
    if not torch.cuda.is_available():
        return False
    size_bytes = pages.numel()
    result = torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), size_bytes, 0)
    if int(result) != 0:
        logger.warning(
            "cudaHostRegister(%d bytes) failed: %s; arena is pageable", size_bytes, result
        )
        return False
    return True


def remove_stale_arenas(prefix: str = ARENA_PREFIX) -> list[str]:
    """Unlink arenas whose owning process (the pid in the name) is gone. Returns their names."""
    removed = []
    for path in SHM_DIR.glob(f"{prefix}*"):
        pid_text = path.name[len(prefix) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostTier(ArenaTier):
    """Host DRAM pages in a shared arena that other processes on the host can map by name."""

    kind = "host"

    def __init__(self, capacity_bytes: int, page_size_bytes: int, name: str | None = None) -> None:
        num_pages = pages_for(capacity_bytes, page_size_bytes, self.kind)
        name = name or f"{ARENA_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.arena = SharedArena(name, num_pages, page_size_bytes, create=True)
        super().__init__(self.arena.pages)

    @property
    def arena_name(self) -> str:
        return self.arena.name

    def close(self) -> None:
        self.pages = None
        self.arena.close()


def attach_arena(name: str, num_pages: int, page_size_bytes: int) -> SharedArena:
    """Map an existing arena created by another process on this host (never unlinks it)."""
    return SharedArena(name, num_pages, page_size_bytes, create=False)
