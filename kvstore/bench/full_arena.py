"""Saves into a full host arena over a real LMDB disk tier, with and without the node agent's
demotion thread (kvstore/node/demotion.py), beside the save's own copy (memcpy of the block).

Runs in-process, inside `kvstore bench micro`. Without the thread every save evicts a victim
first, writing it to disk under the store lock; with it the save takes a page the thread
freed. Saves are paced at twice the disk's measured write time per block, as prefill paces
them (a chunk computes in tens of milliseconds, a disk writes it in a few), so the thread can
keep up; the figures are the medians of each mode's saves.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kvstore import block
from kvstore.eviction import make_policy
from kvstore.keys import BlockKey
from kvstore.kvcopy.verified import copy_and_checksum
from kvstore.node.demotion import DemotionThread
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import DiskTier, HostTier

FREE_PAGES = 2  # what the demotion thread keeps free


def full_arena_results(block_bytes: int, host_pages: int, saves: int, directory: str) -> dict:
    """Median ms of one save into a full arena: evicting itself (`sync`) and with the
    demotion thread (`ahead`), next to the copy alone and the disk's write time per block."""
    source = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
    result: dict = {}
    for mode in ("sync", "ahead"):
        with _store(block_bytes, host_pages, Path(directory) / mode) as store:
            keys = iter(BlockKey(n.to_bytes(16, "little")) for n in range(1, 1 << 30))
            for _ in range(host_pages):  # full, every page a block
                _save(store, next(keys), source)
            write_s = _disk_write_s(store, source)
            demotion = DemotionThread(store, FREE_PAGES) if mode == "ahead" else None
            samples = _paced_saves(store, keys, source, saves, 2 * write_s, demotion)
        result[f"full_arena_save_ms_{mode}"] = 1e3 * statistics.median(samples)
        result[f"disk_write_ms_per_block_{mode}_run"] = 1e3 * write_s
    result["full_arena_copy_ms"] = 1e3 * _copy_s(source, host_pages)
    result["full_arena_save_ahead_vs_sync"] = (
        result["full_arena_save_ms_ahead"] / result["full_arena_save_ms_sync"]
    )
    return result


class _store:
    """A host arena of `pages` pages over an LMDB disk tier of 64 × as many, closed on exit."""

    def __init__(self, block_bytes: int, pages: int, directory: Path) -> None:
        page_bytes = block.HEADER_BYTES + block_bytes
        self.store = TieredStore(
            [
                TierSlot(HostTier(pages * page_bytes, page_bytes), make_policy("lru")),
                TierSlot(
                    DiskTier(directory, 64 * pages * page_bytes, page_bytes), make_policy("lru")
                ),
            ]
        )

    def __enter__(self) -> TieredStore:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def _save(store: TieredStore, key: BlockKey, source: torch.Tensor) -> float:
    started = time.perf_counter()
    view = store.reserve(key, None, source.numel())
    store.commit(key, copy_and_checksum(view, source))
    return time.perf_counter() - started


def _disk_write_s(store: TieredStore, source: torch.Tensor) -> float:
    """One block's write into the disk tier (the store's own write path), median of 3."""
    disk, samples = store.slots[1].tier, []
    page = torch.cat([torch.zeros(block.HEADER_BYTES, dtype=torch.uint8), source])
    for n in range(3):
        key = BlockKey(bytes([255, n]) * 8)  # not a key of the saves
        started = time.perf_counter()
        disk.write(key, page)
        samples.append(time.perf_counter() - started)
        disk.release(key)
    return statistics.median(samples)


def _paced_saves(store, keys, source, saves: int, interval_s: float, demotion) -> list[float]:
    samples = []
    if demotion is not None:
        demotion.start()
    try:
        for _ in range(saves):
            started = time.perf_counter()
            samples.append(_save(store, next(keys), source))
            time.sleep(max(0.0, interval_s - (time.perf_counter() - started)))
    finally:
        if demotion is not None:
            demotion.stop()
    return samples


def _copy_s(source: torch.Tensor, pages: int) -> float:
    """numpy.copyto of the block into distinct rows, as a save copies it: median of `pages`."""
    rows, samples = np.ones((pages, source.numel()), np.uint8), []  # touched: no page faults
    for row in rows:
        started = time.perf_counter()
        np.copyto(row, source.numpy())
        samples.append(time.perf_counter() - started)
    return statistics.median(samples[1:])
