"""The Redis metadata index: all state in one Redis server, shared by metadata-service replicas.

Runs inside each `kvstore metadata --backend redis` process. Multi-key mutations are Lua scripts
(atomic); lease time comes from the injected clock, never from Redis TTLs. Standalone Redis or a
Redis Cluster (redis_cluster.py: all keys in one hash slot, so every script runs on one master).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Sequence

import redis
from redis.commands.core import Script

from kvstore.errors import (
    LeaseError,
    NotFoundError,
    QuotaExceededError,
    UnavailableError,
)
from kvstore.metadata.index.base import MetadataIndex
from kvstore.metadata.index.redis_cluster import ClusterLink, Durability, StandaloneLink
from kvstore.metadata.index.redis_holders import decode, holders_prefix
from kvstore.metadata.index.redis_scripts import SCRIPTS, WRITES
from kvstore.metadata.records import (
    BlockEntry,
    EventPage,
    Holding,
    IndexEvent,
    NodeRecord,
    new_lease_id,
)

NO_WAIT = Durability()
NOW = object()  # a script argument: the clock's time at each attempt (RedisIndex._run)
WAIT_CHUNK_S = 2.0  # XREAD BLOCK slices, so a blocked read never meets the socket timeout
SNAPSHOT_SCAN_COUNT = 512  # keys asked of each SCAN page of a snapshot (one bounded reply each)


# Keys, after the prefix P (bytes; `{prefix}` on a cluster, so all share one slot): :seq
# (counter), :ev (event stream, ids 0-<seq>), :exp (zset node -> expires_at: the node
# registry), :node:<id> (hash lease, ttl, info), :held:<id> (set of tier\0tenant\0key),
# :ncount:<id> / :tiers / :tenants (count hashes), :h:<tenant>\0<key> (string of
# node\0tier\0size\0checksum\0 records: one MGET serves a lookup), :inc (the incarnation).
# Keys may hold NUL; tenants, node ids and tiers don't.
def _pairs(flat: list[bytes]) -> dict[str, int]:
    return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}


class RedisIndex(MetadataIndex):
    """MetadataIndex over Redis. Thread-safe (a connection pool); any number of replicas may
    share one server (or cluster) and prefix. Connection failures raise UnavailableError naming
    the URL; on a cluster, after `failover_timeout_s` of retries."""

    backend = "redis"

    def __init__(
        self,
        url: str,
        prefix: str = "kvstore",
        key_quota_per_tenant: int = 0,
        max_events: int = 100_000,
        clock: Callable[[], float] = time.time,
        *,
        cluster: bool = False,
        durability: Durability = NO_WAIT,
        failover_timeout_s: float = 10.0,
    ) -> None:
        if cluster:
            self._link: ClusterLink | StandaloneLink = ClusterLink(url, prefix, failover_timeout_s)
        else:
            self._link = StandaloneLink(url)
        self.backend = "redis-cluster" if cluster else "redis"
        self._url = self._link.url
        self._prefix = self._link.key_prefix(prefix)
        self._quota = key_quota_per_tenant
        self._max_events = max_events
        self._clock = clock
        self._durability = durability
        self._scripts = {name: Script(None, body.encode()) for name, body in SCRIPTS.items()}

    def _run(self, name: str, args: Sequence[bytes | str | int | float | object]) -> list:
        """Run script `name` (keyed on P:seq, so a cluster routes and checks its slot); writes
        wait for `durability.wait_replicas` replicas when asked to. An argument NOW is the
        clock's time when each attempt runs: the cluster link retries through a failover for
        seconds, and a lease checked against the first attempt's time could be extended after
        it expired."""
        script, keys = self._scripts[name], [self._prefix + b":seq"]
        wait = self._durability.wait_replicas if name in WRITES else 0
        if not wait:
            return self._link.call(
                lambda client: script(keys=keys, args=self._at_now(args), client=client)
            )
        reply, acked = self._link.call(
            lambda client: _run_and_wait(client, script, keys, self._at_now(args), self._durability)
        )
        if acked < wait:
            raise UnavailableError(
                f"redis at {self._url}: a write reached {acked} of {wait} replicas within "
                f"{self._durability.wait_timeout_ms} ms; it may not survive a failover (retry)"
            )
        return reply

    def _at_now(self, args: Sequence) -> list:
        now = repr(self._clock())
        return [now if arg is NOW else arg for arg in args]

    def _leased(self, name: str, node_id: str, lease_id: int, *extra) -> list:
        """Run a script that checks the lease first; raise for unknown/stale/expired leases."""
        reply = self._run(name, [self._prefix, NOW, self._max_events, node_id, lease_id, *extra])
        status = reply[0]
        if status == b"unknown":
            raise NotFoundError(f"unknown node {node_id!r}: register it first")
        if status == b"stale":
            raise LeaseError(f"node {node_id!r}: lease {lease_id} is not current; register again")
        if status == b"expired":
            raise LeaseError(f"node {node_id!r}: lease {lease_id} expired; register again")
        return reply

    # ---- nodes ----------------------------------------------------------------------------
    def register_node(self, node: NodeRecord, lease_ttl_ms: int) -> NodeRecord:
        expires_at = self._clock() + lease_ttl_ms / 1000
        info = json.dumps([node.tcp_address, node.ucx_address, node.tier_capacity_bytes])
        lease_id = new_lease_id()  # a string in Redis: Lua's numbers are doubles
        self._run(
            "register",
            [self._prefix, node.node_id, repr(expires_at), lease_ttl_ms, info, str(lease_id)],
        )
        return NodeRecord(
            node.node_id,
            node.tcp_address,
            node.ucx_address,
            dict(node.tier_capacity_bytes),
            lease_id=lease_id,
            lease_ttl_ms=lease_ttl_ms,
            expires_at=expires_at,
        )

    def heartbeat(self, node_id: str, lease_id: int) -> NodeRecord:
        _, ttl, info, expires_at = self._leased("heartbeat", node_id, lease_id)
        return self._record(node_id, expires_at, lease_id, ttl, info)

    @staticmethod
    def _record(node_id: str, expires_at, lease_id, ttl, info) -> NodeRecord:
        tcp, ucx, capacity = json.loads(info)
        return NodeRecord(node_id, tcp, ucx, capacity, int(lease_id), int(ttl), float(expires_at))

    def deregister_node(self, node_id: str, lease_id: int) -> int:
        return self._leased("deregister", node_id, lease_id)[1]

    def live_nodes(self) -> dict[str, NodeRecord]:
        nodes, _, _ = self._run("nodes", [self._prefix, f"({self._clock()!r}", ""])
        return {n.decode(): self._record(n.decode(), *row[:4]) for n, *row in nodes}

    def expire_leases(self) -> list[str]:
        """Purge every node whose lease expired. Each purge re-checks expiry inside its script,
        so concurrent callers (other replicas) purge a node exactly once; this returns the
        nodes this call purged."""
        now = self._clock()
        due = self._link.call(
            lambda client: client.zrangebyscore(self._prefix + b":exp", "-inf", repr(now))
        )
        expired = []
        for node in due:
            args = [self._prefix, repr(now), self._max_events, node]
            if self._run("expire", args) >= 0:
                expired.append(node.decode())
        return expired

    # ---- holdings -------------------------------------------------------------------------
    def publish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        quads = [part for e in entries for part in (e.key, e.tier, e.size_bytes, e.checksum)]
        reply = self._leased("publish", node_id, lease_id, tenant, self._quota, *quads)
        if reply[0] == b"quota":
            held, new_keys = reply[1], reply[2]
            raise QuotaExceededError(
                f"tenant {tenant!r} holds {held} keys; {new_keys} more "
                f"would exceed its quota of {self._quota}"
            )
        return reply[1]

    def unpublish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        pairs = [part for e in entries for part in (e.key, e.tier)]
        return self._leased("unpublish", node_id, lease_id, tenant, *pairs)[1]

    def lookup(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> list[list[Holding]]:
        """One round trip: the ids of nodes live at `now`, then one MGET of the prompt's holder
        records. Not a MULTI: a script running between the two can only hide a holder (its node
        purged, or registered after the first read), never show a dead one."""
        if not keys:
            return []
        live_ids, blobs = self._round_trip(*self.lookup_commands(tenant, keys))
        return holders_prefix(blobs, frozenset(live_ids))

    def lookup_commands(self, tenant: str, keys: Sequence[bytes]) -> tuple[tuple, tuple]:
        """A lookup's two commands: the ids of nodes live now, the holder records of `keys`."""
        stem = self.holders_stem(tenant)
        return self.live_command(), (b"MGET", *(stem + key for key in keys))

    def live_command(self) -> tuple:
        """The ids of the nodes live now (a lookup's first command)."""
        return (b"ZRANGEBYSCORE", self._prefix + b":exp", f"({self._clock()!r}", b"+inf")

    def holders_stem(self, tenant: str) -> bytes:
        """What the names of `tenant`'s holder records start with (then the key)."""
        return self._prefix + b":h:" + tenant.encode() + b"\0"

    def loop_lookups(self, loop):
        from kvstore.metadata.index.redis_lookups import RedisLoopLookups

        return RedisLoopLookups.of(self, loop)

    def snapshot(self, tenant: str) -> tuple[int, dict[str, NodeRecord], list]:
        """The seq first, then SCAN pages of holder records (each page one script: SCAN + MGET).
        Not a point-in-time copy, but replay-safe: a key no event after that seq touched reads
        as it was at the seq, and a key one did is set by replaying those events (idempotent
        adds and removes, in order) whatever the copy read. The seq and every page are read on
        one master: a failover mid-way (an error) restarts the whole copy on the new one."""
        stem = self._prefix + b":h:"
        pattern = _glob_escape(stem + (tenant.encode() + b"\0" if tenant else b"")) + b"*"
        last_seq, held = self._link.call(lambda client: self._scan(client, pattern, len(stem)))
        copies = [(name, list(held[name].items())) for name in sorted(held)]
        return last_seq, self.live_nodes(), copies

    def _scan(self, client: redis.Redis, pattern: bytes, stem_len: int) -> tuple[int, dict]:
        last_seq = int(client.get(self._prefix + b":seq") or 0)
        script, keys, held, cursor = self._scripts["scan"], [self._prefix + b":seq"], {}, b"0"
        while True:
            args = [self._prefix, cursor, pattern, SNAPSHOT_SCAN_COUNT]
            cursor, names, blobs = script(keys=keys, args=args, client=client)
            for name, blob in zip(names, blobs, strict=True):
                if blob:  # gone between SCAN and MGET: its removal is an event after last_seq
                    tenant, _, key = name[stem_len:].partition(b"\0")
                    holdings = decode(blob)[1]  # afresh: read once
                    held.setdefault(tenant.decode(), {})[key] = holdings
            if cursor in (b"0", 0):
                return last_seq, held

    @property
    def incarnation(self) -> int:  # type: ignore[override]
        """Random, kept at P:inc by whichever replica reads it first, so replicas over one Redis
        agree; a Redis that lost its data (FLUSHALL, a restart without persistence) gets a new
        one, as its events are numbered afresh. Folded with the master's replication id: a
        replica promoted by a failover may not have the newest events, and issues their seqs
        again for others (P:inc, replicated long before, would not tell). Two round trips
        (Stats, Snapshot and WatchEvents pages ask)."""
        stored = int(self._run("incarnation", [self._prefix, secrets.randbits(63) | 1]))
        folded = hashlib.blake2b(
            b"%d/%s" % (stored, self._link.replication_id().encode()), digest_size=8
        ).digest()
        return int.from_bytes(folded, "big") >> 1 | 1

    def index_id(self) -> bytes:
        """Of P:inc, the number the incarnation is folded from: kept by whichever replica asks
        first, so the replicas over one Redis and prefix share it, and another prefix or Redis
        has its own; an emptied Redis gets a new one (the service re-reads it). One round trip."""
        return id_of_incarnation(self._run("incarnation", [self._prefix, secrets.randbits(63) | 1]))

    def _round_trip(self, *commands: tuple) -> list:
        """Send `commands` back to back on one pooled connection and read their raw replies:
        the lookup hot path, without the pipeline machinery (about 60 µs less per call)."""
        return self._link.call(lambda client: _round_trip_on(client.connection_pool, commands))

    # ---- events ---------------------------------------------------------------------------
    def events_since(self, from_seq: int, max_events: int) -> EventPage:
        stream = self._prefix + b":ev"

        def read(client: redis.Redis) -> list:
            with client.pipeline(transaction=True) as pipe:
                pipe.get(self._prefix + b":seq")
                pipe.xrange(stream, count=1)
                if max_events > 0:
                    pipe.xrange(stream, min=f"0-{max(from_seq, 0)}", count=max_events)
                return pipe.execute()

        last, first, *page = self._link.call(read)
        last_seq = int(last or 0)
        oldest = _seq(first[0][0]) if first else last_seq + 1
        events = [_event(event_id, fields) for event_id, fields in (page[0] if page else [])]
        # Ahead of the index: a failover lost the newest events (replication is asynchronous),
        # and their seqs will be issued again for other events. The reader must resync.
        ahead = from_seq > last_seq + 1
        return EventPage(events, ahead or (from_seq < oldest and from_seq <= last_seq), last_seq)

    def wait_for_events(self, after_seq: int, timeout_s: float) -> bool:
        """XREAD BLOCK on a pooled connection of its own, in slices of WAIT_CHUNK_S."""
        deadline = time.monotonic() + timeout_s
        streams = {self._prefix + b":ev": f"0-{max(after_seq, 0)}"}
        while True:
            remaining_s = deadline - time.monotonic()
            block_ms = int(min(remaining_s, WAIT_CHUNK_S) * 1000)
            block = block_ms if block_ms > 0 else None
            if self._link.call(lambda client, b=block: client.xread(streams, count=1, block=b)):
                return True
            if remaining_s <= WAIT_CHUNK_S:
                return self._last_seq() > after_seq

    def _last_seq(self) -> int:
        return int(self._link.call(lambda client: client.get(self._prefix + b":seq")) or 0)

    # ---- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        nodes, tenants, last_seq = self._run("nodes", [self._prefix, "-inf", "stats"])
        per_node = {node.decode(): _pairs(row[-1]) for node, *row in nodes}
        per_tier: dict[str, int] = {}
        for counts in per_node.values():
            for tier, n in counts.items():
                per_tier[tier] = per_tier.get(tier, 0) + n
        return {
            "blocks": sum(per_tier.values()),
            "blocks_per_tier": per_tier,
            "blocks_per_node": per_node,
            "keys_per_tenant": _pairs(tenants),
            "last_event_seq": int(last_seq),
        }

    def close(self) -> None:
        self._link.close()


