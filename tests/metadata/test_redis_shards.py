"""The sharded Redis index on a real 3-master Redis Cluster: chains spread over the masters, a
lookup reads one shard in one round trip, a batch split by shard is applied whole, an expiry
purges every shard, and a lease purged mid-publish cannot leave holdings behind."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from kvstore.bench.shards import anchored, chain
from kvstore.errors import LeaseError
from kvstore.metadata.index.redis_shards import ShardedRedisIndex, open_redis_index
from kvstore.metadata.index.shard_map import lookup_shard, shard_of
from kvstore.metadata.records import BlockEntry, Holding, NodeRecord
from tests.metadata.conftest import FakeClock


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def index(redis_cluster, clock):
    made = open_redis_index(
        redis_cluster.url, cluster=True, prefix=f"shards-{uuid.uuid4().hex[:6]}", clock=clock
    )
    yield made
    made.close()


def register(index, node_id: str, ttl_ms: int = 10_000) -> int:
    return index.register_node(NodeRecord(node_id, f"{node_id}:1"), ttl_ms).lease_id


def test_the_default_fits_the_cluster_and_chains_spread_over_every_master(index, redis_cluster):
    assert isinstance(index, ShardedRedisIndex) and index.shards == 12  # 4 per master
    masters = {redis_cluster.master_of(tag + b":seq") for tag in index.tags}
    assert len(masters) == 3, "the shards' hash tags sit on every master"
    lease = register(index, "n1")
    chains = [chain(f"prompt-{i}", 6) for i in range(24)]
    for keys in chains:
        index.publish("n1", lease, "t", anchored(keys))
    shard_keys = b"\\{" + index._prefix.encode() + b":12:*:h:*"
    holders_per_master = {
        master: len(redis_cluster.keys_on(master, shard_keys)) for master in masters
    }
    assert all(count > 0 for count in holders_per_master.values()), holders_per_master
    # each chain's deeper keys live on its anchor's shard, with a copy of its first key
    for keys in chains:
        shard = lookup_shard(keys, index.shards)
        tag = index.tags[shard]
        master = redis_cluster.master_of(tag + b":seq")
        names = set(redis_cluster.keys_on(master, _glob(tag) + b":*:t\0*"))
        for key in keys[1:]:
            assert tag + b":h:t\0" + key in names
        assert (tag + b":r:t\0" + keys[0] in names) or shard_of(keys[0], index.shards) == shard


def _glob(tag: bytes) -> bytes:
    return tag.replace(b"{", b"\\{").replace(b"}", b"\\}")


def test_a_lookup_is_one_round_trip_to_one_shard(index, monkeypatch):
    lease = register(index, "n1")
    prompts = [chain(f"p{i}", 24) for i in range(6)]
    batch = [entry for keys in prompts for entry in anchored(keys)]
    assert index.publish("n1", lease, "t", batch) == len(batch)  # one batch, several shards
    index.lookup("t", prompts[0])  # the live set is cached (0.25 s): read it now, keep it
    index._live_refresh_s = 60.0
    sent: list[tuple[int, int]] = []
    original = redis.Connection.send_packed_command

    def counting(conn, command, check_health=True):
        packed = bytes(command[0] if isinstance(command, list) else command)
        # not the event relay's; not a new pooled connection's handshake (CLIENT SETINFO)
        if threading.current_thread() is threading.main_thread() and b"CLIENT" not in packed:
            sent.append((conn.port, packed))
        return original(conn, command, check_health)

    monkeypatch.setattr(redis.Connection, "send_packed_command", counting)
    for keys in prompts:
        sent.clear()
        found = index.lookup("t", keys)
        assert [len(holders) for holders in found] == [1] * 24
        assert found[5] == (Holding("n1", "host", 10, 1),)
        assert len(sent) == 1 and sent[0][1].startswith(b"*25\r\n$4\r\nMGET"), sent
    monkeypatch.undo()
    assert index.lookup("t", prompts[0][:1]) == [(Holding("n1", "host", 10, 1),)]


def test_a_batch_split_across_shards_is_applied_with_its_events(index):
    lease = register(index, "n1")
    prompts = [chain(f"split-{i}", 4) for i in range(10)]
    shards = {lookup_shard(keys, index.shards) for keys in prompts}
    assert len(shards) > 3
    batch = [entry for keys in prompts for entry in anchored(keys)]
    assert index.publish("n1", lease, "t", batch) == 40
    for keys in prompts:
        assert len(index.lookup("t", keys)) == 4
    page = index.events_since(1, 1000)
    assert len(page.events) == 40 and not page.gap
    assert [e.seq for e in page.events] == list(range(1, 41))
    assert {e.key for e in page.events} == {e.key for e in batch}
    assert index.stats()["blocks"] == 40 and index.stats()["keys_per_tenant"] == {"t": 40}
    assert index.unpublish("n1", lease, "t", batch[:8]) == 8
    assert len(index.lookup("t", prompts[0])) == 0 and len(index.lookup("t", prompts[2])) == 4


def test_an_expiry_purges_every_shard(index, redis_cluster, clock):
    gone, kept = register(index, "gone", 1_000), register(index, "kept", 60_000)
    prompts = [chain(f"exp-{i}", 5) for i in range(16)]
    for keys in prompts:
        index.publish("gone", gone, "t", anchored(keys))
    index.publish("kept", kept, "t", anchored(prompts[0]))
    clock.advance(2)
    assert index.expire_leases() == ["gone"]
    assert index.stats()["blocks_per_node"] == {"kept": {"host": 5}}
    for tag in index.tags:
        master = redis_cluster.master_of(tag + b":seq")
        assert redis_cluster.keys_on(master, _glob(tag) + b":held:gone") == []
        assert redis_cluster.keys_on(master, _glob(tag) + b":rep:gone") == []
    assert len(index.lookup("t", prompts[0])) == 5 and index.lookup("t", prompts[1]) == []
    removed = [e for e in index.events_since(1, 10_000).events if e.kind == "removed"]
    assert len(removed) == 16 * 5


def test_a_publish_after_its_lease_was_purged_leaves_nothing(redis_cluster, clock):
    """Two service replicas: one purges an expired node; the other, which saw the lease live
    a moment ago, publishes for it. The shard refuses: nothing outlives the purge."""
    prefix = f"race-{uuid.uuid4().hex[:6]}"
    one = ShardedRedisIndex(redis_cluster.url, prefix=prefix, clock=clock, shards=6)
    two = ShardedRedisIndex(redis_cluster.url, prefix=prefix, clock=clock, shards=6)
    lease = register(one, "n1", 1_000)
    keys = chain("race", 4)
    two.publish("n1", lease, "t", anchored(keys)[:2])  # two caches the lease as live
    two._leases["n1"] = (lease, clock() + 60, two._leases["n1"][2])  # its clock ran behind
    clock.advance(2)
    assert one.expire_leases() == ["n1"]
    with pytest.raises(LeaseError, match="expired"):
        two.publish("n1", lease, "t", anchored(keys))
    assert one.stats()["blocks"] == 0 and one.lookup("t", keys) == []
    fresh = register(one, "n1", 10_000)
    assert two.publish("n1", fresh, "t", anchored(keys)) == 4
    assert len(one.lookup("t", keys)) == 4
    one.close()
    two.close()


def test_entries_without_anchors_are_found_by_a_second_round_trip(index):
    """An agent that does not send anchors: its keys live on their own shards, and lookups
    read them there after the anchor's shard misses."""
    lease = register(index, "n1")
    keys = chain("old-agent", 8)
    assert index.publish("n1", lease, "t", [BlockEntry(k, "disk") for k in keys]) == 8
    assert len(index.lookup("t", keys)) == 8
    assert index.unpublish("n1", lease, "t", [BlockEntry(keys[3], "disk")]) == 1
    assert len(index.lookup("t", keys)) == 3


