"""The embedded metadata index: dictionaries in memory, written through to LMDB when given a
data directory. Runs inside the metadata service process (`kvstore serve` / `kvstore metadata`).
One lock serialises writers; a condition wakes event watchers; without a journal, heartbeats
take only a lease lock of their own (never behind a publish). Reads (lookup, live nodes) take
no lock: they read dictionaries in single C-level steps (atomic under the GIL), so a writer
committing to LMDB never delays a lookup. Every mutation is committed to the journal first and
applied to memory only once that succeeded; stats are kept as counters.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import chain
from operator import attrgetter
from pathlib import Path

from kvstore.errors import CapacityError, LeaseError, NotFoundError, QuotaExceededError
from kvstore.metadata.index.base import MetadataIndex
from kvstore.metadata.index.journal import DEFAULT_MAP_SIZE_BYTES, Journal, JournalWriter
from kvstore.metadata.index.ring import EventRing
from kvstore.metadata.records import (
    BlockEntry,
    EventPage,
    Holding,
    IndexEvent,
    NodeRecord,
    new_lease_id,
)

logger = logging.getLogger(__name__)

Held = tuple[str, bytes, str]  # (tenant, key, tier)
Holders = dict[bytes, tuple[Holding, ...]]  # one tenant's keys; a key's holders, replaced whole
SnapshotCopy = tuple[int, dict[str, NodeRecord], list[tuple[str, list[tuple[bytes, tuple]]]]]


class MemoryIndex(MetadataIndex):
    backend = "lmdb"
    nonblocking_reads = True  # reads never touch the journal (the lock is held briefly)

    def __init__(
        self,
        data_dir: Path | None = None,
        key_quota_per_tenant: int = 0,
        max_events: int = 100_000,
        clock: Callable[[], float] = time.time,
        map_size_bytes: int = DEFAULT_MAP_SIZE_BYTES,
    ) -> None:
        self.backend = "lmdb" if data_dir else "memory"
        self._quota = key_quota_per_tenant
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        # guards lease changes of _nodes; taken after _cond where both are (never before)
        self._lease_lock = threading.RLock()
        self._nodes: dict[str, NodeRecord] = {}
        self._holders: dict[str, Holders] = {}  # tenant -> key -> holders
        # (membership version, valid until, live ids, their records): see _alive_ids
        self._alive: tuple[int, float, frozenset[str], dict] = (-1, 0.0, frozenset(), {})
        self._nodes_version = 0  # bumped by every change of membership (not by heartbeats)
        self._by_node: dict[str, set[Held]] = {}
        self._tenant_keys: Counter[str] = Counter()
        self._tier_blocks: Counter[str] = Counter()
        self._node_blocks: dict[str, Counter[str]] = {}
        self._events = EventRing(max_events)
        self._journal = Journal(data_dir, map_size_bytes) if data_dir else None
        self._last_seq = self._journal.counter("last_seq") if self._journal else 0
        self.incarnation = self._incarnation()
        self._load()

    def _incarnation(self) -> int:
        """Random per index; kept in the journal, whose events keep their numbers."""
        existing = self._journal.counter("incarnation") if self._journal else 0
        if existing:
            return existing
        incarnation = secrets.randbits(63) | 1
        self._commit(lambda txn: txn.put_counter("incarnation", incarnation))
        return incarnation

    def _load(self) -> None:
        if self._journal is None:
            return
        for node in self._journal.nodes():
            self._nodes[node.node_id] = node
        for tenant, key, holding in self._journal.holdings():
            self._add_holding(tenant, key, holding)
        self.expire_leases()

    def _commit(self, write: Callable[[JournalWriter], None]) -> None:
        """Run `write` in one journal transaction (nothing without a journal). Callers change
        memory only after this returns, so memory never holds what the journal lacks."""
        if self._journal is not None:
            with self._journal.write() as txn:
                write(txn)

    # ---- nodes ----------------------------------------------------------------------------
    def register_node(self, node: NodeRecord, lease_ttl_ms: int) -> NodeRecord:
        with self._cond:
            lease_id = new_lease_id()
            record = replace(
                node,
                lease_id=lease_id,
                lease_ttl_ms=lease_ttl_ms,
                expires_at=self._clock() + lease_ttl_ms / 1000,
            )

            def write(txn: JournalWriter) -> None:
                txn.put_node(record)

            self._commit(write)
            with self._lease_lock:
                self._nodes[node.node_id] = record
            self._nodes_version += 1
            self._by_node.setdefault(node.node_id, set())
            return record

    def heartbeat(self, node_id: str, lease_id: int) -> NodeRecord:
        """Without a journal, under the lease lock only: a live lease is extended however long
        a publish holds the writers' lock. Else, and for every refusal, under that lock."""
        if self._journal is None:
            with self._lease_lock:
                node = self._nodes.get(node_id)
                if node and node.lease_id == lease_id and node.expires_at > self._clock():
                    record = replace(node, expires_at=self._clock() + node.lease_ttl_ms / 1000)
                    self._nodes[node_id] = record
                    return record
        with self._cond:
            node = self._live_node(node_id, lease_id)
            record = replace(node, expires_at=self._clock() + node.lease_ttl_ms / 1000)
            try:
                self._commit(lambda txn: txn.put_node(record))
            except CapacityError as exc:
                # A lease is soft state: a full journal must not expire every node and purge
                # its holdings. Only a restart would see the older expiry (and re-register).
                logger.warning("heartbeat of %s not journaled: %s", node_id, exc)
            self._nodes[node_id] = record
            return record

    def _live_node(self, node_id: str, lease_id: int) -> NodeRecord:
        node = self._nodes.get(node_id)
        if node is None:
            raise NotFoundError(f"unknown node {node_id!r}: register it first")
        if node.lease_id != lease_id:
            raise LeaseError(f"node {node_id!r}: lease {lease_id} is not current; register again")
        if node.expires_at <= self._clock():
            self._drop_node(node_id)
            raise LeaseError(f"node {node_id!r}: lease {lease_id} expired; register again")
        return node

    def deregister_node(self, node_id: str, lease_id: int) -> int:
        with self._cond:
            self._live_node(node_id, lease_id)
            return self._drop_node(node_id)

    def live_nodes(self) -> dict[str, NodeRecord]:
        now = self._clock()
        return {r.node_id: r for r in list(self._nodes.values()) if r.expires_at > now}

    def expire_leases(self) -> list[str]:
        with self._cond, self._lease_lock:  # no heartbeat extends a lease found expired here
            now = self._clock()
            expired = [n for n, r in self._nodes.items() if r.expires_at <= now]
            for node_id in expired:
                self._drop_node(node_id)
            return expired

    def _drop_node(self, node_id: str) -> int:
        with self._lease_lock:  # a heartbeat extends the lease before this, or finds none
            return self._drop_node_locked(node_id)

    def _drop_node_locked(self, node_id: str) -> int:
        held = list(self._by_node.get(node_id, ()))

        def write(txn: JournalWriter) -> None:
            self._journal_removals(txn, node_id, held)
            txn.delete_node(node_id)

        self._commit(write)
        self._forget_holdings(node_id, held)
        self._nodes.pop(node_id, None)
        self._nodes_version += 1
        self._by_node.pop(node_id, None)
        self._node_blocks.pop(node_id, None)
        return len(held)

    # ---- holdings -------------------------------------------------------------------------
    def publish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        with self._cond:
            self._live_node(node_id, lease_id)
            fresh = {
                (e.key, e.tier): Holding(node_id, e.tier, e.size_bytes, e.checksum)
                for e in entries
                if not _holds(self._holders.get(tenant, {}).get(e.key, ()), node_id, e.tier)
            }
            self._check_quota(tenant, {key for key, _ in fresh})

            def write(txn: JournalWriter) -> None:
                for (key, _), holding in fresh.items():
                    txn.put_holding(tenant, key, holding)
                txn.put_counter("last_seq", self._last_seq + len(fresh))

            self._commit(write)
            for (key, tier), holding in fresh.items():
                self._add_holding(tenant, key, holding)
                self._emit("stored", tenant, key, node_id, tier)
            return len(fresh)

    def _check_quota(self, tenant: str, keys: set[bytes]) -> None:
        if not self._quota:
            return
        held = self._holders.get(tenant, {})
        new_keys = sum(1 for key in keys if key not in held)
        if self._tenant_keys[tenant] + new_keys > self._quota:
            raise QuotaExceededError(
                f"tenant {tenant!r} holds {self._tenant_keys[tenant]} keys; {new_keys} more "
                f"would exceed its quota of {self._quota}"
            )

    def unpublish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        with self._cond:
            self._live_node(node_id, lease_id)
            held = self._by_node.get(node_id, set())
            wanted = dict.fromkeys((tenant, e.key, e.tier) for e in entries)  # dedupe, keep order
            gone = [slot for slot in wanted if slot in held]
            if gone:
                self._commit(lambda txn: self._journal_removals(txn, node_id, gone))
                self._forget_holdings(node_id, gone)
            return len(gone)

    def _add_holding(self, tenant: str, key: bytes, holding: Holding) -> None:
        keys = self._holders.setdefault(tenant, {})
        holders = keys.get(key)
        if holders is None:
            holders = ()
            self._tenant_keys[tenant] += 1
        others = _without(holders, holding.node_id, holding.tier)
        keys[key] = (*others, holding)  # one store: a reader sees the old tuple or the new
        self._by_node.setdefault(holding.node_id, set()).add((tenant, key, holding.tier))
        self._tier_blocks[holding.tier] += 1
        self._node_blocks.setdefault(holding.node_id, Counter())[holding.tier] += 1

    def _journal_removals(self, txn: JournalWriter, node_id: str, held: list[Held]) -> None:
        for tenant, key, tier in held:
            txn.delete_holding(tenant, key, node_id, tier)
        if held:
            txn.put_counter("last_seq", self._last_seq + len(held))

    def _forget_holdings(self, node_id: str, held: list[Held]) -> None:
        """Memory only: the journal already dropped them. Emits one removed event each."""
        node_blocks = self._node_blocks.get(node_id, Counter())
        for tenant, key, tier in held:
            keys = self._holders.get(tenant, {})
            holders = _without(keys.get(key, ()), node_id, tier)
            if holders:
                keys[key] = holders
            elif key in keys:
                keys.pop(key, None)
                self._tenant_keys[tenant] -= 1
                if not self._tenant_keys[tenant]:
                    del self._tenant_keys[tenant]
                    self._holders.pop(tenant, None)
            self._by_node.get(node_id, set()).discard((tenant, key, tier))
            _decrement(self._tier_blocks, tier)
            _decrement(node_blocks, tier)
            self._emit("removed", tenant, key, node_id, tier)

    def lookup(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> list[tuple[Holding, ...]]:
        """Lock-free: a key's holders are a tuple that writers replace whole, and the keys'
        tuples are read in one C-level step (`map` over `dict.get`) that no writer thread can
        interleave: the prefix is of one moment, as under the lock. It ends at the first key
        held by no live node."""
        alive = self._alive_ids()
        held = self._holders.get(tenant)
        if held is None:
            return []
        found = list(map(held.get, keys))
        if None in found:
            del found[found.index(None) :]
        if alive.issuperset(map(_NODE_ID, chain.from_iterable(found))):  # the common case
            return found
        return _live_prefix(found, alive)

    def _alive_ids(self) -> frozenset[str]:
        """Ids of live nodes, recomputed only when membership changed or the earliest lease
        of the cached set ran out: O(1) per lookup, not O(nodes). Heartbeats only extend
        leases, so they cannot make the cached set wrong before its earliest expiry."""
        return self._live()[2]

    def live_addresses(self) -> dict[str, NodeRecord]:
        """The live nodes cached with `_alive_ids` (their expiry as of the cache's making):
        a lookup's answer needs their addresses, which heartbeats leave as they are."""
        return self._live()[3]

    def _live(self) -> tuple[int, float, frozenset[str], dict[str, NodeRecord]]:
        cached = self._alive
        now = self._clock()
        if cached[0] == self._nodes_version and now < cached[1]:
            return cached
        version = self._nodes_version
        records = {r.node_id: r for r in list(self._nodes.values()) if r.expires_at > now}
        valid_until = min((r.expires_at for r in records.values()), default=float("inf"))
        self._alive = (version, valid_until, frozenset(records), records)
        return self._alive

    def snapshot(self, tenant: str) -> SnapshotCopy:
        """(last seq, live nodes, [(tenant, [(key, holders)])]) copied under the lock in
        C-level steps only (a few ms per million keys), for a node agent's view."""
        with self._cond:
            tenants = [tenant] if tenant else sorted(self._holders)
            copies = [(t, list(self._holders.get(t, {}).items())) for t in tenants]
            last_seq, nodes = self._last_seq, self.live_nodes()
        return last_seq, nodes, copies

    # ---- events ---------------------------------------------------------------------------
    def _emit(self, kind: str, tenant: str, key: bytes, node_id: str, tier: str) -> None:
        self._last_seq += 1
        self._events.append(IndexEvent(self._last_seq, kind, tenant, key, node_id, tier))
        self._cond.notify_all()

    def events_since(self, from_seq: int, max_events: int) -> EventPage:
        with self._cond:
            oldest = self._events.oldest_seq() or self._last_seq + 1
            gap = from_seq < oldest and from_seq <= self._last_seq
            return EventPage(self._events.since(from_seq, max_events), gap, self._last_seq)

    def wait_for_events(self, after_seq: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._last_seq > after_seq, timeout=timeout_s)

    # ---- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """From the counters kept by every change: O(nodes x tiers), not O(holdings)."""
        with self._cond:
            per_node = {n: dict(self._node_blocks.get(n, {})) for n in self._nodes}
            for node_id, counts in self._node_blocks.items():  # holdings of no known node
                if counts and node_id not in per_node:
                    per_node[node_id] = dict(counts)
            return {
                "blocks": sum(self._tier_blocks.values()),
                "blocks_per_tier": dict(self._tier_blocks),
                "blocks_per_node": per_node,
                "keys_per_tenant": dict(self._tenant_keys),
                "last_event_seq": self._last_seq,
            }

    def close(self) -> None:
        with self._cond:
            if self._journal:
                self._journal.close()
                self._journal = None


_NODE_ID = attrgetter("node_id")


def _holds(holders: tuple[Holding, ...], node_id: str, tier: str) -> bool:
    return any(h.node_id == node_id and h.tier == tier for h in holders)


def _without(holders: tuple[Holding, ...], node_id: str, tier: str) -> tuple[Holding, ...]:
    return tuple(h for h in holders if h.node_id != node_id or h.tier != tier)


def _live_prefix(found: list[tuple[Holding, ...]], alive: frozenset[str]) -> list[tuple]:
    """The holders on live nodes of each key, up to the first key with none."""
    live_prefix = []
    for holders in found:
        live = tuple(h for h in holders if h.node_id in alive)
        if not live:
            break
        live_prefix.append(live)
    return live_prefix


def _decrement(counter: Counter[str], name: str) -> None:
    counter[name] -= 1
    if counter[name] <= 0:
        del counter[name]
