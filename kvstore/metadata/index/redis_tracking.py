"""What the Redis index's lookups on the loop keep between lookups: the holder records, the live
set and the node records they read on a tracking pipe (redis_pipe.py), each until Redis says
its key changed.

Runs in the metadata service process, on the gRPC loop: one TrackedRecords per pipe of a
RedisLoopLookups (redis_lookups.py), filled from its replies as they are read and emptied by
its invalidations in the same stream, so no value outlives a change Redis made after the read
by more than the invalidation's way here. The pipe is drained before each answer, so what a
lookup answered from here can miss is a change Redis has not yet written to this connection:
Redis writes a change's reply and its invalidations in one pass of its loop, the reply may go
first, and a lookup asked in between answers what was there before the change that another
replica has just acknowledged (microseconds; with Redis descheduled, longer: 1 of 600 lookups
asked right after an acknowledged unpublish on a loaded 2-core machine, for one lookup). A
stale positive costs a worker a failed fetch, as one does from an eviction whose unpublish is
still in its agent's outbox. A connection opened or lost empties it (invalidations may be
lost), and so does age: nothing is kept past MAX_AGE_S, a bound on what an unseen change (a
master cut off from the cluster that still answers) could leave. Liveness is the service
clock's at each lookup (lease expiry changes no key), as the index's own lookup reads it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import chain
from operator import attrgetter

from kvstore.metadata.index.base import Found
from kvstore.metadata.index.redis_holders import holders_prefix
from kvstore.metadata.index.redis_index import RedisIndex
from kvstore.metadata.records import NodeRecord

MAX_AGE_S = 1.0  # values read longer ago are read again
MAX_HOLDER_RECORDS = 1 << 16  # kept records (a few MB); past it, the lot is let go
ABSENT = b""  # a key without a holder record (holders_prefix reads it as no holder)
_NODE_ID = attrgetter("node_id")


def live_set(reply: list) -> dict[bytes, float]:
    """ZRANGE ... WITHSCORES' reply (RESP3 pairs, or RESP2's flat list) as node -> expiry."""
    if reply and isinstance(reply[0], list):
        return {node: float(expires_at) for node, expires_at in reply}
    return {reply[i]: float(reply[i + 1]) for i in range(0, len(reply), 2)}


class TrackedRecords:
    """A RedisIndex's records under `prefix`, as last read on one tracked connection."""

    def __init__(self, prefix: bytes) -> None:
        self.live_name = prefix + b":exp"
        self.node_stem = prefix + b":node:"
        self.holder_stem = prefix + b":h:"
        self.reset()

    def reset(self) -> None:
        self.holders: dict[bytes, dict[bytes, bytes]] = {}  # by tenant's stem, then key
        self.held = 0
        self.live: dict[bytes, float] | None = None
        self._alive: tuple[float, frozenset[bytes]] = (float("-inf"), frozenset())
        self.nodes: dict[bytes, list] = {}  # node id -> its hash's lease, ttl, info
        self.born = time.monotonic()

    def invalidate(self, names: list[bytes] | None) -> None:
        if names is None:
            self.reset()
            return
        for name in names:
            if name.startswith(self.holder_stem):
                cut = name.find(b"\0", len(self.holder_stem)) + 1
                held = self.holders.get(name[:cut])
                if held is not None:
                    held.pop(name[cut:], None)
            elif name == self.live_name:
                self.live = None
            elif name.startswith(self.node_stem):
                self.nodes.pop(name[len(self.node_stem) :], None)

    # ---- filled from replies, as they are read ------------------------------------------
    def fill_live(self, reply: list) -> None:
        self.live = live_set(reply)
        self._alive = (float("-inf"), frozenset())

    def fill_holders(self, stem: bytes, keys: Sequence[bytes], blobs: list) -> None:
        self.held += len(keys)
        if self.held > MAX_HOLDER_RECORDS:
            self.holders, self.held = {}, len(keys)
        held = self.holders.setdefault(stem, {})
        held.update(zip(keys, [ABSENT if blob is None else blob for blob in blobs], strict=True))

    def fill_nodes(self, node_ids: Sequence[bytes], hashes: Sequence[list]) -> None:
        self.nodes.update(zip(node_ids, hashes, strict=True))

    # ---- read -----------------------------------------------------------------------------
    def found(self, stem: bytes, keys: Sequence[bytes], now: float) -> Found | None:
        """The lookup of `keys` answered from what is kept; None where it needs a read."""
        if time.monotonic() - self.born > MAX_AGE_S:
            self.reset()
            return None
        held = self.holders.get(stem)
        if held is None or self.live is None:
            return None
        blobs = list(map(held.get, keys))
        if None in blobs:  # not kept: needed unless the prefix ends before it
            blobs = blobs[: blobs.index(None)]
            found = holders_prefix(blobs, self.alive(now))
            if len(found) == len(blobs):
                return None
        else:
            found = holders_prefix(blobs, self.alive(now))
        holders = dict.fromkeys(map(_NODE_ID, chain.from_iterable(found)))
        nodes = node_records(holders, self.live, self.nodes, now)
        return None if nodes is None else (found, nodes)

    def alive(self, now: float) -> frozenset[bytes]:
        """Nodes whose lease has not ended at `now` (kept until the first of them ends)."""
        until, alive = self._alive
        if now >= until:
            live = self.live
            alive = frozenset(node for node, expires_at in live.items() if expires_at > now)
            until = min((live[node] for node in alive), default=float("inf"))
            self._alive = (until, alive)
        return alive


def node_records(
    holders, live: dict[bytes, float], hashes: dict[bytes, list], now: float
) -> dict[str, NodeRecord] | None:
    """The records of `holders` (node ids) live at `now`, from the live set and their hashes
    (RedisIndex.live_nodes' records); None where a holder's hash is not known."""
    records = {}
    for node_id in holders:
        node = node_id.encode()
        fields = hashes.get(node)
        if fields is None:
            return None
        expires_at = live.get(node)
        if fields[0] is not None and expires_at is not None and expires_at > now:
            records[node_id] = _record(node_id, expires_at, *fields)
    return records


_records: dict[tuple, NodeRecord] = {}  # by the replies they came from (the loop's alone)


def _record(*replied) -> NodeRecord:
    """RedisIndex._record of a node's fields, kept by them (a heartbeat: another expiry)."""
    record = _records.get(replied)
    if record is None:
        if len(_records) >= 256:
            _records.clear()
        record = _records[replied] = RedisIndex._record(*replied)
    return record
