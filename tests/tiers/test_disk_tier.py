"""Disk tier scenarios: blocks survive a reopen, corruption is a miss, a killed writer leaves
no partial block, a full disk refuses one write, a corrupt environment is set aside, one tier
holds a directory at a time."""

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.events import EventKind
from kvstore.eviction import make_policy
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import DiskTier

PAGE = 1 << 16
NS = Namespace("sha256:test", "disk-test")
KEYS = chunk_keys(NS, range(16 * 4), 16)


def disk_store(path, capacity_bytes=64 * PAGE, page=PAGE):
    return TieredStore([TierSlot(DiskTier(path, capacity_bytes, page), make_policy("lru"))])


def payload(n: int, size: int = 1000) -> bytes:
    return bytes((n * 7 + i) % 256 for i in range(size))


def test_blocks_survive_closing_and_reopening(tmp_path):
    keys = chunk_keys(NS, range(40), 4)
    store = disk_store(tmp_path)
    parent = None
    for n, k in enumerate(keys):
        store.put(k, parent, payload(n))
        parent = k
    store.close()

    reopened = disk_store(tmp_path)
    assert reopened.lookup(keys) == len(keys)
    for n, k in enumerate(keys):
        with reopened.read(k) as view:
            assert bytes(view.numpy()) == payload(n)
    stored = [e for e in reopened.events.drain() if e.kind is EventKind.STORED]
    assert {e.key for e in stored} == set(keys), "a reopened tier announces what it holds"
    reopened.close()


def test_a_flipped_byte_on_disk_is_a_checksum_miss_and_the_block_is_purged(tmp_path):
    keys = chunk_keys(NS, range(8), 4)
    store = disk_store(tmp_path)
    store.put(keys[0], None, payload(0, 4000))
    store.put(keys[1], keys[0], payload(1, 4000))
    store.close()

    data_file = tmp_path / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    offset = raw.find(payload(1, 4000))
    assert offset > 0
    raw[offset + 1234] ^= 0xFF
    data_file.write_bytes(raw)

    reopened = disk_store(tmp_path)
    reopened.events.drain()
    with reopened.read(keys[1]) as view:
        assert view is None
    assert reopened.checksum_failures == 1
    assert reopened.lookup(keys) == 1, "the corrupt block is gone; its parent still serves"
    removed = reopened.events.drain()
    assert [(e.kind, e.key, e.tier) for e in removed] == [(EventKind.REMOVED, keys[1], "disk")]
    reopened.close()


_WRITER = textwrap.dedent(
    """
    import sys
    from kvstore.eviction import make_policy
    from kvstore.keys import BlockKey
    from kvstore.store import TieredStore, TierSlot
    from kvstore.tiers import DiskTier
    page = 8 << 20
    store = TieredStore([TierSlot(DiskTier(sys.argv[1], 400 * page, page), make_policy("lru"))])
    block = bytes(range(256)) * ((page - 4096) // 256)
    for n in range(400):
        store.put(BlockKey(n.to_bytes(16, "little")), None, block)
        print(n, flush=True)
    """
)


def test_a_writer_killed_mid_write_leaves_no_partial_block(tmp_path):
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    for _ in range(5):  # let it commit a few blocks, then kill it while it writes the next
        writer.stdout.readline()
    writer.send_signal(signal.SIGKILL)
    writer.wait()

    store = TieredStore(
        [TierSlot(DiskTier(tmp_path, 400 * (8 << 20), 8 << 20), make_policy("lru"))]
    )
    survivors = list(store.slots[0].tier.keys())
    assert 5 <= len(survivors) < 400
    for k in survivors:
        with store.read(k) as view:
            assert view is not None and view.numel() == (8 << 20) - 4096
    assert store.checksum_failures == 0
    store.close()


