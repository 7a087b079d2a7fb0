"""Loads and saves that meet a fault: a load whose fetch fails part-way gives back the pages
it reserved and the pins it took, and returns within its deadline, the metadata service's
answers included (before the fetch, and in the view's correction after a failed one); a
disk that fails to store an evicted block costs a miss, never a failed save (a failed read
raises, the block kept: see test_store_moves.py). Real stores (host arena, LMDB disk that
fails on demand); stand-in holder, view and service.
"""

import errno
import itertools
import logging
import time

import pytest

from kvstore.eviction import make_policy
from kvstore.keys import Namespace, chunk_keys
from kvstore.metadata.client import LookupResult
from kvstore.metadata.records import Holding
from kvstore.node.identity import ALL_TENANTS, PeerCredentials, WorkerIdentity
from kvstore.node.remote import RemoteFetcher
from kvstore.node.session import RequestCounters, WorkerSession
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import HostTier
from kvstore.tiers.disk import DiskTier
from tests.node.test_fetch_join import EveryKeyOnTheHolder, HolderEngine, host_store

PAGE = 1024
KEYS = chunk_keys(Namespace("sha256:fetch-failures", "layout"), range(24), 4)


class FailingDisk(DiskTier):
    """A disk tier whose writes fail with an I/O error while `fail` is set (EIO, a dying
    device, an LMDB error other than MapFull: anything but CapacityError)."""

    fail = False

    def _put(self, key, block):
        if self.fail:
            raise OSError(errno.EIO, "Input/output error (simulated)")
        super()._put(key, block)


def failing_on_call(method, call: int):
    """`method`, raising RuntimeError on its `call`-th call (a fault deep in the store)."""
    calls = itertools.count(1)

    def wrapped(*args, **kwargs):
        if next(calls) == call:
            raise RuntimeError("injected fault")
        return method(*args, **kwargs)

    return wrapped


def host_and_disk(tmp_path, host_pages: int = 2) -> tuple[TieredStore, FailingDisk]:
    disk = FailingDisk(tmp_path / "disk", 8 * PAGE, PAGE)
    host = TierSlot(HostTier(host_pages * PAGE, PAGE), make_policy("lru"))
    return TieredStore([host, TierSlot(disk, make_policy("lru"))]), disk


def holder_with(keys) -> TieredStore:
    holder = host_store(16)
    for index, key in enumerate(keys):
        holder.put(key, keys[index - 1] if index else None, bytes([index + 1]) * 500)
    return holder


# ---- a fault while reserving or pinning gives back what the load took ---------------------
def test_reserved_pages_are_given_back_when_a_later_reservation_raises():
    """The 2nd key's reservation raises: the 1st key's page, reserved already, is given back
    (it stayed pending, its arrival never announced, the key unreservable for good), and a
    later load fetches that key at once instead of waiting its deadline for it."""
    holder, reader = holder_with(KEYS[:2]), host_store()
    try:
        fetcher = RemoteFetcher(reader, None, HolderEngine(holder), "reader", EveryKeyOnTheHolder())
        reader.reserve_page = failing_on_call(reader.reserve_page, 2)
        with pytest.raises(RuntimeError):
            fetcher.fetch("default", KEYS[:2], timeout_s=2)
        started = time.monotonic()
        fetched = fetcher.fetch("default", KEYS[:1], timeout_s=1.0)
        waited = time.monotonic() - started
        assert (fetched, waited < 0.5) == (1, True), (
            f"a fresh load of KEYS[0] fetched {fetched} block(s) after waiting {waited:.2f} s"
        )
    finally:
        holder.close()
        reader.close()


