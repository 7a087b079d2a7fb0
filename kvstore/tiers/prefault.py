"""Page tables of a worker's mapping of the arena, filled ahead of its loads: the first read of
each arena page by a process costs a page fault (measured here: 56 MiB read through a fresh
mapping in 6.9 ms, 2.7 ms once its pages are mapped), which a fresh vLLM server would pay
inside the forward of its first hits. A background thread maps the pages the arena holds
(`mincore`: resident in the file's page cache) with MADV_POPULATE_READ, never its holes: a
populated hole of a tmpfs file is allocated, charged to the worker's memory, which would
claim the whole sparse arena at once. The agent never frees an arena page, so a mapped page
stays valid; sweeps repeat, further apart while nothing new appears, for pages written since.
A sweep reads the residency of the whole arena, so the thread takes at most 1/DUTY_RATIO of a
core: measured in a vLLM worker whose engine saved every step (each sweep finding new pages),
sweeps every 10 ms took ~8 % of the core the forward ran on. It runs on the cores vLLM's
binding left free where there are some (kvstore/cores.py), never beside the forward.

Runs in a daemon thread of each worker process that copies payloads on the CPU (a mapping
registered with CUDA had every page faulted in by the registration). Linux 5.14 or later;
elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import numpy as np

from kvstore.cores import bind_this_thread, spare_cpus

logger = logging.getLogger(__name__)

MADV_POPULATE_READ = 22  # linux/mman.h (5.14)
STEP_BYTES = 64 << 20  # per mincore / madvise call: the thread can stop between calls
FIRST_SWEEP_S = 0.01
IDLE_MAX_S = 5.0  # between sweeps once nothing new appears
DUTY_RATIO = 50  # a sweep of t seconds waits at least (DUTY_RATIO - 1) * t before the next


class Prefault:
    """Maps the resident pages of [address, address + size_bytes) into this process, in a
    daemon thread, until `stop` (call it before unmapping: it waits for the current call)."""

    def __init__(self, address: int, size_bytes: int) -> None:
        self.page_bytes = os.sysconf("SC_PAGE_SIZE")
        self.address = address
        self.pages = size_bytes // self.page_bytes
        self.mapped_pages = 0
        self._done = np.zeros(self.pages, dtype=bool)
        self._step_pages = STEP_BYTES // self.page_bytes
        self._resident = (ctypes.c_ubyte * self._step_pages)()
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-prefault", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        cpus = spare_cpus()
        if cpus:
            bind_this_thread(cpus)
        wait_s = FIRST_SWEEP_S
        try:
            while not self._stop.wait(wait_s):
                started = time.perf_counter()
                found = self._sweep()
                wait_s = FIRST_SWEEP_S if found else min(IDLE_MAX_S, wait_s * 2)
                wait_s = max(wait_s, (DUTY_RATIO - 1) * (time.perf_counter() - started))
        except OSError as exc:  # no mincore or MADV_POPULATE_READ here: faults as before
            logger.debug("arena prefault off: %s", exc)

    def _sweep(self) -> int:
        """Map every resident page not mapped yet; how many were."""
        found = 0
        for first in range(0, self.pages, self._step_pages):
            if self._stop.is_set():
                break
            count = min(self._step_pages, self.pages - first)
            new = self._resident_pages(first, count) & ~self._done[first : first + count]
            for start, stop in _runs(new):
                self._populate(first + start, stop - start)
                self._done[first + start : first + stop] = True
                found += stop - start
        self.mapped_pages += found
        return found

    def _resident_pages(self, first: int, count: int) -> np.ndarray:
        """Which of pages [first, first + count) the file holds (in its page cache)."""
        address = ctypes.c_void_p(self.address + first * self.page_bytes)
        length = ctypes.c_size_t(count * self.page_bytes)
        if self._libc.mincore(address, length, self._resident) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return (np.frombuffer(self._resident, dtype=np.uint8, count=count) & 1).astype(bool)

    def _populate(self, first: int, count: int) -> None:
        address = ctypes.c_void_p(self.address + first * self.page_bytes)
        length = ctypes.c_size_t(count * self.page_bytes)
        if self._libc.madvise(address, length, MADV_POPULATE_READ) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True in `flags`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.view(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))
