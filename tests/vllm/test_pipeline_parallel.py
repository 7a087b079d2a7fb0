"""vLLM pipeline parallelism: each stage stores its layers' blocks under the namespace of its
layer range (vLLM's own split), as SGLang's backend keys a stage's host pool, and the
scheduler looks a chunk up in every stage's namespace. Real vLLM configs of the tiny Llama
(2 layers: one per stage), SGLang's real host pool and factory."""

from __future__ import annotations

import pytest

from kvstore.connectors.vllm.config import ConnectorSettings, engine_kv
from kvstore.keys_sglang import sglang_page_hashes

CHUNK = 64  # SGLang's page size = the connector's chunk_tokens (2 vLLM blocks of 32)


@pytest.fixture(scope="module")
def pp2_config(vllm_inprocess_env, tiny_llama_fp32):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_llama_fp32),
        dtype="float32",
        block_size=32,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
    )
    return args.create_engine_config()


def stage_kv(config, rank: int, key_scheme: str):
    """engine_kv as the worker of global rank `rank` derives it (rank 0: also the scheduler)."""
    config.parallel_config.rank = rank
    try:
        return engine_kv(config, ConnectorSettings(chunk_tokens=CHUNK, key_scheme=key_scheme))
    finally:
        config.parallel_config.rank = 0


@pytest.mark.parametrize("key_scheme", ["vllm", "sglang"])
def test_each_stage_keys_its_own_layers_and_the_scheduler_looks_up_both(pp2_config, key_scheme):
    first, second = stage_kv(pp2_config, 0, key_scheme), stage_kv(pp2_config, 1, key_scheme)
    assert (first.layout.num_layers, second.layout.num_layers) == (1, 1)
    assert first.root != second.root, "equal layer counts must never share a namespace"
    chains = [b"chain-a", b"chain-b"]
    assert first.lookup_blocks_per_chunk == 2
    assert first.lookup_keys(chains) == [
        *first.block_keys(chains[:1]),
        *second.block_keys(chains[:1]),
        *first.block_keys(chains[1:]),
        *second.block_keys(chains[1:]),
    ]


def test_a_stage_shares_blocks_with_sglangs_stage_of_the_same_layers(pp2_config, tiny_llama_fp32):
    """vLLM's second stage (layer 1) keys a page as SGLang's backend over a host pool of layer
    1 does: a prompt one stored is the other's hit, stage by stage."""
    import torch

    from kvstore.bench.sglang import backend_for, host_pool

    stage = stage_kv(pp2_config, 1, "sglang")
    hashes = sglang_page_hashes(list(range(3 * CHUNK)), CHUNK)
    pool = host_pool("page_first_direct", 4, 1, 2, 32, CHUNK, dtype=torch.float32, start_layer=1)
    backend = backend_for("/nonexistent/agent.sock", pool, model_path=str(tiny_llama_fp32))
    try:
        assert backend._store_keys(hashes) == stage.block_keys([h.encode() for h in hashes])
        whole = host_pool("page_first_direct", 4, 2, 2, 32, CHUNK, dtype=torch.float32)
        other = backend_for("/nonexistent/agent.sock", whole, model_path=str(tiny_llama_fp32))
        assert other._store_keys(hashes) != backend._store_keys(hashes)
        other.close()
    finally:
        backend.close()
