"""Remote reads: pull blocks other nodes hold into this node's arena as local replicas.

Runs in the node agent, on the control-server thread of the worker that asked for a load.
Every received block is checksummed before it becomes readable; the first failure ends the
prefix, so a load never has holes. Holders come from the agent's ClusterView when it can answer
(no round trip), else from the metadata service; a failed fetch corrects the view. A load of
blocks another worker's load is already receiving waits for them (within its own deadline), so
each block crosses the network once and both loads get it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import CapacityError, TransferError
from kvstore.keys import BlockKey
from kvstore.node.link import MetadataLink
from kvstore.node.view import ClusterView
from kvstore.owned import owned_keys
from kvstore.store import TieredStore
from kvstore.transfer.base import TransferEngine

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass
class FetchStats:
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0  # blocks that arrived but failed verification
    failed_fetches: int = 0  # batched fetches from one holder that delivered less than asked


class RemoteFetcher:
    def __init__(
        self,
        store: TieredStore,
        link: MetadataLink,
        engine: TransferEngine,
        node_id: str,
        view: ClusterView | None = None,
    ) -> None:
        self.store = store
        self.link = link
        self.engine = engine
        self.node_id = node_id
        self.view = view
        self.stats = FetchStats()

    def remote_prefix(self, tenant: str, keys: Sequence[BlockKey], chunk_tokens: int = 0) -> int:
        """How many leading `keys` other live nodes hold: from the view when it can answer,
        else from the service (0 while the service is down), told the tokens per key."""
        if self.view is not None:
            answer = self.view.remote_prefix(tenant, keys)
            if answer is not None:
                return answer
        result = self.link.lookup(tenant, keys, chunk_tokens=chunk_tokens)
        if result is None:
            return 0
        return len(self._plan(result, keys))

    def fetch(self, tenant: str, keys: Sequence[BlockKey], timeout_s: float) -> int:
        """Copy the leading `keys` from their holders into the store; returns how many arrived.
        A holder that failed to deliver keys is no longer named for them by the view."""
        deadline = time.monotonic() + timeout_s  # the service's answer counts against it too
        plan = self._holders(tenant, keys, deadline)
        owned = owned_keys(tenant, keys)  # the store's names of the tenant's blocks
        done, stalled = 0, False
        while done < len(plan):
            joined = self._arrived_meanwhile(owned[done : len(plan)], deadline)
            done += joined
            if done == len(plan) or (stalled and not joined):  # no room, or a save holds it
                break
            node_id, address = plan[done]
            wanted = keys[done : done + _run_length(plan, done)]
            arrived, tried = self._fetch_run(address, tenant, wanted, deadline)
            if arrived < tried:
                self.stats.failed_fetches += 1
                self._correct_view(tenant, wanted[arrived:tried], node_id, address, deadline)
                return done + arrived
            done += arrived
            # none reserved: the first key may have been taken by another load since it was
            # checked; the next round waits for it (and stops if nothing came of it)
            stalled = tried == 0
        return done

    def _arrived_meanwhile(self, keys: Sequence[bytes], deadline: float) -> int:
        """How many leading owned `keys` are stored now, waiting (until `deadline`) for those
        another worker's load is receiving: this load joins that fetch rather than fetch them
        twice."""
        count = 0
        for key in keys:
            if not self.store.await_arrival(key, deadline - time.monotonic()):
                break
            count += 1
        return count

    def _correct_view(
        self,
        tenant: str,
        keys: Sequence[BlockKey],
        node_id: str,
        address: str,
        deadline: float,
    ) -> None:
        """After a failed fetch, ask the service (the failure path only) within the load's
        deadline: a holder it names at a new address restarted there (its keys came back by
        events), so the view learns the address; otherwise (or with no time left) the view
        stops naming that holder for `keys`, and forgets its address until the service says."""
        if self.view is None:
            return
        left_s = deadline - time.monotonic()
        result = self.link.lookup(tenant, keys, timeout_s=left_s) if left_s > 0 else None
        if result is not None:
            current = self._address(result, node_id)
            if current and current != address:
                self.view.learn_addresses({node_id: result.addresses[node_id]})
                return
        self.view.forget(tenant, keys, node_id)

    def _holders(
        self, tenant: str, keys: Sequence[BlockKey], deadline: float
    ) -> list[tuple[str, str]]:
        """Per leading key, (node id, address) of its best other holder: the view's, else the
        service's answer by `deadline` (none after it)."""
        ucx = self.engine.name == "ucx"
        plan = self.view.plan(tenant, keys, ucx) if self.view is not None else None
        if plan is not None:
            return plan
        result = self.link.lookup(tenant, keys, timeout_s=max(deadline - time.monotonic(), 0))
        if result is None:
            return []
        if self.view is not None:
            self.view.learn_addresses(result.addresses)
        return self._plan(result, keys)

    def _plan(self, result, keys: Sequence[BlockKey]) -> list[tuple[str, str]]:
        """Per leading key, the best other holder and its address (stops where none is)."""
        plan = []
        for holders in result.holders:
            holder = next(
                (
                    (h.node_id, self._address(result, h.node_id))
                    for h in holders
                    if h.node_id != self.node_id
                ),
                ("", ""),
            )
            if not holder[1]:
                break
            plan.append(holder)
        return plan[: len(keys)]

    def _address(self, result, node_id: str) -> str:
        tcp, ucx = result.addresses.get(node_id, ("", ""))
        return ucx if self.engine.name == "ucx" else tcp

    def _fetch_run(
        self, address: str, tenant: str, keys: Sequence[BlockKey], deadline: float
    ) -> tuple[int, int]:
        """(blocks that arrived and were committed, blocks asked of the holder)."""
        owned = owned_keys(tenant, keys)
        pages = self._reserve(owned)
        wanted = keys[: len(pages)]
        owned = owned[: len(pages)]
        checksums: list[int | None] = [None] * len(wanted)  # hashed as they land, if the engine can
        started = time.monotonic()
        try:
            timeout_s = max(0.01, deadline - started)
            received = self.engine.fetch(address, tenant, wanted, pages, timeout_s, checksums)
        except TransferError as exc:
            logger.warning("fetch from %s failed: %s", address, exc)
            received = [0] * len(wanted)
        except BaseException:
            for key in owned:
                self.store.abort(key)
            raise
        self.stats.seconds += time.monotonic() - started
        return self._commit(owned, received, checksums), len(wanted)

    def _reserve(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """Arena pages for the leading owned `keys` that can have one now; on an error (a victim's
        write to disk failing), those reserved so far are given back, never left pending."""
        pages = []
        try:
            for key in keys:
                try:
                    page = self.store.reserve_page(key)
                except CapacityError:
                    break
                if page is None:  # arrived meanwhile (another worker's load): not ours
                    break
                pages.append(page)
        except BaseException:
            for key in keys[: len(pages)]:
                self.store.abort(key)
            raise
        return pages

    def _commit(
        self, keys: Sequence[bytes], received: list[int], checksums: list[int | None]
    ) -> int:
        """Verify (the owned key's tenant included) and commit in order; at the first failure,
        free every later page."""
        for index, (key, size) in enumerate(zip(keys, received, strict=True)):
            if size and self.store.commit_received(key, size, checksums[index]):
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


def _run_length(plan: list[tuple[str, str]], start: int) -> int:
    """How many keys from `start` on have the same holder: one batched fetch."""
    end = start + 1
    while end < len(plan) and plan[end] == plan[start]:
        end += 1
    return end - start
