"""The index interface of the metadata service: nodes with leases, block holdings, events.

Implemented by the embedded in-memory/LMDB index and the Redis index; run inside the metadata
service process, called from many threads at once and, where `nonblocking_reads`, from the
gRPC loop for reads (implementations lock). An index whose reads wait on I/O may offer
`LoopLookups` instead: lookups awaited on the loop. Inputs arrive validated by the service; the
index enforces leases and quotas.
"""

from __future__ import annotations

import asyncio
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvstore.errors import ConfigError
from kvstore.metadata.records import BlockEntry, EventPage, Holding, NodeRecord

# a lookup's holdings (MetadataIndex.lookup) and the live records of their holders
Found = tuple[list[Sequence[Holding]], dict[str, NodeRecord]]


class LoopLookups(ABC):
    """An index's lookups awaited on an event loop, never blocking it (its I/O is the loop's).
    Built off the loop by `MetadataIndex.loop_lookups`; used on one loop only."""

    @abstractmethod
    async def lookup(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> Found | None:
        """What `MetadataIndex.lookup` answers, with `live_addresses` restricted to the holders
        found. None: not answerable on the loop now (a server moved or failed: ask the index
        itself, off the loop, then `refresh`). UnavailableError where a server is too slow."""

    keeps = False  # whether `lookup_now` may answer (the lookups keep what they read)

    def lookup_now(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> Found | None:
        """`lookup`'s answer where it needs no I/O (from what the lookups keep, where
        `keeps`); None: await `lookup`. Default: None."""
        return None

    @abstractmethod
    def refresh(self) -> None:
        """Find the index's servers again (after a failover). Blocks: call it off the loop."""

    @abstractmethod
    def close(self) -> None:
        """Close the connections; on the loop."""


class MetadataIndex(ABC):
    """Who holds which (tenant, key) in which tier, under node leases. Thread-safe."""

    backend: str = ""
    nonblocking_reads: bool = False  # lookup/live_nodes/stats do no I/O: safe on an event loop
    incarnation: int = 0  # changes when the index restarts without its state; 0: unknown
    _own_id = b""  # index_id's where the index keeps none: this object's own

    @abstractmethod
    def register_node(self, node: NodeRecord, lease_ttl_ms: int) -> NodeRecord:
        """Add or replace a node and grant it a new lease. Re-registering keeps its holdings."""

    @abstractmethod
    def heartbeat(self, node_id: str, lease_id: int) -> NodeRecord:
        """Extend a lease. NotFoundError for an unknown node; LeaseError for a stale lease id
        or an expired lease (whose holdings are already gone)."""

    @abstractmethod
    def deregister_node(self, node_id: str, lease_id: int) -> int:
        """Remove a node and its holdings (emitting removed events); returns holdings removed."""

    @abstractmethod
    def publish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        """Record that `node_id` holds each entry; returns how many were new. Errors as for
        heartbeat; QuotaExceededError if the tenant would pass its key quota (nothing recorded)."""

    @abstractmethod
    def unpublish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        """Forget holdings (key and tier); unknown ones are ignored. Returns how many went."""

    @abstractmethod
    def lookup(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> list[Sequence[Holding]]:
        """Holdings on live nodes for the longest prefix of `keys` that has any (each key's a
        list or a tuple: read them, never change them). No side effects. `keys` are a prompt's
        chained keys from depth 0, or from later on with `anchor` (the chain's depth-1 key):
        a sharded index reads the anchor's shard (BlockEntry.anchor); others ignore it."""

    @abstractmethod
    def live_nodes(self) -> dict[str, NodeRecord]:
        """Nodes whose lease has not expired."""

    def live_addresses(self) -> dict[str, NodeRecord]:
        """The live nodes, for their addresses (a lookup's answer names its holders'): an
        index may answer from a cache whose records' `expires_at` lags their heartbeats."""
        return self.live_nodes()

    @abstractmethod
    def expire_leases(self) -> list[str]:
        """Remove nodes whose lease expired, with their holdings and removed events."""

    @abstractmethod
    def events_since(self, from_seq: int, max_events: int) -> EventPage:
        """Events with seq >= from_seq, oldest first, at most `max_events`. One key's events
        are in the order of its changes; a sharded index may order the events of keys on
        different shards otherwise than their writes (each shard's are relayed in order)."""

    @abstractmethod
    def wait_for_events(self, after_seq: int, timeout_s: float) -> bool:
        """Block until an event newer than `after_seq` exists or the timeout passes."""

    @abstractmethod
    def stats(self) -> dict:
        """{"blocks": n, "blocks_per_tier": {...}, "blocks_per_node": {id: {tier: n}},
        "last_event_seq": n, "keys_per_tenant": {...}}"""

    def index_id(self) -> bytes:
        """16 bytes naming this index, not the process: every service over the same index
        (replicas over one Redis and prefix) reads the same, any other index another; the
        service's lookup port takes hellos carrying it (DescribeResponse.instance). It may
        change where the index lost its state. Default: random, of this object (an embedded
        index is its process's own). May block (Redis: a round trip)."""
        if not self._own_id:
            self._own_id = secrets.token_bytes(16)
        return self._own_id

    def loop_lookups(self, loop: asyncio.AbstractEventLoop) -> LoopLookups | None:
        """Lookups on `loop` for an index whose reads block; None: none (its reads never
        block, or block and are run off the loop)."""
        return None

    def snapshot(self, tenant: str) -> tuple[int, dict[str, NodeRecord], list]:
        """(last event seq, live nodes, [(tenant, [(key, {slot: Holding})])]) of `tenant`
        ("" every tenant): a copy for node agents' views, consistent with the events after
        that seq. Backends without one raise ConfigError; agents then ask the service."""
        raise ConfigError(f"the {self.backend} index serves no snapshots")

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections and files. Idempotent."""
