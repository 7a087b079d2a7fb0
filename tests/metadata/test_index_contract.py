"""The MetadataIndex contract, run against every backend (memory, lmdb, redis, redis-cluster, and
the last two sharded)."""

import random
from collections import Counter

import pytest

from kvstore.errors import LeaseError, NotFoundError, QuotaExceededError
from kvstore.metadata.records import TIERS, BlockEntry, NodeRecord
from tests.metadata.conftest import SHARDS, FakeClock, make_index, url_for

KEYS = [bytes([i]) * 16 for i in range(32)]


@pytest.fixture(
    params=["memory", "lmdb", "redis", "redis-cluster", "redis-sharded", "redis-cluster-sharded"]
)
def backend(request):
    return request.param


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def index(backend, tmp_path, clock, request):
    redis_url = url_for(backend, request)
    made = make_index(backend, tmp_path, clock, redis_url)
    yield made
    made.close()


def register(index, node_id="n1", ttl_ms=10_000):
    return index.register_node(NodeRecord(node_id, tcp_address=f"{node_id}:1"), ttl_ms).lease_id


def entries(keys, tier="host"):
    return [BlockEntry(k, tier, 100, 7) for k in keys]


def test_lookup_returns_the_longest_published_prefix_with_holders(index):
    lease = register(index)
    assert index.publish("n1", lease, "t", entries(KEYS[:5])) == 5
    found = index.lookup("t", KEYS)
    assert len(found) == 5
    assert [(h.node_id, h.tier, h.size_bytes, h.checksum) for h in found[0]] == [
        ("n1", "host", 100, 7)
    ]
    assert index.lookup("t", KEYS[1:]) == found[1:]
    assert index.lookup("t", [KEYS[9], *KEYS[:5]]) == []


def test_a_key_held_by_two_nodes_and_two_tiers_lists_every_holder(index):
    one, two = register(index, "n1"), register(index, "n2")
    index.publish("n1", one, "t", entries(KEYS[:2], "host") + entries(KEYS[:1], "disk"))
    index.publish("n2", two, "t", entries(KEYS[:1], "disk"))
    holders = {(h.node_id, h.tier) for h in index.lookup("t", KEYS[:1])[0]}
    assert holders == {("n1", "host"), ("n1", "disk"), ("n2", "disk")}


def test_publishing_twice_is_idempotent(index):
    lease = register(index)
    assert index.publish("n1", lease, "t", entries(KEYS[:3])) == 3
    assert index.publish("n1", lease, "t", entries(KEYS[:4])) == 1
    assert index.stats()["blocks"] == 4


def test_tenants_never_see_each_others_keys(index):
    lease = register(index)
    index.publish("n1", lease, "alice", entries(KEYS[:3]))
    assert index.lookup("bob", KEYS) == []
    assert len(index.lookup("alice", KEYS)) == 3


def test_unpublish_removes_holdings_and_emits_removed_events(index):
    lease = register(index)
    index.publish("n1", lease, "t", entries(KEYS[:3]))
    assert index.unpublish("n1", lease, "t", entries(KEYS[1:2]) + entries(KEYS[20:21])) == 1
    assert len(index.lookup("t", KEYS)) == 1
    kinds = [(e.kind, e.key) for e in index.events_since(1, 100).events]
    # one key's events keep their order; a sharded index may order other keys' differently
    assert [kind for kind, key in kinds if key == KEYS[1]] == ["stored", "removed"]
    assert [key for kind, key in kinds if kind == "removed"] == [KEYS[1]]


def test_an_expired_lease_purges_the_node_and_emits_removals(index, clock):
    lease = register(index, ttl_ms=1_000)
    index.publish("n1", lease, "t", entries(KEYS[:2]))
    clock.advance(0.5)
    index.heartbeat("n1", lease)
    clock.advance(0.9)
    assert len(index.lookup("t", KEYS)) == 2, "the heartbeat extended the lease"
    clock.advance(0.2)
    assert index.lookup("t", KEYS) == [], "an expired node is never returned"
    assert index.expire_leases() == ["n1"]
    assert index.live_nodes() == {}
    removed = [e for e in index.events_since(1, 100).events if e.kind == "removed"]
    assert {e.key for e in removed} == set(KEYS[:2])
    with pytest.raises(NotFoundError):
        index.heartbeat("n1", lease)


