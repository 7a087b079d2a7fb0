"""The metadata service on a real Redis Cluster: the master of the index's slot SIGKILLed under
publish load → its replica is promoted, the service keeps answering, and every write acknowledged
before the kill is counted kept or lost, with asynchronous replication and with WAIT 1 (which
refuses writes while the promoted master has no replica: until the killed one rejoins)."""

import json
import statistics
import threading
import time
import uuid

import pytest

from kvstore.errors import UnavailableError
from kvstore.metadata.index.redis_cluster import ClusterLink
from kvstore.metadata.records import BlockEntry, NodeRecord
from tests.metadata.servers import client_for, running_server

BATCH_KEYS = 4
LOAD_BEFORE_KILL_S = 1.5
LOAD_AFTER_FAILOVER_S = 1.0
FAILOVER_BUDGET_S = 20.0


class Writer:
    """Publishes batches of fresh keys in a loop and remembers which were acknowledged, when."""

    def __init__(self, client, lease: int) -> None:
        self.client, self.lease = client, lease
        self.acked: list[tuple[float, float, list[bytes]]] = []  # (sent, acknowledged, keys)
        self.latencies_s: list[float] = []
        self.failures = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        batch = 0
        while not self.stop.is_set():
            keys = [f"{batch:08d}-{i}".encode().ljust(16, b".") for i in range(BATCH_KEYS)]
            started = time.monotonic()
            try:
                self.client.publish("n1", self.lease, "t", [BlockEntry(k, "host") for k in keys])
            except UnavailableError:
                self.failures += 1
                continue  # the same batch again: publish is idempotent
            done = time.monotonic()
            self.latencies_s.append(done - started)
            self.acked.append((started, done, keys))
            batch += 1

    def acked_after(self, moment: float) -> int:
        """Writes sent after `moment` and acknowledged."""
        return sum(1 for sent, _, _ in self.acked if sent > moment)


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _promoted(cluster, slot_key: bytes, killed: int) -> bool:
    try:
        return cluster.master_of(slot_key) != killed
    except AssertionError:  # no online master for the slot yet
        return False


