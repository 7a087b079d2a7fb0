"""Follows the metadata service's WatchEvents stream: resumes by seq after a broken stream, and
resyncs where events were lost (KIND_GAP, or a service restarted without its state). StreamThread
holds that loop for both its users, each in one background thread of its owner: EventFollower
(the vLLM connector's scheduler process, or `kvstore events`) and the node agent's view feed
(kvstore/node/view_feed.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from kvstore.errors import ConfigError, KVStoreError, PermissionDeniedError, UnavailableError
from kvstore.metadata import wire
from kvstore.metadata.client import EventStream, MetadataClient
from kvstore.retry import Backoff
from kvstore.v1 import metadata_pb2 as pb

logger = logging.getLogger(__name__)
KINDS = {pb.Event.KIND_STORED: "stored", pb.Event.KIND_REMOVED: "removed"}
RESUME_BACKOFF = Backoff(base_s=0.1, cap_s=5.0)


class EventSink(Protocol):
    def apply(self, kind: str, tenant: str, key: bytes, node_id: str, tier: str) -> None:
        """One stored/removed event, in seq order, each at most once after a resync."""


class EventHandler(EventSink, Protocol):
    def resync(self) -> int:
        """Events were lost (or this is the start): rebuild; returns the last seq the rebuilt
        state covers (0: none, follow only new events)."""


class StreamThread:
    """One background thread following the WatchEvents stream of `client` for `tenant` (""
    every tenant): a resync (the subclass's `_resync`) at the start, after a KIND_GAP, after the
    service restarted without its state, or when `_resync_due`; between them each event from
    seq + 1 goes to `sink`. A broken or refused stream is resumed after a backoff
    (`_retry_delay_s`); a refusal for good (config, permission) ends the thread (`_disable`).
    `stop` cancels the stream it reads, joins it (bounded) and closes the client."""

    def __init__(
        self,
        client: MetadataClient,
        sink: EventSink,
        tenant: str,
        counters: dict[str, int],
        backoff: Backoff,
        name: str,
    ) -> None:
        self.client = client
        self.sink = sink
        self.tenant = tenant
        self.counters = counters  # "events", "gaps", "reconnects", "restarts" (and the owner's)
        self.backoff = backoff
        self.seq = 0  # the last event applied (or the state's seq after a resync)
        self.incarnation = 0  # of the index followed
        self.disabled = ""  # why the service refuses this reader ("" while it does not)
        self._need_resync = True
        self._stream: EventStream | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._stream is not None:
            self._stream.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.client.close()

    def _resync(self) -> None:
        """Rebuild the followed state; set seq (and incarnation) to what it covers."""
        raise NotImplementedError

    def _resync_due(self) -> bool:
        """Checked after each event: the state wants a resync although no event was lost."""
        return False

    def _disable(self, exc: KVStoreError) -> None:
        """The service refuses this reader for good; the thread ends after this."""
        logger.error("the metadata service refuses the event stream: %s", exc)

    def _retry_delay_s(self, exc: KVStoreError, attempt: int) -> float:
        """Unavailable, a stream cap, or a broken stream: how long to wait before resuming."""
        if not isinstance(exc, UnavailableError):
            logger.warning("%s: %s; resuming", self._thread.name, exc)
        self.counters["reconnects"] += 1
        return self.backoff.delay_s(attempt)

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                self._step()
            except (ConfigError, PermissionDeniedError) as exc:
                self.disabled = str(exc)
                self._disable(exc)
                return
            except KVStoreError as exc:
                self._stop.wait(self._retry_delay_s(exc, attempt))
                attempt += 1
            else:
                attempt = 0

    def _step(self) -> None:
        if not self._need_resync and self._restarted_afresh(self.client.stats()):
            logger.warning("the metadata service restarted without its state; resyncing")
            self.counters["restarts"] += 1
            self._need_resync = True
        if self._need_resync:
            self._resync()
            self._need_resync = False
        self._follow()

    def _restarted_afresh(self, stats: pb.StatsResponse) -> bool:
        """The service's events are numbered afresh (restarted without its state): resuming
        by seq would skip or misread them."""
        return stats.incarnation != self.incarnation or stats.last_event_seq < self.seq

    def _follow(self) -> None:
        """Apply events from seq + 1 until the stream ends, reports a gap or a resync is due
        (the stream is cancelled at once if stop came meanwhile)."""
        self._stream = stream = self.client.open_events(self.seq + 1, self.tenant)
        if self._stop.is_set():
            stream.cancel()
        for event in stream:
            if event.kind == pb.Event.KIND_GAP:
                logger.warning(
                    "%s: events up to seq %d were lost; resyncing", self._thread.name, event.seq
                )
                self.counters["gaps"] += 1
                self._need_resync = True
                break
            if event.seq > self.seq and event.kind in KINDS:
                tier = wire.PROTO_TO_TIER.get(event.tier, "host")
                self.sink.apply(KINDS[event.kind], event.tenant, event.key, event.node_id, tier)
                self.counters["events"] += 1
                self.seq = event.seq
            if self._resync_due():
                self._need_resync = True
                break
        stream.cancel()


class EventFollower(StreamThread):
    def __init__(
        self,
        client: MetadataClient,
        handler: EventHandler,
        tenant: str = "",  # "" every tenant (needs an all-tenant token)
        backoff: Backoff = RESUME_BACKOFF,
    ) -> None:
        counters = {"events": 0, "gaps": 0, "reconnects": 0, "restarts": 0}
        super().__init__(client, handler, tenant, counters, backoff, "event-follower")
        self.handler = handler

    def _resync(self) -> None:
        stats = self.client.stats()
        self.incarnation = stats.incarnation
        self.seq = self.handler.resync() or stats.last_event_seq
