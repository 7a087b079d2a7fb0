"""KV events for vLLM's publisher (`--kv-events-config`): BlockStored / BlockRemoved, in vLLM's
own types and block hashes, for the chunks kvstore holds on this engine's host.

The scheduler half snapshots each scheduled save (vLLM's hashes, parent, tokens, LoRA); each
worker reports the chunks it committed through KVConnectorOutput.kv_cache_events, and once every
worker did, the chunk is announced (MEDIUM_CPU: the host arena). The node's later changes (host
evictions, write-back to disk, disk evictions) come from the metadata service's event stream,
followed in a thread of the scheduler process. Everything is bounded; what is forgotten or lost
is retracted (BlockRemoved), so a router may miss a hit but never routes to a block not held.
"""

from __future__ import annotations

import logging
import queue
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from kvstore.config import read_secret_file
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.client.follow import EventFollower
from kvstore.tier import STORED

logger = logging.getLogger(__name__)
FOLLOW_START_TIMEOUT_S = 5.0
MEDIUM_OF_TIER = {stored.name: stored.medium for stored in STORED}  # vLLM's MEDIUM_*
assert set(MEDIUM_OF_TIER.values()) == {MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE}


@dataclass(frozen=True)
class EventLimits:
    max_chunks: int = 65_536  # announced chunks remembered (for their removals)
    max_pending_chunks: int = 16_384  # scheduled saves not yet committed by every worker
    max_queued_events: int = 100_000  # events waiting for take_events; node events waiting


class CommittedChunks(KVConnectorKVEvents):
    """A worker's report to the scheduler: chain keys of the chunks it committed to the host
    arena this step (vLLM merges the workers' reports; a key appears once per worker)."""

    def __init__(self, keys: Sequence[bytes] = (), workers: int = 1) -> None:
        self.keys = list(keys)
        self.workers = workers

    def add_events(self, events: list) -> None:
        self.keys.extend(events)

    def aggregate(self) -> CommittedChunks:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list:
        return self.keys

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.keys.clear()
        self.workers = 0


def stored_chunks(chain_keys: Sequence[bytes], payloads: Sequence, groups: int) -> list[bytes]:
    """Of a fully committed reservation: the chunks every block of which it reserved (a block
    not reserved was held already, being written, or found no room: not this engine's store)."""
    return [
        chain
        for i, chain in enumerate(chain_keys)
        if all(p is not None for p in payloads[i * groups : (i + 1) * groups])
    ]


@dataclass
class _Chunk:
    """One chunk's BlockStored payload (tokens compact), its block keys, where they are held."""

    hashes: list
    parent: object
    tokens: array
    extra_keys: list | None
    lora_id: int | None
    lora_name: str | None
    block_keys: tuple[bytes, ...]
    reports: int = 0
    lost: bool = False  # removed before every worker reported it
    held: dict[str, set[int]] = field(default_factory=dict)  # medium -> indexes of block_keys


