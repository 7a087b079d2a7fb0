"""The kvstore L2 adapter, built by LMCache's own plugin factory, against real node agents:
LMCache's objects stored, found and loaded bit-exact, on one host and across two through the
metadata service; other models' keys, a changed block and a missing agent are misses."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from kvstore.client import KVStoreClient
from kvstore.connectors.lmcache.adapter import KVStoreL2Adapter
from kvstore.errors import ConfigError
from tests.lmcache.adapters import (
    build_adapter,
    load,
    lookup,
    memory_obj,
    object_keys,
    same_bytes,
    store,
)
from tests.metadata.servers import running_server, wait_until
from tests.node.agents import running_agent, start_node_process


@pytest.fixture
def agent(tmp_path):
    with running_agent(tmp_path) as agent:
        yield agent


@pytest.fixture
def adapter(agent):
    adapter = build_adapter(agent.config.socket_path)
    yield adapter
    adapter.close()


def agent_requests(agent) -> dict:
    return agent.stats()["requests"]


def test_lmcache_builds_the_adapter_from_its_l2_adapter_json(agent, adapter):
    assert isinstance(adapter, KVStoreL2Adapter)
    assert adapter.config.socket_path == str(agent.config.socket_path)
    fds = {
        adapter.get_store_event_fd(),
        adapter.get_lookup_and_lock_event_fd(),
        adapter.get_load_event_fd(),
    }
    assert len(fds) == 3, "LMCache routes completions by fd: each must be distinct"
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['socket'\] in"):
        build_adapter(agent.config.socket_path, socket="typo")
    with pytest.raises(ConfigError, match="load_timeout_s must be a number"):
        build_adapter(agent.config.socket_path, load_timeout_s="10")


def test_objects_stored_are_found_and_loaded_bit_exact(agent, adapter):
    keys, objects = object_keys(4), [memory_obj(seed) for seed in range(4)]
    result = store(adapter, keys, objects)
    assert result.is_successful() and result.bytes_transferred() == 4 * objects[0].get_size()
    assert agent_requests(agent)["saved"] == 4

    assert lookup(adapter, [*keys, *object_keys(6)[4:]]) == [0, 1, 2, 3]
    targets = [memory_obj() for _ in keys]
    assert load(adapter, keys, targets) == [0, 1, 2, 3]
    assert all(same_bytes(a, b) for a, b in zip(objects, targets, strict=True))
    assert agent_requests(agent)["load_local"] == 4
    assert agent.stats()["pins"] == 0, "a load pins only while it copies"

    again = store(adapter, keys, objects)
    assert again.is_successful() and again.bytes_transferred() == 0, "held already: no copy"
    totals = adapter.report_status()
    assert totals["is_healthy"] and totals["stored_keys"] == 4 and totals["loaded_keys"] == 4


def test_lookup_and_load_give_the_leading_chunks_of_each_object_group(adapter):
    group0, group1 = object_keys(3), object_keys(3, object_group_id=1)
    store(adapter, [group0[0], group0[2], *group1], [memory_obj(i) for i in range(5)])
    assert lookup(adapter, [*group0, *group1]) == [0, 3, 4, 5], "chunk 1 is missing"
    targets = [memory_obj() for _ in range(6)]
    assert load(adapter, [*group0, *group1], targets) == [0, 3, 4, 5]


def test_keys_of_another_model_rank_group_salt_or_tenant_never_match(agent, adapter):
    store(adapter, object_keys(2), [memory_obj(1), memory_obj(2)])
    others = [
        object_keys(2, model="another-model"),
        object_keys(2, object_group_id=1),
        object_keys(2, cache_salt="user-b"),
        [key.__class__(key.chunk_hash, key.model_name, 1) for key in object_keys(2)],
    ]
    for keys in others:
        assert lookup(adapter, keys) == []
        assert load(adapter, keys, [memory_obj(), memory_obj()]) == []
    salted = build_adapter(agent.config.socket_path, salt="deployment-b")
    try:
        assert lookup(salted, object_keys(2)) == []
    finally:
        salted.close()


def test_a_block_whose_bytes_changed_in_the_arena_is_a_miss(agent, adapter):
    keys = object_keys(2)
    store(adapter, keys, [memory_obj(1), memory_obj(2)])
    block_keys = adapter.objects.block_keys(keys)
    with KVStoreClient(agent.config.socket_path, "scribbler", pin_mapping=False) as client:
        loaded = client.load("default", block_keys[1:])
        loaded.payloads[0][100] ^= 0xFF  # a buggy worker writes into a page it only read
        client.release(loaded)
    target = memory_obj()
    assert load(adapter, keys, [memory_obj(), target]) == [0]
    assert adapter.report_status()["checksum_mismatches"] == 1


def test_a_block_of_another_size_is_a_miss(adapter):
    keys = object_keys(1)
    store(adapter, keys, [memory_obj(1, num_bytes=32 << 10)])
    assert lookup(adapter, keys) == [0]
    assert load(adapter, keys, [memory_obj()]) == []
    assert adapter.report_status()["unfit_blocks"] == 1


def test_no_agent_means_misses_and_failed_stores_until_it_comes(tmp_path):
    adapter = build_adapter(tmp_path / "node-a.sock")
    keys, objects = object_keys(2), [memory_obj(1), memory_obj(2)]
    try:
        assert not store(adapter, keys, objects).is_successful()
        assert lookup(adapter, keys) == []
        assert load(adapter, keys, [memory_obj(), memory_obj()]) == []
        assert not adapter.report_status()["is_healthy"]
        with node_process(tmp_path) as node:
            assert store(adapter, keys, objects).is_successful()
            assert lookup(adapter, keys) == [0, 1]
            node.kill()  # the agent dies with the adapter connected
            node.wait()
            assert lookup(adapter, keys) == [], "a miss, not an error"
            assert load(adapter, keys, [memory_obj(), memory_obj()]) == []
        with node_process(tmp_path):
            assert store(adapter, keys, objects).is_successful(), "connected again"
            assert adapter.report_status()["reconnects"] == 1
    finally:
        adapter.close()


@contextmanager
def node_process(tmp_path):
    """`kvstore node` at node-a.sock, as a process of its own (so it can die)."""
    node, _ = start_node_process(tmp_path, "node-a", "--transfer", "none")
    try:
        yield node
    finally:
        if node.poll() is None:
            node.terminate()
            node.wait(timeout=20)


def test_what_one_host_stored_another_loads_through_the_metadata_service(tmp_path):
    with running_server(tmp_path) as server:
        address = f"127.0.0.1:{server.port}"
        with (
            running_agent(tmp_path, "node-1", transfer="tcp", metadata_address=address) as one,
            running_agent(tmp_path, "node-2", transfer="tcp", metadata_address=address) as two,
        ):
            writer = build_adapter(one.config.socket_path)
            reader = build_adapter(two.config.socket_path)
            try:
                keys, objects = object_keys(3), [memory_obj(seed) for seed in range(3)]
                assert store(writer, keys, objects).is_successful()
                assert wait_until(lambda: lookup(reader, keys) == [0, 1, 2], timeout_s=10)
                targets = [memory_obj() for _ in keys]
                assert load(reader, keys, targets) == [0, 1, 2]
                assert all(same_bytes(a, b) for a, b in zip(objects, targets, strict=True))
                assert agent_requests(two)["load_remote"] == 3
            finally:
                writer.close()
                reader.close()
