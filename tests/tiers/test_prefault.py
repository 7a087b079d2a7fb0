"""A worker's CPU mapping of the arena gets its pages mapped in the background: every page the
arena holds, including ones written later, and never a hole (a populated hole of a tmpfs file
is allocated: the sparse arena would be claimed whole)."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import pytest

from kvstore.tiers.host import SHM_DIR, MappedBuffer
from tests.metadata.servers import wait_until

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def sparse_file(tmp_path):
    """A 64 MiB file in /dev/shm (tmpfs) with nothing written yet, and a writer's mapping."""
    path = SHM_DIR / f"kvstore-prefault-test-{os.getpid()}-{tmp_path.name}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 64 * MIB)
    writer = mmap.mmap(fd, 64 * MIB)
    yield fd, writer
    writer.close()
    os.close(fd)
    path.unlink()


def mapped_bytes(address: int) -> int:
    """Rss of this process's mapping that starts at `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        if line.split("-")[0] == f"{address:x}":
            for field in lines[index + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:x}")


def resident_pages(writer: mmap.mmap, start: int, length: int) -> int:
    """Pages of the file's [start, start + length) it holds (mincore)."""
    view = (ctypes.c_char * len(writer)).from_buffer(writer)
    vector = (ctypes.c_ubyte * (length // PAGE))()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(ctypes.addressof(view) + start), length, vector) == 0
    del view
    return sum(byte & 1 for byte in vector)


def test_the_pages_the_arena_holds_are_mapped_and_its_holes_left_alone(sparse_file):
    fd, writer = sparse_file
    writer[0 : 8 * MIB] = b"a" * (8 * MIB)
    writer[40 * MIB : 44 * MIB] = b"b" * (4 * MIB)
    mapping = MappedBuffer(fd, 64 * MIB, pin=True)  # a worker's: no CUDA here
    try:
        address = mapping.flat.data_ptr()
        assert wait_until(lambda: mapping.prefault.mapped_pages == 12 * MIB // PAGE, 10)
        assert mapped_bytes(address) == 12 * MIB
        assert resident_pages(writer, 8 * MIB, 32 * MIB) == 0, "a hole was allocated"
        writer[20 * MIB : 21 * MIB] = b"c" * MIB  # a block written later
        assert wait_until(lambda: mapped_bytes(address) == 13 * MIB, 15)
    finally:
        mapping.close()
    assert not mapping.prefault._thread.is_alive()


def test_a_mapping_that_copies_nothing_is_not_prefaulted(sparse_file):
    """The scheduler's connections (pin=False) read no payload: no thread, no page tables."""
    fd, writer = sparse_file
    writer[0:MIB] = b"a" * MIB
    mapping = MappedBuffer(fd, 64 * MIB)
    try:
        assert mapping.prefault is None
        time.sleep(0.1)
        assert mapped_bytes(mapping.flat.data_ptr()) == 0
    finally:
        mapping.close()
