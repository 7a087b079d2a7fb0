"""`kvstore bench sglang`: the SGLang HiCache backend's batch_set_v1 / batch_get_v1 against a
real node agent (a child process), beside memcpy of the same bytes in the same run.

Runs in the benchmark process with SGLang's real host pool (MHATokenToKVPoolHost on CPU,
pin_memory=False) sized like Llama-3-8B: 32 layers, 8 kv heads, head dim 128, bf16, pages of
64 tokens (8 MiB each), in the page_first_direct and page_first layouts; then page_first_direct
with head_group_size 1 (topology-free blocks: one per kv head, 8 per page) as `head_group_1`.

The memcpy baseline is fair: the same pool pages and the same bytes, copied into (set) and out
of (get) pages of the same agent's arena, reserved through a client of its own (one mapping of
the same /dev/shm file), with numpy.copyto in the longest contiguous runs the two memories
allow, single-threaded like the backend. Its samples alternate with the backend's, so load on
the machine hits both alike: `*_vs_memcpy` are medians of the paired wall-clock ratios,
`*_vs_memcpy_cpu` of the calling thread's CPU seconds (which leave out a loaded machine's
scheduling waits, and the agent's share of the work). Every arena page is written before
timing starts (a first write to a /dev/shm page faults it in).
"""

from __future__ import annotations

import hashlib
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvstore.bench import peers
from kvstore.bench.timing import check_runs, gbps, machine_info, time_s
from kvstore.block import HEADER_BYTES
from kvstore.client import KVStoreClient
from kvstore.connectors.sglang.cpu_imports import allow_host_pool_imports
from kvstore.keys import KEY_BYTES

LLAMA_8B = {"layers": 32, "heads": 8, "head_dim": 128, "page_tokens": 64}
QUICK = {"layers": 4, "heads": 2, "head_dim": 64, "page_tokens": 16}


def storage_config(
    extra: dict,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    model_name: str = "bench-model",
):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name=model_name,
        extra_config=dict(extra),
    )


def host_pool(
    layout: str,
    pages: int,
    layers: int,
    heads: int,
    head_dim: int,
    page_tokens: int,
    mla: bool = False,
    dtype=torch.bfloat16,
    start_layer: int = 0,
):
    """A real SGLang host pool on CPU over small stand-in device buffers (SGLang's own
    buffer-info structs; the host pool only reads their geometry and pointers), of layers
    [start_layer, start_layer + layers) of the model (a pipeline stage's)."""
    allow_host_pool_imports()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = page_tokens
    common = dict(
        host_to_device_ratio=1.0,
        host_size=0,
        page_size=page_tokens,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=pages * page_tokens,
        start_layer=start_layer,
        end_layer=start_layer + layers,
    )
    with _memory_budget():
        if mla:
            return _mla_pool(common, layers, head_dim, page_tokens, dtype)
        k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        buffers = KVBuffers(
            k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v), layout=KVBufferLayout.NHD
        )
        info = MHABufferInfo(
            buffers=buffers,
            page_size=page_tokens,
            head_num=heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            dtype=dtype,
            device=torch.device("cpu"),
        )
        return MHATokenToKVPoolHost(info, **common)


