"""Blocks of many sizes in one store, narrated: each takes the fewest whole pages of the arena
that hold it, a wide block evicts the coldest blocks around one victim (never everything), the
prefix-aware policy still evicts a chain's deepest blocks first, a block past the largest one
is refused with the setting to change, and blocks from peers give back the room they did not
use."""

import random

import pytest

from kvstore.block import HEADER_BYTES
from kvstore.errors import ConfigError
from kvstore.eviction import make_policy
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import DiskTier, HostTier

PAGE = 1024
SMALL = PAGE - HEADER_BYTES  # one page, header included
WIDE = 2 * PAGE - HEADER_BYTES  # two pages
A = chunk_keys(Namespace("sha256:model-a", "layout"), range(64), 4)
B = chunk_keys(Namespace("sha256:model-b", "layout"), range(64), 4)
C = chunk_keys(Namespace("sha256:model-c", "layout"), range(64), 4)


def store_of(pages: int, policy: str = "lru", max_block_pages: int = 4, disk=None) -> TieredStore:
    host = HostTier(pages * PAGE, PAGE, max_block_bytes=max_block_pages * PAGE)
    slots = [TierSlot(host, make_policy(policy))]
    if disk is not None:
        slots.append(TierSlot(disk, make_policy("lru")))
    return TieredStore(slots)


def put_chain(store, keys, payload_bytes, start=0):
    parent = keys[start - 1] if start else None
    for n in range(start, start + len(keys[start:])):
        assert store.put(keys[n], parent, pattern(n, payload_bytes))
        parent = keys[n]


def pattern(n: int, size: int) -> bytes:
    return bytes((n * 7 + i) % 251 for i in range(size))


def read(store, key):
    with store.read(key) as view:
        return None if view is None else bytes(view.numpy())


def test_blocks_of_three_sizes_share_one_arena_each_in_its_fewest_pages():
    with_store = store_of(12)
    put_chain(with_store, A[:2], SMALL)  # 1 page each
    put_chain(with_store, B[:2], WIDE)  # 2 pages each
    put_chain(with_store, C[:2], 3 * PAGE - HEADER_BYTES - 100)  # 3 pages each, 100 bytes spare
    usage = with_store.usage()["host"]
    assert usage["used_pages"] == 12 and usage["used_blocks"] == 6
    for keys, size in ((A, SMALL), (B, WIDE), (C, 3 * PAGE - HEADER_BYTES - 100)):
        assert [read(with_store, keys[n]) for n in range(2)] == [pattern(n, size) for n in range(2)]
    with_store.close()


def test_a_wide_block_evicts_the_coldest_blocks_around_one_victim_not_more():
    store = store_of(8)
    put_chain(store, A[:8], SMALL)  # full: A0..A7, one page each, oldest first in the arena
    store.pin(A[4:8])
    store.unpin(A[4:8])  # A4..A7 are hot
    put_chain(store, B[:1], 4 * PAGE - HEADER_BYTES)  # 4 pages: A0 is the victim
    assert [store.tier_of(k) for k in A[:8]] == [None] * 4 + ["host"] * 4
    assert store.removals["host"] == 4
    assert read(store, B[0]) == pattern(0, 4 * PAGE - HEADER_BYTES)
    store.close()


def test_prefix_aware_eviction_still_takes_a_chains_deepest_blocks_first():
    """Chain A (one page a block) is the coldest; a new two-page block evicts A's leaf and
    the parent next to it (the cheaper neighbour), never the hot chain B's."""
    store = store_of(8, policy="prefix-lru")
    put_chain(store, A[:4], SMALL)  # pages 0-3
    put_chain(store, B[:2], WIDE)  # pages 4-7
    store.pin(B[:2])
    store.unpin(B[:2])
    put_chain(store, C[:1], WIDE)
    assert [store.tier_of(k) for k in A[:4]] == ["host", "host", None, None]
    assert [store.tier_of(k) for k in B[:2]] == ["host", "host"]
    assert store.lookup(A[:4]) == 2  # the chain's prefix is whole
    store.close()


def test_victims_of_a_wide_block_are_demoted_to_disk_whole(tmp_path):
    disk = DiskTier(tmp_path / "disk", 64 * PAGE, PAGE, max_block_bytes=4 * PAGE)
    store = store_of(4, disk=disk)
    put_chain(store, A[:2], WIDE)
    put_chain(store, B[:1], 4 * PAGE - HEADER_BYTES)
    assert [store.tier_of(k) for k in A[:2]] == ["disk", "disk"]
    assert disk.used_pages == 4
    assert store.pin(A[:1]) == 1  # promoted back: B makes room, whole
    assert read(store, A[0]) == pattern(0, WIDE)
    store.unpin(A[:1])
    store.close()


def test_a_block_larger_than_the_largest_is_refused_with_the_setting_to_change():
    store = store_of(8, max_block_pages=2)
    with pytest.raises(ConfigError, match=r"largest block of 2048 bytes.*max_block_bytes"):
        store.reserve(A[0], None, 2 * PAGE)
    assert store.usage()["host"]["used_pages"] == 0
    store.close()


def test_a_largest_block_past_the_arena_or_under_a_page_is_refused():
    with pytest.raises(ConfigError, match="max_block_bytes"):
        HostTier(4 * PAGE, PAGE, max_block_bytes=5 * PAGE)
    with pytest.raises(ConfigError, match="max_block_bytes"):
        HostTier(4 * PAGE, PAGE, max_block_bytes=PAGE // 2)


def test_a_block_from_a_peer_gives_back_the_room_it_did_not_use():
    holder, store = store_of(8), store_of(8)
    put_chain(holder, A[:1], SMALL)
    page = store.reserve_page(A[0])
    assert page.numel() == 4 * PAGE  # its size is known once it lands
    with holder.open_block(A[0]) as sent:
        page[: sent.numel()].copy_(sent)
        assert store.commit_received(A[0], sent.numel())
    assert store.usage()["host"]["used_pages"] == 1
    assert read(store, A[0]) == pattern(0, SMALL)
    store.close()
    holder.close()


def test_many_sizes_interleaved_churn_without_errors_and_read_back_verified():
    """Four models' chains of four block sizes written in random turns into a small arena:
    every save finds room (by eviction), and every block still stored reads back as written."""
    rng = random.Random(3)
    store = store_of(64, max_block_pages=8)
    chains = {
        size: chunk_keys(Namespace(f"sha256:m{size}", "layout"), range(400), 4)
        for size in (SMALL, WIDE, 5 * PAGE - HEADER_BYTES - 17, 8 * PAGE - HEADER_BYTES)
    }
    written = dict.fromkeys(chains, 0)
    for _ in range(300):
        size = rng.choice(list(chains))
        keys, n = chains[size], written[size]
        assert store.put(keys[n], keys[n - 1] if n else None, pattern(n, size))
        written[size] += 1
    for size, keys in chains.items():
        for n in range(written[size]):
            if store.tier_of(keys[n]) is not None:
                assert read(store, keys[n]) == pattern(n, size)
    usage = store.usage()["host"]
    assert usage["used_pages"] >= 64 - 7  # at most one widest block's room left unused
    store.close()
