"""The Snapshot RPC on a real metadata service: a tenant's keys with their live holders in pages,
the seq to resume watching from, the cap that cuts it short, and tenant scoping."""

import pytest

from kvstore.errors import ConfigError, PermissionDeniedError
from kvstore.metadata.index import BlockEntry, NodeRecord
from tests.metadata.servers import client_for, running_server

ADMIN = "admin-token-0123456789"
ALICE = "alice-token-0123456789"
KEYS = [index.to_bytes(16, "big") for index in range(3000)]


def publish(client, node_id: str, tenant: str, keys, tier: str = "host") -> int:
    lease, _ = client.register_node(NodeRecord(node_id, tcp_address=f"{node_id}:1"), 60_000)
    client.publish(node_id, lease, tenant, [BlockEntry(key, tier) for key in keys])
    return lease


def test_a_snapshot_pages_every_key_with_its_holders_and_the_seq_to_resume_from(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        publish(client, "n1", "t", KEYS)
        lease = publish(client, "n2", "t", KEYS[:10], tier="disk")
        publish(client, "n3", "other", KEYS[:5])
        pages = list(client.snapshot("t"))
        assert [len(page.keys) for page in pages] == [1024, 1024, 952]
        assert {page.last_seq for page in pages} == {client.stats().last_event_seq}
        first = pages[0]
        assert {(h.node_id, h.tier) for h in first.holders.holders[0]} == {
            ("n1", "host"), ("n2", "disk"),
        }  # fmt: skip
        assert first.holders.addresses["n2"] == ("n2:1", "")
        assert sorted(k for page in pages for k in page.keys) == KEYS
        client.deregister_node("n2", lease)
        assert all(len(h) == 1 for page in client.snapshot("t") for h in page.holders.holders)


def test_max_keys_cuts_the_snapshot_short_and_says_so(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        publish(client, "n1", "t", KEYS[:50])
        pages = list(client.snapshot("t", max_keys=20))
        assert sum(len(page.keys) for page in pages) == 20 and pages[-1].truncated
        assert not list(client.snapshot("t", max_keys=50))[-1].truncated


def test_an_empty_index_still_gives_the_seq(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        (page,) = client.snapshot("t")
        assert page.keys == [] and page.last_seq == 0 and page.incarnation != 0


def test_a_tenant_token_copies_only_its_own_tenant(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} *\n{ALICE} alice\n")
    with running_server(tmp_path, token_file=tokens) as server:
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