def test_local_pins_are_released_when_pinning_the_fetched_part_raises():
    """KEYS[0] is in the arena, KEYS[1] is fetched; pinning it raises: the load fails with
    KEYS[0] unpinned (it stayed pinned under no load id, never evictable again)."""
    holder, reader = holder_with(KEYS[:2]), host_store()
    try:
        reader.put(KEYS[0], None, bytes([1]) * 500)
        fetcher = RemoteFetcher(reader, None, HolderEngine(holder), "reader", EveryKeyOnTheHolder())
        identity = WorkerIdentity(PeerCredentials(0, 0, 0), frozenset({ALL_TENANTS}), "test")
        session = WorkerSession(reader, fetcher, RequestCounters(), identity, 64)
        reader.pin = failing_on_call(reader.pin, 2)  # the 1st pins KEYS[0], the 2nd KEYS[1]
        with pytest.raises(RuntimeError):
            session.load("default", KEYS[:2], timeout_s=1)
        session.close()
        assert reader.pins_held() == 0, f"{reader.pins_held()} pin(s) leaked"
    finally:
        holder.close()
        reader.close()


# ---- a disk that fails to store a victim costs a miss, never a failed save ----------------
def test_a_victim_the_disk_fails_to_store_is_evicted_and_the_save_goes_on(tmp_path, caplog):
    reader, disk = host_and_disk(tmp_path)
    try:
        reader.put(KEYS[0], None, bytes([1]) * 500)
        reader.put(KEYS[1], KEYS[0], bytes([2]) * 500)
        disk.fail = True
        with caplog.at_level(logging.WARNING, logger="kvstore.store_ledger"):
            reader.put(KEYS[2], KEYS[1], bytes([3]) * 500)  # evicts KEYS[0]: its write fails
            reader.put(KEYS[3], KEYS[2], bytes([4]) * 500)
        assert reader.tier_of(KEYS[0]) is None and reader.tier_of(KEYS[3]) == "host"
        assert reader.write_failures == 2 and len(caplog.records) == 2  # the 1st, the 2nd
    finally:
        reader.close()


# ---- 3. the load's deadline does not bound its metadata lookups -----------------------------
class SlowLink:
    """The metadata service, answering in `delay_s` (its RPC timeout is 5 s)."""

    def __init__(self, delay_s: float, keys) -> None:
        self.delay_s = delay_s
        self.keys = keys
        self.calls = 0

    def lookup(self, tenant, keys, timeout_s=None):
        """Like MetadataLink.lookup: None when the answer does not come within `timeout_s`."""
        self.calls += 1
        if timeout_s is not None and timeout_s < self.delay_s:
            time.sleep(max(timeout_s, 0))
            return None
        time.sleep(self.delay_s)
        holders = [[Holding("holder", "host")] for _ in keys]
        return LookupResult(len(keys), holders, {"holder": ("127.0.0.1:1", "")})


class UnresponsiveEngine:
    """A holder that never answers: the fetch times out at the deadline it is given."""

    name = "tcp"

    def fetch(self, address, tenant, keys, pages, timeout_s, checksums):
        time.sleep(timeout_s)
        return [0] * len(keys)


def test_a_fetch_without_a_view_answer_returns_within_its_timeout():
    """The service's answer on the holders (the view cannot answer) counts against the
    load's timeout (it came on top of it)."""
    reader = host_store()
    try:
        fetcher = RemoteFetcher(reader, SlowLink(0.6, KEYS), UnresponsiveEngine(), "reader", None)
        started = time.monotonic()
        fetcher.fetch("default", KEYS[:2], timeout_s=0.3)
        elapsed = time.monotonic() - started
        assert elapsed < 0.3 + 0.15, f"a fetch with a 0.3 s timeout took {elapsed:.2f} s"
    finally:
        reader.close()


def test_a_failed_fetch_returns_within_its_timeout():
    """After a fetch that timed out at the deadline, the view's correction does not ask the
    service past that deadline (it asked for up to the 5 s RPC timeout)."""
    reader = host_store()
    try:
        link = SlowLink(0.6, KEYS)
        fetcher = RemoteFetcher(reader, link, UnresponsiveEngine(), "reader", EveryKeyOnTheHolder())
        started = time.monotonic()
        assert fetcher.fetch("default", KEYS[:2], timeout_s=0.3) == 0
        elapsed = time.monotonic() - started
        assert elapsed < 0.3 + 0.15, f"a fetch with a 0.3 s timeout took {elapsed:.2f} s"
    finally:
        reader.close()
