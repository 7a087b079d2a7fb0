"""The Snapshot RPC on a real metadata service over every backend: a tenant's keys with their
live holders in pages, the seq to resume watching from, the cap that cuts it short, tenant scoping;
and a copy taken while nodes write that, with the events after its seq, is the index's state."""

import threading
import uuid

import pytest

from kvstore.errors import CapacityError, ConfigError, PermissionDeniedError
from kvstore.metadata.index.redis_index import RedisIndex
from kvstore.metadata.records import BlockEntry, NodeRecord
from tests.metadata.conftest import FakeClock, make_index, url_for
from tests.metadata.servers import client_for, running_server, wait_until

ADMIN = "admin-token-0123456789"
ALICE = "alice-token-0123456789"
KEYS = [index.to_bytes(16, "big") for index in range(3000)]
BACKENDS = ["lmdb", "memory", "redis", "redis-cluster"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def settings(backend, request) -> dict:
    """running_server settings for `backend`: redis ones on a fresh prefix (an empty index)."""
    url = url_for(backend, request)
    redis = {"redis_url": url, "redis_prefix": f"snap-{uuid.uuid4().hex[:8]}"} if url else {}
    return {"backend": backend, **redis}


def publish(client, node_id: str, tenant: str, keys, tier: str = "host") -> int:
    lease, _ = client.register_node(NodeRecord(node_id, tcp_address=f"{node_id}:1"), 60_000)
    client.publish(node_id, lease, tenant, [BlockEntry(key, tier) for key in keys])
    return lease


def test_a_snapshot_pages_every_key_with_its_holders_and_the_seq_to_resume_from(tmp_path, settings):
    with running_server(tmp_path, **settings) as server, client_for(server) as client:
        publish(client, "n1", "t", KEYS)
        lease = publish(client, "n2", "t", KEYS[:10], tier="disk")
        publish(client, "n3", "other", KEYS[:5])
        pages = list(client.snapshot("t"))
        assert [len(page.keys) for page in pages] == [1024, 1024, 952]
        assert {page.last_seq for page in pages} == {client.stats().last_event_seq}
        page = next(page for page in pages if KEYS[0] in page.keys)  # pages in no set order
        holders = page.holders.holders[page.keys.index(KEYS[0])]
        assert {(h.node_id, h.tier) for h in holders} == {("n1", "host"), ("n2", "disk")}
        assert page.holders.addresses["n2"] == ("n2:1", "")
        assert sorted(k for page in pages for k in page.keys) == KEYS
        client.deregister_node("n2", lease)
        assert all(len(h) == 1 for page in client.snapshot("t") for h in page.holders.holders)


def test_max_keys_cuts_the_snapshot_short_and_says_so(tmp_path, settings):
    with running_server(tmp_path, **settings) as server, client_for(server) as client:
        publish(client, "n1", "t", KEYS[:50])
        pages = list(client.snapshot("t", max_keys=20))
        assert sum(len(page.keys) for page in pages) == 20 and pages[-1].truncated
        assert not list(client.snapshot("t", max_keys=50))[-1].truncated


def test_an_empty_index_still_gives_the_seq(tmp_path, settings):
    with running_server(tmp_path, **settings) as server, client_for(server) as client:
        (page,) = client.snapshot("t")
        assert page.keys == [] and page.last_seq == 0 and page.incarnation != 0


def test_a_tenant_token_copies_only_its_own_tenant(tmp_path, settings):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} *\n{ALICE} alice\n")
    with running_server(tmp_path, token_file=tokens, **settings) as server:
        with client_for(server, token=ADMIN) as admin:
            publish(admin, "n1", "alice", KEYS[:3])
            publish(admin, "n2", "bob", KEYS[:3])
            assert {page.tenant for page in admin.snapshot("")} == {"alice", "bob"}
        with client_for(server, token=ALICE) as alice:
            assert sum(len(page.keys) for page in alice.snapshot("alice")) == 3
            with pytest.raises(PermissionDeniedError):
                list(alice.snapshot("bob"))
            with pytest.raises(PermissionDeniedError):
                list(alice.snapshot(""))
            with pytest.raises(ConfigError):
                list(alice.snapshot("not a tenant!"))