def test_two_service_replicas_on_a_sharded_cluster_answer_as_one(redis_cluster, tmp_path):
    """Agents send anchors over gRPC; either replica answers a lookup from one shard, and the
    events of every shard reach WatchEvents in one sequence."""
    from itertools import islice

    from tests.metadata.servers import client_for, running_server, wait_until

    settings = {
        "backend": "redis-cluster",
        "redis_url": redis_cluster.url,
        "redis_prefix": f"svc-{uuid.uuid4().hex[:6]}",
        "redis_shards": 0,  # 4 per master (the default is one slot until agents send anchors)
    }
    with (
        running_server(tmp_path / "a", **settings) as a_server,
        running_server(tmp_path / "b", **settings) as b_server,
        client_for(a_server) as a,
        client_for(b_server) as b,
    ):
        assert a.stats().backend == "redis-cluster" and a_server.index.shards == 12
        lease, _ = a.register_node(NodeRecord("gpu-1", tcp_address="127.0.0.1:7001"), 10_000)
        prompts = [chain(f"svc-{i}", 6) for i in range(8)]
        a.publish("gpu-1", lease, "t", [e for keys in prompts for e in anchored(keys)])
        for keys in prompts:
            assert wait_until(lambda k=keys: b.lookup("t", k).prefix_length == 6, timeout_s=20)
            assert a.lookup("t", keys).prefix_length == 6
        events = list(islice(b.watch_events(from_seq=1), 48))
        assert [e.seq for e in events] == list(range(1, 49))
        assert {e.key for e in events} == {k for keys in prompts for k in keys}
        assert b.unpublish("gpu-1", lease, "t", anchored(prompts[0])[3:]) == 3
        assert a.lookup("t", prompts[0]).prefix_length == 3
        assert b.deregister_node("gpu-1", lease) == 45
        assert a.stats().blocks == 0


