"""Micro-benchmarks of one node's hot paths: chunk hashing, tier writes and reads, saves into a
full arena (kvstore/bench/full_arena.py), the arena's utilisation under a mix of block sizes
(kvstore/bench/arena_mix.py), fp8, xxh3.

Runs in-process (`kvstore bench micro`). Every number is a median of `runs` timed runs after one
untimed warm-up; tier numbers sit next to a numpy.copyto memcpy measured in the same runs.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore import block
from kvstore.bench.arena_mix import MixSizes, arena_mix_results
from kvstore.bench.full_arena import full_arena_results
from kvstore.bench.timing import (
    MemcpyBaseline,
    check_runs,
    gbps,
    machine_info,
    median_time_s,
    time_s,
)
from kvstore.codec import decode_block, encode_block
from kvstore.eviction import make_policy
from kvstore.keys import BlockKey, Namespace, chunk_keys
from kvstore.layout import KVLayout
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import DiskTier, HostTier, Tier
from kvstore.tiers.base import copy_bytes

MIB = 1 << 20
BLOCK_SIZES_MIB = (4, 16)
TIER_KINDS = ("host", "disk")
HASH_CHUNK_TOKENS = 256
HASH_PROMPT_TOKENS = 131072
VOCAB_SIZE = 128256  # Llama-3's; only the int32 range of the ids matters to the hash
# Llama-3-8B-like KV: 8 kv heads of 128 dims, bf16, 256-token chunks; one block = all layers.
CODEC_LAYOUT = dict(num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=256, codec="fp8")


@dataclass(frozen=True)
class MicroSizes:
    """How much work each measurement does; `quick` shrinks it for tests."""

    blocks_per_run: int  # blocks written and read per tier, block size and run
    codec_layers: int  # layers in the fp8 block (32 for Llama-3-8B)
    full_arena: tuple[int, int, int]  # block bytes, arena pages, saves (kvstore.bench.full_arena)
    arena_mix: MixSizes  # the arena, its page, refills, payloads' divisor (bench.arena_mix)


FULL = MicroSizes(
    blocks_per_run=16,
    codec_layers=32,
    full_arena=(16 * MIB, 16, 48),
    arena_mix=MixSizes(arena_bytes=512 * MIB, page_bytes=128 << 10, refills=3, shrink=2),
)
QUICK = MicroSizes(
    blocks_per_run=2,
    codec_layers=2,
    full_arena=(MIB, 4, 6),
    arena_mix=MixSizes(arena_bytes=16 * MIB, page_bytes=4 << 10, refills=2, shrink=64),
)


def run_micro(runs: int = 5, quick: bool = False, disk_dir: str | Path | None = None) -> dict:
    """Run every micro-benchmark and return a flat JSON-able dict of GB/s, rates and ratios.

    `disk_dir` is where the disk tier's temporary LMDB goes (default: the system temp dir).
    Full mode holds about 0.5 GiB of RAM at a time (16 blocks of 16 MiB in a tier and in the
    memcpy baseline; then a 512 MiB arena in /dev/shm) and writes about 3 GiB through the disk
    tier.
    """
    check_runs(runs)
    sizes = QUICK if quick else FULL
    result: dict = {"runs": runs, "quick": quick, "machine": machine_info()}
    result.update(hash_results(runs))
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=disk_dir) as directory:
        for size_mib in BLOCK_SIZES_MIB:
            result.update(tier_results(size_mib * MIB, sizes.blocks_per_run, runs, directory))
        result.update(full_arena_results(*sizes.full_arena, directory))
    result.update(arena_mix_results(sizes.arena_mix))
    result["memcpy_GBps"] = result[f"memcpy_GBps_{BLOCK_SIZES_MIB[-1]}MiB"]
    result.update(codec_results(sizes.codec_layers, runs))
    return result


# ---- chunk hashing ---------------------------------------------------------------------------
def hash_results(runs: int) -> dict[str, float]:
    """chunk_keys over a 128k-token prompt, given as an int32 array and as a Python list."""
    layout_id = KVLayout(num_layers=32, **CODEC_LAYOUT).layout_id
    namespace = Namespace(model_fingerprint="bench", layout_id=layout_id)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB_SIZE, HASH_PROMPT_TOKENS, dtype=np.int32)
    token_list = tokens.tolist()
    array_s = median_time_s(lambda: chunk_keys(namespace, tokens, HASH_CHUNK_TOKENS), runs)
    list_s = median_time_s(lambda: chunk_keys(namespace, token_list, HASH_CHUNK_TOKENS), runs)
    return {
        "hash_tokens_per_s": HASH_PROMPT_TOKENS / array_s,
        "hash_GBps": gbps(HASH_PROMPT_TOKENS * 4, array_s),
        "hash_128k_tokens_ms": array_s * 1e3,
        "hash_128k_tokens_from_list_ms": list_s * 1e3,
    }


# ---- tiers -----------------------------------------------------------------------------------
@dataclass
class TierRig:
    """One tier behind a single-slot store, the keys to write and the engine-side buffers."""

    store: TieredStore
    keys: list[BlockKey]
    source: torch.Tensor  # what every write copies in
    destination: torch.Tensor  # where every read copies out to

    @property
    def tier(self) -> Tier:
        return self.store.slots[0].tier

    @property
    def block_bytes(self) -> int:
        return self.source.numel()


def open_tier(kind: str, block_bytes: int, blocks: int, directory: str) -> Tier:
    """A tier of `kind` with room for exactly `blocks` sealed blocks of `block_bytes`."""
    page_bytes = block.HEADER_BYTES + block_bytes
    capacity_bytes = blocks * page_bytes
    if kind == "host":
        return HostTier(capacity_bytes, page_bytes)
    return DiskTier(Path(directory) / f"disk-{block_bytes}", capacity_bytes, page_bytes)


def make_rig(tier: Tier, block_bytes: int, blocks: int) -> TierRig:
    source = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
    keys = [BlockKey(index.to_bytes(16, "little")) for index in range(1, blocks + 1)]
    store = TieredStore([TierSlot(tier, make_policy("lru"))])
    return TierRig(store, keys, source, torch.zeros_like(source))


def empty_tier(rig: TierRig) -> None:
    """Release every block, so the next write pass finds free pages and no eviction."""
    policy = rig.store.slots[0].policy
    for key in list(rig.tier.keys()):
        rig.tier.release(key)
        policy.remove(key)


def store_write(rig: TierRig) -> None:
    """The store's write path: reserve, copy in while checksumming each slice, seal, commit."""
    for key in rig.keys:
        rig.store.put(key, None, rig.source)


