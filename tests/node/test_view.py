"""The node agent's cluster view, against a real metadata service process: it converges after
publishes, evictions, node expiry and service restarts; it answers lookups with the service
frozen; a stale entry costs one failed fetch, then a miss, and is corrected; past its size cap
the agent asks the service what its view cannot answer."""

import json
import signal
import threading
from contextlib import contextmanager

import pytest
import torch
from prometheus_client import generate_latest

from kvstore.bench.peers import free_port, redis_server
from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, chunk_keys
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.node import view_feed
from kvstore.node.metrics import agent_registry
from kvstore.retry import Backoff
from tests.metadata.servers import start_cli, wait_until
from tests.node.agents import running_agent, start_node_process

KEYS = chunk_keys(Namespace("sha256:model", "layout"), range(256 * 8), 256)
OTHER_KEYS = chunk_keys(Namespace("sha256:other-model", "layout"), range(256 * 50), 256)
PAYLOAD = 100_000


@contextmanager
def metadata_process(*args: str, port: int = 0, lookup_port: int = 0):
    """A metadata service process; on `port` and `lookup_port` where given (a restart at the
    same address), not "auto"'s gRPC port + 1, which another process may hold (CI saw it)."""
    lookup = ("--lookup-listen", f"127.0.0.1:{lookup_port}") if port else ()
    process, address = start_cli("metadata", "--listen", f"127.0.0.1:{port}", *lookup, *args)
    try:
        yield process, address
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=70)  # its stop is bounded: 2 s grace + START_TIMEOUT_S joins


class FakePeer:
    """Another node as the service sees it: registered, publishing, evicting (no agent)."""

    def __init__(self, address: str, node_id: str, lease_ttl_ms: int = 60_000) -> None:
        self.client = MetadataClient(address)
        self.node_id = node_id
        self.lease, _ = self.client.register_node(
            NodeRecord(node_id, tcp_address="127.0.0.1:1"), lease_ttl_ms
        )

    def publish(self, keys, tier="host") -> None:
        entries = [BlockEntry(bytes(key), tier, PAYLOAD, 1) for key in keys]
        self.client.publish(self.node_id, self.lease, "t", entries)

    def evict(self, keys, tier="host") -> None:
        entries = [BlockEntry(bytes(key), tier) for key in keys]
        self.client.unpublish(self.node_id, self.lease, "t", entries)


def await_admission(events, peer: FakePeer) -> None:
    """Return once the service admitted the stream of `events`: it carries an event. The
    stream opens lazily, and an event published before it is admitted never reaches it (CI
    once waited here for the next event, node-b's expiry, a minute later): the peer publishes
    keys outside KEYS until one arrives."""
    arrived = threading.Event()
    threading.Thread(target=lambda: (next(events), arrived.set()), daemon=True).start()
    for filler in OTHER_KEYS:
        peer.publish([filler])
        if arrived.wait(0.2):
            return
    raise AssertionError("the service never admitted the event stream")


def agent_at(tmp_path, address, **settings):
    return running_agent(tmp_path, "node-a", transfer="tcp", metadata_address=address, **settings)


def remote_hits(socket_path, keys) -> int:
    with KVStoreClient(socket_path, "worker") as worker:
        return worker.lookup("t", keys).remote


def converges(agent, keys, expected: int, timeout_s: float = 10) -> bool:
    return wait_until(lambda: remote_hits(agent.config.socket_path, keys) == expected, timeout_s)


