"""Follows the metadata service's WatchEvents stream for a reader outside the node agent: resumes
by seq after a broken stream, and asks its handler to resync where events were lost (KIND_GAP, or
a service restarted without its state). Runs in one background thread of its owner (the vLLM
connector's scheduler process, or `kvstore events`). StreamThread, the thread and stream both
this follower and the node agent's view feed (kvstore/node/view_feed.py) run on, is here too.
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


class EventHandler(Protocol):
    def resync(self) -> int:
        """Events were lost (or this is the start): rebuild; returns the last seq the rebuilt
        state covers (0: none, follow only new events)."""

    def apply(self, kind: str, tenant: str, key: bytes, node_id: str, tier: str) -> None:
        """One stored/removed event, in seq order, each at most once after a resync."""


class StreamThread:
    """One background thread reading the WatchEvents stream of `client` from `seq` + 1: its
    subclass's `_run` loops; `stop` cancels the stream it reads, joins it (bounded) and closes
    the client."""

    def __init__(self, client: MetadataClient, backoff: Backoff, name: str) -> None:
        self.client = client
        self.backoff = backoff
        self.seq = 0  # the last event applied (or the state's seq after a resync)
        self.incarnation = 0  # of the index followed
        self.disabled = ""  # why the service refuses this reader ("" while it does not)
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

    def _run(self) -> None:
        raise NotImplementedError

    def _restarted_afresh(self, stats) -> bool:
        """The service's events are numbered afresh (restarted without its state): resuming
        by seq would skip or misread them."""
        return stats.incarnation != self.incarnation or stats.last_event_seq < self.seq

    def _open_stream(self, tenant: str) -> EventStream:
        """The stream from seq + 1 (cancelled at once if stop came meanwhile)."""
        self._stream = stream = self.client.open_events(self.seq + 1, tenant)
        if self._stop.is_set():
            stream.cancel()
        return stream


class EventFollower(StreamThread):
    def __init__(
        self,
        client: MetadataClient,
        handler: EventHandler,
        tenant: str = "",
        backoff: Backoff = RESUME_BACKOFF,
    ) -> None:
        super().__init__(client, backoff, "event-follower")
        self.handler = handler
        self.tenant = tenant  # "" every tenant (needs an all-tenant token)
        self.counters = {"events": 0, "gaps": 0, "reconnects": 0, "restarts": 0}
        self._need_resync = True

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                self._step()
                attempt = 0
            except (ConfigError, PermissionDeniedError) as exc:
                self.disabled = str(exc)
                logger.error("the metadata service refuses the event stream: %s", exc)
                return
            except KVStoreError as exc:  # unavailable, a stream cap, or a broken stream
                if not isinstance(exc, UnavailableError):
                    logger.warning("event stream: %s; resuming", exc)
                self.counters["reconnects"] += 1
                self._stop.wait(self.backoff.delay_s(attempt))
                attempt += 1

    def _step(self) -> None:
        stats = self.client.stats()
        if not self._need_resync and self._restarted_afresh(stats):
            logger.warning("the metadata service restarted without its state; resyncing")
            self.counters["restarts"] += 1
            self._need_resync = True
        if self._need_resync:
            self.incarnation = stats.incarnation
            self.seq = self.handler.resync() or stats.last_event_seq
            self._need_resync = False
        self._follow()

    def _follow(self) -> None:
        """Apply events from seq + 1 until the stream ends or reports a gap."""
        stream = self._open_stream(self.tenant)
        for event in stream:
            if event.kind == pb.Event.KIND_GAP:
                logger.warning("events up to seq %d were lost; resyncing", event.seq)
                self.counters["gaps"] += 1
                self._need_resync = True
                break
            if event.seq > self.seq and event.kind in KINDS:
                tier = wire.PROTO_TO_TIER.get(event.tier, "host")
                self.handler.apply(KINDS[event.kind], event.tenant, event.key, event.node_id, tier)
                self.counters["events"] += 1
                self.seq = event.seq
        stream.cancel()
