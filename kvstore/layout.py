"""KV layout: the shape of one block's keys and values, and where each layer sits in its payload.

Pure description, used by every process. The payload is layer-major: layer i is the contiguous
slice [i * layer_bytes, (i+1) * layer_bytes), so a worker can load layer by layer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch

from kvstore.errors import ConfigError
from kvstore.keys import DEFAULT_CHUNK_TOKENS

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
CODEC_NAMES = ("raw", "fp8")


@dataclass(frozen=True)
class KVLayout:
    """KV of one chunk: per layer a [2 (K, V), chunk_tokens, num_kv_heads, head_dim] tensor."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    codec: str = "raw"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"KVLayout.{field} must be positive, got {getattr(self, field)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"KVLayout.dtype {self.dtype!r} unsupported; use {list(DTYPES)}")
        if self.codec not in CODEC_NAMES:
            raise ConfigError(f"KVLayout.codec {self.codec!r} unknown; use one of {CODEC_NAMES}")

    def with_tokens(self, tokens: int) -> KVLayout:
        """This layout for a block of `tokens` tokens (a prompt's tail: fewer than a chunk)."""
        return self if tokens == self.chunk_tokens else replace(self, chunk_tokens=tokens)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's KV as the engine side sees it (before encoding)."""
        return (2, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    @property
    def layer_elements(self) -> int:
        return 2 * self.chunk_tokens * self.num_kv_heads * self.head_dim

    @property
    def layer_bytes(self) -> int:
        """Encoded bytes of one layer: raw is elements × itemsize; fp8 is 1 byte each + scales."""
        if self.codec == "fp8":
            return self.layer_elements + self.fp8_scale_bytes
        return self.layer_elements * self.torch_dtype.itemsize

    @property
    def fp8_scale_bytes(self) -> int:
        """fp8 keeps one float32 scale per (K/V, head) at the start of each layer slice."""
        return 2 * self.num_kv_heads * 4

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_range(self, layer: int) -> tuple[int, int]:
        """Byte range [start, stop) of one layer inside the payload."""
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer {layer} outside [0, {self.num_layers})")
        return layer * self.layer_bytes, (layer + 1) * self.layer_bytes

    @property
    def layout_id(self) -> str:
        """A stable name of every field, for namespaces and block headers."""
        return (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{self.dtype}"
            f"-T{self.chunk_tokens}-{self.codec}"
        )

    @property
    def layout_hash(self) -> int:
        """64-bit digest of `layout_id`, stored in every block header."""
        digest = hashlib.blake2b(self.layout_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")
