"""The lookup port's kept records on the Redis backends (redis_tracking.py), with a real
redis-server and a real Redis Cluster: a lookup asked again is answered without a round trip,
and every change another replica makes to what it read (a record unpublished or published, a
node re-registered elsewhere, a node deregistered) shows in the very next lookup, as the unary
Lookup's answer; a server that refuses tracking is read at every lookup; nothing is kept past
MAX_AGE_S."""

import os
import time

import pytest
import redis

from kvstore.metadata.index import redis_tracking
from kvstore.metadata.index.redis_index import RedisIndex
from kvstore.metadata.index.redis_pipe import RedisPipe
from kvstore.metadata.index.redis_tracking import TrackedRecords
from kvstore.metadata.records import NodeRecord
from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from tests.metadata.conftest import FakeClock, make_index, redis_server, url_for
from tests.metadata.servers import (
    FAST_LIMITS,
    LOOKUP_KEYS,
    client_for,
    running_server,
    wait_until,
)
from tests.metadata.test_redis_lookup_port import anchored, both_ways

KEYS = LOOKUP_KEYS


class RoundTrips:
    """Counts the loop lookups' calls to Redis (RedisPipe.call)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        call = RedisPipe.call

        async def counted(pipe, *args, **kwargs):
            self.count += 1
            return await call(pipe, *args, **kwargs)

        monkeypatch.setattr(RedisPipe, "call", counted)


@pytest.fixture(params=("redis", "redis-cluster"))
def replicas(request, tmp_path):
    """A service on a Redis index, and another replica's index over the same Redis and prefix
    (its writes reach the service only through Redis)."""
    clock, url = FakeClock(time.time()), url_for(request.param, request)
    index = make_index(request.param, tmp_path, clock, url)
    prefix = index._prefix.decode().strip("{}")
    other = RedisIndex(url, prefix=prefix, clock=clock, cluster=request.param == "redis-cluster")
    config = MetadataConfig(listen="127.0.0.1:0", limits=FAST_LIMITS, backend="redis")
    server = MetadataServer(config, index=index)
    server.start()
    try:
        yield server, other
    finally:
        server.stop(grace_s=0.5)
        other.close()


def test_kept_records_answer_again_and_follow_every_change_of_another_replica(
    replicas, monkeypatch
):
    """Kept for good but for Redis's invalidations (MAX_AGE_S out of the way): each change
    shows at the port, as the unary Lookup (a direct read) answers it. Not always at the very
    next lookup: Redis may write the writer's reply a moment before the invalidation (1 in
    600 here, under load, one lookup later; redis_tracking.py)."""
    monkeypatch.setattr(redis_tracking, "MAX_AGE_S", 3600.0)
    server, other = replicas
    lease = other.register_node(NodeRecord("holder", tcp_address="10.0.0.1:1"), 600_000).lease_id
    other.publish("holder", lease, "t", anchored(KEYS[:5]))
    trips = RoundTrips(monkeypatch)
    with (
        client_for(server) as port,
        client_for(server, lookup_port=False) as stream,  # LookupStream calls
        client_for(server, lookup_port=False, lookup_streams=False) as unary,
    ):

        def agree(prefix_length: int, addresses: dict) -> None:
            answer = unary.lookup("t", KEYS)
            assert (answer.prefix_length, answer.addresses) == (prefix_length, addresses)
            for kept in (port, stream):
                assert wait_until(lambda k=kept: k.lookup("t", KEYS) == answer, 2.0, 0.001)

        agree(5, {"holder": ("10.0.0.1:1", "")})
        read = trips.count
        for _ in range(3):
            assert both_ways(port, unary, "t", KEYS).prefix_length == 5
            assert both_ways(stream, unary, "t", KEYS).prefix_length == 5
        assert trips.count == read  # from the kept records, without a round trip
        other.unpublish("holder", lease, "t", anchored(KEYS[3:4]))
        agree(3, {"holder": ("10.0.0.1:1", "")})
        lease = other.register_node(NodeRecord("holder", tcp_address="10.0.0.9:9"), 600_000)
        lease = lease.lease_id  # elsewhere now, its holdings kept
        agree(3, {"holder": ("10.0.0.9:9", "")})
        other.publish("holder", lease, "t", anchored(KEYS[3:7]))
        agree(7, {"holder": ("10.0.0.9:9", "")})
        other.deregister_node("holder", lease)
        agree(0, {})


def test_a_redis_that_refuses_tracking_is_read_at_every_lookup(tmp_path, monkeypatch):
    """An ACL user without CLIENT: the pipe reads untracked, and answers stay right."""
    with redis_server(tmp_path) as url:
        with redis.Redis.from_url(url) as admin:
            admin.acl_setuser(
                "lookups",
                enabled=True,
                passwords=["+pw"],
                keys=["*"],
                commands=["+@all", "-client"],
            )
        authed = url.replace("redis://", "redis://lookups:pw@")
        settings = {"backend": "redis", "redis_url": authed}
        with running_server(tmp_path, **settings) as server, client_for(server) as client:
            lease, _ = client.register_node(NodeRecord("holder", tcp_address="10.0.0.1:1"))
            client.publish("holder", lease, "t", anchored(KEYS[:5]))
            assert client.lookup("t", KEYS).prefix_length == 5  # the holder's record read
            trips = RoundTrips(monkeypatch)
            assert [client.lookup("t", KEYS).prefix_length for _ in range(3)] == [5] * 3
            assert trips.count == 3
            client.unpublish("holder", lease, "t", anchored(KEYS[2:3]))
            assert client.lookup("t", KEYS).prefix_length == 2


def test_nothing_is_kept_past_its_max_age(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(redis_tracking.time, "monotonic", lambda: now[0])
    kept = TrackedRecords(b"p")
    key = os.urandom(16)
    kept.fill_live([[b"holder", 2e9]])
    kept.fill_holders(b"p:h:t\0", [key], [b"holder\0host\x001\x001\0"])
    kept.fill_nodes([b"holder"], [[b"1", b"1000", b'["10.0.0.1:1", "", {}]']])
    found, nodes = kept.found(b"p:h:t\0", [key], 1e9)
    assert len(found) == 1 and set(nodes) == {"holder"}
    now[0] += redis_tracking.MAX_AGE_S + 0.01
    assert kept.found(b"p:h:t\0", [key], 1e9) is None
    assert kept.live is None and kept.holders == {}
