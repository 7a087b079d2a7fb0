"""Finished tasks of one kind (store, lookup or load) and the eventfd that tells LMCache's
controller threads about them: LMCache polls the fd, then pops the results.

Runs in the `lmcache server` process: the adapter's threads finish tasks, LMCache's store and
prefetch controller threads pop them. Thread-safe.
"""

from __future__ import annotations

import threading
from typing import Any

from lmcache.v1.platform import create_event_notifier


class Completions:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results: dict[int, Any] = {}
        self._notifier = create_event_notifier()

    def fileno(self) -> int:
        """A descriptor of its own (LMCache routes events by fd), readable after `finish`."""
        return self._notifier.fileno()

    def finish(self, task_id: int, result: Any) -> None:
        with self._lock:
            self._results[task_id] = result
        self._notifier.notify()

    def pop(self, task_id: int) -> Any | None:
        """The task's result once, then None (also None while it runs)."""
        with self._lock:
            return self._results.pop(task_id, None)

    def pop_all(self) -> dict[int, Any]:
        with self._lock:
            results, self._results = self._results, {}
        return results

    def close(self) -> None:
        self._notifier.close()
