"""Copies between one SGLang host page (every kv-head group of it) and its blocks' payloads,
checksummed in the same pass. Runs in SGLang's scheduler processes (storage threads).

Every copy moves a slice of layers of the whole page (about SLICE_BYTES, so it stays in L2)
and hashes each block's bytes right after they were written, in payload order: a save
hashes the reserved payload, a load the private copy that will be used (the host page
itself, or a scratch slice when the page's bytes of a block are not contiguous), so a page
reused under a stale view is a miss, never wrong KV. numpy views throughout: one numpy call
costs about a microsecond, one torch slice several.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from connectors.sglang.pages import PageFormat
from kvstore.block import payload_checksum
from kvstore.codec import decode_layer, encode_layer

# Measured (2-core Xeon, Llama-3-8B pages, CPU time): slices of 256 KiB (one layer of a page)
# copy and hash at 0.8 × memcpy; 512 KiB at 0.75, 1 MiB at 0.7 (the hash reads them back
# from further away). One numpy call costs about a microsecond: smaller slices cost more.
SLICE_BYTES = 256 << 10


def _slices(fmt: PageFormat):
    step = max(1, SLICE_BYTES // (fmt.groups * fmt.layer_bytes))
    for start in range(0, fmt.num_layers, step):
        yield start, min(start + step, fmt.num_layers)


def _blocks(fmt: PageFormat, payload: torch.Tensor) -> np.ndarray:
    """A payload as [layers, components, page tokens, group row bytes]."""
    return payload.numpy().reshape(fmt.num_layers, fmt.components, fmt.page_tokens, -1)


def save_page(
    fmt: PageFormat, token_index: int, payloads: Sequence[torch.Tensor | None]
) -> list[int | None]:
    """Copy each head group of the host page at `token_index` into its reserved payload (flat
    uint8; None: not reserved, skipped); returns each payload's xxh3-64 (None where skipped).
    The page is read once, in slices of layers: each group's bytes of a slice go out while
    the slice is in cache, and each payload slice is hashed while it is."""
    if fmt.kv_layout is not None and fmt.kv_layout.codec == "fp8":
        return [None if p is None else _save_fp8(fmt, token_index, p, g)
                for g, p in enumerate(payloads)]  # fmt: skip
    page = fmt.grouped(token_index)  # [components, layers, tokens, groups, group row]
    outs = [None if p is None else _blocks(fmt, p) for p in payloads]
    hashers = [None if p is None else xxhash.xxh3_64() for p in payloads]
    for start, stop in _slices(fmt):
        source = page[:, start:stop].transpose(1, 0, 2, 3, 4)  # [layers, comps, tokens, ...]
        for group, (out, hasher) in enumerate(zip(outs, hashers, strict=True)):
            if out is not None:
                np.copyto(out[start:stop], source[..., group, :])
                hasher.update(out[start:stop])
    return [None if h is None else h.intdigest() for h in hashers]


def load_page(
    fmt: PageFormat, token_index: int, payloads: Sequence[torch.Tensor], checksums: Sequence[int]
) -> bool:
    """Copy the blocks of every head group into the host page at `token_index`: False when a
    copy is not the block that was loaded (its arena page changed meanwhile); the host page
    then holds no usable KV and must be reported a miss. So is a block of another size."""
    if any(p.numel() != fmt.payload_bytes for p in payloads):
        return False
    if fmt.kv_layout is not None and fmt.kv_layout.codec == "fp8":
        return all(_load_fp8(fmt, token_index, p, c, g)
                   for g, (p, c) in enumerate(zip(payloads, checksums, strict=True)))  # fmt: skip
    sources = [_blocks(fmt, p) for p in payloads]
    hashers = [xxhash.xxh3_64() for _ in payloads]
    page = fmt.grouped(token_index)
    if fmt.groups == 1 and fmt.layout == "page_first_direct":
        _load_in_place(fmt, page[..., 0, :], sources[0], hashers[0])
    else:
        _load_through_scratch(fmt, page, sources, hashers)
    return all(h.intdigest() == c for h, c in zip(hashers, checksums, strict=True))


def _load_in_place(fmt: PageFormat, page: np.ndarray, source: np.ndarray, hasher) -> None:
    """One block whose every (layer, component) is a contiguous run of the host page: copy
    into the page and hash the page's own bytes, which are private to this process."""
    for start, stop in _slices(fmt):
        np.copyto(page[:, start:stop], source[start:stop].transpose(1, 0, 2, 3))
        for layer in range(start, stop):
            for component in range(fmt.components):
                hasher.update(page[component, layer])


def _load_through_scratch(fmt: PageFormat, page: np.ndarray, sources, hashers) -> None:
    """Blocks whose bytes interleave in the host page (head groups, or page_first's token-
    major pages): each block's slice is copied into a private scratch and hashed there, then
    the slice of the whole page is written from the scratch, still in cache."""
    layers = next(_slices(fmt))[1]
    scratch = np.empty((fmt.groups, layers, fmt.components, fmt.page_tokens,
                        fmt.group_row_bytes), np.uint8)  # fmt: skip
    for start, stop in _slices(fmt):
        private = scratch[:, : stop - start]
        for group, (source, hasher) in enumerate(zip(sources, hashers, strict=True)):
            np.copyto(private[group], source[start:stop])
            hasher.update(private[group])
        np.copyto(page[:, start:stop], private.transpose(2, 1, 3, 0, 4))


def _typed_layer(fmt: PageFormat, token_index: int, group: int, layer: int) -> list[torch.Tensor]:
    shape = (fmt.page_tokens, fmt.kv_layout.num_kv_heads, fmt.kv_layout.head_dim)
    comps = fmt.page(token_index, group)
    return [torch.from_numpy(comp[layer]).view(fmt.dtype).view(shape) for comp in comps]


def _save_fp8(fmt: PageFormat, token_index: int, payload: torch.Tensor, group: int) -> int:
    """fp8 quantises while it copies, so the checksum is a second pass over the payload."""
    for layer in range(fmt.num_layers):
        start, stop = fmt.kv_layout.layer_range(layer)
        kv = torch.stack(_typed_layer(fmt, token_index, group, layer))
        encode_layer(fmt.kv_layout, kv, payload[start:stop])
    return payload_checksum(payload)


def _load_fp8(fmt: PageFormat, token_index: int, payload, checksum: int, group: int) -> bool:
    private = payload.clone()
    if payload_checksum(private) != checksum:
        return False
    kv = torch.empty(fmt.kv_layout.layer_shape, dtype=fmt.dtype)
    for layer in range(fmt.num_layers):
        start, stop = fmt.kv_layout.layer_range(layer)
        decode_layer(fmt.kv_layout, private[start:stop], kv)
        targets = _typed_layer(fmt, token_index, group, layer)
        for component, target in zip(kv, targets, strict=True):
            target.copy_(component)
    return True
