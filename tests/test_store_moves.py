"""Moves between host and disk, narrated. Promotion: the block is read with the store lock
released, so a slow disk stalls only the worker that asked for the block; two workers asking
for the same block share one read; a corrupt block is purged and is a miss for both.
Demotion ahead of need: the next victims are written to disk with the lock released, until
enough host pages are free; a victim pinned meanwhile stays in the host tier too."""

import threading
import time
from contextlib import contextmanager

import pytest

from kvstore.block import HEADER_BYTES
from kvstore.eviction import make_policy
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import HostTier
from kvstore.tiers.throttled import ThrottledDiskTier

PAGE = 1024
READ_S = 0.6  # one block read from the slow disk
BLOCK_BYTES = HEADER_BYTES + 500
SLOW = int(BLOCK_BYTES / READ_S)  # bytes a second
NS = Namespace("sha256:promotion-test", "layout")
KEYS = chunk_keys(NS, range(64), 4)


class WatchedDisk(ThrottledDiskTier):
    """A disk that reads a block in READ_S (writes too, once `slow_writes`), and says when a
    read or a write starts."""

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, read_bytes_per_s=SLOW, **options)
        self.reading = threading.Event()
        self.writing = threading.Event()
        self.reads = self.writes = 0

    def slow_writes(self) -> None:
        self.write_bytes_per_s = SLOW

    def _put(self, key, block) -> None:
        self.writes += 1
        self.writing.set()
        super()._put(key, block)

    @contextmanager
    def open(self, key):
        self.reads += 1
        self.reading.set()
        with super().open(key) as view:
            yield view


@pytest.fixture
def store(tmp_path):
    """Six blocks of KEYS: 0 and 1 on the slow disk, 2..5 in a host tier of four pages."""
    made = TieredStore(
        [
            TierSlot(HostTier(4 * PAGE, PAGE), make_policy("lru")),
            TierSlot(WatchedDisk(tmp_path, 16 * PAGE, PAGE), make_policy("lru")),
        ]
    )
    parent = None
    for n in range(6):
        made.put(KEYS[n], parent, bytes([n]) * 500)
        parent = KEYS[n]
    assert [made.tier_of(key) for key in KEYS[:2]] == ["disk", "disk"]
    disk = made.slots[1].tier
    disk.reading.clear()
    disk.writing.clear()
    yield made
    made.close()


def pin_in_thread(store, key, results: list) -> threading.Thread:
    def pin() -> None:
        started = time.perf_counter()
        results.append((store.pin([key]), time.perf_counter() - started))

    thread = threading.Thread(target=pin)
    thread.start()
    return thread


def pin_twice_at_once(store, key) -> list[int]:
    """Two workers pin `key`, the second while the first's disk read is under way: the counts."""
    results: list = []
    first = pin_in_thread(store, key, results)
    assert store.slots[1].tier.reading.wait(5)
    second = pin_in_thread(store, key, results)
    first.join()
    second.join()
    return [pinned for pinned, _ in results]


def test_a_slow_disk_read_does_not_stall_other_workers(store):
    disk = store.slots[1].tier
    promoting: list = []
    thread = pin_in_thread(store, KEYS[0], promoting)
    assert disk.reading.wait(5)
    started = time.perf_counter()
    assert store.lookup(KEYS[2:6]) == 4  # another worker's lookup (host and disk)
    assert store.put(KEYS[6], KEYS[5], bytes([6]) * 500)  # and save
    assert store.pin(KEYS[6:7]) == 1  # and load of a host block
    others_s = time.perf_counter() - started
    thread.join()
    ((pinned, promotion_s),) = promoting
    assert pinned == 1 and promotion_s >= READ_S * 0.9
    assert others_s < READ_S / 3, f"other workers waited {others_s:.3f} s for the disk"
    assert store.tier_of(KEYS[0]) == "host"
    with store.read(KEYS[0]) as view:
        assert bytes(view.numpy()) == bytes([0]) * 500
    store.unpin([KEYS[0], KEYS[6]])
    assert store.pins_held() == 0


