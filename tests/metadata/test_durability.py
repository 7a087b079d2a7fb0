"""The embedded index commits to its LMDB journal before it changes memory: a journal that
fails (a full map, an injected error) leaves memory and disk agreeing on exactly what was
acknowledged, and the service answers RESOURCE_EXHAUSTED naming the setting to raise."""

import lmdb
import pytest

from kvstore.errors import CapacityError
from kvstore.metadata.index.journal import JournalWriter
from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.records import BlockEntry, NodeRecord
from tests.metadata.conftest import FakeClock
from tests.metadata.servers import client_for, running_server

KEYS = [i.to_bytes(16, "big") for i in range(4096)]


def entries(keys, tier="host"):
    return [BlockEntry(k, tier, 4096, 3) for k in keys]


def held(index, tenant="t"):
    return {k for k in KEYS if index.lookup(tenant, [k])}


def test_a_failing_journal_write_leaves_memory_without_the_batch(tmp_path, monkeypatch):
    """Regression: memory was updated before the journal, so a failed write was served until
    the next restart silently lost it."""
    clock = FakeClock()
    index = MemoryIndex(tmp_path / "meta", clock=clock)
    lease = index.register_node(NodeRecord("n"), 600_000).lease_id
    index.publish("n", lease, "t", entries(KEYS[:10]))
    before = index.stats()
    calls = {"n": 0}
    original = JournalWriter.put_holding

    def fail_on_the_fifth(self, *args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise lmdb.MapFullError("injected")
        original(self, *args)

    monkeypatch.setattr(JournalWriter, "put_holding", fail_on_the_fifth)
    with pytest.raises(CapacityError, match="lmdb_map_size_bytes"):
        index.publish("n", lease, "t", entries(KEYS[10:20]))
    assert held(index) == set(KEYS[:10]), "memory holds nothing the journal lacks"
    assert index.stats() == before and index.events_since(11, 10).events == []
    monkeypatch.undo()
    index.close()
    reopened = MemoryIndex(tmp_path / "meta", clock=clock)
    assert held(reopened) == set(KEYS[:10])
    reopened.publish("n", lease, "t", entries(KEYS[10:12]))
    assert reopened.stats()["last_event_seq"] == 12, "no seq was spent on the failed batch"
    reopened.close()


def test_a_full_map_is_resource_exhausted_and_a_restart_finds_what_was_acknowledged(tmp_path):
    acknowledged = []
    with running_server(tmp_path, lmdb_map_size_bytes=256 << 10) as server:
        with client_for(server) as client:
            lease, _ = client.register_node(NodeRecord("n"), lease_ttl_ms=600_000)
            with pytest.raises(CapacityError) as full:
                for start in range(0, len(KEYS), 256):
                    batch = KEYS[start : start + 256]
                    client.publish("n", lease, "t", entries(batch))
                    acknowledged += batch
            message = str(full.value)
            assert "RESOURCE_EXHAUSTED" in message and "262144 bytes" in message
            assert "raise lmdb_map_size_bytes" in message
            assert 0 < len(acknowledged) < len(KEYS)
            refused = KEYS[len(acknowledged) : len(acknowledged) + 256]
            assert client.lookup("t", refused).prefix_length == 0
            assert client.stats().blocks == len(acknowledged)
            client.heartbeat("n", lease)  # a full journal does not cost the lease
    with running_server(tmp_path, lmdb_map_size_bytes=64 << 20) as server:
        with client_for(server) as client:
            assert client.stats().blocks == len(acknowledged)
            found = client.lookup("t", KEYS[: len(acknowledged) + 256]).prefix_length
            assert found == len(acknowledged)


def test_the_journal_is_opened_without_writemap(tmp_path):
    """writemap turns a full disk into SIGBUS; without it ENOSPC is a CapacityError."""
    index = MemoryIndex(tmp_path / "meta")
    assert index._journal._env.flags()["writemap"] is False
    index.close()
