"""Strided host-to-device copies as one DMA: rows of host memory at one stride (the same layer
of several arena pages) into consecutive rows of device memory, by the CUDA runtime's
`cudaMemcpy2DAsync` on a given stream. torch has no such copy: its `copy_` from a strided
host view first gathers it into a pageable host temporary, on the calling thread.

Runs in the worker (the copy engine's CUDA streams, streams.py) and in `kvstore bench gpu`;
only where torch has a CUDA device (it loads the runtime torch itself loaded).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from kvstore.errors import TransferError

logger = logging.getLogger(__name__)

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


def upload_rows(rows: torch.Tensor, first: torch.Tensor, stride_bytes: int, stream) -> None:
    """Queue on `stream` the copy of `rows.shape[0]` host rows of `rows.shape[1]` bytes, the
    first at `first` (a flat uint8 host tensor) and each next `stride_bytes` further (at most
    batches.MAX_STRIDE_BYTES), into the contiguous uint8 device tensor `rows`. TransferError
    if the runtime refuses it."""
    height, width = rows.shape
    runtime = _runtime()
    if runtime is None:
        raise TransferError("strided uploads need torch's CUDA runtime, which was not found")
    with torch.cuda.device(rows.device):
        status = runtime.cudaMemcpy2DAsync(
            ctypes.c_void_p(rows.data_ptr()),
            ctypes.c_size_t(width),
            ctypes.c_void_p(first.data_ptr()),
            ctypes.c_size_t(stride_bytes),
            ctypes.c_size_t(width),
            ctypes.c_size_t(height),
            ctypes.c_int(_HOST_TO_DEVICE),
            ctypes.c_void_p(stream.cuda_stream),
        )
    if status != 0:
        reason = runtime.cudaGetErrorString(status).decode()
        raise TransferError(f"a {height}-row upload of {width} bytes per row failed: {reason}")


def available() -> bool:
    """Whether strided uploads can be queued here (torch's CUDA runtime was found)."""
    return _runtime() is not None


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded, the same library (so the same context): by its soname,
    else by the path this process mapped it from (wheels that bundle a renamed copy)."""
    major = (torch.version.cuda or "12").split(".")[0]
    for name in (f"libcudart.so.{major}", *_mapped("libcudart")):
        try:
            runtime = ctypes.CDLL(name)
        except OSError:
            continue
        runtime.cudaMemcpy2DAsync.restype = ctypes.c_int
        runtime.cudaGetErrorString.restype = ctypes.c_char_p
        runtime.cudaGetErrorString.argtypes = [ctypes.c_int]
        return runtime
    logger.warning("no CUDA runtime found beside torch: a layer's loads take one DMA each")
    return None


def _mapped(stem: str) -> list[str]:
    """Paths of the shared libraries named `stem`* that this process has mapped."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if stem in line}
    except OSError:
        return []
    return sorted(path for path in paths if path.startswith("/"))
