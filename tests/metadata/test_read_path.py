"""The embedded index's read path takes no lock: a lookup never waits for a writer (a journal
commit holds the lock for as long as LMDB takes), and reads racing writes never fail."""

import os
import threading
import time

from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.records import BlockEntry, NodeRecord

KEYS = [index.to_bytes(16, "big") for index in range(64)]


def test_a_lookup_does_not_wait_for_a_writer_holding_the_lock(tmp_path):
    index = MemoryIndex(tmp_path / "meta")
    lease = index.register_node(NodeRecord("n1"), 60_000).lease_id
    index.publish("n1", lease, "t", [BlockEntry(key, "host") for key in KEYS])
    held, release = threading.Event(), threading.Event()

    def slow_writer() -> None:
        with index._cond:  # as a long journal commit does
            held.set()
            release.wait(10)

    writer = threading.Thread(target=slow_writer)
    writer.start()
    held.wait(5)
    try:
        started = time.monotonic()
        assert len(index.lookup("t", KEYS)) == 64
        assert "n1" in index.live_nodes()
        assert time.monotonic() - started < 1.0
    finally:
        release.set()
        writer.join()
    index.close()


def test_lookups_racing_publishes_evictions_and_membership_never_fail():
    index = MemoryIndex()
    lease = index.register_node(NodeRecord("n1"), 60_000).lease_id
    stop, failures = threading.Event(), []

    def write() -> None:
        while not stop.is_set():
            entries = [BlockEntry(key, tier) for key in KEYS for tier in ("host", "disk")]
            index.publish("n1", lease, "t", entries)
            node = index.register_node(NodeRecord(f"n-{os.urandom(2).hex()}"), 60_000)
            index.publish(node.node_id, node.lease_id, "t", [BlockEntry(KEYS[0], "host")])
            index.unpublish("n1", lease, "t", entries[::3])
            index.deregister_node(node.node_id, node.lease_id)

    def read() -> None:
        try:
            while not stop.is_set():
                for found in index.lookup("t", KEYS):
                    assert found, "a key in the prefix has a holder"
                index.live_nodes()
        except Exception as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    stop.set()
    for thread in threads:
        thread.join()
    assert not failures


def test_a_stats_call_beside_a_long_writer_does_not_stall_the_service(tmp_path):
    """Stats ran on the service's event loop, and the embedded index's stats take its writer
    lock: while a writer held it (a journal commit, a large node's purge) one Stats call
    stopped every RPC, lookups included. It runs in the unary pool now."""
    from tests.metadata.servers import client_for, running_server

    with running_server(tmp_path) as server, client_for(server) as client:
        lease, _ = client.register_node(NodeRecord("n1"))
        client.publish("n1", lease, "t", [BlockEntry(key, "host") for key in KEYS])
        held, release = threading.Event(), threading.Event()

        def slow_writer() -> None:
            with server.index._cond:  # as a long commit or purge does
                held.set()
                release.wait(10)

        writer = threading.Thread(target=slow_writer)
        writer.start()
        held.wait(5)
        stats = threading.Thread(target=client.stats)
        try:
            stats.start()
            time.sleep(0.2)  # the Stats call is in the service, waiting for the lock
            started = time.monotonic()
            assert client.lookup("t", KEYS).prefix_length == 64
            waited_s = time.monotonic() - started
        finally:
            release.set()
            writer.join()
            stats.join()
        assert waited_s < 0.5, f"a lookup waited {waited_s:.2f} s behind a Stats call"
