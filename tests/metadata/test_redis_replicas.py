"""Two metadata-service replicas sharing one Redis server and prefix answer as one index."""

import threading
import uuid

import pytest

from kvstore.errors import QuotaExceededError, UnavailableError
from kvstore.metadata.index.redis_index import RedisIndex
from kvstore.metadata.records import BlockEntry, NodeRecord
from tests.metadata.conftest import FakeClock, free_port

KEYS = [bytes([i]) * 16 for i in range(32)]


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def replicas(redis_url, clock):
    """Two replicas as two processes would hold them: separate pools, one prefix, one clock."""
    prefix = f"replicas-{uuid.uuid4().hex[:8]}"
    pair = [RedisIndex(redis_url, prefix=prefix, clock=clock) for _ in range(2)]
    yield pair
    for index in pair:
        index.close()


def entries(keys, tier="host"):
    return [BlockEntry(k, tier, 100, 7) for k in keys]


def register(index, node_id="n1", ttl_ms=1_000):
    return index.register_node(NodeRecord(node_id, tcp_address=f"{node_id}:1"), ttl_ms).lease_id


def test_a_publish_through_one_replica_is_seen_by_the_other(replicas):
    one, two = replicas
    lease = register(one)
    assert one.publish("n1", lease, "t", entries(KEYS[:3])) == 3
    assert len(two.lookup("t", KEYS)) == 3
    assert set(two.live_nodes()) == {"n1"}
    two.heartbeat("n1", lease)  # a lease granted by one replica is honoured by the other
    assert two.publish("n1", lease, "t", entries(KEYS[:4])) == 1
    assert one.stats() == two.stats()
    assert one.stats()["blocks"] == 4


def test_expiry_run_on_both_replicas_purges_each_node_once(replicas, clock):
    one, two = replicas
    for node_id in ("n1", "n2"):
        one.publish(node_id, register(one, node_id), "t", entries(KEYS[:3]))
    clock.advance(2)
    assert sorted(one.expire_leases() + two.expire_leases()) == ["n1", "n2"]
    removed = [e for e in two.events_since(1, 100).events if e.kind == "removed"]
    assert len(removed) == 6, "every holding is removed, and only once"
    assert one.stats()["blocks"] == 0 and one.stats()["keys_per_tenant"] == {}


def test_concurrent_expiry_on_both_replicas_purges_each_node_once(replicas, clock):
    one = replicas[0]
    nodes = [f"n{i}" for i in range(20)]
    for node_id in nodes:
        one.publish(node_id, register(one, node_id), "t", entries(KEYS[:5]))
    clock.advance(2)
    purged: list[list[str]] = [[], []]
    threads = [
        threading.Thread(target=lambda i=i: purged[i].extend(replicas[i].expire_leases()))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(purged[0] + purged[1]) == sorted(nodes)
    page = one.events_since(1, 1_000)
    assert sum(e.kind == "removed" for e in page.events) == 100
    assert page.last_seq == 200


def test_events_from_both_replicas_share_one_sequence(replicas):
    one, two = replicas
    lease = register(one, ttl_ms=10_000)
    one.publish("n1", lease, "t", entries(KEYS[:2]))
    two.publish("n1", lease, "t", entries(KEYS[2:4]))
    one.unpublish("n1", lease, "t", entries(KEYS[:1]))
    seqs = [e.seq for e in two.events_since(1, 100).events]
    assert seqs == [1, 2, 3, 4, 5]
    assert one.events_since(1, 100) == two.events_since(1, 100)


def test_a_watcher_on_one_replica_wakes_for_a_publish_on_the_other(replicas):
    one, two = replicas
    lease = register(one, ttl_ms=10_000)
    woke: list[bool] = []
    watcher = threading.Thread(target=lambda: woke.append(two.wait_for_events(0, 5.0)))
    watcher.start()
    one.publish("n1", lease, "t", entries(KEYS[:1]))
    watcher.join(timeout=5)
    assert woke == [True]


def test_the_tenant_quota_counts_keys_published_through_either_replica(redis_url, clock):
    prefix = f"quota-{uuid.uuid4().hex[:8]}"
    one, two = (RedisIndex(redis_url, prefix, 3, clock=clock) for _ in range(2))
    lease = register(one, ttl_ms=10_000)
    one.publish("n1", lease, "t", entries(KEYS[:2]))
    with pytest.raises(QuotaExceededError, match="quota of 3"):
        two.publish("n1", lease, "t", entries(KEYS[2:4]))
    assert one.stats()["keys_per_tenant"] == {"t": 2}
    one.close()
    two.close()


def test_an_unreachable_redis_raises_unavailable_naming_the_url():
    url = f"redis://127.0.0.1:{free_port()}/0"
    index = RedisIndex(url)
    with pytest.raises(UnavailableError, match=f"redis at {url} is unavailable"):
        index.live_nodes()
    with pytest.raises(UnavailableError):
        index.lookup("t", KEYS[:2])
    index.close()


def test_the_unavailable_message_hides_the_redis_password():
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    index = RedisIndex(url)
    with pytest.raises(UnavailableError) as raised:
        index.stats()
    assert "s3cret" not in str(raised.value) and "user:***@127.0.0.1" in str(raised.value)
    index.close()


def test_a_promoted_replica_that_lost_the_newest_events_is_another_incarnation(tmp_path):
    """Replication is asynchronous: a replica promoted before it received seqs 11-15 issues
    11-18 for other events, under the same P:inc (replicated long before), so a watcher that
    had read 11-15 resumed past them with no gap and kept holdings that no longer exist. The
    incarnation folds in the master's replication id, which a promotion changes."""
    import subprocess
    import time

    import redis

    master_port, replica_port = free_port(), free_port()
    servers = [
        subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp_path),
                "--dbfilename",
                f"{port}.rdb",
                *(["--replicaof", "127.0.0.1", str(master_port)] if port == replica_port else []),
            ],
            stdout=subprocess.DEVNULL,
        )
        for port in (master_port, replica_port)
    ]
    try:
        replica = redis.Redis(port=replica_port)
        deadline = time.monotonic() + 10
        while True:
            try:
                if replica.info("replication").get("master_link_status") == "up":
                    break
            except redis.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.05)
        old = RedisIndex(f"redis://127.0.0.1:{master_port}/0", prefix="p")
        before = old.incarnation
        lease = register(old, ttl_ms=600_000)
        old.publish("n1", lease, "t", entries(KEYS[:10]))
        while int(replica.get(b"p:seq") or 0) < 10:
            time.sleep(0.05)
        replica.execute_command("REPLICAOF", "NO", "ONE")  # promoted; what follows is lost
        old.publish("n1", lease, "t", entries(KEYS[10:15]))  # seqs 11-15, read by a watcher
        assert [e.seq for e in old.events_since(11, 100).events] == list(range(11, 16))
        new = RedisIndex(f"redis://127.0.0.1:{replica_port}/0", prefix="p")  # the failover
        new.publish("n1", lease, "t", entries(KEYS[15:23]))  # seqs 11-18 again, other keys
        assert not new.events_since(16, 100).gap, "the seqs alone cannot tell"
        assert new.incarnation != before and old.incarnation == before
        old.close()
        new.close()
    finally:
        for server in servers:
            server.terminate()
            server.wait()
