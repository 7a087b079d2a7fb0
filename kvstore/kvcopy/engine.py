"""The copy engine: moves one chunk's layer between a payload's layer slice (host memory, the
canonical [2, tokens, kv_heads, head_dim] order, encoded by the layout's codec) and an engine's
paged layer (any device, any strides; see paged.py). A prompt's tail (a block of fewer tokens
than a chunk) goes through the same buffers, with its own layout (KVLayout.with_tokens).

Runs in the worker (the connectors' worker halves) and in `kvstore bench gpu`. One code path
for every device (but the CPU's raw copies, below); only its `Streams` (streams.py) differ: on
the CPU each step runs at once, on CUDA it is queued on the copier's stream. A layer moves
in a constant number of device operations, whatever the number of blocks per chunk: one
indexed gather (`index_select`) or scatter (`index_copy_`) per K and V, over a `BlockIndex`
(index.py) built once per chunk and step, on views that read the head-dim axis as 8-byte
words (a bitwise copy with 4-8x fewer elements).
- A load stages the page's bytes privately (hashed beside the DMA on CUDA), decodes them in
  place (raw) or into the canonical buffer (fp8), and scatters. `load_layers` takes a layer
  of several chunks: their pages that lie at one stride in the arena go up in one DMA
  (batches.py, dma.py), each still hashed into its own chunk's digest. On the CPU a raw load
  skips the staging pass: each engine block's K and V go straight from the page into the
  engine, hashed as copied (a transposed K through an L1 tile: kvstore/native/copyhash.c),
  one host copy per run of consecutive engine blocks: half the bytes that staging then
  scattering move.
- A save gathers into the canonical buffer, encodes it into staging (raw: the same bytes),
  and writes staging into the reserved page (hashed as written on the CPU). On the CPU a raw
  save whose K and V rows are contiguous goes the other way of a raw load: engine blocks
  straight into the page, hashed as written (a K kept transposed is gathered by torch).
Buffers are allocated once per copier and reused: a step allocates nothing per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from kvstore.codec import decode_layer, encode_layer
from kvstore.errors import ConfigError
from kvstore.kvcopy.batches import LayerLoad, batches, page_rows
from kvstore.kvcopy.host import EngineViews, items
from kvstore.kvcopy.index import BlockIndex, block_runs
from kvstore.kvcopy.paged import PagedLayer, kv_views
from kvstore.kvcopy.streams import streams_for
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout

__all__ = ["UPLOAD_BATCH_BYTES", "BlockIndex", "ChunkCopier", "LayerLoad"]

# The most a layer's batched upload moves in one DMA (one device buffer of this size, made on
# the first batched load): 16 chunk layers of Llama-3-8B, past where a DMA reaches the link's
# speed, while a request's later chunks still pipeline with its earlier layers' attention.
UPLOAD_BATCH_BYTES = 16 << 20


class ChunkCopier:
    """Copies chunk layers of one layout for one engine. Not thread-safe: one per thread."""

    def __init__(
        self,
        layout: KVLayout,
        block_size: int,
        device: torch.device | str,
        upload_batch_bytes: int = UPLOAD_BATCH_BYTES,
    ) -> None:
        self.layout = layout
        self.block_size = block_size
        self.device = torch.device(device)
        self.streams = streams_for(self.device)
        self.upload_batch_bytes = upload_batch_bytes
        self._staging = torch.empty(layout.layer_bytes, dtype=torch.uint8, device=self.device)
        self._decoded_flat = torch.empty(
            layout.layer_elements, dtype=layout.torch_dtype, device=self.device
        )
        self._batch: torch.Tensor | None = None  # made by the first batched upload
        self._engine_views = EngineViews()  # host copies' views of the engine's layers

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
        runs = block_runs(blocks, keep)
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
        self._load([LayerLoad(page, hasher, paged, index, layout)])

    def load_layers(self, loads: Sequence[LayerLoad]) -> None:
        """`load_layer` for each of `loads`, chunk layers of one layer, in their order: the
        same copies, each chunk's hasher fed as `load_layer` feeds it. Where the streams stage
        loads (CUDA), the pages of consecutive loads that lie at one stride in one host
        buffer (arena pages next to each other, the same layout) are uploaded by one DMA, up
        to `upload_batch_bytes`; on the CPU, raw pages still go straight into the engine."""
        self._load(loads)

    def _load(self, loads: Sequence[LayerLoad]) -> None:
        """`load_layers`: a raw load in place (CPU), the others staged, with their layouts named
        and checked."""
        staged = []
        layouts = [self._checked(load.layout) for load in loads]  # all refused before any copy
        for load, layout in zip(loads, layouts, strict=True):
            if self.streams.in_place and layout.codec == "raw":
                self._load_in_place(load, layout)
            else:
                staged.append(load if load.layout is layout else replace(load, layout=layout))
        limit = self.upload_batch_bytes if self.streams.strided_uploads else 0
        for run in batches(staged, limit):
            self._load_staged(run)

    def _load_staged(self, run: list[LayerLoad]) -> None:
        """One upload of the run's pages into rows of staging, then each chunk decoded and
        scattered from its row."""
        layout = run[0].layout
        with self.streams.submitting():
            rows = self._rows(len(run), layout.layer_bytes)
            self.streams.upload(rows, page_rows(run), [load.hasher for load in run])
            for row, load in zip(rows, run, strict=True):
                if len(load.index):
                    self._scatter(self._decode(layout, row), load.paged, load.index)

    def _rows(self, count: int, row_bytes: int) -> torch.Tensor:
        """[count, row_bytes] of staging: the layer buffer for one row, else the batch buffer
        (made once, on the copier's stream, which alone uses it)."""
        if count == 1:
            return self._staging[:row_bytes].view(1, row_bytes)
        if self._batch is None:
            self._batch = torch.empty(
                self.upload_batch_bytes, dtype=torch.uint8, device=self.device
            )
        return self._batch[: count * row_bytes].view(count, row_bytes)

    def _load_in_place(self, load: LayerLoad, layout: KVLayout) -> None:
        """Host memory, raw payloads: K, then V, of each engine block straight from the page,
        hashed as copied (a K kept as [head][dim][token] is transposed on the way: see
        kvstore/native/copyhash.c); positions the engine has already go into staging, so
        the digest still covers every byte of the layer, each byte as it was copied."""
        stored = self._by_blocks(load.page, layout)
        copy = load.hasher.copy
        for part, engine in enumerate(self._engine_views(load.paged)):
            for start, stop, block in load.index.runs:
                if block is None:
                    spare = self._by_blocks(self._staging[: layout.layer_bytes], layout)
                    copy(spare[part, start:stop], stored[part, start:stop])
                else:
                    copy(engine[block : block + stop - start], stored[part, start:stop])

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
        if self.streams.in_place and layout.codec == "raw":
            engine = self._engine_views(paged)
            if _rows_dense(engine):
                self._save_in_place(engine, index, page, hasher, layout)
                return
        staging = self._staging[: layout.layer_bytes]
        with self.streams.submitting():
            canonical = self._canonical_for(layout, staging)
            self._gather(paged, index, canonical)
            if layout.codec != "raw":
                encode_layer(layout, canonical, staging)
            self.streams.download(page, staging, hasher)

    def _save_in_place(
        self,
        engine: tuple[np.ndarray, np.ndarray],
        index: BlockIndex,
        page: torch.Tensor,
        hasher: Hasher | None,
        layout: KVLayout,
    ) -> None:
        """Host memory, raw payloads: K, then V, of each run of consecutive engine blocks
        straight into the reserved page, hashed as written (the mirror of `_load_in_place`):
        one pass over the bytes, where gathering into staging and then writing it out took
        two. A page under reservation is this worker's alone until it commits."""
        stored = self._by_blocks(page, layout)
        copy = np.copyto if hasher is None else _streamed(hasher)
        for part, views in enumerate(engine):
            for start, stop, block in index.runs:
                copy(stored[part, start:stop], views[block : block + stop - start])

    def _by_blocks(self, flat: torch.Tensor, layout: KVLayout) -> np.ndarray:
        """A flat uint8 host layer as [2, blocks, block_size, kv_heads, head_dim] items."""
        shape = (2, -1, self.block_size, layout.num_kv_heads, layout.head_dim)
        return items(flat, layout.torch_dtype).reshape(shape)

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


def _streamed(hasher: Hasher):
    """`hasher.copy` writing around the caches: a saved page is read by nobody soon (a load's
    copy keeps its stores cached: the layer's attention reads them next)."""
    return lambda destination, source: hasher.copy(destination, source, True)


def _rows_dense(engine: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether K's and V's head-dim axes are contiguous (runs of a row each, which the host
    copies move at memory speed; a K kept transposed is gathered by torch)."""
    return all(view.strides[-1] == view.itemsize for view in engine)


_WORDS = (torch.int64, torch.int32, torch.int16)


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
