"""WatchEvents and WatchEventBatches streams, served on the gRPC asyncio loop so that an open
stream holds no thread.

Runs in the metadata service process. One notifier thread waits on the index for new events
and wakes every stream through the loop; pages are read in a small executor of their own. So
however many streams are open, unary RPCs (heartbeats) keep the whole handler pool. A tenant
(its token's scope) may hold at most `max_per_tenant` streams at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from kvstore.metadata.index.base import MetadataIndex
from kvstore.metadata.server.event_frames import EventFrames, event_to_proto, gap_event
from kvstore.metadata.server.slots import StreamSlots
from kvstore.v1 import metadata_pb2 as pb

logger = logging.getLogger(__name__)

READ_THREADS = 4  # page reads are short (O(log n) in the ring, one round trip to Redis)
FRAME_PAGES = 64  # encoded events kept for streams behind the newest: 64 pages


class EventNotifier:
    """Tells streams on the loop that the index's newest seq changed: up with new events, or
    down when a Redis failover lost the newest ones (their seqs are issued again).

    A stream takes `changed()` before it reads and waits on that after an empty read, so a
    change during its read wakes it at once; no seq is compared, and a seq going back can
    neither make a stream spin nor miss a wake-up. `start` and the wake-ups run on the loop
    thread; only `_watch` runs in its own thread."""

    def __init__(self, index: MetadataIndex, poll_s: float) -> None:
        self._index = index
        self._poll_s = poll_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._stopping = threading.Event()
        self.last_seq = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.last_seq = self._index.events_since(0, 0).last_seq
        threading.Thread(
            target=self._watch, args=(self.last_seq,), name="event-notifier", daemon=True
        ).start()

    def stop(self) -> None:
        self._stopping.set()

    def _watch(self, seen: int) -> None:
        while not self._stopping.is_set():
            try:
                self._index.wait_for_events(seen, self._poll_s)  # newer, or a poll's time
                newest = self._index.events_since(0, 0).last_seq
                if newest != seen:  # an index that went back is noticed within a poll
                    seen = newest
                    self._loop.call_soon_threadsafe(self._advance, seen)
            except RuntimeError:  # the loop closed under us: shutting down
                return
            except Exception:  # the backend may be briefly unreachable; streams poll meanwhile
                logger.exception("event notifier failed; retrying")
                self._stopping.wait(self._poll_s)

    def _advance(self, seq: int) -> None:
        self.last_seq = seq
        self._changed.set()
        self._changed = asyncio.Event()

    def changed(self) -> asyncio.Event:
        """Set at the next change of the index's newest seq (take it before reading)."""
        return self._changed

    @staticmethod
    async def wait(changed: asyncio.Event, timeout_s: float) -> None:
        """Return once `changed` is set, or after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout_s)


class EventStreams:
    """The open WatchEvents streams: their slots (Snapshot streams hold them too), the notifier
    and the page readers."""

    def __init__(
        self,
        index: MetadataIndex,
        max_per_tenant: int,
        batch: int,
        poll_s: float,
        max_all_tenants: int = 4096,
    ) -> None:
        self.index = index
        self.slots = StreamSlots("watch", max_per_tenant, max_all_tenants)
        self.batch = batch
        self.poll_s = poll_s
        self.notifier = EventNotifier(index, poll_s)
        self.frames = EventFrames(FRAME_PAGES * batch)
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="watch-read")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.notifier.start(loop)

    def stop(self) -> None:
        self.notifier.stop()
        self._readers.shutdown(wait=False, cancel_futures=True)

    async def stream(self, request: pb.WatchEventsRequest) -> AsyncIterator[pb.Event]:
        """Events with seq >= from_seq (0: only new), a KIND_GAP first where some were dropped."""
        async for _, gap_seq, events in self._pages(request):
            if gap_seq is not None:
                yield gap_event(gap_seq)
            for event in events:
                if not request.tenant or event.tenant == request.tenant:
                    yield event_to_proto(event)

    async def stream_batches(self, request: pb.WatchEventsRequest) -> AsyncIterator[bytes]:
        """The same events as `stream`, as encoded EventBatch messages (one per page read,
        none where a page held none of the tenant's), each event encoded once for every
        stream (event_frames.py), in the readers' threads."""
        loop = asyncio.get_running_loop()
        async for incarnation, gap_seq, events in self._pages(request):
            batch = await loop.run_in_executor(
                self._readers, self.frames.batch, incarnation, events, request.tenant, gap_seq
            )
            if batch:
                yield batch

    async def _pages(self, request: pb.WatchEventsRequest):
        """(incarnation, seq of a KIND_GAP to send first or None, the next events) from
        from_seq on (0: only new), for ever: waits on the notifier at the head."""
        loop = asyncio.get_running_loop()

        def read(from_seq: int, count: int):
            return loop.run_in_executor(self._readers, self._page, from_seq, count)

        incarnation, first = await read(0, 0)
        next_seq = request.from_seq or first.last_seq + 1
        while True:
            changed = self.notifier.changed()
            now, page = await read(next_seq, self.batch)
            if now != incarnation:  # seqs from here on may name other events: resync
                incarnation = now
                yield now, page.last_seq, []
                next_seq = page.last_seq + 1
                continue
            gap_seq = None
            if page.gap:
                gap_seq = (page.events[0].seq if page.events else page.last_seq + 1) - 1
            if page.events or gap_seq is not None:
                yield now, gap_seq, page.events
            if page.events:
                next_seq = page.events[-1].seq + 1
            elif page.gap:
                next_seq = page.last_seq + 1
            else:
                await self.notifier.wait(changed, self.poll_s)

    def _page(self, from_seq: int, count: int):
        """(the index's incarnation, a page of events): a Redis failover may issue seqs that
        a stream already passed for other events, which only the incarnation tells."""
        return self.index.incarnation, self.index.events_since(from_seq, count)
