"""The copy engine: moves one chunk's layer between a payload's layer slice (host memory, the
canonical [2, tokens, kv_heads, head_dim] order, encoded by the layout's codec) and an engine's
paged layer (any device, any strides; see paged.py). A prompt's tail (a block of fewer tokens
than a chunk) goes through the same buffers, with its own layout (KVLayout.with_tokens).

Runs in the worker (the connectors' worker halves) and in `kvstore bench gpu`. One code path
for every device (but the CPU's raw loads, below); only its `Streams` (streams.py) differ: on
the CPU each step runs at once, on CUDA it is queued on the copier's stream. A layer moves
in a constant number of device operations, whatever the number of blocks per chunk: one
indexed gather (`index_select`) or scatter (`index_copy_`) per K and V, over a `BlockIndex`
built once per chunk and step, on views that read the head-dim axis as 8-byte words (a
bitwise copy with 4-8x fewer elements).
- A load stages the page's bytes privately (hashed beside the DMA on CUDA), decodes them in
  place (raw) or into the canonical buffer (fp8), and scatters. On the CPU a raw load skips
  the staging pass: each engine block's K and V go straight from the page into the engine,
  hashed as copied (a transposed K through an L1 tile: kvstore/native/copyhash.c), one
  host copy per run of consecutive engine blocks: half the bytes that staging then
  scattering move.
- A save gathers into the canonical buffer, encodes it into staging (raw: the same bytes),
  and writes staging into the reserved page (hashed as written on the CPU).
Buffers are allocated once per copier and reused: a step allocates nothing per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstore.codec import decode_layer, encode_layer
from kvstore.errors import ConfigError
from kvstore.kvcopy.paged import PagedLayer, kv_views
from kvstore.kvcopy.streams import streams_for
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout


@dataclass(frozen=True)
class BlockIndex:
    """Which engine blocks a stored block's positions fill: `blocks` (on the device) holds the
    engine block of each position in [first, stop) of the stored block. `runs`, for host
    copies: every position of the stored block as (start, stop, first engine block) runs of
    consecutive engine blocks, the first engine block None where a run is not filled."""

    blocks: torch.Tensor
    first: int
    stop: int
    runs: tuple[tuple[int, int, int | None], ...] = ()

    def __len__(self) -> int:
        return self.stop - self.first


class ChunkCopier:
    """Copies chunk layers of one layout for one engine. Not thread-safe: one per thread."""

    def __init__(self, layout: KVLayout, block_size: int, device: torch.device | str) -> None:
        self.layout = layout
        self.block_size = block_size
        self.device = torch.device(device)
        self.streams = streams_for(self.device)
        self._staging = torch.empty(layout.layer_bytes, dtype=torch.uint8, device=self.device)
        self._decoded_flat = torch.empty(
            layout.layer_elements, dtype=layout.torch_dtype, device=self.device
        )

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def block_index(self, blocks: list[int], keep: range | None = None) -> BlockIndex:
        """The index of one stored block's engine `blocks`, filling only positions `keep` (a
        range: the ones past a prefix the engine has, or all). Build it once per step, before
        `after_compute` (on CUDA it is copied to the device on the compute stream)."""
        keep = range(len(blocks)) if keep is None else keep
        if keep.step != 1 or keep.start < 0 or keep.stop > len(blocks):
            raise ValueError(f"positions {keep} are not a run within {len(blocks)} blocks")
        host = torch.tensor([blocks[i] for i in keep], dtype=torch.int64)
        runs = _runs(blocks, keep)
        return BlockIndex(self.streams.index(host), keep.start, keep.stop, runs)

    # ---- loads -----------------------------------------------------------------------------
    def load_layer(
        self,
        page: torch.Tensor,
        hasher: Hasher,
        paged: PagedLayer,
        index: BlockIndex,
        layout: KVLayout | None = None,
    ) -> None:
        """Copy one chunk layer (`page`: its slice of a loaded payload) into the engine blocks
        of `index`, feeding `hasher` with the payload bytes the copy used (compare its digest
        with the block's checksum once every layer of the chunk was copied, and `streams`
        synchronized: a mismatch means the KV written is not the block's and must be
        recomputed). `layout`: a tail's (fewer tokens), else the chunk's."""
        layout = self._checked(layout)
        if self.streams.in_place and layout.codec == "raw":
            self._load_in_place(page, hasher, paged, index, layout)
            return
        staging = self._staging[: layout.layer_bytes]
        with self.streams.submitting():
            self.streams.upload(staging, page, hasher)
            if len(index):
                self._scatter(self._decode(layout, staging), paged, index)

    def _load_in_place(
        self,
        page: torch.Tensor,
        hasher: Hasher,
        paged: PagedLayer,
        index: BlockIndex,
        layout: KVLayout,
    ) -> None:
        """Host memory, raw payloads: K, then V, of each engine block straight from the page,
        hashed as copied (a K kept as [head][dim][token] is transposed on the way: see
        kvstore/native/copyhash.c); positions the engine has already go into staging, so
        the digest still covers every byte of the layer, each byte as it was copied."""
        stored = _items(page, layout.torch_dtype).reshape(layout.layer_shape)
        spare = _items(self._staging[: layout.layer_bytes], layout.torch_dtype)
        spare = spare.reshape(layout.layer_shape)
        for part, view in enumerate(kv_views(paged)):
            engine = _items(view, view.dtype)
            source = stored[part].reshape(-1, self.block_size, *stored.shape[2:])
            unfilled = spare[part].reshape(source.shape)
            for start, stop, block in index.runs:
                target = (
                    unfilled[start:stop] if block is None else engine[block : block + stop - start]
                )
                hasher.copy(target, source[start:stop])

    def _decode(self, layout: KVLayout, staging: torch.Tensor) -> torch.Tensor:
        if layout.codec == "raw":
            return staging.view(layout.torch_dtype).view(layout.layer_shape)
        decoded = self._decoded(layout)
        decode_layer(layout, staging, decoded)
        return decoded

    def _scatter(self, canonical: torch.Tensor, paged: PagedLayer, index: BlockIndex) -> None:
        for part, view in enumerate(kv_views(paged)):
            source = self._by_block(canonical[part])[index.first : index.stop]
            target, source = _as_words(view, source)
            target.index_copy_(0, index.blocks, source)

    # ---- saves -----------------------------------------------------------------------------
    def save_layer(
        self,
        paged: PagedLayer,
        index: BlockIndex,
        page: torch.Tensor,
        hasher: Hasher | None,
        layout: KVLayout | None = None,
    ) -> None:
        """Copy the engine blocks of `index` (every position of a stored block) into one chunk
        layer's slice `page` of a reserved payload, encoded, feeding `hasher` with the bytes
        written where the streams hash saves (on CUDA the agent hashes them at commit).
        `layout`: a tail's, else the chunk's."""
        layout = self._checked(layout)
        if index.first != 0 or len(index) * self.block_size != layout.chunk_tokens:
            raise ValueError(f"a save fills every position of its block, not {index.first}..")
        staging = self._staging[: layout.layer_bytes]
        with self.streams.submitting():
            canonical = self._canonical_for(layout, staging)
            self._gather(paged, index, canonical)
            if layout.codec != "raw":
                encode_layer(layout, canonical, staging)
            self.streams.download(page, staging, hasher)

    def _canonical_for(self, layout: KVLayout, staging: torch.Tensor) -> torch.Tensor:
        """Where a save gathers: staging itself for raw payloads, else the decoded buffer."""
        if layout.codec == "raw":
            return staging.view(layout.torch_dtype).view(layout.layer_shape)
        return self._decoded(layout)

    def _gather(self, paged: PagedLayer, index: BlockIndex, canonical: torch.Tensor) -> None:
        for part, view in enumerate(kv_views(paged)):
            source, target = _as_words(view, self._by_block(canonical[part]))
            torch.index_select(source, 0, index.blocks, out=target)

    # ---- shared ----------------------------------------------------------------------------
    def _checked(self, layout: KVLayout | None) -> KVLayout:
        if layout is None:
            return self.layout
        if layout.with_tokens(self.layout.chunk_tokens) != self.layout:
            raise ConfigError(f"layout {layout.layout_id} is not a tail of {self.layout.layout_id}")
        return layout

    def _decoded(self, layout: KVLayout) -> torch.Tensor:
        return self._decoded_flat[: layout.layer_elements].view(layout.layer_shape)

    def _by_block(self, part: torch.Tensor) -> torch.Tensor:
        """One of K or V, [tokens, kv_heads, head_dim], as [blocks, block_size, ...] (a view)."""
        return part.unflatten(0, (-1, self.block_size))

    # ---- ordering with the compute stream (streams.py) -----------------------------------
    def record(self, layer: int) -> None:
        """Mark the end of the work submitted so far for `layer`."""
        self.streams.record(layer)

    def wait(self, layer: int) -> None:
        """Make the current (compute) stream wait for `layer`'s copies, without a host sync."""
        self.streams.wait(layer)

    def after_compute(self) -> None:
        """Order later copies after the compute stream's work so far (before a save reads a
        layer the forward just wrote, or a load writes blocks the forward may have zeroed)."""
        self.streams.after_compute()

    def synchronize(self) -> None:
        """Block until every submitted copy and hash is done (before verifying or committing)."""
        self.streams.synchronize()