def id_of_incarnation(stored: bytes) -> bytes:
    """MetadataIndex.index_id of an index whose P:inc holds `stored`."""
    return hashlib.blake2b(b"index/%d" % int(stored), digest_size=16).digest()


def _glob_escape(text: bytes) -> bytes:
    """`text` matched literally in a SCAN MATCH pattern."""
    for special in (b"\\", b"*", b"?", b"[", b"]"):
        text = text.replace(special, b"\\" + special)
    return text


def _round_trip_on(pool: redis.ConnectionPool, commands: tuple) -> list:
    conn = pool.get_connection()
    try:
        return conn.retry.call_with_retry(
            lambda: _send_and_read(conn, commands), lambda _error: conn.disconnect()
        )
    except BaseException:
        conn.disconnect()  # replies may be left unread on it
        raise
    finally:
        pool.release(conn)


def _send_and_read(conn: redis.Connection, commands: tuple) -> list:
    conn.send_packed_command(conn.pack_commands(commands))
    return [conn.read_response() for _ in commands]


def _run_and_wait(client: redis.Redis, script, keys, args, durability: Durability) -> tuple:
    """The script, then WAIT on the same connection: (script reply, replicas that have it)."""
    with client.pipeline(transaction=False) as pipe:
        script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", durability.wait_replicas, durability.wait_timeout_ms)
        reply, acked = pipe.execute()
    return reply, int(acked)


def _seq(event_id: bytes) -> int:
    return int(event_id.split(b"-", 1)[1])


def _event(event_id: bytes, fields: dict[bytes, bytes]) -> IndexEvent:
    return IndexEvent(
        _seq(event_id),
        fields[b"k"].decode(),
        fields[b"t"].decode(),
        fields[b"key"],
        fields[b"n"].decode(),
        fields[b"tier"].decode(),
    )
