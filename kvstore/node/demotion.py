"""The node agent's demotion thread: keeps some of the host arena's pages free by writing the
eviction policy's next victims to the disk tier ahead of need, with the store lock released
(TieredStore.demote_ahead), so a worker's save takes a free page instead of waiting for a
disk write. Runs in the node agent when it has a disk tier.
"""

from __future__ import annotations

import logging
import threading

from kvstore.store import TieredStore

logger = logging.getLogger(__name__)

POLL_S = 0.01  # how often the free pages are checked (a check is a few microseconds)
BACKOFF_S = 1.0  # after a failure (a full disk of pinned blocks, LMDB's map full)
STOP_S = 10.0  # stop waits this long for a block being written down; then leaves it running
AUTO_FRACTION = 32  # host_free_pages -1: 1/32 of the arena (none for arenas under 32 pages)


def free_pages_target(setting: int, capacity_pages: int) -> int:
    """Pages to keep free: `setting` (at most half the arena), or for -1, 1/32 of it (3 %)."""
    return capacity_pages // AUTO_FRACTION if setting < 0 else min(setting, capacity_pages // 2)


class DemotionThread:
    """Calls `store.demote_ahead(free_pages)` every POLL_S until stopped; an error is logged
    and retried after BACKOFF_S (an eviction a save needs still happens, under the lock)."""

    def __init__(self, store: TieredStore, free_pages: int) -> None:
        self.store = store
        self.free_pages = free_pages
        self.written = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-demotion", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop, waiting up to `timeout_s` (STOP_S) for a block being written down. False when
        the write still runs (a hung disk): the caller must not close the disk tier under it;
        the process's exit ends it."""
        timeout_s = STOP_S if timeout_s is None else timeout_s
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error(
                "a block is still being written to the disk tier %.0f s after the "
                "stop; the disk tier is left open",
                timeout_s,
            )
            return False
        return True

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                self.written += self.store.demote_ahead(self.free_pages, self._stopped)
            except Exception:  # the agent keeps serving: a save that needs a page evicts itself
                logger.exception("demotion ahead failed; retrying in %.0f s", BACKOFF_S)
                self._stopped.wait(BACKOFF_S)