def test_resharding_revokes_leases_and_agents_republish_into_the_new_layout(redis_cluster, clock):
    """S 4 -> 8: the replica started with 8 adopts it, every lease is revoked (the agent's
    next heartbeat is NOT_FOUND: it registers again and republishes its store, as after any
    lost registration), a replica still on 4 refuses to write, and the old layout's keys go."""
    from kvstore.errors import NotFoundError, UnavailableError
    from tests.metadata.servers import wait_until

    prefix = f"reshard-{uuid.uuid4().hex[:6]}"
    four = ShardedRedisIndex(redis_cluster.url, prefix=prefix, clock=clock, shards=4)
    lease = register(four, "n1")
    held = [e for i in range(10) for e in anchored(chain(f"re-{i}", 5))]  # the agent's store
    assert four.publish("n1", lease, "t", held) == 50

    eight = ShardedRedisIndex(redis_cluster.url, prefix=prefix, clock=clock, shards=8)
    with pytest.raises(NotFoundError):
        eight.heartbeat("n1", lease)
    with pytest.raises(UnavailableError, match="resharded"):
        four.heartbeat("n1", lease)
    fresh = register(eight, "n1")  # the agent's resync
    assert eight.publish("n1", fresh, "t", held) == 50
    for i in range(10):
        assert len(eight.lookup("t", chain(f"re-{i}", 5))) == 5
    with pytest.raises(UnavailableError):
        register(four, "n2")

    old_keys = b"\\{" + prefix.encode() + b":4:*"
    masters = {redis_cluster.master_of(tag + b":seq") for tag in eight.tags}
    assert wait_until(
        lambda: all(redis_cluster.keys_on(m, old_keys) == [] for m in masters), timeout_s=10
    )
    assert eight.stats()["blocks"] == 50
    four.close()
    eight.close()


def test_events_page_from_any_seq_inside_a_relayed_batch(index):
    """Relayed events are kept one entry per shard write: a page may start and stop inside
    one, and every seq is served once, in order."""
    lease = register(index, "n1")
    for i in range(6):
        index.publish(
            "n1", lease, "t", [e for j in range(3) for e in anchored(chain(f"e{i}{j}", 3))]
        )
    everything = index.events_since(1, 1000).events
    assert [e.seq for e in everything] == list(range(1, 55))
    for size in (1, 4, 7):
        seq, seen = 3, []
        while page := index.events_since(seq, size).events:
            assert len(page) <= size
            seen += page
            seq = page[-1].seq + 1
        assert seen == everything[2:]
    assert index.wait_for_events(53, 0.01) and not index.wait_for_events(54, 0.01)


