"""Two metadata-service processes sharing one real redis-server answer as one service."""

import signal
import socket
import time
import urllib.request
import uuid
from itertools import islice

import grpc
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvstore.framing import recv_answer
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.metadata.server import server as server_module
from kvstore.metadata.wire import LENGTH, LOOKUP_FRAMING_VERSION
from kvstore.v1 import metadata_pb2 as pb
from kvstore.v1.metadata_pb2_grpc import MetadataStub
from tests.metadata.conftest import free_port, redis_server
from tests.metadata.servers import publish, running_server, start_cli, wait_until

KEYS = [bytes([i]) * 16 for i in range(16)]


def test_two_replicas_on_one_redis_agree(redis_url):
    prefix = f"replicas-{uuid.uuid4().hex[:8]}"
    env = {"KVSTORE_METADATA_REDIS_PREFIX": prefix}
    args = ("metadata", "--backend", "redis", "--redis-url", redis_url, "--listen", "127.0.0.1:0")
    first, first_address = start_cli(*args, env=env)
    second, second_address = start_cli(*args, env=env)
    try:
        with MetadataClient(first_address) as a, MetadataClient(second_address) as b:
            assert a.stats().backend == "redis"
            lease, _ = a.register_node(NodeRecord("gpu-1", tcp_address="127.0.0.1:7001"), 800)
            a.publish("gpu-1", lease, "t", [BlockEntry(k, "host", 10, 1) for k in KEYS[:6]])
            b.heartbeat("gpu-1", lease)  # a lease granted by one replica is honoured by the other
            b.publish("gpu-1", lease, "t", [BlockEntry(k, "disk") for k in KEYS[:8]])

            seen_by_b = b.lookup("t", KEYS, caller_node_id="gpu-1")
            assert seen_by_b.prefix_length == 8
            assert a.lookup("t", KEYS) == seen_by_b
            assert b.route("t", KEYS) == a.route("t", KEYS) == ("gpu-1", 8)
            assert (a.stats().blocks, b.stats().blocks) == (14, 14)

            events = list(islice(b.watch_events(from_seq=1), 14))
            assert [e.seq for e in events] == list(range(1, 15)), "one sequence for both"

            # The lease runs out: either replica's reaper purges the node, exactly once.
            assert wait_until(lambda: a.lookup("t", KEYS).prefix_length == 0, timeout_s=5)
            assert b.lookup("t", KEYS).prefix_length == 0
            removals = list(islice(a.watch_events(from_seq=15), 14))
            assert all(e.kind == pb.Event.KIND_REMOVED for e in removals)
            assert len({(e.key, e.tier) for e in removals}) == 14
            assert b.stats().last_event_seq == 28
    finally:
        for process in (first, second):
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0


def test_snapshot_streams_leave_the_heartbeats_their_threads(redis_url, tmp_path):
    """On Redis a copy of the index is a SCAN of every key, run in the unary pool: four
    Snapshot streams held all four threads, a heartbeat waited seconds and its node's lease
    ran out. Copies run in a pool of their own now."""
    import os
    import threading
    import time
    import uuid

    from kvstore.metadata.client import MetadataClient
    from kvstore.metadata.index.redis_index import RedisIndex
    from kvstore.metadata.records import BlockEntry, NodeRecord
    from kvstore.metadata.server.server import MetadataConfig, MetadataServer

    prefix = f"starve-{uuid.uuid4().hex[:8]}"
    filler = RedisIndex(redis_url, prefix=prefix)
    lease = filler.register_node(NodeRecord("filler"), 600_000).lease_id
    for _ in range(15):
        filler.publish(
            "filler", lease, "t", [BlockEntry(os.urandom(16), "host") for _ in range(4096)]
        )
    filler.close()
    config = MetadataConfig(
        listen="127.0.0.1:0",
        backend="redis",
        redis_url=redis_url,
        redis_prefix=prefix,
        max_workers=4,
        data_dir=tmp_path,
    )
    server = MetadataServer(config)
    server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        with MetadataClient(address) as client:
            node_lease, _ = client.register_node(NodeRecord("n1"), 10_000)

            def copy_index():
                with MetadataClient(address) as reader:
                    for _ in reader.snapshot("t", max_keys=1):
                        pass

            copies = [threading.Thread(target=copy_index) for _ in range(4)]
            for thread in copies:
                thread.start()
            time.sleep(0.2)  # every copy has started its SCAN
            started = time.perf_counter()
            client.heartbeat("n1", node_lease)
            waited_s = time.perf_counter() - started
            for thread in copies:
                thread.join()
            copies_s = time.perf_counter() - started
        # Quiet: 0.03 s against copies of 1.3 s; behind the copies it waited as long as they
        # ran. A loaded CI machine stretches both (a fixed 0.25 s bound failed at 0.38 s).
        assert waited_s < copies_s / 2, (
            f"a heartbeat waited {waited_s:.2f} s behind copies of {copies_s:.2f} s"
        )
    finally:
        server.stop(grace_s=0.5)


