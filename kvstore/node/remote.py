"""Remote reads: pull blocks other nodes hold into this node's arena as local replicas.

Runs in the node agent, on the control-server thread of the worker that asked for a load.
Every received block is checksummed before it becomes readable; the first failure ends the
prefix, so a load never has holes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import CapacityError, TransferError
from kvstore.keys import BlockKey
from kvstore.node.link import MetadataLink
from kvstore.store import TieredStore
from kvstore.transfer.base import TransferEngine

logger = logging.getLogger(__name__)


@dataclass
class FetchStats:
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0


class RemoteFetcher:
    def __init__(
        self, store: TieredStore, link: MetadataLink, engine: TransferEngine, node_id: str
    ) -> None:
        self.store = store
        self.link = link
        self.engine = engine
        self.node_id = node_id
        self.stats = FetchStats()

    def remote_prefix(self, tenant: str, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` other live nodes hold (0 while the service is down)."""
        result = self.link.lookup(tenant, keys)
        if result is None:
            return 0
        return len(self._plan(result, keys))

    def fetch(self, tenant: str, keys: Sequence[BlockKey], timeout_s: float) -> int:
        """Copy the leading `keys` from their holders into the store; returns how many arrived."""
        result = self.link.lookup(tenant, keys)
        if result is None:
            return 0
        plan = self._plan(result, keys)
        deadline = time.monotonic() + timeout_s
        done = 0
        for address, run in _runs(plan):
            arrived = self._fetch_run(address, tenant, keys[done : done + len(run)], deadline)
            done += arrived
            if arrived < len(run):
                break
        return done

    def _plan(self, result, keys: Sequence[BlockKey]) -> list[str]:
        """Per leading key, the address of the best other holder (stops where none is)."""
        addresses = []
        for holders in result.holders:
            address = next(
                (self._address(result, h.node_id) for h in holders if h.node_id != self.node_id),
                "",
            )
            if not address:
                break
            addresses.append(address)
        return addresses[: len(keys)]

    def _address(self, result, node_id: str) -> str:
        tcp, ucx = result.addresses.get(node_id, ("", ""))
        return ucx if self.engine.name == "ucx" else tcp

    def _fetch_run(
        self, address: str, tenant: str, keys: Sequence[BlockKey], deadline: float
    ) -> int:
        pages = []
        for key in keys:
            try:
                page = self.store.reserve_page(key)
            except CapacityError:
                break
            if page is None:  # arrived meanwhile (another worker's load): not ours to fetch
                break
            pages.append(page)
        wanted = keys[: len(pages)]
        started = time.monotonic()
        try:
            timeout_s = max(0.01, deadline - started)
            received = self.engine.fetch(address, tenant, wanted, pages, timeout_s)
        except TransferError as exc:
            logger.warning("fetch from %s failed: %s", address, exc)
            received = [0] * len(wanted)
        except BaseException:
            for key in wanted:
                self.store.abort(key)
            raise
        self.stats.seconds += time.monotonic() - started
        return self._commit(tenant, wanted, received)

    def _commit(self, tenant: str, keys: Sequence[BlockKey], received: list[int]) -> int:
        """Verify (tenant included) and commit in order; at the first failure, free every
        later page."""
        for index, (key, size) in enumerate(zip(keys, received, strict=True)):
            if size and self.store.commit_received(key, size, tenant):
                self.stats.blocks += 1
                self.stats.bytes += size
                continue
            if size:
                self.stats.failures += 1  # commit_received already discarded the block
            else:
                self.store.abort(key)
            for later in keys[index + 1 :]:
                self.store.abort(later)
            return index
        return len(keys)


def _runs(plan: list[str]) -> list[tuple[str, list[int]]]:
    """Group consecutive keys with the same holder address: one batched fetch each."""
    runs: list[tuple[str, list[int]]] = []
    for index, address in enumerate(plan):
        if runs and runs[-1][0] == address:
            runs[-1][1].append(index)
        else:
            runs.append((address, [index]))
    return runs
