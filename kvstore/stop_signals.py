"""SIGTERM and SIGINT for the main thread of every kvstore process that runs until stopped
(`kvstore serve`, `node`, `metadata`, `events`, the chaos bench's workers), heard without a
lock a signal handler could deadlock on.
"""

from __future__ import annotations

import signal
import socket
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM and SIGINT, heard without a lock: the handlers do nothing, the interpreter
    writes each signal's number to a socket (set_wakeup_fd) that `wait` reads. A handler that
    took a lock (Event.set) deadlocked for good when the signal landed while the main thread
    held that lock inside Event.wait: one `kvstore serve` never exited. The main thread's,
    as a context manager; `is_set` and `wait` as on a threading.Event (wait: main thread)."""

    def __init__(self) -> None:
        self._stopped = False
        self._wake: socket.socket | None = None
        self._wakeup_fd: socket.socket | None = None
        self._previous_fd = -1

    def __enter__(self) -> StopSignals:
        self._wake, self._wakeup_fd = socket.socketpair()
        self._wakeup_fd.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._wakeup_fd.fileno())  # none lost
        for signum in STOP_SIGNALS:
            signal.signal(signum, _ignore)  # later ones too: shutdown is under way
        return self

    def __exit__(self, *exc_info: object) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        self._wake.close()
        self._wakeup_fd.close()

    def is_set(self) -> bool:
        return self._stopped

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop signal has arrived (True) or `timeout` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stopped:
            left_s = None if deadline is None else deadline - time.monotonic()
            if left_s is not None and left_s <= 0:
                return False
            self._wake.settimeout(left_s)
            try:
                signum = self._wake.recv(1)[0]
            except TimeoutError:
                return False
            self._stopped = signum in STOP_SIGNALS  # other handled signals wake it too
        return True


def _ignore(signum: int, frame: object) -> None:
    """A stop signal's handler: StopSignals hears it through its wakeup socket."""