def test_the_view_follows_publishes_evictions_and_node_expiry(tmp_path):
    with metadata_process("--backend", "memory") as (_, address), agent_at(tmp_path, address) as a:
        assert wait_until(lambda: a.view.ready)
        b = FakePeer(address, "node-b")
        b.publish(KEYS[:6])
        assert converges(a, KEYS, 6)
        assert a.view.holders("t", bytes(KEYS[0])) == {("node-b", "host")}

        b.evict(KEYS[3:6])  # evictions on node-b
        assert converges(a, KEYS, 3)

        c = FakePeer(address, "node-c", lease_ttl_ms=600)  # never heartbeats: expires
        c.publish(KEYS[:8], tier="disk")
        assert converges(a, KEYS, 8)
        assert converges(a, KEYS, 3), "node-c's lease ran out: its keys left the view"
        # lookups skip node-c as soon as its expiry is seen; its keys leave as their removed
        # events arrive (CI once counted 4 keys still in the view right after the lookup)
        assert wait_until(lambda: a.view.keys == 3)
        assert a.view.counters["fallback_not_ready"] == 0
        scraped = generate_latest(agent_registry(a.stats)).decode()
        assert "kvstore_agent_view_keys 3.0" in scraped
        assert 'kvstore_agent_view_lookups_total{answer="fallback_overflow"} 0.0' in scraped


def test_lookups_are_answered_by_the_view_while_the_service_is_frozen(tmp_path):
    with (
        metadata_process("--backend", "memory") as (service, address),
        agent_at(tmp_path, address) as a,
    ):
        FakePeer(address, "node-b").publish(KEYS[:5])
        assert converges(a, KEYS, 5)  # which the service may have answered: wait for the view
        assert wait_until(lambda: a.view.remote_prefix("t", KEYS) == 5, timeout_s=30)
        service.send_signal(signal.SIGSTOP)  # no round trip could be answered now
        with KVStoreClient(a.config.socket_path, "worker") as worker:
            assert worker.lookup("t", KEYS).remote == 5
            assert worker.lookup("t", list(reversed(KEYS))).remote == 0, "a miss, locally"
        service.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("backend", ["lmdb", "memory"])
def test_the_view_converges_after_a_metadata_restart(tmp_path, backend):
    """lmdb: the journal kept the keys and the events' numbers: the view resumes by seq;
    memory: the index comes back empty under a new incarnation: the view resyncs first."""
    data = ["--data-dir", str(tmp_path / "meta")] if backend == "lmdb" else []
    ports = {"port": free_port(), "lookup_port": free_port()}
    with metadata_process("--backend", backend, *data, **ports) as (service, address):
        with agent_at(tmp_path, address) as a:
            b = FakePeer(address, "node-b", lease_ttl_ms=600_000)
            b.publish(KEYS[:4])
            assert converges(a, KEYS, 4)
            service.send_signal(signal.SIGKILL)
            service.wait()
            with metadata_process("--backend", backend, *data, **ports) as (_, again):
                if backend == "lmdb":  # kept node-b and its keys
                    b = FakePeer(again, "node-b", lease_ttl_ms=600_000)
                    b.evict(KEYS[2:4])
                    assert converges(a, KEYS, 2)
                else:  # everything is gone, node-b with it
                    assert converges(a, KEYS, 0)
                    b = FakePeer(again, "node-b", lease_ttl_ms=600_000)
                b.publish(KEYS[:7])
                assert converges(a, KEYS, 7), "resumed by seq"
                assert a.view.counters["reconnects"] >= 1
                snapshots = a.view.counters["snapshots"]
                assert snapshots == 1 if backend == "lmdb" else snapshots >= 2


def test_events_lost_by_a_slow_view_are_a_gap_and_a_resync(tmp_path):
    """The service keeps 200 events; the view is held while 20,000 are published, so the
    stream falls behind the ring: a KIND_GAP, then a snapshot, then events again."""
    env = {"KVSTORE_METADATA_MAX_EVENTS": "200"}
    process, address = start_cli(
        "metadata", "--backend", "memory", "--listen", "127.0.0.1:0", env=env
    )
    try:
        with agent_at(tmp_path, address) as a:
            b = FakePeer(address, "node-b")
            b.publish(KEYS[:4])
            assert converges(a, KEYS, 4)
            others = [index.to_bytes(16, "big") for index in range(20_000)]
            with a.view._lock:  # the feed thread blocks in its next apply
                for start in range(0, len(others), 1000):
                    b.publish(others[start : start + 1000])
                b.evict(KEYS[2:4])
            assert wait_until(lambda: a.view.counters["snapshots"] >= 2, timeout_s=20)
            assert a.view.counters["gaps"] >= 1
            assert wait_until(lambda: a.view.keys == 20_002)
            assert a.view.remote_prefix("t", KEYS) == 2
            b.publish(KEYS[2:3])
            assert converges(a, KEYS, 3)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)