class KVEventTracker:
    """The scheduler half's events. All methods but `apply`/`resync` (the follower thread's,
    which only queue) run on vLLM's scheduler thread; no locks."""

    def __init__(
        self,
        kv,
        block_size: int,
        hash_block_size: int,
        workers: int,
        limits: EventLimits = EventLimits(),
    ) -> None:
        self.kv = kv
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.workers = workers
        self.limits = limits
        self.node_id: str | None = None  # this engine's agent (set once connected)
        self.follower: EventFollower | None = None
        self._requests: dict[str, object] = {}  # live requests: their hashes and tokens
        self._pending: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._by_block: dict[bytes, bytes] = {}  # block key -> chain key (pending or announced)
        self._out: deque[KVCacheEvent] = deque()
        self._removed_parents: dict[int, object] = {}  # a queued removal -> its parent hash
        self._inbox: queue.Queue = queue.Queue(limits.max_queued_events)
        self._lost = False  # node events were lost: retract everything announced
        self._following = threading.Event()  # the follower's first resync is done
        self._announced_any = False
        self.counters = {
            "announced": 0,
            "removed": 0,
            "forgotten": 0,
            "dropped_pending": 0,
            "dropped_events": 0,
            "lost_node_events": 0,
        }

    def follow(self, address: str, token_file: str, tenant: str) -> None:
        """Follow the metadata service's events of this node (host/disk changes)."""
        token = read_secret_file(Path(token_file), "metadata token") if token_file else None
        self.follower = EventFollower(MetadataClient(address, token=token), self, tenant)
        self.follower.start()
        # Chunks announced before the stream is followed may be evicted unseen: wait a little
        # (an absent service costs a retraction of those later, not a stalled engine).
        if not self._following.wait(FOLLOW_START_TIMEOUT_S):
            logger.warning("the metadata service's event stream is not followed yet (%s)", address)

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()

    # ---- scheduler thread: requests and saves ---------------------------------------------
    def seen(self, request) -> None:
        self._requests[request.request_id] = request

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def scheduled(self, saves, states: dict) -> None:
        """Snapshot the chunks of this step's saves while their requests are alive."""
        for spec in saves:
            request, state = self._requests.get(spec.req_id), states.get(spec.req_id)
            if request is None or state is None or spec.tail_blocks:
                continue  # gone, or a tail: fewer blocks than a chunk, no event (saves.py)
            first = state.keys.index(spec.keys[0])
            for offset, chain in enumerate(spec.keys):
                if chain not in self._pending and chain not in self._chunks:
                    self._add_pending(chain, self._snapshot(request, first + offset, chain))

    def _snapshot(self, request, index: int, chain: bytes) -> _Chunk:
        per_chunk, size = self.kv.blocks_per_chunk, self.block_size
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, size)
        first = index * per_chunk
        extra, mm_index = [], 0
        for block in range(first, first + per_chunk):
            keys, mm_index = generate_block_hash_extra_keys(
                request, block * size, (block + 1) * size, mm_index
            )
            extra.append(keys)
        lora = request.lora_request
        return _Chunk(
            hashes=[maybe_convert_block_hash(hashes[b]) for b in range(first, first + per_chunk)],
            parent=maybe_convert_block_hash(hashes[first - 1]) if first else None,
            tokens=array("i", request.all_token_ids[first * size : (first + per_chunk) * size]),
            extra_keys=to_event_extra_keys(extra),
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            block_keys=tuple(self.kv.lookup_keys([chain])),
        )

    def _add_pending(self, chain: bytes, chunk: _Chunk) -> None:
        self._pending[chain] = chunk
        self._by_block.update(dict.fromkeys(chunk.block_keys, chain))
        while len(self._pending) > self.limits.max_pending_chunks:
            old_chain, old = self._pending.popitem(last=False)
            self._unindex(old_chain, old)
            self.counters["dropped_pending"] += 1

    def committed(self, report) -> None:
        """The workers' CommittedChunks of a step: a chunk every worker committed is held on
        this host's arena, and announced."""
        if not isinstance(report, CommittedChunks):
            return
        for chain in report.get_all_events():
            chunk = self._pending.get(chain)
            if chunk is None:
                continue
            chunk.reports += 1
            if chunk.reports < self.workers:
                continue
            del self._pending[chain]
            if chunk.lost:
                self._unindex(chain, chunk)
                continue
            self._chunks[chain] = chunk
            self._announced_any = True
            chunk.held[MEDIUM_CPU] = set(range(len(chunk.block_keys)))
            self._emit(self._stored(chunk, MEDIUM_CPU))
            self._bound_chunks()

    def _bound_chunks(self) -> None:
        while len(self._chunks) > self.limits.max_chunks:
            chain, chunk = self._chunks.popitem(last=False)
            self._retract(chain, chunk)
            self.counters["forgotten"] += 1

    # ---- the node's events (metadata service) ---------------------------------------------
    def apply(self, kind: str, tenant: str, key: bytes, node_id: str, tier: str) -> None:
        """Follower thread: queue this node's events for the scheduler thread."""
        if node_id != self.node_id:
            return
        try:
            self._inbox.put_nowait((kind, key, tier))
        except queue.Full:
            self._lost = True
            self.counters["lost_node_events"] += 1

    def resync(self) -> int:
        """Follower thread: events were lost (or this is the start, after announcements):
        retract what was announced, then follow only new events."""
        if self._following.is_set() or self._announced_any:
            self._lost = True
        self._following.set()
        return 0

    def _apply_node_events(self) -> None:
        for _ in range(self._inbox.qsize()):
            kind, key, tier = self._inbox.get_nowait()
            chain = self._by_block.get(key)
            medium = MEDIUM_OF_TIER.get(tier)
            if chain is None or medium is None:
                continue
            pending = self._pending.get(chain)
            if pending is not None:
                pending.lost |= kind == "removed"
                continue
            chunk = self._chunks.get(chain)
            if chunk is not None:
                self._held(chain, chunk, medium, chunk.block_keys.index(key), kind == "stored")

    def _held(self, chain: bytes, chunk: _Chunk, medium: str, index: int, stored: bool) -> None:
        held = chunk.held.setdefault(medium, set())
        was_full = len(held) == len(chunk.block_keys)
        if stored:
            held.add(index)
        else:
            held.discard(index)
        is_full = len(held) == len(chunk.block_keys)
        if is_full and not was_full:
            self._emit(self._stored(chunk, medium))
        elif was_full and not is_full:
            self._emit_removed(chunk, medium)
        if not any(chunk.held.values()):
            del self._chunks[chain]
            self._unindex(chain, chunk)

    def _retract(self, chain: bytes, chunk: _Chunk) -> None:
        for medium, held in chunk.held.items():
            if len(held) == len(chunk.block_keys):
                self._emit_removed(chunk, medium)
        self._unindex(chain, chunk)

    def _unindex(self, chain: bytes, chunk: _Chunk) -> None:
        for key in chunk.block_keys:
            if self._by_block.get(key) == chain:
                del self._by_block[key]

    # ---- out --------------------------------------------------------------------------------
    def _stored(self, chunk: _Chunk, medium: str) -> BlockStored:
        self.counters["announced"] += 1
        return BlockStored(
            block_hashes=list(chunk.hashes),
            parent_block_hash=chunk.parent,
            token_ids=chunk.tokens.tolist(),
            block_size=self.block_size,
            lora_id=chunk.lora_id,
            medium=medium,
            lora_name=chunk.lora_name,
            extra_keys=chunk.extra_keys,
        )

    def _emit_removed(self, chunk: _Chunk, medium: str) -> None:
        event = BlockRemoved(block_hashes=list(chunk.hashes), medium=medium)
        self._removed_parents[id(event)] = chunk.parent
        self._emit(event)
        self.counters["removed"] += 1

    def _emit(self, event: KVCacheEvent) -> None:
        self._out.append(event)
        if len(self._out) > self.limits.max_queued_events:
            self._removed_parents.pop(id(self._out.popleft()), None)  # bounded with the queue
            self.counters["dropped_events"] += 1

    def take(self) -> Iterator[KVCacheEvent]:
        """vLLM's take_events: what changed since the last call."""
        if self._lost:
            self._lost = False
            while self._chunks:  # node events after the loss name only chunks still pending
                self._retract(*self._chunks.popitem(last=False))
        self._apply_node_events()
        events = _children_first(list(self._out), self._removed_parents)
        self._out.clear()
        self._removed_parents.clear()
        yield from events


