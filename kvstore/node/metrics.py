"""Prometheus metrics of one node agent, read from its store, sessions and fetcher at scrape
time (no bookkeeping on the hot path). Runs in the node agent process.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.metrics_families import family_by_label


class AgentCollector(Collector):
    """Turns `snapshot()` (NodeAgent.stats) into metric families."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self):
        stats = self._snapshot()
        yield from self._tiers(stats["tiers"])
        yield from self._requests(stats["requests"])
        yield from self._counters(stats)
        yield from self._view(stats.get("view") or {})
        yield from self._tenants(stats.get("tenants") or {})

    def _tiers(self, tiers: dict):
        blocks = GaugeMetricFamily(
            "kvstore_agent_blocks", "Blocks stored, by tier", labels=["tier"]
        )
        used = GaugeMetricFamily(
            "kvstore_agent_bytes", "Bytes of pages in use, by tier", labels=["tier"]
        )
        capacity = GaugeMetricFamily(
            "kvstore_agent_capacity_bytes", "Tier capacity", labels=["tier"]
        )
        for tier, usage in tiers.items():
            blocks.add_metric([tier], usage["used_blocks"])
            used.add_metric([tier], usage["used_pages"] * usage["page_size_bytes"])
            capacity.add_metric([tier], usage["capacity_pages"] * usage["page_size_bytes"])
        yield from (blocks, used, capacity)

    def _requests(self, requests: dict):
        lookups = CounterMetricFamily(
            "kvstore_agent_lookup_blocks",
            "Blocks asked for by lookups, by result",
            labels=["result"],
        )
        tokens = CounterMetricFamily(
            "kvstore_agent_lookup_tokens",
            "Prompt tokens of lookups that said how many tokens a key stands for, by result",
            labels=["result"],
        )
        for result in ("asked", "local_hit", "remote_hit"):
            lookups.add_metric([result], requests[f"lookup_{result}"])
            tokens.add_metric([result], requests[f"lookup_tokens_{result}"])
        loads = CounterMetricFamily(
            "kvstore_agent_loaded_blocks", "Blocks served to workers, by source", labels=["source"]
        )
        loads.add_metric(["local"], requests["load_local"])
        loads.add_metric(["remote"], requests["load_remote"])
        loads.add_metric(["miss"], requests["load_miss"])
        saves = CounterMetricFamily("kvstore_agent_saved_blocks", "Blocks committed by workers")
        saves.add_metric([], requests["saved"])
        yield from (lookups, tokens, loads, saves)

    def _counters(self, stats: dict):
        transfer = stats["transfer"]
        yield CounterMetricFamily(
            "kvstore_agent_fetched_bytes", "Bytes pulled from other nodes", value=transfer["bytes"]
        )
        yield CounterMetricFamily(
            "kvstore_agent_fetch_seconds",
            "Time spent pulling from other nodes",
            value=transfer["seconds"],
        )
        yield CounterMetricFamily(
            "kvstore_agent_checksum_failures",
            "Blocks discarded for a bad checksum",
            value=stats["checksum_failures"] + transfer["failures"],
        )
        yield family_by_label(
            CounterMetricFamily,
            "kvstore_agent_evictions",
            "Blocks removed from a tier",
            "tier",
            stats["evictions"],
        )
        yield CounterMetricFamily(
            "kvstore_agent_demoted_ahead_blocks",
            "Blocks the demotion thread wrote to disk to keep arena pages free",
            value=stats["demoted_ahead"],
        )
        yield GaugeMetricFamily("kvstore_agent_pins", "Pins held by workers", value=stats["pins"])
        yield GaugeMetricFamily(
            "kvstore_agent_workers", "Connected workers", value=stats["workers"]
        )
        yield GaugeMetricFamily(
            "kvstore_agent_metadata_connected",
            "1 while registered with the metadata service",
            value=1 if stats["metadata_connected"] else 0,
        )
        yield from self._bounds(stats)

    def _bounds(self, stats: dict):
        """What the agent refused or holds at its bounds (docs/security.md: Workers and tenants)."""
        yield family_by_label(
            CounterMetricFamily,
            "kvstore_agent_refused_connections",
            "Worker connections refused",
            "reason",
            stats["refused"],
        )
        yield GaugeMetricFamily(
            "kvstore_agent_orphaned_pages",
            "Pages still pinned for workers whose connection broke (until they exit)",
            value=stats["orphaned_pages"],
        )
        yield family_by_label(
            CounterMetricFamily,
            "kvstore_agent_publish_dropped_blocks",
            "Blocks the metadata service refused to index (quota, full, permission)",
            "cause",
            stats["dropped_by_cause"],
        )
        yield family_by_label(
            CounterMetricFamily,
            "kvstore_agent_transfer_events",
            "Transfer engine events: connections accepted/opened/refused at the caps, batches "
            "served/cut at the deadline, transfers broken, handshakes and MACs failed",
            "event",
            stats["transfer"].get("engine_events", {}),
        )

    def _tenants(self, tenants: dict):
        """Each tenant's pages: reserved by its saves, pinned by its loads, stored per tier;
        and how often its share of the arena or a reservation's TTL was reached."""
        pages = GaugeMetricFamily(
            "kvstore_agent_tenant_pages",
            "Pages per tenant: reserved (saves), pinned (loads), stored_<tier> (blocks)",
            labels=["tenant", "state"],
        )
        for tenant, states in tenants.get("pages", {}).items():
            for state, count in states.items():
                pages.add_metric([tenant, state], count)
        yield pages
        yield CounterMetricFamily(
            "kvstore_agent_share_refusals",
            "Reserves and pins refused: the tenant held its share of the arena",
            value=tenants.get("share_refusals", 0),
        )
        yield CounterMetricFamily(
            "kvstore_agent_expired_reservations",
            "Saves released because they were not committed within the reservation TTL",
            value=tenants.get("expired_reservations", 0),
        )

    def _view(self, view: dict):
        """The cluster view (node/view.py): its size and how lookups were answered."""
        if not view:
            return
        yield GaugeMetricFamily(
            "kvstore_agent_view_keys", "Keys in the cluster view", value=view["keys"]
        )
        yield GaugeMetricFamily(
            "kvstore_agent_view_bytes", "Memory of the cluster view", value=view["bytes"]
        )
        yield GaugeMetricFamily(
            "kvstore_agent_view_ready",
            "1 while the view follows the index",
            value=1 if view["ready"] else 0,
        )
        answers = CounterMetricFamily(
            "kvstore_agent_view_lookups", "Remote lookups, by who answered", labels=["answer"]
        )
        for answer in ("answered", "fallback_not_ready", "fallback_overflow"):
            answers.add_metric([answer], view.get(answer, 0))
        yield answers
        yield CounterMetricFamily(
            "kvstore_agent_view_corrections",
            "View entries dropped after a failed fetch",
            value=view.get("corrections", 0),
        )


def agent_registry(snapshot: Callable[[], dict]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(AgentCollector(snapshot))
    return registry
