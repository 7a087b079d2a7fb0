"""The backend's counters: running totals of hits, misses and bytes, and the per-interval
page counts and bandwidths SGLang's StorageMetrics histograms take. Thread-safe."""

from __future__ import annotations

import threading
from collections import Counter


class BackendStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()
        self._interval = self._empty_interval()

    @staticmethod
    def _empty_interval() -> dict[str, list]:
        return {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    def count(self, **deltas: int) -> None:
        with self._lock:
            self._totals.update(deltas)

    def record_get(self, pages: int, failed: int, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._totals.update(get_pages=pages, get_failed_pages=failed, loaded_bytes=num_bytes)
            self._interval["prefetch_pgs"].append(pages)
            self._interval["prefetch_bandwidth"].append(num_bytes / 1e9 / max(seconds, 1e-9))

    def record_set(self, pages: int, failed: int, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._totals.update(set_pages=pages, set_failed_pages=failed, saved_bytes=num_bytes)
            self._interval["backup_pgs"].append(pages)
            self._interval["backup_bandwidth"].append(num_bytes / 1e9 / max(seconds, 1e-9))

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._totals)

    def take(self):
        """SGLang's StorageMetrics of the interval (a new one starts), bandwidths in GB/s,
        with the running totals as `.totals`. SGLang's collector asserts the type."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            interval, self._interval = self._interval, self._empty_interval()
            totals = dict(self._totals)
        metrics = StorageMetrics(**interval)
        metrics.totals = totals
        return metrics
