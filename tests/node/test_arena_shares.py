"""Each tenant's fair share of the arena, narrated: bob reserves pages as fast as he can from
several connections and never commits. Before, he took all 16 pages: alice's committed blocks
were evicted (to disk, where none could be promoted back, since promotion needs a free page)
and her saves reserved nothing. Now his reservations and pins stop at his share, reservations
expire, a reserve of pages is kept for promotions, and per-tenant gauges show it all."""

import time
import urllib.request

import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import CapacityError, ConfigError
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import ArenaLimits
from tests.node.agents import running_agent
from tests.node.test_trust import (
    ALICE_TOKEN,
    BOB_TOKEN,
    KEYS,
    PAYLOAD,
    credentials,
    token_file,
)

BOB_KEYS = chunk_keys(Namespace("sha256:model", "layout", tenant="bob"), range(256 * 64), 256)
PAGES = 16  # tests.node.agents.SMALL: 16 pages of 1 MiB
TTL_S = 1.5


@pytest.fixture
def crowded(tmp_path):
    """An agent with a disk tier, tenant_share 0.5 and one page kept for promotions; alice
    and three connections of bob's."""
    table = credentials(tmp_path, f"token:{ALICE_TOKEN} alice", f"token:{BOB_TOKEN} bob")
    settings = {
        "worker_credentials": table,
        "disk_dir": tmp_path / "disk",
        "host_policy": "lru",
        "tenant_share": 0.5,
        "promotion_reserve_pages": 1,
        "reservation_ttl_s": TTL_S,
        "metrics_listen": "127.0.0.1:0",
    }
    with running_agent(tmp_path, **settings) as agent:
        path = agent.config.socket_path
        alice_token, bob_token = (
            token_file(tmp_path, "alice", ALICE_TOKEN),
            token_file(tmp_path, "bob", BOB_TOKEN),
        )
        alice = KVStoreClient(path, "alice", credential_file=alice_token)
        bobs = [KVStoreClient(path, f"bob-{n}", credential_file=bob_token) for n in range(3)]
        yield agent, alice, bobs
        for client in (alice, *bobs):
            client.close()


def save(client, tenant, keys, fill=7) -> int:
    reservation = client.save(tenant, keys, PAYLOAD)
    for view in reservation.payloads:
        if view is not None:
            view.fill_(fill)
    return client.commit(reservation)


def flood(bobs) -> tuple[int, list[str]]:
    """Bob reserves one page at a time, round robin over his connections, never committing,
    until every connection is refused: (pages he got, the refusals' messages)."""
    got, refusals, key = 0, [], iter(BOB_KEYS)
    while len(refusals) < len(bobs):
        for bob in bobs:
            try:
                reservation = bob.save("bob", [next(key)], PAYLOAD)
                got += sum(view is not None for view in reservation.payloads)
            except CapacityError as exc:
                refusals.append(str(exc))
    return got, refusals


def test_bob_flooding_reservations_stops_at_his_share_and_alice_keeps_working(crowded):
    agent, alice, bobs = crowded
    assert save(alice, "alice", KEYS[:4]) == 4
    got, refusals = flood(bobs)
    assert got == PAGES // 2, "bob holds half the arena while alice uses it"
    assert all("its share" in message for message in refusals)
    loaded = alice.load("alice", KEYS[:4])
    assert len(loaded) == 4, "her committed blocks stay loadable"
    alice.release(loaded)
    assert save(alice, "alice", KEYS[:2], fill=9) == 0, "already hers: nothing to write"
    assert save(alice, "alice", chunk_keys_after(4), fill=9) == 3, "her saves succeed"
    tenants = agent.stats()["tenants"]
    assert tenants["pages"]["bob"]["reserved"] == PAGES // 2
    assert tenants["share_refusals"] >= len(bobs)


def chunk_keys_after(count: int, more: int = 3):
    return chunk_keys(
        Namespace("sha256:model", "layout", tenant="alice", salt="s"),
        range(256 * (count + more)),
        256,
    )[count:]


def test_alices_blocks_on_disk_can_be_promoted_while_bob_holds_his_share(crowded):
    """Her blocks went down to disk; bob holds his half; reading them needs promotions."""
    agent, alice, bobs = crowded
    keys = chunk_keys_after(0, more=12)
    assert save(alice, "alice", keys) == 12
    flood(bobs)  # his 8 reservations push 4 of her blocks down to disk
    assert agent.stats()["tenants"]["pages"]["alice"].get("stored_disk", 0) >= 4
    loaded = alice.load("alice", keys)
    assert len(loaded) == PAGES // 2, "up to her share, promoted from disk as needed"
    assert all(bool((view == 7).all()) for view in loaded.payloads)
    alice.release(loaded)


def test_uncommitted_reservations_expire_and_are_counted(crowded):
    agent, alice, bobs = crowded
    assert save(alice, "alice", KEYS[:4]) == 4
    stale = bobs[0].save("bob", BOB_KEYS[:8], PAYLOAD)
    assert sum(view is not None for view in stale.payloads) == PAGES // 2
    time.sleep(TTL_S + 0.2)
    fresh = bobs[1].save("bob", BOB_KEYS[8:12], PAYLOAD)  # room again: the stale ones went
    assert sum(view is not None for view in fresh.payloads) == 4
    assert agent.store.expired_reservations == PAGES // 2
    assert bobs[0].commit(stale) == 0, "an expired save commits nothing"
    assert bobs[1].commit(fresh) == 4
    assert bobs[0].lookup("bob", BOB_KEYS[:12]).total == 0, "the expired keys were never written"


def test_per_tenant_gauges_are_exported(crowded):
    agent, alice, bobs = crowded
    save(alice, "alice", KEYS[:3])
    bobs[0].save("bob", BOB_KEYS[:2], PAYLOAD)
    url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'kvstore_agent_tenant_pages{state="reserved",tenant="bob"} 2.0' in text
    assert 'kvstore_agent_tenant_pages{state="stored_host",tenant="alice"} 3.0' in text
    assert "kvstore_agent_share_refusals_total 0.0" in text
    assert "kvstore_agent_expired_reservations_total 0.0" in text


def test_the_node_command_takes_the_arena_settings():
    from kvstore.cli import _node_config, build_parser

    flags = [
        "node",
        "--transfer",
        "none",
        "--tenant-share",
        "0.25",
        "--reservation-ttl-s",
        "30",
        "--promotion-reserve-pages",
        "2",
    ]
    limits = _node_config(build_parser().parse_args(flags)).arena_limits()
    assert limits == ArenaLimits(
        tenant_share=0.25, promotion_reserve_pages=2, reservation_ttl_s=30.0
    )
    with pytest.raises(ConfigError, match="tenant_share"):
        _node_config(build_parser().parse_args([*flags[:3], "--tenant-share", "1.5"]))


def test_pages_are_kept_for_promotions_only_where_there_is_a_disk_to_promote_from(tmp_path):
    from kvstore.node.agent import NodeConfig

    arena = {"host_capacity_bytes": 128 << 20, "page_size_bytes": 1 << 20, "transfer": "none"}
    assert NodeConfig(**arena).arena_limits().promotion_reserve_pages == 0
    with_disk = NodeConfig(**arena, disk_dir=tmp_path / "disk").arena_limits()
    assert with_disk.promotion_reserve_pages == 2  # 1/64 of 128 pages
