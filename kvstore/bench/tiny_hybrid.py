"""Builds random-weight models whose KV cache vLLM splits into groups, with the tiny Llama's
local tokenizer, offline: a Gemma-2 (sliding-window and full-attention layers alternating)
and a Mamba (state-space layers). Runs in the test process; same arguments, same files.
"""

from pathlib import Path

from transformers import Gemma2Config, Gemma2ForCausalLM, MambaConfig, MambaForCausalLM

from kvstore.bench.tiny_llama import MAX_POSITION_EMBEDDINGS, TOKEN_IDS, save_model


def build_tiny_gemma2(
    directory: Path,
    dtype: str = "float32",
    num_layers: int = 4,
    sliding_window_tokens: int = 64,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Write config, safetensors weights and tokenizer files into `directory`; return it.

    Even layers attend over the last `sliding_window_tokens` tokens, odd layers over all of
    them (Gemma-2's pattern); head_dim 32 because vLLM's CPU attention accepts it.
    """
    config = Gemma2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=sliding_window_tokens,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ],
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        **TOKEN_IDS,
        tie_word_embeddings=True,
        dtype=dtype,
    )
    return save_model(directory, Gemma2ForCausalLM, config, dtype, vocab_size, seed)


def build_tiny_mamba(
    directory: Path, num_layers: int = 2, vocab_size: int = 512, seed: int = 0
) -> Path:
    """A float32 Mamba of `num_layers` state-space layers (no attention at all)."""
    config = MambaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        state_size=8,
        num_hidden_layers=num_layers,
        expand=2,
        conv_kernel=4,
        **TOKEN_IDS,
        dtype="float32",
    )
    return save_model(directory, MambaForCausalLM, config, "float32", vocab_size, seed)
