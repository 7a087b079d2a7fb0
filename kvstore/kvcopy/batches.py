"""Which chunk layers of one layer's loads share one upload: the layer slices of several
chunks' pages that lie at one stride in one host buffer (arena pages next to each other, in
the order loaded), as many as the copier's batch buffer holds, go to the device as one 2D DMA
(kvstore/kvcopy/dma.py) instead of one DMA each.

Pure planning over host tensors' addresses, used by the copy engine (engine.py) in the worker
(the connectors' worker halves) and in `kvstore bench gpu`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.kvcopy.index import BlockIndex
from kvstore.kvcopy.paged import PagedLayer
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout

MAX_STRIDE_BYTES = (1 << 31) - 1  # a 2D DMA's largest pitch (cudaDevAttrMaxPitch)


@dataclass(frozen=True)
class LayerLoad:
    """One chunk layer to load: `ChunkCopier.load_layer`'s arguments (see there). The copy
    engine's own loads name their `layout`, a tail's or the chunk's."""

    page: torch.Tensor
    hasher: Hasher
    paged: PagedLayer
    index: BlockIndex
    layout: KVLayout | None = None


@dataclass(frozen=True)
class PageRows:
    """Equal-sized flat uint8 host slices `pages`, the first at `pages[0]` and each next one
    `stride_bytes` further in the same buffer: one strided upload moves them all."""

    pages: tuple[torch.Tensor, ...]
    stride_bytes: int

    def __len__(self) -> int:
        return len(self.pages)


def batches(loads: Sequence[LayerLoad], max_bytes: int) -> list[list[LayerLoad]]:
    """`loads` (their layouts named) cut, in their order, into runs whose pages make one
    `PageRows` of at most `max_bytes` (a run of one where nothing lines up, or 0 bytes)."""
    runs: list[list[LayerLoad]] = []
    for load in loads:
        fits = runs and (len(runs[-1]) + 1) * load.page.numel() <= max_bytes
        if fits and _continues(runs[-1], load):
            runs[-1].append(load)
        else:
            runs.append([load])
    return runs


def page_rows(run: Sequence[LayerLoad]) -> PageRows:
    """The pages of a run `batches` made, with their stride (0 for a run of one)."""
    pages = tuple(load.page for load in run)
    stride = pages[1].data_ptr() - pages[0].data_ptr() if len(pages) > 1 else 0
    return PageRows(pages, stride)


def _continues(run: list[LayerLoad], load: LayerLoad) -> bool:
    """Whether `load` extends `run` as its next row: the same layout, and its page in the same
    buffer at the run's stride (set by the run's second page: at least a row further on)."""
    first, page = run[0].page, load.page
    if load.layout != run[0].layout or not _is_row(page, first):
        return False
    offset = page.data_ptr() - first.data_ptr()
    if len(run) == 1:
        return first.numel() <= offset <= MAX_STRIDE_BYTES
    stride = run[1].page.data_ptr() - first.data_ptr()
    return offset == stride * len(run)


def _is_row(page: torch.Tensor, first: torch.Tensor) -> bool:
    """Whether `page` can be a row beside `first`: host bytes, flat and dense, as many, in the
    same allocation (one registration of pinned memory covers both)."""
    return (
        page.device.type == "cpu"
        and page.dtype == torch.uint8
        and page.dim() == 1
        and page.is_contiguous()
        and page.numel() == first.numel()
        and page.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    )
