"""Blocks belong to (tenant, key), narrated: bob, with his own valid credential, saves blocks
under the keys alice will compute (they derive from names he may know). Before, one block per
key answered both tenants: alice's saves were told "held" and committed nothing, her lookups
found nothing, and another node's load for her fetched none of them. Now bob's blocks are his
alone, before or after hers, on one node and across two."""

import signal

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.owned import owned_key
from tests.metadata.servers import start_cli, wait_until
from tests.node.agents import start_node_process
from tests.node.test_trust import (
    ALICE_TOKEN,
    BOB_TOKEN,
    KEYS,
    PAYLOAD,
    credentials,
    token_file,
    two_tenants,  # noqa: F401 (a fixture)
)

ALICE_KV, BOB_KV = 0xAA, 0xBB


def save(client, tenant, keys, fill) -> tuple[int, int]:
    """(pages the agent reserved, blocks committed)."""
    reservation = client.save(tenant, keys, PAYLOAD)
    reserved = [view for view in reservation.payloads if view is not None]
    for view in reserved:
        view.fill_(fill)
    return len(reserved), client.commit(reservation)


def loaded_fills(client, tenant, keys, **options) -> list[int]:
    """The fill byte of each block a load of `keys` got (every byte checked)."""
    loaded = client.load(tenant, keys, **options)
    try:
        fills = [int(view[0]) for view in loaded.payloads]
        assert all(bool((view == view[0]).all()) for view in loaded.payloads)
        return fills
    finally:
        client.release(loaded)


def test_bob_squatting_alices_keys_before_her_takes_nothing_from_her(two_tenants):  # noqa: F811
    agent, alice, bob = two_tenants
    assert save(bob, "bob", KEYS, BOB_KV) == (len(KEYS), len(KEYS))
    assert save(alice, "alice", KEYS, ALICE_KV) == (len(KEYS), len(KEYS)), "not told 'held'"
    assert alice.lookup("alice", KEYS).local == len(KEYS)
    assert loaded_fills(alice, "alice", KEYS) == [ALICE_KV] * len(KEYS)
    assert loaded_fills(bob, "bob", KEYS) == [BOB_KV] * len(KEYS)
    assert agent.store.pins_held() == 0


def test_bob_saving_alices_keys_after_her_learns_nothing_and_changes_nothing(
    two_tenants,  # noqa: F811
):
    agent, alice, bob = two_tenants
    assert save(alice, "alice", KEYS, ALICE_KV) == (len(KEYS), len(KEYS))
    # Before, bob's save was told the keys were held: an oracle of what alice cached.
    assert save(bob, "bob", KEYS, BOB_KV) == (len(KEYS), len(KEYS))
    assert loaded_fills(alice, "alice", KEYS) == [ALICE_KV] * len(KEYS)
    assert loaded_fills(bob, "bob", KEYS) == [BOB_KV] * len(KEYS)
    pages = agent.stats()["tenants"]["pages"]
    assert pages["alice"]["stored_host"] == pages["bob"]["stored_host"] == len(KEYS)


@pytest.fixture
def two_nodes(tmp_path):
    """A metadata service and two `kvstore node` processes that both serve alice and bob."""
    table = credentials(tmp_path, f"token:{ALICE_TOKEN} alice", f"token:{BOB_TOKEN} bob")
    secret = tmp_path / "cluster.secret"
    secret.write_text("the-cluster-secret-0123456789\n")
    processes = []
    metadata, address = start_cli("metadata", "--backend", "memory", "--listen", "127.0.0.1:0")
    processes.append(metadata)
    try:
        sockets = []
        for name in ("node-1", "node-2"):
            node, path = start_node_process(
                tmp_path,
                name,
                "--metadata-address",
                address,
                "--transfer",
                "tcp",
                "--cluster-secret-file",
                str(secret),
                "--worker-credentials",
                str(table),
            )
            processes.append(node)
            sockets.append(path)
        clients = {}
        for index, path in enumerate(sockets, start=1):
            for tenant, token in (("alice", ALICE_TOKEN), ("bob", BOB_TOKEN)):
                credential = token_file(tmp_path, tenant, token)
                clients[tenant, index] = KVStoreClient(
                    path, f"{tenant}-{index}", credential_file=credential
                )
        yield clients
        for client in clients.values():
            client.close()
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=20)


def test_across_two_nodes_alice_loads_her_own_blocks_where_bob_squats_on_both(two_nodes):
    clients = two_nodes
    keys = KEYS[:3]
    assert save(clients["bob", 1], "bob", keys, BOB_KV) == (3, 3)  # before alice, on her node
    assert save(clients["alice", 1], "alice", keys, ALICE_KV) == (3, 3)
    assert save(clients["bob", 2], "bob", keys, BOB_KV) == (3, 3)  # on the node she reads from
    reader = clients["alice", 2]
    assert wait_until(lambda: reader.lookup("alice", keys).remote == 3, timeout_s=10)
    # Before, node 2 took bob's blocks for hers ("arrived meanwhile") and loaded none.
    loaded = reader.load("alice", keys, timeout_s=10)
    try:
        assert (len(loaded), loaded.remote_blocks) == (3, 3)
        assert all(bool((view == ALICE_KV).all()) for view in loaded.payloads)
    finally:
        reader.release(loaded)
    assert loaded_fills(clients["bob", 2], "bob", keys) == [BOB_KV] * 3
    assert loaded_fills(clients["bob", 1], "bob", keys) == [BOB_KV] * 3


def test_the_store_names_a_tenants_block_by_its_key_and_tenant(two_tenants):  # noqa: F811
    """The agent's store holds bob's and alice's blocks of one key side by side."""
    agent, alice, bob = two_tenants
    save(alice, "alice", KEYS[:1], ALICE_KV)
    save(bob, "bob", KEYS[:1], BOB_KV)
    for tenant, fill in (("alice", ALICE_KV), ("bob", BOB_KV)):
        with agent.store.read(owned_key(tenant, KEYS[0])) as payload:
            assert torch.equal(payload, torch.full_like(payload, fill))
    assert {tenant for _, _, tenant in agent.store.inventory()} == {"alice", "bob"}
