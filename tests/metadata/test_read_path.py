"""The embedded index's read path takes no lock: a lookup never waits for a writer (a journal
commit holds the lock for as long as LMDB takes), and reads racing writes never fail."""

import os
import threading
import time

from kvstore.metadata.index import BlockEntry, NodeRecord
from kvstore.metadata.memory import MemoryIndex

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
