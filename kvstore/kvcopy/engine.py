"""The copy engine: moves one chunk's layer between a payload's layer slice (host memory, the
canonical [2, tokens, kv_heads, head_dim] order, encoded by the layout's codec) and an engine's
paged layer (any device, any strides; see paged.py). A prompt's tail (a block of fewer tokens
than a chunk) goes through the same buffers, with its own layout (KVLayout.with_tokens).

Runs in the worker (the connectors' worker halves) and in `kvstore bench gpu`. Buffers are
allocated once per engine and reused, so the load path allocates nothing per layer.
- On the CPU, a load copies the shared slice into a private staging buffer hashing it in the
  same pass (kvcopy.verified), then scatters block by block from the staging buffer (still in
  cache) through strided views; a save copies block by block straight into the reserved
  payload slice and hashes it while it is hot. One pass over the bytes each way.
- On CUDA, copies run on the engine's own stream: loads DMA the (pinned) slice into a device
  staging buffer, decode there (fp8 too) and scatter; saves gather and encode on the device and
  DMA into the pinned slice. `record(layer)` / `wait(layer)` give one event per layer, so the
  compute stream waits on the device, never the host.
"""

from __future__ import annotations

import torch

from kvstore.block import as_buffer
from kvstore.codec import decode_layer, encode_layer
from kvstore.errors import ConfigError
from kvstore.kvcopy.paged import PagedLayer, kv_views
from kvstore.kvcopy.verified import Hasher, copy_hashed
from kvstore.layout import KVLayout


class ChunkCopier:
    """Copies chunk layers of one layout for one engine. Not thread-safe: one per thread."""

    def __init__(self, layout: KVLayout, block_size: int, device: torch.device | str) -> None:
        self.layout = layout
        self.block_size = block_size
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._staging = torch.empty(layout.layer_bytes, dtype=torch.uint8, device=self.device)
        self._canonical_flat = torch.empty(
            layout.layer_elements, dtype=layout.torch_dtype, device=self.device
        )
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._events: dict[int, torch.cuda.Event] = {}

    # ---- loads -----------------------------------------------------------------------------
    def load_layer(
        self, payload_slice: torch.Tensor, hasher: Hasher, paged: PagedLayer,
        blocks: list[int], keep: list[int], layout: KVLayout | None = None,
    ) -> None:  # fmt: skip
        """Copy one chunk layer into `paged[blocks[i]]` for i in `keep`, feeding `hasher` with
        the payload bytes the copy used (compare its digest with the block's checksum once
        every layer of the chunk was copied: a mismatch means the KV written is not the
        block's and must be recomputed). `layout`: a tail's (fewer tokens), else the chunk's."""
        layout = self._checked(layout)
        staging = self._staging[: layout.layer_bytes]
        if self.on_cuda:
            hasher.update(as_buffer(payload_slice))  # host side, the page stays pinned
            with torch.cuda.stream(self.stream):
                staging.copy_(payload_slice, non_blocking=True)
                self._scatter(self._decoded(layout, staging), paged, blocks, keep)
            return
        copy_hashed(staging, payload_slice, hasher)
        self._scatter(self._decoded(layout, staging), paged, blocks, keep)

    def _checked(self, layout: KVLayout | None) -> KVLayout:
        if layout is None:
            return self.layout
        if layout.with_tokens(self.layout.chunk_tokens) != self.layout:
            raise ConfigError(f"layout {layout.layout_id} is not a tail of {self.layout.layout_id}")
        return layout

    def _canonical(self, layout: KVLayout) -> torch.Tensor:
        return self._canonical_flat[: layout.layer_elements].view(layout.layer_shape)

    def _decoded(self, layout: KVLayout, staging: torch.Tensor) -> torch.Tensor:
        if layout.codec == "raw":
            return staging.view(layout.torch_dtype).view(layout.layer_shape)
        canonical = self._canonical(layout)
        decode_layer(layout, staging, canonical)
        return canonical

    def _scatter(self, canonical, paged: PagedLayer, blocks: list[int], keep: list[int]) -> None:
        size = self.block_size
        for part, view in enumerate(kv_views(paged)):
            for i in keep:
                view[blocks[i]].copy_(canonical[part, i * size : (i + 1) * size])

    # ---- saves -----------------------------------------------------------------------------
    def save_layer(
        self, paged: PagedLayer, blocks: list[int], payload_slice: torch.Tensor,
        hasher: Hasher | None, layout: KVLayout | None = None,
    ) -> None:  # fmt: skip
        """Copy `paged[blocks]` into one chunk layer's payload slice (encoded), feeding
        `hasher` with the written bytes (on CUDA they are not written yet: the hasher is not
        fed, and the agent hashes the payload at commit). `layout`: a tail's, else the
        chunk's."""
        layout = self._checked(layout)
        canonical = self._canonical(layout)
        if self.on_cuda:
            staging = self._staging[: layout.layer_bytes]
            with torch.cuda.stream(self.stream):
                self._gather(paged, blocks, canonical)
                encode_layer(layout, canonical, staging)
                payload_slice.copy_(staging, non_blocking=True)
            return
        if layout.codec == "raw":
            shape = layout.layer_shape
            self._gather(paged, blocks, payload_slice.view(layout.torch_dtype).view(shape))
        else:
            self._gather(paged, blocks, canonical)
            encode_layer(layout, canonical, payload_slice)
        if hasher is not None:
            hasher.update(as_buffer(payload_slice))  # just written: still in cache

    def _gather(self, paged: PagedLayer, blocks: list[int], canonical: torch.Tensor) -> None:
        size = self.block_size
        for part, view in enumerate(kv_views(paged)):
            for i, block in enumerate(blocks):
                canonical[part, i * size : (i + 1) * size].copy_(view[block])

    # ---- ordering with the compute stream (CUDA; no-ops on the CPU) ----------------------
    def record(self, layer: int) -> None:
        """Mark the end of the work submitted so far for `layer`."""
        if self.on_cuda:
            event = self._events.get(layer) or torch.cuda.Event()
            event.record(self.stream)
            self._events[layer] = event

    def wait(self, layer: int) -> None:
        """Make the current (compute) stream wait for `layer`'s copies, without a host sync."""
        event = self._events.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def after_compute(self) -> None:
        """Make the copy stream wait for the compute stream's work so far (before a save
        reads a layer the forward just wrote)."""
        if self.on_cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """Block until every submitted copy is done (before committing saves)."""
        if self.on_cuda:
            self.stream.synchronize()
