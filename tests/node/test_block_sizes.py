"""Workers of two models, each with its own block size, share one node's arena through a real
agent: each block takes its own run of pages, loads read them in place at their offsets with
their checksums verified, a private worker gets verified copies, and a block larger than the
agent's largest block is refused with the setting to change."""

import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError
from kvstore.keys import Namespace, chunk_keys
from kvstore.node.agent import NodeConfig
from tests.node.agents import running_agent
from tests.node.test_trust import ALICE_TOKEN, credentials, token_file

PAGE = 64 << 10
SIZES = {"small": PAGE - 4096, "wide": 5 * PAGE - 4096}  # one page; five pages
KEYS = {
    name: chunk_keys(Namespace(f"sha256:{name}", "layout"), range(256 * 4), 256) for name in SIZES
}
ARENA = {"host_capacity_bytes": 64 * PAGE, "page_size_bytes": PAGE, "max_block_bytes": 8 * PAGE}


def save(client, name, keys):
    reservation = client.save("t", keys, SIZES[name])
    for index, view in enumerate(reservation.payloads):
        view.fill_(index + 1 if name == "small" else 100 + index)
    return client.commit(reservation)


def test_two_block_sizes_share_the_arena_and_load_verified_in_place(tmp_path):
    with running_agent(tmp_path, **ARENA) as agent, KVStoreClient(agent.config.socket_path) as c:
        assert save(c, "small", KEYS["small"][:4]) == 4
        assert save(c, "wide", KEYS["wide"][:4]) == 4
        assert agent.store.usage()["host"]["used_pages"] == 4 * 1 + 4 * 5
        for name, first in (("small", 1), ("wide", 100)):
            loaded = c.load("t", KEYS[name])  # verify=True: checksummed in this process
            assert len(loaded) == 4
            assert [int(view[-1]) for view in loaded.payloads] == [first + i for i in range(4)]
            assert all(view.numel() == SIZES[name] for view in loaded.payloads)
            c.release(loaded)


def test_a_stray_write_into_a_wide_block_ends_the_loaded_prefix(tmp_path):
    with running_agent(tmp_path, **ARENA) as agent, KVStoreClient(agent.config.socket_path) as c:
        save(c, "wide", KEYS["wide"][:3])
        loaded = c.load("t", KEYS["wide"])
        c.release(loaded)
        loaded.payloads[1][3 * PAGE] += 1  # past the block's first page
        again = c.load("t", KEYS["wide"])
        assert len(again) == 1, "the corrupt block and those after it are misses"
        c.release(again)


def test_a_private_worker_gets_verified_copies_of_wide_blocks(tmp_path):
    table = credentials(tmp_path, f"token:{ALICE_TOKEN} t")
    options = {**ARENA, "private_buffer_bytes": 16 * PAGE, "worker_credentials": table}
    with running_agent(tmp_path, **options) as agent:
        token = token_file(tmp_path, "alice", ALICE_TOKEN)
        with KVStoreClient(agent.config.socket_path, credential_file=token) as c:
            assert c.access == "private"
            save(c, "wide", KEYS["wide"][:2])
            loaded = c.load("t", KEYS["wide"])
            assert [int(view[-1]) for view in loaded.payloads] == [100, 101]
            assert all(view.numel() == SIZES["wide"] for view in loaded.payloads)
            c.release(loaded)


def test_a_block_past_the_largest_is_refused_with_the_setting_to_change(tmp_path):
    with running_agent(tmp_path, **ARENA) as agent, KVStoreClient(agent.config.socket_path) as c:
        with pytest.raises(ConfigError, match="max_block_bytes"):
            c.save("t", KEYS["wide"][:1], 8 * PAGE)
        assert agent.store.usage()["host"]["used_pages"] == 0


def test_a_largest_block_past_the_arena_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="max_block_bytes"):
        NodeConfig(
            socket_path=tmp_path / "a.sock",
            transfer="none",
            **{**ARENA, "max_block_bytes": 65 * PAGE},
        )
