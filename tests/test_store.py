"""The node-local store, narrated: writes, longest-prefix lookups, pins, demotion to disk,
promotion on hit, events, and corruption handled as a miss."""

import threading
import time

import pytest

from kvstore.block import HEADER_BYTES
from kvstore.errors import CapacityError, ConfigError, NotFoundError
from kvstore.events import EventKind
from kvstore.eviction import make_policy
from kvstore.keys import Namespace, chunk_keys
from kvstore.owned import owned_key, owned_keys
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import DiskTier, HostTier

PAGE = 1024
NS = Namespace("sha256:store-test", "layout")
KEYS = chunk_keys(NS, range(64), 4)  # 16 chained keys


def payload(n: int) -> bytes:
    return bytes([n % 256]) * 500


@pytest.fixture
def store(tmp_path):
    made = TieredStore(
        [
            TierSlot(HostTier(4 * PAGE, PAGE), make_policy("lru")),
            TierSlot(DiskTier(tmp_path, 8 * PAGE, PAGE), make_policy("lru")),
        ]
    )
    yield made
    made.close()


def put_chain(store, count, start=0):
    parent = KEYS[start - 1] if start else None
    for n in range(start, start + count):
        store.put(KEYS[n], parent, payload(n))
        parent = KEYS[n]


def read(store, key):
    with store.read(key) as view:
        return None if view is None else bytes(view.numpy())


def test_lookup_is_the_longest_prefix_across_tiers(store):
    put_chain(store, 6)  # 4 fit on host: the two oldest were demoted to disk
    assert [store.tier_of(k) for k in KEYS[:6]] == ["disk"] * 2 + ["host"] * 4
    assert store.lookup(KEYS) == 6
    assert store.lookup(KEYS[:3]) == 3
    assert store.lookup(KEYS[1:]) == 5
    assert store.lookup([KEYS[7], *KEYS[:6]]) == 0
    assert all(read(store, KEYS[n]) == payload(n) for n in range(6))


def test_lookup_has_no_side_effects(store):
    put_chain(store, 6)
    before = [store.tier_of(k) for k in KEYS[:6]]
    store.lookup(KEYS)
    assert [store.tier_of(k) for k in KEYS[:6]] == before
    assert store.pins_held() == 0


def test_pinning_a_disk_block_promotes_it_to_host(store):
    put_chain(store, 6)
    assert store.pin(KEYS[:1]) == 1
    assert store.tier_of(KEYS[0]) == "host"
    assert read(store, KEYS[0]) == payload(0)
    store.unpin(KEYS[:1])


def test_pinned_blocks_are_never_evicted(store):
    put_chain(store, 4)
    assert store.pin(KEYS[:4]) == 4
    with pytest.raises(CapacityError, match="pinned"):
        store.put(KEYS[4], KEYS[3], payload(4))
    assert [store.tier_of(k) for k in KEYS[:4]] == ["host"] * 4
    store.unpin(KEYS[:4])
    store.put(KEYS[4], KEYS[3], payload(4))
    assert store.lookup(KEYS) == 5


def test_disk_evicts_to_nothing_when_full(store):
    put_chain(store, 14)  # 4 host + 8 disk = 12 blocks of room
    assert store.lookup(KEYS[2:14]) == 12
    assert store.tier_of(KEYS[0]) is None and store.tier_of(KEYS[1]) is None


def test_a_reserved_block_is_invisible_until_committed_and_abort_frees_it(store):
    view = store.reserve(KEYS[0], None, 100)
    view.fill_(9)
    assert store.lookup(KEYS[:1]) == 0 and read(store, KEYS[0]) is None
    assert store.reserve(KEYS[0], None, 100) is None, "a second writer backs off"
    store.commit(KEYS[0])
    assert read(store, KEYS[0]) == bytes([9]) * 100
    assert store.reserve(KEYS[0], None, 100) is None, "already stored: nothing to write"

    store.reserve(KEYS[1], KEYS[0], 100)
    store.abort(KEYS[1])
    assert store.lookup(KEYS[:2]) == 1
    with pytest.raises(NotFoundError):
        store.commit(KEYS[1])


