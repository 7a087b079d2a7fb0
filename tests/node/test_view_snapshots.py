"""ClusterView loading snapshots, against a real in-memory index and the service's own pager
(kvstore.metadata.wire): a snapshot of several tenants cut inside one the view does not follow
marks the view overflowed (it answered a trusted 0 for the later tenants' keys, which it never
got); a reset forgets departed nodes' addresses."""

from kvstore.metadata import wire
from kvstore.metadata.client import SnapshotPage, lookup_result
from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.node.view import ClusterView


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def load_snapshot(view: ClusterView, index: MemoryIndex, max_keys: int) -> None:
    view.reset()
    for page in wire.snapshot_pages(index.snapshot(""), max_keys, 1024, index.incarnation):
        holders = lookup_result(page.holders)
        view.load(
            SnapshotPage(
                page.last_seq,
                page.tenant,
                list(page.keys),
                holders,
                page.truncated,
                page.incarnation,
            )
        )
    view.synced()


def test_a_snapshot_cut_inside_a_tenant_the_view_ignores_leaves_it_overflowed():
    index = MemoryIndex()
    lease = index.register_node(NodeRecord("n2", tcp_address="n2:1"), 60_000).lease_id
    index.publish("n2", lease, "a", [BlockEntry(key(i), "host") for i in range(10)])
    index.publish("n2", lease, "b", [BlockEntry(key(100), "host")])
    view = ClusterView("n1", frozenset({"b", "c"}), max_keys=4)  # two tenants: snapshot of all
    load_snapshot(view, index, max_keys=4)  # cut inside "a": "b" never arrives
    assert view.holders("b", key(100)) == set() and view.overflowed
    assert view.remote_prefix("b", [key(100)]) is None  # ask the service, not a trusted 0


def test_a_reset_forgets_the_addresses_of_nodes_that_left():
    view = ClusterView("n1", frozenset({"*"}), max_keys=100)
    view.learn_addresses({f"gone-{i}": (f"10.0.0.{i}:1", "") for i in range(100)})
    index = MemoryIndex()
    lease = index.register_node(NodeRecord("n2", tcp_address="n2:1"), 60_000).lease_id
    index.publish("n2", lease, "t", [BlockEntry(key(1), "host")])
    load_snapshot(view, index, max_keys=100)
    assert view.plan("t", [key(1)], ucx=False) == [("n2", "n2:1")]  # relearned from the pages
    assert set(view._addresses) == {"n2"}, "the 100 departed nodes' addresses were kept"


def test_the_feed_copies_each_followed_tenant_so_the_cap_counts_only_theirs(tmp_path):
    """A view of tenants b and c asked the service for every tenant's keys, cut at the
    view's cap: tenant a's keys (which the view ignores) spent it, b's keys never came, and
    the view overflowed. Each followed tenant is copied on its own now, within what is left
    of the cap (a real metadata service on loopback)."""
    from kvstore.node.view_feed import ViewFeed
    from tests.metadata.servers import client_for, running_server

    with running_server(tmp_path) as server, client_for(server) as client:
        lease, _ = client.register_node(NodeRecord("n2", tcp_address="n2:1"))
        client.publish("n2", lease, "a", [BlockEntry(key(i), "host") for i in range(10)])
        client.publish("n2", lease, "b", [BlockEntry(key(100), "host")])
        view = ClusterView("n1", frozenset({"b", "c"}), max_keys=4)
        feed = ViewFeed(client, view)
        feed._resync()
        assert view.holders("b", key(100)) == {("n2", "host")} and not view.overflowed
        assert feed.seq == 11  # the service's seq when b and c were copied

        capped = ClusterView("n1", frozenset({"a", "b"}), max_keys=4)
        ViewFeed(client, capped)._resync()  # a's 10 keys fill the cap; b is not copied
        assert capped.keys == 4 and capped.overflowed
        assert capped.remote_prefix("b", [key(100)]) is None  # asks the service
