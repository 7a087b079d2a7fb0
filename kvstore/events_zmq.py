"""`kvstore events --zmq ENDPOINT`: republishes the metadata service's block events in vLLM's
KV-event wire format (vllm/distributed/kv_events.py, ZmqEventPublisher: multipart topic, 8-byte
big-endian seq, msgpack KVEventBatch), one topic per node, `kv@<node>@<model>`, for routers that
watch the store rather than the engines. Runs as its own process: a follower thread feeds a
bounded queue, one publisher thread owns the ZMQ sockets.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvstore.errors import ConfigError
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.client.follow import EventFollower
from kvstore.tier import STORED

logger = logging.getLogger(__name__)

MEDIUM_OF_TIER = {stored.name: stored.medium for stored in STORED}  # vLLM's MEDIUM_*
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay, as vLLM's publisher does


# vLLM's structs, field for field (msgspec tags them by class name), so the process needs no
# vLLM; tests/test_events_zmq.py decodes what it sends with vLLM's own types.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(frozen=True)
class EventsConfig:
    metadata_address: str
    zmq_endpoint: str  # bound when it has "*", "::" or is ipc/inproc; else connected (as vLLM)
    model: str = "kvstore"  # the <model> of the topics
    replay_endpoint: str = ""  # ROUTER for replays by seq ("" none)
    tenant: str = ""  # "" every tenant (needs an all-tenant token)
    token: str | None = None
    tls_ca: Any = None
    block_tokens: int = 0  # the BlockStored block_size (tokens per kvstore block; 0 unknown)
    int_hashes: bool = True  # vLLM's default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    max_batch_events: int = 1024
    max_queued_events: int = 100_000
    replay_batches: int = 10_000  # per topic
    replay_bytes: int = 256 << 20  # every topic's replay buffers together: the oldest go first
    snapshot_max_keys: int = 1_000_000

    def __post_init__(self) -> None:
        if not self.zmq_endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"--zmq {self.zmq_endpoint!r}: use tcp://HOST:PORT or ipc://PATH")
        if "@" in self.model or not self.model:
            raise ConfigError("--model must be a non-empty name without '@'")
        for name in ("max_batch_events", "max_queued_events", "replay_batches", "replay_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")


def block_hash(key: bytes, int_hashes: bool) -> bytes | int:
    """vLLM's maybe_convert_block_hash of a key: its last 8 bytes as an int, or the bytes."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1) if int_hashes else bytes(key)


