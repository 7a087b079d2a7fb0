"""The SGLang HiCache backend with SGLang's real classes: loaded by SGLang's own factory,
pages stored and loaded through a real node agent and SGLang's real host pools on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from numpy.lib.array_utils import byte_bounds

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from kvstore.bench.sglang import backend_for, host_pool, storage_config
from kvstore.errors import ConfigError
from tests.node.agents import running_agent, start_node_process

SHAPE = {"layers": 3, "heads": 2, "head_dim": 16, "page_tokens": 4}
SETTINGS = {"host_capacity_bytes": 4 << 20, "page_size_bytes": 64 << 10}


def fill(pool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def pages_of(backend, indices: torch.Tensor) -> list[list[np.ndarray]]:
    fmt = backend._format
    return [[c.copy() for c in fmt.page(s)] for s in indices[:: fmt.page_tokens].tolist()]


def same_pages(a, b) -> bool:
    return all(
        (x == y).all() for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True)
    )


def page_indices(first_page: int, count: int) -> torch.Tensor:
    tokens = SHAPE["page_tokens"]
    return torch.arange(first_page * tokens, (first_page + count) * tokens)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_set_exists_get_round_trip(tmp_path, layout):
    with running_agent(tmp_path, **SETTINGS) as agent:
        writer_pool, reader_pool = host_pool(layout, 8, **SHAPE), host_pool(layout, 8, **SHAPE)
        writer = backend_for(agent.config.socket_path, writer_pool)
        reader = backend_for(agent.config.socket_path, reader_pool)
        fill(writer_pool, 1)
        keys = [f"hash-{i}" for i in range(4)]
        assert writer.batch_set_v1(keys, page_indices(1, 4)) == [True] * 4
        assert reader.batch_exists([*keys, "absent"]) == 4
        assert reader.batch_exists(["absent", *keys]) == 0
        assert reader.batch_get_v1(keys, page_indices(3, 4)) == [True] * 4
        assert same_pages(
            pages_of(writer, page_indices(1, 4)), pages_of(reader, page_indices(3, 4))
        )
        stats = reader.get_stats()
        assert stats.totals["hit_pages"] == 4 and stats.totals["miss_pages"] == 1 + 5
        assert stats.totals["loaded_bytes"] == 4 * reader._format.payload_bytes
        assert stats.prefetch_pgs == [4] and reader.get_stats().prefetch_pgs == []


def test_views_are_the_pools_own_pages():
    """The bytes copied are the ones SGLang's get_page_buffer_meta names for the page."""
    for layout in ("page_first", "page_first_direct"):
        pool = host_pool(layout, 4, **SHAPE)
        from kvstore.connectors.sglang.pages import page_format

        fmt = page_format(pool, mla=False, codec="raw")
        pointers, sizes = pool.get_page_buffer_meta(page_indices(2, 1))
        k, v = fmt.page(2 * SHAPE["page_tokens"])
        assert sizes == [k.size, v.size]
        starts = [int(byte_bounds(c)[0]) for c in (k, v)]
        assert starts == pointers


def test_layouts_share_blocks(tmp_path):
    """The payload is canonical: a page_first writer's pages load into a page_first_direct pool."""
    with running_agent(tmp_path, **SETTINGS) as agent:
        first, direct = (
            host_pool("page_first", 4, **SHAPE),
            host_pool("page_first_direct", 4, **SHAPE),
        )
        writer, reader = (
            backend_for(agent.config.socket_path, first),
            backend_for(agent.config.socket_path, direct),
        )
        fill(first, 2)
        assert writer.batch_set_v1(["a", "b"], page_indices(1, 2)) == [True, True]
        assert reader.batch_get_v1(["a", "b"], page_indices(2, 2)) == [True, True]
        assert same_pages(
            pages_of(writer, page_indices(1, 2)), pages_of(reader, page_indices(2, 2))
        )


def test_tp_ranks_store_their_own_shards(tmp_path):
    with running_agent(tmp_path, **SETTINGS) as agent:
        pools = [host_pool("page_first", 4, **SHAPE) for _ in range(2)]
        ranks = [
            backend_for(agent.config.socket_path, p, tp_rank=r, tp_size=2)
            for r, p in enumerate(pools)
        ]
        for rank, pool in enumerate(pools):
            fill(pool, 10 + rank)
        assert ranks[0].batch_set_v1(["x", "y"], page_indices(1, 2)) == [True, True]
        assert ranks[1].batch_exists(["x", "y"]) == 0  # rank 1 never reads rank 0's heads
        assert ranks[1].batch_set_v1(["x", "y"], page_indices(1, 2)) == [True, True]
        before = [pages_of(r, page_indices(1, 2)) for r in ranks]
        for rank, pool in enumerate(pools):
            pool.kv_buffer.zero_()
            assert ranks[rank].batch_get_v1(["x", "y"], page_indices(1, 2)) == [True, True]
            assert same_pages(before[rank], pages_of(ranks[rank], page_indices(1, 2)))
        assert not same_pages(before[0], before[1])


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mla_one_writer_every_rank_reads(tmp_path, layout):
    shape = {**SHAPE, "heads": 1, "head_dim": 24}
    with running_agent(tmp_path, **SETTINGS) as agent:
        pools = [host_pool(layout, 4, mla=True, **shape) for _ in range(2)]
        ranks = [
            backend_for(agent.config.socket_path, p, tp_rank=r, tp_size=2, mla=True)
            for r, p in enumerate(pools)
        ]
        fill(pools[0], 3)
        fill(pools[1], 4)
        assert ranks[1].batch_set_v1(["m1", "m2"], page_indices(1, 2)) == [True, True]
        assert ranks[0].batch_exists(["m1"]) == 0  # rank 1 is not the writer: nothing stored
        assert ranks[0].batch_set_v1(["m1", "m2"], page_indices(1, 2)) == [True, True]
        assert ranks[1].batch_exists(["m1", "m2"]) == 2
        assert ranks[1].batch_get_v1(["m1", "m2"], page_indices(2, 2)) == [True, True]
        assert same_pages(
            pages_of(ranks[0], page_indices(1, 2)), pages_of(ranks[1], page_indices(2, 2))
        )


