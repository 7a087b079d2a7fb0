"""A real node agent over a slow disk: one worker's load of a block on disk waits for the
disk; other workers' lookups, saves and loads from the arena do not wait with it; and a save
into a full arena finds free pages, the demotion thread writing victims down meanwhile."""

import threading
import time

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, chunk_keys
from kvstore.node import demotion
from kvstore.node.agent import NodeAgent, NodeConfig
from kvstore.owned import owned_key, owned_keys
from tests.metadata.servers import running_server, wait_until
from tests.node.agents import running_agent
from tests.node.test_client import PAYLOAD, save_chain

KEYS = chunk_keys(Namespace("sha256:model", "layout"), range(256 * 40), 256)
READ_S = 0.8  # one block from the disk


def test_a_load_from_a_slow_disk_does_not_stall_other_workers(tmp_path):
    settings = {
        "disk_dir": tmp_path / "disk",
        "host_capacity_bytes": 8 << 20,
        "host_policy": "lru",
        "disk_read_bytes_per_s": int(PAYLOAD / READ_S),
    }
    with running_agent(tmp_path, **settings) as agent:
        with (
            KVStoreClient(agent.config.socket_path, "slow") as slow,
            KVStoreClient(agent.config.socket_path, "other") as other,
        ):
            for start in (0, 4, 8):  # 8 host pages: the first 4 blocks go down to disk
                save_chain(slow, KEYS[start : start + 4], fill=lambda i, s=start: s + i + 1)
            assert agent.store.tier_of(owned_key("t", KEYS[0])) == "disk"
            loads = []
            thread = threading.Thread(target=lambda: loads.append(slow.load("t", KEYS[:1])))
            thread.start()
            time.sleep(READ_S / 4)  # the slow worker's disk read is under way
            started = time.perf_counter()
            assert other.lookup("t", KEYS[8:12]).total == 4
            assert save_chain(other, KEYS[12:14], fill=lambda i: 13 + i) == 2
            loaded = other.load("t", KEYS[13:14])
            assert [int(view[0]) for view in loaded.payloads] == [14]
            other.release(loaded)
            others_s = time.perf_counter() - started
            thread.join()
            assert others_s < READ_S / 3, f"the other worker waited {others_s:.3f} s for the disk"
            (promoted,) = loads
            assert [int(view[0]) for view in promoted.payloads] == [1]
            assert agent.store.tier_of(owned_key("t", KEYS[0])) == "host"
            slow.release(promoted)


def test_a_save_into_a_full_arena_does_not_wait_for_a_slow_disk_write(tmp_path):
    """The demotion thread keeps 2 of the 8 arena pages free, writing victims down at its own
    pace; a save takes those pages at once instead of evicting through the slow disk."""
    settings = {
        "disk_dir": tmp_path / "disk",
        "host_capacity_bytes": 8 << 20,
        "host_policy": "lru",
        "host_free_pages": 2,
        "disk_write_bytes_per_s": int(PAYLOAD / READ_S),
    }
    with running_agent(tmp_path, **settings) as agent:
        host = agent.store.slots[0].tier
        with KVStoreClient(agent.config.socket_path, "writer") as writer:
            for start in (0, 4):
                save_chain(writer, KEYS[start : start + 4], fill=lambda i, s=start: s + i + 1)
                assert wait_until(lambda: host.free_pages >= 2, timeout_s=10)
            started = time.perf_counter()
            assert save_chain(writer, KEYS[8:10], fill=lambda i: 9 + i) == 2
            save_s = time.perf_counter() - started
            assert save_s < READ_S / 3, f"the save waited {save_s:.3f} s for the disk"
            assert wait_until(lambda: host.free_pages >= 2, timeout_s=10)
            assert (
                agent.demotion.written >= 4 and agent.store.lookup(owned_keys("t", KEYS[:10])) == 10
            )
            loaded = writer.load("t", KEYS[:10])  # the demoted ones come back from disk
            values = [int(view[0]) for view in loaded.payloads]
            assert len(values) >= 6 and values == list(range(1, len(values) + 1))
            writer.release(loaded)


def test_a_load_joins_the_fetch_another_worker_has_under_way(tmp_path):
    """Two workers of one host load a prefix another host holds on its slow disk: the second
    waits for the blocks the first is already receiving (each is fetched once) instead of
    finding them half-written and computing the whole prefix."""
    holder_settings = {
        "disk_dir": tmp_path / "disk",
        "host_capacity_bytes": 8 << 20,
        "host_policy": "lru",
        "disk_read_bytes_per_s": int(PAYLOAD / READ_S),
    }
    with running_server(tmp_path) as server:
        address = f"127.0.0.1:{server.port}"
        with (
            running_agent(
                tmp_path, "holder", metadata_address=address, transfer="tcp", **holder_settings
            ) as holder,
            running_agent(tmp_path, "reader", metadata_address=address, transfer="tcp") as reader,
        ):
            with KVStoreClient(holder.config.socket_path, "w") as writer:
                for start in (0, 4, 8):  # the first 4 blocks go down to the holder's disk
                    save_chain(writer, KEYS[start : start + 4], fill=lambda i, s=start: s + i + 1)
            assert holder.store.tier_of(owned_key("t", KEYS[0])) == "disk"
            with (
                KVStoreClient(reader.config.socket_path, "first") as first,
                KVStoreClient(reader.config.socket_path, "second") as second,
            ):
                assert wait_until(lambda: second.lookup("t", KEYS[:2]).remote == 2, timeout_s=10)
                loads = []
                thread = threading.Thread(target=lambda: loads.append(first.load("t", KEYS[:2])))
                thread.start()
                assert wait_until(lambda: reader.store.writes_pending(), timeout_s=READ_S)
                joined = second.load("t", KEYS[:2])
                thread.join()
                for loaded in (*loads, joined):
                    assert [int(view[0]) for view in loaded.payloads] == [1, 2]
                assert reader.fetcher.stats.blocks == 2, "each block is fetched once"
                first.release(loads[0])
                second.release(joined)


def test_an_agent_stops_promptly_while_the_disk_hangs_in_a_demotion(tmp_path, monkeypatch):
    """A block write that does not return (a hung disk) holds the agent's stop no longer than
    the demotion thread's stop timeout, and the disk tier is left open under that write."""
    monkeypatch.setattr(demotion, "STOP_S", 0.3)
    settings = {
        "disk_dir": tmp_path / "disk",
        "host_capacity_bytes": 8 << 20,
        "host_policy": "lru",
        "host_free_pages": 2,
        "disk_write_bytes_per_s": int(PAYLOAD / 4),
    }  # 4 s a block
    agent = NodeAgent(
        NodeConfig(
            node_id="hung",
            socket_path=tmp_path / "hung.sock",
            transfer="none",
            page_size_bytes=1 << 20,
            **settings,
        )
    )
    agent.start()
    with KVStoreClient(agent.config.socket_path, "writer") as writer:
        save_chain(writer, KEYS[:8], fill=lambda i: i + 1)  # a full arena: demotion starts
    disk = agent.store.slots[1].tier
    assert wait_until(lambda: disk.used_pages > 0, timeout_s=5)  # a block is being written
    started = time.perf_counter()
    agent.stop()
    assert time.perf_counter() - started < 2, "the stop waited for the hung disk write"
    assert not disk.closed, "the disk tier was closed under the demotion's write"