def test_events_report_every_store_and_removal_with_its_tier(store):
    put_chain(store, 5)
    events = store.events.drain()
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    summary = [(e.kind, KEYS.index(e.key), e.tier) for e in events]
    assert summary[:4] == [(EventKind.STORED, n, "host") for n in range(4)]
    assert summary[4:] == [
        (EventKind.STORED, 0, "disk"),
        (EventKind.REMOVED, 0, "host"),
        (EventKind.STORED, 4, "host"),
    ]
    assert events[0].size_bytes == HEADER_BYTES + 500


def test_a_host_page_holding_another_key_reads_as_a_miss(store):
    put_chain(store, 2)
    host = store.slots[0].tier
    host.pages[host.page_index(KEYS[1]), 8:24] = 0  # clobber the key in the header
    assert read(store, KEYS[1]) is None
    assert store.checksum_failures == 1 and store.lookup(KEYS) == 1


def test_payload_larger_than_a_page_is_rejected_with_sizes(store):
    with pytest.raises(ConfigError, match="does not fit a host page of 1024"):
        store.reserve(KEYS[0], None, PAGE)


def test_remove_drops_unpinned_blocks_from_every_tier(store):
    put_chain(store, 6)
    store.pin(KEYS[5:6])
    store.events.drain()
    assert store.remove([KEYS[0], KEYS[4], KEYS[5], KEYS[9]]) == 2
    assert [store.tier_of(k) for k in (KEYS[0], KEYS[4], KEYS[5])] == [None, None, "host"]
    assert [(e.kind, e.key) for e in store.events.drain()] == [
        (EventKind.REMOVED, KEYS[0]),
        (EventKind.REMOVED, KEYS[4]),
    ]


def test_a_bad_tenant_takes_no_page(store):
    """Regression: reserve() validated the tenant after taking a page, which then leaked."""
    with pytest.raises(ConfigError, match="tenant"):
        store.reserve(owned_key("x" * 65, KEYS[0]), None, 100)
    assert store.usage()["host"]["used_pages"] == 0
    assert store.reserve(KEYS[0], None, 100) is not None


def test_a_received_block_stays_unreservable_until_it_is_decided(store):
    """Regression: commit_received released its pending entry before verifying."""
    page = store.reserve_page(KEYS[0])
    assert store.reserve(KEYS[0], None, 10) is None and store.reserve_page(KEYS[0]) is None
    assert store.commit_received(KEYS[0], 50) is False  # garbage: discarded, page freed
    assert store.usage()["host"]["used_pages"] == 0 and page is not None


def test_a_waiter_for_a_received_block_learns_as_soon_as_it_is_decided(store):
    """await_arrival: a block being received is waited for, and a failed one is a prompt
    False (the waiter does not sit out its timeout); a block never on its way is not."""
    store.reserve_page(KEYS[0])
    threading.Timer(0.2, store.abort, (KEYS[0],)).start()
    started = time.monotonic()
    assert store.await_arrival(KEYS[0], timeout_s=10) is False
    assert 0.15 < time.monotonic() - started < 5
    put_chain(store, 1)
    assert store.await_arrival(KEYS[0], timeout_s=10) is True
    started = time.monotonic()
    assert store.await_arrival(KEYS[1], timeout_s=10) is False  # not on its way: no wait
    assert time.monotonic() - started < 1


def test_lookup_slots_name_each_leading_key_s_fastest_slot_and_stop_at_another_tenant(store):
    a, b = (lambda keys: owned_keys("a", keys)), (lambda keys: owned_keys("b", keys))

    def stored(key, parent):
        store.reserve(key, parent, 100).fill_(1)
        store.commit(key)

    for n in range(6):
        stored(a(KEYS)[n], a(KEYS)[n - 1] if n else None)
    stored(b(KEYS)[6], b(KEYS)[5])  # 4 fit on host: a's KEYS[:3] went down to disk
    assert store.lookup_slots(a(KEYS[3:6])) == bytes(3)  # all on host: slot 0
    assert store.lookup_slots(a(KEYS[:6])) == bytes([1, 1, 1, 0, 0, 0])
    assert store.lookup_slots(a(KEYS[3:8])) == bytes(3)  # KEYS[6] is b's: absent for a
    assert store.lookup_slots(b(KEYS[6:7])) == bytes(1)
    assert store.lookup_slots(a(KEYS[6:7])) == b""
    assert store.lookup_slots(KEYS[:7]) == b""  # the default tenant's: none
    assert store.lookup_slots([]) == b""
