"""The metadata service over real gRPC on loopback, narrated: membership and leases, lookups
and routing, events with resume and gaps, persistence across a restart, metrics."""

import threading
import time
import urllib.request
from itertools import islice

import pytest

from kvstore.errors import LeaseError
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.v1 import metadata_pb2 as pb
from tests.metadata.servers import client_for, health_status, running_server

KEYS = [bytes([i]) * 16 for i in range(64)]


def host_entries(keys, tier="host"):
    return [BlockEntry(k, tier, 4096, 11) for k in keys]


def test_lookup_prefers_the_callers_node_then_faster_tiers(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        a, _ = client.register_node(NodeRecord("node-a", tcp_address="10.0.0.1:7000"))
        b, _ = client.register_node(NodeRecord("node-b", tcp_address="10.0.0.2:7000"))
        client.publish("node-a", a, "t", host_entries(KEYS[:4], "disk"))
        client.publish("node-b", b, "t", host_entries(KEYS[:2], "host"))
        result = client.lookup("t", KEYS, caller_node_id="node-a")
        assert result.prefix_length == 4
        assert [(h.node_id, h.tier) for h in result.holders[0]] == [
            ("node-a", "disk"),
            ("node-b", "host"),
        ]
        other = client.lookup("t", KEYS, caller_node_id="node-c")
        assert [(h.node_id, h.tier) for h in other.holders[0]][0] == ("node-b", "host")
        assert other.addresses["node-b"] == ("10.0.0.2:7000", "")


def test_route_picks_the_node_with_the_longest_prefix(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        a, _ = client.register_node(NodeRecord("node-a"))
        b, _ = client.register_node(NodeRecord("node-b"))
        client.publish("node-a", a, "t", host_entries(KEYS[:3]))
        client.publish("node-b", b, "t", host_entries(KEYS[:6]))
        assert client.route("t", KEYS) == ("node-b", 6)
        assert client.route("t", KEYS, ["node-a"]) == ("node-a", 3)
        assert client.route("t", KEYS[10:]) == ("", 0)


def test_an_expired_lease_purges_the_nodes_keys_and_streams_removals(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        lease, ttl_ms = client.register_node(NodeRecord("short-lived"), lease_ttl_ms=300)
        assert ttl_ms == 300
        client.publish("short-lived", lease, "t", host_entries(KEYS[:3]))
        received = []
        stream = client.watch_events(from_seq=1)
        reader = threading.Thread(target=lambda: received.extend(islice(stream, 6)))
        reader.start()
        reader.join(timeout=5)
        stream.close()
        assert client.lookup("t", KEYS).prefix_length == 0
        kinds = [pb.Event.Kind.Name(e.kind) for e in received]
        assert kinds == ["KIND_STORED"] * 3 + ["KIND_REMOVED"] * 3
        assert {e.key for e in received[3:]} == set(KEYS[:3])
        assert all(e.node_id == "short-lived" and e.tier == pb.TIER_HOST for e in received)
        with pytest.raises(Exception, match=r"NOT_FOUND|FAILED_PRECONDITION"):
            client.heartbeat("short-lived", lease)


def test_heartbeats_keep_a_node_alive(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        lease, _ = client.register_node(NodeRecord("steady"), lease_ttl_ms=300)
        client.publish("steady", lease, "t", host_entries(KEYS[:1]))
        for _ in range(8):
            time.sleep(0.1)
            client.heartbeat("steady", lease)
        assert client.lookup("t", KEYS).prefix_length == 1


def test_event_stream_resumes_from_a_sequence_number_and_signals_gaps(tmp_path):
    with running_server(tmp_path, max_events=5) as server, client_for(server) as client:
        lease, _ = client.register_node(NodeRecord("n"))
        client.publish("n", lease, "t", host_entries(KEYS[:3]))
        assert [e.seq for e in islice(client.watch_events(from_seq=2), 2)] == [2, 3]
        client.publish("n", lease, "t", host_entries(KEYS[3:10]))  # seq 4..10; only 6..10 kept
        events = list(islice(client.watch_events(from_seq=2), 3))
        assert (events[0].kind, events[0].seq) == (pb.Event.KIND_GAP, 5)
        assert [e.seq for e in events[1:]] == [6, 7]
        tenant_only = client.watch_events(from_seq=6, tenant="t")
        assert next(tenant_only).tenant == "t"
        tenant_only.close()


def test_restart_keeps_published_keys_and_nodes_but_not_expired_leases(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        long, _ = client.register_node(NodeRecord("durable", tcp_address="h:1"), 60_000)
        short, _ = client.register_node(NodeRecord("fleeting"), 300)
        client.publish("durable", long, "t", host_entries(KEYS[:5]))
        client.publish("fleeting", short, "t", host_entries(KEYS[:8], "disk"))
    time.sleep(0.5)  # the short lease runs out while the service is down
    with running_server(tmp_path) as server, client_for(server) as client:
        result = client.lookup("t", KEYS)
        assert result.prefix_length == 5
        assert {h.node_id for per_key in result.holders for h in per_key} == {"durable"}
        assert [n.node.node_id for n in client.stats().nodes] == ["durable"]
        client.heartbeat("durable", long)
        with pytest.raises(LeaseError):
            client.heartbeat("durable", long + 99)


def test_health_and_metrics_endpoints(tmp_path):
    with (
        running_server(tmp_path, metrics_listen="127.0.0.1:0") as server,
        client_for(server) as client,
    ):
        assert health_status(f"127.0.0.1:{server.port}") == "SERVING"
        assert health_status(f"127.0.0.1:{server.port}", "kvstore.v1.Metadata") == "SERVING"
        lease, _ = client.register_node(NodeRecord("n"))
        client.publish("n", lease, "t", host_entries(KEYS[:4]))
        client.lookup("t", KEYS[:8], chunk_tokens=256)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        for line in (
            'kvstore_metadata_rpcs_total{code="OK",method="Lookup"} 1.0',
            'kvstore_metadata_lookup_chunks_total{result="hit"} 4.0',
            'kvstore_metadata_lookup_tokens_total{result="asked"} 2048.0',
            'kvstore_metadata_blocks{tier="host"} 4.0',
            "kvstore_metadata_nodes_alive 1.0",
            'kvstore_metadata_events_total{kind="stored"} 4.0',
        ):
            assert line in text, line
        assert "kvstore_metadata_rpc_latency_seconds_bucket" in text


def test_stats_reports_nodes_and_blocks(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        lease, _ = client.register_node(NodeRecord("n", tier_capacity_bytes={"host": 1 << 30}))
        client.publish("n", lease, "t", host_entries(KEYS[:2]) + host_entries(KEYS[:1], "disk"))
        stats = client.stats()
        assert (stats.blocks, stats.backend, stats.last_event_seq) == (3, "lmdb", 3)
        assert dict(stats.nodes[0].blocks_per_tier) == {"host": 2, "disk": 1}
        assert stats.nodes[0].node.tier_capacity_bytes["host"] == 1 << 30
