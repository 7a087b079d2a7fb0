"""Helpers for the LMCache adapter tests: adapters built the way `lmcache server` builds them
(its --l2-adapter JSON, its plugin factory), LMCache memory objects and keys, and waits on
the adapter's eventfds."""

from __future__ import annotations

import argparse
import json
import os
import select
import time

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

OBJECT_BYTES = 64 << 10
MODEL = "tiny-llama"


def adapter_spec(socket_path, **params) -> str:
    """The --l2-adapter JSON of the kvstore adapter."""
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvstore.connectors.lmcache.adapter",
            "class_name": "KVStoreL2Adapter",
            "adapter_params": {
                "socket_path": str(socket_path),
                "reconnect_interval_s": 0,
                **params,
            },
        }
    )


def build_adapter(socket_path, **params):
    """A KVStoreL2Adapter from LMCache's own argument parser and plugin factory."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", adapter_spec(socket_path, **params)])
    (config,) = parse_args_to_l2_adapters_config(args).adapters
    return create_l2_adapter_from_registry(config)


def object_keys(count: int, model: str = MODEL, **fields) -> list[ObjectKey]:
    """`count` keys of one chain: LMCache's chunk hashes 0..count-1 (32 bytes each)."""
    return [ObjectKey(i.to_bytes(32, "big"), model, 0, **fields) for i in range(count)]


def memory_obj(seed: int | None = None, num_bytes: int = OBJECT_BYTES) -> TensorMemoryObj:
    """An LMCache memory object of float32 KV: random bytes from `seed`, else zeros."""
    raw = torch.zeros(num_bytes, dtype=torch.uint8)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator))
    shape = torch.Size([num_bytes // 4])
    metadata = MemoryObjMetadata(
        shape, torch.float32, 0, num_bytes, 1, shapes=[shape], dtypes=[torch.float32]
    )
    return TensorMemoryObj(raw, metadata, parent_allocator=None)


def wait_for(fd: int, query, timeout_s: float = 10.0):
    """Wait on the adapter's eventfd until `query()` gives a result; that result."""
    deadline = time.monotonic() + timeout_s
    while (result := query()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no result after {timeout_s} s")
        if select.select([fd], [], [], 0.05)[0]:
            os.eventfd_read(fd)  # consumed, as LMCache's controllers do
    return result


def store(adapter, keys, objects):
    task = adapter.submit_store_task(keys, objects)
    results = wait_for(
        adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks() or None
    )
    return results[task]


def lookup(adapter, keys) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    fd = adapter.get_lookup_and_lock_event_fd()
    return positions(wait_for(fd, lambda: adapter.query_lookup_and_lock_result(task)))


def load(adapter, keys, objects) -> list[int]:
    task = adapter.submit_load_task(keys, objects)
    fd = adapter.get_load_event_fd()
    return positions(wait_for(fd, lambda: adapter.query_load_result(task)))


def positions(bitmap: Bitmap) -> list[int]:
    return sorted(bitmap.get_indices_list())


def same_bytes(a: TensorMemoryObj, b: TensorMemoryObj) -> bool:
    return torch.equal(a.raw_tensor, b.raw_tensor)