def test_two_workers_pinning_one_disk_block_share_one_read(store):
    disk = store.slots[1].tier
    assert pin_twice_at_once(store, KEYS[1]) == [1, 1]
    assert disk.reads == 1 and store.tier_of(KEYS[1]) == "host"
    assert store.pins_held() == 2
    store.unpin([KEYS[1]] * 2)
    assert store.pins_held() == 0


def test_a_corrupt_disk_block_is_a_miss_for_every_worker_waiting_on_it(store):
    disk = store.slots[1].tier
    with disk._env.begin(write=True) as txn:  # a flipped payload bit on the device
        stored = bytearray(txn.get(KEYS[0]))
        stored[-1] ^= 0xFF
        txn.put(KEYS[0], bytes(stored))
    assert pin_twice_at_once(store, KEYS[0]) == [0, 0]
    assert store.checksum_failures == 1 and store.tier_of(KEYS[0]) is None
    assert store.pins_held() == 0 and store.lookup(KEYS) == 0


def test_demotion_ahead_frees_host_pages_without_holding_the_lock(store):
    """Host: 2..5 (LRU order), full. Two pages wanted free: 2 and 3 are written down, one
    slow write at a time, while another worker's lookup and load go on."""
    disk = store.slots[1].tier
    disk.slow_writes()
    results: list = []
    thread = threading.Thread(target=lambda: results.append(store.demote_ahead(2)))
    thread.start()
    assert disk.writing.wait(5)
    started = time.perf_counter()
    assert store.lookup(KEYS[2:6]) == 4
    assert store.pin(KEYS[5:6]) == 1
    others_s = time.perf_counter() - started
    thread.join()
    assert results == [2] and others_s < READ_S / 3, f"waited {others_s:.3f} s for the disk"
    assert [store.tier_of(key) for key in KEYS[2:6]] == ["disk", "disk", "host", "host"]
    assert store.slots[0].tier.free_pages == 2
    assert store.demote_ahead(2) == 0, "enough pages free: nothing to do"
    with store.read(KEYS[2]) as view:  # from disk
        assert bytes(view.numpy()) == bytes([2]) * 500
    store.unpin(KEYS[5:6])


def test_a_victim_pinned_while_it_is_written_down_stays_in_host_too(store):
    disk = store.slots[1].tier
    disk.slow_writes()
    thread = threading.Thread(target=store.demote_ahead, args=(1,))
    thread.start()
    assert disk.writing.wait(5)
    assert store.pin(KEYS[2:3]) == 1  # the victim being written
    thread.join()
    assert store.tier_of(KEYS[2]) == "host" and KEYS[2] in disk, "pinned: in both tiers"
    assert store.tier_of(KEYS[3]) == "disk", "the next victim freed the page"
    store.unpin(KEYS[2:3])
    writes = disk.writes
    assert store.demote_ahead(4) == 2  # 4 and 5 written down; 2, already there, dropped
    assert disk.writes == writes + 2 and store.slots[0].tier.free_pages == 4
    assert [store.tier_of(key) for key in KEYS[:6]] == ["disk"] * 6


def test_a_pin_that_fails_on_a_broken_disk_leaves_no_pins(store, monkeypatch):
    """An unexpected error (not a bad checksum) while promoting the second key: pin raises,
    and the first key, already pinned, is unpinned too (the caller got no count)."""
    disk = store.slots[1].tier

    def broken_open(key):
        raise OSError("I/O error reading the disk tier")

    monkeypatch.setattr(disk, "open", broken_open)
    with pytest.raises(OSError, match="I/O error"):
        store.pin([KEYS[5], KEYS[0]])  # host, then disk
    assert store.pins_held() == 0
    assert store.tier_of(KEYS[0]) == "disk" and store.slots[0].tier.free_pages >= 0
    monkeypatch.undo()
    assert store.pin([KEYS[0]]) == 1, "the key promotes once the disk reads again"
    store.unpin([KEYS[0]])
