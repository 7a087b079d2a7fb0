"""Heartbeats on the metadata service take a path no publish can hold up: a pool of their own
(not the unary pool every publish queues for) and, in memory, a lease lock of their own (not
the writers' lock a publish holds). Real gRPC service on loopback, flooded by 64 publishers
whose every publish holds the writers' lock for 0.1 s."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from kvstore.errors import LeaseError
from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from tests.metadata.servers import FAST_LIMITS, client_for

PUBLISHERS = 64  # twice the unary pool's threads


class LockHoggingIndex(MemoryIndex):
    """Every publish holds the writers' lock for `hold_s` first (a large batch, a slow disk)."""

    def __init__(self, hold_s: float) -> None:
        super().__init__()
        self.hold_s = hold_s

    def publish(self, *args):
        with self._cond:
            time.sleep(self.hold_s)
            return super().publish(*args)


@contextmanager
def flooded_service(hold_s: float):
    config = MetadataConfig(listen="127.0.0.1:0", backend="memory", limits=FAST_LIMITS)
    server = MetadataServer(config, index=LockHoggingIndex(hold_s))
    server.start()
    stop = threading.Event()
    flood = client_for(server)
    lease, _ = flood.register_node(NodeRecord("flooder"), 60_000)
    agent_lease, _ = flood.register_node(NodeRecord("node-a"), 10_000)  # before the flood

    def publish_until_stopped(n: int) -> None:
        key = n.to_bytes(16, "big")
        while not stop.is_set():
            flood.publish("flooder", lease, "t", [BlockEntry(key, "host")])

    pool = ThreadPoolExecutor(PUBLISHERS)
    try:
        for n in range(PUBLISHERS):
            pool.submit(publish_until_stopped, n)
        time.sleep(0.5)  # the unary pool is full and its queue long
        yield server, agent_lease
    finally:
        stop.set()
        pool.shutdown(wait=True)
        flood.close()
        server.stop(grace_s=0.5)


def test_a_heartbeat_is_answered_at_once_while_publishes_queue_for_seconds():
    with flooded_service(hold_s=0.1) as (server, lease), client_for(server) as agent:
        waits_s = []
        for _ in range(10):
            started = time.perf_counter()
            agent.heartbeat("node-a", lease, timeout_s=5)
            waits_s.append(time.perf_counter() - started)
            time.sleep(0.05)
        # behind the flood, each would wait for ~64 publishes of 0.1 s: seconds
        assert max(waits_s) < 0.5, waits_s


def test_a_lease_that_ran_out_is_still_refused_on_the_fast_path():
    clock = [1000.0]
    index = MemoryIndex(clock=lambda: clock[0])
    lease = index.register_node(NodeRecord("node-a"), 1_000).lease_id
    clock[0] += 0.5
    assert index.heartbeat("node-a", lease).expires_at == 1001.5
    clock[0] += 1.5
    with pytest.raises(LeaseError, match="expired"):
        index.heartbeat("node-a", lease)
    assert "node-a" not in index.live_nodes()