def test_a_lookup_of_a_suffix_names_its_anchor(redis_cluster, tmp_path):
    """An agent asks the service for the keys past its local hits: `anchor` (the chain's
    depth-1 key) names the shard; without it the suffix is read as a prompt from depth 0."""
    from tests.metadata.servers import client_for, running_server

    settings = {"backend": "redis-cluster", "redis_url": redis_cluster.url, "redis_shards": 6}
    with (
        running_server(tmp_path, redis_prefix=f"sfx-{uuid.uuid4().hex[:6]}", **settings) as server,
        client_for(server) as client,
    ):
        assert server.index.shards == 6  # the setting, not the default (12)
        lease, _ = client.register_node(NodeRecord("gpu-1", tcp_address="127.0.0.1:7001"))
        keys = chain("suffix", 10)
        client.publish("gpu-1", lease, "t", anchored(keys))
        assert client.lookup("t", keys).prefix_length == 10
        assert client.lookup("t", keys[4:], anchor=keys[1]).prefix_length == 6
        assert client.lookup("t", keys[1:], anchor=keys[1]).prefix_length == 9


def test_a_shard_failover_that_lost_writes_makes_every_reader_resync(redis_url):
    """A promoted replica that lacked a shard's newest writes issues their outbox seqs again:
    the relay must not skip the new events as copied already. Told by the shard master's new
    replication id, it empties the stream (a gap for every reader, who resyncs from a
    snapshot) and relays what comes next."""
    prefix = f"back-{uuid.uuid4().hex[:6]}"
    index = ShardedRedisIndex(redis_url, prefix=prefix, shards=2, cluster=False)
    lease = register(index, "n1")
    keys = chain("back", 3)
    shard = lookup_shard(keys, 2)
    index.publish("n1", lease, "t", anchored(keys))
    assert index.events_since(1, 100).last_seq == 3
    with redis.Redis.from_url(redis_url) as client:  # what the promoted replica holds
        client.set(index.tags[shard] + b":seq", 0)
        client.delete(index.tags[shard] + b":ev")
    index._relay._replids[shard] = (index._links[shard].client(), "promoted-replica")
    more = next(
        m for m in (chain(f"more-{i}", 3) for i in range(64)) if lookup_shard(m, 2) == shard
    )
    index.publish("n1", lease, "t", anchored(more)[1:])  # the depth-0 key would touch both
    page = index.events_since(4, 100)
    assert page.gap and page.events == []  # the reader resyncs from a snapshot
    last_seq, _, copies = index.snapshot("t")
    assert {key for _, held in copies for key, _ in held} >= set(more[1:])
    index.publish("n1", lease, "t", [BlockEntry(more[1], "disk", 1, 1, more[1])])
    after = index.events_since(last_seq + 1, 100)
    assert not after.gap and [(e.key, e.tier) for e in after.events] == [(more[1], "disk")]
    index.close()


def test_the_service_keeps_one_slot_unless_told_to_shard(redis_cluster, tmp_path):
    """Agents do not name their chains' anchors yet: a sharded index would read their keys
    shard by shard, so the service's default is the single-tag index; --redis-shards 0 fits
    the cluster (4 per master), N gives N."""
    from kvstore.metadata.index.redis_index import RedisIndex
    from tests.metadata.servers import running_server

    settings = {"backend": "redis-cluster", "redis_url": redis_cluster.url}
    with running_server(tmp_path / "a", redis_prefix="one", **settings) as one:
        assert isinstance(one.index, RedisIndex)
    with running_server(tmp_path / "b", redis_prefix="fit", redis_shards=0, **settings) as fit:
        assert isinstance(fit.index, ShardedRedisIndex) and fit.index.shards == 12
