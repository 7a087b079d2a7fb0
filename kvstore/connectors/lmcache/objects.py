"""LMCache's memory objects in kvstore, synchronously: store, look up and load (ObjectKey,
MemoryObj) pairs through the node agent. A stored object is one kvstore block holding the
object's bytes as they are; its checksum is taken as it is copied into the arena and checked
as it is copied out, so a block that changed or does not fit its destination is a miss.

Runs in the `lmcache server` process, on the adapter's store and read threads. Agent failures
are misses and incomplete stores, never exceptions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryObj

from kvstore.client import KVStoreClient, LoadedBlocks
from kvstore.connectors.lmcache.agent import FAILURES, AgentConnection
from kvstore.connectors.lmcache.keys import block_key, scope_runs
from kvstore.connectors.lmcache.stats import AdapterStats
from kvstore.keys import BlockKey
from kvstore.kvcopy.verified import copy_and_checksum

logger = logging.getLogger(__name__)


@dataclass
class Stored:
    """What a store did: the positions written now, and whether every object is in kvstore
    (written now, or held already)."""

    written: list[int] = field(default_factory=list)
    complete: bool = True
    written_bytes: int = 0


def object_bytes(obj: MemoryObj) -> torch.Tensor | None:
    """The object's logical bytes as a flat uint8 view (no copy); None if LMCache freed it."""
    raw = obj.raw_tensor
    return None if raw is None else raw.view(torch.uint8)[: obj.get_size()]


class KVStoreObjects:
    def __init__(self, agent: AgentConnection, stats: AdapterStats) -> None:
        self.agent = agent
        self.stats = stats
        self.tenant = agent.config.tenant
        self.salt = agent.config.salt

    def block_keys(self, keys: Sequence[ObjectKey]) -> list[BlockKey]:
        return [block_key(key, self.tenant, self.salt) for key in keys]

    # ---- lookups ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ObjectKey]) -> list[int]:
        """Positions of the keys this host or another node can serve: the leading ones of each
        scope's run. No side effect: kvstore pins a block only while it is loaded."""
        client, found = self.agent.client(), []
        if client is not None:
            block_keys = self.block_keys(keys)
            try:
                for run in scope_runs(keys):
                    hits = client.lookup(self.tenant, block_keys[run.start : run.stop]).total
                    found.extend(run[:hits])
            except FAILURES as exc:
                logger.warning("kvstore lookup failed: %s", exc)
        self.stats.count(lookup_keys=len(keys), found_keys=len(found))
        return found

    # ---- loads -----------------------------------------------------------------------------
    def load(self, keys: Sequence[ObjectKey], objects: Sequence[MemoryObj]) -> list[int]:
        """Copy the leading loadable blocks of each scope's run into their objects; the
        positions loaded. A block of another size than its object, or whose copy fails its
        checksum, ends its run."""
        client, loaded = self.agent.client(), []
        if client is not None:
            block_keys = self.block_keys(keys)
            try:
                for run in scope_runs(keys):
                    wanted = block_keys[run.start : run.stop]
                    loaded.extend(self._load_run(client, run, wanted, objects))
            except FAILURES as exc:
                logger.warning("kvstore load failed: %s", exc)
        self.stats.count(load_keys=len(keys), loaded_keys=len(loaded))
        return loaded

    def _load_run(self, client: KVStoreClient, run: range, wanted, objects) -> list[int]:
        blocks = client.load(self.tenant, wanted, self.agent.config.load_timeout_s, verify=False)
        copied, suspect = [], []
        try:
            for index, position in enumerate(run[: len(blocks)]):
                destination = object_bytes(objects[position])
                if destination is None or blocks.payloads[index].numel() != destination.numel():
                    self.stats.count(unfit_blocks=1)  # another layout under the same key
                    break
                if not blocks.copy_to(index, destination):
                    logger.warning("a kvstore block changed while it was read: a miss")
                    self.stats.count(checksum_mismatches=1)
                    suspect = [index]
                    break
                copied.append(position)
        finally:
            _release(client, blocks, suspect)
        self.stats.count(loaded_bytes=sum(objects[p].get_size() for p in copied))
        return copied

    # ---- stores ----------------------------------------------------------------------------
    def store(self, keys: Sequence[ObjectKey], objects: Sequence[MemoryObj]) -> Stored:
        """Write every object not held yet; one save per run of one scope and one size."""
        client, stored = self.agent.client(), Stored()
        if client is None:
            stored.complete = False
            return stored
        block_keys = self.block_keys(keys)
        try:
            for batch in _batches(keys, objects):
                self._store_batch(client, batch, [block_keys[p] for p in batch], objects, stored)
        except FAILURES as exc:
            logger.warning("kvstore store of %d objects failed: %s", len(keys), exc)
            stored.complete = False
        self.stats.count(stored_keys=len(stored.written), stored_bytes=stored.written_bytes)
        return stored

    def _store_batch(self, client, batch: list[int], block_keys, objects, stored: Stored) -> None:
        """One save: reserve, copy in with checksums, commit; abort what was not written."""
        size = objects[batch[0]].get_size()
        reservation = client.save(self.tenant, block_keys, size)
        views = reservation.payloads
        try:
            written, checksums = _write(views, [objects[p] for p in batch])
            done = [block_keys[i] for i in written]
            committed = client.commit(reservation, keys=done, checksums=checksums) if done else 0
        except BaseException:
            _abort(client, reservation)
            raise
        if len(written) < _reserved(views):
            _abort(client, reservation)  # pages reserved for objects LMCache freed meanwhile
        if committed == len(written):  # else which ones were is unknown: none is sure
            stored.written.extend(batch[i] for i in written)
            stored.written_bytes += size * len(written)
        unreserved = [key for key, view in zip(block_keys, views, strict=True) if view is None]
        stored.complete &= committed == len(written) == _reserved(views) and _all_held(
            client, self.tenant, unreserved
        )


def _batches(keys: Sequence[ObjectKey], objects: Sequence[MemoryObj]) -> list[list[int]]:
    """Positions by run of one scope (a chain), split where the object size changes."""
    batches: list[list[int]] = []
    for run in scope_runs(keys):
        for position in run:
            size = objects[position].get_size()
            if position == run.start or size != objects[batches[-1][-1]].get_size():
                batches.append([])
            batches[-1].append(position)
    return batches


def _write(views, objects) -> tuple[list[int], list[int]]:
    """Copy each object whose block was reserved into its page: the indices written and their
    checksums (an object LMCache freed meanwhile is not written)."""
    written, checksums = [], []
    for index, (view, obj) in enumerate(zip(views, objects, strict=True)):
        source = object_bytes(obj)
        if view is None or source is None:
            continue
        checksums.append(copy_and_checksum(view, source))
        written.append(index)
    return written, checksums


def _reserved(views) -> int:
    return sum(view is not None for view in views)


def _all_held(client: KVStoreClient, tenant: str, keys: list[BlockKey]) -> bool:
    """Whether this node holds each of `keys` (the agent reserves no page for a block it holds
    already, nor for one another worker is writing or when it has no room)."""
    return all(client.lookup(tenant, [key], local_only=True).local == 1 for key in keys)


def _release(client: KVStoreClient, blocks: LoadedBlocks, suspect: list[int]) -> None:
    try:
        client.release(blocks, suspect)
    except FAILURES as exc:  # the agent frees a broken connection's pins itself
        logger.warning("kvstore release failed: %s", exc)


def _abort(client: KVStoreClient, reservation) -> None:
    try:
        client.abort(reservation)
    except FAILURES:  # a broken connection's reservations are freed by the agent
        logger.debug("kvstore abort failed", exc_info=True)
