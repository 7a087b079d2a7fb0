"""Host tier: a shared-memory arena of pages in a file under /dev/shm (a block takes a run of
them: kvstore/tiers/arena.py).

The node agent creates and owns the arena (mode 0600: no other user can open it by name);
workers on the same host get a file descriptor of it over the control socket (SCM_RIGHTS) when
the agent grants them shared access, and read or write pages in place (zero copy). A file
mapped with mmap, not multiprocessing's SharedMemory, so that mapping never registers the
segment for unlinking (Python 3.11's resource tracker would unlink it when a worker exits).
The owner holds an exclusive flock on the file for its lifetime, so a restarted agent removes
exactly the arenas whose owner is gone (`remove_stale_arenas`), whatever pids were reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import uuid
from pathlib import Path

import torch

from kvstore.errors import ConfigError, NotFoundError, UnavailableError
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import check_max_block, pages_for
from kvstore.tiers.prefault import Prefault

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "kvstore-arena-"


class MappedBuffer:
    """A shared mapping of a file descriptor, viewed as a flat uint8 tensor. With `pin` (a
    worker's mapping of the arena or its private buffer, which it copies payloads through):
    when CUDA is present, registered as pinned memory so device copies from and to it are DMA;
    else its pages the file holds are mapped in the background (prefault.py), so that a load
    pays no page fault."""

    def __init__(self, fd: int, size_bytes: int, pin: bool = False) -> None:
        self.size_bytes = size_bytes
        self._mmap = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._cuda_registered = pin and _register_with_cuda(self.flat)
        self.prefault = None
        if pin and not self._cuda_registered:
            self.prefault = Prefault(self.flat.data_ptr(), size_bytes)

    def close(self) -> None:
        """Unmap. Idempotent; views must not be used afterwards."""
        if self._mmap is None:
            return
        if self.prefault is not None:
            self.prefault.stop()  # before the unmap: its calls name these addresses
        if self._cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
        self.flat = None
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view; the mapping goes when it does
            logger.debug("a mapping still has views; leaving it to the GC")
        self._mmap = None


def _check_room(size_bytes: int) -> None:
    """ConfigError if SHM_DIR cannot hold an arena of `size_bytes`: the file is sparse, and a
    page written past what the filesystem holds kills the agent with SIGBUS (Docker's
    /dev/shm is 64 MiB unless --shm-size says more)."""
    stats = os.statvfs(SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    if size_bytes > free:
        raise ConfigError(
            f"the host arena needs {size_bytes} bytes but {SHM_DIR} has {free} free: lower "
            "host_capacity_bytes or enlarge it (docker run --shm-size; in Kubernetes an "
            "emptyDir with medium: Memory and a sizeLimit, mounted at /dev/shm)"
        )


def map_fd(fd: int, size_bytes: int, pin: bool = False) -> MappedBuffer:
    """Map a descriptor received from the agent (its arena, or a private buffer)."""
    if os.fstat(fd).st_size < size_bytes:
        raise ConfigError(f"the agent's mapping is smaller than the {size_bytes} bytes announced")
    return MappedBuffer(fd, size_bytes, pin)


def private_buffer(name: str, size_bytes: int) -> tuple[int, MappedBuffer]:
    """An anonymous shared buffer (memfd) for one worker: (its fd, the agent's mapping)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size_bytes)
        return fd, MappedBuffer(fd, size_bytes)
    except BaseException:
        os.close(fd)
        raise


class SharedArena:
    """The agent's arena: a /dev/shm file viewed as [num_pages, page_size_bytes] uint8."""

    def __init__(self, name: str, num_pages: int, page_size_bytes: int) -> None:
        self.name = name
        self.path = SHM_DIR / name
        _check_room(num_pages * page_size_bytes)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"shared arena {name!r} already exists; pick another name") from None
        except PermissionError as exc:
            raise UnavailableError(f"cannot create shared arena {name!r}: {exc}") from None
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # held until this process is gone
        os.ftruncate(self._fd, num_pages * page_size_bytes)
        self.mapping = MappedBuffer(self._fd, num_pages * page_size_bytes)
        self.pages = self.mapping.flat.view(num_pages, page_size_bytes)

    def open_fd(self) -> int:
        """A new descriptor of the arena to hand a worker: a new open file description, so the
        owner's lock never travels with it, opened through our own descriptor, so it works
        even if another process unlinked the name. The caller closes it once sent."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | os.O_CLOEXEC)

    def close(self) -> None:
        """Unmap and unlink. Idempotent; views must not be used afterwards."""
        if self._fd is None:
            return
        self.pages = None
        self.mapping.close()
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


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
    """Unlink arenas no live process holds the lock of. Returns their names."""
    removed = []
    for path in SHM_DIR.glob(f"{prefix}*"):
        if _owner_gone(path):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _owner_gone(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # vanished meanwhile, or not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its owner lives
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return True


class HostTier(ArenaTier):
    """Host DRAM pages in a shared arena that workers on the host can be handed."""

    kind = "host"

    def __init__(
        self,
        capacity_bytes: int,
        page_size_bytes: int,
        name: str | None = None,
        max_block_bytes: int = 0,
    ) -> None:
        num_pages = pages_for(capacity_bytes, page_size_bytes, self.kind)
        check_max_block(max_block_bytes, page_size_bytes, num_pages * page_size_bytes)
        name = name or f"{ARENA_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.arena = SharedArena(name, num_pages, page_size_bytes)
        super().__init__(self.arena.pages, max_block_bytes)

    @property
    def arena_name(self) -> str:
        return self.arena.name

    def close(self) -> None:
        self.pages = self.flat = None
        self.arena.close()


def attach_arena(name: str, size_bytes: int) -> MappedBuffer:
    """Map an arena by name (same user as its owner only: the file is 0600). Workers get a
    descriptor from the agent instead; this is for tools and tests."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(f"no shared arena named {name!r} in {SHM_DIR}") from None
    except PermissionError as exc:
        raise UnavailableError(f"cannot map shared arena {name!r}: {exc}") from None
    try:
        return map_fd(fd, size_bytes)
    finally:
        os.close(fd)
