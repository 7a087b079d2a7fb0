"""Builds random-weight models whose KV cache vLLM splits into groups, with the tiny Llama's
local tokenizer, offline: a Gemma-2 (sliding-window and full-attention layers alternating)
and a Mamba (state-space layers). Runs in the test process; same arguments, same files.
"""

from pathlib import Path

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, MambaConfig, MambaForCausalLM

from kvstore.bench.tiny_llama import (
    BOS_ID,
    EOS_ID,
    MAX_POSITION_EMBEDDINGS,
    PAD_ID,
    _train_tokenizer,
)


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
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
        dtype=dtype,
    )
    return _save(directory, Gemma2ForCausalLM, config, dtype, vocab_size, seed)


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
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )
    return _save(directory, MambaForCausalLM, config, "float32", vocab_size, seed)


def _save(directory: Path, model_class, config, dtype: str, vocab_size: int, seed: int) -> Path:
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype)).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    _train_tokenizer(vocab_size, seed).save_pretrained(directory)
    return directory