def _register_once_replicas_caught_up(client) -> int:
    """The node's lease, registered once the cluster's replicas answer WAIT again (a master
    restarted by an earlier drill may still be syncing as a replica)."""
    deadline = time.monotonic() + FAILOVER_BUDGET_S
    while True:
        try:
            return client.register_node(NodeRecord("n1", tcp_address="n1:1"), lease_ttl_ms=120_000)[
                0
            ]
        except UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _drill(tmp_path, cluster, wait_replicas: int, replica_lag_s: float) -> dict:
    prefix = f"drill-{uuid.uuid4().hex[:8]}"
    settings = dict(
        backend="redis-cluster",
        redis_url=cluster.url,
        redis_prefix=prefix,
        redis_wait_replicas=wait_replicas,
        redis_wait_timeout_ms=500,
        redis_failover_timeout_s=FAILOVER_BUDGET_S,
        redis_shards=0,  # sharded: 4 per master
    )
    with running_server(tmp_path, **settings) as server, client_for(server, timeout_s=30) as c:
        lease = _register_once_replicas_caught_up(c)
        writer = Writer(c, lease)
        writer.thread.start()
        time.sleep(LOAD_BEFORE_KILL_S)
        # the master of the index's first shard (4 shards per master): a third of the shards
        tags = getattr(server.index, "tags", [ClusterLink.key_prefix(prefix)])
        slot_key = tags[0] + b":seq"
        master = cluster.master_of(slot_key)
        replica = cluster.replica_of(master)
        if replica_lag_s:
            cluster.pause(replica)
            time.sleep(replica_lag_s)
        killed_at = time.monotonic()
        cluster.kill(master)
        killed_by = time.monotonic()  # a write sent from now on can only reach the new master
        cluster.resume(replica)
        rejoined = False
        try:
            promoted = _wait_for(lambda: _promoted(cluster, slot_key, master), FAILOVER_BUDGET_S)
            if wait_replicas:  # the promoted replica has none of its own until the old rejoins
                cluster.restart(master)
                rejoined = True
            resumed = _wait_for(lambda: writer.acked_after(killed_by) > 0, FAILOVER_BUDGET_S)
            first_ack = min(
                (done for sent, done, _ in writer.acked if sent > killed_by), default=killed_at
            )
            time.sleep(LOAD_AFTER_FAILOVER_S)
            writer.stop.set()
            writer.thread.join(timeout=FAILOVER_BUDGET_S)
            # acknowledged before the kill began / sent after it ended (those in flight across
            # the kill may have reached either master: neither promised nor counted)
            before = [keys for _, done, keys in writer.acked if done <= killed_at]
            after = [keys for sent, _, keys in writer.acked if sent > killed_by]
            kept = sum(len(c.lookup("t", keys).holders) == BATCH_KEYS for keys in before)
            kept_after = sum(len(c.lookup("t", keys).holders) == BATCH_KEYS for keys in after)
        finally:
            writer.stop.set()
            if not rejoined:
                cluster.restart(master)
    before_latencies = writer.latencies_s[: len(before)]
    return {
        "wait_replicas": wait_replicas,
        "replica_lag_s": replica_lag_s,
        "promoted": promoted,
        "resumed": resumed,
        "write_stall_s": round(first_ack - killed_at, 3),
        "acked_before_kill": len(before),
        "kept": kept,
        "lost": len(before) - kept,
        "acked_after_failover": len(after),
        "kept_after_failover": kept_after,
        "publish_p50_us": round(statistics.median(before_latencies) * 1e6),
        "publish_p99_us": round(statistics.quantiles(before_latencies, n=100)[98] * 1e6),
        "unavailable_calls": writer.failures,
    }


@pytest.mark.parametrize(("wait_replicas", "replica_lag_s"), [(0, 0.0), (0, 0.5), (1, 0.5)])
def test_a_killed_master_is_replaced_and_the_service_keeps_answering(
    tmp_path, redis_cluster, wait_replicas, replica_lag_s
):
    report = _drill(tmp_path, redis_cluster, wait_replicas, replica_lag_s)
    print("failover drill:", json.dumps(report))
    assert report["promoted"], f"no replica took over within {FAILOVER_BUDGET_S} s"
    assert report["resumed"], f"no write succeeded within {FAILOVER_BUDGET_S} s of the kill"
    assert report["acked_before_kill"] > 20
    assert report["kept_after_failover"] == report["acked_after_failover"]
    if wait_replicas:
        assert report["lost"] == 0, "a write its replica confirmed survived the failover"
    else:  # the service retried through the failover: no caller saw an error
        assert report["unavailable_calls"] == 0
        assert report["lost"] <= report["acked_before_kill"]  # counted, not promised


def test_wait_costs_a_replica_round_trip_per_write(redis_cluster):
    """Same run, same cluster: publish latency at the index without WAIT and with WAIT 1."""
    from kvstore.metadata.index.redis_cluster import Durability
    from kvstore.metadata.index.redis_index import RedisIndex

    p50_us = {}
    for wait in (0, 1):
        index = RedisIndex(
            redis_cluster.url,
            prefix=f"wait-{wait}-{uuid.uuid4().hex[:6]}",
            cluster=True,
            durability=Durability(wait, 500),
        )
        lease = index.register_node(NodeRecord("n1"), 60_000).lease_id
        latencies = []
        for batch in range(300):
            keys = [BlockEntry(f"{batch}-{i}".encode().ljust(16, b"."), "host") for i in range(4)]
            started = time.perf_counter()
            index.publish("n1", lease, "t", keys)
            latencies.append(time.perf_counter() - started)
        p50_us[wait] = round(statistics.median(latencies) * 1e6)
        index.close()
    print("publish p50 us by wait_replicas:", json.dumps(p50_us))
    assert p50_us[1] > 0 and p50_us[0] > 0