_FULL_DISK = textwrap.dedent("""
    import resource, sys, torch
    from kvstore.keys import BlockKey
    from kvstore.tiers import DiskTier
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))  # a disk that fills at 8 MiB
    tier = DiskTier(sys.argv[1], capacity_bytes=64 << 20, page_size_bytes=1 << 20)
    stored = []
    for i in range(64):
        key = BlockKey(i.to_bytes(16, "little"))
        try:
            tier.write(key, torch.full((1 << 20,), i % 251, dtype=torch.uint8))
        except OSError as exc:
            print("REFUSED", i, type(exc).__name__, flush=True)
            break
        stored.append(key)
    for i, key in enumerate(stored):
        with tier.open(key) as page:
            assert page is not None and int(page[0]) == i % 251
    print("KEPT", len(stored), flush=True)
""")


def test_a_full_disk_refuses_the_write_and_keeps_every_other_block(tmp_path):
    """LMDB wrote through a writable map of a sparse file: a page written when the disk was
    full killed the agent with SIGBUS. It writes through write(2) now: a full disk is an
    OSError (counted as a failed write-down), and every block stored before stays readable."""
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path / "disk")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout and int(done.stdout.split("KEPT")[1]) >= 4


def test_a_corrupt_environment_is_set_aside_and_the_tier_starts_empty(tmp_path):
    """An LMDB environment that reads as corrupt (a power loss without fsync) stopped the
    agent at start with a raw LMDB error; it is moved aside now, and the tier starts empty."""
    directory = tmp_path / "disk"
    tier = DiskTier(directory, capacity_bytes=8 << 20, page_size_bytes=1 << 20)
    tier.write(KEYS[0], torch.full((1000,), 7, dtype=torch.uint8))
    tier.close()
    (directory / "data.mdb").write_bytes(b"\xff" * 65536)  # not an LMDB file any more
    reopened = DiskTier(directory, capacity_bytes=8 << 20, page_size_bytes=1 << 20)
    try:
        assert KEYS[0] not in reopened and reopened.used_pages == 0
        aside = list(directory.glob("corrupt-*/data.mdb"))
        assert len(aside) == 1 and aside[0].read_bytes() == b"\xff" * 65536
        reopened.write(KEYS[1], torch.full((1000,), 8, dtype=torch.uint8))
        with reopened.open(KEYS[1]) as page:
            assert int(page[0]) == 8
    finally:
        reopened.close()


def test_a_directory_is_held_by_one_tier_at_a_time(tmp_path):
    """Two agents on one disk_dir (a rolling restart) kept separate key sets and capacity
    counts over one environment; the second is refused while the first holds it."""
    first = DiskTier(tmp_path / "disk", capacity_bytes=8 << 20, page_size_bytes=1 << 20)
    with pytest.raises(ConfigError, match="in use by another agent"):
        DiskTier(tmp_path / "disk", capacity_bytes=8 << 20, page_size_bytes=1 << 20)
    first.close()
    DiskTier(tmp_path / "disk", capacity_bytes=8 << 20, page_size_bytes=1 << 20).close()


def test_a_tier_dropped_without_close_frees_its_directory(tmp_path):
    import gc

    tier = DiskTier(tmp_path / "disk", capacity_bytes=8 << 20, page_size_bytes=1 << 20)
    tier._env.close()  # as a process that lost the tier without closing it
    del tier
    gc.collect()
    DiskTier(tmp_path / "disk", capacity_bytes=8 << 20, page_size_bytes=1 << 20).close()


def test_the_disk_tier_imports_with_an_lmdb_before_3(monkeypatch):
    """lmdb.BadChecksumError exists from lmdb 3.0 only; pyproject allows lmdb >= 1.4."""
    import importlib

    import lmdb

    import kvstore.tiers.disk as disk

    monkeypatch.delattr(lmdb, "BadChecksumError", raising=False)
    try:
        assert lmdb.CorruptedError in importlib.reload(disk)._CORRUPT
    finally:
        monkeypatch.undo()
        importlib.reload(disk)