def test_a_stale_entry_costs_one_failed_fetch_then_a_miss_then_the_view_is_corrected(tmp_path):
    with metadata_process("--backend", "memory") as (_, address), agent_at(tmp_path, address) as a:
        b, b_socket = start_node_process(
            tmp_path, "node-b", "--metadata-address", address, "--transfer", "tcp"
        )
        try:
            with KVStoreClient(b_socket, "writer") as writer:
                reservation = writer.save("t", KEYS[:3], PAYLOAD)
                for payload in reservation.payloads:
                    payload.copy_(torch.full((PAYLOAD,), 7, dtype=torch.uint8))
                assert writer.commit(reservation) == 3
            assert converges(a, KEYS, 3)
        finally:
            b.send_signal(signal.SIGKILL)  # its lease lives on: the service still names it
            b.wait()
        with KVStoreClient(a.config.socket_path, "reader") as reader:
            assert reader.lookup("t", KEYS).remote == 3, "the view is stale"
            loaded = reader.load("t", KEYS, timeout_s=2)
            assert len(loaded) == 0, "the failed fetch is a miss: the engine recomputes"
            reader.release(loaded)
            assert reader.lookup("t", KEYS).remote == 0, "the view was corrected"
            again = reader.load("t", KEYS, timeout_s=2)
            assert len(again) == 0
            reader.release(again)
        assert a.fetcher.stats.failed_fetches == 1, "one failed fetch: none after the correction"
        assert a.view.counters["corrections"] == 3
        with MetadataClient(address) as service:
            assert service.lookup("t", KEYS).prefix_length == 3, "not by the service"


def test_past_its_size_cap_the_agent_asks_the_service(tmp_path):
    with (
        metadata_process("--backend", "memory") as (_, address),
        agent_at(tmp_path, address, view_max_keys=4) as a,
    ):
        assert wait_until(lambda: a.view.ready)
        FakePeer(address, "node-b").publish(KEYS[:6])
        assert converges(a, KEYS, 6), "the service answers what the view left out"
        # the answer may come from the service before the events reach the view (CI saw 0)
        assert wait_until(lambda: a.view.keys == 4 and a.view.overflowed), a.view.keys
        assert a.view.counters["fallback_overflow"] > 0
        assert remote_hits(a.config.socket_path, KEYS[:3]) == 3, "hits within the view"
        assert remote_hits(a.config.socket_path, KEYS[7:]) == 0
        assert a.stats()["view"]["keys"] == 4


def test_on_a_redis_backend_the_view_converges_and_answers_with_the_service_frozen(tmp_path):
    with (
        redis_server() as redis,
        metadata_process(
            "--backend",
            "redis",
            "--redis-url",
            f"redis://127.0.0.1:{redis.connection_pool.connection_kwargs['port']}/0",
        ) as (service, address),
    ):
        peer = FakePeer(address, "node-r")
        peer.publish(KEYS[:4])  # before the agent: its snapshot carries them
        with agent_at(tmp_path, address) as a:
            assert wait_until(lambda: a.view.ready, timeout_s=10), a.view_feed.disabled
            assert a.view.remote_prefix("t", KEYS) == 4
            peer.publish(KEYS[4:6])  # after it: the events carry them
            peer.evict(KEYS[5:6])
            assert converges(a, KEYS, 5)
            assert a.view.remote_prefix("t", KEYS) == 5 and not a.view_feed.disabled
            service.send_signal(signal.SIGSTOP)  # no round trip could be answered now
            try:
                assert remote_hits(a.config.socket_path, KEYS) == 5, "from the view"
            finally:
                service.send_signal(signal.SIGCONT)


