"""Codecs: how one layer's KV tensor becomes payload bytes and back.

Pure functions on torch tensors, run by the worker that copies KV in or out of the engine.
`raw` stores the engine's dtype unchanged; `fp8` stores float8_e4m3fn with one float32 scale per
(K/V, head) per layer: about half the bytes of bf16.
"""

from __future__ import annotations

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
CODEC_IDS = {"raw": 0, "fp8": 1}


def _check_layer(layout: KVLayout, kv: torch.Tensor) -> None:
    if tuple(kv.shape) != layout.layer_shape:
        raise ConfigError(f"layer KV shape {tuple(kv.shape)} != layout {layout.layer_shape}")
    if kv.dtype != layout.torch_dtype:
        raise ConfigError(f"layer KV dtype {kv.dtype} != layout dtype {layout.dtype}")


def _check_slice(layout: KVLayout, data: torch.Tensor) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != layout.layer_bytes:
        raise ConfigError(
            f"layer slice must be 1-D uint8 of {layout.layer_bytes} bytes, "
            f"got {data.dtype} {tuple(data.shape)}"
        )


def encode_layer(layout: KVLayout, kv: torch.Tensor, out: torch.Tensor) -> None:
    """Write one layer's KV (shape `layout.layer_shape`, dtype `layout.dtype`) to `out`.

    `out` is a 1-D uint8 slice of `layout.layer_bytes` on the same device as `kv`.
    """
    _check_layer(layout, kv)
    _check_slice(layout, out)
    if layout.codec == "raw":
        out.copy_(kv.contiguous().view(-1).view(torch.uint8))
        return
    scale_bytes = layout.fp8_scale_bytes
    amax = kv.abs().amax(dim=(1, 3)).float()  # [2, heads]
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    out[:scale_bytes].copy_(scales.contiguous().view(-1).view(torch.uint8))
    quantized = (kv.float() / scales[:, None, :, None]).to(FP8_DTYPE)
    out[scale_bytes:].copy_(quantized.contiguous().view(-1).view(torch.uint8))


def decode_layer(layout: KVLayout, data: torch.Tensor, out: torch.Tensor) -> None:
    """Fill `out` (shape `layout.layer_shape`, `layout.dtype`) from one encoded layer slice."""
    _check_layer(layout, out)
    _check_slice(layout, data)
    if layout.codec == "raw":
        out.copy_(data.view(layout.torch_dtype).view(layout.layer_shape))
        return
    scale_bytes = layout.fp8_scale_bytes
    scales = data[:scale_bytes].clone().view(torch.float32).view(2, layout.num_kv_heads)
    quantized = data[scale_bytes:].view(FP8_DTYPE).view(layout.layer_shape)
    out.copy_(quantized.float() * scales[:, None, :, None])


def encode_block(layout: KVLayout, layers: list[torch.Tensor], payload: torch.Tensor) -> None:
    """Encode every layer of one chunk into a payload of `layout.payload_bytes`."""
    if len(layers) != layout.num_layers:
        raise ConfigError(f"expected {layout.num_layers} layers, got {len(layers)}")
    for index, kv in enumerate(layers):
        start, stop = layout.layer_range(index)
        encode_layer(layout, kv, payload[start:stop])


def decode_block(layout: KVLayout, payload: torch.Tensor) -> list[torch.Tensor]:
    """Decode a whole payload into freshly allocated per-layer tensors."""
    layers = []
    for index in range(layout.num_layers):
        start, stop = layout.layer_range(index)
        out = torch.empty(layout.layer_shape, dtype=layout.torch_dtype, device=payload.device)
        decode_layer(layout, payload[start:stop], out)
        layers.append(out)
    return layers
