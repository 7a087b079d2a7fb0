"""`kvstore bench gpu`: the copy engine on a device, beside the device's own limit.

Runs in the benchmark process, with a real node agent as a child process; needs only torch and
the project (no vLLM, no SGLang). Paged KV sized like Llama-3-8B (32 layers, 8 kv heads, head
dim 128, bf16, block 16, 256-token chunks) in each of vLLM's six physical layouts, built with
plain strides; `--chunks` chunks saved into the agent's arena and loaded back through the copy
engine (a layer of every chunk in one call: on CUDA, one DMA for the chunks whose pages lie
side by side), bytes compared; after each such round, a plain `copy_` of the same bytes each
way between the KV and pinned host memory, the figures `*_vs_copy` being the median of the
rounds' ratios; and the overlap: 32 layer-sized matmuls on the compute stream alone, then
while loads run.
`--device cpu` runs the same code (CI calls it), where streams are no-ops and a thread loads.
"""

from __future__ import annotations

import contextlib
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
from kvstore.kvcopy.engine import ChunkCopier, LayerLoad
from kvstore.kvcopy.streams import one_thread
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
        self.uploads = 0  # the copier's uploads (DMAs into staging) in its last load

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
        uploads = self.copier.streams.uploads
        loaded = self.client.load("bench", keys, verify=False)
        indexes = self.indexes()
        digests = [Hasher() for _ in keys]
        self.copier.after_compute()
        for layer, paged in enumerate(self.target):
            start, stop = self.layout.layer_range(layer)
            self.copier.load_layers(
                [
                    LayerLoad(payload[start:stop], digest, paged, index)
                    for payload, digest, index in zip(
                        loaded.payloads, digests, indexes, strict=True
                    )
                ]
            )
            self.copier.record(layer)
            if layer_done is not None:
                layer_done(layer)
        self.copier.synchronize()
        elapsed = time.perf_counter() - started
        self.uploads = self.copier.streams.uploads - uploads
        verified = len(loaded) == len(keys) and all(
            d.intdigest() == c for d, c in zip(digests, loaded.checksums, strict=True)
        )
        self.client.release(loaded)
        return elapsed, verified

    def bytes_equal(self) -> bool:
        return all(torch.equal(s, t) for s, t in zip(self.source, self.target, strict=True))


class _CopyLimit:
    """A plain copy_ of a round's bytes, from its source KV (one allocation) into pinned host
    memory and back into its target KV, timed right after the round's save and load, under
    the same load from the rest of the host (on a shared one, what other work leaves free
    changes from minute to minute: one baseline taken after every round would compare
    moments, not copies). On the CPU on one thread, as the copy engine copies
    (kvcopy/streams.py `one_thread`): torch's pool would time two threads against one."""

    def __init__(self, num_bytes: int, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.host.zero_()  # its pages exist before the first timed copy

    def seconds(self, run: _Run) -> tuple[float, float]:
        """Seconds of the copy device -> host, and host -> device, of `run`'s bytes."""
        source, target = _bytes_of(run.source), _bytes_of(run.target)
        with contextlib.nullcontext() if self.pinned else one_thread():
            out = self._timed(self.host, source)
            back = self._timed(target, self.host)
        return out, back

    def _timed(self, destination: torch.Tensor, source: torch.Tensor) -> float:
        _sync(self.device)
        started = time.perf_counter()
        destination.copy_(source, non_blocking=self.pinned)
        _sync(self.device)
        return time.perf_counter() - started


def _bytes_of(layers: list[torch.Tensor]) -> torch.Tensor:
    """The one allocation `paged_layers` made, as flat bytes."""
    storage = layers[0].untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=layers[0].device).set_(storage)


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


def _paired(copy_s: list[float], engine_s: list[float]) -> float:
    """The median over rounds of the plain copy's seconds over the engine's, each pair
    measured back to back."""
    return statistics.median(c / e for c, e in zip(copy_s, engine_s, strict=True))


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
    times = {"save": [], "load": [], "out": [], "back": []}
    equal, verified, run = True, True, None
    limit = _CopyLimit(total, device)
    for round_, name in enumerate(layouts * runs):
        run = None  # the last round's KV goes before the next round's is made
        run = _Run(client, layout, block, chunks, LAYOUTS[name], device)
        keys = [BlockKey((round_ * 1000 + i).to_bytes(16, "little")) for i in range(chunks)]
        times["save"].append(run.save(keys))
        elapsed, ok = run.load(keys)
        times["load"].append(elapsed)
        equal &= run.bytes_equal()
        verified &= ok
        out, back = limit.seconds(run)  # after the comparison: it overwrites the target
        times["out"].append(out)
        times["back"].append(back)
    alone, beside = _overlap(run, keys, 256 if quick else 4096, layout.num_layers)
    rates = {name: gbps(total, statistics.median(values)) for name, values in times.items()}
    return {
        "device": str(device),
        "layouts": layouts,
        "chunks": chunks,
        "payload_bytes": layout.payload_bytes,
        "save_GBps": rates["save"],
        "load_GBps": rates["load"],
        "copy_d2h_GBps": rates["out"],
        "copy_h2d_GBps": rates["back"],
        "load_uploads_per_layer": run.uploads / layout.num_layers,
        "save_vs_copy": _paired(times["out"], times["save"]),
        "load_vs_copy": _paired(times["back"], times["load"]),
        "matmuls_alone_s": alone,
        "matmuls_with_loads_s": beside,
        "compute_slowdown": beside / alone - 1,
        "bytes_equal": equal,
        "checksums_ok": verified,
    }
