"""When a node's outbox (outbox.py) is flushed to the metadata service: every `interval_s`
while the service keeps up, every `coalesce_s` once it falls behind, so that a loaded service
gets one large batch per node every second or two instead of many small ones (its cost is per
call, not per key: docs/scale.md).

A value object, used by the node agent's metadata link (link.py) and by `kvstore bench
scale`'s simulated agents, in whichever thread flushes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError


@dataclass(frozen=True)
class FlushPacing:
    interval_s: float = 0.2  # between flushes while the service keeps up
    coalesce_s: float = 1.0  # between flushes while it is behind (1-2 s)
    behind_s: float = 0.05  # a flush whose calls took longer: the service is behind

    def __post_init__(self) -> None:
        if not 0 < self.interval_s <= self.coalesce_s:
            raise ConfigError("flush pacing needs 0 < interval_s <= coalesce_s")
        if self.behind_s <= 0:
            raise ConfigError("flush pacing needs behind_s > 0")

    def wait_s(self, flush_s: float, failed: bool = False) -> float:
        """How long to wait after a flush whose calls took `flush_s` (`failed`: one of them
        did not get an answer, or the answer said the service is overloaded)."""
        behind = failed or flush_s > self.behind_s
        return max(0.0, (self.coalesce_s if behind else self.interval_s) - flush_s)
