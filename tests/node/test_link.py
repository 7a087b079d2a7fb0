"""The node agent's metadata link against a real metadata service that refuses batches: over
quota or with a full journal, a batch is dropped and counted, logged once per cause, and the
link keeps its lease and goes on publishing what the service accepts."""

import logging

from kvstore.events import EventFeed, EventKind
from kvstore.metadata.records import NodeRecord
from kvstore.node.link import MetadataLink
from kvstore.retry import Backoff
from tests.metadata.servers import client_for, running_server, wait_until

KEYS = [i.to_bytes(16, "big") for i in range(4096)]
FAST = Backoff(base_s=0.01, cap_s=0.05)


class FakeStore:
    """What the link reads from a TieredStore: its event feed and its inventory."""

    def __init__(self, inventory=()) -> None:
        self.events = EventFeed()
        self._inventory = list(inventory)

    def inventory(self):
        return list(self._inventory)

    def store(self, keys, tenant="t", tier="host"):
        for key in keys:
            self._inventory.append((key, tier, tenant))
            self.events.emit(EventKind.STORED, key, tier, 4096, tenant)


def link_to(server, store, name="node-a"):
    link = MetadataLink(
        client_for(server), NodeRecord(name), store, lease_ttl_ms=2_000, backoff=FAST
    )
    link.start()
    assert wait_until(lambda: link.connected, timeout_s=10)
    return link


def test_a_batch_over_quota_is_dropped_counted_and_the_link_goes_on(tmp_path, caplog):
    with running_server(tmp_path, key_quota_per_tenant=10) as server, client_for(server) as meta:
        store = FakeStore()
        link = link_to(server, store)
        try:
            with caplog.at_level(logging.DEBUG, logger="kvstore.node.link"):
                store.store(KEYS[:20], tenant="greedy")  # one batch of 20 > quota 10
                link.flush()
                assert wait_until(lambda: link.dropped_blocks == 20, timeout_s=10)
                store.store(KEYS[20:40], tenant="greedy")  # refused again, logged at DEBUG
                store.store(KEYS[:5], tenant="modest")  # accepted
                link.flush()
                assert wait_until(lambda: meta.lookup("modest", KEYS[:64]).prefix_length == 5, 10)
                assert wait_until(lambda: link.dropped_blocks == 40, timeout_s=10)
            assert link.dropped_by_cause == {"capacity": 40}
            # counted once the publish call returns, which may trail the service's answer
            assert wait_until(lambda: link.published == 5, timeout_s=10) and link.connected
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 1 and "RESOURCE_EXHAUSTED" in errors[0].getMessage()
            assert meta.lookup("greedy", KEYS[:64]).prefix_length == 0
        finally:
            link.stop()


def test_a_resync_over_quota_drops_the_refused_batch_instead_of_looping(tmp_path):
    """Regression: a refused inventory batch failed the whole registration, forever."""
    inventory = [(k, "host", "greedy") for k in KEYS[:30]] + [(k, "disk", "ok") for k in KEYS[:3]]
    with running_server(tmp_path, key_quota_per_tenant=10) as server, client_for(server) as meta:
        link = link_to(server, FakeStore(inventory))
        try:
            assert link.dropped_blocks == 30
            assert meta.lookup("ok", KEYS[:64]).prefix_length == 3
            lease = link.lease_id
            assert not wait_until(lambda: link.lease_id != lease, timeout_s=1.0)
        finally:
            link.stop()


def test_a_full_journal_drops_the_batch_and_heartbeats_keep_the_lease(tmp_path):
    settings = {"lmdb_map_size_bytes": 256 << 10}
    with running_server(tmp_path, **settings) as server, client_for(server) as meta:
        store = FakeStore()
        link = link_to(server, store)
        try:
            store.store(KEYS)  # 4 batches, ~300 KiB of holdings: more than the whole map
            link.flush()
            assert wait_until(lambda: link.published + link.dropped_blocks == 4096, 10)
            assert link.dropped_blocks > 0 and set(link.dropped_by_cause) == {"capacity"}
            assert meta.stats().blocks == link.published, "only what was acknowledged"
            lease = link.lease_id
            assert not wait_until(lambda: link.lease_id != lease, timeout_s=1.5)
        finally:
            link.stop()


def test_an_unavailable_service_is_retried_until_it_is_back(tmp_path):
    with running_server(tmp_path) as server:
        port = server.port
    store = FakeStore()
    link = MetadataLink(
        client_for(server), NodeRecord("node-a"), store, lease_ttl_ms=2_000, backoff=FAST
    )
    link.start()
    try:
        store.store(KEYS[:3])
        assert not wait_until(lambda: link.connected, timeout_s=0.5)
        # its lookup port anywhere: "auto" (the gRPC port + 1) may be another process's now
        again = {"listen": f"127.0.0.1:{port}", "lookup_listen": "127.0.0.1:0"}
        with running_server(tmp_path, **again) as server:
            with client_for(server) as meta:
                assert wait_until(lambda: meta.lookup("t", KEYS[:64]).prefix_length == 3, 10)
        assert link.dropped_blocks == 0
    finally:
        link.stop(deregister=False)
