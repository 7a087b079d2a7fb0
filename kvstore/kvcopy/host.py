"""Host tensors as numpy arrays of integers of their items' size, sharing their memory: what
the C copies (`Hasher.copy`, kvstore/native/copyhash.c) take, for any dtype (numpy has no
bfloat16) and any strides. An engine layer's K and V views are cached (`EngineViews`): a
chunk layer's in-place copy would otherwise spend more time building them than a layer of a
small model takes to copy.

Used by the copy engine (engine.py) in the worker (the connectors' worker halves) and in
`kvstore bench gpu`, on the CPU only.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.kvcopy.paged import PagedLayer, kv_views

_ITEMS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}
_ITEMS[8] = (torch.int64, np.int64)


def items(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A host tensor's items of `dtype` (a flat uint8 one's: its bytes read as `dtype`) as a
    numpy array of integers of their size, sharing its memory."""
    torch_items, numpy_items = _ITEMS[dtype.itemsize]
    if tensor.dtype == torch.uint8:
        return tensor.numpy().view(numpy_items)
    return tensor.view(torch_items).numpy()


class EngineViews:
    """K and V of engine layers as [num_blocks, block_size, kv_heads, head_dim] item arrays,
    built on a layer's first copy and kept, by its address, shape and strides (a worker's
    layers and head groups: a few hundred). A kept array holds its tensor's memory, so no
    other tensor can take that address meanwhile; past `limit` layers all are forgotten.
    Not thread-safe: one per copier."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._views: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, paged: PagedLayer) -> tuple[np.ndarray, np.ndarray]:
        key = (_key(paged[0]), _key(paged[1])) if isinstance(paged, tuple) else _key(paged)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self.limit:
                self._views.clear()
            key_view, value_view = kv_views(paged)
            views = items(key_view, key_view.dtype), items(value_view, value_view.dtype)
            self._views[key] = views
        return views


def _key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride()
