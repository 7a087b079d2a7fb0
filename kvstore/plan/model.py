"""The model a plan is for: read from a Hugging Face `config.json` or a named preset; what one
token's KV costs in bytes (dtype, codec, TP) and its prefill in FLOPs. Runs in `kvstore plan`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvstore.block import HEADER_BYTES
from kvstore.errors import ConfigError
from kvstore.layout import CODEC_NAMES, DTYPES, KVLayout

REQUIRED_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)

# Public Hugging Face config.json values of meta-llama/Meta-Llama-3-{8B,70B}.
PRESETS: dict[str, dict] = {
    "llama-3-8b": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
    "llama-3-70b": {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"

    def layout(self, codec: str, tp_size: int, chunk_tokens: int) -> KVLayout:
        """One TP rank's KV layout: kv heads split across ranks (replicated when fewer)."""
        if codec not in CODEC_NAMES:
            raise ConfigError(f"codec {codec!r} unknown; use one of {CODEC_NAMES}")
        if tp_size < 1:
            raise ConfigError(f"tp size must be at least 1, got {tp_size}")
        heads = max(1, self.num_kv_heads // tp_size)
        return KVLayout(self.num_layers, heads, self.head_dim, self.dtype, chunk_tokens, codec)

    def block_bytes(self, codec: str, tp_size: int, chunk_tokens: int) -> int:
        """Bytes one chunk of every TP rank occupies in a node's tiers (payloads and headers)."""
        layout = self.layout(codec, tp_size, chunk_tokens)
        return tp_size * (layout.payload_bytes + HEADER_BYTES)

    def kv_bytes_per_token(self, codec: str, tp_size: int) -> float:
        """KV bytes of one token over all TP ranks (payload only)."""
        return tp_size * self.layout(codec, tp_size, 512).payload_bytes / 512

    @property
    def linear_flops_per_token(self) -> float:
        """Matmul FLOPs of one prompt token outside attention's token-pair term."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return 2.0 * self.num_layers * (attention + mlp)

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs per (query token, context token) pair: QK^T and AV over every head and layer."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim


def load_model(source: str) -> ModelSpec:
    """A preset name or the path of a config.json; ConfigError names a missing or bad field."""
    if source in PRESETS:
        return model_from_config(PRESETS[source], source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(
            f"--model {source!r}: neither a preset ({', '.join(PRESETS)}) nor a config.json file"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a JSON model config ({exc})") from None
    return model_from_config(config, str(path))


def model_from_config(config: dict, where: str) -> ModelSpec:
    config = config.get("text_config", config)  # multimodal configs nest the language model
    for field in REQUIRED_FIELDS:
        value = config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: field {field!r} must be a positive integer, got {value!r}")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in DTYPES:
        raise ConfigError(f"{where}: field 'torch_dtype' {dtype!r} unsupported; use {list(DTYPES)}")
    return ModelSpec(
        where,
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        int(head_dim),
        config["intermediate_size"],
        config["vocab_size"],
        dtype,
    )
