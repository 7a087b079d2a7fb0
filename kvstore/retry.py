"""Retry with exponential backoff and jitter, as small injectable objects (after redis-py).

Used by the node agent's metadata link, in its own threads. Only UnavailableError is retried:
other errors mean the request itself is wrong and retrying cannot help.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvstore.errors import UnavailableError

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Delay before retry n (0-based): min(cap, base * 2**n), with full jitter."""

    base_s: float = 0.05
    cap_s: float = 5.0

    def delay_s(self, attempt: int, rng: random.Random = random._inst) -> float:
        return rng.uniform(0, min(self.cap_s, self.base_s * (2**attempt)))


@dataclass(frozen=True)
class Retry:
    """Call a function until it succeeds, `attempts` runs out, or `stop` is set."""

    backoff: Backoff = Backoff()
    attempts: int = 5

    def call(self, fn: Callable[[], T], stop: threading.Event | None = None) -> T:
        for attempt in range(self.attempts):
            try:
                return fn()
            except UnavailableError:
                if attempt == self.attempts - 1:
                    raise
                if stop is not None and stop.wait(self.backoff.delay_s(attempt)):
                    raise
                if stop is None:
                    threading.Event().wait(self.backoff.delay_s(attempt))
        raise AssertionError("unreachable")
