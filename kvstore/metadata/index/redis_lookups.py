"""The Redis indexes' lookups on the service's event loop (LoopLookups): the index's own
commands, sent on pipes (redis_pipe.py) to the master that holds the keys, then one more round
trip for the records of the holders found (what `live_addresses` would give of them).

Runs in the metadata service process: built off the loop (the servers its links lead to), used
on the gRPC loop by lookup-port connections and LookupStream calls. What the index would answer
it answers, from the same keys (`RedisIndex`'s holder records, live set and node hashes;
`ShardedRedisIndex`'s names, the MGET packed without building them: `pack_mget`), its cached
live set, and `holders_prefix`. RedisIndex's are read on a tracking pipe and kept until Redis
invalidates them (redis_tracking.py: what that staleness is), so a lookup asked again is
answered without I/O (`lookup_now`); the sharded index's are read at every lookup. A server
gone or moved (a refused or lost connection, MOVED, CLUSTERDOWN, ...) answers None: the service
asks the index itself off the loop, which follows failovers, then `refresh` finds the servers
again. A late reply is UnavailableError.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter

import hiredis

from kvstore.metadata.index.base import Found, LoopLookups
from kvstore.metadata.index.redis_holders import holders_prefix
from kvstore.metadata.index.redis_index import RedisIndex
from kvstore.metadata.index.redis_pipe import (
    Fill,
    PipeAddress,
    PipeError,
    RedisPipe,
    ReplyError,
    ReplyLate,
    Tracker,
    pack_mget,
)
from kvstore.metadata.index.redis_tracking import TrackedRecords, live_set, node_records
from kvstore.metadata.records import Holding, NodeRecord

# error replies of a server that no longer serves the slot, or not yet: ask the index itself
FAILOVER_REPLIES = frozenset(
    {"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "READONLY", "MASTERDOWN"}
)


class _Pipes:
    """A pipe to the server each of the index's links leads to now (`by_link`, in the links'
    order; one pipe per server)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        links: Sequence,
        tracker: Callable[[], Tracker] | None = None,
    ) -> None:
        """`tracker`: makes each pipe's Tracker (None: reads are not tracked)."""
        self.loop = loop
        self.links = links
        self.tracker = tracker
        self.by_link: list[RedisPipe] = []
        self._pipes: dict[PipeAddress, RedisPipe] = {}
        self._lock = threading.Lock()  # refreshes from several threads at once

    def refresh(self) -> bool:
        """Find each link's server (its slot map as last read; no I/O); False where one
        cannot be piped (TLS). Pipes no longer used are closed."""
        addresses = [PipeAddress.of(link.client()) for link in self.links]
        if None in addresses:
            return False
        with self._lock:
            for address in addresses:
                if address not in self._pipes:
                    tracker = None if self.tracker is None else self.tracker()
                    self._pipes[address] = RedisPipe(self.loop, address, tracker=tracker)
            unused = [self._pipes.pop(a) for a in set(self._pipes) - set(addresses)]
            self.by_link = [self._pipes[address] for address in addresses]
        for pipe in unused:
            self.loop.call_soon_threadsafe(pipe.close)
        return True

    def close(self) -> None:
        for pipe in self._pipes.values():
            pipe.close()


async def _ask(
    pipe: RedisPipe, commands: Sequence[tuple | bytes], fill: Fill | None = None
) -> list | None:
    """The replies; None where the server is gone or no longer serves the keys."""
    try:
        return await pipe.call(commands, fill)
    except ReplyLate:
        raise
    except PipeError:
        return None
    except ReplyError as exc:
        if exc.reply.split(" ", 1)[0] in FAILOVER_REPLIES:
            return None
        raise


_FIELDS = (b"lease", b"ttl", b"info")  # of a node's hash, as `live_nodes` reads them
_NODE_ID = attrgetter("node_id")
RECENT_HOLDERS = 8  # nodes whose records each lookup asks for beside its keys


