"""Keeps the node agent's ClusterView following the metadata service: a snapshot, then the
WatchEvents stream from the snapshot's seq, resumed by seq after a broken stream. A KIND_GAP
(events lost), a service whose seq went backwards (restarted without its journal) or an overflow
that has drained away cause a new snapshot (the stream loop is StreamThread's, in
kvstore/metadata/client/follow.py). Runs in one background thread of the node agent.
"""

from __future__ import annotations

import logging
import time

from kvstore.errors import CapacityError, KVStoreError
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.client.follow import StreamThread
from kvstore.node.identity import ALL_TENANTS
from kvstore.node.link import DEFAULT_BACKOFF
from kvstore.node.view import ClusterView
from kvstore.retry import Backoff

logger = logging.getLogger(__name__)
REFUSED_BACKOFF = Backoff(base_s=1.0, cap_s=60.0)  # each retry costs the service a snapshot


class ViewFeed(StreamThread):
    def __init__(
        self,
        client: MetadataClient,
        view: ClusterView,
        resync_min_interval_s: float = 30.0,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        super().__init__(client, view, _one_tenant(view), view.counters, backoff, "view-feed")
        self.view = view
        self.resync_min_interval_s = resync_min_interval_s
        self._snapshot_at = 0.0

    def _resync(self) -> None:
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
        self._snapshot_at = time.monotonic()
        self.view.synced()
        logger.info("view synced at seq %d: %d keys", self.seq, self.view.keys)

    def _resync_due(self) -> bool:
        """After an overflow, a new snapshot once the view fell to half its cap (and the last
        one is old enough): it may then hold every key again."""
        return (
            self.view.overflowed
            and self.view.keys < self.view.max_keys // 2
            and time.monotonic() - self._snapshot_at >= self.resync_min_interval_s
        )

    def _disable(self, exc: KVStoreError) -> None:
        self.view.reset()
        logger.warning("no cluster view (lookups ask the metadata service): %s", exc)

    def _retry_delay_s(self, exc: KVStoreError, attempt: int) -> float:
        """No stream slot (CapacityError): a view not followed is stale, so it is dropped
        and a snapshot taken once a slot is had; a longer backoff, as each costs the service
        a snapshot. Anything else resumes as StreamThread does."""
        if not isinstance(exc, CapacityError):
            return super()._retry_delay_s(exc, attempt)
        logger.warning("view feed refused (%s); lookups ask the service meanwhile", exc)
        self.view.reset()
        self._need_resync = True
        self.counters["refused"] += 1
        return REFUSED_BACKOFF.delay_s(attempt)


def _snapshot_tenants(view: ClusterView) -> list[str]:
    """What to copy: each followed tenant in turn, so that the cap counts their keys only;
    [""] (every tenant, in one copy) for a view of all (or of none: it keeps only the seq)."""
    return [""] if ALL_TENANTS in view.tenants or not view.tenants else sorted(view.tenants)


def _one_tenant(view: ClusterView) -> str:
    """The tenant to ask for when the view follows exactly one; "" (every tenant) otherwise."""
    if ALL_TENANTS in view.tenants or len(view.tenants) != 1:
        return ""
    return next(iter(view.tenants))