def _mla_pool(common: dict, layers: int, head_dim: int, page_tokens: int, dtype):
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    rows = tuple(torch.zeros(page_tokens, 1, head_dim, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=_pointers(rows),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_tokens,
        kv_lora_rank=head_dim - 64 if head_dim > 64 else head_dim // 2,
        qk_rope_head_dim=64 if head_dim > 64 else head_dim - head_dim // 2,
        kv_cache_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(info, **common, target_layer_num=layers)


def _pointers(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def _memory_budget():
    """The host's available memory as SGLang's pool budget: SGLang keeps 10 GiB back for the
    rest of a serving host, which refuses even a small pool on a busy CI machine."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    return host_memory_budget_scope(psutil.virtual_memory().available)


def backend_for(socket_path: Path, pool, **extra):
    """A KVStoreHiCacheStorage built through SGLang's own factory, its pool registered."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    ranks = {k: extra.pop(k) for k in ("tp_rank", "tp_size", "mla") if k in extra}
    config = storage_config(
        {
            "backend_name": "kvstore",
            "module_path": "kvstore.connectors.sglang.backend",
            "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1,
            "socket_path": str(socket_path),
            **extra,
        },
        **ranks,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def run_sglang(pages: int = 64, runs: int = 3, quick: bool = False) -> dict:
    check_runs(runs)
    shape = dict(QUICK if quick else LLAMA_8B)
    pages = min(pages, 4) if quick else pages
    page_bytes = 2 * shape["layers"] * shape["page_tokens"] * shape["heads"] * shape["head_dim"] * 2
    result = {
        "pages": pages,
        "page_bytes": page_bytes,
        "model": "quick" if quick else "llama-3-8b",
        "runs": runs,
        "layouts": {},
        "machine": machine_info(),
    }
    for layout in ("page_first_direct", "page_first"):
        result["layouts"][layout] = _measure(layout, shape, pages, runs)
    best = result["layouts"]["page_first_direct"]
    grouped = _measure("page_first_direct", shape, pages, runs, head_group_size=1)
    result.update({key: best[key] for key in ("memcpy_gbps", "set_vs_memcpy", "get_vs_memcpy")})
    result["head_group_1"] = {**grouped, "blocks_per_page": shape["heads"]}
    return result


def _measure(layout: str, shape: dict, pages: int, runs: int, head_group_size: int = 0) -> dict:
    """One pool layout against a fresh agent whose arena holds two batches (the one being
    set, the one before) and the baseline's pages."""
    blocks = pages * (shape["heads"] if head_group_size else 1)
    block_bytes = (
        (2 * shape["layers"] * shape["page_tokens"] * shape["heads"] * shape["head_dim"] * 2)
        * pages
        // blocks
    )
    with (
        tempfile.TemporaryDirectory() as directory,
        peers.node_agent(Path(directory), block_bytes + HEADER_BYTES, 3 * blocks) as socket_path,
    ):
        pool = host_pool(layout, pages, **shape)
        backend = backend_for(socket_path, pool, salt=layout, head_group_size=head_group_size)
        try:
            return _timed(backend, pool, socket_path, pages, runs)
        finally:
            backend.close()


def _timed(backend, pool, socket_path: Path, pages: int, runs: int) -> dict:
    fmt, tokens = backend._format, backend._format.page_tokens
    indices = torch.arange(tokens, (pages + 1) * tokens)  # page 0 is SGLang's padding page
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    starts = indices[::tokens].tolist()
    expected = [[comp.copy() for comp in fmt.page(s)] for s in starts]
    total = pages * backend._page_bytes
    names = (f"{fmt.layout}-{i}" for i in itertools.count())
    keys: list[str] = []

    def batch_set() -> None:
        keys[:] = [next(names) for _ in range(pages)]  # pages the agent does not hold yet
        _check(backend.batch_set_v1(keys, indices))

    with ArenaMemcpy(socket_path, fmt, starts, backend._groups.count) as memcpy:
        warmup = 2  # two batches: every page of the backend's part of the arena written once
        sets = _paired(batch_set, memcpy.to_arena, runs, warmup)
        pool.kv_buffer.zero_()
        gets = _paired(
            lambda: _check(backend.batch_get_v1(keys, indices)), memcpy.from_arena, runs, warmup=1
        )
    intact = all(
        (comp == want).all()
        for s, page in zip(starts, expected, strict=True)
        for comp, want in zip(fmt.page(s), page, strict=True)
    )
    memcpy_set, memcpy_get = gbps(total, sets["memcpy_s"]), gbps(total, gets["memcpy_s"])
    return {
        "set_gbps": gbps(total, sets["backend_s"]),
        "get_gbps": gbps(total, gets["backend_s"]),
        "memcpy_set_gbps": memcpy_set,
        "memcpy_get_gbps": memcpy_get,
        "memcpy_gbps": min(memcpy_set, memcpy_get),
        "set_vs_memcpy": sets["ratio"],
        "get_vs_memcpy": gets["ratio"],
        "set_vs_memcpy_cpu": sets["cpu_ratio"],
        "get_vs_memcpy_cpu": gets["cpu_ratio"],
        "bytes_equal": intact,
        "exists": backend.batch_exists(keys),
    }


def _paired(
    backend_call: Callable[[], object], memcpy_call: Callable[[], object], runs: int, warmup: int
) -> dict:
    """Alternate samples of the backend and the baseline: their median wall-clock seconds,
    the median of each pair's throughput ratio (memcpy seconds / backend seconds), and the
    same ratio of this thread's CPU seconds (which a loaded machine's waits do not enter;
    it leaves out the agent's share of the backend's work)."""
    pairs = []
    for index in range(warmup + runs):
        sample = (*_wall_and_cpu_s(memcpy_call), *_wall_and_cpu_s(backend_call))
        if index >= warmup:
            pairs.append(sample)
    return {
        "memcpy_s": statistics.median(p[0] for p in pairs),
        "backend_s": statistics.median(p[2] for p in pairs),
        "ratio": statistics.median(p[0] / p[2] for p in pairs),
        "cpu_ratio": statistics.median(p[1] / p[3] for p in pairs),
    }


def _wall_and_cpu_s(call: Callable[[], object]) -> tuple[float, float]:
    cpu_s = time.thread_time()
    wall_s = time_s(call)
    return wall_s, time.thread_time() - cpu_s


class ArenaMemcpy:
    """numpy.copyto of the bytes of the benchmark's host pages to and from arena pages that a
    client of its own reserved (the same arena file, mapped again), in the longest runs both
    sides allow: a page's contiguous regions (a component each) against its blocks."""

    def __init__(self, socket_path: Path, fmt, starts: list[int], blocks_per_page: int) -> None:
        self._client = KVStoreClient(socket_path, worker="bench-memcpy")
        keys = [
            hashlib.blake2b(b"memcpy%d" % i, digest_size=KEY_BYTES).digest()
            for i in range(len(starts) * blocks_per_page)
        ]
        self._reservation = self._client.save(peers.TENANT, keys, fmt.payload_bytes)
        views = [view.numpy() for view in self._reservation.payloads]
        self._pairs = []  # (arena run, pool run) views of equal length
        for page, start in enumerate(starts):
            regions = [_region(fmt, start, c) for c in range(fmt.components)]
            arena = views[page * blocks_per_page : (page + 1) * blocks_per_page]
            self._pairs += _matched_runs(arena, regions)

    def __enter__(self) -> ArenaMemcpy:
        self.to_arena()  # touch every page once: the backend's pages were written in warm-up
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.abort(self._reservation)
        self._client.close()

    def to_arena(self) -> None:
        for arena, pool in self._pairs:
            np.copyto(arena, pool)

    def from_arena(self) -> None:
        for arena, pool in self._pairs:
            np.copyto(pool, arena)


def _region(fmt, token_index: int, component: int) -> np.ndarray:
    """One component of the host page at `token_index`, a contiguous run of the pool."""
    if fmt.layout == "page_first_direct":
        region = fmt.buffer[component, token_index // fmt.page_tokens]
    else:
        region = fmt.buffer[component, token_index : token_index + fmt.page_tokens]
    return np.reshape(region, -1, copy=False)


def _matched_runs(first: list[np.ndarray], second: list[np.ndarray]) -> list[tuple]:
    """Pairs of equal-length consecutive pieces of two sequences of flat runs of equal total
    length (a page's blocks against its regions)."""
    pairs, a, b = [], list(first), list(second)
    while a and b:
        n = min(a[0].size, b[0].size)
        pairs.append((a[0][:n], b[0][:n]))
        a[0], b[0] = a[0][n:], b[0][n:]
        a, b = [r for r in a if r.size], [r for r in b if r.size]
    return pairs


def _check(results: list[bool]) -> None:
    if not all(results):
        raise RuntimeError(f"{results.count(False)} of {len(results)} pages failed")
