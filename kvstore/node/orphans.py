"""Sessions whose worker connection broke while the worker may still be alive.

Runs in the node agent (one reaper thread). A worker copies from the zero-copy views of the
pages it loaded; if its connection breaks (a timeout, a bug, a restarted client) the process
may still be copying. Unpinning then would let another save reuse a page under a live view,
so a broken session keeps every pin and reservation until its process is known to have exited
(a pidfd, immune to pid reuse) or until `ttl_s` passes, far longer than any copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from dataclasses import dataclass

from kvstore.node.identity import WorkerIdentity
from kvstore.node.session import WorkerSession

logger = logging.getLogger(__name__)
_REAP_INTERVAL_S = 0.5


def open_pidfd(pid: int) -> int | None:
    """A pidfd for `pid`, or None (pid 0: outside our pid namespace; or already gone)."""
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def process_exited(pidfd: int | None) -> bool:
    """Whether the process behind `pidfd` has exited (a pidfd polls readable then)."""
    if pidfd is None:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


@dataclass
class _Orphan:
    session: WorkerSession
    pidfd: int | None
    expires_at: float


class OrphanedSessions:
    """Holds broken sessions' pins until their worker exits or their lease runs out."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._orphans: list[_Orphan] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orphan-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def adopt(self, session: WorkerSession, pidfd: int | None) -> None:
        """Take over a session whose connection ended; frees it now if its process is gone,
        or if it is a private worker's (it never maps arena pages: nothing reads them)."""
        if session.private is not None or process_exited(pidfd) or not session.pages_held():
            _finish(session, pidfd)
            return
        logger.info(
            "worker %s disconnected holding %d pages; they stay pinned until it exits "
            "(at most %.0f s)",
            session.name or "?",
            session.pages_held(),
            self.ttl_s,
        )
        with self._lock:
            self._orphans.append(_Orphan(session, pidfd, time.monotonic() + self.ttl_s))

    def pages_held(self) -> int:
        with self._lock:
            return sum(orphan.session.pages_held() for orphan in self._orphans)

    def pages_held_by(self, identity: WorkerIdentity) -> int:
        """Pages the broken sessions of workers authenticated as `identity` (the same way,
        for the same tenants) still hold."""
        key = _identity_key(identity)
        with self._lock:
            return sum(
                o.session.pages_held()
                for o in self._orphans
                if _identity_key(o.session.identity) == key
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._orphans)

    def reap(self) -> int:
        """Free the sessions whose process exited or whose lease ran out; returns how many."""
        now = time.monotonic()
        with self._lock:
            done = [o for o in self._orphans if now >= o.expires_at or process_exited(o.pidfd)]
            self._orphans = [o for o in self._orphans if o not in done]
        for orphan in done:
            _finish(orphan.session, orphan.pidfd)
        return len(done)

    def _run(self) -> None:
        while not self._stop.wait(_REAP_INTERVAL_S):
            self.reap()

    def stop(self) -> None:
        """Free every held session (the agent is stopping: no page outlives it anyway)."""
        self._stop.set()
        with self._lock:
            orphans, self._orphans = self._orphans, []
        for orphan in orphans:
            _finish(orphan.session, orphan.pidfd)


def _identity_key(identity: WorkerIdentity) -> tuple[str, frozenset[str]]:
    return identity.via, identity.tenants


def _finish(session: WorkerSession, pidfd: int | None) -> None:
    session.close()
    if pidfd is not None:
        with contextlib.suppress(OSError):
            os.close(pidfd)
