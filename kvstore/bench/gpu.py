"""`kvstore bench gpu`: the copy engine on a device, beside the device's own limit.

Runs in the benchmark process, with a real node agent as a child process; needs only torch and
the project (no vLLM, no SGLang). Paged KV sized like Llama-3-8B (32 layers, 8 kv heads, head
dim 128, bf16, block 16, 256-token chunks) in each of vLLM's six physical layouts, built with
plain strides; `--chunks` chunks saved into the agent's arena and loaded back through the copy
engine, bytes compared; beside them, a plain pinned `copy_` of the same bytes each way; and
the overlap: 32 layer-sized matmuls on the compute stream alone, then while loads run.
`--device cpu` runs the same code (CI calls it), where streams are no-ops and a thread loads.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvstore.bench import peers
from kvstore.bench.timing import check_runs, gbps
from kvstore.block import HEADER_BYTES
from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.kvcopy.engine import ChunkCopier
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout

logger = logging.getLogger(__name__)

# vLLM's KVCacheLayout members: the physical order of the logical axes [L, B, H, N, C].
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LLAMA_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block": 16}


def paged_layers(layout: KVLayout, block: int, num_blocks: int, order, device) -> list:
    """Per-layer [num_blocks, H, block, 2D] views of one allocation in physical `order`."""
    logical = (layout.num_layers, num_blocks, layout.num_kv_heads, block, 2 * layout.head_dim)
    physical = torch.empty(
        [logical[axis] for axis in order], dtype=layout.torch_dtype, device=device
    )
    five = physical.permute([order.index(axis) for axis in range(5)])
    return [five[layer] for layer in range(layout.num_layers)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Run:
    """One layout's save and load of `chunks` chunks through a real agent."""

    def __init__(self, client, layout: KVLayout, block: int, chunks: int, order, device):
        self.client, self.layout, self.block, self.device = client, layout, block, device
        self.per_chunk = layout.chunk_tokens // block
        self.chunks = chunks
        self.source = paged_layers(layout, block, chunks * self.per_chunk, order, device)
        self.target = paged_layers(layout, block, chunks * self.per_chunk, order, device)
        for layer in self.source:
            layer.copy_(torch.randn(layer.shape, device=device, dtype=torch.float32))
        for layer in self.target:
            layer.zero_()
        self.copier = ChunkCopier(layout, block, device)

    def blocks(self, chunk: int) -> list[int]:
        return list(range(chunk * self.per_chunk, (chunk + 1) * self.per_chunk))

    def indexes(self) -> list:
        """Each chunk's engine blocks, indexed once (as the connector does once per step)."""
        return [self.copier.block_index(self.blocks(chunk)) for chunk in range(self.chunks)]

    def save(self, keys: list[BlockKey]) -> float:
        _sync(self.device)
        started = time.perf_counter()
        reservation = self.client.save("bench", keys, self.layout.payload_bytes)
        indexes = self.indexes()
        digests = [Hasher() for _ in keys]
        for layer, paged in enumerate(self.source):
            start, stop = self.layout.layer_range(layer)
            self.copier.after_compute()
            for chunk, payload in enumerate(reservation.payloads):
                self.copier.save_layer(paged, indexes[chunk], payload[start:stop], digests[chunk])
        self.copier.synchronize()
        self.client.commit(reservation, checksums=[d.intdigest() for d in digests])
        return time.perf_counter() - started

    def load(self, keys: list[BlockKey], layer_done=None) -> tuple[float, bool]:
        started = time.perf_counter()
        loaded = self.client.load("bench", keys, verify=False)
        indexes = self.indexes()
        digests = [Hasher() for _ in keys]
        self.copier.after_compute()
        for layer, paged in enumerate(self.target):
            start, stop = self.layout.layer_range(layer)
            for chunk, payload in enumerate(loaded.payloads):
                self.copier.load_layer(payload[start:stop], digests[chunk], paged, indexes[chunk])
            self.copier.record(layer)
            if layer_done is not None:
                layer_done(layer)
        self.copier.synchronize()
        elapsed = time.perf_counter() - started
        verified = len(loaded) == len(keys) and all(
            d.intdigest() == c for d, c in zip(digests, loaded.checksums, strict=True)
        )
        self.client.release(loaded)
        return elapsed, verified

    def bytes_equal(self) -> bool:
        return all(torch.equal(s, t) for s, t in zip(self.source, self.target, strict=True))