def _runs(blocks: list[int], keep: range) -> tuple[tuple[int, int, int | None], ...]:
    """Positions 0..len(blocks) as (start, stop, first engine block) runs: consecutive engine
    blocks within `keep` make one run (one host copy), positions outside it runs of None."""
    runs = [(0, keep.start, None)] if keep.start else []
    for position in keep:
        start, stop, block = runs[-1] if runs else (0, 0, None)
        if block is not None and stop == position and blocks[position] == block + stop - start:
            runs[-1] = (start, position + 1, block)
        else:
            runs.append((position, position + 1, blocks[position]))
    if keep.stop < len(blocks):
        runs.append((keep.stop, len(blocks), None))
    return tuple(runs)


_WORDS = (torch.int64, torch.int32, torch.int16)
_ITEMS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}
_ITEMS[8] = (torch.int64, np.int64)


def _items(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A host tensor's items of `dtype` (a flat uint8 one's: its bytes read as `dtype`) as a
    numpy array of integers of their size, sharing its memory: what Hasher.copy takes, for
    any dtype (numpy has no bfloat16) and any strides."""
    torch_items, numpy_items = _ITEMS[dtype.itemsize]
    if tensor.dtype == torch.uint8:
        return tensor.numpy().view(numpy_items)
    return tensor.view(torch_items).numpy()


def _as_words(*views: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`views` (of one dtype) with their contiguous last axis read as the widest integers
    that every view's sizes, strides and offset allow: the same bytes, fewer elements for an
    indexed copy to move. Unchanged where a last axis is strided (vLLM's CPU kernels keep K
    transposed)."""
    item = views[0].element_size()
    for word in _WORDS:
        wider = word.itemsize > item
        if wider and all(_fits(view, word.itemsize // item) for view in views):
            return tuple(view.view(word) for view in views)
    return views


def _fits(view: torch.Tensor, ratio: int) -> bool:
    """Whether `view` can be read in words of `ratio` of its elements."""
    if view.stride(-1) != 1 or view.shape[-1] % ratio or view.storage_offset() % ratio:
        return False
    return all(stride % ratio == 0 for stride in view.stride()[:-1])
