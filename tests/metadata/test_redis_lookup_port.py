"""The lookup port on the Redis backends, a real redis-server and a real Redis Cluster, one slot
and sharded: its answers are the unary Lookup's (hits, misses, a foreign tenant, a dead holder
not yet purged), from the index's lookups on the loop, never from its blocking reads; a Redis
that stalls or goes away is an error status, not a hang, and the service keeps answering. (A
version gave these backends no lookup port: their clients paid LookupStream's gRPC.)"""

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from kvstore.errors import PermissionDeniedError, UnavailableError
from kvstore.metadata.index import redis_pipe
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from tests.metadata.conftest import FakeClock, free_port, make_index, url_for
from tests.metadata.servers import (
    ADMIN,
    ALICE,
    FAST_LIMITS,
    LOOKUP_KEYS,
    calls,
    client_for,
    health_status,
    running_server,
    wait_until,
)

KEYS = LOOKUP_KEYS
BOB = "bob-token-0123456789"
KINDS = ("redis", "redis-sharded", "redis-cluster", "redis-cluster-sharded")


def anchored(keys, anchor: bool = True) -> list[BlockEntry]:
    """Entries of a chain from depth 0 (naming their anchors) or, `anchor` False, none."""
    if not anchor:
        return [BlockEntry(key, "host", 1, 1) for key in keys]
    return [BlockEntry(key, "host", 1, 1, b"" if i == 0 else KEYS[1]) for i, key in enumerate(keys)]


class CountedReads:
    """Counts the index's blocking lookups (those the unary Lookup makes)."""

    def __init__(self, index) -> None:
        self.count = 0
        self.lookup = index.lookup
        index.lookup = self

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.lookup(*args, **kwargs)


@pytest.fixture(params=KINDS)
def redis_service(request, tmp_path):
    """A service on a Redis index of each kind, with a clock the test moves and no reaper
    purges (a dead holder stays in the index, for lookups to leave out)."""
    clock = FakeClock(time.time())
    index = make_index(request.param, tmp_path, clock, url_for(request.param, request))
    index.expire_leases = list
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{ADMIN} *\n{ALICE} alice\n{BOB} bob\n")
    config = MetadataConfig(
        listen="127.0.0.1:0", limits=FAST_LIMITS, backend="redis", token_file=token_file
    )
    server = MetadataServer(config, index=index)
    server.start()
    try:
        yield server, clock
    finally:
        server.stop(grace_s=0.5)


def both_ways(port, unary, *args, **kwargs):
    """The lookup on the port and as a unary Lookup: the same answer, or the same error."""
    answers = []
    for client in (port, unary):
        try:
            answers.append(client.lookup(*args, **kwargs))
        except Exception as exc:
            answers.append((type(exc), str(exc)))
    assert answers[0] == answers[1]
    if isinstance(answers[1], tuple):
        raise answers[1][0](answers[1][1])
    return answers[1]


def test_the_lookup_port_answers_as_the_unary_lookup_on_every_redis_backend(redis_service):
    server, clock = redis_service
    assert server.servicer.lookup_port > 0
    with client_for(server, token=ADMIN) as admin:
        holder, _ = admin.register_node(NodeRecord("holder", tcp_address="10.0.0.1:1"), 600_000)
        dead, _ = admin.register_node(NodeRecord("dead", tcp_address="10.0.0.2:1"), 1_000)
        admin.publish("holder", holder, "alice", anchored(KEYS[:5]))
        admin.publish("dead", dead, "alice", anchored(KEYS[:7], anchor=False))
        bobs = [os.urandom(16) for _ in range(4)]
        admin.publish("holder", holder, "bob", anchored(bobs))
    reads = CountedReads(server.index)
    with (
        client_for(server, token=ALICE) as port,
        client_for(server, token=ALICE, lookup_port=False, lookup_streams=False) as unary,
    ):
        live = both_ways(port, unary, "alice", KEYS, caller_node_id="dead")
        assert live.prefix_length == 7
        assert live.addresses == {"holder": ("10.0.0.1:1", ""), "dead": ("10.0.0.2:1", "")}
        clock.advance(2.0)  # the dead node's lease ends; nothing purges it
        after = both_ways(port, unary, "alice", KEYS, caller_node_id="holder")
        assert after.prefix_length == 5
        assert after.addresses == {"holder": ("10.0.0.1:1", "")}
        assert both_ways(port, unary, "alice", KEYS[2:], anchor=KEYS[1]).prefix_length == 3
        assert both_ways(port, unary, "alice", [os.urandom(16)] * 3).prefix_length == 0
        assert both_ways(port, unary, "alice", KEYS[5:]).prefix_length == 0
        assert both_ways(port, unary, "alice", bobs).prefix_length == 0  # bob's keys, not hers
        with pytest.raises(PermissionDeniedError, match="only act for tenant 'alice'"):
            both_ways(port, unary, "bob", KEYS)
        with pytest.raises(Exception, match="16 bytes"):
            both_ways(port, unary, "alice", [b"short"])
    assert reads.count == 6  # the unary Lookups' only: the port's were asked on the loop
    assert calls(server, "LookupPort") == 1
    assert calls(server, "LookupStream") == 0