class TopicPublisher:
    """One PUB socket (and an optional ROUTER for replays); a seq and a replay buffer per
    topic, the buffers bounded per topic and together (`replay_bytes`: the oldest batches of
    any topic go first, and a topic whose last batch went keeps only its seq, so nodes that
    came and went hold no memory but an int: a topic's seq never restarts while the process
    runs). Only the publisher thread calls it."""

    def __init__(self, config: EventsConfig, context: zmq.Context) -> None:
        self.config = config
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        endpoint = config.zmq_endpoint
        if "*" in endpoint or "::" in endpoint or not endpoint.startswith("tcp://"):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay = None
        if config.replay_endpoint:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(config.replay_endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._seqs: dict[bytes, int] = {}
        self._buffers: dict[bytes, deque[tuple[int, bytes, int]]] = {}  # (seq, payload, order)
        self._order: deque[tuple[int, bytes]] = deque()  # (order, topic), oldest first
        self._published = 0  # the order of the next batch, over every topic
        self._buffered = 0  # batches in the buffers
        self.replay_bytes = 0
        self.published_batches = 0

    def topic(self, node_id: str) -> bytes:
        return f"kv@{node_id}@{self.config.model}".encode()

    def publish(self, node_id: str, events: list[KVCacheEvent]) -> None:
        topic = self.topic(node_id)
        seq = self._seqs.get(topic, 0)
        self._seqs[topic] = seq + 1
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        self.pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self._buffer(topic, seq, payload)
        self.published_batches += 1

    def _buffer(self, topic: bytes, seq: int, payload: bytes) -> None:
        order, self._published = self._published, self._published + 1
        buffer = self._buffers.setdefault(topic, deque())
        buffer.append((seq, payload, order))
        self._order.append((order, topic))
        self._buffered += 1
        self.replay_bytes += len(payload)
        if len(buffer) > self.config.replay_batches:
            self._drop_oldest(topic)
        while self.replay_bytes > self.config.replay_bytes:
            order, topic = self._order.popleft()
            if self._buffered_still(order, topic):
                self._drop_oldest(topic)
        if len(self._order) > 2 * self._buffered + 64:  # entries of batches dropped per topic
            self._order = deque(e for e in self._order if self._buffered_still(*e))

    def _buffered_still(self, order: int, topic: bytes) -> bool:
        """Whether the batch published `order`-th (on `topic`) is buffered: a topic's batches
        are dropped oldest first, so it is unless the topic's oldest is newer."""
        buffer = self._buffers.get(topic)
        return buffer is not None and buffer[0][2] <= order

    def _drop_oldest(self, topic: bytes) -> None:
        """Drop `topic`'s oldest buffered batch, and the topic's buffer once empty."""
        buffer = self._buffers[topic]
        _, payload, _ = buffer.popleft()
        self._buffered -= 1
        self.replay_bytes -= len(payload)
        if not buffer:
            del self._buffers[topic]

    def serve_replay(self) -> None:
        """Answer one waiting replay request: (topic, 8-byte start seq) → buffered batches of
        that topic from the seq, then vLLM's end marker."""
        if self.replay is None or not self.replay.poll(0):
            return
        frames = self.replay.recv_multipart()
        if len(frames) != 4 or len(frames[3]) != 8:
            logger.warning("invalid replay request (%d frames)", len(frames))
            return
        client, _, topic, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload, _ in self._buffers.get(topic, ()):
            if seq >= start_seq:
                self.replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close()
        if self.replay is not None:
            self.replay.close()


class Republisher:
    """The follower's handler (EventHandler): turns index events into vLLM events on a bounded
    queue (a full queue blocks the follower, so the stream is read more slowly: the service's
    journal, not this process, holds the backlog); the publisher thread batches them per node."""

    def __init__(self, config: EventsConfig, client: MetadataClient) -> None:
        self.config = config
        self.client = client
        self.held: Counter[str] = Counter()  # per node: the (key, tier) it holds, as announced
        self.counters = {"stored": 0, "removed": 0, "resyncs": 0, "snapshot_truncated": 0}
        self._queue: queue.Queue[tuple[str, KVCacheEvent]] = queue.Queue(config.max_queued_events)
        self._stop = threading.Event()

    # ---- follower thread ------------------------------------------------------------------
    def resync(self) -> int:
        """Each node's holdings afresh: AllBlocksCleared on every topic, then a BlockStored per
        (key, node, tier) of a snapshot; returns the snapshot's seq."""
        self.counters["resyncs"] += 1
        last_seq, held = 0, []
        for page in self.client.snapshot(self.config.tenant, self.config.snapshot_max_keys):
            last_seq = page.last_seq
            self.counters["snapshot_truncated"] += page.truncated
            for key, holders in zip(page.keys, page.holders.holders, strict=True):
                held.extend((key, h.node_id, h.tier) for h in holders)
        for node_id in sorted(set(self.held) | {node for _, node, _ in held}):
            self._put(node_id, AllBlocksCleared())
        self.held.clear()
        for key, node_id, tier in held:
            self.apply("stored", "", key, node_id, tier)
        return last_seq

    def apply(self, kind: str, tenant: str, key: bytes, node_id: str, tier: str) -> None:
        hashes = [block_hash(key, self.config.int_hashes)]
        medium = MEDIUM_OF_TIER.get(tier)
        if kind == "stored":
            event = BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=self.config.block_tokens,
                lora_id=None,
                medium=medium,
                lora_name=None,
            )
        else:
            event = BlockRemoved(block_hashes=hashes, medium=medium)
        self.counters[kind] += 1
        self._count_held(kind, node_id)
        self._put(node_id, event)

    def _count_held(self, kind: str, node_id: str) -> None:
        """A node that holds nothing is forgotten (a departed one's removals all came): the
        next resync clears the topics of nodes that hold something."""
        self.held[node_id] += 1 if kind == "stored" else -1
        if self.held[node_id] <= 0:
            del self.held[node_id]

    def _put(self, node_id: str, event: KVCacheEvent) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put((node_id, event), timeout=0.5)
                return
            except queue.Full:
                continue

    # ---- publisher thread -----------------------------------------------------------------
    def publish_loop(self, publisher: TopicPublisher) -> None:
        while not self._stop.is_set():
            publisher.serve_replay()
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            for node_id, events in self._batch(first).items():
                publisher.publish(node_id, events)

    def _batch(self, first: tuple[str, KVCacheEvent]) -> dict[str, list[KVCacheEvent]]:
        """`first` and what else is queued, up to max_batch_events, per node in order."""
        batches: dict[str, list[KVCacheEvent]] = {first[0]: [first[1]]}
        for _ in range(self.config.max_batch_events - 1):
            try:
                node_id, event = self._queue.get_nowait()
            except queue.Empty:
                break
            batches.setdefault(node_id, []).append(event)
        return batches

    def stop(self) -> None:
        self._stop.set()


def run_events(config: EventsConfig, stop) -> dict:
    """Follow and republish until `stop` (a threading.Event or kvstore.serve.StopSignals) is
    set; returns the counters."""
    client = MetadataClient(config.metadata_address, token=config.token, tls_ca=config.tls_ca)
    republisher = Republisher(config, client)
    context = zmq.Context()
    publisher = TopicPublisher(config, context)
    follower = EventFollower(client, republisher, tenant=config.tenant)
    thread = threading.Thread(
        target=republisher.publish_loop, args=(publisher,), name="zmq-publisher", daemon=True
    )
    thread.start()
    follower.start()
    print(
        f"kvstore events from {config.metadata_address} publishing on {config.zmq_endpoint}"
        f" (topics kv@<node>@{config.model})",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        republisher.stop()
        follower.stop()
        thread.join(timeout=5)
        publisher.close()
        context.term()
    return {
        **republisher.counters,
        **follower.counters,
        "published_batches": publisher.published_batches,
    }
