"""Blocks are per kv-head group, not per TP rank: the two halves of a TP=2 deployment (the
connector's worker halves, each over its rank's heads of a paged cache written by vLLM's own
CPU cache kernel) store blocks that a TP=1 worker loads, equal to what a TP=1 writer stores,
and the reverse; an SGLang TP=1 backend reads them too. Real node agents, real tensors."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvstore.connectors.vllm.compat import paged_layer_view
from kvstore.connectors.vllm.config import ConnectorSettings, EngineKV
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.worker import WorkerSide
from kvstore.fingerprint import model_fingerprint
from kvstore.keys_sglang import head_groups, sglang_page_hashes, shared_namespace
from kvstore.layout import KVLayout
from tests.node.agents import running_agent

LAYERS, HEADS, HEAD_DIM, BLOCK, CHUNK, CHUNKS = 2, 2, 32, 32, 64, 3
TOKENS = [(i * 31) % 500 + 5 for i in range(CHUNK * CHUNKS + 5)]
CHAIN = [h.encode() for h in sglang_page_hashes(TOKENS, CHUNK)]
AGENT = {"host_capacity_bytes": 4 << 20, "page_size_bytes": 64 << 10}
NUM_BLOCKS = 2 * CHUNKS * CHUNK // BLOCK  # room to load into blocks the writer did not use


def engine(model_dir, tp_size: int, tp_rank: int, head_group_size: int = 1) -> EngineKV:
    """What engine_kv derives for one rank with key_scheme sglang on the CPU ('vec' ISA)."""
    groups = head_groups(HEADS, tp_size, tp_rank, head_group_size)
    layout = KVLayout(LAYERS, groups.group_heads, HEAD_DIM, "float32", CHUNK)
    namespace = shared_namespace(
        model_fingerprint(model_dir), layout, HEADS, (0, LAYERS), "default", ""
    )
    every = head_groups(HEADS, 1, 0, groups.group_heads)
    return EngineKV(layout, namespace, BLOCK, groups, every, "sglang", "vec")


def model_kv() -> torch.Tensor:
    """The model's K/V of the prompt's chunks: [layers, 2, tokens, heads, head_dim]."""
    generator = torch.Generator().manual_seed(7)
    return torch.randn(LAYERS, 2, CHUNK * CHUNKS, HEADS, HEAD_DIM, generator=generator)


def caches_written_by_vllm(kv: torch.Tensor, heads: slice) -> dict[str, torch.Tensor]:
    """Paged caches of one rank (its heads of `kv`) as vLLM's CPU cache kernel writes them,
    the prompt in blocks 0.. of each layer."""
    from vllm import _custom_ops as ops

    caches = {}
    for layer in range(LAYERS):
        key, value = (kv[layer, c, :, heads].contiguous() for c in range(2))
        cache = torch.zeros(NUM_BLOCKS, key.shape[1], BLOCK, 2 * HEAD_DIM)
        key_cache, value_cache = cache.view(NUM_BLOCKS, key.shape[1], 2 * BLOCK, HEAD_DIM).chunk(
            2, dim=2
        )
        ops.cpu_attn_reshape_and_cache(
            key,
            value,
            key_cache,
            value_cache,
            torch.arange(key.shape[0]),
            "vec",
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        caches[f"model.layers.{layer}.self_attn.attn"] = cache
    return caches


def held_kv(caches: dict[str, torch.Tensor], blocks: list[int]) -> torch.Tensor:
    """What a rank's caches hold in `blocks`, read back as [layers, 2, tokens, heads, dim]."""
    out = []
    for cache in caches.values():
        keys, values = paged_layer_view(cache, "vec")
        out.append(torch.stack([keys[blocks].flatten(0, 1), values[blocks].flatten(0, 1)]))
    return torch.stack(out)


def worker(socket_path, kv: EngineKV, caches) -> WorkerSide:
    side = WorkerSide(ConnectorSettings(socket_path=str(socket_path), key_scheme="sglang"), kv)
    side.register(caches)
    return side


