"""Where the copy engine's work runs, the one thing that differs between devices.

The copy engine (engine.py) runs the same loads and saves on every device; a `Streams` object
says where each step goes and how bytes cross between the host page and the device:
- `HostStreams` (the CPU): everything runs at once, on the calling thread alone (not torch's
  thread pool); a raw page's bytes are copied into the engine's blocks, and a raw save's
  engine blocks into the reserved page (else through the private staging buffer), hashed in
  the same pass (kvcopy.verified), so the digest is of the copy that becomes KV (or is
  stored).
- `CudaStreams`: copies are queued on the copier's own stream and ordered against the compute
  stream by one event per layer, so the forward waits on the device, never on the host. A
  load DMAs the pinned page into device staging (the same layer of several chunks whose pages
  lie at one stride in the arena: one strided DMA, dma.py) and, beside the DMA, a verifier
  thread hashes each page into its chunk's hasher (it cannot change while pinned); a save
  DMAs into the reserved page, and the verifier thread hashes it once the DMA's event
  completes. Verification costs no pass on the forward's thread, and the agent need not hash
  a save at commit. `synchronize` (and a step's `StepDone`) waits for the copies and the
  hashes.

Runs in the worker (the connectors' worker halves) and in `kvstore bench gpu`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvstore.block import as_buffer
from kvstore.kvcopy import dma
from kvstore.kvcopy.batches import PageRows
from kvstore.kvcopy.verified import Hasher, copy_hashed


class HostStreams:
    """The CPU: no queues; each copy is done when its call returns. A raw load goes from the
    page into the engine's blocks in place, hashed as copied (no staging pass), unless made
    with `in_place=False` (the staged path every device shares, as tests exercise it)."""

    strided_uploads = True  # `upload` takes rows at any stride

    def __init__(self, in_place: bool = True) -> None:
        self.in_place = in_place
        self.uploads = 0  # calls of `upload`: what a device would DMA

    def submitting(self) -> contextlib.AbstractContextManager:
        """Torch's copies on this thread alone: see `one_thread`."""
        return one_thread()

    def upload(self, rows: torch.Tensor, pages: PageRows, hashers: Sequence[Hasher]) -> None:
        """Copy each of `pages` into its row of `rows` ([len(pages), row bytes]), feeding its
        hasher with the bytes copied (the bytes that then become KV). Counted as one upload:
        what the device does in one DMA."""
        self.uploads += 1
        for row, page, hasher in zip(rows, pages.pages, hashers, strict=True):
            copy_hashed(row, page, hasher)

    def index(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor (block ids) where the copies read it."""
        return host

    def download(self, page: torch.Tensor, staging: torch.Tensor, hasher: Hasher | None) -> None:
        """Copy `staging` into a reserved page, feeding `hasher` with the bytes written."""
        if hasher is None:
            page.copy_(staging)
            return
        copy_hashed(page, staging, hasher)

    def record(self, layer: int) -> None:
        """Mark the end of the work submitted so far for `layer`."""

    def wait(self, layer: int) -> None:
        """Make the compute stream wait for `layer`'s copies."""

    def after_compute(self) -> None:
        """Order later copies after the compute stream's work so far."""

    def synchronize(self) -> None:
        """Every submitted copy (and hash) is done."""

    def step_done(self) -> None:
        """A marker of the work submitted so far, to commit from later: None, it is done."""
        return None


class CudaStreams:
    """A CUDA device: the copier's stream, an event per layer, and a verifier thread."""

    in_place = False  # a page reaches the device by one DMA into staging

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.strided_uploads = dma.available()
        self.uploads = 0
        self.stream = torch.cuda.Stream(device)
        self._events: dict[int, torch.cuda.Event] = {}
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="kvstore-verify")
        self._hashing: list[Future] = []

    def submitting(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def upload(self, rows: torch.Tensor, pages: PageRows, hashers: Sequence[Hasher]) -> None:
        """One DMA of every page into its row (a strided one for several), each page hashed
        beside it into its own hasher (a pinned page cannot change while pinned)."""
        self.uploads += 1
        if len(pages) == 1:
            rows[0].copy_(pages.pages[0], non_blocking=True)
        else:
            dma.upload_rows(rows, pages.pages[0], pages.stride_bytes, self.stream)
        for page, hasher in zip(pages.pages, hashers, strict=True):
            self._hashing.append(self._verifier.submit(hasher.update, as_buffer(page)))

    def index(self, host: torch.Tensor) -> torch.Tensor:
        """Through pinned memory: a copy from pageable memory would wait for the current
        stream's work first, a host synchronize inside the step. Queued on the current
        (compute) stream: call `after_compute` before copies use it."""
        return host.pin_memory().to(self.device, non_blocking=True)

    def download(self, page: torch.Tensor, staging: torch.Tensor, hasher: Hasher | None) -> None:
        page.copy_(staging, non_blocking=True)
        if hasher is not None:
            copied = torch.cuda.Event()
            copied.record(self.stream)
            self._hashing.append(self._verifier.submit(_hash_when_copied, copied, hasher, page))

    def record(self, layer: int) -> None:
        event = self._events.get(layer) or torch.cuda.Event()
        event.record(self.stream)
        self._events[layer] = event

    def wait(self, layer: int) -> None:
        event = self._events.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.step_done().synchronize()

    def step_done(self) -> StepDone:
        """The copies and hashes submitted so far, as one marker to commit from later."""
        event = torch.cuda.Event()
        event.record(self.stream)
        hashing, self._hashing = self._hashing, []
        return StepDone(event, hashing)


class StepDone:
    """A step's copies (an event on the copier's stream) and hashes (the verifier's)."""

    def __init__(self, event: torch.cuda.Event, hashing: list[Future]) -> None:
        self.event = event
        self.hashing = hashing

    def query(self) -> bool:
        """Whether all of it is done, without waiting."""
        return self.event.query() and all(future.done() for future in self.hashing)

    def synchronize(self) -> None:
        """Wait for all of it; a hash that failed raises here."""
        self.event.synchronize()
        for future in self.hashing:
            future.result()


def _hash_when_copied(copied: torch.cuda.Event, hasher: Hasher, page: torch.Tensor) -> None:
    """On the verifier thread: feed `hasher` with `page` once the DMA into it is done."""
    copied.synchronize()
    hasher.update(as_buffer(page))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the torch operations inside on the calling thread, not fanned out to torch's
    intra-op pool: a chunk layer is a few hundred KiB to a few MiB, which one core copies at
    memory speed, while a parallel region needs every pool thread scheduled at once and, on a
    host whose cores are busy (the forward's own threads, the node agent, other engines),
    waits for them: measured on a shared 2-core host, 0.1-0.2 GB/s parallel against 3.7-4.4
    GB/s on one thread. Per thread: under OpenMP a thread's count is its own (only a thread
    that first uses torch meanwhile starts from this one's). An engine that binds its threads
    to cores and forbids changing their count (vLLM's CPU worker replaces
    torch.set_num_threads) owns them: its copies then run on its bound team, left as it is."""
    if torch.set_num_threads is not torch._C.set_num_threads:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


Streams = HostStreams | CudaStreams


def streams_for(device: torch.device) -> Streams:
    """The streams of `device`: CUDA's, or the host's (run at once) for any other."""
    if device.type == "cuda":
        return CudaStreams(device)
    return HostStreams()
