"""The node agent's metadata link against a real metadata service that is slow to take
publishes (every Publish takes a while, as on a loaded service): the link coalesces its
events into one batch a second instead of a call per round, and its heartbeats, on a thread
of their own, keep the lease however long a publish takes."""

import threading
import time
from contextlib import contextmanager

from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.records import NodeRecord
from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from kvstore.node.link import MetadataLink
from tests.metadata.servers import FAST_LIMITS, calls, client_for, wait_until
from tests.node.test_link import FAST, KEYS, FakeStore


class SlowIndex(MemoryIndex):
    """Publish and Unpublish take `delay_s` each (outside the writers' lock)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def publish(self, *args):
        time.sleep(self.delay_s)
        return super().publish(*args)

    def unpublish(self, *args):
        time.sleep(self.delay_s)
        return super().unpublish(*args)


@contextmanager
def slow_service(delay_s: float):
    config = MetadataConfig(listen="127.0.0.1:0", backend="memory", limits=FAST_LIMITS)
    server = MetadataServer(config, index=SlowIndex(delay_s))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=0.5)


@contextmanager
def linked(server, store, lease_ttl_ms: int):
    link = MetadataLink(
        client_for(server), NodeRecord("node-a"), store, lease_ttl_ms=lease_ttl_ms, backoff=FAST
    )
    link.start()
    try:
        assert wait_until(lambda: link.connected, timeout_s=10)
        yield link
    finally:
        link.stop()


def store_steadily(store, keys, seconds: float) -> None:
    """`keys` stored evenly over `seconds`, as a worker's commits arrive."""
    step = seconds / len(keys)
    for key in keys:
        store.store([key])
        time.sleep(step)


def test_a_slow_service_gets_one_batch_a_second_and_every_block_in_the_end():
    with slow_service(delay_s=0.2) as server:
        store = FakeStore()
        with linked(server, store, lease_ttl_ms=3_000) as link:
            before = calls(server, "Publish")
            started = time.monotonic()
            store_steadily(store, KEYS[:400], seconds=4.0)
            spent_s = time.monotonic() - started
            sent = calls(server, "Publish") - before
            # a round each 0.2 s + the call's 0.2 s would be ~10 calls; coalesced: one a second
            assert sent <= spent_s / link.pacing.coalesce_s + 2, sent
            link.flush()
            assert wait_until(lambda: link.published == 400, timeout_s=10)
            assert link.dropped_blocks == 0


def test_heartbeats_keep_the_lease_while_every_publish_takes_longer_than_the_lease():
    """1 s leases, publishes of 1.5 s each: a link that heartbeat between its publishes lost
    its lease at every one of them and registered again."""
    with slow_service(delay_s=1.5) as server:
        store = FakeStore()
        with linked(server, store, lease_ttl_ms=1_000) as link:
            lease, beats = link.lease_id, link.lease.heartbeats
            feeder = threading.Thread(target=store_steadily, args=(store, KEYS[:40], 4.0))
            feeder.start()
            feeder.join()
            assert link.lease_id == lease and link.lease.late == 0
            assert link.lease.heartbeats - beats >= 8  # every 1/3 s
            assert calls(server, "RegisterNode") == 2  # the first registration's two calls
            assert wait_until(lambda: link.published == 40, timeout_s=15)