def test_an_agent_refused_a_stream_slot_asks_the_service_until_it_gets_one(tmp_path, monkeypatch):
    """A view that cannot follow the events would go stale: it stands down instead."""
    # retries within a second: on a loaded machine the doubling back-off can outlast the waits
    monkeypatch.setattr(view_feed, "REFUSED_BACKOFF", Backoff(base_s=0.2, cap_s=1.0))
    limit = ("--max-watch-streams-all-tenants", "1")
    with metadata_process("--backend", "memory", *limit) as (_, address):
        other = MetadataClient(address)
        taken = other.open_events()  # holds the `*` scope's one stream slot...
        try:
            peer = FakePeer(address, "node-b")
            await_admission(iter(taken), peer)  # before, the agent could take the slot
            peer.publish(KEYS[:3])
            with agent_at(tmp_path, address) as a:
                assert wait_until(lambda: a.view.counters["refused"] >= 1, timeout_s=30)
                assert remote_hits(a.config.socket_path, KEYS) == 3, "from the service"
                assert not a.view.ready
                taken.cancel()
                assert wait_until(lambda: a.view.ready, timeout_s=30)
                assert a.view.remote_prefix("t", KEYS) == 3
        finally:
            taken.cancel()
            other.close()


def write_blocks(socket_path, keys, fill: int) -> None:
    with KVStoreClient(socket_path, "writer") as writer:
        reservation = writer.save("t", keys, PAYLOAD)
        for payload in reservation.payloads:
            payload.copy_(torch.full((PAYLOAD,), fill, dtype=torch.uint8))
        assert writer.commit(reservation) == len(keys)


def published(socket_path) -> int:
    with KVStoreClient(socket_path, "probe") as probe:
        return json.loads(probe.stats())["published_blocks"]


def caught_up(agent, address) -> bool:
    """The agent's view has applied every event the service has issued."""
    with MetadataClient(address) as service:
        return agent.view_feed.seq >= service.stats().last_event_seq


def test_a_holder_restarted_at_a_new_address_costs_one_failed_fetch_not_its_keys(tmp_path):
    """The view keeps node addresses; a node that restarts listens on a new port. The failed
    fetch asks the service, which names the new address: the next load is served."""
    flags = ("--transfer", "tcp")
    with metadata_process("--backend", "memory") as (_, address), agent_at(tmp_path, address) as a:
        b, b_socket = start_node_process(tmp_path, "node-b", "--metadata-address", address, *flags)
        try:
            write_blocks(b_socket, KEYS[:3], fill=1)
            assert converges(a, KEYS, 3)
            with KVStoreClient(a.config.socket_path, "reader") as reader:
                reader.release(reader.load("t", KEYS[:1], timeout_s=5))  # learns b's address
            b.send_signal(signal.SIGKILL)
            b.wait()
            b, b_socket = start_node_process(
                tmp_path, "node-b", "--metadata-address", address, *flags
            )
            write_blocks(b_socket, KEYS[:3], fill=2)
            assert wait_until(lambda: published(b_socket) >= 3, timeout_s=10)
            assert wait_until(lambda: caught_up(a, address), timeout_s=10)
            assert a.view.remote_prefix("t", KEYS[1:]) == 2
            with KVStoreClient(a.config.socket_path, "reader") as reader:
                first = reader.load("t", KEYS, timeout_s=5)
                assert len(first) == 1, "the old address failed: the rest is a miss"
                reader.release(first)
                second = reader.load("t", KEYS, timeout_s=5)
                assert (len(second), second.remote_blocks) == (3, 2)
                assert int(second.payloads[2][0]) == 2, "the restarted holder's bytes"
                reader.release(second)
            assert a.fetcher.stats.failed_fetches == 1
        finally:
            b.send_signal(signal.SIGKILL)
            b.wait()
