"""WatchEvents streams over an index whose newest seq goes back, as a Redis failover does (the
replica promoted had not received the newest events, and their seqs are issued again). The
stream layer alone (EventStreams on an asyncio loop) over a small index of seqs: an idle
stream neither spins nor misses the events issued after the failover."""

import asyncio
import contextlib
import threading

from kvstore.metadata.records import EventPage, IndexEvent
from kvstore.metadata.server.watch import EventStreams
from kvstore.v1 import metadata_pb2 as pb

POLL_S = 0.2


class SeqIndex:
    """events_since / wait_for_events as the Redis index answers them (a reader ahead of the
    newest seq is told of a gap); counts its reads."""

    incarnation = 1  # the same index throughout

    def __init__(self, last_seq: int) -> None:
        self.last_seq = last_seq
        self.events: list[IndexEvent] = []
        self.reads = 0
        self._cond = threading.Condition()

    def events_since(self, from_seq: int, max_events: int) -> EventPage:
        with self._cond:
            self.reads += 1
            events = [e for e in self.events if e.seq >= from_seq][:max_events]
            return EventPage(events, from_seq > self.last_seq + 1, self.last_seq)

    def wait_for_events(self, after_seq: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.last_seq > after_seq, timeout_s)

    def fail_over(self, last_seq: int) -> None:
        with self._cond:
            self.last_seq, self.events = last_seq, []
            self._cond.notify_all()

    def add(self) -> None:
        with self._cond:
            self.last_seq += 1
            self.events.append(IndexEvent(self.last_seq, "stored", "t", b"k", "n", "host"))
            self._cond.notify_all()


async def _idle_reads(index: SeqIndex, seconds: float) -> int:
    before = index.reads
    await asyncio.sleep(seconds)
    return index.reads - before


@contextlib.asynccontextmanager
async def _stream(index: SeqIndex, from_seq: int):
    """A WatchEvents stream over `index` from `from_seq`, on the running loop."""
    streams = EventStreams(index, max_per_tenant=4, batch=64, poll_s=POLL_S)
    streams.start(asyncio.get_running_loop())
    events = streams.stream(pb.WatchEventsRequest(from_seq=from_seq))
    try:
        yield events
    finally:
        streams.stop()
        await events.aclose()


async def _watch_through_a_failover() -> dict:
    index = SeqIndex(last_seq=1000)
    async with _stream(index, 1001) as events:
        pending = asyncio.ensure_future(anext(events))
        idle_before = await _idle_reads(index, 0.5)
        index.fail_over(900)  # the promoted replica's newest seq
        gap = await asyncio.wait_for(pending, 3 * POLL_S)
        pending = asyncio.ensure_future(anext(events))
        idle_after = await _idle_reads(index, 0.5)
        index.add()  # seq 901, issued again
        loop = asyncio.get_running_loop()
        started = loop.time()
        event = await asyncio.wait_for(pending, 3 * POLL_S)
        return {
            "idle_before": idle_before,
            "idle_after": idle_after,
            "gap": gap,
            "event": event,
            "delivered_s": loop.time() - started,
        }


def test_an_idle_stream_neither_spins_nor_misses_events_after_the_index_went_back():
    """The notifier only woke streams for seqs above the newest it had seen (1000): after a
    failover to seq 900 every idle stream re-read the index in a busy loop until seq 1001,
    a core per stream; now a change either way wakes the streams once."""
    seen = asyncio.run(_watch_through_a_failover())
    assert seen["idle_before"] <= 2 * 0.5 / POLL_S + 2
    assert seen["gap"].kind == pb.Event.KIND_GAP and seen["gap"].seq == 900
    assert seen["idle_after"] <= 2 * 0.5 / POLL_S + 2, f"{seen['idle_after']} reads while idle"
    assert seen["event"].kind == pb.Event.KIND_STORED and seen["event"].seq == 901
    assert seen["delivered_s"] < 2 * POLL_S


async def _watch_across_an_incarnation() -> list:
    index = SeqIndex(last_seq=10)
    async with _stream(index, 11) as events:
        index.add()  # seq 11
        first = await asyncio.wait_for(anext(events), 3 * POLL_S)
        index.incarnation = 2  # a failover to a replica that issues seqs again
        index.add()  # seq 12, of the new incarnation
        return [first, await asyncio.wait_for(anext(events), 3 * POLL_S)]


def test_a_stream_reports_a_gap_when_the_index_becomes_another_incarnation():
    """The seqs of another incarnation may name other events than the stream already
    passed: the stream says so (KIND_GAP), and the watcher resyncs."""
    first, second = asyncio.run(_watch_across_an_incarnation())
    assert first.kind == pb.Event.KIND_STORED and first.seq == 11
    assert second.kind == pb.Event.KIND_GAP and second.seq == 12
