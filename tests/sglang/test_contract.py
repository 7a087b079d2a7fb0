"""The backend against how SGLang 0.5.23 itself drives a storage backend: the host pools it
refuses (MXFP8, whose scales live outside kv_buffer), the sidecar pools of its hybrid
controller (refused at attach), per-page truth from batch_set_v1 when the agent has no room,
SGLang's clear reported as failed, and the extra-config key SGLang adds on its own. SGLang's
real pools, controller methods and factory settings; a real node agent."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from kvstore.bench.sglang import backend_for, host_pool
from kvstore.client import KVStoreClient
from kvstore.connectors.sglang.cpu_imports import allow_host_pool_imports
from kvstore.errors import ConfigError
from tests.node.agents import running_agent

allow_host_pool_imports()

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host  # noqa: E402

from kvstore.connectors.sglang.config import BackendSettings  # noqa: E402

SHAPE = {"layers": 2, "heads": 2, "head_dim": 16, "page_tokens": 4}
AGENT = {"host_capacity_bytes": 4 << 20, "page_size_bytes": 64 << 10}


def indices(first_page: int, count: int) -> torch.Tensor:
    tokens = SHAPE["page_tokens"]
    return torch.arange(first_page * tokens, (first_page + count) * tokens)


def mxfp8_pool():
    """A real MHA host pool on CPU made SGLang's MXFP8 host pool (whose constructor needs CUDA
    kernels), with its two scale buffers as _init_scale_buffers allocates them."""
    pool = host_pool("page_first", 4, **SHAPE, dtype=torch.float8_e4m3fn)
    pool.__class__ = MHATokenToKVPoolMXFP8Host
    pool.k_scale_host = torch.zeros(pool.page_num, pool.layer_num, 8, dtype=torch.uint8)
    pool.v_scale_host = torch.zeros(pool.page_num, pool.layer_num, 8, dtype=torch.uint8)
    return pool


def controller_of(backend) -> HybridCacheController:
    """SGLang's hybrid cache controller, only as far as its storage calls need."""
    controller = HybridCacheController.__new__(HybridCacheController)
    controller.storage_backend = backend
    controller.storage_config = backend.storage_config
    controller.enable_storage = True
    controller.page_size = SHAPE["page_tokens"]
    controller.mem_pool_host = types.SimpleNamespace(layout_lease=contextlib.nullcontext)
    return controller


def test_an_mxfp8_pool_is_refused_at_registration(tmp_path):
    pool = mxfp8_pool()
    with pytest.raises(NotImplementedError, match="scales live outside kv_buffer"):
        pool.get_page_buffer_meta(indices(1, 1))  # SGLang gives no L3 pages of it either
    with running_agent(tmp_path, **AGENT) as agent:
        with pytest.raises(ConfigError, match="not MHATokenToKVPoolMXFP8Host"):
            backend_for(agent.config.socket_path, pool)  # it stored pages without scales


def test_a_sidecar_pool_fails_the_attach_and_the_kv_pool_registers(tmp_path):
    with running_agent(tmp_path, **AGENT) as agent:
        pool = host_pool("page_first", 4, **SHAPE)
        backend = backend_for(agent.config.socket_path, pool)
        backend.register_mem_host_pool_v2(pool, PoolName.KV)  # as the hybrid controller does
        backend.on_host_pools_registered()
        with pytest.raises(ConfigError, match="not SGLang's 'draft' pool"):
            backend.register_mem_host_pool_v2(host_pool("page_first", 4, **SHAPE), "draft")


def test_set_reports_false_for_pages_the_agent_had_no_room_for(tmp_path):
    with running_agent(
        tmp_path, host_capacity_bytes=3 * (64 << 10), page_size_bytes=64 << 10
    ) as agent:  # 3 pages of room
        pool = host_pool("page_first", 8, **SHAPE)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
        backend = backend_for(agent.config.socket_path, pool)
        assert backend.batch_set_v1(["a", "b", "c"], indices(1, 3)) == [True] * 3
        assert backend.batch_set_v1(["a", "b"], indices(1, 2)) == [True] * 2  # held already
        with KVStoreClient(agent.config.socket_path) as other:
            pinned = other.load("default", backend._store_keys(["a", "b", "c"]))
            assert len(pinned) == 3  # every arena page pinned: nothing can be evicted
            results = backend.batch_set_v1(["c", "d"], indices(3, 2))
            other.release(pinned)
        assert results == [True, False], "a page with no room was reported stored"
        assert backend.batch_exists(["c", "d"]) == 1


def test_sglangs_clear_reports_failure_and_the_pages_stay(tmp_path):
    with running_agent(tmp_path, **AGENT) as agent:
        backend = backend_for(agent.config.socket_path, host_pool("page_first", 4, **SHAPE))
        assert backend.batch_set_v1(["a"], indices(1, 1)) == [True]
        with pytest.raises(NotImplementedError, match="shared by every engine"):
            controller_of(backend).clear_storage_backend()  # StorageAttachment: success=False
        assert backend.batch_exists(["a"]) == 1


def test_the_backend_polls_for_answers_as_its_extra_config_says(tmp_path, answer_polls):
    with running_agent(tmp_path, **AGENT) as agent:
        pool = host_pool("page_first", 4, **SHAPE)
        backend = backend_for(agent.config.socket_path, pool, answer_spin_us=0)
        assert backend.batch_exists(["a"]) == 0
        assert answer_polls == []
        backend = backend_for(agent.config.socket_path, pool, answer_spin_us=300)
        assert backend.batch_exists(["a"]) == 0
        assert answer_polls and set(answer_polls) == {300e-6}
    for wrong in (10_001, -1, "100", True):
        with pytest.raises(ConfigError, match="answer_spin_us"):
            BackendSettings.from_extra_config({"answer_spin_us": wrong})


def test_the_file_storage_path_sglang_adds_is_accepted():
    settings = BackendSettings.from_extra_config(
        {
            "backend_name": "kvstore",
            "module_path": "kvstore.connectors.sglang.backend",
            "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1,
            "file_storage_path": "/tmp/hicache",  # from --file-storage-path, to every backend
        }
    )
    assert settings == BackendSettings()