def test_a_stale_or_expired_lease_is_refused(index, clock):
    lease = register(index, ttl_ms=1_000)
    with pytest.raises(LeaseError, match="not current"):
        index.publish("n1", lease + 1000, "t", entries(KEYS[:1]))
    clock.advance(2)
    with pytest.raises(LeaseError, match="expired"):
        index.heartbeat("n1", lease)


def test_unknown_node_is_not_found(index):
    with pytest.raises(NotFoundError, match="unknown node"):
        index.publish("ghost", 1, "t", entries(KEYS[:1]))


def test_reregistering_gives_a_new_lease_and_keeps_holdings(index):
    first = register(index)
    index.publish("n1", first, "t", entries(KEYS[:2]))
    second = register(index)
    assert second != first
    with pytest.raises(LeaseError):
        index.heartbeat("n1", first)
    assert len(index.lookup("t", KEYS)) == 2


def test_deregister_removes_everything_of_the_node(index):
    lease = register(index)
    index.publish("n1", lease, "t", entries(KEYS[:4]))
    assert index.deregister_node("n1", lease) == 4
    assert index.lookup("t", KEYS) == [] and index.live_nodes() == {}


def test_quota_rejects_a_whole_batch_that_would_exceed_it(backend, tmp_path, clock, request):
    redis_url = url_for(backend, request)
    index = make_index(backend, tmp_path, clock, redis_url, key_quota_per_tenant=3)
    lease = register(index)
    index.publish("n1", lease, "t", entries(KEYS[:2]))
    with pytest.raises(QuotaExceededError, match="quota of 3"):
        index.publish("n1", lease, "t", entries(KEYS[2:4]))
    assert len(index.lookup("t", KEYS)) == 2
    index.publish("n1", lease, "t", entries(KEYS[:2], "disk") + entries(KEYS[2:3]))
    index.publish("n1", lease, "other", entries(KEYS[:3]))
    index.close()


def test_events_are_sequenced_and_resumable(index):
    lease = register(index)
    index.publish("n1", lease, "t", entries(KEYS[:5]))
    page = index.events_since(1, 100)
    assert [e.seq for e in page.events] == [1, 2, 3, 4, 5] and not page.gap
    assert page.last_seq == 5
    assert [e.seq for e in index.events_since(4, 100).events] == [4, 5]
    assert index.events_since(6, 100).events == []
    assert [e.seq for e in index.events_since(2, 2).events] == [2, 3]


def test_an_event_gap_is_signalled(backend, tmp_path, clock, request):
    redis_url = url_for(backend, request)
    index = make_index(backend, tmp_path, clock, redis_url, max_events=4)
    lease = register(index)
    index.publish("n1", lease, "t", entries(KEYS[:10]))
    page = index.events_since(1, 100)
    assert page.gap and page.events[0].seq > 1 and page.events[-1].seq == 10
    assert not index.events_since(page.events[0].seq, 100).gap
    index.close()


def test_wait_for_events_wakes_on_a_new_event_or_times_out(index):
    lease = register(index)
    assert not index.wait_for_events(0, 0.05)
    index.publish("n1", lease, "t", entries(KEYS[:1]))
    assert index.wait_for_events(0, 1.0)


def test_stats_count_blocks_per_tier_and_node(index):
    lease = register(index)
    index.publish("n1", lease, "t", entries(KEYS[:3], "host") + entries(KEYS[:1], "disk"))
    stats = index.stats()
    assert stats["blocks"] == 4
    assert stats["blocks_per_tier"] == {"host": 3, "disk": 1}
    assert stats["blocks_per_node"]["n1"] == {"host": 3, "disk": 1}
    assert stats["last_event_seq"] == 4