def test_a_reader_ahead_of_the_index_is_told_of_a_gap(redis_cluster):
    """After a failover lost the newest events, their seqs are issued again for new events: a
    watcher that had read them must resync (KIND_GAP), not skip the new ones silently."""
    from kvstore.metadata.index.redis_index import RedisIndex

    index = RedisIndex(redis_cluster.url, prefix=f"ahead-{uuid.uuid4().hex[:6]}", cluster=True)
    lease = index.register_node(NodeRecord("n1"), 60_000).lease_id
    index.publish("n1", lease, "t", [BlockEntry(bytes([i]) * 16, "host") for i in range(3)])
    assert not index.events_since(4, 10).gap, "the next seq to come is no gap"
    page = index.events_since(9, 10)  # this reader saw seqs up to 8: lost in a failover
    assert page.gap and page.events == [] and page.last_seq == 3
    index.close()


def test_the_index_slot_is_one_hash_tag_so_every_script_runs_on_one_master(redis_cluster):
    from kvstore.metadata.index.redis_index import RedisIndex

    index = RedisIndex(redis_cluster.url, prefix="tagged", cluster=True)
    lease = index.register_node(NodeRecord("n1"), 10_000).lease_id
    index.publish("n1", lease, "tenant", [BlockEntry(bytes([i]) * 16, "disk") for i in range(50)])
    master = redis_cluster.master_of(b"{tagged}:seq")
    holder_keys = redis_cluster.keys_on(master, b"{tagged}:*")
    assert len(holder_keys) >= 50 + 5, "holdings, counters, stream and registry on one master"
    index.close()


def test_a_cluster_url_without_seeds_is_a_config_error():
    from kvstore.errors import ConfigError
    from kvstore.metadata.index.redis_cluster import cluster_seeds

    with pytest.raises(ConfigError, match="must be host:port"):
        cluster_seeds("redis://localhost")
    assert [(s.host, s.port) for s in cluster_seeds("redis://a:1,b:2")] == [("a", 1), ("b", 2)]


def test_an_empty_prefix_on_a_cluster_is_a_config_error():
    """An empty prefix made the hash tag "{}", which is no hash tag: the index's keys spread
    over slots and every script failed CROSSSLOT."""
    from kvstore.errors import ConfigError
    from kvstore.metadata.server.server import MetadataConfig

    with pytest.raises(ConfigError, match="redis_prefix must be non-empty"):
        MetadataConfig(backend="redis-cluster", redis_url="redis://a:1", redis_prefix="")
    MetadataConfig(backend="redis", redis_url="redis://a:1", redis_prefix="")  # one server


def test_a_heartbeat_retried_through_a_failover_cannot_revive_an_expired_lease(redis_cluster):
    """The lease was checked against the time of the first attempt: a heartbeat that the
    cluster link retried for seconds through a failover extended a lease that had expired
    meanwhile (its holdings, hidden from lookups, came back with no event). Each attempt
    checks against its own time now."""
    import redis

    from kvstore.errors import LeaseError
    from kvstore.metadata.index.redis_index import RedisIndex
    from tests.metadata.conftest import FakeClock

    clock = FakeClock()
    index = RedisIndex(
        redis_cluster.url, prefix=f"retry-{uuid.uuid4().hex[:6]}", cluster=True, clock=clock
    )
    lease = index.register_node(NodeRecord("n1"), 1_000).lease_id
    link, failures = index._link, []
    master = link.client

    def failing_once():
        if not failures:
            failures.append(True)
            clock.advance(2)  # the failover took longer than the lease
            raise redis.ConnectionError("the master is gone")
        return master()

    link.client = failing_once
    try:
        with pytest.raises(LeaseError, match="expired"):
            index.heartbeat("n1", lease)
    finally:
        link.client = master
        index.close()
    assert failures == [True]
