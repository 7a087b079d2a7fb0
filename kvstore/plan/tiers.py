"""Tier replay for the planner: requests pushed through a real TieredStore (host tier over a disk
tier, the real eviction policies, demotion and promotion) sized in blocks; per request, how many
of its prompt tokens each tier supplied. Runs in the `kvstore plan` process, single-threaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.events import EventFeed
from kvstore.eviction import make_policy
from kvstore.keys import BlockKey
from kvstore.plan.progress import Progress, silent
from kvstore.replay import PAGE_SIZE_BYTES, PLACEHOLDER, TraceKeyer, TraceRequest
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.host import HostTier

TIER_KINDS = ("host", "disk")


@dataclass(frozen=True)
class KeyedRequest:
    """A request as the store sees it: chunk keys, tokens per chunk, and how many leading
    chunks a lookup may return (the engine may refuse the last ones)."""

    keys: tuple[BlockKey, ...]
    chunk_tokens: tuple[int, ...]
    lookup_limit: int

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)


@dataclass(frozen=True)
class TierHits:
    """Per request: prompt tokens, and tokens served by each tier (host, disk)."""

    tokens: np.ndarray
    hit_tokens: dict[str, np.ndarray]
    hit_chunks: dict[str, np.ndarray]
    total_chunks: int = 0

    @property
    def token_hit_ratio(self) -> float:
        return float(sum(t.sum() for t in self.hit_tokens.values()) / max(1, self.tokens.sum()))

    def tier_token_hit_ratio(self, kind: str) -> float:
        return float(self.hit_tokens[kind].sum() / max(1, self.tokens.sum()))

    @property
    def block_hit_ratio(self) -> float:
        chunks = sum(c.sum() for c in self.hit_chunks.values())
        return float(chunks / max(1, self.total_chunks))


class _DiskStandIn(ArenaTier):
    """Placeholder pages named `disk`: residency and eviction are the store's own; the bytes
    (which hit ratios do not depend on) live in DRAM, so a sweep is not bound by LMDB."""

    kind = "disk"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(torch.empty((capacity_pages, PAGE_SIZE_BYTES), dtype=torch.uint8))


def keyed_trace(
    requests: Sequence[TraceRequest], progress: Progress | None = None
) -> list[KeyedRequest]:
    """The project's chained keys of every trace block (as `kvstore replay` computes them);
    `progress` advances by one per request."""
    keyer = TraceKeyer()
    keyed = []
    for request in (progress or silent()).track(requests):
        keys = tuple(keyer.keys(request))
        keyed.append(KeyedRequest(keys, tuple(request.block_tokens()), len(keys)))
    return keyed


def _store(host_blocks: int, disk_blocks: int, host_policy: str, disk_policy: str):
    slots = []
    if host_blocks > 0:
        tier = HostTier(host_blocks * PAGE_SIZE_BYTES, PAGE_SIZE_BYTES)
        slots.append(TierSlot(tier, make_policy(host_policy)))
    if disk_blocks > 0:
        slots.append(TierSlot(_DiskStandIn(disk_blocks), make_policy(disk_policy)))
    return TieredStore(slots, events=EventFeed(max_events=1))


def replay_tiers(
    keyed: Sequence[KeyedRequest],
    host_blocks: int,
    disk_blocks: int,
    host_policy: str = "lru",
    disk_policy: str = "lru",
    progress: Progress | None = None,
) -> TierHits:
    """Replay `keyed` through a store of `host_blocks` host pages over `disk_blocks` disk pages.

    Per request, as a connector does: look up the longest resident prefix (up to its lookup
    limit), read it (pin = access, promotion), then store every chunk after it. `progress`
    advances by one per request replayed.
    """
    count = len(keyed)
    tokens = np.array([request.tokens for request in keyed], dtype=np.int64)
    hit_tokens = {kind: np.zeros(count, dtype=np.int64) for kind in TIER_KINDS}
    hit_chunks = {kind: np.zeros(count, dtype=np.int64) for kind in TIER_KINDS}
    total_chunks = sum(len(request.keys) for request in keyed)
    if host_blocks <= 0 and disk_blocks <= 0:
        return TierHits(tokens, hit_tokens, hit_chunks, total_chunks)
    store = _store(host_blocks, disk_blocks, host_policy, disk_policy)
    try:
        for number, request in (progress or silent()).track(enumerate(keyed)):
            _replay_one(store, request, number, hit_tokens, hit_chunks)
    finally:
        store.close()
    return TierHits(tokens, hit_tokens, hit_chunks, total_chunks)


def _replay_one(store: TieredStore, request: KeyedRequest, number: int, hit_tokens, hit_chunks):
    keys = request.keys
    hits = store.lookup(keys[: request.lookup_limit])
    for index in range(hits):
        kind = store.tier_of(keys[index])
        hit_tokens[kind][number] += request.chunk_tokens[index]
        hit_chunks[kind][number] += 1
    store.unpin(keys[: store.pin(keys[:hits])])
    for index in range(hits, len(keys)):
        store.put(keys[index], keys[index - 1] if index else None, PLACEHOLDER)
