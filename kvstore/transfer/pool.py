"""Idle fetch connections kept per peer, for the transfer engines to reuse.

Runs inside the node agent, on whichever threads fetch; thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

C = TypeVar("C")


class IdlePool(Generic[C]):
    """At most `per_peer` idle connections per peer address, most recently pooled taken first.

    `usable(conn)` says whether a pooled connection is still fit to send on (it is checked on
    `take`, outside the lock); `drop(conn)` closes one the pool does not keep.
    """

    def __init__(
        self, per_peer: int, usable: Callable[[C], bool], drop: Callable[[C], None]
    ) -> None:
        self._per_peer = per_peer
        self._usable = usable
        self._drop = drop
        self._lock = threading.Lock()
        self._idle: dict[str, list[C]] = {}  # under the lock
        self._closed = False

    def take(self, address: str) -> C | None:
        """A usable idle connection to `address`, or None; unusable ones met are dropped."""
        while True:
            with self._lock:
                idle = self._idle.get(address)
                if not idle:
                    return None
                conn = idle.pop()
            if self._usable(conn):
                return conn
            self._drop(conn)

    def put(self, address: str, conn: C) -> None:
        """Keep `conn` for the next fetch from `address`; dropped when full or drained."""
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self._per_peer:
                idle.append(conn)
                return
        self._drop(conn)

    def drain(self) -> list[C]:
        """Empty the pool for good (later `put`s drop); the caller closes what it returns."""
        with self._lock:
            self._closed = True
            idle = [conn for conns in self._idle.values() for conn in conns]
            self._idle.clear()
        return idle
