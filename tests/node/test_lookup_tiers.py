"""A lookup says where each leading key is, on real node agents: this host's arena ('host'), its
disk tier ('disk'), another host ('remote'); the keys after them are absent. And a disk tier
throttled by the agent's `disk_read_bytes_per_s` (the slow disk of the load-or-recompute tests)
really reads that slowly."""

import time

import pytest

from kvstore.client import KVStoreClient, LookupCounts
from kvstore.errors import ConfigError
from kvstore.keys import Namespace, chunk_keys
from kvstore.node.agent import NodeConfig
from tests.metadata.servers import running_server, wait_until
from tests.node.agents import running_agent
from tests.node.test_client import PAYLOAD, save_chain

KEYS = chunk_keys(Namespace("sha256:model", "layout"), range(256 * 8), 256)
SMALL_HOST = {"host_capacity_bytes": 4 << 20, "host_policy": "lru"}  # 4 pages of 1 MiB


def save_in_two(client) -> None:
    """6 blocks into 4 host pages: the first 2 go down to disk."""
    for start in (0, 3):
        assert save_chain(client, KEYS[start : start + 3]) == 3


def test_a_lookup_names_host_and_disk_per_key(tmp_path):
    with running_agent(tmp_path, disk_dir=tmp_path / "disk", **SMALL_HOST) as agent:
        with KVStoreClient(agent.config.socket_path) as client:
            save_in_two(client)
            counts = client.lookup("t", KEYS)
            assert counts == LookupCounts(local=6, remote=0)
            assert counts.codes == "ddhhhh"
            assert counts.tier_names() == ("disk",) * 2 + ("host",) * 4
            assert client.lookup("other-tenant", KEYS).codes == ""  # not its blocks: absent


def test_a_lookup_names_remote_keys_after_local_ones(tmp_path):
    with running_server(tmp_path) as server:
        common = {"metadata_address": f"127.0.0.1:{server.port}", "transfer": "tcp"}
        with (
            running_agent(tmp_path, "node-a", **common) as holder,
            running_agent(tmp_path, "node-b", **common) as reader,
        ):
            with KVStoreClient(holder.config.socket_path) as client:
                save_chain(client, KEYS[:4])
            with KVStoreClient(reader.config.socket_path) as client:
                save_chain(client, KEYS[:1])
                assert wait_until(lambda: client.lookup("t", KEYS).total == 4)
                counts = client.lookup("t", KEYS)
                assert (counts.local, counts.remote, counts.codes) == (1, 3, "hrrr")
                assert client.lookup("t", KEYS, local_only=True).codes == "h"


def test_counts_without_codes_read_local_keys_as_host():
    """An agent older than the field answers no codes: its local hits count as host."""
    assert LookupCounts(2, 1).tier_names() == ("host", "host", "remote")


def test_a_throttled_disk_reads_at_its_rate(tmp_path):
    rate_bytes_per_s = 1 << 20
    settings = {"disk_dir": tmp_path / "disk", "disk_read_bytes_per_s": rate_bytes_per_s}
    with running_agent(tmp_path, **SMALL_HOST, **settings) as agent:
        with KVStoreClient(agent.config.socket_path) as client:
            save_in_two(client)
            assert client.lookup("t", KEYS).codes == "ddhhhh"
            started = time.perf_counter()
            loaded = client.load("t", KEYS[:2])  # both promoted from disk to the arena
            elapsed_s = time.perf_counter() - started
            client.release(loaded)
            assert len(loaded) == 2
            assert elapsed_s >= 2 * PAYLOAD / rate_bytes_per_s
            assert client.lookup("t", KEYS[:2]).codes == "hh"  # now in the arena


def test_a_negative_disk_rate_is_refused():
    with pytest.raises(ConfigError, match="disk_read_bytes_per_s"):
        NodeConfig(disk_read_bytes_per_s=-1)
