"""Shared benchmark helpers: wall-clock samples, medians, GB/s and a numpy.copyto memcpy baseline.

Pure helpers, run in-process by whichever benchmark imports them (`kvstore bench ...`).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvstore._copyhash import best_isa
from kvstore.errors import ConfigError

GB = 1e9  # GB/s here means 10^9 bytes per second, as memory and disk datasheets use


def check_runs(runs: int) -> None:
    """Raise ConfigError unless `runs` is a positive number of timed repetitions."""
    if runs < 1:
        raise ConfigError(f"runs must be at least 1, got {runs}")


def time_s(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes (perf_counter)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time_s(
    fn: Callable[[], object],
    runs: int,
    setup: Callable[[], object] | None = None,
    warmup: int = 1,
) -> float:
    """Median seconds of `runs` calls of `fn`, after `warmup` untimed calls.

    `setup`, if given, runs untimed before every call (warm-up ones included), e.g. to empty
    the tier that `fn` fills.
    """
    check_runs(runs)
    samples = []
    for index in range(warmup + runs):
        if setup is not None:
            setup()
        elapsed = time_s(fn)
        if index >= warmup:
            samples.append(elapsed)
    return statistics.median(samples)


def gbps(num_bytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second)."""
    return num_bytes / seconds / GB


class MemcpyBaseline:
    """numpy.copyto of one source block into `blocks` distinct destination rows.

    The same access pattern as a tier write (one engine-side buffer, distinct pages) or read
    (distinct pages, one engine-side buffer). Buffers are allocated and touched once, here.
    """

    def __init__(self, block_bytes: int, blocks: int) -> None:
        self.block_bytes = block_bytes
        self.blocks = blocks
        self.source = np.ones(block_bytes, dtype=np.uint8)
        self.rows = np.empty((blocks, block_bytes), dtype=np.uint8)
        self.rows.fill(0)  # np.zeros would map lazily and fault pages in during the first pass

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.blocks

    def copy_all(self) -> None:
        for row in self.rows:
            np.copyto(row, self.source)

    def sample_s(self) -> float:
        """Seconds for one pass over every row."""
        return time_s(self.copy_all)


def memcpy_gbps(block_bytes: int, blocks: int, runs: int) -> float:
    """Median memcpy GB/s copying `blocks` blocks of `block_bytes` each, over `runs` passes."""
    baseline = MemcpyBaseline(block_bytes, blocks)
    return gbps(baseline.total_bytes, median_time_s(baseline.copy_all, runs))


def machine_info() -> dict[str, object]:
    """What the numbers depend on: CPUs, threads and library versions."""
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "copy_hash_isa": best_isa(),  # kvstore._copyhash's copy + checksum loop
        "load_avg_1m": os.getloadavg()[0],  # other work on the machine makes numbers noisy
    }