def save_prompt(side: WorkerSide, caches) -> None:
    meta = KVStoreConnectorMetadata(
        saves=[SaveSpec("p", CHAIN, b"", [list(range(NUM_BLOCKS // 2))])]
    )
    side.start_load(meta)
    for name, tensor in caches.items():
        side.save_layer(meta, name, tensor)
    side.finish_save()


def load_prompt(side: WorkerSide, blocks: list[int]) -> None:
    side.start_load(KVStoreConnectorMetadata(loads=[LoadSpec("p", CHAIN, [blocks], 0)]))
    for name in side.kv_caches:
        side.wait_for_layer(name)
    side.finish_load()
    assert side.take_failed_block_ids() == set()


def stored(agent) -> dict[bytes, bytes]:
    from kvstore.block import HEADER_BYTES
    from kvstore.owned import owned_key

    out = {}
    for key, _, tenant in agent.store.inventory():
        with agent.store.open_block(owned_key(tenant, key)) as whole:
            out[bytes(key)] = whole[HEADER_BYTES:].numpy().tobytes()
    return out


@pytest.fixture
def model_dir(tiny_llama_fp32):
    return tiny_llama_fp32


def test_tp2_halves_write_what_tp1_reads_and_a_tp1_writer_stores(tmp_path, model_dir):
    kv = model_kv()
    halves = [slice(0, 1), slice(1, 2)]
    target = list(range(NUM_BLOCKS // 2, NUM_BLOCKS))
    with running_agent(tmp_path, "tp2", **AGENT) as tp2_agent:
        ranks = [
            worker(
                tp2_agent.config.socket_path,
                engine(model_dir, 2, r),
                caches_written_by_vllm(kv, halves[r]),
            )
            for r in range(2)
        ]
        for rank in ranks:
            save_prompt(rank, rank.kv_caches)
        assert [r.stats["saved_blocks"] for r in ranks] == [CHUNKS, CHUNKS]

        reader = worker(
            tp2_agent.config.socket_path,
            engine(model_dir, 1, 0),
            caches_written_by_vllm(torch.zeros_like(kv), slice(0, HEADS)),
        )
        load_prompt(reader, target)
        assert reader.stats["loaded_blocks"] == CHUNKS * HEADS
        assert torch.equal(held_kv(reader.kv_caches, target), kv), "TP=1 holds the model's K/V"
        from_tp2 = stored(tp2_agent)

    with running_agent(tmp_path, "tp1", **AGENT) as tp1_agent:
        writer = worker(
            tp1_agent.config.socket_path,
            engine(model_dir, 1, 0),
            caches_written_by_vllm(kv, slice(0, HEADS)),
        )
        save_prompt(writer, writer.kv_caches)
        assert stored(tp1_agent) == from_tp2, "the same keys and bytes, whoever wrote them"

        for rank, heads in enumerate(halves):  # and the reverse: TP=2 ranks read TP=1's blocks
            side = worker(
                tp1_agent.config.socket_path,
                engine(model_dir, 2, rank),
                caches_written_by_vllm(torch.zeros_like(kv), heads),
            )
            load_prompt(side, target)
            assert torch.equal(held_kv(side.kv_caches, target), kv[:, :, :, heads])
            side.close()
        writer.close()
    for side in (*ranks, reader):
        side.close()


def test_sglang_tp1_reads_the_tp2_halves_vllm_wrote(tmp_path, model_dir):
    from kvstore.bench.sglang import backend_for, host_pool

    kv = model_kv()
    with running_agent(tmp_path, **AGENT) as agent:
        for rank, heads in enumerate((slice(0, 1), slice(1, 2))):
            side = worker(
                agent.config.socket_path,
                engine(model_dir, 2, rank),
                caches_written_by_vllm(kv, heads),
            )
            save_prompt(side, side.kv_caches)
            side.close()
        pool = host_pool(
            "page_first_direct", CHUNKS + 1, LAYERS, HEADS, HEAD_DIM, CHUNK, dtype=torch.float32
        )
        backend = backend_for(
            agent.config.socket_path, pool, model_path=str(model_dir), head_group_size=1
        )
        keys = [k.decode() for k in CHAIN]
        assert backend.batch_exists(keys) == CHUNKS
        indices = torch.arange(CHUNK, (CHUNKS + 1) * CHUNK)
        assert backend.batch_get_v1(keys, indices) == [True] * CHUNKS
        # page_first_direct: [K/V, pages, layers, page tokens, heads, head dim]
        held = pool.kv_buffer[:, 1 : CHUNKS + 1].permute(2, 0, 1, 3, 4, 5).flatten(2, 3)
        assert torch.equal(held, kv)
        backend.close()


def test_a_head_group_size_that_does_not_divide_the_ranks_heads_is_refused(tmp_path, model_dir):
    from kvstore.bench.sglang import backend_for, host_pool
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="head_group_size 2 must divide this rank's 1 kv heads"):
        engine(model_dir, 2, 0, head_group_size=2)
    with pytest.raises(ConfigError, match="key_scheme 'lmcache' unknown"):
        ConnectorSettings.from_extra_config({"key_scheme": "lmcache"})
    with pytest.raises(ConfigError, match="head_group_size must be >= 0"):
        ConnectorSettings.from_extra_config({"head_group_size": -1})
    pool = host_pool("page_first", 4, LAYERS, HEADS, HEAD_DIM, CHUNK, dtype=torch.float32)
    with pytest.raises(ConfigError, match="head_group_size 3 must divide"):
        backend_for(tmp_path / "none.sock", pool, head_group_size=3)