def test_fp8_codec_round_trips_approximately(tmp_path):
    with running_agent(tmp_path, **SETTINGS) as agent:
        pool = host_pool("page_first_direct", 4, **SHAPE)
        backend = backend_for(agent.config.socket_path, pool, codec="fp8")
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
        original = pool.kv_buffer.clone()
        assert backend.batch_set_v1(["f"], page_indices(1, 1)) == [True]
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(["f"], page_indices(1, 1)) == [True]
        page = slice(1, 2)
        got, want = pool.kv_buffer[:, page].float(), original[:, page].float()
        assert torch.allclose(got, want, atol=0.1 * want.abs().max().item())


def test_refuses_other_layouts_unknown_keys_and_bad_values(tmp_path):
    with running_agent(tmp_path, **SETTINGS) as agent:
        socket_path = agent.config.socket_path
        with pytest.raises(ConfigError, match="page_first or page_first_direct"):
            backend_for(socket_path, host_pool("layer_first", 4, **SHAPE))
        with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['sockt_path'\] in"):
            backend_for(socket_path, host_pool("page_first", 4, **SHAPE), sockt_path="x")
        with pytest.raises(ConfigError, match="load_timeout_s must be a number"):
            backend_for(socket_path, host_pool("page_first", 4, **SHAPE), load_timeout_s="10")
        with pytest.raises(ConfigError, match="codec"):
            backend_for(socket_path, host_pool("page_first", 4, **SHAPE), codec="zstd")
        from kvstore.connectors.sglang.backend import KVStoreHiCacheStorage

        with pytest.raises(ConfigError, match="interface_v1"):
            KVStoreHiCacheStorage(storage_config({"socket_path": str(socket_path)}), {})


def test_namespaces_separate_models_tenants_and_salts(tmp_path):
    with running_agent(tmp_path, **SETTINGS) as agent:
        pool = host_pool("page_first", 4, **SHAPE)
        base = backend_for(agent.config.socket_path, pool)
        assert base.batch_set_v1(["k"], page_indices(1, 1)) == [True]
        for other in ({"salt": "s"}, {"model_path": "another-model"}, {"codec": "fp8"}):
            assert backend_for(agent.config.socket_path, pool, **other).batch_exists(["k"]) == 0


def test_agent_killed_mid_call_gives_misses_and_falses_then_reconnects(tmp_path):
    process, socket_path = start_node_process(tmp_path, "node-k")
    pool = host_pool("page_first", 8, **SHAPE)
    backend = backend_for(socket_path, pool, reconnect_interval_s=0)
    try:
        assert backend.batch_set_v1(["a", "b"], page_indices(1, 2)) == [True, True]
        process.kill()
        process.wait()
        assert backend.batch_exists(["a", "b"]) == 0
        assert backend.batch_get_v1(["a", "b"], page_indices(3, 2)) == [False, False]
        assert backend.batch_set_v1(["c"], page_indices(1, 1)) == [False]
        process, socket_path = start_node_process(tmp_path, "node-k")  # the agent comes back
        assert backend.batch_set_v1(["c"], page_indices(1, 1)) == [True]
        assert backend.batch_exists(["c"]) == 1
        assert backend.get_stats().totals["reconnects"] >= 1
    finally:
        backend.close()
        process.kill()
        process.wait()


def test_no_agent_at_start_is_a_miss_not_an_error(tmp_path):
    backend = backend_for(tmp_path / "nobody.sock", host_pool("page_first", 4, **SHAPE))
    assert backend.batch_exists(["a"]) == 0
    assert backend.batch_get_v1(["a"], page_indices(1, 1)) == [False]
    assert backend.batch_set_v1(["a"], page_indices(1, 1)) == [False]


def test_bench_sglang_prints_one_json_object():
    command = [
        sys.executable,
        "-m",
        "kvstore",
        "bench",
        "sglang",
        "--json",
        "--quick",
        "--runs",
        "1",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out)
    assert {"set_vs_memcpy", "get_vs_memcpy", "memcpy_gbps"} <= set(result)
    assert all(
        r["bytes_equal"] and r["exists"] == result["pages"] for r in result["layouts"].values()
    )
