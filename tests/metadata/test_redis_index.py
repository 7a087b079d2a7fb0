"""Redis-specific behaviour of RedisIndex beyond the shared contract: binary keys, exact lease
times, batch deduplication, node records surviving the round trip; holder records read and
MGETs packed as the lookups on the loop do."""

import os
import time
import uuid

import hiredis
import pytest
import redis

from kvstore.metadata.index.redis_holders import holders_prefix
from kvstore.metadata.index.redis_index import RedisIndex
from kvstore.metadata.index.redis_pipe import pack_mget
from kvstore.metadata.records import BlockEntry, Holding, NodeRecord
from tests.metadata.conftest import FakeClock


@pytest.fixture
def clock():
    return FakeClock(1_712_345_678.123456)  # a realistic wall clock with sub-ms digits


@pytest.fixture
def index(redis_url, clock):
    made = RedisIndex(redis_url, prefix=f"redis-{uuid.uuid4().hex[:8]}", clock=clock)
    yield made
    made.close()


def test_keys_with_separator_bytes_round_trip(index):
    keys = [b"\0" * 16, b"\0\1" * 8, b"a\0b\0c\0" + b"\xff" * 10]
    lease = index.register_node(NodeRecord("n1"), 10_000).lease_id
    assert index.publish("n1", lease, "t", [BlockEntry(k, "disk", 5, 2**63) for k in keys]) == 3
    assert index.lookup("t", keys) == [(Holding("n1", "disk", 5, 2**63),)] * 3
    assert [e.key for e in index.events_since(1, 10).events] == keys
    assert index.unpublish("n1", lease, "t", [BlockEntry(keys[1], "disk")]) == 1
    assert len(index.lookup("t", keys)) == 1


def test_lease_times_are_exact_and_the_node_record_survives(index, clock):
    node = NodeRecord("n1", "10.0.0.1:7000", "ucx://x", {"host": 1 << 34, "disk": 5})
    record = index.register_node(node, 1_500)
    assert record.expires_at == clock() + 1.5
    assert index.live_nodes()["n1"] == record
    clock.advance(0.7)
    beat = index.heartbeat("n1", record.lease_id)
    assert beat.expires_at == clock() + 1.5
    assert beat.tier_capacity_bytes == {"host": 1 << 34, "disk": 5}
    clock.now = beat.expires_at  # alive strictly before expires_at, as in the memory index
    assert index.live_nodes() == {}


def test_a_key_repeated_in_one_batch_is_recorded_once_with_the_last_values(index):
    lease = index.register_node(NodeRecord("n1"), 10_000).lease_id
    key = b"k" * 16
    batch = [BlockEntry(key, "host", 1, 1), BlockEntry(key, "host", 2, 2)]
    assert index.publish("n1", lease, "t", batch) == 1
    assert index.lookup("t", [key]) == [(Holding("n1", "host", 2, 2),)]
    assert index.stats()["keys_per_tenant"] == {"t": 1}
    assert index.events_since(0, 10).last_seq == 1


def test_a_holder_on_an_expired_node_is_hidden_while_a_live_one_is_shown(index, clock):
    key = b"k" * 16
    short = index.register_node(NodeRecord("short"), 1_000).lease_id
    long = index.register_node(NodeRecord("long"), 10_000).lease_id
    index.publish("short", short, "t", [BlockEntry(key, "host")])
    index.publish("long", long, "t", [BlockEntry(key, "disk")])
    clock.advance(2)
    assert index.lookup("t", [key]) == [(Holding("long", "disk"),)]
    assert index.stats()["blocks"] == 2, "lookup has no side effects"


def test_wait_for_events_with_no_timeout_answers_at_once(index):
    started = time.monotonic()
    assert not index.wait_for_events(0, 0)
    assert time.monotonic() - started < 0.5


def test_a_lookup_survives_redis_dropping_the_connection(index, redis_url):
    lease = index.register_node(NodeRecord("n1"), 10_000).lease_id
    index.publish("n1", lease, "t", [BlockEntry(b"k" * 16, "host")])
    assert len(index.lookup("t", [b"k" * 16])) == 1
    killer = redis.Redis.from_url(redis_url)
    assert killer.client_kill_filter(_type="normal", skipme=True) >= 1
    killer.close()
    assert len(index.lookup("t", [b"k" * 16])) == 1, "retried on a fresh connection"


def test_a_user_without_the_dangerous_commands_still_serves_stats_and_streams(redis_url):
    """INFO is in Redis's @dangerous category, and `+@all -@dangerous` is the least-privilege
    user of Redis's own docs: reading the replication id for the incarnation raised, and
    every Stats, Snapshot and WatchEvents call failed. Without INFO the incarnation is
    P:inc's alone (a warning says a lossy failover is then not detected)."""
    admin = redis.Redis.from_url(redis_url)
    user = f"limited-{uuid.uuid4().hex[:6]}"
    admin.acl_setuser(
        user, enabled=True, passwords=["+limited-pw"], keys=["*"], commands=["+@all", "-@dangerous"]
    )
    host_port = redis_url.split("//", 1)[1]
    limited = RedisIndex(f"redis://{user}:limited-pw@{host_port}", prefix=f"acl-{user}")
    try:
        with pytest.raises(redis.ResponseError):
            limited._link.client().info("replication")  # the user may not run INFO
        assert limited.incarnation == limited.incarnation != 0
        lease = limited.register_node(NodeRecord("n1"), 60_000).lease_id
        limited.publish("n1", lease, "t", [BlockEntry(bytes(16), "host")])
        assert [e.seq for e in limited.events_since(1, 10).events] == [1]
    finally:
        limited.close()
        admin.acl_deluser(user)
        admin.close()


def test_a_lookup_s_run_of_keys_ends_at_the_first_without_a_live_holder():
    """holders_prefix: all live (each key's holdings as recorded), a dead holder left out, and
    a key with none (no record, an empty one, only dead holders) ends the run."""
    one, two = Holding("n1", "host", 1, 2), Holding("n2", "disk", 3, 4)
    n1, n2 = b"n1\0host\x001\x002\0", b"n2\0disk\x003\x004\0"
    assert holders_prefix([n1, n1 + n2], frozenset({b"n1", b"n2"})) == [(one,), (one, two)]
    assert holders_prefix([n1, n1 + n2, n1], frozenset({b"n1"})) == [(one,), (one,), (one,)]
    for gap in (None, b"", n2):
        assert holders_prefix([n1, gap, n1], frozenset({b"n1"})) == [(one,)]
    assert holders_prefix([None, n1], frozenset({b"n1"})) == []


def test_a_packed_mget_is_the_one_hiredis_packs():
    """pack_mget writes a lookup's MGET without building its names: the same bytes."""
    stem = b"P:h:tenant\0"
    for keys, head in (
        ([os.urandom(16) for _ in range(64)], ()),
        ([os.urandom(16) for _ in range(3)], (b"{P}:r:tenant\0" + b"k" * 16,)),
        ([b"short", b"longer key"], ()),
        ([], (b"first",)),
    ):
        names = (b"MGET", *head, *(stem + key for key in keys))
        assert pack_mget(stem, keys, head) == hiredis.pack_command(names)
