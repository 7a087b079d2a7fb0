"""Prometheus metrics of the metadata service, in a registry of its own (one per server).

Runs in the metadata service process; served over HTTP by `start_http_server` when a metrics
port is configured. Gauges of blocks and nodes are read from the index at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.metrics_families import family_by_label

_LATENCY_BUCKETS_S = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)


class _IndexGauges(Collector):
    def __init__(self, stats: Callable[[], dict], nodes_alive: Callable[[], int]) -> None:
        self._stats = stats
        self._nodes_alive = nodes_alive

    def collect(self):
        stats = self._stats()
        yield family_by_label(
            GaugeMetricFamily,
            "kvstore_metadata_blocks",
            "Published blocks by tier",
            "tier",
            stats["blocks_per_tier"],
        )
        yield GaugeMetricFamily(
            "kvstore_metadata_nodes_alive", "Nodes with a live lease", value=self._nodes_alive()
        )


class MetadataMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = Counter(
            "kvstore_metadata_rpcs",
            "RPCs by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvstore_metadata_rpc_latency_seconds",
            "RPC handling time",
            ["method"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.lookup_chunks = Counter(
            "kvstore_metadata_lookup_chunks",
            "Chunks looked up, and hit",
            ["result"],
            registry=self.registry,
        )
        self.lookup_tokens = Counter(
            "kvstore_metadata_lookup_tokens",
            "Tokens looked up, and hit",
            ["result"],
            registry=self.registry,
        )
        self.events = Counter(
            "kvstore_metadata_events", "Block events by kind", ["kind"], registry=self.registry
        )
        self.evictions = Counter(
            "kvstore_metadata_evictions",
            "Blocks nodes unpublished (evicted or purged)",
            registry=self.registry,
        )
        self.expired_nodes = Counter(
            "kvstore_metadata_expired_nodes", "Nodes whose lease expired", registry=self.registry
        )
        # every lookup counts into these: `labels` per call costs 1 µs each, a child far less
        self._lookup_series = tuple(
            counter.labels(result)
            for counter in (self.lookup_chunks, self.lookup_tokens)
            for result in ("asked", "hit")
        )

    def watch_index(self, stats: Callable[[], dict], nodes_alive: Callable[[], int]) -> None:
        self.registry.register(_IndexGauges(stats, nodes_alive))

    def count_calls(self, method: str) -> Callable[[grpc.StatusCode], None]:
        """Counts a stream call (or lookup-port connection) of `method` by the status it
        opened (or failed) with."""
        return lambda code: self.rpcs.labels(method, code.name).inc()

    def observe_lookup(self, asked: int, hit: int, chunk_tokens: int) -> None:
        chunks_asked, chunks_hit, tokens_asked, tokens_hit = self._lookup_series
        chunks_asked.inc(asked)
        chunks_hit.inc(hit)
        if chunk_tokens:
            tokens_asked.inc(asked * chunk_tokens)
            tokens_hit.inc(hit * chunk_tokens)
