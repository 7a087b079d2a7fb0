"""WatchEvents on a live service: open streams never starve unary RPCs, a tenant's streams are
capped, and any resume sequence yields ordered events (or a gap first), never a dead server."""

import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.v1 import metadata_pb2 as pb
from kvstore.v1 import metadata_pb2_grpc as pb_grpc
from tests.metadata.servers import client_for, running_server, wait_until

ADMIN = "admin-token-0123456789"
TENANTS = [f"tenant{i}" for i in range(4)]
TOKENS = {tenant: f"{tenant}-token-0123456789" for tenant in TENANTS}
KEYS = [i.to_bytes(16, "big") for i in range(64)]


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    lines = [f"{ADMIN} *"] + [f"{token} {tenant}" for tenant, token in TOKENS.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def open_stream(channel, token, tenant, from_seq=1, timeout_s=20.0):
    stub = pb_grpc.MetadataStub(channel)
    request = pb.WatchEventsRequest(from_seq=from_seq, tenant=tenant)
    return stub.WatchEvents(
        request, timeout=timeout_s, metadata=(("authorization", f"Bearer {token}"),)
    )


def test_64_open_streams_do_not_delay_heartbeats(tmp_path, token_file):
    """Regression: each stream held one of 32 handler threads; heartbeats queued behind them,
    leases expired and every node's holdings were purged."""
    with (
        running_server(tmp_path, token_file=token_file) as server,
        client_for(server, token=ADMIN, timeout_s=2.0) as admin,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        lease, _ = admin.register_node(NodeRecord("n"), lease_ttl_ms=60_000)
        for tenant in TENANTS:
            admin.publish("n", lease, tenant, [BlockEntry(KEYS[0], "host")])
        streams = [open_stream(channel, TOKENS[t], t) for t in TENANTS for _ in range(16)]
        time.sleep(0.5)  # let every stream reach its handler
        latencies_s = []
        for _ in range(5):
            started = time.perf_counter()
            admin.heartbeat("n", lease)
            latencies_s.append(time.perf_counter() - started)
        assert max(latencies_s) < 0.5, latencies_s
        assert all(next(s).kind == pb.Event.KIND_STORED for s in streams), "all 64 are served"
        for stream in streams:
            stream.cancel()


def test_a_tenant_past_its_stream_cap_is_refused_naming_the_cap(tmp_path, token_file):
    with (
        running_server(tmp_path, token_file=token_file, max_watch_streams_per_tenant=2) as server,
        client_for(server, token=ADMIN) as admin,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        lease, _ = admin.register_node(NodeRecord("n"))
        for tenant in TENANTS[:2]:
            admin.publish("n", lease, tenant, [BlockEntry(KEYS[0], "host")])
        mine = [open_stream(channel, TOKENS["tenant0"], "tenant0") for _ in range(2)]
        assert all(next(s).seq == 1 for s in mine)
        with pytest.raises(grpc.RpcError) as refused:
            next(open_stream(channel, TOKENS["tenant0"], "tenant0"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit is 2 per tenant (max_watch_streams_per_tenant)" in refused.value.details()
        assert next(open_stream(channel, TOKENS["tenant1"], "tenant1")).seq == 2, "others may"
        mine[0].cancel()
        assert wait_until(lambda: server.streams.slots.open_count("tenant0") == 1)
        assert next(open_stream(channel, TOKENS["tenant0"], "tenant0")).seq == 1


def test_node_agents_streams_have_their_own_cap_beyond_a_tenants(tmp_path, token_file):
    """Every node agent's view holds one all-tenant stream: a tenant's cap must not bound them."""
    caps = {"max_watch_streams_per_tenant": 2, "max_watch_streams_all_tenants": 20}
    with (
        running_server(tmp_path, token_file=token_file, **caps) as server,
        client_for(server, token=ADMIN) as admin,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        lease, _ = admin.register_node(NodeRecord("n"))
        admin.publish("n", lease, TENANTS[0], [BlockEntry(KEYS[0], "host")])
        agents = [open_stream(channel, ADMIN, "") for _ in range(20)]
        assert all(next(s).seq == 1 for s in agents)
        with pytest.raises(grpc.RpcError) as refused:
            next(open_stream(channel, ADMIN, ""))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(max_watch_streams_all_tenants)" in refused.value.details()
        for stream in agents:
            stream.cancel()


# ---- resume sequences, fuzzed ------------------------------------------------------------
RETAINED = 20  # the ring keeps seqs 31..50 of the 50 events published below
PUBLISHED = 50


@pytest.fixture(scope="module")
def ring_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("watch"), max_events=RETAINED) as server:
        with client_for(server) as client:
            lease, _ = client.register_node(NodeRecord("n"), lease_ttl_ms=600_000)
            for start in range(0, PUBLISHED, 10):
                tenant = "even" if start % 20 == 0 else "odd"
                entries = [BlockEntry(k, "host") for k in KEYS[start : start + 10]]
                client.publish("n", lease, tenant, entries)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, channel


def read_events(stream, count: int) -> tuple[list, grpc.StatusCode]:
    """Up to `count` events, or fewer when the stream's deadline passes."""
    received = []
    try:
        for event in stream:
            received.append(event)
            if len(received) >= count:
                break
    except grpc.RpcError as exc:
        return received, exc.code()
    finally:
        stream.cancel()
    return received, grpc.StatusCode.OK


EDGES = [0, 1, 29, 30, 31, 32, 49, 50, 51, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    from_seq=st.sampled_from(EDGES) | st.integers(0, 2**64 - 1) | st.integers(0, 60),
    tenant=st.sampled_from(["", "even", "odd", "nobody"]),
)
def test_any_resume_sequence_yields_ordered_events_or_a_gap_first(ring_server, from_seq, tenant):
    _, channel = ring_server
    oldest = PUBLISHED - RETAINED + 1
    gap = 0 < from_seq < oldest
    first = max(from_seq, oldest)
    wanted = [s for s in range(first, PUBLISHED + 1) if not tenant or tenant == _tenant_of(s)]
    if from_seq == 0:
        wanted = []  # only events newer than the request: none are published meanwhile
    expected = int(gap) + len(wanted)
    # A stream that owes nothing must stay silent (short deadline); others stop when complete.
    timeout_s = 5.0 if expected else 0.2
    stream = open_stream(channel, ADMIN, tenant, from_seq=from_seq, timeout_s=timeout_s)
    received, code = read_events(stream, max(expected, 1))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED), code
    assert len(received) == expected
    if gap:
        assert (received[0].kind, received[0].seq) == (pb.Event.KIND_GAP, oldest - 1)
        received = received[1:]
    assert [e.seq for e in received] == wanted, "in order, from from_seq, none missing"
    assert all(e.kind == pb.Event.KIND_STORED for e in received)


def _tenant_of(seq: int) -> str:
    return "even" if (seq - 1) // 10 % 2 == 0 else "odd"


def test_the_server_still_answers_after_the_fuzzed_streams(ring_server):
    server, _ = ring_server
    with client_for(server) as client:
        assert client.stats().last_event_seq == PUBLISHED
    assert wait_until(lambda: server.streams.slots.open_count("*") == 0), "every slot was released"


def test_a_stream_sees_events_published_after_it_opened(ring_server):
    server, channel = ring_server
    stream = open_stream(channel, ADMIN, "late", from_seq=0, timeout_s=5)
    got = []
    reader = threading.Thread(target=lambda: got.append(next(stream)))
    reader.start()
    time.sleep(0.2)
    with client_for(server) as client:
        lease, _ = client.register_node(NodeRecord("late-node"), lease_ttl_ms=600_000)
        client.publish("late-node", lease, "late", [BlockEntry(KEYS[63], "disk")])
    reader.join(timeout=5)
    stream.cancel()
    assert got and (got[0].tenant, got[0].tier) == ("late", pb.TIER_DISK)
