"""The host arena's utilisation under a mix of block sizes: several models' and TP sizes'
chains saved in random turns through a real TieredStore into a real shared arena, until it has
been refilled several times, with the arena's pages shared by every size (small pages, a large
largest block) and, for comparison, one page per block (the page sized for the largest).

Runs in-process, inside `kvstore bench micro`. Utilisation is payload bytes stored over arena
bytes, sampled after every save once the arena is full; the saves' rate is measured with it.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from kvstore import block
from kvstore.eviction import make_policy
from kvstore.keys import BlockKey, Namespace, chunk_keys
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import HostTier

MIB = 1 << 20
# Payloads of one 256-token chunk (one 64-token page for SGLang) in bf16, per shard.
MIX_BYTES = {
    "llama3_8b_tp1": 32 * MIB,  # 32 layers x 8 kv heads x 128 dims
    "llama3_8b_tp2": 16 * MIB,
    "qwen25_7b_tp1": 14 * MIB,  # 28 layers x 4 kv heads
    "llama3_70b_tp8": 10 * MIB,  # 80 layers x 1 kv head a rank
    "llama3_8b_sglang_page64": 8 * MIB,
}
CHAIN_BLOCKS = (1, 8)  # blocks per request, drawn uniformly
SEED = 0


@dataclass(frozen=True)
class MixSizes:
    """The arena, its page (the shared arena's allocation unit), how many times the arena's
    bytes are written, and the factor every payload of MIX_BYTES is divided by."""

    arena_bytes: int
    page_bytes: int
    refills: int
    shrink: int


def arena_mix_results(sizes: MixSizes) -> dict:
    """Utilisation (median and lowest once full) and save GB/s, shared pages and one page per
    block, and the ratio of the two utilisations."""
    payloads = [size // sizes.shrink for size in MIX_BYTES.values()]
    largest = block.HEADER_BYTES + max(payloads)
    shared_largest = -(-largest // sizes.page_bytes) * sizes.page_bytes
    result: dict = {"arena_mix_block_sizes": len(payloads), "arena_mix_bytes": sizes.arena_bytes}
    for name, page_bytes, max_block_bytes in (
        ("shared", sizes.page_bytes, shared_largest),
        ("one_page_per_block", largest, 0),
    ):
        host = HostTier(sizes.arena_bytes, page_bytes, max_block_bytes=max_block_bytes)
        store = TieredStore([TierSlot(host, make_policy("prefix-lru"))])
        try:
            samples, saved_bytes, seconds = _churn(store, payloads, sizes.refills)
        finally:
            store.close()
        result[f"arena_utilisation_{name}"] = statistics.median(samples)
        result[f"arena_utilisation_min_{name}"] = min(samples)
        result[f"arena_mix_save_GBps_{name}"] = saved_bytes / seconds / 1e9
    result["arena_utilisation_shared_vs_one_page"] = (
        result["arena_utilisation_shared"] / result["arena_utilisation_one_page_per_block"]
    )
    return result


def _churn(store: TieredStore, payloads: list[int], refills: int) -> tuple[list[float], int, float]:
    """Save chains of random sizes until `refills` arenas' bytes were written; utilisation
    after every save once the first eviction happened, bytes saved and seconds spent."""
    rng = random.Random(SEED)
    host = store.slots[0].tier
    sources = {size: torch.randint(0, 256, (size,), dtype=torch.uint8) for size in set(payloads)}
    stored: dict[bytes, int] = {}
    samples: list[float] = []
    saved = 0
    started = time.perf_counter()
    while saved < refills * host.capacity_bytes:
        size = rng.choice(payloads)
        for key, parent in _chain(rng, size):
            store.put(key, parent, sources[size])
            stored[key] = size
            saved += size
            if store.removals["host"]:
                samples.append(_payload_bytes(host, stored) / host.capacity_bytes)
    return samples, saved, time.perf_counter() - started


def _chain(rng: random.Random, size: int) -> list[tuple[BlockKey, BlockKey | None]]:
    """A new request's keys of one model (its namespace: the block size), with parents."""
    namespace = Namespace(f"bench:{size}", f"request-{rng.getrandbits(64)}")
    keys = chunk_keys(namespace, range(4 * rng.randint(*CHAIN_BLOCKS)), 4)
    return list(zip(keys, [None, *keys[:-1]], strict=True))


def _payload_bytes(host: HostTier, stored: dict[bytes, int]) -> int:
    """Payload bytes of the blocks the arena holds now (forgetting those evicted)."""
    for key in [key for key in stored if key not in host]:
        del stored[key]
    return sum(stored.values())
