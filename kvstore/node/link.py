"""The node agent's link to the metadata service: registration, and publishing the store's
events in batches, retrying with backoff (kvstore/retry.py) while the service is down.

Runs in one background thread of the node agent; heartbeats run in another (lease.py), so a
slow publish never delays one. Local hits never wait for either: events coalesce in a bounded
outbox (outbox.py) that is flushed every 0.2 s, or every 1 s once the service falls behind
(flush_pacing.py); after a lost lease, or events the feed or the outbox had no room for, the
whole store is re-published. A batch the service refuses for good (quota or journal full,
permission, invalid), and a store the outbox had no room for, is dropped and counted in
`dropped_blocks`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.errors import (
    CapacityError,
    ConfigError,
    KVStoreError,
    LeaseError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from kvstore.events import EventKind
from kvstore.metadata.client import LookupResult, MetadataClient
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.node.flush_pacing import FlushPacing
from kvstore.node.lease import LeaseKeeper
from kvstore.node.outbox import Batch, Outbox
from kvstore.retry import Backoff
from kvstore.store import TieredStore

logger = logging.getLogger(__name__)
DEFAULT_BACKOFF = Backoff(base_s=0.05, cap_s=2.0)
DEFAULT_MAX_PENDING = 1 << 18  # events waiting in the outbox: ~85 min of the trace's rate
MAX_INTERNAL_ATTEMPTS = 5  # an INTERNAL error may pass; after this many, the batch is dropped

# Refusals no retry can turn into success, each with the cause it is counted under.
_REFUSED: tuple[tuple[type[Exception], str], ...] = (
    (PermissionDeniedError, "permission"),
    (CapacityError, "capacity"),
    (ConfigError, "invalid"),
)


class MetadataLink:
    def __init__(
        self,
        client: MetadataClient,
        node: NodeRecord,
        store: TieredStore,
        lease_ttl_ms: int = 10_000,
        batch_max: int = 4096,
        backoff: Backoff = DEFAULT_BACKOFF,
        pacing: FlushPacing | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.client = client
        self.node = node
        self.store = store
        self.lease_ttl_ms = lease_ttl_ms
        self.batch_max = batch_max  # entries per call: the service's max_batch by default
        self.backoff = backoff
        self.pacing = pacing or FlushPacing(interval_s=min(lease_ttl_ms / 3000, 0.2))
        self.outbox = Outbox(max_pending)
        self.lease = LeaseKeeper(client, node.node_id, self._lease_lost)
        self.lease_id: int | None = None
        self.published = 0
        self.unpublished = 0
        self.dropped_blocks = 0
        self.dropped_by_cause: Counter[str] = Counter()
        self._internal_failures = 0
        self._dropped_seen = 0
        self._outbox_dropped_seen = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metadata-link", daemon=True)

    @property
    def connected(self) -> bool:
        return self.lease_id is not None

    def start(self) -> None:
        self.lease.start()
        self._thread.start()

    def flush(self) -> None:
        """Ask the link to publish pending events now, however far behind the service is."""
        self._wake.set()

    def lookup(
        self,
        tenant: str,
        keys: Sequence[bytes],
        timeout_s: float | None = None,
        chunk_tokens: int = 0,
    ) -> LookupResult | None:
        """Who else holds the leading `keys`; None while the service is unreachable or has not
        answered within `timeout_s` (the client's own timeout by default). `chunk_tokens`: the
        prompt tokens per key, for the service's token counters (0: not counted)."""
        try:
            return self.client.lookup(
                tenant,
                keys,
                caller_node_id=self.node.node_id,
                chunk_tokens=chunk_tokens,
                timeout_s=timeout_s,
            )
        except UnavailableError as exc:
            logger.debug("remote lookup skipped: %s", exc)
            return None

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._step()
                attempt = 0
                period_s = self.pacing.wait_s(time.monotonic() - started)
            except UnavailableError as exc:
                logger.debug("metadata service unavailable: %s", exc)
                period_s = self.backoff.delay_s(attempt)
                attempt += 1
            except (LeaseError, NotFoundError) as exc:
                logger.warning("lost the lease (%s); registering again", exc)
                self._forget_lease()
                period_s = 0
            except Exception as exc:
                logger.error("metadata link step failed: %s", exc)
                period_s = self.backoff.delay_s(attempt)
                attempt += 1
            self._wake.wait(period_s)
            self._wake.clear()

    def _step(self) -> None:
        if self.lease_id is None:
            self._register_and_resync()
        self._publish_events()

    def _lease_lost(self, lease_id: int) -> None:
        """From the lease keeper's thread: the service no longer knows `lease_id`."""
        if self.lease_id == lease_id:
            self.lease_id = None
        self._wake.set()

    def _forget_lease(self) -> None:
        self.lease_id = None
        self.lease.release()

    def _register_and_resync(self) -> None:
        """Register, forget whatever the service believed this node held (a restarted agent's
        arena is empty; events may have been dropped), then publish the store's inventory.
        Heartbeats start at once (a large inventory may take longer than a lease), but the
        lease counts as held only once all of it is published: a failure redoes it all."""
        node_id = self.node.node_id
        self.lease.release()
        lease_id, _ = self.client.register_node(self.node, self.lease_ttl_ms)
        self.client.deregister_node(node_id, lease_id)
        lease_id, self.lease_ttl_ms = self.client.register_node(self.node, self.lease_ttl_ms)
        self.lease.hold(lease_id, self.lease_ttl_ms)
        self.store.events.drain()  # the inventory below supersedes queued events
        self.outbox.clear()
        self._dropped_seen = self.store.events.dropped
        inventory = self.store.inventory()
        for tenant in sorted({tenant for _, _, tenant in inventory}):
            entries = [BlockEntry(k, tier) for k, tier, t in inventory if t == tenant]
            for start in range(0, len(entries), self.batch_max):
                batch = entries[start : start + self.batch_max]
                self._deliver(
                    lambda b=batch, t=tenant: self._count_published(
                        self.client.publish(node_id, lease_id, t, b)
                    ),
                    len(batch),
                    "publish",
                )
        self.lease_id = lease_id
        logger.info(
            "registered node %s (lease %d), %d blocks published", node_id, lease_id, len(inventory)
        )

    def _publish_events(self) -> None:
        """Everything pending, in batches of one kind and tenant; a batch that could not be
        sent goes back to the outbox for the next try."""
        if self.store.events.dropped != self._dropped_seen:
            logger.warning("event feed overflowed; re-publishing the whole store")
            self._forget_lease()
            return
        self.outbox.add(self.store.events.drain())
        self._count_outbox_drops()
        if self.outbox.overflowed:
            logger.warning("%d evictions pending; re-publishing the whole store", len(self.outbox))
            self._forget_lease()
            return
        while (batch := self.outbox.take(self.batch_max)) is not None:
            try:
                self._deliver(lambda b=batch: self._send(b), len(batch.events), str(batch.kind))
            except BaseException:
                self.outbox.restore(batch)
                raise

    def _count_outbox_drops(self) -> None:
        """Stores the outbox had no room for: never published (a miss elsewhere, not wrong KV)."""
        dropped = self.outbox.dropped - self._outbox_dropped_seen
        if dropped:
            self._outbox_dropped_seen = self.outbox.dropped
            error = CapacityError(f"{self.outbox.max_pending} events already pending")
            self._drop(dropped, "publish", "backlog", error)

    def _deliver(self, send: Callable[[], None], count: int, what: str) -> None:
        """Send one batch. Returns when it was accepted or dropped; raises what a later retry
        can fix: UnavailableError (the loop backs off), lease errors (it registers again),
        and the first MAX_INTERNAL_ATTEMPTS - 1 INTERNAL errors of this batch."""
        try:
            send()
            self._internal_failures = 0
        except (LeaseError, NotFoundError, UnavailableError):
            raise
        except KVStoreError as exc:
            cause = next((c for cls, c in _REFUSED if isinstance(exc, cls)), "internal")
            if cause == "internal":
                self._internal_failures += 1
                if self._internal_failures < MAX_INTERNAL_ATTEMPTS:
                    raise
            self._internal_failures = 0
            self._drop(count, what, cause, exc)

    def _drop(self, count: int, what: str, cause: str, exc: Exception) -> None:
        """Count a refused batch; log a cause the first time only (a full quota refuses every
        batch after it, and a log line per batch would flood the agent's log)."""
        self.dropped_blocks += count
        self.dropped_by_cause[cause] += count
        if self.dropped_by_cause[cause] == count:
            logger.error(
                "dropping %s batches the metadata service refuses (%s): %s; counted "
                "in dropped_blocks, logged once",
                what,
                cause,
                exc,
            )
        else:
            logger.debug("dropped %d %s entries (%s): %s", count, what, cause, exc)

    def _count_published(self, accepted: int) -> None:
        self.published += accepted

    def _send(self, batch: Batch) -> None:
        entries = [BlockEntry(e.key, e.tier, e.size_bytes) for e in batch.events]
        node_id, tenant = self.node.node_id, batch.tenant
        if batch.kind is EventKind.STORED:
            self._count_published(self.client.publish(node_id, self.lease_id, tenant, entries))
        else:
            self.unpublished += self.client.unpublish(node_id, self.lease_id, tenant, entries)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.lease.stop()
        if deregister and self.lease_id is not None:
            try:
                self.client.deregister_node(self.node.node_id, self.lease_id)
            except KVStoreError as exc:
                logger.info("could not deregister on shutdown: %s", exc)
        self.client.close()
