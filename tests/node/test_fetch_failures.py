"""A load whose fetch fails part-way gives back everything it took, and returns within its
deadline: pages reserved before a reservation raised (a victim's write to a failing disk),
the local prefix's pins when pinning the fetched part raises, and the metadata service's
answers (before the fetch, and in the view's correction after a failed one) inside the
load's timeout. A real store over a disk that fails on demand; stand-in holder and service.
"""

import errno
import time

import pytest
import torch

from kvstore.eviction import make_policy
from kvstore.keys import Namespace, chunk_keys
from kvstore.metadata.client import LookupResult
from kvstore.metadata.index import Holding
from kvstore.node.identity import ALL_TENANTS, PeerCredentials, WorkerIdentity
from kvstore.node.remote import RemoteFetcher
from kvstore.node.session import RequestCounters, WorkerSession
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import HostTier
from kvstore.tiers.disk import DiskTier

PAGE = 1024
KEYS = chunk_keys(Namespace("sha256:review-fetch", "layout"), range(12), 4)
OTHER = chunk_keys(Namespace("sha256:review-other", "layout"), range(4), 4)


class FailingDisk(DiskTier):
    """A disk tier whose writes fail with an I/O error once `fail` is set (EIO, a dying
    device, an LMDB error other than MapFull: anything but CapacityError)."""

    fail = False

    def _put(self, key, block):
        if self.fail:
            raise OSError(errno.EIO, "Input/output error (simulated)")
        super()._put(key, block)


def host_store(pages: int = 8) -> TieredStore:
    return TieredStore([TierSlot(HostTier(pages * PAGE, PAGE), make_policy("lru"))])


def holder_with(keys) -> TieredStore:
    holder = host_store(16)
    for index, key in enumerate(keys):
        holder.put(key, keys[index - 1] if index else None, bytes([index + 1]) * 500)
    return holder


def copy_block(holder: TieredStore, key, page: torch.Tensor) -> int:
    with holder.open_block(key) as data:
        if data is None:
            return 0
        page[: data.numel()].copy_(data)
        return data.numel()


class HolderEngine:
    name = "tcp"

    def __init__(self, holder: TieredStore) -> None:
        self.holder = holder
        self.fetched: list[bytes] = []

    def fetch(self, address, tenant, keys, pages, timeout_s, checksums):
        self.fetched.extend(keys)
        return [copy_block(self.holder, key, page) for key, page in zip(keys, pages, strict=True)]


class EveryKeyOnTheHolder:
    def plan(self, tenant, keys, ucx):
        return [("holder", "127.0.0.1:1")] * len(keys)

    def forget(self, tenant, keys, node_id):
        pass

    def learn_addresses(self, addresses):
        pass


# ---- 1. a reservation leaked when reserve_page raises anything but CapacityError --------------
def test_reserved_pages_are_freed_when_a_later_reservation_raises(tmp_path):
    """Reserving the 2nd key evicts a victim whose demotion to disk fails with an I/O error:
    the 1st key's page, reserved already, is given back (it was left pending, its `arrived`
    never set, the key unreservable for good)."""
    holder = holder_with(KEYS[:2])
    disk = FailingDisk(tmp_path / "disk", 8 * PAGE, PAGE)
    reader = TieredStore(
        [
            TierSlot(HostTier(2 * PAGE, PAGE), make_policy("lru")),
            TierSlot(disk, make_policy("lru")),
        ]
    )
    try:
        reader.put(OTHER[0], None, b"x" * 500)  # 1 of the 2 host pages in use, evictable
        fetcher = RemoteFetcher(reader, None, HolderEngine(holder), "reader", EveryKeyOnTheHolder())
        disk.fail = True
        with pytest.raises(OSError):
            fetcher.fetch("default", KEYS[:2], timeout_s=2)
        disk.fail = False  # the disk recovered (or the error was transient)

        # every page reserved by the failed fetch should have been given back
        page = reader.reserve_page(KEYS[0])
        assert page is not None, "KEYS[0] left reserved by the failed fetch"
        reader.abort(KEYS[0])

    finally:
        holder.close()
        reader.close()


def test_a_load_after_a_failed_fetch_is_not_stuck_on_its_leaked_reservation(tmp_path):
    """After that failure a load of KEYS[0] fetches it at once (a leaked reservation made
    every later load wait its whole deadline for an arrival no one would announce)."""
    holder = holder_with(KEYS[:2])
    disk = FailingDisk(tmp_path / "disk", 8 * PAGE, PAGE)
    reader = TieredStore(
        [
            TierSlot(HostTier(2 * PAGE, PAGE), make_policy("lru")),
            TierSlot(disk, make_policy("lru")),
        ]
    )
    try:
        reader.put(OTHER[0], None, b"x" * 500)
        fetcher = RemoteFetcher(reader, None, HolderEngine(holder), "reader", EveryKeyOnTheHolder())
        disk.fail = True
        with pytest.raises(OSError):
            fetcher.fetch("default", KEYS[:2], timeout_s=2)
        disk.fail = False

        started = time.monotonic()
        fetched = fetcher.fetch("default", KEYS[:1], timeout_s=1.0)
        waited = time.monotonic() - started
        assert (fetched, waited < 0.5) == (1, True), (
            f"a fresh load of KEYS[0] fetched {fetched} block(s) after waiting {waited:.2f} s"
        )
    finally:
        holder.close()
        reader.close()


# ---- 2. the local prefix's pins leak when the second _pin_in_arena raises --------------------
def test_local_pins_are_released_when_pinning_the_fetched_part_raises(tmp_path):
    """KEYS[0] is in the arena, KEYS[1] on this node's disk (no room to promote it on the
    first pin: another worker pinned the other page). That worker releases its load while
    this load's fetch runs; the fetch finds KEYS[1] stored (joined), and the second pin
    promotes it, evicting the released block, whose demotion hits a disk I/O error. The load
    raises, and KEYS[0] is unpinned (it stayed pinned under no load id, never evictable)."""
    holder = holder_with(KEYS[:2])
    disk = FailingDisk(tmp_path / "disk", 8 * PAGE, PAGE)
    with holder.open_block(KEYS[1]) as whole:  # KEYS[1] already on this node's disk
        disk.write(KEYS[1], whole.clone())
    reader = TieredStore(
        [
            TierSlot(HostTier(2 * PAGE, PAGE), make_policy("lru")),
            TierSlot(disk, make_policy("lru")),
        ]
    )
    try:
        assert reader.tier_of(KEYS[1]) == "disk"
        reader.put(KEYS[0], None, bytes([1]) * 500)
        reader.put(OTHER[0], None, b"x" * 500)
        assert reader.pin([OTHER[0]]) == 1  # another worker's load: the arena is full, pinned

        class ViewWhileAnotherWorkerReleases(EveryKeyOnTheHolder):
            def plan(self, tenant, keys, ucx):
                reader.unpin([OTHER[0]])  # the other worker releases its load meanwhile
                return super().plan(tenant, keys, ucx)

        fetcher = RemoteFetcher(
            reader, None, HolderEngine(holder), "reader", ViewWhileAnotherWorkerReleases()
        )
        identity = WorkerIdentity(PeerCredentials(0, 0, 0), frozenset({ALL_TENANTS}), "test")
        session = WorkerSession(reader, fetcher, RequestCounters(), identity, 64)
        disk.fail = True
        with pytest.raises(OSError):
            session.load("default", KEYS[:2], timeout_s=1)
        disk.fail = False
        session.close()
        assert reader.pins_held() == 0, f"{reader.pins_held()} pin(s) leaked"
    finally:
        holder.close()
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
