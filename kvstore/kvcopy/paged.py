"""An engine's paged KV as the copy engine sees it: per layer, one tensor whose logical shape
is [num_blocks, kv_heads, block_size, 2 * head_dim] (K then V along the last axis, vLLM's
convention) in any physical order, i.e. any strides, as long as the last axis is contiguous.

Pure description, used in the worker (the connectors) and by the GPU check. `kv_views` gives
K and V of every block as strided [num_blocks, block_size, kv_heads, head_dim] views, the
canonical order of a stored payload's blocks, so every physical layout (vLLM's LBHNC, LBNHC,
LHBNC, BLHNC, BLNHC, BHLNC) is copied by the same code: strides do the work, not a code path
per layout. An engine whose K and V have different orders (vLLM's CPU kernels keep K
transposed) gives a (K, V) pair of [num_blocks, block_size, kv_heads, head_dim] views instead
(`PagedLayer`).
"""

from __future__ import annotations

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

PagedLayer = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def kv_views(layer: PagedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every block as [num_blocks, block_size, kv_heads, head_dim] views."""
    if isinstance(layer, tuple):
        return layer
    two_dim = layer.shape[-1]
    kv = layer.unflatten(-1, (2, two_dim // 2)).transpose(1, 2)
    return kv[..., 0, :], kv[..., 1, :]


def check_paged_layer(name: str, layer: PagedLayer, layout: KVLayout, block_size: int) -> None:
    """ConfigError naming what is unsupported about one engine layer, if anything is."""
    if isinstance(layer, tuple):
        _check_pair(name, layer, layout, block_size)
        return
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


def _check_pair(name: str, pair, layout: KVLayout, block_size: int) -> None:
    expected = (block_size, layout.num_kv_heads, layout.head_dim)
    for part, view in zip("KV", pair, strict=True):
        if view.dim() != 4 or tuple(view.shape[1:]) != expected:
            raise ConfigError(
                f"{part} of KV cache {name!r} is {tuple(view.shape)}, not [num_blocks, "
                f"{expected[0]} tokens, {expected[1]} kv heads, {expected[2]}]"
            )
        if view.dtype != layout.torch_dtype:
            raise ConfigError(f"KV cache {name!r} is {view.dtype}; the layout says {layout.dtype}")


def head_slice(layer: PagedLayer, heads: slice) -> PagedLayer:
    """The same paged layer restricted to kv heads `heads` (one head group), as views."""
    if isinstance(layer, tuple):
        return layer[0][:, :, heads], layer[1][:, :, heads]
    return layer[:, heads]