def store_read(rig: TierRig) -> None:
    """Open each block through the store (disk: checksum verified) and copy it out."""
    for key in rig.keys:
        with rig.store.read(key) as payload:
            copy_bytes(rig.destination, payload)


def tier_write(rig: TierRig) -> None:
    """The bare tier's two-phase write: no checksum, no header."""
    for key in rig.keys:
        copy_bytes(rig.tier.reserve(key)[: rig.block_bytes], rig.source)
        rig.tier.commit(key, rig.block_bytes)


def tier_read(rig: TierRig) -> None:
    for key in rig.keys:
        with rig.tier.open(key) as page:
            copy_bytes(rig.destination, page)


def timed_round(rig: TierRig, baseline: MemcpyBaseline) -> dict[str, float]:
    """Seconds of one pass of memcpy and of each tier path; leaves the tier empty."""
    steps: list[tuple[str, Callable[[TierRig], None]]] = [
        ("write", store_write),
        ("read", store_read),
        ("tier_write", tier_write),
        ("tier_read", tier_read),
    ]
    samples = {"memcpy": baseline.sample_s()}
    for name, step in steps:
        if name.endswith("write"):
            empty_tier(rig)
        samples[name] = time_s(lambda step=step: step(rig))
    empty_tier(rig)
    return samples


def tier_samples(
    kind: str, baseline: MemcpyBaseline, runs: int, directory: str
) -> dict[str, list[float]]:
    """`runs` timed rounds (after one warm-up round) on a fresh tier of `kind`."""
    with open_tier(kind, baseline.block_bytes, baseline.blocks, directory) as tier:
        rig = make_rig(tier, baseline.block_bytes, baseline.blocks)
        rounds = [timed_round(rig, baseline) for _ in range(runs + 1)][1:]
    return {name: [sample[name] for sample in rounds] for name in rounds[0]}


def tier_results(block_bytes: int, blocks: int, runs: int, directory: str) -> dict[str, float]:
    """GB/s of every tier path at one block size, and each store path over memcpy."""
    suffix = f"{block_bytes // MIB}MiB"
    baseline = MemcpyBaseline(block_bytes, blocks)
    result: dict[str, float] = {}
    all_memcpy_s: list[float] = []
    for kind in TIER_KINDS:
        samples = tier_samples(kind, baseline, runs, directory)
        rates = {
            name: gbps(baseline.total_bytes, statistics.median(seconds))
            for name, seconds in samples.items()
        }
        all_memcpy_s += samples["memcpy"]
        for name in ("write", "read", "tier_write", "tier_read"):
            result[f"{kind}_{name}_GBps_{suffix}"] = rates[name]
        for name in ("write", "read"):
            result[f"{kind}_{name}_vs_memcpy_{suffix}"] = rates[name] / rates["memcpy"]
    result[f"memcpy_GBps_{suffix}"] = gbps(baseline.total_bytes, statistics.median(all_memcpy_s))
    return result


# ---- codec and checksum ----------------------------------------------------------------------
def codec_results(layers: int, runs: int) -> dict[str, float]:
    """fp8 encode/decode of one whole block and xxh3 of the same bf16 bytes, in GB/s of bf16."""
    layout = KVLayout(num_layers=layers, **CODEC_LAYOUT)
    generator = torch.Generator().manual_seed(0)
    kv = [
        torch.randn(layout.layer_shape, generator=generator).to(torch.bfloat16)
        for _ in range(layers)
    ]
    payload = torch.empty(layout.payload_bytes, dtype=torch.uint8)
    bf16_bytes = layers * layout.layer_elements * torch.bfloat16.itemsize
    raw = torch.cat([layer.view(-1) for layer in kv]).view(torch.uint8)
    encode_s = median_time_s(lambda: encode_block(layout, kv, payload), runs)
    decode_s = median_time_s(lambda: decode_block(layout, payload), runs)
    checksum_s = median_time_s(lambda: block.payload_checksum(raw), runs)
    return {
        "fp8_block_bf16_bytes": bf16_bytes,
        "fp8_encode_GBps": gbps(bf16_bytes, encode_s),
        "fp8_decode_GBps": gbps(bf16_bytes, decode_s),
        "checksum_GBps": gbps(bf16_bytes, checksum_s),
    }
