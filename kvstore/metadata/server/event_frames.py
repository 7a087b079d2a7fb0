"""Index events encoded once for every WatchEventBatches stream that sends them: each event's
bytes, framed as one element of `EventBatch.events`, kept by seq for the newest `capacity`
events; a stream's batch is the join of its events' frames (protobuf encodes a repeated
message field as its elements' frames one after another).

Runs in the metadata service process, in the watch readers' threads (watch.py); one lock
around each batch (a batch is up to the service's event batch, 1,024 events).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from kvstore.metadata import wire
from kvstore.metadata.records import IndexEvent
from kvstore.v1 import metadata_pb2 as pb

EVENTS_TAG = b"\x0a"  # EventBatch.events: field 1, length-delimited


class EventFrames:
    """The frames of the newest `capacity` events of one index incarnation (a new one forgets
    the old: its seqs may name other events). `encoded` counts the events encoded."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.encoded = 0
        self._incarnation = 0
        self._frames: dict[int, bytes] = {}  # seq -> frame
        self._order: deque[int] = deque()  # their seqs, oldest first (the next to forget)
        self._lock = threading.Lock()

    def batch(
        self, incarnation: int, events: Sequence[IndexEvent], tenant: str, gap_seq: int | None
    ) -> bytes:
        """An encoded EventBatch: a KIND_GAP event at `gap_seq` first where not None, then
        `events` of `tenant` ("" every tenant), in order. b"" where it holds none."""
        parts = [] if gap_seq is None else [frame(gap_event(gap_seq))]
        with self._lock:
            if incarnation != self._incarnation:
                self._incarnation, self._frames, self._order = incarnation, {}, deque()
            frames = self._frames
            for event in events:
                if tenant and event.tenant != tenant:
                    continue
                encoded = frames.get(event.seq)
                if encoded is None:
                    encoded = frames[event.seq] = frame(event_to_proto(event))
                    self._order.append(event.seq)
                    self.encoded += 1
                parts.append(encoded)
            self._trim()
        return b"".join(parts)

    def _trim(self) -> None:
        """Forget the oldest frames past capacity (a deque: a dict's first key is found in
        O(deleted keys) once many were deleted from its front)."""
        frames, order = self._frames, self._order
        while len(order) > self.capacity:
            del frames[order.popleft()]


def frame(event: pb.Event) -> bytes:
    """`event` as one element of EventBatch.events: tag, varint length, bytes."""
    payload = event.SerializeToString()
    return EVENTS_TAG + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def gap_event(seq: int) -> pb.Event:
    """Events up to `seq` are gone: the reader resyncs."""
    return pb.Event(seq=seq, kind=pb.Event.KIND_GAP)


def event_to_proto(event: IndexEvent) -> pb.Event:
    kind = pb.Event.KIND_STORED if event.kind == "stored" else pb.Event.KIND_REMOVED
    return pb.Event(
        seq=event.seq,
        kind=kind,
        key=event.key,
        tier=wire.TIER_TO_PROTO[event.tier],
        node_id=event.node_id,
        tenant=event.tenant,
    )