# ---- the lookup port behind one Service: the hello's instance is the index's ------------------
def describe(address: str) -> pb.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return MetadataStub(channel).Describe(pb.DescribeRequest(), timeout=5)


def lookup_hello(port: int, instance: bytes) -> pb.LookupStreamResponse:
    """The status a LookupHello carrying `instance` gets on the lookup port 127.0.0.1:`port`."""
    hello = pb.LookupHello(version=LOOKUP_FRAMING_VERSION, instance=instance).SerializeToString()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(LENGTH.pack(len(hello)) + hello)
        answer = recv_answer(sock, pb.LookupStreamResponse, 4096, time.monotonic() + 5)
    assert answer is not None, "the lookup port closed the connection unanswered"
    return answer


def rpcs(metrics_port: int, method: str) -> float:
    """The OK calls of `method` a service process counted (its /metrics)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvstore_metadata_rpcs_total"
        and sample.labels == {"method": method, "code": "OK"}
    )


def ports(lookup_listen: str, metrics_port: int) -> tuple[str, ...]:
    return ("--lookup-listen", lookup_listen, "--metrics-listen", f"127.0.0.1:{metrics_port}")


def test_a_replica_answers_on_its_lookup_port_a_client_that_described_another(redis_url, tmp_path):
    """Behind one Kubernetes Service a client's Describe and its lookup connection may reach
    different replicas. Each replica had a random id of its own process and refused a hello
    carrying another's, so the client fell back to gRPC for 10 s at a time. The id is the
    index's now: replica 2 answers a client that described replica 1, and a service over
    another prefix, or another Redis, still refuses that hello."""
    prefix = f"behind-a-service-{uuid.uuid4().hex[:8]}"
    env = {"KVSTORE_METADATA_REDIS_PREFIX": prefix}
    args = ("metadata", "--backend", "redis", "--redis-url", redis_url, "--listen", "127.0.0.1:0")
    lookup_port, metrics = free_port(), (free_port(), free_port())
    # The Service, on loopback: the lookup port described by replica 1 is replica 2's on the
    # client's host (replica 1's own listens on 127.0.0.2, where no client dials).
    processes = [
        start_cli(*args, *ports(f"127.0.0.{2 - i}:{lookup_port}", metrics[i]), env=env)
        for i in (0, 1)
    ]
    with redis_server(tmp_path) as other_redis:
        others = [
            start_cli(*args, env={"KVSTORE_METADATA_REDIS_PREFIX": prefix + "-other"}),
            start_cli(*args[:4], other_redis, *args[5:], env=env),
        ]
        processes += others
        try:
            described = describe(processes[0][1])
            assert described.lookup_port == lookup_port
            with MetadataClient(processes[0][1]) as client:
                publish(client, "t", KEYS[:5])
                assert client.lookup("t", KEYS).prefix_length == 5
            assert rpcs(metrics[1], "LookupPort") == 1, "replica 2 took the hello"
            assert (rpcs(metrics[0], "Lookup"), rpcs(metrics[1], "Lookup")) == (0, 1)
            for _, address in others:
                refused = lookup_hello(describe(address).lookup_port, described.instance)
                assert refused.status_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
                assert "another service instance's" in refused.status_message
        finally:
            for process, _ in processes:
                process.send_signal(signal.SIGTERM)
            for process, _ in processes:
                assert process.wait(timeout=15) == 0


def test_replicas_follow_their_index_to_a_new_id_when_it_loses_its_state(
    redis_url, tmp_path, monkeypatch
):
    """A Redis that lost its data (a FLUSHALL, a restart without persistence) gives its index a
    new id, which replicas started since then describe: those running before take it too, and
    still take hellos carrying the id their clients described before."""
    monkeypatch.setattr(server_module, "INDEX_ID_REFRESH_S", 0.1)
    prefix = f"lost-{uuid.uuid4().hex[:8]}"
    settings = {"backend": "redis", "redis_url": redis_url, "redis_prefix": prefix}
    with running_server(tmp_path, **settings) as first:
        before = first.lookup_port.instance
        redis.Redis.from_url(redis_url).delete(f"{prefix}:inc")  # what a FLUSHALL does to it
        with running_server(tmp_path, **settings) as second:
            after = second.lookup_port.instance
            assert after != before
            assert wait_until(lambda: first.lookup_port.instance == after)
            assert describe(f"127.0.0.1:{first.port}").instance == after
            for instance in (before, after):
                assert lookup_hello(first.servicer.lookup_port, instance).status_code == 0