class _Addresses:
    """The records of a lookup's holders, from the node hashes and expiry set under `prefix`:
    those live now, as `live_nodes` reads them. Those of the RECENT_HOLDERS nodes that held
    the last prompts are asked for with the keys (`guess`), so a lookup whose holders are
    among them takes one round trip; others' after the keys' replies."""

    def __init__(self, prefix: bytes, clock: Callable[[], float]) -> None:
        self.prefix = prefix
        self.clock = clock
        self.recent: dict[str, None] = {}  # node ids, the last holder last
        self._guess: tuple[list[str], list[bytes]] = ([], [])
        self._decoded: dict[tuple, NodeRecord] = {}  # records by the replies they came from

    def guess(self) -> tuple[list[str], list[bytes]]:
        """The recent holders and the commands that read their records (packed again only
        when the holders change)."""
        node_ids = list(self.recent)
        if node_ids != self._guess[0]:
            self._guess = node_ids, self._commands(node_ids)
        return self._guess

    def _commands(self, node_ids: list[str]) -> list[bytes]:
        commands = []
        for node_id in node_ids:
            commands.append((b"HMGET", self.prefix + b":node:" + node_id.encode(), *_FIELDS))
            commands.append((b"ZSCORE", self.prefix + b":exp", node_id))
        return list(map(hiredis.pack_command, commands))

    def _records(self, node_ids: list[str], replies: list) -> dict[str, NodeRecord]:
        now, nodes = self.clock(), {}
        for i, node_id in enumerate(node_ids):
            (lease, ttl, info), expires_at = replies[2 * i], replies[2 * i + 1]
            if lease is not None and expires_at is not None and float(expires_at) > now:
                nodes[node_id] = self._record(node_id, expires_at, lease, ttl, info)
        return nodes

    def _record(self, *replied) -> NodeRecord:
        """RedisIndex._record of a node's replied fields, kept by them: the same replies, the
        same record (a heartbeat's new expiry is another reply); a few holders' at a time."""
        record = self._decoded.get(replied)
        if record is None:
            if len(self._decoded) >= 4 * RECENT_HOLDERS:
                self._decoded.clear()
            record = self._decoded[replied] = RedisIndex._record(*replied)
        return record

    async def of(
        self, pipe: RedisPipe, found: list, guessed: list[str], replies: list
    ) -> Found | None:
        """`found` with its holders' records: `replies` to the `guess` of `guessed`, the
        others asked of `pipe` now."""
        holders = list(dict.fromkeys(map(_NODE_ID, chain.from_iterable(found))))
        records = self._records(guessed, replies)
        missing = [node_id for node_id in holders if node_id not in self.recent]
        if missing:
            more = await _ask(pipe, self._commands(missing))
            if more is None:
                return None
            records |= self._records(missing, more)
        self.remember(holders)
        return found, {node_id: records[node_id] for node_id in holders if node_id in records}

    def remember(self, holders: list[str]) -> None:
        """`holders` held the last prompt: the next lookups guess them first."""
        for node_id in holders:
            self.recent.pop(node_id, None)
            self.recent[node_id] = None
        while len(self.recent) > RECENT_HOLDERS:
            del self.recent[next(iter(self.recent))]


class _PipedLookups(LoopLookups):
    """What both indexes' loop lookups hold: the index, its servers' pipes, the holders'
    records."""

    def __init__(self, index, pipes: _Pipes, addresses: _Addresses) -> None:
        self.index = index
        self.pipes = pipes
        self.addresses = addresses

    def refresh(self) -> None:
        self.pipes.refresh()

    def close(self) -> None:
        self.pipes.close()


