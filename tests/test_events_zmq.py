"""`kvstore events --zmq`: a real metadata service and two node agents; the publisher as its own
process; a ZMQ subscriber (and a replay client) decode what it sends with vLLM's own msgspec
types: one topic per node, its seqs, the keys stored, the evictions, the snapshot at start."""

import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import torch
import zmq

from kvstore.client import KVStoreClient
from kvstore.events_zmq import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hash,
)
from kvstore.keys import Namespace, chunk_keys
from tests.metadata.conftest import free_port
from tests.metadata.servers import client_for, running_server, wait_until
from tests.node.agents import running_agent

PAGE = 1 << 20
PAYLOAD = PAGE - 4096
KEYS = chunk_keys(Namespace("sha256:model", "layout"), range(16 * 10), 16)  # 10 chained keys


def vllm_types():
    """vLLM's own event types (importing vLLM is slow: only where needed)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.distributed import kv_events

    return kv_events


def save(socket_path, keys) -> None:
    with KVStoreClient(socket_path, "writer") as client:
        reservation = client.save("t", keys, PAYLOAD)
        for view in reservation.payloads:
            view.copy_(torch.full((PAYLOAD,), 7, dtype=torch.uint8))
        assert client.commit(reservation) == len(keys)


def test_the_structs_encode_as_vllms_own():
    """The publisher's copies of vLLM's structs give vLLM's bytes (so it needs no vLLM)."""
    ours = msgspec.msgpack.encode(
        KVEventBatch(
            ts=1.5,
            events=[
                BlockStored(
                    block_hashes=[1, 2],
                    parent_block_hash=None,
                    token_ids=[3],
                    block_size=16,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                ),
                BlockRemoved(block_hashes=[b"\x01" * 16], medium="STORAGE"),
                AllBlocksCleared(),
            ],
        )
    )
    kv = vllm_types()
    theirs = msgspec.msgpack.encode(
        kv.KVEventBatch(
            ts=1.5,
            events=[
                kv.BlockStored(
                    block_hashes=[1, 2],
                    parent_block_hash=None,
                    token_ids=[3],
                    block_size=16,
                    lora_id=None,
                    medium=kv.MEDIUM_CPU,
                    lora_name=None,
                ),
                kv.BlockRemoved(block_hashes=[b"\x01" * 16], medium=kv.MEDIUM_STORAGE),
                kv.AllBlocksCleared(),
            ],
        )
    )
    assert ours == theirs


@pytest.fixture
def cluster(tmp_path):
    """A metadata service; node-a (16 pages), node-b (4 pages: saving 6 blocks evicts 2)."""
    with running_server(tmp_path, backend="memory") as server:
        address = f"127.0.0.1:{server.port}"
        with (
            running_agent(tmp_path, "node-a", metadata_address=address) as a,
            running_agent(
                tmp_path, "node-b", metadata_address=address, host_capacity_bytes=4 * PAGE
            ) as b,
        ):
            yield server, a.config.socket_path, b.config.socket_path


