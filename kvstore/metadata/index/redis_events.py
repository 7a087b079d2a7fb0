"""The event stream of the sharded Redis index: each shard's outbox relayed into one stream.

Runs inside each metadata-service replica, under ShardedRedisIndex (redis_shards.py): a thread
copies outbox entries (one per shard write, atomic with it) to the events tag, exactly once and
in order per shard; readers page the stream by seq. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.metadata.index.redis_cluster import _replication_id
from kvstore.metadata.index.redis_index import _seq
from kvstore.metadata.records import EventPage, IndexEvent

logger = logging.getLogger(__name__)

RELAY_BATCH = 64  # outbox entries (one per script call: up to a batch of events) per relay
RELAY_PERIOD_S = 1.0  # every outbox is relayed at least this often (a crashed writer's events)
ENTRIES_PER_READ = 16  # relayed entries (batches of events) an events page reads at first
WAIT_CHUNK_S = 2.0  # XREAD BLOCK slices, so a blocked read never meets the socket timeout


class EventRelay:
    """The events tag `events_tag` fed from the outboxes of the shards (`links[i]` serves
    `tags[i]`); `run(link, tag, name, args)` runs a script (the index's, with its WAIT)."""

    def __init__(self, events, events_tag: bytes, links, tags, max_events: int, run) -> None:
        self._events, self._events_tag = events, events_tag
        self._links, self._tags, self._max_events, self._run = links, tags, max_events, run
        self._cursors: dict[int, int] = {}
        self._replids: dict[int, tuple[object, str]] = {}  # shard -> (its master, replid)
        self._relayed_replids: dict[int, str] = {}  # shard -> the replid its last relay named
        self._locks = [threading.Lock() for _ in links]
        self._dirty: set[int] = set()
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, tick: Callable[[], None], tick_s: float) -> None:
        self._thread = threading.Thread(
            target=self._loop, args=(tick, tick_s), name="redis-relay", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def mark(self, shards) -> None:
        """`shards` were written: relay them now (in the relay thread)."""
        self._dirty.update(shards)
        self._wake.set()

    def _loop(self, tick: Callable[[], None], tick_s: float) -> None:
        """Copies outbox events to the stream: at once for shards this process wrote, every
        RELAY_PERIOD_S for all (events a crashed replica wrote and did not relay); runs
        `tick` at least every `tick_s`."""
        last_sweep = time.monotonic()
        while not self._stopping.is_set():
            self._wake.wait(min(RELAY_PERIOD_S, tick_s))
            self._wake.clear()
            try:
                tick()
                if time.monotonic() - last_sweep >= RELAY_PERIOD_S:
                    self._dirty.update(range(len(self._links)))
                    last_sweep = time.monotonic()
                self.relay_dirty()
            except Exception as exc:  # the cluster may be mid-failover; the next round retries
                logger.debug("event relay failed: %s", exc)

    def relay_dirty(self) -> None:
        """Relay every shard this process wrote since its last relay, and wait for relays in
        flight: events a caller's own writes made are in the stream when this returns."""
        for shard in range(len(self._links)):
            with self._locks[shard]:
                if shard in self._dirty:
                    self._dirty.discard(shard)
                    try:
                        self._copy(shard)
                    except BaseException:
                        self._dirty.add(shard)
                        raise

    def _copy(self, shard: int) -> None:
        """Copy shard `shard`'s outbox events past its cursor to the stream, in order, once
        (the relay script skips what any replica copied already). Under its relay lock."""
        outbox = self._tags[shard] + b":ev"
        cursor = self._cursors.get(shard)
        if cursor is None:
            relayed = self._events.call(
                lambda c: c.hget(self._events_tag + b":relayed", str(shard))
            )
            cursor = int(relayed or 0)
        while True:
            shard_seq, page = self._links[shard].call(
                lambda c, low=cursor: _outbox_page(c, outbox, low)
            )
            replid = self._replid(shard)
            if not page and shard_seq >= cursor and self._relayed_replids.get(shard) == replid:
                break
            triples = [x for event_id, f in page for x in (_seq(event_id), f[b"n"], f[b"e"])]
            args = [self._max_events, shard, shard_seq, replid, *triples]
            cursor = int(self._run(self._events, self._events_tag, "relay", args))
            self._cursors[shard], self._relayed_replids[shard] = cursor, replid
            if len(page) < RELAY_BATCH:
                break

    def _replid(self, shard: int) -> str:
        """The replication id of shard `shard`'s master, read again when the link moved to
        another master (a failover)."""
        link = self._links[shard]
        client = link.client()
        cached = self._replids.get(shard)
        if cached is None or cached[0] is not client:
            cached = (client, _replication_id(link))
            self._replids[shard] = cached
        return cached[1]

    def events_since(self, from_seq: int, max_events: int) -> EventPage:
        """Events are kept in entries of one relayed batch each (id: its last event's seq):
        pages read entries from the one holding `from_seq` until `max_events` are found."""
        self.relay_dirty()
        stream = self._events_tag + b":ev"
        from_seq = max(from_seq, 0)

        def read(client) -> list:
            with client.pipeline(transaction=True) as pipe:
                pipe.get(self._events_tag + b":seq")
                pipe.xrange(stream, count=1)
                if max_events > 0:
                    pipe.xrange(stream, min=f"0-{from_seq}", count=ENTRIES_PER_READ)
                return pipe.execute()

        last, first, *page = self._events.call(read)
        last_seq = int(last or 0)
        oldest = _first_seq(*first[0]) if first else last_seq + 1
        entries = page[0] if page else []
        events = _events_of(entries, from_seq, max_events)
        while len(entries) == ENTRIES_PER_READ and len(events) < max_events:
            after = _seq(entries[-1][0]) + 1
            entries = self._events.call(
                lambda c, a=after: c.xrange(stream, min=f"0-{a}", count=ENTRIES_PER_READ)
            )
            events += _events_of(entries, from_seq, max_events - len(events))
        ahead = from_seq > last_seq + 1  # a failover lost the newest events: resync
        return EventPage(events, ahead or (from_seq < oldest and from_seq <= last_seq), last_seq)

    def wait_for_events(self, after_seq: int, timeout_s: float) -> bool:
        self.relay_dirty()
        deadline = time.monotonic() + timeout_s
        streams = {self._events_tag + b":ev": f"0-{max(after_seq, 0)}"}
        while True:
            remaining_s = deadline - time.monotonic()
            block_ms = int(min(remaining_s, WAIT_CHUNK_S) * 1000)
            block = block_ms if block_ms > 0 else None
            if self._events.call(lambda client, b=block: client.xread(streams, count=1, block=b)):
                return True
            if remaining_s <= WAIT_CHUNK_S:
                return self.last_seq() > after_seq

    def last_seq(self) -> int:
        seq = self._events.call(lambda client: client.get(self._events_tag + b":seq"))
        return int(seq or 0)


def _outbox_page(client, outbox: bytes, after: int) -> tuple[int, list]:
    """(the shard's :seq, its outbox entries after `after`), read together on its master."""
    with client.pipeline(transaction=False) as pipe:
        pipe.get(outbox[: -len(b":ev")] + b":seq")
        pipe.xrange(outbox, min=f"0-{after + 1}", count=RELAY_BATCH)
        seq, page = pipe.execute()
    return int(seq or 0), page


def _first_seq(entry_id: bytes, fields: dict) -> int:
    return _seq(entry_id) - int(fields[b"n"]) + 1


def _events_of(entries: list, from_seq: int, limit: int) -> list[IndexEvent]:
    """The events of relayed entries with seq >= from_seq, at most `limit`, oldest first."""
    events: list[IndexEvent] = []
    for entry_id, fields in entries:
        seq = _first_seq(entry_id, fields)
        parts = _netstrings(fields[b"e"])
        for i in range(0, len(parts), 5):
            if seq >= from_seq:
                if len(events) == limit:
                    return events
                kind, tenant, key, node, tier = parts[i : i + 5]
                events.append(
                    IndexEvent(
                        seq, kind.decode(), tenant.decode(), key, node.decode(), tier.decode()
                    )
                )
            seq += 1
    return events


def _netstrings(blob: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(blob):
        colon = blob.index(b":", pos)
        end = colon + 1 + int(blob[pos:colon])
        out.append(blob[colon + 1 : end])
        pos = end
    return out
