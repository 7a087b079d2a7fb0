"""The host arena's pages allocated ahead of their first use, by the agent, in the background.

The arena file is sparse: a page is allocated (and zeroed) by the kernel when something first
writes it. In a fresh arena that writer is a worker saving KV inside its forward pass: measured
here, 56 MiB copied (and hashed) into fresh /dev/shm pages took 111 ms, 53 ms into pages
allocated but not yet mapped by the writer, 8.7 ms into mapped ones; a cold node's first
prompts reached their first token ~17 % later than with no connector.
The allocator hands out never-used pages from the lowest up (page_runs.py: the free run past
every page used so far is taken from its start), so the agent keeps the pages from there to
`ahead_bytes` further allocated (fallocate), off any request's path; a worker's prefault thread
(prefault.py) then maps them, resident by then, before a forward writes them. The pages are
charged to the agent, which owns the arena, never to the first worker that writes them; the
arena's far end stays a hole until the cache grows that far.

Runs in a daemon thread of the node agent (the process that owns the arena: host.py).
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

STEP_BYTES = 64 << 20  # per fallocate call: the thread can stop between calls
AHEAD_MIN_BYTES = 256 << 20
AHEAD_FRACTION = 16  # ahead: the larger of AHEAD_MIN_BYTES and 1/AHEAD_FRACTION of the arena


def default_ahead_bytes(size_bytes: int) -> int:
    return min(size_bytes, max(AHEAD_MIN_BYTES, size_bytes // AHEAD_FRACTION))


class ArenaGrowth:
    """Keeps bytes [0, used + ahead_bytes) of the file `fd` (of `size_bytes`) allocated, where
    `used` is the end of the pages handed out so far (`used_up_to`), until `stop`."""

    def __init__(self, fd: int, size_bytes: int, ahead_bytes: int) -> None:
        self.fd = fd
        self.size_bytes = size_bytes
        self.ahead_bytes = ahead_bytes
        self.allocated_bytes = 0
        self._target = min(size_bytes, ahead_bytes)
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvstore-arena-growth", daemon=True)
        self._thread.start()

    def used_up_to(self, stop_bytes: int) -> None:
        """Bytes up to `stop_bytes` are handed out: allocate `ahead_bytes` past them."""
        target = min(self.size_bytes, stop_bytes + self.ahead_bytes)
        if target <= self._target:
            return
        with self._wake:
            self._target = max(self._target, target)
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopped or self._target > self.allocated_bytes)
                if self._stopped:
                    return
                stop = min(self._target, self.allocated_bytes + STEP_BYTES)
            try:
                os.posix_fallocate(self.fd, self.allocated_bytes, stop - self.allocated_bytes)
            except OSError as exc:  # no room (or no fallocate here): pages fault in as written
                logger.warning("arena pages not allocated ahead: %s", exc)
                return
            self.allocated_bytes = stop
