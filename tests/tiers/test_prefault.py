"""A worker's CPU mapping of the arena gets its pages mapped in the background: every page the
arena holds, including ones written later, and never a hole (a populated hole of a tmpfs file
is allocated: the sparse arena would be claimed whole), at a bounded cost, on the cores the
forward's threads leave free."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.tiers import prefault
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


def test_sweeps_take_a_bounded_share_of_a_core(monkeypatch):
    """A sweep reads the whole arena's residency: while every sweep finds new pages (an engine
    saving every step), the next waits DUTY_RATIO - 1 times as long as the last took."""
    sweeps = []

    def slow_sweep(self) -> int:
        sweeps.append(time.perf_counter())
        time.sleep(0.02)
        return 1  # always something new

    monkeypatch.setattr(prefault.Prefault, "_sweep", slow_sweep)
    buffer = (ctypes.c_ubyte * PAGE)()
    sweeper = prefault.Prefault(ctypes.addressof(buffer), PAGE)
    time.sleep(0.5)
    sweeper.stop()
    assert 1 <= len(sweeps) <= 2, "a sweep every FIRST_SWEEP_S would be ~16 in 0.5 s"


BOUND = """
import ctypes, json, mmap, os
import torch  # libgomp binds this process's first thread as it loads, as in vLLM's worker
from kvstore.cores import spare_cpus
from kvstore.tiers.prefault import Prefault
pages = mmap.mmap(-1, 1 << 20)  # page-aligned, as an arena mapping is
sweeper = Prefault(ctypes.addressof(ctypes.c_char.from_buffer(pages)), 1 << 20)
sweeper._stop.wait(0.2)
print(json.dumps([sorted(spare_cpus()), sorted(os.sched_getaffinity(sweeper._thread.native_id))]))
sweeper.stop()
"""


def test_the_sweeps_run_on_the_cores_the_forward_left_free():
    first = min(os.sched_getaffinity(0))
    env = {**os.environ, "GOMP_CPU_AFFINITY": str(first), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", BOUND], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    spare, sweeping_on = json.loads(result.stdout)
    assert sweeping_on == (spare or [first])
