"""Between SGLang host-pool pages and kvstore payloads: the page format of a host pool, and
copies that checksum in the same pass. Runs in SGLang's scheduler processes (storage threads).

A payload is kvstore's canonical layer-major block of one kv-head group: per layer, each
component's [page_size tokens, row] bytes (MHA: K then V, row = the group's heads × head_dim;
MLA: one latent row, one group). It does not depend on the pool's layout, so page_first and
page_first_direct pools share blocks, and so do vLLM's connector and other TP sizes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvstore.block import payload_checksum
from kvstore.codec import decode_layer, encode_layer
from kvstore.errors import ConfigError
from kvstore.layout import DTYPES, KVLayout

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct")
SLICE_BYTES = 256 << 10  # copy and hash about this much at a time: it stays in cache


@dataclass(frozen=True)
class PageFormat:
    """How one host pool's pages map to payloads. `buffer` is the pool's whole KV buffer as
    bytes, shaped [components, tokens or pages, ...]; views of it are the pool's own memory."""

    mla: bool
    layout: str  # the pool's layout, one of SUPPORTED_LAYOUTS
    page_tokens: int
    num_layers: int
    row_bytes: int  # bytes of one token of one layer of one component (all the pool's heads)
    dtype: torch.dtype
    kv_layout: KVLayout | None  # one group's block, MHA with a dtype kvstore's codecs know
    buffer: np.ndarray
    groups: int = 1  # kv-head groups of the pool's heads, one block each

    @property
    def group_row_bytes(self) -> int:
        return self.row_bytes // self.groups

    @property
    def components(self) -> int:
        return 1 if self.mla else 2

    @property
    def layer_bytes(self) -> int:
        return self.components * self.page_tokens * self.group_row_bytes

    @property
    def payload_bytes(self) -> int:
        if self.kv_layout is not None:
            return self.kv_layout.payload_bytes
        return self.num_layers * self.layer_bytes

    @property
    def layout_id(self) -> str:
        if self.kv_layout is not None:
            return self.kv_layout.layout_id
        kind = "mla" if self.mla else "mha"
        return (
            f"{kind}-L{self.num_layers}-R{self.group_row_bytes}-"
            f"{str(self.dtype).removeprefix('torch.')}"
            f"-T{self.page_tokens}-raw"
        )

    @property
    def layout_hash(self) -> int:
        digest = hashlib.blake2b(self.layout_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def page(self, token_index: int, group: int | None = None) -> list[np.ndarray]:
        """One [layers, page_tokens, row bytes] view per component of the page at
        `token_index`: every head, or only head group `group`'s bytes of each row."""
        if self.layout == "page_first_direct":
            page = token_index // self.page_tokens
            views = [self.buffer[c, page] for c in range(self.components)]
        else:
            stop = token_index + self.page_tokens
            views = [self.buffer[c, token_index:stop].transpose(1, 0, 2)
                     for c in range(self.components)]  # fmt: skip
        if group is None:
            return views
        width = self.group_row_bytes
        return [view[..., group * width : (group + 1) * width] for view in views]


def page_format(pool, mla: bool, codec: str, group_heads: int = 0) -> PageFormat:
    """The format of a real SGLang host pool (MHATokenToKVPoolHost / MLATokenToKVPoolHost),
    its heads stored in blocks of `group_heads` (0: all of them); ConfigError, naming what is
    supported, for anything else."""
    layout = getattr(pool, "layout", None)
    if layout not in SUPPORTED_LAYOUTS:
        raise ConfigError(
            "the kvstore HiCache backend supports --hicache-mem-layout "
            f"{' or '.join(SUPPORTED_LAYOUTS)}, not {layout!r}"
        )
    kv = pool.kv_buffer
    layers, tokens, dtype = pool.layer_num, pool.page_size, pool.dtype
    if mla:
        row = pool.kv_cache_dim * dtype.itemsize
        shape = (1, kv.shape[0], layers, row) if layout == "page_first" else (
            1, kv.shape[0], layers, tokens, row)  # fmt: skip
        kv_layout, groups = None, 1
    else:
        if pool.head_dim != pool.v_head_dim:
            raise ConfigError("the kvstore HiCache backend needs equal K and V head dims")
        row = pool.head_num * pool.head_dim * dtype.itemsize
        shape = (2, kv.shape[1], layers, row) if layout == "page_first" else (
            2, kv.shape[1], layers, tokens, row)  # fmt: skip
        groups = pool.head_num // (group_heads or pool.head_num)
        kv_layout = _kv_layout(pool, codec, pool.head_num // groups)
    if codec != "raw" and kv_layout is None:
        raise ConfigError(f"codec {codec!r} needs an MHA pool of {list(DTYPES)}; use codec raw")
    if not kv.is_contiguous() or kv.numel() * dtype.itemsize != int(np.prod(shape)):
        raise ConfigError(f"host pool buffer {tuple(kv.shape)} is not a plain {layout} pool")
    buffer = kv.view(torch.uint8).numpy().reshape(shape)
    return PageFormat(mla, layout, tokens, layers, row, dtype, kv_layout, buffer, groups)


def _kv_layout(pool, codec: str, heads: int) -> KVLayout | None:
    name = str(pool.dtype).removeprefix("torch.")
    if name not in DTYPES:
        return None
    return KVLayout(pool.layer_num, heads, pool.head_dim, name, pool.page_size, codec)


def _layer_groups(fmt: PageFormat):
    step = max(1, SLICE_BYTES // fmt.layer_bytes)
    for start in range(0, fmt.num_layers, step):
        yield start, min(start + step, fmt.num_layers)


def save_page(fmt: PageFormat, token_index: int, payload: torch.Tensor, group: int = 0) -> int:
    """Copy head group `group` of one host page into a reserved payload (flat uint8); returns
    the payload's xxh3-64, hashed slice by slice right after each slice is written."""
    comps = fmt.page(token_index, group)
    if fmt.kv_layout is not None and fmt.kv_layout.codec == "fp8":
        return _save_fp8(fmt, comps, payload)
    shape = (fmt.num_layers, fmt.components, fmt.page_tokens, fmt.group_row_bytes)
    out = payload.numpy().reshape(shape)
    hasher = xxhash.xxh3_64()
    for start, stop in _layer_groups(fmt):
        for c, comp in enumerate(comps):
            np.copyto(out[start:stop, c], comp[start:stop])
        hasher.update(out[start:stop])
    return hasher.intdigest()


def load_page(
    fmt: PageFormat, payload: torch.Tensor, checksum: int, token_index: int, group: int = 0
) -> bool:
    """Copy a loaded payload into head group `group` of one host page through a private
    slice, hashing the slice: False when the bytes are not the block that was loaded (the
    page is then a miss)."""
    comps = fmt.page(token_index, group)
    if fmt.kv_layout is not None and fmt.kv_layout.codec == "fp8":
        return _load_fp8(fmt, payload, checksum, comps)
    source = payload.numpy().reshape(fmt.num_layers, -1)
    layers = max(1, SLICE_BYTES // fmt.layer_bytes)
    scratch = np.empty((layers, fmt.components, fmt.page_tokens, fmt.group_row_bytes), np.uint8)
    hasher = xxhash.xxh3_64()
    for start, stop in _layer_groups(fmt):
        private = scratch[: stop - start]
        np.copyto(private.reshape(stop - start, -1), source[start:stop])
        hasher.update(private)
        for c, comp in enumerate(comps):
            np.copyto(comp[start:stop], private[:, c])
    return hasher.intdigest() == checksum


def _typed_layer(fmt: PageFormat, comps: list[np.ndarray], layer: int) -> list[torch.Tensor]:
    shape = (fmt.page_tokens, fmt.kv_layout.num_kv_heads, fmt.kv_layout.head_dim)
    return [torch.from_numpy(comp[layer]).view(fmt.dtype).view(shape) for comp in comps]


def _save_fp8(fmt: PageFormat, comps: list[np.ndarray], payload: torch.Tensor) -> int:
    """fp8 quantises while it copies, so the checksum is a second pass over the payload."""
    for layer in range(fmt.num_layers):
        start, stop = fmt.kv_layout.layer_range(layer)
        encode_layer(
            fmt.kv_layout, torch.stack(_typed_layer(fmt, comps, layer)), payload[start:stop]
        )
    return payload_checksum(payload)


def _load_fp8(fmt: PageFormat, payload: torch.Tensor, checksum: int, comps) -> bool:
    private = payload.clone()
    if payload_checksum(private) != checksum:
        return False
    kv = torch.empty(fmt.kv_layout.layer_shape, dtype=fmt.dtype)
    for layer in range(fmt.num_layers):
        start, stop = fmt.kv_layout.layer_range(layer)
        decode_layer(fmt.kv_layout, private[start:stop], kv)
        for component, target in zip(kv, _typed_layer(fmt, comps, layer), strict=True):
            target.copy_(component)
    return True
