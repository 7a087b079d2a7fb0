"""The node agent's view of the cluster index: which other nodes hold which keys of this agent's
tenants, so that a worker's lookup is answered on its host. Fed by one thread (view_feed.py),
read lock-free by the control-connection threads. The metadata service stays the authority:
the view is a hint whose worst error is a failed fetch (a miss, recomputed), which corrects it.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterable, Sequence

from kvstore.metadata.client import SnapshotPage
from kvstore.metadata.records import TIERS
from kvstore.node.identity import ALL_TENANTS

KEY_OBJECT_BYTES = (sys.getsizeof(bytes(16)) + 7) & ~7  # one 16-byte key as pymalloc stores it
MAX_INTERNED_MASKS = 1 << 16


class ClusterView:
    """Per followed tenant, key -> holder mask: bit 3*slot + tier for each other node holding
    it (slots number the node ids seen since the last snapshot). An int per key, interned, so a
    key costs its bytes object and a dict slot. Writers (the feed, `forget`) take the lock."""

    def __init__(self, node_id: str, tenants: frozenset[str], max_keys: int) -> None:
        self.node_id = node_id
        self.tenants = tenants
        self.max_keys = max_keys
        self.ready = False  # a snapshot is loaded and events follow it
        self.overflowed = False  # a key was left out at the cap: the view's misses are hints
        self.keys = 0
        self.counters: Counter[str] = Counter()
        self._held: dict[str, dict[bytes, int]] = {}
        self._slots: dict[str, int] = {}
        self._node_ids: list[str] = []
        self._addresses: dict[str, tuple[str, str]] = {}
        self._masks: dict[int, int] = {}
        self._lock = threading.Lock()

    def follows(self, tenant: str) -> bool:
        return ALL_TENANTS in self.tenants or tenant in self.tenants

    # ---- readers: no lock (each dict read is one atomic step) -----------------------------
    def remote_prefix(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        """How many leading `keys` other nodes hold; None when the view cannot say (not
        synced, a tenant it does not follow, or a miss past an overflow): ask the service."""
        if not self.ready or not self.follows(tenant):
            self.counters["fallback_not_ready"] += 1
            return None
        held = self._held.get(tenant, {})
        count = 0
        for key in keys:
            if not held.get(key):
                break
            count += 1
        if count < len(keys) and self.overflowed:
            self.counters["fallback_overflow"] += 1
            return None
        self.counters["answered"] += 1
        return count

    def plan(self, tenant: str, keys: Sequence[bytes], ucx: bool) -> list[tuple[str, str]] | None:
        """Per leading key held elsewhere, (node id, address) of its best holder (fastest tier,
        then node id); None when the view cannot answer or lacks a holder's address."""
        if self.remote_prefix(tenant, keys) is None:
            return None
        held = self._held.get(tenant, {})
        plan = []
        for key in keys:
            mask = held.get(key)
            if not mask:
                break
            node_id = self._best_holder(mask)
            addresses = self._addresses.get(node_id)
            if addresses is None or not addresses[ucx]:
                self.counters["fallback_address"] += 1
                return None
            plan.append((node_id, addresses[ucx]))
        return plan

    def _best_holder(self, mask: int) -> str:
        node_ids = self._node_ids
        best = min(
            (bit % 3, node_ids[bit // 3]) for bit in range(mask.bit_length()) if mask >> bit & 1
        )
        return best[1]

    def holders(self, tenant: str, key: bytes) -> set[tuple[str, str]]:
        """(node id, tier) of every holder the view knows for `key` (for tests and tools)."""
        mask = self._held.get(tenant, {}).get(key, 0)
        return {
            (self._node_ids[bit // 3], TIERS[bit % 3])
            for bit in range(mask.bit_length())
            if mask >> bit & 1
        }

    # ---- writers --------------------------------------------------------------------------
    def apply(self, kind: str, tenant: str, key: bytes, node_id: str, tier: str) -> None:
        """One index event ("stored" or "removed"); idempotent, like the index's own sets."""
        if node_id == self.node_id or not self.follows(tenant):
            return
        with self._lock:
            bit = 1 << (3 * self._slot(node_id) + TIERS.index(tier))
            if kind == "stored":
                self._add(tenant, key, bit)
            else:
                self._remove(tenant, key, bit)

    def forget(self, tenant: str, keys: Iterable[bytes], node_id: str) -> None:
        """A fetch of `keys` from `node_id` failed: the view stops naming it as their holder,
        and forgets its address (a restarted node listens elsewhere: the service will say)."""
        with self._lock:
            self._addresses.pop(node_id, None)
            slot = self._slots.get(node_id)
            if slot is None:
                return
            for key in keys:
                self._remove(tenant, key, 0b111 << (3 * slot))
                self.counters["corrections"] += 1

    def learn_addresses(self, addresses: dict[str, tuple[str, str]]) -> None:
        """Node addresses from a service answer (a node that registered after the snapshot)."""
        self._addresses.update(addresses)

    def _slot(self, node_id: str) -> int:
        slot = self._slots.get(node_id)
        if slot is None:
            slot = self._slots[node_id] = len(self._node_ids)
            self._node_ids.append(node_id)
        return slot

    def _add(self, tenant: str, key: bytes, bits: int) -> None:
        held = self._held.setdefault(tenant, {})
        mask = held.get(key)
        if mask is None:
            if self.keys >= self.max_keys:
                self.overflowed = True
                self.counters["left_out"] += 1
                return
            self.keys += 1
            mask = 0
        held[key] = self._intern(mask | bits)

    def _remove(self, tenant: str, key: bytes, bits: int) -> None:
        held = self._held.get(tenant, {})
        mask = held.get(key)
        if mask is None:
            return
        mask &= ~bits
        if mask:
            held[key] = self._intern(mask)
        else:
            del held[key]
            self.keys -= 1

    def _intern(self, mask: int) -> int:
        """One int object per distinct mask (most keys share a few), while the table is small."""
        if len(self._masks) < MAX_INTERNED_MASKS:
            return self._masks.setdefault(mask, mask)
        return mask

    # ---- resync ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything before loading a snapshot (the nodes' addresses too: departed
        nodes' would pile up); lookups go to the service meanwhile."""
        with self._lock:
            self.ready = False
            self.overflowed = False
            self.keys = 0
            self._held, self._slots, self._node_ids, self._masks = {}, {}, [], {}
            self._addresses = {}

    def load(self, page: SnapshotPage) -> None:
        """One page of a snapshot (after `reset`). A truncated page marks the view overflowed
        even when its tenant is not followed: a snapshot of several tenants cut inside one
        the view ignores also left out every later tenant's keys."""
        self.overflowed |= page.truncated
        if not self.follows(page.tenant):
            return
        self.learn_addresses(page.holders.addresses)
        with self._lock:
            for key, holders in zip(page.keys, page.holders.holders, strict=True):
                for holding in holders:
                    if holding.node_id != self.node_id:
                        bit = 1 << (3 * self._slot(holding.node_id) + TIERS.index(holding.tier))
                        self._add(page.tenant, key, bit)

    def synced(self) -> None:
        self.ready = True
        self.counters["snapshots"] += 1

    def bytes_estimate(self) -> int:
        """The view's memory: its dicts, plus a key object per key (masks are shared)."""
        dicts = sum(sys.getsizeof(held) for held in list(self._held.values()))
        return dicts + self.keys * KEY_OBJECT_BYTES + sys.getsizeof(self._masks)

    def stats(self) -> dict:
        return {
            "ready": self.ready,
            "overflowed": self.overflowed,
            "keys": self.keys,
            "max_keys": self.max_keys,
            "nodes": len(self._node_ids),
            "bytes": self.bytes_estimate(),
            **dict(self.counters),
        }