def start_publisher(address: str, endpoint: str, replay: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "kvstore",
        "events",
        "--zmq",
        endpoint,
        "--replay",
        replay,
        "--metadata-address",
        address,
        "--model",
        "tiny",
        "--block-tokens",
        "16",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if "publishing on" not in line:
        process.kill()
        raise AssertionError(f"kvstore events did not start: {line!r} {process.stderr.read()}")
    return process


class Subscriber:
    """A SUB socket connected to the publisher's bound PUB, decoding with vLLM's KVEventBatch."""

    def __init__(self, context: zmq.Context, port: int, decoder) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.decoder = decoder
        self.seqs: dict[bytes, list[int]] = {}
        self.events: dict[bytes, list] = {}

    def receive(self, timeout_s: float = 0.2) -> None:
        while self.socket.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.socket.recv_multipart()
            self.seqs.setdefault(topic, []).append(int.from_bytes(seq, "big"))
            self.events.setdefault(topic, []).extend(self.decoder.decode(payload).events)

    def of(self, topic: bytes, kind) -> list:
        return [e for e in self.events.get(topic, []) if isinstance(e, kind)]


def replayed(context: zmq.Context, endpoint: str, topic: bytes, decoder) -> list:
    """The publisher's buffered batches of `topic` from seq 0, until its end marker."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", topic, (0).to_bytes(8, "big")))
    events = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        _, got_topic, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            dealer.close()
            return events
        assert got_topic == topic
        events.extend(decoder.decode(payload).events)


def hashes(events) -> list:
    return [h for event in events for h in event.block_hashes]


@pytest.mark.multiprocess
def test_events_per_node_topic_in_vllms_format(cluster):
    server, socket_a, socket_b = cluster
    kv = vllm_types()
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    save(socket_a, KEYS[:2])  # held before the publisher starts: its snapshot tells them
    assert wait_until(lambda: client_for(server).stats().blocks >= 2, 10)
    context = zmq.Context()
    port, replay = free_port(), f"tcp://127.0.0.1:{free_port()}"
    publisher = start_publisher(f"127.0.0.1:{server.port}", f"tcp://*:{port}", replay)
    subscriber = Subscriber(context, port, decoder)
    topic_a, topic_b = b"kv@node-a@tiny", b"kv@node-b@tiny"
    try:
        # The snapshot was published before this subscriber joined: the replay has it.
        snapshot = replayed(context, replay, topic_a, decoder)
        time.sleep(1)  # the subscription reaches the publisher (ZMQ drops what precedes it)
        assert isinstance(snapshot[0], kv.AllBlocksCleared)
        assert [e.medium for e in snapshot[1:]] == [kv.MEDIUM_CPU] * 2
        assert sorted(hashes(snapshot[1:])) == sorted(block_hash(k, True) for k in KEYS[:2])
        assert all(e.block_size == 16 and e.parent_block_hash is None for e in snapshot[1:])

        save(socket_a, KEYS[2:3])  # live, on node-a's topic
        save(socket_b, KEYS[:4])  # node-b's arena is full ...
        save(socket_b, KEYS[4:6])  # ... so these evict two of those
        want = lambda: len(subscriber.of(topic_b, kv.BlockRemoved)) >= 2  # noqa: E731
        assert wait_until(lambda: subscriber.receive() or want(), 15), subscriber.events
        subscriber.receive()
        live_a = subscriber.of(topic_a, kv.BlockStored)
        assert block_hash(KEYS[2], True) in hashes(live_a)
        stored_b = subscriber.of(topic_b, kv.BlockStored)
        assert hashes(stored_b) == [block_hash(k, True) for k in KEYS[:6]]
        removed_b = subscriber.of(topic_b, kv.BlockRemoved)
        assert {e.medium for e in removed_b} == {kv.MEDIUM_CPU}
        assert set(hashes(removed_b)) <= {block_hash(k, True) for k in KEYS[:4]}
        assert len(set(hashes(removed_b))) == 2
        assert set(subscriber.events) <= {topic_a, topic_b}
        for seqs in subscriber.seqs.values():  # each topic numbers its own batches
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    finally:
        publisher.send_signal(signal.SIGTERM)
        assert publisher.wait(timeout=20) == 0, publisher.stderr.read()
        subscriber.socket.close(linger=0)
        context.term()


def _replay_seqs(publisher, context: zmq.Context, endpoint: str, topic: bytes) -> list[int]:
    """The seqs of `topic` that `publisher` replays from seq 0 (served here, in this thread)."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", topic, (0).to_bytes(8, "big")))
    seqs = []
    while True:
        publisher.serve_replay()
        if not dealer.poll(10):
            continue
        _, _, seq, _ = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            dealer.close()
            return seqs
        seqs.append(int.from_bytes(seq, "big"))


def test_the_replay_buffers_of_churning_nodes_are_bounded_together():
    """Each node's topic kept up to 10,000 batches for good: node ids that came and went (a
    pod's name changes with each restart) piled up until the process ran out of memory. The
    buffers are bounded together now, oldest first; a topic keeps its seq."""
    from kvstore.events_zmq import EventsConfig, TopicPublisher

    config = EventsConfig(
        metadata_address="unused:1",
        zmq_endpoint="inproc://events-bound",
        replay_endpoint="inproc://events-bound-replay",
        replay_batches=4,
        replay_bytes=64 << 10,
    )
    context = zmq.Context()
    publisher = TopicPublisher(config, context)
    stored = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    try:
        for node in range(2000):
            for _ in range(3):
                publisher.publish(f"node-{node}", [stored] * 16)
        publisher.publish("node-0", [stored])  # a node that came back: its seq goes on
        assert publisher.replay_bytes <= config.replay_bytes
        assert len(publisher._buffers) < 300 and len(publisher._order) < 1000
        assert _replay_seqs(
            publisher, context, config.replay_endpoint, b"kv@node-1999@kvstore"
        ) == [0, 1, 2]
        assert _replay_seqs(publisher, context, config.replay_endpoint, b"kv@node-0@kvstore") == [3]
        for _ in range(6):  # one busy topic: its own cap
            publisher.publish("node-busy", [stored])
        assert _replay_seqs(
            publisher, context, config.replay_endpoint, b"kv@node-busy@kvstore"
        ) == [2, 3, 4, 5]
    finally:
        publisher.close()
        context.term()


def test_a_node_that_holds_nothing_is_forgotten_and_one_that_holds_is_cleared_at_a_resync():
    """The republisher kept every node id it ever saw, and sent each an AllBlocksCleared at
    every resync; a node whose blocks were all removed is forgotten now."""
    from kvstore.events_zmq import EventsConfig, Republisher

    class Snapshot:  # a metadata client whose snapshot holds nothing
        def snapshot(self, tenant, max_keys):
            return iter(())

    republisher = Republisher(EventsConfig("unused:1", "inproc://unused"), Snapshot())
    for node in range(1000):
        republisher.apply("stored", "t", b"k", f"node-{node}", "host")
        republisher.apply("stored", "t", b"k", f"node-{node}", "disk")
        republisher.apply("removed", "t", b"k", f"node-{node}", "host")
        if node != 7:
            republisher.apply("removed", "t", b"k", f"node-{node}", "disk")
    assert dict(republisher.held) == {"node-7": 1}
    while not republisher._queue.empty():
        republisher._queue.get_nowait()
    republisher.resync()
    cleared = [republisher._queue.get_nowait() for _ in range(republisher._queue.qsize())]
    assert [(node, type(event)) for node, event in cleared] == [("node-7", AllBlocksCleared)]
    assert not republisher.held