def scheduler_tracker(vllm_config, kv_cache_config, settings, kv) -> KVEventTracker | None:
    """The scheduler half's tracker when vLLM publishes KV events (else None)."""
    if not worker_collects(vllm_config):
        return None
    block_size = kv.block_size
    hash_block_size = (
        getattr(kv_cache_config, "hash_block_size", None)
        or getattr(vllm_config.cache_config, "hash_block_size", None)
        or block_size
    )
    limits = EventLimits(max_chunks=settings.events_max_chunks)
    workers = vllm_config.parallel_config.world_size
    tracker = KVEventTracker(kv, block_size, hash_block_size, workers, limits)
    if settings.events_metadata_address:
        tracker.follow(
            settings.events_metadata_address, settings.events_token_file, settings.tenant
        )
    else:
        logger.warning(
            "KV events: set events_metadata_address (the metadata service) so that "
            "evictions from this host are announced; only stores are"
        )
    return tracker


def worker_collects(vllm_config) -> bool:
    """Whether vLLM publishes KV events (--kv-events-config enable_kv_cache_events)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def _children_first(events: list, parents: dict[int, object]) -> list:
    """`events` with each run of removals reordered so that a chunk's removal comes before
    its parent chunk's: the node's outbox keeps each block's events in order, not the order
    between blocks, and a router's radix tree (Dynamo's) that drops a parent with its subtree
    then cannot find the child's block."""
    out, run = [], []
    for event in [*events, None]:
        if isinstance(event, BlockRemoved):
            run.append(event)
            continue
        out.extend(sorted(run, key=lambda e: -_depth(e, run, parents)))
        run = []
        if event is not None:
            out.append(event)
    return out


def _depth(event, run: list, parents: dict[int, object]) -> int:
    """How many of `run`'s removals are ancestors of `event`'s chunk (by parent hashes)."""
    last = {e.block_hashes[-1]: e for e in run if e.block_hashes}
    depth, parent = 0, parents.get(id(event))
    while parent in last and depth < len(run):
        depth += 1
        parent = parents.get(id(last[parent]))
    return depth
