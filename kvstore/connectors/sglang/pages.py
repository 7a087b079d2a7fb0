"""Between SGLang host-pool pages and kvstore payloads: the page format of a host pool and its
views of a page (the copies are in copies.py). Runs in SGLang's scheduler processes.

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

from kvstore.errors import ConfigError
from kvstore.layout import DTYPES, KVLayout

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct")
# The host pools whose pages are wholly in kv_buffer. Not their subclasses: the MXFP8 pool
# keeps each page's scales in buffers of its own (SGLang refuses it L3 pages too).
SUPPORTED_POOLS = (
    "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost",
    "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost",
)


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
            views = [
                self.buffer[c, token_index:stop].transpose(1, 0, 2) for c in range(self.components)
            ]
        if group is None:
            return views
        width = self.group_row_bytes
        return [view[..., group * width : (group + 1) * width] for view in views]

    def grouped(self, token_index: int) -> np.ndarray:
        """The page at `token_index` as one [components, layers, page_tokens, groups, group
        row bytes] view of the pool's memory."""
        if self.layout == "page_first_direct":
            page = self.buffer[:, token_index // self.page_tokens]
        else:
            page = self.buffer[:, token_index : token_index + self.page_tokens].swapaxes(1, 2)
        shape = (*page.shape[:-1], self.groups, self.group_row_bytes)
        return np.reshape(page, shape, copy=False)  # a view: it raises rather than copy


def page_format(pool, mla: bool, codec: str, group_heads: int = 0) -> PageFormat:
    """The format of a real SGLang host pool (MHATokenToKVPoolHost / MLATokenToKVPoolHost),
    its heads stored in blocks of `group_heads` (0: all of them); ConfigError, naming what is
    supported, for anything else."""
    kind = type(pool)
    if f"{kind.__module__}.{kind.__qualname__}" not in SUPPORTED_POOLS:
        names = " or ".join(name.rpartition(".")[2] for name in SUPPORTED_POOLS)
        raise ConfigError(
            f"the kvstore HiCache backend stores the pages of {names}, not {kind.__name__} "
            "(whose pages hold more than its kv_buffer, or are laid out otherwise)"
        )
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
        shape = (
            (1, kv.shape[0], layers, row)
            if layout == "page_first"
            else (1, kv.shape[0], layers, tokens, row)
        )
        kv_layout, groups = None, 1
    else:
        if pool.head_dim != pool.v_head_dim:
            raise ConfigError("the kvstore HiCache backend needs equal K and V head dims")
        row = pool.head_num * pool.head_dim * dtype.itemsize
        shape = (
            (2, kv.shape[1], layers, row)
            if layout == "page_first"
            else (2, kv.shape[1], layers, tokens, row)
        )
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
