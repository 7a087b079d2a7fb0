"""The sharded Redis index: holdings in S shards (one hash tag each) spread over a cluster's
masters, leases in a tag of their own, events relayed from each shard's outbox to one stream.

Runs inside each `kvstore metadata --backend redis-cluster` process (or `--backend redis` with
shards > 1). Every script touches one tag; the index splits a batch by shard (shard_map.py). A
lookup reads one shard in one round trip, against a live set cached for `live_refresh_s`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence

from redis.commands.core import Script

from kvstore.errors import LeaseError, NotFoundError, QuotaExceededError, UnavailableError
from kvstore.metadata.index.base import MetadataIndex
from kvstore.metadata.index.redis_cluster import (
    ClusterLink,
    Durability,
    StandaloneLink,
    _replication_id,
)
from kvstore.metadata.index.redis_events import EventRelay
from kvstore.metadata.index.redis_holders import decode, holders_prefix
from kvstore.metadata.index.redis_index import (
    NO_WAIT,
    SNAPSHOT_SCAN_COUNT,
    RedisIndex,
    _glob_escape,
    _pairs,
    _round_trip_on,
    _run_and_wait,
    id_of_incarnation,
)
from kvstore.metadata.index.redis_scripts import SCRIPTS
from kvstore.metadata.index.redis_shard_scripts import SHARD_SCRIPTS, SHARD_WRITES
from kvstore.metadata.index.shard_map import (
    ROOT,
    default_shards,
    lookup_shard,
    shard_of,
    shard_tags,
)
from kvstore.metadata.records import (
    BlockEntry,
    EventPage,
    Holding,
    NodeRecord,
    new_lease_id,
)

logger = logging.getLogger(__name__)

PURGE_BATCH = 1_000  # holdings one purge script removes: a shard is never blocked long
OUTBOX_ENTRIES = 10_000  # a shard's outbox keeps this many entries not yet relayed (then: gap)
LIVE_REFRESH_S = 0.25  # how stale the cached live set may be (a node another replica admitted)


def open_redis_index(url: str, *, cluster: bool, shards: int | None = None, **options):
    """The Redis index for `shards` (None: what fits the servers found: 1 on a standalone
    server, 4 per master on a cluster). One shard is the single-tag index (redis_index.py)."""
    if shards is None and cluster:
        probe = ClusterLink(url, options.get("prefix", "kvstore"))
        try:
            shards = default_shards(probe.masters())
        finally:
            probe.close()
    if (shards or 1) <= 1:
        return RedisIndex(url, cluster=cluster, **options)
    return ShardedRedisIndex(url, cluster=cluster, shards=shards, **options)


def _tag(name: str, cluster: bool) -> bytes:
    return b"{" + name.encode() + b"}" if cluster else name.encode()


class ShardedRedisIndex(MetadataIndex):
    """MetadataIndex over S shards of Redis. Thread-safe; any number of service replicas may
    share one cluster, prefix and S. Entries name their chain's anchor (BlockEntry.anchor);
    entries without one are kept on their key's own shard, and lookups then read those too."""

    backend = "redis-cluster"

    def __init__(
        self,
        url: str,
        prefix: str = "kvstore",
        key_quota_per_tenant: int = 0,
        max_events: int = 100_000,
        clock: Callable[[], float] = time.time,
        *,
        cluster: bool = True,
        shards: int | None = None,
        durability: Durability = NO_WAIT,
        failover_timeout_s: float = 10.0,
        live_refresh_s: float = LIVE_REFRESH_S,
    ) -> None:
        root = ClusterLink(url, prefix, failover_timeout_s) if cluster else StandaloneLink(url)
        self.backend = "redis-cluster" if cluster else "redis"
        shards = shards or default_shards(root.masters())
        self.shards = shards
        self._root, self._url = root, root.url
        self._tags = shard_tags(prefix, shards, cluster)
        self._links = [root.for_slot_of(tag + b":seq") for tag in self._tags]
        self._members_tag = _tag(prefix + ":m", cluster)  # shared by every layout
        self._events_tag = _tag(f"{prefix}:e{shards}", cluster)  # a layout's own stream
        self._members = root.for_slot_of(self._members_tag + b":seq")
        self._events = root.for_slot_of(self._events_tag + b":seq")
        self._quota, self._max_events, self._clock = key_quota_per_tenant, max_events, clock
        self._durability, self._live_refresh_s = durability, live_refresh_s
        self._scripts = {n: Script(None, b.encode()) for n, b in SHARD_SCRIPTS.items()}
        self._scripts |= {n: Script(None, SCRIPTS[n].encode()) for n in ("scan", "incarnation")}
        self._leases: dict[str, tuple[int, float, int]] = {}  # node -> (lease, expiry, epoch)
        self._live: dict[bytes, float] = {}  # node id -> expires_at, read at _live_read_at
        self._live_read_at, self._unanchored = -1e18, False
        self._live_lock = threading.Lock()  # a re-read of the live set vs this process's changes
        self._live_noted: dict[bytes, tuple[float, float]] = {}  # id -> (when, expires_at)
        self._live_version = 0  # bumped by every change of _live
        self._alive_cache: tuple[int, float, frozenset[bytes]] = (-1, 0.0, frozenset())
        self._relay = EventRelay(
            self._events, self._events_tag, self._links, self._tags, max_events, self._run
        )
        self._prefix, self._cluster = prefix, cluster
        self._adopt_layout()
        self._relay.start(self._tick, live_refresh_s / 2)

    @property
    def tags(self) -> list[bytes]:
        """The shards' hash tags, shard 0 first (every key of shard i starts with tags[i])."""
        return list(self._tags)

    # ---- scripts ---------------------------------------------------------------------------
    def _run(self, link, tag: bytes, name: str, args: Sequence) -> list:
        """Script `name` in `tag` on its master; writes wait for replicas when asked to."""
        script, keys = self._scripts[name], [tag + b":seq"]
        args = [tag, *args]
        wait = self._durability.wait_replicas if name in SHARD_WRITES else 0
        if not wait:
            return link.call(lambda client: script(keys=keys, args=args, client=client))
        reply, acked = link.call(
            lambda client: _run_and_wait(client, script, keys, args, self._durability)
        )
        if acked < wait:
            raise UnavailableError(
                f"redis at {self._url}: a write reached {acked} of {wait} replicas within "
                f"{self._durability.wait_timeout_ms} ms; it may not survive a failover (retry)"
            )
        return reply

    def _shard(self, shard: int, name: str, args: Sequence) -> list:
        return self._run(self._links[shard], self._tags[shard], name, args)

    def _member(self, name: str, args: Sequence) -> list:
        return self._run(self._members, self._members_tag, name, args)

    # ---- nodes -----------------------------------------------------------------------------
    def register_node(self, node: NodeRecord, lease_ttl_ms: int) -> NodeRecord:
        """A node whose holdings are still being purged (its lease expired) is purged first:
        its new lease's publishes must not meet the old lease's purge."""
        purging = self._members.call(
            lambda client: client.hget(self._members_tag + b":purging", node.node_id)
        )
        if purging is not None:
            self._purge(node.node_id, purging)
        expires_at = self._clock() + lease_ttl_ms / 1000
        info = json.dumps([node.tcp_address, node.ucx_address, node.tier_capacity_bytes])
        lease_id = new_lease_id()
        args = [node.node_id, repr(expires_at), lease_ttl_ms, info, str(lease_id)]
        epoch = self._member("register", [*args, self.shards])
        if isinstance(epoch, list):
            raise self._moved()
        epoch = int(epoch)
        self._leases[node.node_id] = (lease_id, expires_at, epoch)
        self._note_live(node.node_id, expires_at)
        return NodeRecord(
            node.node_id,
            node.tcp_address,
            node.ucx_address,
            dict(node.tier_capacity_bytes),
            lease_id=lease_id,
            lease_ttl_ms=lease_ttl_ms,
            expires_at=expires_at,
        )

    def _check_lease(self, node_id: str, lease_id: int, extend: bool = False) -> list:
        """The lease script on the membership tag; raises for unknown, stale, expired leases
        (an expired one is purged first). Returns {"ok", ttl, info, expires_at, epoch}."""
        args = [repr(self._clock()), node_id, lease_id, int(extend), self.shards]
        reply = self._member("lease", args)
        status = reply[0]
        if status == b"ok":
            expires_at = float(reply[3])
            self._leases[node_id] = (lease_id, expires_at, int(reply[4]))
            self._note_live(node_id, expires_at)
            return reply
        self._leases.pop(node_id, None)
        if status == b"layout":
            raise self._moved()
        if status == b"unknown":
            raise NotFoundError(f"unknown node {node_id!r}: register it first")
        if status == b"stale":
            raise LeaseError(f"node {node_id!r}: lease {lease_id} is not current; register again")
        self._purge(node_id, reply[1])
        raise LeaseError(f"node {node_id!r}: lease {lease_id} expired; register again")

    def _adopt_layout(self) -> None:
        """Record this replica's shard count S in the membership tag. Another S recorded there
        means a reshard: every lease is revoked (each agent's next heartbeat is NOT_FOUND; it
        registers again and republishes its whole store into this layout, as after any lost
        registration), and the old layout's keys are deleted in the background."""
        old = int(self._member("layout", [self.shards]))
        if old in (0, self.shards):
            return
        logger.warning(
            "redis index %s: resharded from %d to %d shards; every lease is revoked and "
            "agents republish their blocks",
            self._prefix,
            old,
            self.shards,
        )
        threading.Thread(
            target=self._drop_layout, args=(old,), name="redis-drop-layout", daemon=True
        ).start()

    def _drop_layout(self, shards: int) -> None:
        """Delete the keys of the `shards`-shard layout, tag by tag, UNLINKed in pages."""
        tags = shard_tags(self._prefix, shards, self._cluster)
        tags.append(_tag(f"{self._prefix}:e{shards}", self._cluster))
        for tag in tags:
            link = self._root.for_slot_of(tag + b":seq")
            try:
                link.call(lambda client, t=tag: _unlink_tag(client, t))
            except Exception as exc:  # best effort: the keys are unreachable garbage
                logger.warning("could not delete the old layout's %r: %s", tag, exc)

    def _moved(self) -> UnavailableError:
        return UnavailableError(
            f"redis index {self._prefix!r} was resharded by a replica with another shard "
            f"count; this one runs {self.shards}: restart it with the new count"
        )

    def _epoch(self, node_id: str, lease_id: int) -> int:
        """The lease's registration epoch. Writes skip the membership round trip while this
        process saw the lease live; a lease purged meanwhile is refused by each shard."""
        cached = self._leases.get(node_id)
        if cached is None or cached[0] != lease_id or cached[1] <= self._clock():
            return int(self._check_lease(node_id, lease_id)[4])
        return cached[2]

    def heartbeat(self, node_id: str, lease_id: int) -> NodeRecord:
        _, ttl, info, expires_at, _ = self._check_lease(node_id, lease_id, extend=True)
        return RedisIndex._record(node_id, expires_at, lease_id, ttl, info)

    def deregister_node(self, node_id: str, lease_id: int) -> int:
        self._check_lease(node_id, lease_id)
        purging = self._member("retire", [node_id, lease_id])
        if not purging:
            raise LeaseError(f"node {node_id!r}: lease {lease_id} is not current; register again")
        self._leases.pop(node_id, None)
        self._note_live(node_id, 0.0)
        return self._purge(node_id, purging)

    def _purge(self, node_id: str, purging: bytes) -> int:
        """Remove the holdings of `node_id`'s registration `purging` ("lease epoch") from every
        shard, PURGE_BATCH at a time; idempotent (replicas may purge one node at once).
        Returns the holdings removed."""
        lease, _, epoch = purging.partition(b" ")
        removed = 0
        for shard in range(self.shards):
            left = 1
            while left:
                args = [OUTBOX_ENTRIES, node_id, lease, epoch, PURGE_BATCH]
                done, left = self._shard(shard, "purge", args)
                removed += done
            self._relay.mark((shard,))
        self._member("purged", [node_id, purging])
        return removed

    def live_nodes(self) -> dict[str, NodeRecord]:
        rows, _ = self._member("members", [f"({self._clock()!r}"])
        return {n.decode(): RedisIndex._record(n.decode(), *row[:4]) for n, *row in rows}

    def expire_leases(self) -> list[str]:
        """Purge nodes whose lease expired (and finish purges a crashed replica left), shard
        by shard in batches. Each expiry is claimed by one script: concurrent replicas purge
        a node once between them; this returns the nodes this call expired."""
        now = self._clock()
        leftover = self._members.call(
            lambda client: client.hgetall(self._members_tag + b":purging")
        )
        for node, purging in leftover.items():
            self._purge(node.decode(), purging)
        due = self._members.call(
            lambda client: client.zrangebyscore(self._members_tag + b":exp", "-inf", repr(now))
        )
        expired = []
        for node in due:
            purging = self._member("expire", [repr(now), node])
            if purging:
                self._leases.pop(node.decode(), None)
                self._purge(node.decode(), purging)
                expired.append(node.decode())
        return expired

    # ---- holdings --------------------------------------------------------------------------
    def _placements(self, entry: BlockEntry) -> list[tuple[int, bool]]:
        """(shard, home) of each copy of `entry`: its anchor's shard; a depth-0 key on every
        shard (home: its own); a key without an anchor on its own shard only."""
        if entry.anchor is None or entry.anchor == ROOT:
            home = shard_of(entry.key, self.shards)
            if entry.anchor is None:
                return [(home, True)]
            return [(shard, shard == home) for shard in range(self.shards)]
        return [(shard_of(entry.anchor, self.shards), True)]

    def _split(self, entries: Sequence[BlockEntry]) -> dict[int, list[tuple[BlockEntry, bool]]]:
        """Entries by shard, each (key, tier) once with its last values (as one script
        records a repeated one): a batch's depth-0 keys are sent to every shard once."""
        by_shard: dict[int, list[tuple[BlockEntry, bool]]] = {}
        for entry in {(e.key, e.tier): e for e in entries}.values():
            for shard, home in self._placements(entry):
                by_shard.setdefault(shard, []).append((entry, home))
        if not self._unanchored and any(e.anchor is None for e in entries):
            self._members.call(lambda client: client.set(self._members_tag + b":unanchored", 1))
            self._unanchored = True
        return by_shard

    def publish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        """One script per shard the batch touches. Not atomic across shards: a lease purged
        mid-batch leaves the shards written before it to the purge (which removes them)."""
        epoch = self._epoch(node_id, lease_id)
        by_shard = self._split(entries)
        if self._quota > 0:
            self._check_quota(tenant, by_shard)
        added = 0
        for shard, placed in by_shard.items():
            quints = [
                part
                for e, home in placed
                for part in (e.key, e.tier, e.size_bytes, e.checksum, int(home))
            ]
            args = [OUTBOX_ENTRIES, node_id, lease_id, epoch, tenant, *quints]
            reply = self._shard(shard, "publish", args)
            if reply[0] == b"expired":
                self._leases.pop(node_id, None)
                raise LeaseError(f"node {node_id!r}: lease {lease_id} expired; register again")
            added += reply[1]
            self._relay.mark((shard,))
        return added

    def _check_quota(self, tenant: str, by_shard: dict) -> None:
        """The tenant's keys on every shard plus the batch's new ones, read before writing (a
        check, not a reservation: concurrent batches may pass the quota by their own size)."""
        held = new_keys = 0
        for shard in range(self.shards):
            keys = {e.key for e, home in by_shard.get(shard, []) if home}
            count, new = self._shard(shard, "new_keys", [tenant, *keys])
            held, new_keys = held + count, new_keys + new
        if held + new_keys > self._quota:
            raise QuotaExceededError(
                f"tenant {tenant!r} holds {held} keys; {new_keys} more "
                f"would exceed its quota of {self._quota}"
            )

    def unpublish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        """Entries must name the anchor they were published with (they are found there)."""
        self._epoch(node_id, lease_id)
        gone = 0
        for shard, placed in self._split(entries).items():
            triples = [part for e, home in placed for part in (e.key, e.tier, int(home))]
            gone += self._shard(shard, "unpublish", [OUTBOX_ENTRIES, node_id, tenant, *triples])
            self._relay.mark((shard,))
        return gone

    def lookup(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> list[list[Holding]]:
        """One MGET on the shard of the prompt's anchor (keys[1], or `anchor` where keys start
        deeper); a depth-0 first key read from that shard's copy. Entries published without
        an anchor (seen by some replica) are read from their own shards after the first miss."""
        if not keys:
            return []
        live = self._alive(self._clock())
        shard, names = self.lookup_names(tenant, keys, anchor)
        link = self._links[shard]
        (blobs,) = link.call(lambda c: _round_trip_on(c.connection_pool, ((b"MGET", *names),)))
        found = holders_prefix(blobs, live)
        if len(found) < len(keys) and self._unanchored:
            found += self._lookup_unanchored(tenant, keys[len(found) :], live)
        return found

    def lookup_names(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None
    ) -> tuple[int, list[bytes]]:
        """The shard a lookup reads and the names of its keys' holder records there."""
        shard, first, stem = self.lookup_stem(tenant, keys, anchor)
        return shard, [first, *(stem + key for key in keys[1:])]

    def lookup_stem(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None
    ) -> tuple[int, bytes, bytes]:
        """lookup_names as (the shard, the first key's name, what the others' names start
        with before their key)."""
        if anchor is None:
            shard, rooted = lookup_shard(keys, self.shards), True
        else:
            shard, rooted = shard_of(anchor, self.shards), False
        first = self._holder_name(shard, tenant, keys[0], rooted)
        return shard, first, self._tags[shard] + b":h:" + tenant.encode() + b"\0"

    def _holder_name(self, shard: int, tenant: str, key: bytes, first: bool) -> bytes:
        own = not first or shard_of(key, self.shards) == shard
        return self._tags[shard] + (b":h:" if own else b":r:") + tenant.encode() + b"\0" + key

    def _lookup_unanchored(self, tenant: str, keys: Sequence[bytes], live: frozenset) -> list:
        blobs: list = [None] * len(keys)
        for shard, (positions, names) in self.unanchored_names(tenant, keys).items():
            got = self._links[shard].call(lambda client, n=names: client.mget(n))
            for i, blob in zip(positions, got, strict=True):
                blobs[i] = blob
        return holders_prefix(blobs, live)

    @property
    def unanchored(self) -> bool:
        """Whether entries without an anchor were published (lookups then read them too)."""
        return self._unanchored

    def unanchored_names(
        self, tenant: str, keys: Sequence[bytes]
    ) -> dict[int, tuple[list[int], list[bytes]]]:
        """Where `keys` published without an anchor are: per shard, (positions, names)."""
        by_shard: dict[int, tuple[list[int], list[bytes]]] = {}
        for i, key in enumerate(keys):
            shard = shard_of(key, self.shards)
            positions, names = by_shard.setdefault(shard, ([], []))
            positions.append(i)
            names.append(self._holder_name(shard, tenant, key, False))
        return by_shard

    def loop_lookups(self, loop):
        from kvstore.metadata.index.redis_lookups import ShardedLoopLookups

        return ShardedLoopLookups.of(self, loop)

    def alive_cached(self, now: float) -> frozenset[bytes] | None:
        """`_alive(now)` without I/O; None where the live set is due to be re-read."""
        if time.monotonic() - self._live_read_at >= self._live_refresh_s:
            return None
        return self._alive_of_live_set(now)

    def _alive(self, now: float) -> frozenset[bytes]:
        """Ids of nodes live at `now`: from the live set (node id -> expires_at), which the
        relay thread keeps fresh and which is re-read here only when older than
        live_refresh_s (a node admitted or extended by another replica shows within that
        time)."""
        if time.monotonic() - self._live_read_at >= self._live_refresh_s:
            self._read_live_set()
        return self._alive_of_live_set(now)

    def _alive_of_live_set(self, now: float) -> frozenset[bytes]:
        """Kept between lookups until the live set changes or its first lease ends."""
        version, until, alive = self._alive_cache
        if version == self._live_version and now < until:
            return alive
        version, live = self._live_version, dict(self._live)
        alive = frozenset(node for node, expires_at in live.items() if expires_at > now)
        until = min((live[node] for node in alive), default=float("inf"))
        self._alive_cache = (version, until, alive)
        return alive

    def _read_live_set(self) -> None:
        """Re-read the live set; what this process changed since the read began wins."""
        read_at = time.monotonic()
        rows, unanchored = self._member("members", ["-inf"])
        live = {row[0]: float(row[1]) for row in rows}
        with self._live_lock:
            for node, (when, expires_at) in list(self._live_noted.items()):
                if when >= read_at:
                    live[node] = expires_at
                else:
                    del self._live_noted[node]
            self._live = live
            self._live_version += 1
        self._unanchored = self._unanchored or unanchored == b"1"
        self._live_read_at = read_at

    def _note_live(self, node_id: str, expires_at: float) -> None:
        """A lease this process granted, extended (or ended: 0) shows in lookups at once."""
        node = node_id.encode()
        with self._live_lock:
            self._live_noted[node] = (time.monotonic(), expires_at)
            self._live[node] = expires_at
            self._live_version += 1

    def snapshot(self, tenant: str) -> tuple[int, dict[str, NodeRecord], list]:
        """The events' seq first, then every shard's home copies (SCAN pages): replay-safe as
        in RedisIndex.snapshot, since a shard's events reach the stream after its writes."""
        self._relay.relay_dirty()
        last_seq = self._relay.last_seq()
        held: dict[str, dict[bytes, tuple]] = {}
        for shard, tag in enumerate(self._tags):
            stem = tag + b":h:"
            pattern = _glob_escape(stem + (tenant.encode() + b"\0" if tenant else b"")) + b"*"
            self._links[shard].call(lambda c, s=stem, p=pattern: self._scan(c, s, p, held))
        copies = [(name, list(held[name].items())) for name in sorted(held)]
        return last_seq, self.live_nodes(), copies

    def _scan(self, client, stem: bytes, pattern: bytes, held: dict) -> None:
        script, cursor, found = self._scripts["scan"], b"0", []
        while True:
            args = [stem, cursor, pattern, SNAPSHOT_SCAN_COUNT]
            cursor, names, blobs = script(keys=[stem + b"seq"], args=args, client=client)
            found += [(n, b) for n, b in zip(names, blobs, strict=True) if b]
            if cursor in (b"0", 0):
                break
        for name, blob in found:  # applied once the shard's copy is whole (a retry restarts)
            tenant, _, key = name[len(stem) :].partition(b"\0")
            holdings = decode(blob)[1]
            into = held.setdefault(tenant.decode(), {})
            into[key] = tuple(dict.fromkeys(into.get(key, ()) + holdings))

    @property
    def incarnation(self) -> int:  # type: ignore[override]
        """P:inc on the events tag, folded with the replication ids of the events master and
        every shard's master: a failover that may have lost writes or events changes it."""
        stored = int(
            self._run(self._events, self._events_tag, "incarnation", [secrets.randbits(63) | 1])
        )
        masters = {id(link.client()): link for link in (self._events, *self._links)}
        replids = sorted(_replication_id(link) for link in masters.values())
        folded = hashlib.blake2b(
            b"%d/%s" % (stored, "/".join(replids).encode()), digest_size=8
        ).digest()
        return int.from_bytes(folded, "big") >> 1 | 1

    def index_id(self) -> bytes:
        """Of P:inc on the events tag (redis_index.py's, of its layout): one round trip."""
        stored = self._run(
            self._events, self._events_tag, "incarnation", [secrets.randbits(63) | 1]
        )
        return id_of_incarnation(stored)

    # ---- events ----------------------------------------------------------------------------
    def events_since(self, from_seq: int, max_events: int) -> EventPage:
        return self._relay.events_since(from_seq, max_events)

    def wait_for_events(self, after_seq: int, timeout_s: float) -> bool:
        return self._relay.wait_for_events(after_seq, timeout_s)

    def _tick(self) -> None:
        """The relay thread's every round: the live set re-read every live_refresh_s / 2, so
        lookups never wait for it."""
        if time.monotonic() - self._live_read_at >= self._live_refresh_s / 2:
            self._read_live_set()

    # ---- stats -----------------------------------------------------------------------------
    def stats(self) -> dict:
        self._relay.relay_dirty()
        rows, _ = self._member("members", ["-inf"])
        nodes = [row[0] for row in rows]
        per_tier: dict[str, int] = {}
        per_tenant: dict[str, int] = {}
        per_node: dict[str, dict[str, int]] = {node.decode(): {} for node in nodes}
        for shard in range(self.shards):
            tiers, tenants, counts = self._shard(shard, "shard_stats", nodes)
            _add(per_tier, _pairs(tiers))
            _add(per_tenant, _pairs(tenants))
            for node, flat in zip(nodes, counts, strict=True):
                _add(per_node[node.decode()], _pairs(flat))
        return {
            "blocks": sum(per_tier.values()),
            "blocks_per_tier": per_tier,
            "blocks_per_node": per_node,
            "keys_per_tenant": per_tenant,
            "last_event_seq": self._relay.last_seq(),
        }

    def close(self) -> None:
        self._relay.stop()
        self._root.close()


def _unlink_tag(client, tag: bytes) -> None:
    page = []
    for name in client.scan_iter(match=_glob_escape(tag) + b"*", count=1000):
        page.append(name)
        if len(page) == 1000:
            client.unlink(*page)
            page = []
    if page:
        client.unlink(*page)


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for name, count in counts.items():
        into[name] = into.get(name, 0) + count