def test_a_copy_taken_while_nodes_write_plus_the_events_after_its_seq_is_the_index(
    tmp_path, backend, request
):
    """Redis copies page by page while scripts run between pages: replaying the events after
    the copy's seq must still give exactly the index's state."""
    index = make_index(backend, tmp_path, FakeClock(), url_for(backend, request))
    try:
        leases = {n: index.register_node(NodeRecord(n), 60_000).lease_id for n in ("n1", "n2")}
        index.publish("n1", leases["n1"], "t", [BlockEntry(k, "host") for k in KEYS])
        stop = threading.Event()
        writer = threading.Thread(target=churn, args=(index, leases, stop))
        writer.start()
        try:
            copies = [index.snapshot("t") for _ in range(3)]
        finally:
            stop.set()
            writer.join()
        final = held(index.snapshot("t"))
        assert final  # the writer left keys behind
        for copy in copies:
            state = held(copy)
            for event in index.events_since(copy[0] + 1, 10**6).events:
                change = state.add if event.kind == "stored" else state.discard
                change((event.tenant, event.key, event.node_id, event.tier))
            assert state == final
    finally:
        index.close()


def churn(index, leases, stop: threading.Event) -> None:
    """Move keys between nodes and tiers in small batches until told to stop."""
    step = 0
    while not stop.is_set() or step < 4:
        batch = KEYS[(step * 97) % 2900 :][:100]
        node = ("n1", "n2")[step % 2]
        index.publish(node, leases[node], "t", [BlockEntry(k, "disk") for k in batch])
        index.unpublish("n1", leases["n1"], "t", [BlockEntry(k, "host") for k in batch[::2]])
        step += 1


def held(copy) -> set[tuple]:
    _, nodes, tenants = copy
    return {
        (tenant, key, h.node_id, h.tier)
        for tenant, items in tenants
        for key, holders in items
        for h in holders
        if h.node_id in nodes
    }


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
def test_redis_replicas_agree_on_the_incarnation_and_a_redis_that_lost_the_index_has_a_new_one(
    tmp_path, backend, request
):
    url = url_for(backend, request)
    first = make_index(backend, tmp_path, FakeClock(), url)
    prefix = first._prefix.strip(b"{}").decode()
    second = RedisIndex(url, prefix=prefix, cluster=backend == "redis-cluster")
    try:
        incarnation = first.incarnation
        assert incarnation != 0 and second.incarnation == incarnation == first.incarnation
        first.publish(
            "n1",
            first.register_node(NodeRecord("n1"), 60_000).lease_id,
            "t",
            [BlockEntry(KEYS[0], "host")],
        )
        lose_everything(first)  # as FLUSHALL, or a restart without persistence, would
        assert second.incarnation not in (0, incarnation)
        assert first.incarnation == second.incarnation
        assert first.snapshot("t") == (0, {}, [])
    finally:
        first.close()
        second.close()


def lose_everything(index) -> None:
    """Delete every key of the index's prefix, on the master that holds them."""

    def delete(client) -> None:
        for name in list(client.scan_iter(match=index._prefix + b":*")):
            client.delete(name)

    index._link.call(delete)


def test_snapshot_streams_take_the_tenant_tokens_stream_slots(tmp_path):
    """An open Snapshot holds a whole copy of its tenant's index in the service: it takes a
    stream slot like WatchEvents (any number could be opened, and left unread)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} *\n{ALICE} alice\n")
    with running_server(tmp_path, token_file=tokens, max_watch_streams_per_tenant=2) as server:
        with client_for(server, token=ADMIN) as admin:
            lease, _ = admin.register_node(NodeRecord("n"))
            admin.publish("n", lease, "alice", [BlockEntry(k, "host") for k in KEYS[:10]])
        with client_for(server, token=ALICE) as alice:
            watches = [alice.open_events(tenant="alice") for _ in range(2)]
            assert wait_until(lambda: server.streams.slots.open_count("alice") == 2)
            with pytest.raises(CapacityError, match=r"streams \(WatchEvents, Snapshot\)"):
                next(alice.snapshot("alice"))
            watches.pop().cancel()
            assert wait_until(lambda: _snapshot_opens(alice))  # a slot is free again
            assert wait_until(lambda: server.streams.slots.open_count("alice") == 1)  # given back
            watches.pop().cancel()


def _snapshot_opens(client) -> bool:
    try:
        return next(client.snapshot("alice", max_keys=1)).keys != []
    except CapacityError:
        return False
