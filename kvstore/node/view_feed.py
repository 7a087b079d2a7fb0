"""Keeps the node agent's ClusterView following the metadata service: a snapshot, then the
WatchEvents stream from the snapshot's seq, resumed by seq after a broken stream. A KIND_GAP
(events lost), a service whose seq went backwards (restarted without its journal) or an overflow
that has drained away cause a new snapshot. Runs in one background thread of the node agent.
"""

from __future__ import annotations

import logging
import time

from kvstore.errors import (
    CapacityError,
    ConfigError,
    KVStoreError,
    PermissionDeniedError,
    UnavailableError,
)
from kvstore.metadata import wire
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.client.follow import StreamThread
from kvstore.node.identity import ALL_TENANTS
from kvstore.node.link import DEFAULT_BACKOFF
from kvstore.node.view import ClusterView
from kvstore.retry import Backoff
from kvstore.v1 import metadata_pb2 as pb

logger = logging.getLogger(__name__)
REFUSED_BACKOFF = Backoff(base_s=1.0, cap_s=60.0)  # each retry costs the service a snapshot
_KINDS = {pb.Event.KIND_STORED: "stored", pb.Event.KIND_REMOVED: "removed"}


class ViewFeed(StreamThread):
    def __init__(
        self,
        client: MetadataClient,
        view: ClusterView,
        resync_min_interval_s: float = 30.0,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        super().__init__(client, backoff, "view-feed")
        self.view = view
        self.resync_min_interval_s = resync_min_interval_s
        self._need_snapshot = True
        self._snapshot_at = 0.0

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                self._step()
                attempt = 0
            except (ConfigError, PermissionDeniedError) as exc:
                self._disable(exc)
                return
            except CapacityError as exc:  # no stream slot: a view not followed is stale
                logger.warning("view feed refused (%s); lookups ask the service meanwhile", exc)
                self.view.reset()
                self._need_snapshot = True
                self.view.counters["refused"] += 1
                self._stop.wait(REFUSED_BACKOFF.delay_s(attempt))
                attempt += 1
            except KVStoreError as exc:  # unavailable, or a stream broken mid-way
                if not isinstance(exc, UnavailableError):
                    logger.warning("view feed: %s; resuming", exc)
                self.view.counters["reconnects"] += 1
                self._stop.wait(self.backoff.delay_s(attempt))
                attempt += 1

    def _step(self) -> None:
        if self._need_snapshot:
            self._snapshot()
        elif self._restarted_afresh(self.client.stats()):
            logger.warning("the metadata service restarted without its state; resyncing")
            self.view.counters["restarts"] += 1
            self._need_snapshot = True
            return
        self._follow()

    def _snapshot(self) -> None:
        """A copy of each followed tenant's keys (every tenant's for a view of all), within
        the view's cap; the events are then followed from the oldest copy's seq (replayed
        over a newer copy they leave it as it was: each sets or clears one holder's bit)."""
        self.view.reset()
        seqs = []
        for tenant in _snapshot_tenants(self.view):
            room = self.view.max_keys - self.view.keys
            if room <= 0:  # the cap is spent: this tenant's misses ask the service
                self.view.overflowed = True
                continue
            for page in self.client.snapshot(tenant, max_keys=room):  # one page at least
                self.incarnation = page.incarnation
                self.view.load(page)
            seqs.append(page.last_seq)
        self.seq = min(seqs, default=0)
        self._need_snapshot = False
        self._snapshot_at = time.monotonic()
        self.view.synced()
        logger.info("view synced at seq %d: %d keys", self.seq, self.view.keys)

    def _follow(self) -> None:
        """Apply events from seq + 1 until the stream ends, a gap or a drained overflow."""
        stream = self._open_stream(_one_tenant(self.view))
        view = self.view
        for event in stream:
            if event.kind == pb.Event.KIND_GAP:
                logger.warning("view feed: events up to seq %d were lost; resyncing", event.seq)
                view.counters["gaps"] += 1
                self._need_snapshot = True
                break
            if event.seq > self.seq and event.kind in _KINDS:
                tier = wire.PROTO_TO_TIER.get(event.tier, "host")
                view.apply(_KINDS[event.kind], event.tenant, event.key, event.node_id, tier)
                view.counters["events"] += 1
                self.seq = event.seq
            if view.overflowed and self._overflow_drained():
                self._need_snapshot = True
                break
        stream.cancel()

    def _overflow_drained(self) -> bool:
        """After an overflow, a new snapshot once the view fell to half its cap (and the last
        one is old enough): it may then hold every key again."""
        return (
            self.view.keys < self.view.max_keys // 2
            and time.monotonic() - self._snapshot_at >= self.resync_min_interval_s
        )

    def _disable(self, exc: Exception) -> None:
        self.disabled = str(exc)
        self.view.reset()
        logger.warning("no cluster view (lookups ask the metadata service): %s", exc)


def _snapshot_tenants(view: ClusterView) -> list[str]:
    """What to copy: each followed tenant in turn, so that the cap counts their keys only;
    [""] (every tenant, in one copy) for a view of all (or of none: it keeps only the seq)."""
    return [""] if ALL_TENANTS in view.tenants or not view.tenants else sorted(view.tenants)


def _one_tenant(view: ClusterView) -> str:
    """The tenant to ask for when the view follows exactly one; "" (every tenant) otherwise."""
    if ALL_TENANTS in view.tenants or len(view.tenants) != 1:
        return ""
    return next(iter(view.tenants))
