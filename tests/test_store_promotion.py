"""Promotion from disk to host, narrated: the block is read with the store lock released, so a
slow disk stalls only the worker that asked for the block; two workers asking for the same
block share one read; a corrupt block is purged and is a miss for both."""

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
NS = Namespace("sha256:promotion-test", "layout")
KEYS = chunk_keys(NS, range(64), 4)


class WatchedDisk(ThrottledDiskTier):
    """A slow disk that says when a read starts and counts reads."""

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, read_bytes_per_s=int(BLOCK_BYTES / READ_S), **options)
        self.reading = threading.Event()
        self.reads = 0

    @contextmanager
    def open(self, key):
        self.reads += 1
        self.reading.set()
        with super().open(key) as view:
            yield view


@pytest.fixture
def store(tmp_path):
    """Six blocks of KEYS: 0 and 1 on the slow disk, 2..5 in a host tier of four pages."""
    made = TieredStore([
        TierSlot(HostTier(4 * PAGE, PAGE), make_policy("lru")),
        TierSlot(WatchedDisk(tmp_path, 16 * PAGE, PAGE), make_policy("lru")),
    ])  # fmt: skip
    parent = None
    for n in range(6):
        made.put(KEYS[n], parent, bytes([n]) * 500)
        parent = KEYS[n]
    assert [made.tier_of(key) for key in KEYS[:2]] == ["disk", "disk"]
    yield made
    made.close()


def pin_in_thread(store, key, results: list) -> threading.Thread:
    def pin() -> None:
        started = time.perf_counter()
        results.append((store.pin([key]), time.perf_counter() - started))

    thread = threading.Thread(target=pin)
    thread.start()
    return thread


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
    results: list = []
    first = pin_in_thread(store, KEYS[1], results)
    assert disk.reading.wait(5)
    second = pin_in_thread(store, KEYS[1], results)
    first.join()
    second.join()
    assert [pinned for pinned, _ in results] == [1, 1]
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
    results: list = []
    first = pin_in_thread(store, KEYS[0], results)
    assert disk.reading.wait(5)
    second = pin_in_thread(store, KEYS[0], results)
    first.join()
    second.join()
    assert [pinned for pinned, _ in results] == [0, 0]
    assert store.checksum_failures == 1 and store.tier_of(KEYS[0]) is None
    assert store.pins_held() == 0 and store.lookup(KEYS) == 0
