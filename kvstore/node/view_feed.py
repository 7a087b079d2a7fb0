"""Keeps the node agent's ClusterView following the metadata service: a snapshot, then the
WatchEvents stream from the snapshot's seq, resumed by seq after a broken stream (the
EventFollower's loop). A KIND_GAP (events lost), a service whose seq went backwards (restarted
without its journal) or an overflow that has drained away cause a new snapshot. Runs in one
background thread of the node agent.
"""

from __future__ import annotations

import logging
import time

from kvstore.metadata.client import MetadataClient
from kvstore.metadata.follow import EventFollower, EventHandler
from kvstore.node.identity import ALL_TENANTS
from kvstore.node.link import DEFAULT_BACKOFF
from kvstore.node.view import ClusterView
from kvstore.retry import Backoff

logger = logging.getLogger(__name__)


class ViewFeed(EventHandler):
    def __init__(
        self, client: MetadataClient, view: ClusterView, resync_min_interval_s: float = 30.0,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:  # fmt: skip
        self.view = view
        self.resync_min_interval_s = resync_min_interval_s
        self._snapshot_at = 0.0
        self._follower = EventFollower(client, self, _one_tenant(view), backoff,
                                       counters=view.counters, name="view-feed")  # fmt: skip

    @property
    def seq(self) -> int:
        """The last event applied (or the snapshot's seq)."""
        return self._follower.seq

    @property
    def disabled(self) -> str:
        """Why the service cannot feed a view ("" while it can)."""
        return self._follower.disabled

    def start(self) -> None:
        self._follower.start()

    def stop(self) -> None:
        self._follower.stop()

    # ---- the follower's handler ------------------------------------------------------------
    def resync(self) -> int:
        self.view.reset()
        last_seq = 0
        client = self._follower.client
        for page in client.snapshot(self._follower.tenant, max_keys=self.view.max_keys):
            last_seq, self._follower.incarnation = page.last_seq, page.incarnation
            self.view.load(page)
        self._snapshot_at = time.monotonic()
        self.view.synced()
        logger.info("view synced at seq %d: %d keys", last_seq, self.view.keys)
        return last_seq

    def apply(self, kind: str, tenant: str, key: bytes, node_id: str, tier: str) -> None:
        self.view.apply(kind, tenant, key, node_id, tier)

    def needs_resync(self) -> bool:
        """After an overflow, a new snapshot once the view fell to half its cap (and the last
        one is old enough): it may then hold every key again."""
        return (
            self.view.overflowed
            and self.view.keys < self.view.max_keys // 2
            and time.monotonic() - self._snapshot_at >= self.resync_min_interval_s
        )

    def on_refused(self, exc: Exception) -> None:
        logger.warning("view feed refused (%s); lookups ask the service meanwhile", exc)
        self.view.reset()  # a view not followed is stale

    def on_disabled(self, exc: Exception) -> None:
        self.view.reset()
        logger.warning("no cluster view (lookups ask the metadata service): %s", exc)


def _one_tenant(view: ClusterView) -> str:
    """The tenant to ask for when the view follows exactly one; "" (every tenant) otherwise."""
    if ALL_TENANTS in view.tenants or len(view.tenants) != 1:
        return ""
    return next(iter(view.tenants))