def _copy_limit_s(num_bytes: int, device: torch.device, runs: int) -> tuple[float, float]:
    """Median seconds of a plain copy_ of `num_bytes` device -> pinned host and back."""
    pinned = device.type == "cuda"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
    there = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    out, back = [], []
    for _ in range(runs + 1):
        _sync(device)
        started = time.perf_counter()
        host.copy_(there, non_blocking=pinned)
        _sync(device)
        out.append(time.perf_counter() - started)
        started = time.perf_counter()
        there.copy_(host, non_blocking=pinned)
        _sync(device)
        back.append(time.perf_counter() - started)
    return statistics.median(out[1:]), statistics.median(back[1:])


def _matmuls_s(device: torch.device, size: int, count: int) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    _sync(device)
    started = time.perf_counter()
    for _ in range(count):
        a = torch.matmul(a, b) / size
    _sync(device)
    return time.perf_counter() - started


def _overlap(run: _Run, keys, matmul_size: int, layers: int) -> tuple[float, float]:
    """Seconds of `layers` matmuls alone, and while a load of `keys` runs beside them (on
    CUDA its own stream; on the CPU a thread, as the connector does)."""
    _matmuls_s(run.device, matmul_size, 2)  # warm
    alone = _matmuls_s(run.device, matmul_size, layers)
    loader = threading.Thread(target=run.load, args=(keys,), daemon=True)
    loader.start()
    beside = _matmuls_s(run.device, matmul_size, layers)
    loader.join()
    return alone, beside


def _device(name: str) -> torch.device:
    """The device to measure; ConfigError where it is CUDA and there is none (a figure
    measured on the CPU must never pass for the GPU's)."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
        raise ConfigError(
            f"--device {name}: no CUDA device is visible ({build}); "
            "run with --device cpu to measure the CPU path"
        )
    return device


def run_gpu(device: str = "cuda", chunks: int = 64, runs: int = 3, quick: bool = False) -> dict:
    check_runs(runs)
    dev = _device(device)
    shape = dict(LLAMA_8B)
    layouts = list(LAYOUTS)
    if quick:  # CI: the same code on a small model
        shape.update(num_layers=4, num_kv_heads=2, head_dim=64)
        chunks, layouts = min(chunks, 4), ["LBHNC", "BLNHC"]
    block = shape.pop("block")
    layout = KVLayout(**shape, dtype="bfloat16", chunk_tokens=256)
    with (
        tempfile.TemporaryDirectory() as directory,
        peers.node_agent(
            Path(directory), layout.payload_bytes + HEADER_BYTES, 2 * chunks
        ) as socket_path,
        KVStoreClient(socket_path, "bench-gpu") as client,
    ):
        return _measure(client, layout, block, chunks, layouts, dev, runs, quick)


def _measure(client, layout, block, chunks, layouts, device, runs, quick) -> dict:
    total = layout.payload_bytes * chunks
    save_s, load_s, equal, verified = [], [], True, True
    run = None
    for round_, name in enumerate(layouts * runs):
        run = _Run(client, layout, block, chunks, LAYOUTS[name], device)
        keys = [BlockKey((round_ * 1000 + i).to_bytes(16, "little")) for i in range(chunks)]
        save_s.append(run.save(keys))
        elapsed, ok = run.load(keys)
        load_s.append(elapsed)
        equal &= run.bytes_equal()
        verified &= ok
    out_s, back_s = _copy_limit_s(total, device, runs)
    alone, beside = _overlap(run, keys, 256 if quick else 4096, layout.num_layers)
    save, load = gbps(total, statistics.median(save_s)), gbps(total, statistics.median(load_s))
    copy_out, copy_in = gbps(total, out_s), gbps(total, back_s)
    return {
        "device": str(device),
        "layouts": layouts,
        "chunks": chunks,
        "payload_bytes": layout.payload_bytes,
        "save_GBps": save,
        "load_GBps": load,
        "copy_d2h_GBps": copy_out,
        "copy_h2d_GBps": copy_in,
        "save_vs_copy": save / copy_out,
        "load_vs_copy": load / copy_in,
        "matmuls_alone_s": alone,
        "matmuls_with_loads_s": beside,
        "compute_slowdown": beside / alone - 1,
        "bytes_equal": equal,
        "checksums_ok": verified,
    }
