"""The node agent's lease on the metadata service: heartbeats every third of the lease, on a
thread of their own, so that no publish, however slow the service is to take it, delays one.

Runs in one background thread of the node agent, beside the metadata link's (link.py), which
registers the node and hands the lease over; a lease the service no longer knows is handed
back to the link (`on_lost`) to register again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.errors import KVStoreError, LeaseError, NotFoundError
from kvstore.metadata.client import MetadataClient

logger = logging.getLogger(__name__)
RETRY_S = 0.2  # after a failed heartbeat (the lease has two more periods to live)


class LeaseKeeper:
    """Heartbeats `node_id`'s lease while one is `hold`-ing; `late` counts heartbeats sent
    after the lease's whole ttl had passed since the last acknowledged one."""

    def __init__(
        self, client: MetadataClient, node_id: str, on_lost: Callable[[int], None]
    ) -> None:
        self.client = client
        self.node_id = node_id
        self.on_lost = on_lost  # called with the lost lease id, from this thread
        self.heartbeats = 0
        self.late = 0
        self._lease: tuple[int, float] | None = None  # (lease id, ttl in s)
        self._acked_at = 0.0
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metadata-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def hold(self, lease_id: int, ttl_ms: int) -> None:
        """Keep `lease_id` alive from now (the link has just registered)."""
        self._lease = (lease_id, ttl_ms / 1000)
        self._acked_at = time.monotonic()
        self._changed.set()

    def release(self) -> None:
        """Stop heartbeating (the link registers again, or stops)."""
        self._lease = None
        self._changed.set()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            lease = self._lease
            wait_s = None if lease is None else self._beat(*lease)
            self._changed.wait(wait_s)
            self._changed.clear()

    def _beat(self, lease_id: int, ttl_s: float) -> float:
        """One heartbeat; returns how long to wait for the next."""
        self.heartbeats += 1
        if time.monotonic() - self._acked_at > ttl_s:
            self.late += 1
        try:
            self.client.heartbeat(self.node_id, lease_id, timeout_s=ttl_s / 3)
        except (LeaseError, NotFoundError) as exc:
            logger.warning("lost the lease (%s); registering again", exc)
            if self._lease is not None and self._lease[0] == lease_id:
                self._lease = None
                self.on_lost(lease_id)
            return 0
        except KVStoreError as exc:
            logger.debug("heartbeat failed: %s", exc)
            return RETRY_S
        self._acked_at = time.monotonic()
        return ttl_s / 3