class RedisLoopLookups(_PipedLookups):
    """RedisIndex's: from what its tracking pipe read before (TrackedRecords) where that
    answers, else one round trip (the live set, the holder records, the recent holders'
    records), then one for the other holders' records."""

    keeps = True

    @classmethod
    def of(cls, index, loop: asyncio.AbstractEventLoop) -> RedisLoopLookups | None:
        prefix = index._prefix
        pipes = _Pipes(loop, [index._link], lambda: TrackedRecords(prefix))
        if not pipes.refresh():
            return None
        return cls(index, pipes, _Addresses(prefix, index._clock))

    def lookup_now(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> Found | None:
        if not keys:
            return [], {}
        pipe = self.pipes.by_link[0]
        if not pipe.drain():  # not open, or not tracked: nothing kept is known fresh
            return None
        return pipe.tracker.found(self.index.holders_stem(tenant), keys, self.addresses.clock())

    async def lookup(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> Found | None:
        found = self.lookup_now(tenant, keys, anchor)
        if found is not None:
            return found
        pipe, addresses = self.pipes.by_link[0], self.addresses
        tracked: TrackedRecords | None = pipe.tracker
        stem = self.index.holders_stem(tenant)
        guessed = [node_id.encode() for node_id in addresses.recent]
        commands = [(b"ZRANGE", self.index._prefix + b":exp", b"0", b"-1", b"WITHSCORES")]
        commands += [pack_mget(stem, keys), *map(self._node_hash, guessed)]
        fill = None if tracked is None else _filled(tracked, stem, keys, guessed)
        replies = await _ask(pipe, commands, fill)
        if replies is None:
            return None
        scores, blobs, *hashes = replies
        live, now = live_set(scores), addresses.clock()
        found = holders_prefix(blobs, frozenset(n for n, t in live.items() if t > now))
        holders = list(dict.fromkeys(map(_NODE_ID, chain.from_iterable(found))))
        by_node = dict(zip(guessed, hashes, strict=True))
        missing = [n.encode() for n in holders if n.encode() not in by_node]
        if missing:
            fill = None if tracked is None else functools.partial(tracked.fill_nodes, missing)
            more = await _ask(pipe, list(map(self._node_hash, missing)), fill)
            if more is None:
                return None
            by_node |= zip(missing, more, strict=True)
        addresses.remember(holders)
        return found, node_records(holders, live, by_node, now)

    def _node_hash(self, node: bytes) -> tuple:
        return (b"HMGET", self.index._prefix + b":node:" + node, *_FIELDS)


def _filled(tracked: TrackedRecords, stem: bytes, keys: Sequence[bytes], guessed: list) -> Fill:
    """A lookup's round trip's fill: the live set, the holder records, the guessed hashes."""

    def fill(replies: list) -> None:
        tracked.fill_live(replies[0])
        tracked.fill_holders(stem, keys, replies[1])
        tracked.fill_nodes(guessed, replies[2:])

    return fill


class ShardedLoopLookups(_PipedLookups):
    """ShardedRedisIndex's: one MGET on the shard of the prompt's anchor against the cached
    live set (and the shards of keys published without an anchor after the first miss), then
    the holders' records from the membership tag (the last of its pipes)."""

    @classmethod
    def of(cls, index, loop: asyncio.AbstractEventLoop) -> ShardedLoopLookups | None:
        pipes = _Pipes(loop, [*index._links, index._members])
        if not pipes.refresh():
            return None
        return cls(index, pipes, _Addresses(index._members_tag, index._clock))

    async def lookup(
        self, tenant: str, keys: Sequence[bytes], anchor: bytes | None = None
    ) -> Found | None:
        if not keys:
            return [], {}
        live = self.index.alive_cached(self.addresses.clock())
        if live is None:  # the live set is due to be read again: the index does it
            return None
        shard, first, stem = self.index.lookup_stem(tenant, keys, anchor)
        got = await self._read(self.pipes.by_link[shard], pack_mget(stem, keys[1:], (first,)))
        if got is None:
            return None
        blobs, guessed, records = got
        found = holders_prefix(blobs, live)
        if len(found) < len(keys) and self.index.unanchored:
            more = await self._unanchored(tenant, keys[len(found) :], live)
            if more is None:
                return None
            found += more
        return await self.addresses.of(self.pipes.by_link[-1], found, guessed, records)

    async def _read(self, pipe: RedisPipe, mget: bytes) -> tuple[list, list, list] | None:
        """The MGET's reply, with the guessed holders' records read on the membership tag's
        master meanwhile (in the same write where it is the shard's)."""
        guessed, guesses = self.addresses.guess()
        members = self.pipes.by_link[-1]
        if members is pipe or not guesses:
            replies = await _ask(pipe, [mget, *guesses])
            return None if replies is None else (replies[0], guessed, replies[1:])
        blobs, records = await asyncio.gather(_ask(pipe, [mget]), _ask(members, guesses))
        if blobs is None or records is None:
            return None
        return blobs[0], guessed, records

    async def _unanchored(
        self, tenant: str, keys: Sequence[bytes], live: frozenset[bytes]
    ) -> list[list[Holding]] | None:
        """The holdings of `keys` published without an anchor, each on its own shard."""
        by_shard = self.index.unanchored_names(tenant, keys).items()
        pipes = self.pipes.by_link
        replies = await asyncio.gather(
            *(_ask(pipes[shard], ((b"MGET", *names),)) for shard, (_, names) in by_shard)
        )
        if None in replies:
            return None
        blobs: list = [None] * len(keys)
        for (_, (positions, _)), (got,) in zip(by_shard, replies, strict=True):
            for i, blob in zip(positions, got, strict=True):
                blobs[i] = blob
        return holders_prefix(blobs, live)
