"""The adapter's running counters, reported through LMCache's `report_status` (and so its
HTTP /status). Runs in the `lmcache server` process; thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter

COUNTERS = (
    "lookup_keys",  # keys LMCache asked about
    "found_keys",  # of those, held by this host or another node
    "load_keys",  # keys LMCache asked to load
    "loaded_keys",  # of those, copied into LMCache's memory, verified
    "loaded_bytes",
    "stored_keys",  # objects written into kvstore (not those it held already)
    "stored_bytes",
    "checksum_mismatches",  # blocks whose copy did not match their checksum: misses
    "unfit_blocks",  # blocks of another size than the object they were loaded for: misses
)


class AdapterStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()

    def count(self, **deltas: int) -> None:
        with self._lock:
            self._totals.update(deltas)

    def totals(self) -> dict[str, int]:
        with self._lock:
            return {name: self._totals[name] for name in COUNTERS}
