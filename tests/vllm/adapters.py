"""Tiny random LoRA adapters for the tiny Llama, built offline with peft, for the vLLM tests."""

from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_lora(model_dir: Path, directory: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter on the attention projections of the model in `model_dir`, with random
    (non-zero) A and B, so it changes the KV; the same seed gives the same adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:  # peft zeroes B: the adapter would change nothing
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
