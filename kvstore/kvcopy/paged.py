"""An engine's paged KV as the copy engine sees it: per layer, one tensor whose logical shape
is [num_blocks, kv_heads, block_size, 2 * head_dim] (K then V along the last axis, vLLM's
convention) in any physical order, i.e. any strides, as long as the last axis is contiguous.

Pure description, used in the worker (the connectors) and by the GPU check. `block_view`
gives each block as a strided [2, block_size, kv_heads, head_dim] view, the canonical order of
a stored payload, so every physical layout (vLLM's LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC)
is copied by the same code: strides do the work, not a code path per layout.
"""

from __future__ import annotations

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout


def check_paged_layer(name: str, layer: torch.Tensor, layout: KVLayout, block_size: int) -> None:
    """ConfigError naming what is unsupported about one engine layer, if anything is."""
    expected = (layout.num_kv_heads, block_size, 2 * layout.head_dim)
    if layer.dim() != 4 or tuple(layer.shape[1:]) != expected:
        raise ConfigError(
            f"KV cache {name!r} has shape {tuple(layer.shape)}; kvstore copies "
            f"[num_blocks, {expected[0]} kv heads, {expected[1]} tokens, {expected[2]} (K|V)] "
            "layers (vLLM's logical per-layer view)"
        )
    if layer.dtype != layout.torch_dtype:
        raise ConfigError(
            f"KV cache {name!r} is {layer.dtype}; the store's layout says {layout.torch_dtype} "
            "(set the connector's codec, or use the engine's KV dtype)"
        )
    if layer.stride(-1) != 1:
        raise ConfigError(
            f"KV cache {name!r} has strides {layer.stride()}: its head-dim axis is not "
            "contiguous, a layout kvstore does not copy"
        )


def block_view(layer: torch.Tensor, block: int) -> torch.Tensor:
    """Block `block` of a paged layer as a [2, block_size, kv_heads, head_dim] view."""
    two_dim = layer.shape[-1]
    return layer[block].unflatten(-1, (2, two_dim // 2)).permute(2, 1, 0, 3)


def blocks_view(layer: torch.Tensor) -> torch.Tensor:
    """Every block as [num_blocks, 2, block_size, kv_heads, head_dim] (a view)."""
    two_dim = layer.shape[-1]
    return layer.unflatten(-1, (2, two_dim // 2)).permute(0, 3, 2, 1, 4)