def test_unpublishing_the_same_entry_twice_in_one_call_removes_it_once(index):
    """Regression: the memory index removed a duplicated entry twice (count went negative)."""
    lease = register(index)
    index.publish("n1", lease, "t", entries(KEYS[:2]))
    assert index.unpublish("n1", lease, "t", entries(KEYS[:1]) * 2) == 1
    assert index.stats()["keys_per_tenant"] == {"t": 1}
    assert [e.kind for e in index.events_since(1, 100).events].count("removed") == 1


def _recount(model: set) -> dict:
    """Stats computed from scratch from a set of (node, tenant, key, tier) holdings."""
    per_tier, per_node, tenant_keys = Counter(), {}, {}
    for node, tenant, key, tier in model:
        per_tier[tier] += 1
        per_node.setdefault(node, Counter())[tier] += 1
        tenant_keys.setdefault(tenant, set()).add(key)
    return {
        "blocks": len(model),
        "blocks_per_tier": dict(per_tier),
        "blocks_per_node": {n: dict(c) for n, c in per_node.items()},
        "keys_per_tenant": {t: len(k) for t, k in tenant_keys.items()},
    }


def _counted(stats: dict) -> dict:
    return {
        "blocks": stats["blocks"],
        "blocks_per_tier": stats["blocks_per_tier"],
        "blocks_per_node": {n: c for n, c in stats["blocks_per_node"].items() if c},
        "keys_per_tenant": stats["keys_per_tenant"],
    }


def test_stats_equal_a_full_recount_after_every_kind_of_change(backend, tmp_path, request):
    """Stats are counters kept by each change (a scrape is O(1) in holdings): they must stay
    equal to a recount through publishes, unpublishes, node expiry and a restart."""
    clock, prefix = FakeClock(), "recount"
    redis_url = url_for(backend, request)

    def open_index():
        if backend.startswith("redis"):
            from kvstore.metadata.index.redis_index import RedisIndex
            from kvstore.metadata.index.redis_shards import ShardedRedisIndex

            kind, options = RedisIndex, {}
            if backend.endswith("-sharded"):
                kind, options = ShardedRedisIndex, {"shards": SHARDS}
            return kind(
                redis_url,
                prefix=f"{prefix}-{tmp_path.name}",
                clock=clock,
                cluster=backend.startswith("redis-cluster"),
                **options,
            )
        return make_index(backend, tmp_path, clock)

    index, rng, model = open_index(), random.Random(7), set()
    leases = {"n1": register(index, "n1", 60_000), "n2": register(index, "n2", 1_000)}
    for _ in range(40):
        node, tenant = rng.choice(["n1", "n2"]), rng.choice(["a", "b"])
        batch = [BlockEntry(rng.choice(KEYS), rng.choice(TIERS)) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.65:
            index.publish(node, leases[node], tenant, batch)
            model |= {(node, tenant, e.key, e.tier) for e in batch}
        else:
            index.unpublish(node, leases[node], tenant, batch + batch[:1])
            model -= {(node, tenant, e.key, e.tier) for e in batch}
        assert _counted(index.stats()) == _recount(model)
    clock.advance(2)
    index.heartbeat("n1", leases["n1"])
    assert index.expire_leases() == ["n2"]
    model = {h for h in model if h[0] != "n2"}
    assert _counted(index.stats()) == _recount(model)
    if backend != "memory":
        index.close()
        index = open_index()
        assert _counted(index.stats()) == _recount(model), "after a restart"
    index.close()


def test_lease_ids_cannot_be_guessed_from_one_another(index):
    """They gate a node's heartbeats, publishes and deregistration: counters (1, 2, 3...)
    let any caller that saw one, or none, act as another node."""
    leases = [register(index, f"n{i}") for i in range(8)]
    assert len(set(leases)) == 8 and max(leases) - min(leases) > 1 << 32
    assert all(0 < lease < 1 << 63 for lease in leases)
    with pytest.raises(LeaseError):
        index.publish("n1", leases[0], "t", entries(KEYS[:1]))  # n0's lease, for n1
    assert index.publish("n1", leases[1], "t", entries(KEYS[:1])) == 1