def _redis_server(port: int, workdir) -> subprocess.Popen:
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)]
    process = subprocess.Popen([shutil.which("redis-server"), *args], stdout=subprocess.DEVNULL)
    assert wait_until(lambda: _answers(port), timeout_s=10), "redis-server did not start"
    return process


def _answers(port: int) -> bool:
    import redis

    try:
        with redis.Redis(port=port, socket_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def test_a_redis_that_stalls_or_goes_away_is_an_error_and_the_service_keeps_answering(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(redis_pipe, "REPLY_TIMEOUT_S", 0.5)
    port = free_port()
    process = _redis_server(port, tmp_path)
    settings = {"backend": "redis", "redis_url": f"redis://127.0.0.1:{port}/0"}
    try:
        with running_server(tmp_path, **settings) as server, client_for(server) as client:
            lease, _ = client.register_node(NodeRecord("holder", tcp_address="10.0.0.1:1"))
            client.publish("holder", lease, "t", anchored(KEYS[:5]))
            assert client.lookup("t", KEYS).prefix_length == 5
            process.send_signal(signal.SIGSTOP)  # connected, silent
            started = time.monotonic()
            unread = [os.urandom(16) for _ in range(3)]  # KEYS' records are kept: not read again
            with pytest.raises(UnavailableError, match=r"no reply within 0\.5 s"):
                client.lookup("t", unread, timeout_s=5.0)
            assert time.monotonic() - started < 2.0
            process.send_signal(signal.SIGCONT)
            assert client.lookup("t", KEYS).prefix_length == 5  # on a new Redis connection
            process.terminate()
            process.wait(timeout=10)
            started = time.monotonic()
            with pytest.raises(UnavailableError, match=f"127.0.0.1:{port}.* is unavailable"):
                client.lookup("t", KEYS, timeout_s=5.0)
            assert time.monotonic() - started < 4.0
            assert health_status(f"127.0.0.1:{server.port}") == "SERVING"
            process = _redis_server(port, tmp_path)  # back, empty (no persistence)
            assert client.lookup("t", KEYS).prefix_length == 0
            assert calls(server, "LookupPort") == 1  # every answer, errors too, on one connection
            assert calls(server, "LookupStream") == 0
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(timeout=10)


def test_lookups_on_the_port_follow_a_failover_of_the_index_s_master(tmp_path, redis_cluster):
    """The master killed: lookups are answered off the loop by the index, which follows the
    failover, until the new master is found; then on the loop again, from it."""
    prefix = f"failover-{uuid.uuid4().hex[:8]}"
    settings = {"backend": "redis-cluster", "redis_url": redis_cluster.url}
    settings |= {"redis_prefix": prefix, "redis_wait_replicas": 1}
    with running_server(tmp_path, **settings) as server, client_for(server) as client:
        lease, _ = client.register_node(NodeRecord("holder", tcp_address="10.0.0.1:1"), 600_000)
        client.publish("holder", lease, "t", anchored(KEYS[:5]))  # on the replica too (WAIT)
        assert client.lookup("t", KEYS).prefix_length == 5
        master = redis_cluster.master_of(b"{" + prefix.encode() + b"}:seq")
        redis_cluster.kill(master)
        try:
            answers = []

            def answered() -> bool:
                with contextlib.suppress(UnavailableError):
                    answers.append(client.lookup("t", KEYS, timeout_s=5.0).prefix_length)
                return answers[-1:] == [5]

            assert wait_until(answered, timeout_s=30, interval_s=0.1), answers
            reads = CountedReads(server.index)
            assert [client.lookup("t", KEYS).prefix_length for _ in range(5)] == [5] * 5
            assert reads.count == 0  # on the loop, from the new master
            assert set(answers) <= {5}  # errors meanwhile, never a wrong answer
            assert calls(server, "LookupStream") == 0
        finally:
            redis_cluster.restart(master)
