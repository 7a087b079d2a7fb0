"""Copies between one SGLang host page (every kv-head group of it) and its blocks' payloads,
checksummed in the same pass. Runs in SGLang's scheduler processes (storage threads).

A copy moves a slice of layers of the whole page (about SLICE_BYTES, so it stays in L2 while
every head group's block takes its part; the whole page when it is one block) as one strided
copy per block (kvstore._copyhash:
every byte is loaded once, stored and hashed from the same register): a save hashes what it
wrote into the reserved payload, a load what it wrote into the host page, which is private to
this process, so a page reused under a stale view is a miss, never wrong KV. Strides do the
layouts' work: page_first and page_first_direct, any head groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.codec import decode_layer, encode_layer
from kvstore.connectors.sglang.pages import PageFormat
from kvstore.kvcopy.verified import Hasher

# Measured (2-core Xeon, Llama-3-8B pages): with a block per kv head, slices of one layer of
# a page (256 KiB) copy at 0.61-0.64 x memcpy, whole pages at 0.54-0.55; with one block per
# page, the whole page in one copy is faster (0.89 against 0.86).
SLICE_BYTES = 256 << 10


def _slices(fmt: PageFormat):
    if fmt.groups == 1:
        yield 0, fmt.num_layers
        return
    step = max(1, SLICE_BYTES // (fmt.groups * fmt.layer_bytes))
    for start in range(0, fmt.num_layers, step):
        yield start, min(start + step, fmt.num_layers)


def _blocks(fmt: PageFormat, payload: torch.Tensor) -> np.ndarray:
    """A payload as [layers, components, page tokens, group row bytes]."""
    return payload.numpy().reshape(fmt.num_layers, fmt.components, fmt.page_tokens, -1)


def _group_bytes(fmt: PageFormat, token_index: int, group: int) -> np.ndarray:
    """Head group `group`'s bytes of the page at `token_index`, in payload order: a
    [layers, components, page tokens, group row bytes] view of the pool's memory."""
    return fmt.grouped(token_index)[..., group, :].swapaxes(0, 1)


def save_page(
    fmt: PageFormat, token_index: int, payloads: Sequence[torch.Tensor | None]
) -> list[int | None]:
    """Copy each head group of the host page at `token_index` into its reserved payload (flat
    uint8; None: not reserved, skipped); returns each payload's xxh3-64 (None where skipped)."""
    if fmt.kv_layout is not None and fmt.kv_layout.codec == "fp8":
        return [
            None if p is None else _save_fp8(fmt, token_index, p, g) for g, p in enumerate(payloads)
        ]
    copies = [
        (group, _blocks(fmt, payload), _group_bytes(fmt, token_index, group), Hasher())
        for group, payload in enumerate(payloads)
        if payload is not None
    ]
    for start, stop in _slices(fmt):
        for _, payload, page, hasher in copies:
            hasher.copy(payload[start:stop], page[start:stop])
    checksums: list[int | None] = [None] * len(payloads)
    for group, _, _, hasher in copies:
        checksums[group] = hasher.intdigest()
    return checksums


def load_page(
    fmt: PageFormat, token_index: int, payloads: Sequence[torch.Tensor], checksums: Sequence[int]
) -> bool:
    """Copy the blocks of every head group into the host page at `token_index`: False when a
    copy is not the block that was loaded (its arena page changed meanwhile); the host page
    then holds no usable KV and must be reported a miss. So is a block of another size."""
    if any(p.numel() != fmt.payload_bytes for p in payloads):
        return False
    if fmt.kv_layout is not None and fmt.kv_layout.codec == "fp8":
        return all(
            _load_fp8(fmt, token_index, p, c, g)
            for g, (p, c) in enumerate(zip(payloads, checksums, strict=True))
        )
    copies = [
        (_group_bytes(fmt, token_index, group), _blocks(fmt, payload), Hasher())
        for group, payload in enumerate(payloads)
    ]
    for start, stop in _slices(fmt):
        for page, payload, hasher in copies:
            hasher.copy(page[start:stop], payload[start:stop])
    return all(h.intdigest() == c for (_, _, h), c in zip(copies, checksums, strict=True))


def _typed_layer(fmt: PageFormat, token_index: int, group: int, layer: int) -> list[torch.Tensor]:
    shape = (fmt.page_tokens, fmt.kv_layout.num_kv_heads, fmt.kv_layout.head_dim)
    comps = fmt.page(token_index, group)
    return [torch.from_numpy(comp[layer]).view(fmt.dtype).view(shape) for comp in comps]


def _save_fp8(fmt: PageFormat, token_index: int, payload: torch.Tensor, group: int) -> int:
    """fp8 quantises while it copies; each layer's encoded bytes are hashed while in cache."""
    hasher = Hasher()
    for layer in range(fmt.num_layers):
        start, stop = fmt.kv_layout.layer_range(layer)
        kv = torch.stack(_typed_layer(fmt, token_index, group, layer))
        encode_layer(fmt.kv_layout, kv, payload[start:stop])
        hasher.update(payload[start:stop].numpy())
    return hasher.intdigest()


def _load_fp8(fmt: PageFormat, token_index: int, payload, checksum: int, group: int) -> bool:
    private = torch.empty_like(payload)
    hasher = Hasher()
    hasher.copy(private.numpy(), payload.numpy())
    if hasher.intdigest() != checksum:
        return False
    kv = torch.empty(fmt.kv_layout.layer_shape, dtype=fmt.dtype)
    for layer in range(fmt.num_layers):
        start, stop = fmt.kv_layout.layer_range(layer)
        decode_layer(fmt.kv_layout, private[start:stop], kv)
        targets = _typed_layer(fmt, token_index, group, layer)
        for component, target in zip(kv, targets, strict=True):
            target.copy_(component)
    return True
